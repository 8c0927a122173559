// Split-K paged decode attention on tensor cores (mma.sync m16n8k16), one CTA of 4 warps per
// (sequence, KV head, head tile of <= 16 query heads, partition of the context); or, with warp rows
// (kRows, for many short rows), one warp per (sequence, KV head, 8-head tile, partition).
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
#include "layout.cuh"
#include "merge.cuh"
#include "params.h"

namespace hal_cuda {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStep = 16;  // tokens per warp iteration (two n8 tiles for QK, one k16 block for PV)


// The main loop's shape per cache kind. An FP8 step carries half the bytes of a 16-bit one, so two
// steps share a load round (and one softmax update); with one 8-head tile and D <= 128 registers
// are capped for 4 resident CTAs per SM. Both measured faster on the H200 than one step per round
// at 3 CTAs per SM (docs/cuda.md). Two 8-head tiles (FP8 GQA > 8) also take two steps a round up to
// D 128 (196 registers, 2 CTAs per SM; 1.05-1.19x one step a round at 3 on the H100); at D 256 that
// spills, and launch.head_tile gives FP8 one 8-head tile a CTA there.
template <Kind K, int D, int NH> struct LoopConfig {
  static constexpr int kSub = (Traits<K>::kFp8 && (NH == 1 || D <= 128)) ? 2 : 1;
  static constexpr int kMinBlocks = (NH == 1 && D <= 128) ? 4 : (Traits<K>::kFp8 && D <= 128) ? 2 : 1;
};

template <Kind K, int D, int NH, bool kPlain, bool kRows>
__global__ void __launch_bounds__(kThreads, (LoopConfig<K, D, NH>::kMinBlocks)) decode_kernel(const DecodeParams p) {
  // kPlain: no soft-cap and no ALiBi (the common case compiles without their branches).
  // kRows: warp rows (below); a template flag so the other kernel keeps its registers.
  static_assert(!kRows || NH == 1, "warp rows serve one head tile");
  constexpr int SUB = LoopConfig<K, D, NH>::kSub;
  constexpr float kSlack = 8.f;
  // NH tiles of 8 query heads (the MMA's N) share every K/V fragment.
  using LY = Layout<K, D>;
  constexpr bool kBf = Traits<K>::kBf16Math;
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr int kMt = D / 16;  // m16 tiles of the output's head dim
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Warp rows (one head tile only): each warp serves its own (sequence, KV head) over the whole
  // partition and writes its own result, with no merge between warps: the grid's x covers 4 rows
  // (KV heads of a sequence, fastest). Otherwise the CTA serves one row, a quarter per warp.
  constexpr bool wrows = kRows;
  int seq = blockIdx.x, y = blockIdx.y;
  bool live = true;  // this warp has a row (warp rows: the last CTA may have fewer than 4)
  if (wrows) {
    const int per_seq = p.num_kv_heads * p.head_tiles;
    const int r = blockIdx.x * kWarps + warp;
    seq = r / per_seq;
    y = r % per_seq;
    live = seq < p.num_seqs;
    if (!live) seq = p.num_seqs - 1;
  }
  const int kvh = y / p.head_tiles;
  const int tile = y % p.head_tiles;
  const int part = blockIdx.z;

  // the query/output row of this sequence; with query_start_loc only one-row sequences are ours
  int qrow = seq;
  if (p.query_start_loc) {
    qrow = p.query_start_loc[seq];
    if (p.query_start_loc[seq + 1] - qrow != 1) {
      if (!wrows) return;  // CTA-uniform here
      live = false;
    }
  }
  const int L = p.seq_lens[seq];
  const int first = p.window > 0 ? max(0, L - p.window) : 0;
  const int p0 = part * p.partition_size;
  const bool split = p.num_parts > 1;
  // Partitions wholly outside [first, L) have nothing to merge (the reduce skips them too); an empty
  // sequence keeps partition 0, so that a merge in the kernel still writes its zeros.
  const bool skip = split && (p0 >= max(L, 1) || p0 + p.partition_size <= first);
  if (!wrows && skip) return;  // CTA-uniform here
  live = live && !skip;

  const int rows = min(8 * NH, p.gqa - tile * 8 * NH);   // query heads in this tile
  const int head0 = kvh * p.gqa + tile * 8 * NH;

  // cache rows through their strides (bytes): an NHD cache's HND view reads as the HND cache does
  const int64_t k_head = (int64_t)kvh * p.k_head_stride, v_head = (int64_t)kvh * p.v_head_stride;
  const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
  const int64_t kRow = p.k_row, vRow = p.v_row;  // bytes between token rows of one head

  // ---- this warp's token range ----
  const int quarter = wrows ? p.partition_size : p.partition_size / kWarps;
  const int w0 = wrows ? p0 : p0 + warp * quarter;
  const int w1 = live ? min(w0 + quarter, L) : w0;
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
  // Page ids of the lean steps are read a round ahead (nb), so a round's loads wait on one memory
  // latency instead of a table read followed by the K/V reads.
  int nb[SUB];
  auto prefetch_pages = [&](int s0) {
#pragma unroll
    for (int u = 0; u < SUB; ++u) {
      const int s = s0 + u * kStep;
      nb[u] = lean_pages && s < w1 ? table[s >> p.block_shift] : 0;
    }
  };
  auto load_step = [&](int u, int s0) {
    if (lean_pages && s0 >= first && s0 + kStep <= w1) {
      const int64_t blk = nb[u];
      const int64_t off = s0 & (p.block_size - 1);
      const uint8_t* kp = p.key_cache + blk * p.k_stride0 + k_head + off * kRow;
      const uint8_t* vp = p.value_cache + blk * p.v_stride0 + v_head + off * vRow;
      LY::load_k_row(kp + g * kRow, t, kr[u][0]);
      LY::load_k_row(kp + (g + 8) * kRow, t, kr[u][1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) LY::load_v_row(vp + (2 * t + (i & 1) + 8 * (i >> 1)) * vRow, g, vr[u][i]);
      return;
    }
#pragma unroll
    for (int h8 = 0; h8 < 2; ++h8) {
      const int s8 = s0 + 8 * h8;
      const bool live = s8 + 7 >= first && s8 < w1;
      const int64_t blk = live ? table[s8 >> p.block_shift] : 0;
      const int64_t off = s8 & (p.block_size - 1);
      const uint8_t* kp = p.key_cache + blk * p.k_stride0 + k_head + off * kRow;
      const uint8_t* vp = p.value_cache + blk * p.v_stride0 + v_head + off * vRow;
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
          LY::load_v_row(vp + r * vRow, g, vr[u][i]);
        } else {
#pragma unroll
          for (int j = 0; j < LY::kVWords; ++j) vr[u][i][j] = 0u;
        }
      }
    }
  };
  // The first round of loads goes out before the query is read, so the two latencies overlap.
  if (s_begin < w1) {
    prefetch_pages(s_begin);
#pragma unroll
    for (int u = 0; u < SUB; ++u) load_step(u, s_begin + u * kStep);
    prefetch_pages(s_begin + SUB * kStep);
  }

  // ---- Q^T fragments (B operand): head (n) g of each 8-head tile, dims permuted like K ----
  // Q^T fragments live in shared memory and are read back at every step (8 bytes per lane per
  // k-block, conflict free): registers are what limits the loads in flight, not shared bandwidth.
  __shared__ uint2 sq_all[kRows ? kWarps : 1][NH][LY::kKb][32];
  auto& sq = sq_all[wrows ? warp : 0];
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
            const int64_t off = (int64_t)qrow * p.q_stride0 + (int64_t)(head0 + row) * p.q_stride1 + d0 + i;
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
        if (wrows || warp == 0) {  // without warp rows every warp computed the same fragments
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
      prefetch_pages(s_outer + SUB * kStep);
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
          a[2] = fp8x2_to_f16x2<K, true>(kr[u][0][kb]);
          a[3] = fp8x2_to_f16x2<K, true>(kr[u][1][kb]);
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
            const uint32_t a[4] = {fp8x2_to_f16x2<K>(lo01), fp8x2_to_f16x2<K, true>(lo01),
                                   fp8x2_to_f16x2<K>(lo23), fp8x2_to_f16x2<K, true>(lo23)};
#pragma unroll
            for (int nh = 0; nh < NH; ++nh) mma16816<false>(o[nh][2 * q], a, pb[u][nh][0], pb[u][nh][1]);
          }
          if (2 * q + 1 < kMt) {
            const uint32_t a[4] = {fp8x2_to_f16x2<K>(hi01), fp8x2_to_f16x2<K, true>(hi01),
                                   fp8x2_to_f16x2<K>(hi23), fp8x2_to_f16x2<K, true>(hi23)};
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

  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
  if (wrows) {
    // ---- warp rows: normalise and write this warp's own result from its fragments ----
    if (!live) return;
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int c = 0; c < 2; ++c) l[nh][c] = rows_sum(l[nh][c]);
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = nh * 8 + 2 * t + (c & 1);
          if (r >= rows) continue;
          const int d = LY::vdim(g, 2 * mt + (c >> 1));
          const float lsum = l[nh][c & 1];
          const float val = lsum == 0.f ? 0.f : o[nh][mt][c] / lsum;  // 0: empty; NaN stays NaN
          const int h = head0 + r;
          if (!split) {
            const float x = val * vs;
            const int64_t off = (int64_t)qrow * p.out_stride0 + (int64_t)h * p.out_stride1 + d;
            if (p.q_is_bf16) reinterpret_cast<__nv_bfloat16*>(p.out)[off] = __float2bfloat16_rn(x);
            else reinterpret_cast<__half*>(p.out)[off] = __float2half_rn(x);
          } else {
            // A split context: verified on the H200 with a forced plan (warp rows over split-K,
            // with and without a window); launch.plan asks for warp rows on one-pass calls only.
            const int64_t slot = ((int64_t)seq * p.num_heads + h) * p.num_parts + part;
            p.part_out[slot * D + d] = val;
            if (d == 0) { p.part_ml[2 * slot] = m[nh][c & 1]; p.part_ml[2 * slot + 1] = lsum; }
          }
        }
    return;
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
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float M = -INFINITY, Lsum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][r]);
#pragma unroll
    // A warp whose max stayed -inf saw no finite logit: its sum is 0 (no token) or NaN (every
    // logit NaN), and l * 0 keeps exactly that. Only an empty range gives Lsum == 0 (zeros).
    for (int w = 0; w < kWarps; ++w)
      Lsum += sm_m[w][r] == -INFINITY ? sm_l[w][r] * 0.f : sm_l[w][r] * fast_exp2(sm_m[w][r] - M);
    const float val = Lsum == 0.f ? 0.f : so[r][d] / Lsum;
    const int h = head0 + r;
    if (!split) {
      const float x = val * vs;
      const int64_t off = (int64_t)qrow * p.out_stride0 + (int64_t)h * p.out_stride1 + d;
      if (p.q_is_bf16) reinterpret_cast<__nv_bfloat16*>(p.out)[off] = __float2bfloat16_rn(x);
      else reinterpret_cast<__half*>(p.out)[off] = __float2half_rn(x);
    } else {
      const int64_t slot = ((int64_t)seq * p.num_heads + h) * p.num_parts + part;
      p.part_out[slot * D + d] = val;
      if (d == 0) { p.part_ml[2 * slot] = M; p.part_ml[2 * slot + 1] = Lsum; }
    }
  }
  // ---- a split row with counters: the last of its partitions to finish merges them (no second launch) ----
  if (split && p.counters) {
    const int pa = first / p.partition_size;
    const int pb = max((L + p.partition_size - 1) / p.partition_size, pa + 1);
    if (last_to_arrive(p.counters + (int64_t)seq * p.num_kv_heads * p.head_tiles + y, pb - pa)) {
      const MergeOut dst{p.out, (int64_t)qrow * p.out_stride0, p.out_stride0, p.out_stride1, head0, p.num_heads,
                         p.q_is_bf16 != 0};
      merge_partitions<D>(p.part_out, p.part_ml, ((int64_t)seq * p.num_heads + head0) * p.num_parts, p.num_parts,
                          1, rows, pa, pb, vs, dst, &sm_m[0][0]);
    }
  }
}

}  // namespace hal_cuda
