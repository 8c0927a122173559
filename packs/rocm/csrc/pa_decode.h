// Paged decode attention, one workgroup (4 wave64s) per (sequence, partition, KV head x GQA tile).
//
// Anatomy (docs/rocm.md has the full picture and where it follows or departs from vLLM's
// ll4mi_QKV_mfma16 kernel):
//  * All query heads of a GQA group (up to 16; larger groups are split into tiles, one per workgroup)
//    share one 16x16x16 MFMA tile, so each K and V byte is read once per tile.
//  * A partition of `partition_size` tokens (a multiple of 256) is walked in chunks of 256; for QK,
//    wave w takes tokens [64w, 64w + 64) of each chunk as four 16-token MFMA tiles.
//  * QK: logits^T[token][head] = sum_d K[token][d] Q[head][d] with A = K (cache rows, 16-byte loads),
//    B = Q (registers). The head dimension is walked in a permuted order so that every lane loads 16
//    contiguous bytes of K: in MFMA chunk c = f*(E/4) + cc, lane group r holds d = 4E*f + E*r + 4*cc + e
//    (E = cache elements per 16 bytes), for A and B alike.
//  * Softmax: each wave's max per head goes to LDS; the chunk max over the four waves drives an online
//    softmax across the partition's chunks (running max, sum and output rescaled per chunk).
//  * The QK result lands with lane l holding head l%16 and tokens 4*(l/16) + e: exactly the B operand
//    (P^T) of the PV product out^T[d][head] = sum_t V^T[d][t] P^T[t][head]. Each lane stores its
//    probabilities to LDS in that layout, and PV splits the head dimension across the waves (as vLLM
//    does): wave w owns d in [w*D/4, (w+1)*D/4) over all 256 tokens of the chunk, so its accumulators
//    are D/16 floats per lane. A = V^T: row l%16 of MFMA m is d = w*D/4 + (D/64)*(l%16) + m, and lane l
//    loads those D/64 elements of each of its four tokens.
//  * FP8: k_scale is folded into the logit scale, v_scale into the output; bytes are converted to the
//    MFMA operand type exactly (formats.h). Probabilities are rounded to the PV operand type (f16 for
//    FP8 caches, whatever the query type: V values are exact in f16, and f16 keeps 3 more bits of P
//    than bf16); the softmax sum adds the rounded values, so the weights sum to 1 as used.
//  * Results: one partition -> the output row directly; several -> fp32 partials (unnormalised sums
//    times v_scale) plus the partition's max logit and sum, combined by pa_reduce.h.
#pragma once
#include "formats.h"

namespace pa {

constexpr int kChunk = 256;  // tokens per workgroup step: 4 waves x 4 MFMA tiles x 16 tokens

struct DecodeLds {
  u16x4 p[16][64];  // the chunk's probabilities as PV B operands: tile T (tokens 16T..16T+15), lane
  i32 blk[256];     // block of each token of the chunk
  float mx[4][16];  // per wave, per head: max logit of the wave's 64 tokens
  float l[4][16];   // per wave, per head: sum of probabilities
};

HAL_DEV float tanh_f32(float x) {
  float a = hal_fabsf(x);
  float r;
  if (a < 0.0625f) {  // odd series; (1 - t)/(1 + t) would cancel here
    float x2 = a * a;
    r = a * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f)));
  } else {
    float t = hal_exp2(-2.0f * kLog2e * a);
    r = (1.0f - t) / (1.0f + t);
  }
  return x < 0 ? -r : r;
}

// `NW` 32-bit words from p (p aligned to min(4 * NW, 16) bytes), with the widest loads that fit.
template <int NW> HAL_DEV void load_words(const void* p, u32* w) {
  if constexpr (NW == 1) {
    w[0] = hal_ld(static_cast<const u32*>(p));
  } else if constexpr (NW == 2) {
    u32x2 v = hal_ld(static_cast<const u32x2*>(p));
    w[0] = v[0];
    w[1] = v[1];
  } else {
    #pragma unroll
    for (int i = 0; i < NW / 4; ++i) {
      u32x4 v = hal_ld(static_cast<const u32x4*>(p) + i);
      #pragma unroll
      for (int j = 0; j < 4; ++j) w[4 * i + j] = v[j];
    }
  }
}
template <int NW> HAL_DEV void store_words(void* p, const u32* w) {
  if constexpr (NW == 1) {
    hal_st(static_cast<u32*>(p), w[0]);
  } else if constexpr (NW == 2) {
    hal_st(static_cast<u32x2*>(p), u32x2{w[0], w[1]});
  } else {
    #pragma unroll
    for (int i = 0; i < NW / 4; ++i)
      hal_st(static_cast<u32x4*>(p) + i, u32x4{w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]});
  }
}

// N consecutive cache elements (1 to 8 bytes) as words, first element in the low bits.
template <class CE, int N> HAL_DEV void load_run(const CE* p, u32* w) {
  constexpr int bytes = N * (int)sizeof(CE);
  if constexpr (bytes == 1) w[0] = hal_ld(reinterpret_cast<const u8*>(p));
  else if constexpr (bytes == 2) w[0] = hal_ld(reinterpret_cast<const u16*>(p));
  else load_words<bytes / 4>(p, w);
}

// Column m of four tokens' runs (token e in w[e]): the A operand {V[t0][m], .., V[t3][m]} as T bits.
template <class CACHE, class T, int VW> HAL_DEV u16x4 column(const u32 (*w)[VW], int m) {
  if constexpr (CACHE::kFp8) {
    u32 packed = 0;
    #pragma unroll
    for (int e = 0; e < 4; ++e) packed |= ((w[e][0] >> (8 * m)) & 0xffu) << (8 * e);
    float f[4];
    fp8x4_decode<typename CACHE::Enc>(packed, f);
    return u16x4{T::from_f32(f[0]), T::from_f32(f[1]), T::from_f32(f[2]), T::from_f32(f[3])};
  } else {
    u16x4 a;
    #pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = (u16)(w[e][m / 2] >> (16 * (m % 2)));
    return a;
  }
}

// N consecutive 16-bit values to p.
template <int N> HAL_DEV void store_run(u16* p, const u16* v) {
  u32 w[N / 2];
  #pragma unroll
  for (int i = 0; i < N / 2; ++i) w[i] = (u32)v[2 * i] | ((u32)v[2 * i + 1] << 16);
  store_words<N / 2>(p, w);
}

HAL_DEV u16x4 words_to_u16x4(u32 lo, u32 hi) { return __builtin_bit_cast(u16x4, u32x2{lo, hi}); }

// Four consecutive cache elements (in `w`, starting at element `i`) as operand type T bits.
template <class CACHE, class T> HAL_DEV u16x4 cache4_as(const u32* w, int i) {
  if constexpr (CACHE::kFp8) {
    float f[4];
    fp8x4_decode<typename CACHE::Enc>(w[i / 4], f);
    return u16x4{T::from_f32(f[0]), T::from_f32(f[1]), T::from_f32(f[2]), T::from_f32(f[3])};
  } else {
    return words_to_u16x4(w[i / 2], w[i / 2 + 1]);
  }
}

template <int BYTES> struct Elem;
template <> struct Elem<1> { using type = u8; };
template <> struct Elem<2> { using type = u16; };

template <class CACHE> struct PvOperand { using type = F16; };
template <class T16> struct PvOperand<Cache16<T16>> { using type = T16; };

#define HAL_PA_DECODE_PARAMS                                                                                  \
  void *__restrict__ out, float *__restrict__ tmp_out, float *__restrict__ exp_sums,                          \
      float *__restrict__ max_logits, const void *__restrict__ query, const void *__restrict__ key_cache,    \
      const void *__restrict__ value_cache, const i32 *__restrict__ block_tables,                             \
      const i32 *__restrict__ seq_lens, const i32 *__restrict__ query_start_loc,                             \
      const float *__restrict__ k_scale_ptr, const float *__restrict__ v_scale_ptr,                          \
      const float *__restrict__ alibi_slopes, i64 q_stride_seq, i64 q_stride_head, i64 o_stride_seq,         \
      i64 o_stride_head, i64 k_block_stride, i64 k_head_stride, i64 k_token_stride, i64 v_block_stride,      \
      i64 v_head_stride, i64 v_token_stride, i64 bt_stride, float scale, float k_scale_val,                  \
      float v_scale_val, float soft_cap, i32 num_kv_heads, i32 gqa_ratio, i32 num_tiles,                     \
      i32 block_size_log2, i32 sliding_window, i32 partition_size, i32 max_parts,                            \
      i32 k_scale_stride, i32 v_scale_stride
#define HAL_PA_DECODE_ARGS                                                                                    \
  out, tmp_out, exp_sums, max_logits, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, \
      k_scale_ptr, v_scale_ptr, alibi_slopes, q_stride_seq, q_stride_head, o_stride_seq, o_stride_head,       \
      k_block_stride, k_head_stride, k_token_stride, v_block_stride, v_head_stride, v_token_stride,          \
      bt_stride, scale, k_scale_val, v_scale_val, soft_cap, num_kv_heads, gqa_ratio, num_tiles,              \
      block_size_log2, sliding_window, partition_size, max_parts, k_scale_stride, v_scale_stride

template <class Q, class CACHE, int D>
HAL_DEV void decode(HAL_PA_DECODE_PARAMS) {
  static_assert(D == 64 || D == 128 || D == 256, "head sizes 64, 128, 256");
  using PV = typename PvOperand<CACHE>::type;
  using CE = typename Elem<CACHE::kBytes>::type;  // a cache element's storage
  constexpr int E = 16 / CACHE::kBytes;  // cache elements per 16-byte K fetch
  constexpr int NF = D / (4 * E);        // K fetches per token per lane
  constexpr int NC = D / 16;             // QK MFMA chunks over the head dimension
  constexpr int VD = D / 64;             // V elements per token per lane = PV MFMAs per tile
  constexpr int VW = (VD * CACHE::kBytes + 3) / 4;  // ... as 32-bit words

  HAL_SHARED(DecodeLds, lds);
  const int seq = (int)hal_bid_x(), part = (int)hal_bid_y(), z = (int)hal_bid_z();
  const int kvh = z / num_tiles, tile_g = z % num_tiles;
  const int tid = (int)hal_tid(), lane = (int)hal_lane(), wave = (int)hal_wave();
  const int r = lane >> 4, c16 = lane & 15;
  // qrow: the sequence's query (and output) row. With query_start_loc (a mixed batch) only sequences
  // of exactly one query token are this kernel's; pa_prefill.h takes the others in the same call.
  int qrow = seq;
  if (query_start_loc) {
    qrow = hal_ld(query_start_loc + seq);
    if (hal_ld(query_start_loc + seq + 1) - qrow != 1) return;  // workgroup-uniform
  }
  const int L = hal_ld(seq_lens + seq);
  const int first = sliding_window > 0 && L > sliding_window ? L - sliding_window : 0;
  const int first_part = first / partition_size;
  const int nparts = L > 0 ? (L - 1) / partition_size - first_part + 1 : 0;
  const int num_heads = num_kv_heads * gqa_ratio;
  const int head0 = kvh * gqa_ratio + tile_g * 16;
  const int nh = gqa_ratio - tile_g * 16 < 16 ? gqa_ratio - tile_g * 16 : 16;

  if (part >= nparts) {
    if (part == 0) {  // empty sequence: a row of zeros
      for (int i = tid; i < nh * D; i += 256)
        hal_st(static_cast<u16*>(out) + qrow * o_stride_seq + (head0 + i / D) * o_stride_head + i % D, (u16)0);
    }
    return;
  }
  const int p = first_part + part;
  const int t_begin = p * partition_size > first ? p * partition_size : first;
  const int t_end = (p + 1) * partition_size < L ? (p + 1) * partition_size : L;
  const int bs = 1 << block_size_log2;

  const float ks = k_scale_ptr ? hal_ld(k_scale_ptr + kvh * k_scale_stride) : k_scale_val;
  const float vs = v_scale_ptr ? hal_ld(v_scale_ptr + kvh * v_scale_stride) : v_scale_val;
  const float qk_scale = scale * ks;
  const float inv_cap = soft_cap > 0 ? 1.0f / soft_cap : 0.0f;
  const bool head_ok = c16 < nh;
  const float slope = alibi_slopes && head_ok ? hal_ld(alibi_slopes + head0 + c16) : 0.0f;

  // Q as the B operand of QK: chunk c = f*(E/4) + cc holds d = 4E*f + E*r + 4*cc + e.
  u16x4 qb[NC];
  {
    const u16* qptr = static_cast<const u16*>(query) + (i64)qrow * q_stride_seq + (head0 + c16) * q_stride_head;
    #pragma unroll
    for (int f = 0; f < NF; ++f) {
      u32 w[E / 2];
      if (head_ok) {
        load_words<E / 2>(qptr + 4 * E * f + E * r, w);
      } else {
        #pragma unroll
        for (int i = 0; i < E / 2; ++i) w[i] = 0;
      }
      #pragma unroll
      for (int cc = 0; cc < E / 4; ++cc) qb[f * (E / 4) + cc] = words_to_u16x4(w[2 * cc], w[2 * cc + 1]);
    }
  }

  // cache rows through their strides (an NHD cache's HND view too); the head dimension is contiguous
  const CE* kc = static_cast<const CE*>(key_cache) + (i64)kvh * k_head_stride;
  // this wave's quarter of the head dimension; lane row c16 of PV MFMA m is d = D/4*wave + VD*c16 + m
  const CE* vc = static_cast<const CE*>(value_cache) + (i64)kvh * v_head_stride + (D / 4) * wave + VD * c16;
  float m_run = kNegInf, l_run = 0.0f;
  f32x4 acc[VD];
  #pragma unroll
  for (int m = 0; m < VD; ++m) acc[m] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};

  const int c_first = p * partition_size + (t_begin - p * partition_size) / kChunk * kChunk;
  for (int c0 = c_first; c0 < t_end; c0 += kChunk) {  // workgroup-uniform loop
    const int my_t = c0 + tid;  // work-item t looks up the block of token c0 + t
    const int my_blk = my_t >= t_begin && my_t < t_end ? hal_ld(block_tables + seq * bt_stride + (my_t >> block_size_log2)) : 0;
    lds.blk[tid] = my_blk;

    // QK: s[tile][e] = logit of token w0 + 16*tile + 4r + e for head c16 (w0: this wave's 64 tokens)
    const int w0 = c0 + 64 * wave;
    float s[4][4];
    #pragma unroll
    for (int tile = 0; tile < 4; ++tile) {
      const int tok = w0 + 16 * tile + c16;
      const int blk = hal_bpermute((16 * tile + c16) << 2, my_blk);
      // Tokens outside [t_begin, t_end) have block 0 (my_blk), a block of the cache: their K is read
      // from there (never through the block table's junk entries) and their logits are masked below.
      u32 kw[NF][4];
      const CE* krow = kc + (i64)blk * k_block_stride + (i64)(tok & (bs - 1)) * k_token_stride;
      #pragma unroll
      for (int f = 0; f < NF; ++f) load_words<4>(krow + 4 * E * f + E * r, kw[f]);
      f32x4 c = {0.0f, 0.0f, 0.0f, 0.0f};
      #pragma unroll
      for (int f = 0; f < NF; ++f)
        #pragma unroll
        for (int cc = 0; cc < E / 4; ++cc) c = Q::mfma(cache4_as<CACHE, Q>(kw[f], 4 * cc), qb[f * (E / 4) + cc], c);
      #pragma unroll
      for (int e = 0; e < 4; ++e) s[tile][e] = c[e];
    }

    // scale, soft-cap, ALiBi, mask; this wave's max per head (lanes c16 + 16k share a head)
    float mx = kNegInf;
    #pragma unroll
    for (int tile = 0; tile < 4; ++tile)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = w0 + 16 * tile + 4 * r + e;
        float x = s[tile][e] * qk_scale;
        if (soft_cap > 0) x = soft_cap * tanh_f32(x * inv_cap);
        x += slope * (float)(t - (L - 1));
        if (t < t_begin || t >= t_end) x = kNegInf;
        s[tile][e] = x;
        mx = hal_fmaxf(mx, x);
      }
    mx = hal_fmaxf(mx, hal_shfl_xor(mx, 16));
    mx = hal_fmaxf(mx, hal_shfl_xor(mx, 32));
    if (r == 0) lds.mx[wave][c16] = mx;
    hal_syncthreads();

    // online softmax over chunks, with the chunk max of all four waves
    #pragma unroll
    for (int w = 0; w < 4; ++w) mx = hal_fmaxf(mx, lds.mx[w][c16]);
    const float m_new = hal_fmaxf(m_run, mx);
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    const float alpha = hal_exp2((m_run - m_use) * kLog2e);
    float psum = 0.0f;
    #pragma unroll
    for (int tile = 0; tile < 4; ++tile) {
      u16x4 pb;  // P^T as the B operand of PV (tokens 4r + e, head c16), rounded to the PV type
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const u16 h = PV::from_f32(hal_exp2((s[tile][e] - m_use) * kLog2e));
        pb[e] = h;
        psum += PV::to_f32(h);
      }
      lds.p[4 * wave + tile][lane] = pb;
    }
    l_run = l_run * alpha + psum;
    #pragma unroll
    for (int m = 0; m < VD; ++m) acc[m] *= alpha;
    m_run = m_new;
    hal_syncthreads();

    // PV over the chunk's 16 tiles: A = V^T (row c16: d = D/4*wave + VD*c16 + m; column 4r + e:
    // token c0 + 16*T + 4r + e), B = P^T from LDS
    #pragma unroll 1
    for (int T = 0; T < 16; ++T) {
      u32 vt[4][VW];  // token e's VD elements
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * T + 4 * r + e, tok = c0 + i;
        if (tok >= t_begin && tok < t_end) {
          load_run<CE, VD>(vc + (i64)lds.blk[i] * v_block_stride + (i64)(tok & (bs - 1)) * v_token_stride, vt[e]);
        } else {
          #pragma unroll
          for (int j = 0; j < VW; ++j) vt[e][j] = 0;
        }
      }
      const u16x4 pb = lds.p[T][lane];
      #pragma unroll
      for (int m = 0; m < VD; ++m) acc[m] = PV::mfma(column<CACHE, PV, VW>(vt, m), pb, acc[m]);
    }
    hal_syncthreads();  // before the next chunk overwrites blk / mx / p
  }

  // sums per head over all lanes and waves
  l_run += hal_shfl_xor(l_run, 16);
  l_run += hal_shfl_xor(l_run, 32);
  if (r == 0) lds.l[wave][c16] = l_run;
  hal_syncthreads();
  if (!head_ok) return;
  const float Lsum = (lds.l[0][c16] + lds.l[1][c16]) + (lds.l[2][c16] + lds.l[3][c16]);

  // lane holds d = D/4*wave + VD*(4r + e) + m of head c16: D/16 consecutive outputs from d0
  const int head = head0 + c16, d0 = (D / 4) * wave + (D / 16) * r;
  if (nparts == 1) {
    const float k = vs / Lsum;
    u16 o[D / 16];
    #pragma unroll
    for (int e = 0; e < 4; ++e)
      #pragma unroll
      for (int m = 0; m < VD; ++m) o[VD * e + m] = Q::from_f32(acc[m][e] * k);
    store_run<D / 16>(static_cast<u16*>(out) + (i64)qrow * o_stride_seq + head * o_stride_head + d0, o);
  } else {
    const i64 row = ((i64)seq * num_heads + head) * max_parts + part;
    u32 w[D / 16];
    #pragma unroll
    for (int e = 0; e < 4; ++e)
      #pragma unroll
      for (int m = 0; m < VD; ++m) w[VD * e + m] = __builtin_bit_cast(u32, acc[m][e] * vs);
    store_words<D / 16>(tmp_out + row * D + d0, w);
    if (d0 == 0) {
      hal_st(exp_sums + row, Lsum);
      hal_st(max_logits + row, m_run);
    }
  }
}

}  // namespace pa
