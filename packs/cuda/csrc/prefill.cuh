// Multi-token paged attention (prefill, chunked prefill, the multi-token sequences of a mixed batch)
// on tensor cores (mma.sync m16n8k16, sm89+), FlashAttention-2 style: one CTA of 4 warps per
// (sequence, tile of query rows, KV head), streaming K/V tiles through shared memory.
//
// Why this shape:
// * Rows are (query token, query head) pairs with the GQA heads of the KV head fastest (as in decode):
//   every K/V byte a CTA reads serves all of its group's query heads.
// * K/V tiles are gathered through the block table with cp.async (16-byte chunks, zero-filled outside
//   the keys the CTA's rows see, so no junk page or unwritten slot is ever read). 16-bit caches land
//   in the MMA operand tiles directly; FP8 caches land in a byte staging tile that all 128 threads
//   widen once (hardware cvt, exact for e4m3 and e5m2) into fp16 tiles shared by the four warps, so a
//   byte is converted once per CTA, not once per warp. The next tile's copies overlap this tile's math.
// * Each warp owns 16 x kMt rows: Q and K/V fragments come from shared memory by ldmatrix (rows padded
//   by 16 bytes: conflict-free), S = Q K^T and O += P V accumulate in fp32, P stays in registers
//   (the S accumulator is the A operand of PV with no shuffle). Online softmax in fp32 (log2 units).
// * Precision: Q is never rounded below its own 16 bits (a bf16 query against an FP8 cache is scaled
//   by a power of two into fp16, exactly, the factor folded into the logit scale); P is rounded to the
//   MMA's 16-bit type (fp16 with FP8 caches: 11 significant bits). Never FP8.
#pragma once
#include "common.cuh"
#include "params.h"

namespace hal_cuda {

constexpr int kPrefillThreads = 128;

template <int D> struct PrefillShape {
  static constexpr int kMt = D <= 128 ? 2 : 1;    // m16 row tiles a warp (registers: O is 16*kMt x D)
  static constexpr int kRows = 4 * 16 * kMt;      // query rows a CTA
  static constexpr int kN = D <= 128 ? 64 : 32;   // keys a step
  static constexpr int kStride = D + 8;           // 16-bit elements between shared rows (+16 bytes)
  static_assert(D % 16 == 0, "head size must be a multiple of 16");
};

template <Kind K, int D> constexpr int prefill_smem_bytes() {
  using S = PrefillShape<D>;
  return (S::kRows + 2 * S::kN) * S::kStride * 2 + (Traits<K>::kFp8 ? 2 * S::kN * D : 0);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool fill) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// The rows of a CTA and the keys they see (both kernels: this one and prefill_sm90.cuh). Rows are
// (token, GQA head) pairs of one sequence and KV head, the heads fastest; tile blockIdx.x % row_tiles
// counted from the end (the longest rows, the last tokens, first).
struct PrefillTile {
  int seq, kvh, q0, qlen, R0, R1, L;
  int base;              // position of the sequence's first new token (bottom-right aligned)
  int kv_lo, kv_hi;      // keys some row of the CTA sees
  int full_lo, full_hi;  // keys every row sees (a step inside them needs no mask)
};

// false: nothing for this CTA (a one-row sequence, the decode kernel's in a mixed call; or past its rows)
__device__ __forceinline__ bool prefill_tile(const PrefillParams& p, int rows, PrefillTile& t) {
  t.seq = blockIdx.x / p.row_tiles;
  const int tile = p.row_tiles - 1 - blockIdx.x % p.row_tiles;
  t.kvh = blockIdx.y;
  t.q0 = p.query_start_loc[t.seq];
  t.qlen = p.query_start_loc[t.seq + 1] - t.q0;
  if (t.qlen < p.min_rows) return false;
  const int nrows = t.qlen * p.gqa;
  t.R0 = tile * rows;
  if (t.R0 >= nrows) return false;
  t.R1 = min(t.R0 + rows, nrows) - 1;
  t.L = p.seq_lens[t.seq];
  t.base = t.L - t.qlen;
  const int pos_first = t.base + t.R0 / p.gqa, pos_last = t.base + t.R1 / p.gqa;
  t.kv_lo = p.window > 0 ? max(0, pos_first - p.window + 1) : 0;
  t.kv_hi = min(t.L, p.causal ? pos_last + 1 : t.L);
  t.full_lo = p.window > 0 ? max(0, pos_last - p.window + 1) : 0;
  t.full_hi = p.causal ? pos_first + 1 : t.L;
  return true;
}

// The CTA's kRows query rows into shared memory, row r's 8-column chunk ch at element off(r, ch); rows
// past R1 zero. kThreads threads (tid < kThreads, whole warps) take part; sync() joins them. A bf16 query
// over an FP8 cache is scaled exactly into fp16 by a power of two (the tile's largest magnitude into
// [2^14, 2^15), decode.cuh's rule) in place once its copies landed, and the factor to fold into the
// logit scale returned; otherwise the rows' copies are left in flight (the caller waits) and 1 returned.
template <bool kFp8, int D, int kRows, int kThreads, class Off, class Sync>
__device__ __forceinline__ float stage_query(const PrefillParams& p, const PrefillTile& t, uint16_t* sQ, int tid,
                                             Off off, Sync sync) {
  constexpr int CH = D / 8;
  auto q_row = [&](int r) -> const uint8_t* {  // row r: token (R0 + r) / gqa, head kvh * gqa + (R0 + r) % gqa
    const int R = t.R0 + r;
    return reinterpret_cast<const uint8_t*>(p.query) +
           ((int64_t)(t.q0 + R / p.gqa) * p.q_stride0 + (int64_t)(t.kvh * p.gqa + R % p.gqa) * p.q_stride1) * 2;
  };
  // every row by cp.async first: all of the tile's loads in flight at once (a load-then-use loop per
  // thread would pay one memory latency per chunk), rows past R1 zero-filled
  for (int c = tid; c < kRows * CH; c += kThreads) {
    const int r = c / CH, ch = c % CH;
    const bool ok = t.R0 + r <= t.R1;
    cp_async16(sQ + off(r, ch), ok ? q_row(r) + ch * 16 : static_cast<const uint8_t*>(p.query), ok);
  }
  if (!(kFp8 && p.q_is_bf16)) return 1.f;
  // a bf16 query over an FP8 cache: the tile's largest magnitude, then the rows rescaled in place (each
  // thread converts the chunks it copied)
  cp_async_commit();
  cp_async_wait_all();
  sync();
  __shared__ float red[kThreads / 32];
  float amax = 0.f;
  for (int c = tid; c < kRows * CH; c += kThreads) {
    const int r = c / CH, ch = c % CH;
    const uint4 v = *reinterpret_cast<const uint4*>(sQ + off(r, ch));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w[i] << 16)), fabsf(__uint_as_float(w[i] & 0xffff0000u))));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (tid % 32 == 0) red[tid / 32] = amax;
  sync();
  amax = red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, red[w]);
  float up = 1.f, qmul = 1.f;
  if (amax > 0.f && isfinite(amax)) {
    int e;
    frexpf(amax, &e);
    qmul = exp2f((float)(e - 15));
    up = exp2f((float)(15 - e));
  }
  for (int c = tid; c < kRows * CH; c += kThreads) {
    const int r = c / CH, ch = c % CH;
    uint4* q = reinterpret_cast<uint4*>(sQ + off(r, ch));
    const uint4 v = *q;
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = pack_f16x2(__uint_as_float(w[i] << 16) * up, __uint_as_float(w[i] & 0xffff0000u) * up);
    *q = make_uint4(o[0], o[1], o[2], o[3]);
  }
  return qmul;
}

template <Kind K, int D, bool kPlain>
__global__ void __launch_bounds__(kPrefillThreads, 2) prefill_kernel(const PrefillParams p) {
  // kPlain: no soft-cap and no ALiBi (compiled without their arithmetic)
  using SH = PrefillShape<D>;
  constexpr int MT = SH::kMt, ROWS = SH::kRows, N = SH::kN, ST = SH::kStride;
  constexpr int KB = D / 16, NT = N / 8, DT = D / 8;
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr bool kBf = Traits<K>::kBf16Math;  // FP8 caches compute in fp16 (their exact widening)
  constexpr int kBpe = Traits<K>::kBytes;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + ROWS * ST;
  uint16_t* sV = sK + N * ST;
  uint8_t* stK = reinterpret_cast<uint8_t*>(sV + N * ST);  // FP8 staging: N x D bytes each
  uint8_t* stV = stK + N * D;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  PrefillTile tl;
  if (!prefill_tile(p, ROWS, tl)) return;
  const int seq = tl.seq, kvh = tl.kvh, q0 = tl.q0, R0 = tl.R0, R1 = tl.R1, L = tl.L, base = tl.base;
  const int kv_lo = tl.kv_lo, kv_hi = tl.kv_hi, full_lo = tl.full_lo, full_hi = tl.full_hi;

  const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
  const int64_t k_head = (int64_t)kvh * p.k_head_stride, v_head = (int64_t)kvh * p.v_head_stride;

  // ---- K/V tiles: token rows j0 .. j0+N-1 (zeros outside [kv_lo, kv_hi): no table read there) ----
  constexpr int kChunks = D * kBpe / 16;  // 16-byte chunks a cache row
  auto load_rows = [&](int j0, const uint8_t* cache, int64_t block_stride, int64_t head_off, int64_t row,
                       uint16_t* tile16, uint8_t* staging) {
#pragma unroll 4
    for (int c = tid; c < N * kChunks; c += kPrefillThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const int j = j0 + r;
      const bool ok = j >= kv_lo && j < kv_hi;
      const int64_t page = ok ? table[j >> p.block_shift] : 0;
      const uint8_t* src = cache + page * block_stride + head_off + (int64_t)(j & (p.block_size - 1)) * row + ch * 16;
      void* dst = kFp8 ? static_cast<void*>(staging + r * D + ch * 16)
                       : static_cast<void*>(reinterpret_cast<uint8_t*>(tile16 + r * ST) + ch * 16);
      cp_async16(dst, ok ? src : cache, ok);
    }
  };
  auto load_k = [&](int j0) { load_rows(j0, p.key_cache, p.k_stride0, k_head, p.k_row, sK, stK); };
  auto load_v = [&](int j0) { load_rows(j0, p.value_cache, p.v_stride0, v_head, p.v_row, sV, stV); };
  auto widen = [&]() {  // FP8 staging -> fp16 tiles, 8 elements a thread a pass
#pragma unroll 4
    for (int c = tid; c < N * D / 8; c += kPrefillThreads) {
      const int r = c / (D / 8), col = (c % (D / 8)) * 8;
      const uint2 kb = *reinterpret_cast<const uint2*>(stK + r * D + col);
      const uint2 vb = *reinterpret_cast<const uint2*>(stV + r * D + col);
      *reinterpret_cast<uint4*>(sK + r * ST + col) =
          make_uint4(fp8x2_to_f16x2<K>(kb.x), fp8x2_to_f16x2<K, true>(kb.x), fp8x2_to_f16x2<K>(kb.y), fp8x2_to_f16x2<K, true>(kb.y));
      *reinterpret_cast<uint4*>(sV + r * ST + col) =
          make_uint4(fp8x2_to_f16x2<K>(vb.x), fp8x2_to_f16x2<K, true>(vb.x), fp8x2_to_f16x2<K>(vb.y), fp8x2_to_f16x2<K, true>(vb.y));
    }
  };

  // ---- Q tile (a power of two folded into the logit scale for a bf16 query over an FP8 cache) ----
  const float qmul = stage_query<kFp8, D, ROWS, kPrefillThreads>(
      p, tl, sQ, tid, [](int r, int ch) { return r * ST + ch * 8; }, [] { __syncthreads(); });

  const int j_begin = kv_lo & ~(N - 1);
  if (j_begin < kv_hi) {
    load_k(j_begin);
    if constexpr (kFp8) load_v(j_begin);
  }
  cp_async_commit();

  // ---- per-row facts of this thread's rows: (mt, hi) -> row warp*16*MT + mt*16 + g + 8*hi ----
  int pos[MT][2];
  float slope[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int R = min(R0 + warp * 16 * MT + mt * 16 + g + 8 * hi, R1);  // rows past R1: a real row's keys
      pos[mt][hi] = base + R / p.gqa;
      slope[mt][hi] = (!kPlain && p.alibi) ? p.alibi[kvh * p.gqa + R % p.gqa] : 0.f;
    }
  const float ks = p.k_scale_ptr ? p.k_scale_ptr[kvh * p.k_scale_stride] : p.k_scale;
  const float logit_scale = p.scale * ks * qmul;
  const float step_scale = kPlain ? logit_scale * kLog2e : logit_scale;

  float o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;

  const uint16_t* qbase = sQ + (warp * 16 * MT + (lane % 8) + 8 * ((lane / 8) & 1)) * ST + 8 * (lane / 16);
  const uint16_t* kbase = sK + (8 * (lane / 16) + (lane % 8)) * ST + 8 * ((lane / 8) & 1);
  const uint16_t* vbase = sV + (8 * ((lane / 8) & 1) + (lane % 8)) * ST + 8 * (lane / 16);

  for (int j0 = j_begin; j0 < kv_hi; j0 += N) {
    const bool more = j0 + N < kv_hi;
    cp_async_wait_all();
    __syncthreads();  // this step's K (FP8: K and V staging) landed; every warp is done with the last V
    if constexpr (kFp8) {
      widen();
      __syncthreads();  // fp16 tiles ready, staging free
      if (more) { load_k(j0 + N); load_v(j0 + N); }
      cp_async_commit();
    } else {
      load_v(j0);
      cp_async_commit();
    }

    // ---- S = Q K^T: per warp 16*MT rows x N keys ----
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], qbase + mt * 16 * ST + kb * 16);
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        uint32_t b[4];
        ldsm_x4(b, kbase + n2 * 16 * ST + kb * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<kBf>(s[mt][2 * n2], a[mt], b[0], b[1]);
          mma16816<kBf>(s[mt][2 * n2 + 1], a[mt], b[2], b[3]);
        }
      }
    }
    if constexpr (!kFp8) {
      cp_async_wait_all();
      __syncthreads();  // V landed; every warp is done with K
      if (more) load_k(j0 + N);
      cp_async_commit();
    }

    // ---- scale, soft-cap, ALiBi, mask; online softmax per row ----
    const bool masked = !(j0 >= full_lo && j0 + N <= full_hi);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int lo_j = p.window > 0 ? pos[mt][hi] - p.window + 1 : 0;
        const int hi_j = p.causal ? pos[mt][hi] : L - 1;
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float x = s[mt][nt][2 * hi + c] * step_scale;
            const int j = j0 + nt * 8 + 2 * t + c;
            if constexpr (!kPlain) {
              if (p.soft_cap > 0.f) x = p.soft_cap * tanhf(x / p.soft_cap);
              if (p.alibi) x += slope[mt][hi] * (float)(j - pos[mt][hi]);
              x *= kLog2e;
            }
            if (masked && (j < lo_j || j > hi_j)) x = -INFINITY;
            s[mt][nt][2 * hi + c] = x;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m[mt][hi], mx);
        const float ref = mn == -INFINITY ? 0.f : mn;
        const float alpha = fast_exp2(m[mt][hi] - ref);
        m[mt][hi] = mn;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float e = fast_exp2(s[mt][nt][2 * hi + c] - ref);
            s[mt][nt][2 * hi + c] = e;
            sum += e;
          }
        l[mt][hi] = l[mt][hi] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) { o[mt][dt][2 * hi] *= alpha; o[mt][dt][2 * hi + 1] *= alpha; }
      }
    }

    // ---- O += P V: the S accumulators of two n8 tiles are the A fragment of one k16 step ----
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        auto pack = [](float lo, float hi) { return kBf ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi); };
        pa[mt][0] = pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        uint32_t b[4];
        ldsm_x4_trans(b, vbase + kk * 16 * ST + d2 * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<kBf>(o[mt][2 * d2], pa[mt], b[0], b[1]);
          mma16816<kBf>(o[mt][2 * d2 + 1], pa[mt], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait_all();  // nothing left in flight when the CTA exits

  // ---- normalise and write this thread's rows ----
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float lsum = l[mt][hi];
      lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
      lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
      const int R = R0 + warp * 16 * MT + mt * 16 + g + 8 * hi;
      if (R > R1) continue;
      const float f = lsum == 0.f ? 0.f : vs / lsum;  // 0: no key (only a malformed call); NaN stays NaN
      uint8_t* orow = reinterpret_cast<uint8_t*>(p.out) +
                      ((int64_t)(q0 + R / p.gqa) * p.out_stride0 + (int64_t)(kvh * p.gqa + R % p.gqa) * p.out_stride1) * 2;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const float x0 = o[mt][dt][2 * hi] * f, x1 = o[mt][dt][2 * hi + 1] * f;
        *reinterpret_cast<uint32_t*>(orow + (dt * 8 + 2 * t) * 2) = p.q_is_bf16 ? pack_bf16x2(x0, x1) : pack_f16x2(x0, x1);
      }
    }
}

}  // namespace hal_cuda
