// Paged multi-token attention (prefill, chunked prefill, the multi-token sequences of a mixed batch) on
// MFMA 16x16x16: one workgroup of 4 wave64s per (sequence, tile of 64 rows, KV head). A row is a (query
// token, query head) pair of the KV head's GQA group, token-major (row = t * G + g), so the G heads that
// share a KV head share every K/V byte the workgroup stages; each wave owns 16 rows and all D columns.
//
// Anatomy (docs/rocm.md, "Prefill", has the picture, the resource budget and the performance model):
//  * The context is walked N = 4096 / D tokens at a time (64, 32, 16 for D = 64, 128, 256: every step
//    stages 8 KiB of 16-bit K and V). The workgroup stages a step's K in LDS in the query's type and
//    its V in the PV type (the query's for a 16-bit cache, f16 for FP8), widening FP8 on the way
//    (v_cvt_pk_f32_fp8/_bf8 on gfx942's fnuz encodings, exact software elsewhere: every FP8 value is
//    exact in both 16-bit types), so the math reads operands and never converts. The next step's global
//    loads are issued before this step's math (register prefetch). Cache rows are addressed through
//    their block, head and token strides: an NHD cache's permute(0, 2, 1, 3) view is read as is.
//  * S^T = K Q^T per 16-token subtile: A = K (token l%16, dims 16c + 4(l/16) + e: one 8-byte LDS read),
//    B = Q^T (registers, loaded once: D/8 VGPRs). The result lands with lane l holding row l%16 and
//    tokens 4(l/16) + e, exactly the B operand P^T of O^T = V^T P^T: P never goes through LDS, and a
//    row's max and sum are 2 shuffles (lanes l%16 + 16k share a row).
//  * Scales: k_scale into the logit scale, v_scale into the output. Soft-cap, ALiBi (slope (j - p)),
//    the causal limit (keys j <= p, p = L - q_len + t) and the sliding window (j > p - w) per element;
//    the online softmax in log2 units; P rounded to the PV type and the sum adds the rounded values.
//  * O^T: MFMA m's row l%16 is column (D/16)(l%16) + m, so a lane reads D/16 consecutive V elements of
//    each of its 4 tokens, and ends holding D/4 consecutive output columns of its row (wide stores).
//  * A workgroup reads the keys its rows need: from the window start of its first row to the causal
//    limit of its last; a wave skips the math of steps outside its own rows' range (wave-uniform).
//  * Sequences of one query token in a mixed batch are left to the decode kernels
//    (pa_decode.h, its split-K and pa_reduce.h), launched in the same call.
#pragma once
#include "formats.h"
#include "pa_decode.h"

namespace pa {

constexpr int kPrefillRows = 64;  // rows a workgroup: 4 waves x 16

template <int D> struct PrefillShape {
  static constexpr int N = 4096 / D;  // tokens a step
  static constexpr int J = N / 16;    // 16-token subtiles a step
  static constexpr int KS = D + 4;    // K row stride in LDS, elements: 8-byte reads, 16 lanes on 32 banks
  static constexpr int VS = D + 8;    // V row stride: 16-byte aligned rows for 16-byte reads
};

template <int D> struct PrefillLds {
  u16 k[PrefillShape<D>::N][PrefillShape<D>::KS];
  u16 v[PrefillShape<D>::N][PrefillShape<D>::VS];
};

// One 16-byte chunk of cache (8 16-bit or 16 FP8 elements) as T bits: 4 or 8 words.
template <class CACHE, class T> HAL_DEV void widen_chunk(u32x4 v, u32* out) {
  if constexpr (CACHE::kFp8) {
    const u32 w[4] = {v[0], v[1], v[2], v[3]};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      float f[4];
      fp8x4_decode<typename CACHE::Enc>(w[i], f);  // exact
      out[2 * i] = (u32)T::from_f32(f[0]) | ((u32)T::from_f32(f[1]) << 16);
      out[2 * i + 1] = (u32)T::from_f32(f[2]) | ((u32)T::from_f32(f[3]) << 16);
    }
  } else {
    #pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = v[i];
  }
}

#define HAL_PA_PREFILL_PARAMS                                                                                 \
  void *__restrict__ out, const void *__restrict__ query, const void *__restrict__ key_cache,                \
      const void *__restrict__ value_cache, const i32 *__restrict__ block_tables,                            \
      const i32 *__restrict__ seq_lens, const i32 *__restrict__ query_start_loc,                             \
      const float *__restrict__ k_scale_ptr, const float *__restrict__ v_scale_ptr,                          \
      const float *__restrict__ alibi_slopes, i64 q_stride_tok, i64 q_stride_head, i64 o_stride_tok,         \
      i64 o_stride_head, i64 k_block_stride, i64 k_head_stride, i64 k_token_stride, i64 v_block_stride,      \
      i64 v_head_stride, i64 v_token_stride, i64 bt_stride, float scale, float k_scale_val,                  \
      float v_scale_val, float soft_cap, i32 gqa_ratio, i32 block_size_log2, i32 sliding_window, i32 causal, \
      i32 k_scale_stride, i32 v_scale_stride
#define HAL_PA_PREFILL_ARGS                                                                                   \
  out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, k_scale_ptr, v_scale_ptr,     \
      alibi_slopes, q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, k_block_stride, k_head_stride, \
      k_token_stride, v_block_stride, v_head_stride, v_token_stride, bt_stride, scale, k_scale_val,          \
      v_scale_val, soft_cap, gqa_ratio, block_size_log2, sliding_window, causal, k_scale_stride,             \
      v_scale_stride

// The key range [lo, hi) that rows [first, last] of a sequence (q_len rows over L keys) attend to.
HAL_DEV void key_range(int first, int last, int G, int L, int qlen, int causal, int window, int& lo, int& hi) {
  const int t0 = first / G, t1 = last / G;
  hi = causal ? L - qlen + t1 + 1 : L;
  lo = window > 0 && L - qlen + t0 - window + 1 > 0 ? L - qlen + t0 - window + 1 : 0;
}

// grid (num_seqs, row tiles of 64, num_kv_heads)
template <class Q, class CACHE, int D> HAL_DEV void prefill(HAL_PA_PREFILL_PARAMS) {
  static_assert(D == 64 || D == 128 || D == 256, "head sizes 64, 128, 256");
  using S = PrefillShape<D>;
  using PV = typename PvOperand<CACHE>::type;
  using CE = typename Elem<CACHE::kBytes>::type;
  constexpr int N = S::N, J = S::J, NC = D / 16, NM = D / 16;
  constexpr int E = 16 / CACHE::kBytes;       // cache elements per 16-byte chunk
  constexpr int CPT = D / E;                  // chunks per token row
  constexpr int kLoads = N * CPT / 256;       // chunks per thread per step, K and V each (2, or 1 for FP8)
  constexpr int EW = CACHE::kFp8 ? 8 : 4;     // words of one widened chunk
  static_assert(kLoads * 256 == N * CPT, "a step is a whole number of chunks per thread");

  HAL_SHARED(PrefillLds<D>, lds);
  const int seq = (int)hal_bid_x(), kvh = (int)hal_bid_z();
  const int tid = (int)hal_tid(), lane = (int)hal_lane(), wave = (int)hal_wave();
  const int r = lane >> 4, c16 = lane & 15;
  const int G = gqa_ratio;
  const int q0 = hal_ld(query_start_loc + seq), qlen = hal_ld(query_start_loc + seq + 1) - q0;
  if (qlen == 1) return;  // a decode row: the decode kernel launched in the same call has it
  const int rows = qlen * G, row0 = (int)hal_bid_y() * kPrefillRows;
  if (row0 >= rows) return;  // workgroup-uniform: fewer rows than the longest sequence
  const int L = hal_ld(seq_lens + seq);

  int kv_lo, kv_hi;  // what the workgroup stages
  key_range(row0, (row0 + kPrefillRows < rows ? row0 + kPrefillRows : rows) - 1, G, L, qlen, causal,
            sliding_window, kv_lo, kv_hi);
  const int wr0 = row0 + 16 * wave, wr1 = (wr0 + 16 < rows ? wr0 + 16 : rows) - 1;
  const bool wave_rows = wr0 < rows;
  int w_lo = 0, w_hi = 0;  // what this wave's rows need (the union of their ranges)
  if (wave_rows) key_range(wr0, wr1, G, L, qlen, causal, sliding_window, w_lo, w_hi);
  // the intersection of the wave's valid rows' ranges: keys every one of them attends to
  int w_lo_all = 0, w_hi_all = 0;
  if (wave_rows) {
    int lo0, hi0, lo1, hi1;
    key_range(wr0, wr0, G, L, qlen, causal, sliding_window, lo0, hi0);
    key_range(wr1, wr1, G, L, qlen, causal, sliding_window, lo1, hi1);
    w_lo_all = lo1;  // the last row's window starts last
    w_hi_all = hi0;  // the first row's causal limit comes first
  }

  // this lane's row (the B column c16 of its wave's S^T and O^T)
  const int row = wr0 + c16;
  const bool row_ok = row < rows;
  const int t = row_ok ? row / G : 0, g = row_ok ? row - t * G : 0;
  const int head = kvh * G + g, pos_q = L - qlen + t;
  int lo = 0, hi = 0;  // this row's keys (none for a padding row)
  if (row_ok) key_range(row, row, G, L, qlen, causal, sliding_window, lo, hi);

  const float ks = k_scale_ptr ? hal_ld(k_scale_ptr + kvh * k_scale_stride) : k_scale_val;
  const float vs = v_scale_ptr ? hal_ld(v_scale_ptr + kvh * v_scale_stride) : v_scale_val;
  const float qk_scale = scale * ks;
  const float inv_cap = soft_cap > 0 ? 1.0f / soft_cap : 0.0f;
  const float slope = alibi_slopes && row_ok ? hal_ld(alibi_slopes + head) : 0.0f;

  // Q^T as the B operand: chunk c holds dims 16c + 4r + e of row c16
  u16x4 qb[NC];
  {
    const u16* qrow = static_cast<const u16*>(query) + (i64)(q0 + t) * q_stride_tok + (i64)head * q_stride_head;
    #pragma unroll
    for (int c = 0; c < NC; ++c)
      qb[c] = row_ok ? hal_ld(reinterpret_cast<const u16x4*>(qrow + 16 * c + 4 * r)) : u16x4{0, 0, 0, 0};
  }

  // Staging: chunk ci = tid + 256 i of a step is piece ci % CPT of token ci / CPT
  const int bmask = (1 << block_size_log2) - 1;
  const CE* kbase = static_cast<const CE*>(key_cache) + (i64)kvh * k_head_stride;
  const CE* vbase = static_cast<const CE*>(value_cache) + (i64)kvh * v_head_stride;
  u32x4 kr[kLoads], vr[kLoads];
  auto load_step = [&](int s) {
    #pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int ci = tid + 256 * i, pos = s + ci / CPT, piece = ci % CPT;
      if (pos < kv_hi) {
        const i64 blk = hal_ld(block_tables + seq * bt_stride + (pos >> block_size_log2));
        const i64 off = pos & bmask;
        kr[i] = hal_ld(reinterpret_cast<const u32x4*>(kbase + blk * k_block_stride + off * k_token_stride) + piece);
        vr[i] = hal_ld(reinterpret_cast<const u32x4*>(vbase + blk * v_block_stride + off * v_token_stride) + piece);
      } else {  // past the keys the workgroup needs: never read, zeros in LDS
        kr[i] = u32x4{0u, 0u, 0u, 0u};
        vr[i] = u32x4{0u, 0u, 0u, 0u};
      }
    }
  };
  auto store_step = [&]() {
    #pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int ci = tid + 256 * i, j = ci / CPT, col = (ci % CPT) * E;
      u32 w[EW];
      widen_chunk<CACHE, Q>(kr[i], w);
      #pragma unroll
      for (int h = 0; h < EW / 2; ++h) lds_st(&lds.k[j][col + 4 * h], u32x2{w[2 * h], w[2 * h + 1]});
      widen_chunk<CACHE, PV>(vr[i], w);
      #pragma unroll
      for (int h = 0; h < EW / 4; ++h)
        lds_st(&lds.v[j][col + 8 * h], u32x4{w[4 * h], w[4 * h + 1], w[4 * h + 2], w[4 * h + 3]});
    }
  };

  float m_run = kNegInf, l_run = 0.0f;  // row c16's running max (log2 units) and this lane's sum
  f32x4 acc[NM];
  #pragma unroll
  for (int m = 0; m < NM; ++m) acc[m] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};

  const int nsteps = kv_hi > kv_lo ? (kv_hi - kv_lo + N - 1) / N : 0;
  if (nsteps > 0) load_step(kv_lo);
  for (int it = 0; it < nsteps; ++it) {  // workgroup-uniform loop
    const int s = kv_lo + N * it;
    hal_syncthreads();  // every wave is done with the previous step's tile
    store_step();
    if (it + 1 < nsteps) load_step(s + N);  // in flight during this step's math
    hal_syncthreads();  // the tile is complete
    if (!wave_rows || s >= w_hi || s + N <= w_lo) continue;  // wave-uniform: none of its rows' keys here

    // S^T per subtile: lane holds tokens s + 16j + 4r + e of row c16
    f32x4 st[J];
    #pragma unroll
    for (int j = 0; j < J; ++j) {
      st[j] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
      const u16* krow = &lds.k[16 * j + c16][4 * r];
      #pragma unroll
      for (int c = 0; c < NC; ++c) st[j] = Q::mfma(lds_ld<u16x4>(krow + 16 * c), qb[c], st[j]);
    }
    // wave-uniform: every key of the step inside every row's range (most steps of a long prefill)
    const bool inside = s >= w_lo_all && s + N <= w_hi_all;
    float mx = kNegInf;
    #pragma unroll
    for (int j = 0; j < J; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = s + 16 * j + 4 * r + e;
        float x = st[j][e] * qk_scale;
        if (soft_cap > 0) x = soft_cap * tanh_f32(x * inv_cap);
        if (alibi_slopes) x += slope * (float)(pos - pos_q);
        x *= kLog2e;
        if (!inside && (pos < lo || pos >= hi)) x = kNegInf;
        st[j][e] = x;
        mx = hal_fmaxf(mx, x);
      }
    mx = hal_fmaxf(mx, hal_shfl_xor(mx, 16));
    mx = hal_fmaxf(mx, hal_shfl_xor(mx, 32));
    const float m_new = hal_fmaxf(m_run, mx);
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    const float alpha = hal_exp2(m_run - m_use);
    u16x4 pb[J];  // P^T as PV's B operand, rounded to the PV type
    float psum = 0.0f;
    #pragma unroll
    for (int j = 0; j < J; ++j)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const u16 h = PV::from_f32(hal_exp2(st[j][e] - m_use));
        pb[j][e] = h;
        psum += PV::to_f32(h);
      }
    l_run = l_run * alpha + psum;
    m_run = m_new;
    #pragma unroll
    for (int m = 0; m < NM; ++m) acc[m] *= alpha;

    // O^T += V^T P^T: MFMA m's row c16 is column NM*c16 + m; the lane's tokens 16j + 4r + e
    #pragma unroll
    for (int j = 0; j < J; ++j) {
      u32 v[4][NM / 2];  // NM consecutive columns of each of the lane's 4 tokens
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const u16* vrow = &lds.v[16 * j + 4 * r + e][NM * c16];
        if constexpr (NM == 4) {
          const u32x2 x = lds_ld<u32x2>(vrow);
          v[e][0] = x[0];
          v[e][1] = x[1];
        } else {
          #pragma unroll
          for (int q = 0; q < NM / 8; ++q) {
            const u32x4 x = lds_ld<u32x4>(vrow + 8 * q);
            #pragma unroll
            for (int k = 0; k < 4; ++k) v[e][4 * q + k] = x[k];
          }
        }
      }
      #pragma unroll
      for (int m = 0; m < NM; ++m) {
        u16x4 a;
        #pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = (u16)(v[e][m / 2] >> (16 * (m % 2)));
        acc[m] = PV::mfma(a, pb[j], acc[m]);
      }
    }
  }

  // the row's sum over its 4 lanes (the max is already row-wide)
  l_run += hal_shfl_xor(l_run, 16);
  l_run += hal_shfl_xor(l_run, 32);
  if (!row_ok) return;
  // lane holds columns NM*(4r + e) + m of its row: D/4 consecutive ones from D/4 * r
  const float k = vs / l_run;  // every row has its own position among its keys: l_run > 0 (or NaN)
  u16 o[D / 4];
  #pragma unroll
  for (int e = 0; e < 4; ++e)
    #pragma unroll
    for (int m = 0; m < NM; ++m) o[NM * e + m] = Q::from_f32(acc[m][e] * k);
  store_run<D / 4>(static_cast<u16*>(out) + (i64)(q0 + t) * o_stride_tok + (i64)head * o_stride_head + (D / 4) * r, o);
}

}  // namespace pa
