// Shared device helpers for the cuda pack: cache element traits, FP8 conversions (hardware cvt,
// sm89+), mma.sync wrappers and raw loads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace hal_cuda {

// Cache element kinds. FP8 caches are read as bytes and widened to fp16 (exact for both encodings);
// 16-bit caches are used as they are.
enum class Kind : int { F16 = 0, BF16 = 1, E4M3 = 2, E5M2 = 3 };

template <Kind K> struct Traits;
template <> struct Traits<Kind::F16>  { static constexpr int kBytes = 2; static constexpr bool kFp8 = false; static constexpr bool kBf16Math = false; };
template <> struct Traits<Kind::BF16> { static constexpr int kBytes = 2; static constexpr bool kFp8 = false; static constexpr bool kBf16Math = true; };
template <> struct Traits<Kind::E4M3> { static constexpr int kBytes = 1; static constexpr bool kFp8 = true;  static constexpr bool kBf16Math = false; };
template <> struct Traits<Kind::E5M2> { static constexpr int kBytes = 1; static constexpr bool kFp8 = true;  static constexpr bool kBf16Math = false; };

// Two FP8 values to an f16x2 register (the first byte -> the low half), with the hardware conversion:
// bytes 0-1 of `four`, or bytes 2-3 with kHigh. The word is split with mov.b32 {lo, hi}, which ptxas
// turns into an operand selector (F2FP ... R.H1), where `x >> 16` cost a shift an upper pair.
template <Kind K, bool kHigh = false>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t four) {
  uint16_t lo, hi;
  asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(four));
  const uint16_t h = kHigh ? hi : lo;
  uint32_t r;
  if constexpr (K == Kind::E4M3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(h));
  }
  return r;
}

// Two floats to two saturated FP8 bytes (x -> low byte, y -> high byte), round to nearest even;
// NaN becomes the canonical NaN 0x7f, infinities saturate to the largest finite value.
template <Kind K>
__device__ __forceinline__ uint16_t f32x2_to_fp8x2(float x, float y) {
  uint16_t r;
  if constexpr (K == Kind::E4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(y), "f"(x));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(y), "f"(x));
  }
  return r;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulators.
template <bool kBf16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Transpose an 8x8 matrix of 16-bit elements held in the mma fragment layout (thread (g, t) holds
// row g, columns 2t and 2t+1) across the warp.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Loads of 2, 4, 8 or 16 bytes into 32-bit words (a 2-byte load fills the low half of one word).
template <int N>
__device__ __forceinline__ void load_bytes(const uint8_t* p, uint32_t* w) {
  if constexpr (N == 16) {
    uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (N == 8) {
    uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else if constexpr (N == 4) {
    w[0] = __ldg(reinterpret_cast<const uint32_t*>(p));
  } else if constexpr (N == 2) {
    w[0] = __ldg(reinterpret_cast<const uint16_t*>(p));
  } else {
    static_assert(N == 16, "unsupported load width");
  }
}

// An 8-byte shared-memory load the compiler may not hoist out of a loop (which would pin the value
// in registers for the whole loop).
__device__ __forceinline__ uint2 lds_u2(const uint2* p) {
  uint2 v;
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}

// 2^x with the SFU (relative error ~2^-22); softmax weights need no more.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the 8 lanes that share t = lane % 4 (the rows of an mma fragment).
__device__ __forceinline__ float rows_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
}
__device__ __forceinline__ float rows_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  return v + __shfl_xor_sync(0xffffffffu, v, 16);
}

}  // namespace hal_cuda
