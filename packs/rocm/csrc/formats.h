// Number formats: the 16-bit MFMA operand types and the FP8 cache encodings, with exact conversions.
//
// FP8 follows hal/fp8.py: real = decode(byte) * scale; stored = encode(saturate(x / scale)), round to
// nearest even, saturating to the largest finite value for every encoding, NaN staying NaN. gfx942
// converts its fnuz encodings with v_cvt_pk_f32_fp8 / v_cvt_pk_fp8_f32 (and the bf8 forms); every other
// (arch, encoding) pair uses the exact software conversions below. A byte is only ever read in the
// encoding the cache's dtype names: e4m3fn bytes are never fed to the fnuz instructions.
#pragma once
#include "mini_hip.h"

// ---- 16-bit operand types (what the MFMA multiplies) ----
struct F16 {
  static HAL_DEV u16 from_f32(float x) { return hal_f32_to_f16(x); }  // round to nearest even
  static HAL_DEV float to_f32(u16 h) { return hal_f16_to_f32(h); }
  static HAL_DEV f32x4 mfma(u16x4 a, u16x4 b, f32x4 c) { return hal_mfma_f16(a, b, c); }
};

struct BF16 {
  static HAL_DEV u16 from_f32(float x) {  // round to nearest even; NaN -> 0x7fc0 (as torch converts)
    if (hal_isnan(x)) return 0x7fc0;
    u32 u = __builtin_bit_cast(u32, x);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
  }
  static HAL_DEV float to_f32(u16 h) { return __builtin_bit_cast(float, (u32)h << 16); }
  static HAL_DEV f32x4 mfma(u16x4 a, u16x4 b, f32x4 c) { return hal_mfma_bf16(a, b, c); }
};

struct F32 {};  // cache_kv input only

// ---- FP8 encodings (bit layouts as in hal/fp8.py) ----
template <int MBITS, int BIAS, bool FNUZ, int MAX_BYTE, int NAN_BYTE, bool HAS_INF>
struct Fp8 {
  static constexpr int kM = MBITS, kBias = BIAS, kMaxByte = MAX_BYTE, kNanByte = NAN_BYTE;
  static constexpr bool kFnuz = FNUZ, kHasInf = HAS_INF;
  // largest finite value: (2^M + mantissa) * 2^(exponent - bias - M) of MAX_BYTE
  static constexpr float kMax = (float)((1 << MBITS) + (MAX_BYTE & ((1 << MBITS) - 1))) *
                                (float)(1ull << (MAX_BYTE >> MBITS)) / (float)(1ull << (BIAS + MBITS));
};
using E4m3fn = Fp8<3, 7, false, 0x7e, 0x7f, false>;      // max 448
using E4m3fnuz = Fp8<3, 8, true, 0x7f, 0x80, false>;     // max 240
using E5m2 = Fp8<2, 15, false, 0x7b, 0x7f, true>;        // max 57344, +-inf at 0x7c / 0xfc, NaN written as 0x7f
using E5m2fnuz = Fp8<2, 16, true, 0x7f, 0x80, false>;    // max 57344
static_assert(E4m3fn::kMax == 448.0f && E4m3fnuz::kMax == 240.0f && E5m2::kMax == 57344.0f &&
              E5m2fnuz::kMax == 57344.0f, "FP8 maxima");

// Whether this build converts ENC with the hardware instructions (gfx942 and its fnuz encodings).
template <class ENC> constexpr bool kHwFp8 = HAL_FP8_FNUZ_HW && ENC::kFnuz;

// Exact software decode: value = mant * 2^(max(e, 1) - bias - M), mant = m | (e != 0) << M.
// Every value is a normal float, so no denormal mode can change it.
template <class ENC> HAL_DEV float fp8_decode_sw(u32 byte) {
  u32 mag = byte & 0x7fu;
  u32 e = mag >> ENC::kM, m = mag & ((1u << ENC::kM) - 1u);
  u32 mant = m | (e != 0 ? (1u << ENC::kM) : 0u);
  int k = (int)(e != 0 ? e : 1u) - ENC::kBias - ENC::kM;
  float v = (float)mant * hal_pow2i(k);
  if (byte & 0x80u) v = -v;
  if (ENC::kFnuz) {
    if (byte == 0x80u) v = __builtin_nanf("");
  } else if (ENC::kHasInf) {  // e5m2: exponent 31 is inf (m == 0) or NaN
    if (e == 31u) v = m ? __builtin_nanf("") : ((byte & 0x80u) ? -__builtin_inff() : __builtin_inff());
  } else if (mag == 0x7fu) {  // e4m3fn: S.1111.111 is NaN
    v = __builtin_nanf("");
  }
  return v;
}

// Four bytes of a little-endian word -> four floats.
template <class ENC> HAL_DEV void fp8x4_decode(u32 w, float* f) {
#if HAL_FP8_FNUZ_HW
  if constexpr (kHwFp8<ENC>) {
    f32x2 lo, hi;
    if constexpr (ENC::kM == 3) {
      lo = hal_cvt_pk_f32_fp8<false>(w);
      hi = hal_cvt_pk_f32_fp8<true>(w);
    } else {
      lo = hal_cvt_pk_f32_bf8<false>(w);
      hi = hal_cvt_pk_f32_bf8<true>(w);
    }
    f[0] = lo[0];
    f[1] = lo[1];
    f[2] = hi[0];
    f[3] = hi[1];
    return;
  }
#endif
  #pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = fp8_decode_sw<ENC>((w >> (8 * i)) & 0xffu);
}

// Exact software encode: saturate, then round to nearest even in the binade
// E = max(floor(log2 |x|), 1 - bias): byte = ((E + bias - 1) << M) + rint(|x| * 2^(M - E)).
// A mantissa that rounds up to 2^(M+1) carries into the exponent by the same sum.
template <class ENC> HAL_DEV u32 fp8_encode_sw(float x) {
  if (hal_isnan(x)) return (u32)ENC::kNanByte;
  u32 sign = (__builtin_bit_cast(u32, x) >> 24) & 0x80u;
  float a = hal_fabsf(x);
  a = a < ENC::kMax ? a : ENC::kMax;  // saturate (infinities too)
  int E = (int)((__builtin_bit_cast(u32, a) >> 23) & 0xffu) - 127;
  E = E > 1 - ENC::kBias ? E : 1 - ENC::kBias;
  float r = __builtin_rintf(a * hal_pow2i(ENC::kM - E));
  u32 mag = ((u32)(E + ENC::kBias - 1) << ENC::kM) + (u32)r;
  if (ENC::kFnuz && mag == 0) sign = 0;  // fnuz has no -0: 0x80 is its NaN
  return sign | mag;
}

// Four floats -> four bytes of a word (byte i from f[i]).
template <class ENC> HAL_DEV u32 fp8x4_encode(const float* f) {
#if HAL_FP8_FNUZ_HW
  if constexpr (kHwFp8<ENC>) {
    // v_cvt_pk_fp8_f32 rounds to nearest even; saturation is done here (NaN kept), and any 0x80 byte
    // (fnuz NaN) that did not come from a NaN is written as 0x00: the ISA guide does not promise
    // either behaviour of the instruction itself.
    float c[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = hal_isnan(f[i]) ? f[i] : (f[i] > ENC::kMax ? ENC::kMax : (f[i] < -ENC::kMax ? -ENC::kMax : f[i]));
    u32 w;
    if constexpr (ENC::kM == 3) {
      w = hal_cvt_pk_fp8_f32<false>(c[0], c[1], 0u);
      w = hal_cvt_pk_fp8_f32<true>(c[2], c[3], w);
    } else {
      w = hal_cvt_pk_bf8_f32<false>(c[0], c[1], 0u);
      w = hal_cvt_pk_bf8_f32<true>(c[2], c[3], w);
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i)
      if (((w >> (8 * i)) & 0xffu) == 0x80u && !hal_isnan(f[i])) w &= ~(0xffu << (8 * i));
    return w;
  }
#endif
  u32 w = 0;
  #pragma unroll
  for (int i = 0; i < 4; ++i) w |= fp8_encode_sw<ENC>(f[i]) << (8 * i);
  return w;
}

// ---- cache element kinds (the kernels' CACHE template parameter) ----
template <class T16> struct Cache16 {  // float16 / bfloat16 cache: elements are the operand type
  static constexpr bool kFp8 = false;
  static constexpr int kBytes = 2;
  using Operand = T16;
};
template <class ENC> struct CacheFp8 {
  static constexpr bool kFp8 = true;
  static constexpr int kBytes = 1;
  using Enc = ENC;
};
