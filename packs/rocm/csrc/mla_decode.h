// MLA decode (absorbed form, R = 512 latent + P = 64 rotary dims) on MFMA 16x16x16, one workgroup of
// 4 wave64s per (sequence, tile of 16*G rows, partition of the context). A row is a (query token,
// head) pair of the sequence: every head reads the same latent, so the rows are an MFMA dimension
// and each latent byte is read from memory once per row tile.
//
// Anatomy (docs/rocm.md, "MLA decode", has the picture and the resource budget):
//  * The waves form G row groups (16 rows each) x CW = 4/G column groups. G = 1 serves <= 16 rows a
//    sequence (16 heads, one token: memory-bound), G = 2 everything larger (32 rows a workgroup).
//  * The context is walked 16 tokens at a time. The workgroup stages a step's tokens in LDS as one
//    row per token, [rope (64) | latent (512)]: the rope as stored (the query's type), the latent in
//    its MFMA type T (the query's for a 16-bit latent, f16 for FP8: FP8 latents are widened on the
//    way, exactly, with v_cvt_pk_f32_fp8/_bf8 for gfx942's fnuz encodings and in software
//    elsewhere), so every wave reads operands, never converts them. The next step's global loads
//    are issued before this step's math (register prefetch).
//  * S^T = K Q^T with A = K (token l%16, 4 dims a lane: one 8-byte LDS read) and B = Q^T (registers,
//    loaded once). The 36 16-dim chunks of [rope | latent] are split over the CW waves of a row group
//    (9 or 18 each, so Q costs 18 or 36 VGPRs a lane); the rope chunks (wave 0's first four) run in
//    the query's type, the latent's in T. A bf16 query against an FP8 latent is moved into f16 by a
//    power of two per (wave, row) from its absmax (amax x 2^e in [2^14, 2^15): exact for elements
//    above amax x 2^-32; never rounded to FP8), undone exactly on the fp32 partial. The partials (latent + rope
//    times kpe_scale / ckv_scale) meet in LDS and every wave of the group sums them in the same order
//    (bitwise the same S).
//  * The S^T result lands with lane l holding row l%16 and tokens 4(l/16) + e: exactly the B operand
//    P^T of O^T = V^T P^T, so P never goes through LDS. P is rounded to T (f16 for FP8 latents, as
//    pa_decode.h's PV: 3 more bits of P than bf16) and the softmax sum adds the rounded values.
//    Online softmax over the steps, in log2 units.
//  * O^T: wave (g, c) owns columns [c*C, (c+1)*C), C = 512/CW, over all the step's tokens: C/16 MFMAs
//    whose A = V^T comes from the LDS rows of the lane's 4 tokens. In MFMA m, lane row l%16 is
//    column c*C + (C/16)*(l%16) + m, so a lane reads C/16 consecutive columns of each token (16-byte
//    LDS reads) and builds the operand of MFMA m from element m of each; its outputs are then 4*C/16
//    consecutive columns of its row (wide stores).
//  * Positions at or past the partition's end are never read (zero-filled in LDS); positions past a
//    row's causal limit (L - q_len + t + 1 for its token t) are masked.
//  * One partition: the output row, times ckv_scale / sum, written directly (an empty sequence gives
//    zeros). Several: fp32 partials (unnormalised) and the row's max and sum per partition; a row with
//    no key in the partition writes max = -inf and no partial, which mla_reduce.h skips.
#pragma once
#include "formats.h"
#include "pa_decode.h"

namespace mla {

constexpr int kR = 512;                 // latent width (also the value)
constexpr int kP = 64;                  // rotary width
constexpr int kW = kP + kR;             // one LDS row: [rope | latent]
constexpr int kStep = 16;               // tokens per step
constexpr int kStride = kW + 8;         // LDS row stride in elements (1168 B: 16-byte aligned rows)
constexpr int kChunks = kW / 16;        // 16-dim MFMA chunks of S
constexpr int kRopeChunks = kP / 16;

struct MlaLds {
  u16 tile[kStep][kStride];  // the step's tokens, [rope (query type) | latent (its MFMA type) | pad]
  f32x4 part[4][64];         // per wave: its partial S^T in the MFMA result layout
};

// A latent element's storage and its 16-byte loads per thread for one step (16 tokens, 16 threads a
// token): 16-bit latents 4 x 16 B (1 KiB a token), FP8 2 x 16 B (512 B).
template <class CACHE> struct Latent {
  using Elem = typename pa::Elem<CACHE::kBytes>::type;
  static constexpr int kLoads = kR * CACHE::kBytes / 16 / 16;
};

// The latent's MFMA operand type: a 16-bit latent's own (the query's); f16 for FP8 (exact, and P in
// f16 keeps 3 more bits than in bf16), as pa_decode.h's PV operand.
template <class Q, class CACHE> struct LatentOperand { using type = F16; };
template <class Q, class T16> struct LatentOperand<Q, Cache16<T16>> { using type = T16; };

// floor(log2 |x|) of a positive finite float (-127 for subnormals; they are scaled up no further).
HAL_DEV int exponent_of(float x) { return (int)((__builtin_bit_cast(u32, x) >> 23) & 0xffu) - 127; }

// One 16-byte chunk of latent as LDS elements of T (8 for a 16-bit cache, 16 for FP8) at `dst`.
template <class CACHE, class T> HAL_DEV void widen_store(u16* dst, u32x4 v) {
  if constexpr (CACHE::kFp8) {
    const u32 w[4] = {v[0], v[1], v[2], v[3]};  // scalars first (clang 19: see cache_kv.h)
    u32 h[8];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      float f[4];
      fp8x4_decode<typename CACHE::Enc>(w[i], f);  // exact: every FP8 value is a 16-bit value
      h[2 * i] = (u32)T::from_f32(f[0]) | ((u32)T::from_f32(f[1]) << 16);
      h[2 * i + 1] = (u32)T::from_f32(f[2]) | ((u32)T::from_f32(f[3]) << 16);
    }
    lds_st(dst, u32x4{h[0], h[1], h[2], h[3]});
    lds_st(dst + 8, u32x4{h[4], h[5], h[6], h[7]});
  } else {
    lds_st(dst, v);
  }
}

#define HAL_MLA_DECODE_PARAMS                                                                                 \
  void *__restrict__ out, float *__restrict__ tmp_out, float *__restrict__ part_ml,                          \
      const void *__restrict__ q_nope, const void *__restrict__ q_pe, const void *__restrict__ ckv_cache,    \
      const void *__restrict__ kpe_cache, const i32 *__restrict__ block_tables,                              \
      const i32 *__restrict__ seq_lens, const i32 *__restrict__ query_start_loc,                             \
      const float *__restrict__ ckv_scale_ptr, const float *__restrict__ kpe_scale_ptr, i64 qn_stride_tok,   \
      i64 qn_stride_head, i64 qp_stride_tok, i64 qp_stride_head, i64 o_stride_tok, i64 o_stride_head,       \
      i64 ckv_block_stride, i64 ckv_token_stride, i64 kpe_block_stride, i64 kpe_token_stride, i64 bt_stride, \
      float scale, float ckv_scale_val, float kpe_scale_val, i32 num_heads, i32 block_size_log2,            \
      i32 partition_size, i32 num_parts
#define HAL_MLA_DECODE_ARGS                                                                                   \
  out, tmp_out, part_ml, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, query_start_loc,        \
      ckv_scale_ptr, kpe_scale_ptr, qn_stride_tok, qn_stride_head, qp_stride_tok, qp_stride_head,            \
      o_stride_tok, o_stride_head, ckv_block_stride, ckv_token_stride, kpe_block_stride, kpe_token_stride,   \
      bt_stride, scale, ckv_scale_val, kpe_scale_val, num_heads, block_size_log2, partition_size, num_parts

// grid (num_seqs, row tiles of 16*G rows, num_parts); partition_size is a multiple of kStep.
template <class Q, class CACHE, int G> HAL_DEV void mla_decode(HAL_MLA_DECODE_PARAMS) {
  static_assert(G == 1 || G == 2, "16 or 32 rows a workgroup (64 would need 128 VGPRs of O a lane)");
  constexpr int CW = 4 / G;               // waves per row group
  constexpr int CH = kChunks / CW;        // S chunks per wave
  constexpr int C = kR / CW;              // output columns per wave
  constexpr int NM = C / 16;              // PV MFMAs per step per wave (= columns a lane reads per token)
  static_assert(CH >= kRopeChunks && NM % 8 == 0, "wave 0 of a group holds the rope chunks; 16-byte runs");
  using CE = typename Latent<CACHE>::Elem;
  using T = typename LatentOperand<Q, CACHE>::type;
  constexpr int kLoads = Latent<CACHE>::kLoads;
  constexpr bool kRescale = !__is_same(T, Q);  // a bf16 query against an f16 (FP8) latent

  HAL_SHARED(MlaLds, lds);
  const int seq = (int)hal_bid_x(), part = (int)hal_bid_z();
  const int tid = (int)hal_tid(), lane = (int)hal_lane(), wave = (int)hal_wave();
  const int rg = wave / CW, cg = wave % CW;
  const int r = lane >> 4, c16 = lane & 15;
  int q0 = seq, qlen = 1;
  if (query_start_loc) {
    q0 = hal_ld(query_start_loc + seq);
    qlen = hal_ld(query_start_loc + seq + 1) - q0;
  }
  const int H = num_heads, rows = qlen * H;
  const int row0 = (int)hal_bid_y() * 16 * G;
  if (row0 >= rows) return;  // workgroup-uniform: this sequence has fewer rows than the longest one
  const int L = hal_ld(seq_lens + seq);
  const int p0 = part * partition_size;
  const int p1 = p0 + partition_size < L ? p0 + partition_size : L;  // end of what this workgroup reads

  // This lane's row: the B column (j = l%16) of its row group's S^T and O^T.
  const int row = row0 + 16 * rg + c16;
  const bool row_ok = row < rows;
  const int tq = row_ok ? row / H : 0, head = row_ok ? row - tq * H : 0;
  const int lim = row_ok ? L - qlen + tq + 1 : 0;  // causal: positions < lim (padding rows: none)
  const int end = lim < p1 ? lim : p1;

  const float cs = ckv_scale_ptr ? hal_ld(ckv_scale_ptr) : ckv_scale_val;
  const float ps = kpe_scale_ptr ? hal_ld(kpe_scale_ptr) : kpe_scale_val;
  const float ratio = ps / cs;                // rope logits into the latent's units
  const float c2 = cs * scale * kLog2e;       // latent units -> log2 units

  // Q^T as the B operand of S^T: chunk c (of [rope | latent]) holds dims 16c + 4r + e of row c16.
  u16x4 qb[CH];
  {
    const u16* qn = static_cast<const u16*>(q_nope) + (i64)(q0 + tq) * qn_stride_tok + (i64)head * qn_stride_head;
    const u16* qp = static_cast<const u16*>(q_pe) + (i64)(q0 + tq) * qp_stride_tok + (i64)head * qp_stride_head;
    #pragma unroll
    for (int i = 0; i < CH; ++i) {
      const int c = cg * CH + i;
      const u16* src = c < kRopeChunks ? qp + 16 * c + 4 * r : qn + 16 * (c - kRopeChunks) + 4 * r;
      qb[i] = row_ok ? hal_ld(reinterpret_cast<const u16x4*>(src)) : u16x4{0, 0, 0, 0};
    }
  }
  // latent chunks into T by 2^e (per wave and row: lanes c16 + 16k hold the row's chunks), so that
  // the row's absmax a has a 2^e in [2^14, 2^15); e = 0 for a zero, infinite or NaN absmax.
  float unscale = 1.0f;
  if constexpr (kRescale) {
    float amax = 0.0f;
    #pragma unroll
    for (int i = 0; i < CH; ++i)
      if (!(cg == 0 && i < kRopeChunks))
        #pragma unroll
        for (int e = 0; e < 4; ++e) amax = hal_fmaxf(amax, hal_fabsf(Q::to_f32(qb[i][e])));
    amax = hal_fmaxf(amax, hal_shfl_xor(amax, 16));
    amax = hal_fmaxf(amax, hal_shfl_xor(amax, 32));
    int e2 = amax > 0.0f && amax <= 3.4028235e38f ? 14 - exponent_of(amax) : 0;
    e2 = e2 < -126 ? -126 : (e2 > 126 ? 126 : e2);
    const float up = hal_pow2i(e2);
    unscale = hal_pow2i(-e2);
    #pragma unroll
    for (int i = 0; i < CH; ++i)
      if (!(cg == 0 && i < kRopeChunks))
        #pragma unroll
        for (int e = 0; e < 4; ++e) qb[i][e] = T::from_f32(Q::to_f32(qb[i][e]) * up);
  }

  // Staging: thread t fills token t/16 of the step; its 16-byte chunks fk + 16i of the latent and
  // 8 bytes (4 dims) of the rope, so each wave's load covers 4 tokens x 256 contiguous bytes.
  const int fj = tid >> 4, fk = tid & 15;
  const int bmask = (1 << block_size_log2) - 1;
  u32x4 lat[kLoads];
  u32x2 rope;
  auto load_step = [&](int s) {
    const int pos = s + fj;
    if (pos < p1) {
      const i64 blk = hal_ld(block_tables + seq * bt_stride + (pos >> block_size_log2));
      const i64 off = pos & bmask;
      const u32x4* crow = reinterpret_cast<const u32x4*>(static_cast<const CE*>(ckv_cache) + blk * ckv_block_stride +
                                                         off * ckv_token_stride);
      #pragma unroll
      for (int i = 0; i < kLoads; ++i) lat[i] = hal_ld(crow + fk + 16 * i);
      const u16* prow = static_cast<const u16*>(kpe_cache) + blk * kpe_block_stride + off * kpe_token_stride;
      rope = hal_ld(reinterpret_cast<const u32x2*>(prow + 4 * fk));
    } else {  // past the partition (or the sequence): never read, zeros in LDS
      #pragma unroll
      for (int i = 0; i < kLoads; ++i) lat[i] = u32x4{0u, 0u, 0u, 0u};
      rope = u32x2{0u, 0u};
    }
  };
  auto store_step = [&]() {
    u16* trow = &lds.tile[fj][0];
    lds_st(trow + 4 * fk, rope);
    constexpr int kElems = 16 / CACHE::kBytes;  // latent elements per 16-byte chunk
    #pragma unroll
    for (int i = 0; i < kLoads; ++i) widen_store<CACHE, T>(trow + kP + kElems * (fk + 16 * i), lat[i]);
  };

  float m_run = kNegInf, l_run = 0.0f;  // row c16's running max (log2 units) and this lane's sum
  f32x4 acc[NM];
  #pragma unroll
  for (int m = 0; m < NM; ++m) acc[m] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};

  const int nsteps = p1 > p0 ? (p1 - p0 + kStep - 1) / kStep : 0;
  if (nsteps > 0) load_step(p0);
  for (int it = 0; it < nsteps; ++it) {  // workgroup-uniform loop
    const int s = p0 + kStep * it;
    hal_syncthreads();  // every wave is done with the previous step's tile
    store_step();
    if (it + 1 < nsteps) load_step(s + kStep);  // in flight during this step's math
    hal_syncthreads();  // the tile is complete

    // S^T partial over this wave's chunks: A = K (token c16: dims 16c + 4r + e), B = Q^T; the rope
    // chunks are wave 0's first four
    f32x4 sn = {0.0f, 0.0f, 0.0f, 0.0f}, sr = {0.0f, 0.0f, 0.0f, 0.0f};
    const u16* krow = &lds.tile[c16][4 * r];
    #pragma unroll
    for (int i = 0; i < CH; ++i) {
      const u16x4 k = lds_ld<u16x4>(krow + 16 * (cg * CH + i));
      if (i < kRopeChunks && cg == 0) sr = Q::mfma(k, qb[i], sr);
      else sn = T::mfma(k, qb[i], sn);
    }
    lds.part[wave][lane] = sn * unscale + sr * ratio;  // latent units (unscale: exact power of two)
    hal_syncthreads();  // the group's partials are complete
    f32x4 st = lds.part[rg * CW][lane];
    #pragma unroll
    for (int w = 1; w < CW; ++w) st += lds.part[rg * CW + w][lane];

    // mask, row max over the step (lanes c16 + 16k share a row), online softmax
    float x[4], mx = kNegInf;
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e] = s + 4 * r + e < end ? st[e] * c2 : kNegInf;
      mx = hal_fmaxf(mx, x[e]);
    }
    mx = hal_fmaxf(mx, hal_shfl_xor(mx, 16));
    mx = hal_fmaxf(mx, hal_shfl_xor(mx, 32));
    const float m_new = hal_fmaxf(m_run, mx);
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    const float alpha = hal_exp2(m_run - m_use);
    u16x4 pb;  // P^T as the B operand of PV (tokens 4r + e, row c16), rounded to the MFMA type T
    float psum = 0.0f;
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const u16 h = T::from_f32(hal_exp2(x[e] - m_use));
      pb[e] = h;
      psum += T::to_f32(h);
    }
    l_run = l_run * alpha + psum;
    m_run = m_new;
    #pragma unroll
    for (int m = 0; m < NM; ++m) acc[m] *= alpha;

    // O^T += V^T P^T: lane row c16 of MFMA m is column cg*C + NM*c16 + m; its tokens 4r + e
    const u16* vrow = &lds.tile[4 * r][kP + cg * C + NM * c16];
    #pragma unroll
    for (int h8 = 0; h8 < NM / 8; ++h8) {
      u32 v[4][4];  // 8 consecutive columns of each of the lane's 4 tokens
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const u32x4 t = lds_ld<u32x4>(vrow + e * kStride + 8 * h8);
        #pragma unroll
        for (int j = 0; j < 4; ++j) v[e][j] = t[j];
      }
      #pragma unroll
      for (int mm = 0; mm < 8; ++mm) {
        u16x4 a;
        #pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = (u16)(v[e][mm / 2] >> (16 * (mm % 2)));
        acc[8 * h8 + mm] = T::mfma(a, pb, acc[8 * h8 + mm]);
      }
    }
  }

  // the row's sum over its 4 lanes (the rows' max is already row-wide)
  l_run += hal_shfl_xor(l_run, 16);
  l_run += hal_shfl_xor(l_run, 32);
  if (!row_ok) return;

  // lane holds columns cg*C + NM*(4r + e) + m of its row: 4*NM consecutive ones from d0
  const int d0 = cg * C + 4 * NM * r;
  const i64 orow = q0 + tq;
  if (num_parts == 1) {
    const float k = l_run == 0.0f ? 0.0f : cs / l_run;  // no key (empty sequence): zeros; NaN stays
    u16 o[4 * NM];
    #pragma unroll
    for (int e = 0; e < 4; ++e)
      #pragma unroll
      for (int m = 0; m < NM; ++m) o[NM * e + m] = Q::from_f32(acc[m][e] * k);
    pa::store_run<4 * NM>(static_cast<u16*>(out) + orow * o_stride_tok + head * o_stride_head + d0, o);
  } else {
    const i64 slot = (orow * H + head) * num_parts + part;
    if (m_run != kNegInf) {  // a row with no key here leaves its partial unwritten (the merge skips it)
      u32 w[4 * NM];
      #pragma unroll
      for (int e = 0; e < 4; ++e)
        #pragma unroll
        for (int m = 0; m < NM; ++m) {
          const float a = acc[m][e];
          w[NM * e + m] = __builtin_bit_cast(u32, a);
        }
      pa::store_words<4 * NM>(tmp_out + slot * kR + d0, w);
    }
    if (cg == 0 && r == 0) hal_st(reinterpret_cast<f32x2*>(part_ml) + slot, f32x2{m_run, l_run});
  }
}

}  // namespace mla
