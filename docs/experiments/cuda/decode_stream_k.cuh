// Paged decode attention on tensor cores (mma.sync m16n8k16), stream-K: a fixed grid of CTAs (4
// warps each, a few per SM) shares the whole problem evenly. The work is the concatenation of every
// "row" (sequence, KV head, head tile of <= 16 query heads) as a run of tokens; CTA c takes the span
// [c * span, (c + 1) * span) of it, which covers pieces of one or more rows ("segments"). A segment
// that is a whole row writes the output; a piece of a row writes a partial result (O, max, sum), and
// the CTA that finishes a row's last piece merges them (log-sum-exp), so no second kernel runs.
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
// * Each warp runs its own online softmax over a quarter of the segment; warps merge through
//   shared memory.
// * Why stream-K: with one CTA per (row, partition) the work per SM is uneven (SMs hold 3 or 4 CTAs,
//   CTAs end at different times: ~9% idle SM time at 64x4096 on the H200), short rows pay a CTA's
//   start and end many times, and splitting a row costs a second kernel.
#pragma once
#include "common.cuh"
#include "layout.cuh"
#include "params.h"

namespace hal_cuda {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStep = 16;  // tokens per warp iteration (two n8 tiles for QK, one k16 block for PV)


// The main loop's shape per cache kind. An FP8 step carries half the bytes of a 16-bit one, so two
// steps share a load round (and one softmax update); with one 8-head tile and D <= 128 registers
// are capped for 4 resident CTAs per SM. Both measured faster on the H200 than one step per round
// at 3 CTAs per SM (docs/cuda.md).
template <Kind K, int D, int NH> struct LoopConfig {
  static constexpr int kSub = (Traits<K>::kFp8 && NH == 1) ? 2 : 1;
  static constexpr int kMinBlocks = (NH == 1 && D <= 128) ? 4 : 1;
};

__device__ __forceinline__ void store_out(const DecodeParams& p, const int seq, const int h, const int d, const float x) {
  const int64_t off = (int64_t)seq * p.out_stride0 + (int64_t)h * p.out_stride1 + d;
  if (p.q_is_bf16) reinterpret_cast<__nv_bfloat16*>(p.out)[off] = __float2bfloat16_rn(x);
  else reinterpret_cast<__half*>(p.out)[off] = __float2half_rn(x);
}

// One segment: tokens [t0, t1) of row (seq, kvh, tile) (t0 a multiple of 16). part == nullptr: the
// segment is the whole row and writes the output; else it writes its normalised partial result
// (rows x D) to part and (max, sum) per row to part_ml.
template <Kind K, int D, int NH, bool kPlain>
__device__ __forceinline__ void attend(const DecodeParams& p, const int seq, const int kvh, const int tile, const int L,
                                       const int first, const int t0, const int t1, float* const part,
                                       float* const part_ml) {
  // kPlain: no soft-cap and no ALiBi (the common case compiles without their branches).
  constexpr int SUB = LoopConfig<K, D, NH>::kSub;
  constexpr float kSlack = 8.f;
  // NH tiles of 8 query heads (the MMA's N) share every K/V fragment.
  using LY = Layout<K, D>;
  constexpr bool kBf = Traits<K>::kBf16Math;
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr int kMt = D / 16;  // m16 tiles of the output's head dim
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  __syncthreads();  // the previous segment is done with the shared buffers

  const int rows = min(8 * NH, p.gqa - tile * 8 * NH);   // query heads in this tile
  const int head0 = kvh * p.gqa + tile * 8 * NH;

  const int64_t head_off = (int64_t)kvh * p.block_size * D * LY::kBpe;
  const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
  constexpr int64_t kRow = (int64_t)D * LY::kBpe;  // bytes per token row of one head

  // ---- this warp's token range ----
  const int quarter = ((t1 - t0 + kWarps - 1) / kWarps + kStep - 1) & ~(kStep - 1);
  const int w0 = t0 + warp * quarter;
  const int w1 = min(min(w0 + quarter, t1), L);
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

  // SUB steps of 16 tokens have their loads issued together: more bytes in flight per warp for the
  // FP8 loop, which moves half the bytes of a 16-bit step.
  uint32_t kr[SUB][2][LY::kKWords], vr[SUB][4][LY::kVWords];
  // A step wholly inside [first, w1) on one page (block size >= 16) takes the lean path: one table
  // lookup and no per-row tests. Others look up each run of 8 tokens (a run starting at a multiple
  // of 8 never crosses a page) and zero the rows outside the range (pages there may be junk entries).
  const bool lean_pages = p.block_size >= kStep;
  auto load_step = [&](int u, int s0) {
    if (lean_pages && s0 >= first && s0 + kStep <= w1) {
      const int64_t blk = table[s0 >> p.block_shift];
      const int64_t row0 = head_off + (int64_t)(s0 & (p.block_size - 1)) * kRow;
      const uint8_t* kp = p.key_cache + blk * p.k_stride0 + row0;
      const uint8_t* vp = p.value_cache + blk * p.v_stride0 + row0;
      LY::load_k_row(kp + g * kRow, t, kr[u][0]);
      LY::load_k_row(kp + (g + 8) * kRow, t, kr[u][1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) LY::load_v_row(vp + (2 * t + (i & 1) + 8 * (i >> 1)) * kRow, g, vr[u][i]);
      return;
    }
#pragma unroll
    for (int h8 = 0; h8 < 2; ++h8) {
      const int s8 = s0 + 8 * h8;
      const bool live = s8 + 7 >= first && s8 < w1;
      const int64_t blk = live ? table[s8 >> p.block_shift] : 0;
      const int64_t row0 = head_off + (int64_t)(s8 & (p.block_size - 1)) * kRow;
      const uint8_t* kp = p.key_cache + blk * p.k_stride0 + row0;
      const uint8_t* vp = p.value_cache + blk * p.v_stride0 + row0;
      if (s8 + g >= first && s8 + g < w1) {
        LY::load_k_row(kp + g * kRow, t, kr[u][h8]);
      } else {
#pragma unroll
        for (int j = 0; j < LY::kKWords; ++j) kr[u][h8][j] = 0u;
      }
#pragma unroll
      for (int i = 2 * h8; i < 2 * h8 + 2; ++i) {
        const int r = 2 * t + (i & 1);
        if (s8 + r >= first && s8 + r < w1) {
          LY::load_v_row(vp + r * kRow, g, vr[u][i]);
        } else {
#pragma unroll
          for (int j = 0; j < LY::kVWords; ++j) vr[u][i][j] = 0u;
        }
      }
    }
  };
  // The first round of loads goes out before the query is read, so the two latencies overlap.
  if (s_begin < w1) {
#pragma unroll
    for (int u = 0; u < SUB; ++u) load_step(u, s_begin + u * kStep);
  }

  // ---- Q^T fragments (B operand): head (n) g of each 8-head tile, dims permuted like K ----
  // Q^T fragments live in shared memory and are read back at every step (8 bytes per lane per
  // k-block, conflict free): registers are what limits the loads in flight, not shared bandwidth.
  __shared__ uint2 sq[NH][LY::kKb][32];
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
        if (warp == 0) {  // every warp computed the same fragments; one writes them
          if constexpr (kBf) {
            sq[nh][kb][lane] = make_uint2(pack_bf16x2(qv[nh][kb][0], qv[nh][kb][1]), pack_bf16x2(qv[nh][kb][2], qv[nh][kb][3]));
          } else {
            sq[nh][kb][lane] = make_uint2(pack_f16x2(qv[nh][kb][0], qv[nh][kb][1]), pack_f16x2(qv[nh][kb][2], qv[nh][kb][3]));
          }
        }
      }
  }

  __syncthreads();  // sq written

  const float ks = p.k_scale_ptr ? p.k_scale_ptr[kvh * p.k_scale_stride] : p.k_scale;
  const float logit_scale = p.scale * ks * qmul;   // natural-log units
  constexpr float kLog2e = 1.4426950408889634f;
  float slope[NH][2];
#pragma unroll
  for (int nh = 0; nh < NH; ++nh)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = nh * 8 + 2 * t + c;
      slope[nh][c] = p.alibi && r < rows ? p.alibi[head0 + r] : 0.f;
    }

  // Logits in log2 units: the plain path folds log2(e) into the scale; soft-cap and ALiBi work in
  // natural units first.
  const float step_scale = kPlain ? logit_scale * kLog2e : logit_scale;

  // The SUB steps of a batch share one softmax update (one max, one rescale); QK^T runs as
  // independent accumulator chains (one per step, or split over k-blocks when SUB is 1) so the
  // tensor-core latency overlaps.
  constexpr int kChains = (SUB == 1 && NH == 1 && LY::kKb >= 8) ? 2 : 1;
  for (int s_outer = s_begin; s_outer < w1; s_outer += SUB * kStep) {
    if (s_outer != s_begin) {
#pragma unroll
      for (int u = 0; u < SUB; ++u) load_step(u, s_outer + u * kStep);
    }
    // ---- S^T = K Q^T: per step, 16 tokens (rows g: token s0+g, g+8: token s0+8+g) x 8 heads ----
    float acc[SUB * kChains][NH][4];
#pragma unroll
    for (int i = 0; i < SUB * kChains; ++i)
#pragma unroll
      for (int nh = 0; nh < NH; ++nh) acc[i][nh][0] = acc[i][nh][1] = acc[i][nh][2] = acc[i][nh][3] = 0.f;
#pragma unroll
    for (int kb = 0; kb < LY::kKb; ++kb) {
      uint2 q[NH];
#pragma unroll
      for (int nh = 0; nh < NH; ++nh) q[nh] = lds_u2(&sq[nh][kb][lane]);
#pragma unroll
      for (int u = 0; u < SUB; ++u) {
        uint32_t a[4];
        if constexpr (kFp8) {
          a[0] = fp8x2_to_f16x2<K>(kr[u][0][kb]);
          a[1] = fp8x2_to_f16x2<K>(kr[u][1][kb]);
          a[2] = fp8x2_to_f16x2<K>(kr[u][0][kb] >> 16);
          a[3] = fp8x2_to_f16x2<K>(kr[u][1][kb] >> 16);
        } else {
          a[0] = kr[u][0][2 * kb]; a[1] = kr[u][1][2 * kb]; a[2] = kr[u][0][2 * kb + 1]; a[3] = kr[u][1][2 * kb + 1];
        }
#pragma unroll
        for (int nh = 0; nh < NH; ++nh) mma16816<kBf>(acc[u * kChains + kb % kChains][nh], a, q[nh].x, q[nh].y);
      }
    }
    // ---- scale, soft-cap, ALiBi, mask ----
    float s[SUB][NH][4];
    float mx[NH][2];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) mx[nh][0] = mx[nh][1] = -INFINITY;
#pragma unroll
    for (int u = 0; u < SUB; ++u) {
      const int tok_lo = s_outer + u * kStep + g, tok_hi = tok_lo + 8;
      const bool ok_lo = tok_lo >= first && tok_lo < w1, ok_hi = tok_hi >= first && tok_hi < w1;
#pragma unroll
      for (int nh = 0; nh < NH; ++nh) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float x = acc[u * kChains][nh][c];
          if constexpr (kChains == 2) x += acc[u * kChains + 1][nh][c];
          x *= step_scale;
          if constexpr (!kPlain) {
            if (p.soft_cap > 0.f) x = p.soft_cap * tanhf(x / p.soft_cap);
            if (p.alibi) x += slope[nh][c & 1] * (float)((c < 2 ? tok_lo : tok_hi) - (L - 1));
            x *= kLog2e;
          }
          s[u][nh][c] = (c < 2 ? ok_lo : ok_hi) ? x : -INFINITY;
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) mx[nh][c] = fmaxf(mx[nh][c], fmaxf(s[u][nh][c], s[u][nh][c + 2]));
      }
    }
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int c = 0; c < 2; ++c) mx[nh][c] = rows_max(mx[nh][c]);
    // ---- online softmax per head (column). The running max m moves only when a new logit
    // exceeds it by more than kSlack (log2 units): until then P = 2^(s - m) <= 2^kSlack, which
    // fp16/bf16 and the fp32 sums hold with no loss, and the rescale of O is skipped. ----
    bool grow = false;
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int c = 0; c < 2; ++c) grow |= mx[nh][c] > m[nh][c] + kSlack;
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int nh = 0; nh < NH; ++nh)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float mn = fmaxf(m[nh][c], mx[nh][c]);
          const float alpha = fast_exp2(m[nh][c] - (mn == -INFINITY ? 0.f : mn));
          m[nh][c] = mn;
          l[nh][c] *= alpha;
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt) { o[nh][mt][c] *= alpha; o[nh][mt][c + 2] *= alpha; }
        }
    }
    uint32_t pb[SUB][NH][2];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) {
      const float ref0 = m[nh][0] == -INFINITY ? 0.f : m[nh][0];
      const float ref1 = m[nh][1] == -INFINITY ? 0.f : m[nh][1];
#pragma unroll
      for (int u = 0; u < SUB; ++u) {
        float pr[4];
        pr[0] = fast_exp2(s[u][nh][0] - ref0);
        pr[1] = fast_exp2(s[u][nh][1] - ref1);
        pr[2] = fast_exp2(s[u][nh][2] - ref0);
        pr[3] = fast_exp2(s[u][nh][3] - ref1);
        l[nh][0] += pr[0] + pr[2];
        l[nh][1] += pr[1] + pr[3];
        // P^T as the B operand: transpose the two 8x8 blocks (tokens 0-7, 8-15) across the warp.
        if constexpr (kBf) {
          pb[u][nh][0] = transpose8x8(pack_bf16x2(pr[0], pr[1]));
          pb[u][nh][1] = transpose8x8(pack_bf16x2(pr[2], pr[3]));
        } else {
          pb[u][nh][0] = transpose8x8(pack_f16x2(pr[0], pr[1]));
          pb[u][nh][1] = transpose8x8(pack_f16x2(pr[2], pr[3]));
        }
      }
    }
    // ---- O^T += V^T P^T: A fragments pair tokens (2t, 2t+1) and (2t+8, 2t+9) of one head dim ----
#pragma unroll
    for (int u = 0; u < SUB; ++u) {
      if constexpr (kFp8) {
#pragma unroll
        for (int q = 0; q < LY::kVWords; ++q) {
          const uint32_t lo01 = __byte_perm(vr[u][0][q], vr[u][1][q], 0x5140), hi01 = __byte_perm(vr[u][0][q], vr[u][1][q], 0x7362);
          const uint32_t lo23 = __byte_perm(vr[u][2][q], vr[u][3][q], 0x5140), hi23 = __byte_perm(vr[u][2][q], vr[u][3][q], 0x7362);
          if (2 * q < kMt) {
            const uint32_t a[4] = {fp8x2_to_f16x2<K>(lo01), fp8x2_to_f16x2<K>(lo01 >> 16),
                                   fp8x2_to_f16x2<K>(lo23), fp8x2_to_f16x2<K>(lo23 >> 16)};
#pragma unroll
            for (int nh = 0; nh < NH; ++nh) mma16816<false>(o[nh][2 * q], a, pb[u][nh][0], pb[u][nh][1]);
          }
          if (2 * q + 1 < kMt) {
            const uint32_t a[4] = {fp8x2_to_f16x2<K>(hi01), fp8x2_to_f16x2<K>(hi01 >> 16),
                                   fp8x2_to_f16x2<K>(hi23), fp8x2_to_f16x2<K>(hi23 >> 16)};
#pragma unroll
            for (int nh = 0; nh < NH; ++nh) mma16816<false>(o[nh][2 * q + 1], a, pb[u][nh][0], pb[u][nh][1]);
          }
        }
      } else {
#pragma unroll
        for (int q = 0; q < kMt; ++q) {
          const uint32_t a[4] = {__byte_perm(vr[u][0][q], vr[u][1][q], 0x5410), __byte_perm(vr[u][0][q], vr[u][1][q], 0x7632),
                                 __byte_perm(vr[u][2][q], vr[u][3][q], 0x5410), __byte_perm(vr[u][2][q], vr[u][3][q], 0x7632)};
#pragma unroll
          for (int nh = 0; nh < NH; ++nh) mma16816<kBf>(o[nh][q], a, pb[u][nh][0], pb[u][nh][1]);
        }
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
    if (part == nullptr) {
      store_out(p, seq, head0 + r, d, val * vs);
    } else {
      part[r * D + d] = val;
      if (d == 0) { part_ml[2 * r] = M; part_ml[2 * r + 1] = Lsum; }
    }
  }
}

// A row's tokens in the work order: from the window's first 16-token step to the end, padded to
// whole steps; at least one step, so that an empty sequence still gets a CTA to write its zeros.
__device__ __forceinline__ int window_first(const DecodeParams& p, const int L) {
  return p.window > 0 ? max(0, L - p.window) : 0;
}
__device__ __forceinline__ int row_tokens(const int L, const int first) {
  const int f16 = first & ~(kStep - 1);
  return max(kStep, (L - f16 + kStep - 1) & ~(kStep - 1));
}

// The last CTA to finish a piece of row r of sequence seq merges the pieces: CTAs c0..c1 each
// wrote one, in their slot 0 (a piece that starts their span) or 1 (a piece that starts inside it).
template <int D, int NH>
__device__ __forceinline__ void merge_if_last(const DecodeParams& p, const int seq, const int r, const int64_t G,
                                              const int len, const int64_t span) {
  __shared__ int s_last;
  const int row_id = seq * p.num_kv_heads * p.head_tiles + r;
  const int c0 = (int)(G / span), c1 = (int)((G + len - 1) / span);
  __threadfence();  // this CTA's partial result is visible before its arrival counts
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&p.counters[row_id], 1) == c1 - c0;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int kvh = r / p.head_tiles, tile = r % p.head_tiles;
  const int rows = min(8 * NH, p.gqa - tile * 8 * NH);
  const int head0 = kvh * p.gqa + tile * 8 * NH;
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
  const int slot0 = G != (int64_t)c0 * span ? 1 : 0;  // c0's piece starts inside its span unless the row starts it
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int h = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int c = c0; c <= c1; ++c) {
      const int64_t at = (int64_t)(c * 2 + (c == c0 ? slot0 : 0)) * 16 + h;
      M = fmaxf(M, __ldcg(p.part_ml + at * 2));
    }
    float wsum = 0.f, acc = 0.f;
    for (int c = c0; c <= c1; ++c) {
      const int64_t at = (int64_t)(c * 2 + (c == c0 ? slot0 : 0)) * 16 + h;
      const float m = __ldcg(p.part_ml + at * 2);
      if (m == -INFINITY) continue;
      const float w = __ldcg(p.part_ml + at * 2 + 1) * fast_exp2(m - M);
      wsum += w;
      acc += w * __ldcg(p.part_out + at * D + d);
    }
    store_out(p, seq, head0 + h, d, wsum > 0.f ? acc / wsum * vs : 0.f);
  }
  if (threadIdx.x == 0) p.counters[row_id] = 0;  // ready for the next call
}

template <Kind K, int D, int NH, bool kPlain>
__global__ void __launch_bounds__(kThreads, (LoopConfig<K, D, NH>::kMinBlocks)) decode_kernel(const DecodeParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_per_seq = p.num_kv_heads * p.head_tiles;
  // ---- total work and where this CTA's span starts: a scan of the rows' lengths ----
  __shared__ long long s_warp[kWarps];
  __shared__ long long s_state[5];
  const int per = (p.num_seqs + kThreads - 1) / kThreads;
  const int a = min(p.num_seqs, threadIdx.x * per), b = min(p.num_seqs, a + per);
  long long mine = 0;
  for (int s = a; s < b; ++s) {
    const int L = p.seq_lens[s];
    mine += row_tokens(L, window_first(p, L));
  }
  mine *= rows_per_seq;
  long long inc = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long v = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) s_warp[warp] = inc;
  __syncthreads();
  long long before = inc - mine, total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += s_warp[w];
    total += s_warp[w];
  }
  const long long even = ((total + p.num_ctas - 1) / p.num_ctas + 63) & ~63ll;
  const long long span = max((long long)p.min_span, even);
  const long long pos0 = (long long)blockIdx.x * span;
  if (pos0 >= total) return;  // more CTAs than work: the same answer in every thread
  // The walk's state lives in shared memory (the same in every thread), re-read around each segment
  // so that no register holds it through the attention loop.
  volatile long long* const st = s_state;  // position, its sequence, that sequence's first position, span, end
  if (pos0 >= before && pos0 < before + mine) {  // the one thread whose sequences hold pos0
    long long q = before;
    int s = a;
    for (;; ++s) {
      const int L = p.seq_lens[s];
      const long long w = (long long)row_tokens(L, window_first(p, L)) * rows_per_seq;
      if (pos0 < q + w) break;
      q += w;
    }
    st[0] = pos0;
    st[1] = s;
    st[2] = q;
    st[3] = span;
    st[4] = min(total, pos0 + span);
  }
  __syncthreads();
  // ---- the segments of this CTA's span ----
  struct Seg {
    int seq, r, L, first, len, t0, t1;
    long long G, end;  // the row's first position; the segment's end
    bool next_seq;
  };
  auto locate = [&]() {
    Seg z;
    const long long pos = st[0], seq_pos = st[2];
    z.seq = (int)st[1];
    z.L = p.seq_lens[z.seq];
    z.first = window_first(p, z.L);
    z.len = row_tokens(z.L, z.first);
    const long long seq_end = seq_pos + (long long)z.len * rows_per_seq;
    z.next_seq = pos >= seq_end;
    z.end = seq_end;
    if (z.next_seq) return z;
    z.r = (int)((pos - seq_pos) / z.len);
    z.G = seq_pos + (long long)z.r * z.len;
    z.end = min((long long)st[4], z.G + z.len);
    z.t0 = (z.first & ~(kStep - 1)) + (int)(pos - z.G);
    z.t1 = z.t0 + (int)(z.end - pos);
    return z;
  };
  while (st[0] < st[4]) {
    Seg z = locate();
    if (z.next_seq) {
      __syncthreads();
      if (threadIdx.x == 0) { st[1] = z.seq + 1; st[2] = z.end; }
      __syncthreads();
      continue;
    }
    const long long pos = st[0];
    const bool whole = pos == z.G && z.end == z.G + z.len;
    const int64_t slot = (int64_t)blockIdx.x * 2 + (pos == (long long)blockIdx.x * st[3] ? 0 : 1);
    attend<K, D, NH, kPlain>(p, z.seq, z.r / p.head_tiles, z.r % p.head_tiles, z.L, z.first, z.t0, z.t1,
                             whole ? nullptr : p.part_out + slot * 16 * D, whole ? nullptr : p.part_ml + slot * 16 * 2);
    z = locate();
    if (!(st[0] == z.G && z.end == z.G + z.len)) merge_if_last<D, NH>(p, z.seq, z.r, z.G, z.len, st[3]);
    __syncthreads();
    if (threadIdx.x == 0) st[0] = z.end;
    __syncthreads();
  }
}

}  // namespace hal_cuda
