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

template <Kind K, int D, int NH>
__global__ void __launch_bounds__(kThreads) decode_kernel(const DecodeParams p) {
  // NH tiles of 8 query heads (the MMA's N) share every K/V fragment.
  using LY = Layout<K, D>;
  constexpr bool kBf = Traits<K>::kBf16Math;
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr int kMt = D / 16;  // m16 tiles of the output's head dim
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

  const int rows = min(8 * NH, p.gqa - tile * 16);   // query heads in this tile
  const int head0 = kvh * p.gqa + tile * 16;

  // ---- Q^T fragments (B operand): head (n) g of each 8-head tile, dims permuted like K ----
  uint32_t qb[NH][LY::kKb][2];
  float qmul = 1.0f;  // power of two folded into the logit scale
  {
    float qv[NH][LY::kKb][4];
    float amax = 0.f;
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) {
      const int row = nh * 8 + g;
#pragma unroll
      for (int kb = 0; kb < LY::kKb; ++kb) {
        const int d0 = LY::kdim(t, kb);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float v = 0.f;
          if (row < rows) {
            const int64_t off = (int64_t)seq * p.q_stride0 + (int64_t)(head0 + row) * p.q_stride1 + d0 + i;
            v = p.q_is_bf16 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.query)[off])
                            : __half2float(reinterpret_cast<const __half*>(p.query)[off]);
          }
          qv[nh][kb][i] = v;
          amax = fmaxf(amax, fabsf(v));
        }
      }
    }
    if (kFp8 && p.q_is_bf16) {
      // fp16 holds every bf16 value exactly once the largest is near 2^14 (powers of two are exact);
      // without this, bf16 values beyond fp16's range would overflow.
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (amax > 0.f && isfinite(amax)) {
        int e;
        frexpf(amax, &e);             // amax in [2^(e-1), 2^e)
        const int shift = 15 - e;     // amax * 2^shift in [2^14, 2^15)
        qmul = exp2f((float)-shift);
        const float up = exp2f((float)shift);
#pragma unroll
        for (int nh = 0; nh < NH; ++nh)
#pragma unroll
          for (int kb = 0; kb < LY::kKb; ++kb)
#pragma unroll
            for (int i = 0; i < 4; ++i) qv[nh][kb][i] *= up;
      }
    }
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int kb = 0; kb < LY::kKb; ++kb) {
        if constexpr (kBf) {
          qb[nh][kb][0] = pack_bf16x2(qv[nh][kb][0], qv[nh][kb][1]);
          qb[nh][kb][1] = pack_bf16x2(qv[nh][kb][2], qv[nh][kb][3]);
        } else {
          qb[nh][kb][0] = pack_f16x2(qv[nh][kb][0], qv[nh][kb][1]);
          qb[nh][kb][1] = pack_f16x2(qv[nh][kb][2], qv[nh][kb][3]);
        }
      }
  }

  const float ks = p.k_scale_ptr ? p.k_scale_ptr[kvh * p.k_scale_stride] : p.k_scale;
  const float logit_scale = p.scale * ks * qmul;   // natural-log units
  constexpr float kLog2e = 1.4426950408889634f;
  const bool plain = p.soft_cap <= 0.f && p.alibi == nullptr;
  float slope[NH][2];
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = nh * 8 + 2 * t + c;
      slope[nh][c] = p.alibi && r < rows ? p.alibi[head0 + r] : 0.f;
    }

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

  // O^T accumulators: tile mt rows g / g+8 are head dims vdim(g, 2mt) / vdim(g, 2mt+1); columns are
  // heads 2t, 2t+1 of each 8-head tile.
  float o[NH][kMt][4];
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) o[nh][mt][0] = o[nh][mt][1] = o[nh][mt][2] = o[nh][mt][3] = 0.f;
  float m[NH][2], l[NH][2];  // heads 2t, 2t+1 (log2 units; l: this thread's tokens only)
#pragma unroll
  for (int nh = 0; nh < NH; ++nh) m[nh][0] = m[nh][1] = -INFINITY, l[nh][0] = l[nh][1] = 0.f;

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
    // ---- S^T = K Q^T: 16 tokens (rows g: token s0+g, g+8: token s0+8+g) x 8 heads per tile ----
    float s[NH][4];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) s[nh][0] = s[nh][1] = s[nh][2] = s[nh][3] = 0.f;
#pragma unroll
    for (int kb = 0; kb < LY::kKb; ++kb) {
      uint32_t a[4];
      if constexpr (kFp8) {
        a[0] = fp8x2_to_f16x2<K>(kr[0][kb]);
        a[1] = fp8x2_to_f16x2<K>(kr[1][kb]);
        a[2] = fp8x2_to_f16x2<K>(kr[0][kb] >> 16);
        a[3] = fp8x2_to_f16x2<K>(kr[1][kb] >> 16);
      } else {
        a[0] = kr[0][2 * kb]; a[1] = kr[1][2 * kb]; a[2] = kr[0][2 * kb + 1]; a[3] = kr[1][2 * kb + 1];
      }
#pragma unroll
      for (int nh = 0; nh < NH; ++nh) mma16816<kBf>(s[nh], a, qb[nh][kb][0], qb[nh][kb][1]);
    }
    // ---- scale, soft-cap, ALiBi, mask ----
    const int tok_lo = s0 + g, tok_hi = s0 + 8 + g;
    const bool ok_lo = tok_lo >= first && tok_lo < w1, ok_hi = tok_hi >= first && tok_hi < w1;
    uint32_t pb[NH][2];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int tok = c < 2 ? tok_lo : tok_hi;
        float x = s[nh][c] * logit_scale;
        if (!plain) {
          if (p.soft_cap > 0.f) x = p.soft_cap * tanhf(x / p.soft_cap);
          if (p.alibi) x += slope[nh][c & 1] * (float)(tok - (L - 1));
        }
        s[nh][c] = (c < 2 ? ok_lo : ok_hi) ? x * kLog2e : -INFINITY;
      }
      // ---- online softmax per head (column), over the 8 row lanes ----
      float pr[4];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float mx = rows_max(fmaxf(s[nh][c], s[nh][c + 2]));
        const float mn = fmaxf(m[nh][c], mx);
        const float u = mn == -INFINITY ? 0.f : mn;
        const float alpha = fast_exp2(m[nh][c] - u);
        m[nh][c] = mn;
        pr[c] = fast_exp2(s[nh][c] - u);
        pr[c + 2] = fast_exp2(s[nh][c + 2] - u);
        l[nh][c] = l[nh][c] * alpha + pr[c] + pr[c + 2];
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) { o[nh][mt][c] *= alpha; o[nh][mt][c + 2] *= alpha; }
      }
      // P^T as the B operand: transpose the two 8x8 blocks (tokens 0-7, 8-15) across the warp.
      if constexpr (kBf) {
        pb[nh][0] = transpose8x8(pack_bf16x2(pr[0], pr[1]));
        pb[nh][1] = transpose8x8(pack_bf16x2(pr[2], pr[3]));
      } else {
        pb[nh][0] = transpose8x8(pack_f16x2(pr[0], pr[1]));
        pb[nh][1] = transpose8x8(pack_f16x2(pr[2], pr[3]));
      }
    }
    // ---- O^T += V^T P^T: A fragments pair tokens (2t, 2t+1) and (2t+8, 2t+9) of one head dim ----
    if constexpr (kFp8) {
#pragma unroll
      for (int q = 0; q < LY::kVWords; ++q) {
        const uint32_t lo01 = __byte_perm(vr[0][q], vr[1][q], 0x5140), hi01 = __byte_perm(vr[0][q], vr[1][q], 0x7362);
        const uint32_t lo23 = __byte_perm(vr[2][q], vr[3][q], 0x5140), hi23 = __byte_perm(vr[2][q], vr[3][q], 0x7362);
        if (2 * q < kMt) {
          const uint32_t a[4] = {fp8x2_to_f16x2<K>(lo01), fp8x2_to_f16x2<K>(lo01 >> 16),
                                 fp8x2_to_f16x2<K>(lo23), fp8x2_to_f16x2<K>(lo23 >> 16)};
#pragma unroll
          for (int nh = 0; nh < NH; ++nh) mma16816<false>(o[nh][2 * q], a, pb[nh][0], pb[nh][1]);
        }
        if (2 * q + 1 < kMt) {
          const uint32_t a[4] = {fp8x2_to_f16x2<K>(hi01), fp8x2_to_f16x2<K>(hi01 >> 16),
                                 fp8x2_to_f16x2<K>(hi23), fp8x2_to_f16x2<K>(hi23 >> 16)};
#pragma unroll
          for (int nh = 0; nh < NH; ++nh) mma16816<false>(o[nh][2 * q + 1], a, pb[nh][0], pb[nh][1]);
        }
      }
    } else {
#pragma unroll
      for (int q = 0; q < kMt; ++q) {
        const uint32_t a[4] = {__byte_perm(vr[0][q], vr[1][q], 0x5410), __byte_perm(vr[0][q], vr[1][q], 0x7632),
                               __byte_perm(vr[2][q], vr[3][q], 0x5410), __byte_perm(vr[2][q], vr[3][q], 0x7632)};
#pragma unroll
        for (int nh = 0; nh < NH; ++nh) mma16816<kBf>(o[nh][q], a, pb[nh][0], pb[nh][1]);
      }
    }
  }

  // ---- merge the four warps through shared memory ----
  __shared__ float sm_m[kWarps][16], sm_l[kWarps][16];
  __shared__ float so[16][D];
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      l[nh][c] = rows_sum(l[nh][c]);
      if (g == 0) { sm_m[warp][nh * 8 + 2 * t + c] = m[nh][c]; sm_l[warp][nh * 8 + 2 * t + c] = l[nh][c]; }
    }
  __syncthreads();
  float f[NH][2];
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = nh * 8 + 2 * t + c;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][r]);
      f[nh][c] = m[nh][c] == -INFINITY ? 0.f : fast_exp2(m[nh][c] - M);
    }
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int nh = 0; nh < NH; ++nh)
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = nh * 8 + 2 * t + (c & 1);
            const int d = LY::vdim(g, 2 * mt + (c >> 1));
            const float x = o[nh][mt][c] * f[nh][c & 1];
            so[r][d] = w == 0 ? x : so[r][d] + x;
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
