// Split-K paged decode attention on tensor cores (mma.sync m16n8k16), one CTA of 4 warps per
// (sequence, KV head, head tile of <= 16 query heads, partition of the context).
//
// Why this shape:
// * All query heads of a GQA group sit in the 16 rows of one MMA tile, so every K/V byte is read
//   once per group, never once per query head.
// * K and V go straight from global memory into MMA fragment registers with 16-byte loads. The dot
//   product over the head dimension does not care about the order of the dimensions, so each thread
//   loads a *contiguous* run of a K row and the same permutation is applied to Q (see kdim()); for V
//   the output dimensions are permuted instead (vdim()) and undone when the result is written.
// * FP8 bytes are widened to fp16 with the hardware cvt (exact for e4m3 and e5m2). bf16 queries
//   against an FP8 cache are rescaled by a power of two (exact) so they fit fp16, and the factor is
//   folded into the logit scale with k_scale; v_scale multiplies the output once.
// * Each warp runs its own online softmax over a quarter of the partition; warps merge through
//   shared memory; partitions merge in a second kernel by log-sum-exp.
#pragma once
#include "common.cuh"
#include "params.h"

namespace hal_cuda {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStep = 16;  // tokens per warp iteration (two n8 tiles for QK, one k16 block for PV)

template <Kind K, int D>
struct Layout {
  static constexpr int kBpe = Traits<K>::kBytes;
  static constexpr int kEpl = 16 / kBpe;             // elements per 16-byte load
  static constexpr int kKbPerChunk = kEpl / 4;       // k-blocks a thread covers per full chunk
  static constexpr int kChunk = 4 * kEpl;            // dims per chunk (4 threads x 16 bytes)
  static constexpr int kFull = D / kChunk;
  static constexpr int kTailKb = (D % kChunk) / 16;  // k-blocks in the last, partial chunk
  static constexpr int kKb = D / 16;                 // k-blocks (QK) per row
  static constexpr int kKWords = kKb * kBpe;         // 32-bit words of one K row per thread
  static constexpr int kNt = D / 8;                  // n8 tiles (PV) per row
  // V piece width in elements: the largest power of two dividing kNt, at most one 16-byte load.
  static constexpr int kW = (kNt % 16 == 0 && kEpl >= 16) ? 16 : (kNt % 8 == 0 && kEpl >= 8) ? 8 : (kNt % 4 == 0) ? 4 : 2;
  static constexpr int kVBytes = kNt * kBpe;         // bytes of one V row per thread
  static constexpr int kVWords = (kVBytes + 3) / 4;
  static_assert(D % 16 == 0, "head size must be a multiple of 16");

  // First of the 4 contiguous dims thread t holds for k-block kb (same map for Q and K).
  static __device__ __forceinline__ int kdim(int t, int kb) {
    const int c = kb / kKbPerChunk, j = kb % kKbPerChunk;
    const int m = c < kFull ? kKbPerChunk : kTailKb;
    return c * kChunk + 4 * m * t + 4 * j;
  }
  // The head dim that output column n (thread group n) of n8 tile nt stands for.
  static __device__ __forceinline__ int vdim(int n, int nt) { return (nt / kW) * (8 * kW) + n * kW + (nt % kW); }

  static __device__ __forceinline__ void load_k_row(const uint8_t* row, int t, uint32_t (&w)[kKWords]) {
#pragma unroll
    for (int c = 0; c < kFull; ++c) load_bytes<16>(row + (c * kChunk + kEpl * t) * kBpe, &w[c * 4]);
    if constexpr (kTailKb > 0) {
      constexpr int bytes = 4 * kTailKb * kBpe;
      const uint8_t* p = row + (kFull * kChunk + 4 * kTailKb * t) * kBpe;
      if constexpr (bytes == 12) {
        load_bytes<4>(p, &w[kFull * 4]);
        load_bytes<4>(p + 4, &w[kFull * 4 + 1]);
        load_bytes<4>(p + 8, &w[kFull * 4 + 2]);
      } else {
        load_bytes<bytes>(p, &w[kFull * 4]);
      }
    }
  }
  static __device__ __forceinline__ void load_v_row(const uint8_t* row, int g, uint32_t (&w)[kVWords]) {
    constexpr int pb = kW * kBpe;  // bytes per piece
#pragma unroll
    for (int i = 0; i < kNt / kW; ++i) {
      const uint8_t* p = row + (i * 8 * kW + g * kW) * kBpe;
      if constexpr (pb >= 4) {
        load_bytes<pb>(p, &w[i * pb / 4]);
      } else {  // 2-byte pieces, two to a word
        uint32_t h;
        load_bytes<2>(p, &h);
        if (i % 2 == 0) w[i / 2] = h; else w[i / 2] |= h << 16;
      }
    }
  }
};

template <Kind K, int D>
__global__ void __launch_bounds__(kThreads) decode_kernel(const DecodeParams p) {
  using LY = Layout<K, D>;
  constexpr bool kBf = Traits<K>::kBf16Math;
  constexpr bool kFp8 = Traits<K>::kFp8;
  const int seq = blockIdx.x;
  const int kvh = blockIdx.y / p.head_tiles;
  const int tile = blockIdx.y % p.head_tiles;
  const int part = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const int L = p.seq_lens[seq];
  const int first = p.window > 0 ? max(0, L - p.window) : 0;
  const int p0 = part * p.partition_size;
  const bool split = p.num_parts > 1;
  if (split && (p0 >= L || p0 + p.partition_size <= first)) return;  // the reduce skips this part too

  const int rows = min(16, p.gqa - tile * 16);        // query heads in this tile
  const int head0 = kvh * p.gqa + tile * 16;

  // ---- Q fragments (A operand), permuted like K ----
  uint32_t qa[LY::kKb][4];
  float qmul = 1.0f;  // power of two folded into the logit scale
  {
    float qv[LY::kKb][2][4];
    float amax = 0.f;
#pragma unroll
    for (int kb = 0; kb < LY::kKb; ++kb) {
      const int d0 = LY::kdim(t, kb);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float v = 0.f;
          if (row < rows) {
            const int64_t off = (int64_t)seq * p.q_stride0 + (int64_t)(head0 + row) * p.q_stride1 + d0 + i;
            v = p.q_is_bf16 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.query)[off])
                            : __half2float(reinterpret_cast<const __half*>(p.query)[off]);
          }
          qv[kb][r][i] = v;
          amax = fmaxf(amax, fabsf(v));
        }
      }
    }
    if (kFp8 && p.q_is_bf16) {
      // fp16 holds every bf16 value of a row exactly once its largest is near 2^14 (powers of two
      // are exact); values beyond fp16's range would overflow otherwise.
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (amax > 0.f && isfinite(amax)) {
        int e;
        frexpf(amax, &e);             // amax in [2^(e-1), 2^e)
        const int shift = 15 - e;     // amax * 2^shift in [2^14, 2^15)
        qmul = exp2f((float)-shift);
        const float up = exp2f((float)shift);
#pragma unroll
        for (int kb = 0; kb < LY::kKb; ++kb)
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int i = 0; i < 4; ++i) qv[kb][r][i] *= up;
      }
    }
#pragma unroll
    for (int kb = 0; kb < LY::kKb; ++kb) {
      if constexpr (kBf) {
        qa[kb][0] = pack_bf16x2(qv[kb][0][0], qv[kb][0][1]);
        qa[kb][1] = pack_bf16x2(qv[kb][1][0], qv[kb][1][1]);
        qa[kb][2] = pack_bf16x2(qv[kb][0][2], qv[kb][0][3]);
        qa[kb][3] = pack_bf16x2(qv[kb][1][2], qv[kb][1][3]);
      } else {
        qa[kb][0] = pack_f16x2(qv[kb][0][0], qv[kb][0][1]);
        qa[kb][1] = pack_f16x2(qv[kb][1][0], qv[kb][1][1]);
        qa[kb][2] = pack_f16x2(qv[kb][0][2], qv[kb][0][3]);
        qa[kb][3] = pack_f16x2(qv[kb][1][2], qv[kb][1][3]);
      }
    }
  }

  const float ks = p.k_scale_ptr ? p.k_scale_ptr[kvh * p.k_scale_stride] : p.k_scale;
  const float logit_scale = p.scale * ks * qmul;   // natural-log units
  constexpr float kLog2e = 1.4426950408889634f;
  const bool plain = p.soft_cap <= 0.f && p.alibi == nullptr;
  const float slope0 = p.alibi && g < rows ? p.alibi[head0 + g] : 0.f;
  const float slope1 = p.alibi && g + 8 < rows ? p.alibi[head0 + g + 8] : 0.f;

  const int64_t head_off = (int64_t)kvh * p.block_size * D * LY::kBpe;
  const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
  auto row_ptr = [&](const uint8_t* base, int64_t stride0, int tok) -> const uint8_t* {
    const int blk = table[tok >> p.block_shift];
    const int off = tok & (p.block_size - 1);
    return base + (int64_t)blk * stride0 + head_off + (int64_t)off * D * LY::kBpe;
  };

  // ---- this warp's token range ----
  const int quarter = p.partition_size / kWarps;
  const int w0 = p0 + warp * quarter;
  const int w1 = min(w0 + quarter, L);
  const int s_begin = max(w0, first & ~(kStep - 1));

  float o[LY::kNt][4];
#pragma unroll
  for (int nt = 0; nt < LY::kNt; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g and g + 8 (log2 units)

  uint32_t kr[2][LY::kKWords], vr[4][LY::kVWords];
  auto load_step = [&](int s0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tok = s0 + g + 8 * i;
      if (tok >= first && tok < w1) {
        LY::load_k_row(row_ptr(p.key_cache, p.k_stride0, tok), t, kr[i]);
      } else {
#pragma unroll
        for (int j = 0; j < LY::kKWords; ++j) kr[i][j] = 0u;
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = s0 + 2 * t + (i & 1) + 8 * (i >> 1);
      if (tok >= first && tok < w1) {
        LY::load_v_row(row_ptr(p.value_cache, p.v_stride0, tok), g, vr[i]);
      } else {
#pragma unroll
        for (int j = 0; j < LY::kVWords; ++j) vr[i][j] = 0u;
      }
    }
  };

  for (int s0 = s_begin; s0 < w1; s0 += kStep) {
    load_step(s0);
    // ---- S = Q K^T for 16 tokens: two n8 tiles ----
    float s[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int kb = 0; kb < LY::kKb; ++kb) {
        uint32_t b0, b1;
        if constexpr (kFp8) {
          b0 = fp8x2_to_f16x2<K>(kr[i][kb]);
          b1 = fp8x2_to_f16x2<K>(kr[i][kb] >> 16);
        } else {
          b0 = kr[i][2 * kb];
          b1 = kr[i][2 * kb + 1];
        }
        mma16816<kBf>(s[i], qa[kb], b0, b1);
      }
    }
    // ---- scale, soft-cap, ALiBi, mask; columns: tile i, col 2t + c -> token s0 + 8i + 2t + c ----
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int tok = s0 + 8 * i + 2 * t + (c & 1);
        float x = s[i][c] * logit_scale;
        if (!plain) {
          if (p.soft_cap > 0.f) x = p.soft_cap * tanhf(x / p.soft_cap);
          if (p.alibi) x += (c < 2 ? slope0 : slope1) * (float)(tok - (L - 1));
        }
        s[i][c] = (tok >= first && tok < w1) ? x * kLog2e : -INFINITY;
      }
    }
    // ---- online softmax (per row, over the quad) ----
    const float mx0 = warp_max4(fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1])));
    const float mx1 = warp_max4(fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3])));
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;
    const float a0 = fast_exp2(m0 - u0), a1 = fast_exp2(m1 - u1);
    m0 = n0; m1 = n1;
    float pr[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      pr[i][0] = fast_exp2(s[i][0] - u0); pr[i][1] = fast_exp2(s[i][1] - u0);
      pr[i][2] = fast_exp2(s[i][2] - u1); pr[i][3] = fast_exp2(s[i][3] - u1);
    }
    l0 = l0 * a0 + pr[0][0] + pr[0][1] + pr[1][0] + pr[1][1];
    l1 = l1 * a1 + pr[0][2] + pr[0][3] + pr[1][2] + pr[1][3];
#pragma unroll
    for (int nt = 0; nt < LY::kNt; ++nt) { o[nt][0] *= a0; o[nt][1] *= a0; o[nt][2] *= a1; o[nt][3] *= a1; }
    uint32_t pa[4];
    if constexpr (kBf) {
      pa[0] = pack_bf16x2(pr[0][0], pr[0][1]); pa[1] = pack_bf16x2(pr[0][2], pr[0][3]);
      pa[2] = pack_bf16x2(pr[1][0], pr[1][1]); pa[3] = pack_bf16x2(pr[1][2], pr[1][3]);
    } else {
      pa[0] = pack_f16x2(pr[0][0], pr[0][1]); pa[1] = pack_f16x2(pr[0][2], pr[0][3]);
      pa[2] = pack_f16x2(pr[1][0], pr[1][1]); pa[3] = pack_f16x2(pr[1][2], pr[1][3]);
    }
    // ---- O += P V: B fragments pair tokens (2t, 2t+1) and (2t+8, 2t+9) of one head dim ----
    if constexpr (kFp8) {
#pragma unroll
      for (int q = 0; q < LY::kVWords; ++q) {
        const uint32_t lo01 = __byte_perm(vr[0][q], vr[1][q], 0x5140), hi01 = __byte_perm(vr[0][q], vr[1][q], 0x7362);
        const uint32_t lo23 = __byte_perm(vr[2][q], vr[3][q], 0x5140), hi23 = __byte_perm(vr[2][q], vr[3][q], 0x7362);
        const uint32_t b0[4] = {lo01, lo01 >> 16, hi01, hi01 >> 16};
        const uint32_t b1[4] = {lo23, lo23 >> 16, hi23, hi23 >> 16};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int nt = 4 * q + e;
          if (nt < LY::kNt) mma16816<false>(o[nt], pa, fp8x2_to_f16x2<K>(b0[e]), fp8x2_to_f16x2<K>(b1[e]));
        }
      }
    } else {
#pragma unroll
      for (int q = 0; q < LY::kVWords; ++q) {
        const uint32_t b0e = __byte_perm(vr[0][q], vr[1][q], 0x5410), b0o = __byte_perm(vr[0][q], vr[1][q], 0x7632);
        const uint32_t b1e = __byte_perm(vr[2][q], vr[3][q], 0x5410), b1o = __byte_perm(vr[2][q], vr[3][q], 0x7632);
        mma16816<kBf>(o[2 * q], pa, b0e, b1e);
        mma16816<kBf>(o[2 * q + 1], pa, b0o, b1o);
      }
    }
  }

  // ---- merge the four warps through shared memory ----
  __shared__ float sm_m[kWarps][16], sm_l[kWarps][16];
  __shared__ float so[16][D];
  l0 = warp_sum4(l0);
  l1 = warp_sum4(l1);
  if (t == 0) {
    sm_m[warp][g] = m0; sm_m[warp][g + 8] = m1;
    sm_l[warp][g] = l0; sm_l[warp][g + 8] = l1;
  }
  __syncthreads();
  float f0, f1;
  {
    float M0 = -INFINITY, M1 = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) { M0 = fmaxf(M0, sm_m[w][g]); M1 = fmaxf(M1, sm_m[w][g + 8]); }
    f0 = m0 == -INFINITY ? 0.f : fast_exp2(m0 - M0);
    f1 = m1 == -INFINITY ? 0.f : fast_exp2(m1 - M1);
  }
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int nt = 0; nt < LY::kNt; ++nt) {
        const int d0 = LY::vdim(2 * t, nt), d1 = LY::vdim(2 * t + 1, nt);
        if (w == 0) {
          so[g][d0] = o[nt][0] * f0; so[g][d1] = o[nt][1] * f0;
          so[g + 8][d0] = o[nt][2] * f1; so[g + 8][d1] = o[nt][3] * f1;
        } else {
          so[g][d0] += o[nt][0] * f0; so[g][d1] += o[nt][1] * f0;
          so[g + 8][d0] += o[nt][2] * f1; so[g + 8][d1] += o[nt][3] * f1;
        }
      }
    }
    __syncthreads();
  }
  // ---- write: the output (one partition) or this partition's normalised partial result ----
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float M = -INFINITY, Lsum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][r]);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) Lsum += sm_m[w][r] == -INFINITY ? 0.f : sm_l[w][r] * fast_exp2(sm_m[w][r] - M);
    const float val = Lsum > 0.f ? so[r][d] / Lsum : 0.f;
    const int h = head0 + r;
    if (!split) {
      const float x = val * vs;
      const int64_t off = (int64_t)seq * p.out_stride0 + (int64_t)h * p.out_stride1 + d;
      if (p.q_is_bf16) reinterpret_cast<__nv_bfloat16*>(p.out)[off] = __float2bfloat16_rn(x);
      else reinterpret_cast<__half*>(p.out)[off] = __float2half_rn(x);
    } else {
      const int64_t slot = ((int64_t)seq * p.num_heads + h) * p.num_parts + part;
      p.part_out[slot * D + d] = val;
      if (d == 0) { p.part_ml[2 * slot] = M; p.part_ml[2 * slot + 1] = Lsum; }
    }
  }
}

// Merge partitions: out = v_scale * sum_p w_p O_p / sum_p w_p with w_p = l_p 2^(m_p - max m).
template <int D>
__global__ void __launch_bounds__(128) reduce_kernel(const DecodeParams p) {
  const int seq = blockIdx.x, h = blockIdx.y;
  const int L = p.seq_lens[seq];
  const int first = p.window > 0 ? max(0, L - p.window) : 0;
  const int pa = first / p.partition_size;
  const int pb = (L + p.partition_size - 1) / p.partition_size;
  const int64_t base = ((int64_t)seq * p.num_heads + h) * p.num_parts;
  float M = -INFINITY;
  for (int q = pa; q < pb; ++q) M = fmaxf(M, p.part_ml[2 * (base + q)]);
  float wsum = 0.f;
  for (int q = pa; q < pb; ++q) {
    const float m = p.part_ml[2 * (base + q)];
    wsum += m == -INFINITY ? 0.f : p.part_ml[2 * (base + q) + 1] * fast_exp2(m - M);
  }
  const int kvh = h / p.gqa;
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int q = pa; q < pb; ++q) {
      const float m = p.part_ml[2 * (base + q)];
      if (m == -INFINITY) continue;
      acc += p.part_ml[2 * (base + q) + 1] * fast_exp2(m - M) * p.part_out[(base + q) * D + d];
    }
    const float x = wsum > 0.f ? acc / wsum * vs : 0.f;
    const int64_t off = (int64_t)seq * p.out_stride0 + (int64_t)h * p.out_stride1 + d;
    if (p.q_is_bf16) reinterpret_cast<__nv_bfloat16*>(p.out)[off] = __float2bfloat16_rn(x);
    else reinterpret_cast<__half*>(p.out)[off] = __float2half_rn(x);
  }
}

}  // namespace hal_cuda
