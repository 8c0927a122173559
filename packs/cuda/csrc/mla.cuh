// MLA decode (absorbed form) on tensor cores (mma.sync m16n8k16): one CTA of 8 warps per
// (sequence, tile of M rows, partition of the context); a row is a (query token, head) pair.
//
// Why this shape:
// * Every head reads the same latent, so the rows of a sequence (heads x speculative tokens) are the
//   M of the matrix products and each latent byte is read once per row tile: S = Q [M x 576] K^T,
//   O [M x 512] += P V, with K = [latent | rope] and V = the latent, one K/V tile in shared memory.
// * The warps form MW row groups of 16 x CW column groups. For S each warp owns 16 rows x N/CW
//   tokens (all 576 dims); for O it owns 16 rows x 512/CW columns (O in registers: 256/CW floats a
//   thread). The row max and the probabilities are exchanged through shared memory within a row
//   group (named barriers), so the CW warps of a group share one softmax.
// * M = 16 (MW 1) for <= 16 rows a sequence (memory-bound: 16 heads), 32, or 64 (MW 4: 128 heads,
//   two tiles, compute-bound, the second tile's latent reads mostly hit L2).
//   Where they run instead: 16-row tiles over an FP8 latent take mla_narrow.cuh, 64-row tiles on sm_90a
//   take mla_sm90.cuh (launch._mla_own_kernel); this kernel serves the rest on every arch.
// * 16-bit latents go global -> shared with cp.async. FP8 latents are loaded a tile ahead into
//   registers and widened with the hardware cvt (exact) into fp16 in shared memory after the tile's
//   MMAs, so the loads are in flight during the math. A bf16 query against an FP8 latent is moved
//   into fp16 by an exact power of two chosen per CTA from its absmax (undone on the logits in fp32).
//   The rotary part stays in the query's dtype; its logits are scaled into the latent's units in
//   fp32 before the latent's are added. P is rounded to the MMA's 16-bit type, never to FP8.
// * Positions past the partition or past a row's causal limit are masked; their rows are zero-filled,
//   never read from the cache (unused slots may hold any bytes).
#pragma once
#include "common.cuh"
#include "merge.cuh"
#include "mla_item.cuh"
#include "params.h"
#include <type_traits>

namespace hal_cuda {
namespace mla {

constexpr int kR = 512, kP = 64, kW = kR + kP;
constexpr int kStr = kW + 8;  // shared row stride in elements: 8 rows of an ldmatrix hit 32 banks once
constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

template <int MW> struct Tile {
  static constexpr int M = 16 * MW;          // rows per CTA
  static constexpr int CW = kWarps / MW;     // column groups
  static constexpr int N = MW == 4 ? 32 : 64;  // tokens per K/V tile (MW 4: O takes 128 registers)
  static constexpr int NW = N / CW;          // tokens of S per warp
  static constexpr int NT = NW / 8;          // n8 tiles of S per warp
  static constexpr int OC = kR / CW;         // output columns per warp
  static constexpr int ON = OC / 8;          // n8 tiles of O per warp
  static constexpr int PStr = N + 8;         // row stride of P in shared memory
  static constexpr int kPre = kR / 16 * N / kThreads;  // 16-byte FP8 chunks a thread prefetches
  static constexpr size_t kSmem = (size_t)(M + 2 * N) * kStr * 2 + (size_t)M * PStr * 2 + kWarps * 16 * 4;
  static_assert(NT >= 1 && ON % 2 == 0 && N * 8 % kThreads == 0, "tile shape");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// 16 bytes global -> shared; ok == false zero-fills (nothing is read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// The warps of one row group (barrier 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Q staging, shared by both MLA kernels. Chunk ch (0-63: q_nope, 64-71: q_pe; 8 elements) of row r of
// a sequence whose first query token is q0 (heads fastest); zeros past its `rows`.
__device__ __forceinline__ uint4 q_chunk(const MLAParams& p, int q0, int rows, int r, int ch) {
  if (r >= rows) return make_uint4(0, 0, 0, 0);
  const int tq = r / p.num_heads, h = r - tq * p.num_heads;
  const uint16_t* src = ch < 64
      ? static_cast<const uint16_t*>(p.q_nope) + (int64_t)(q0 + tq) * p.qn_stride0 + (int64_t)h * p.qn_stride1 + ch * 8
      : static_cast<const uint16_t*>(p.q_pe) + (int64_t)(q0 + tq) * p.qp_stride0 + (int64_t)h * p.qp_stride1 + (ch - 64) * 8;
  return __ldg(reinterpret_cast<const uint4*>(src));
}
__device__ __forceinline__ float absmax_bf16x8(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) m = fmaxf(m, fmaxf(fabsf(bf16_bits_to_f32(w[i] & 0xffffu)), fabsf(bf16_bits_to_f32(w[i] >> 16))));
  return m;
}
// The power of two 2^e that moves a bf16 query of absolute maximum amax into fp16 exactly: amax * 2^e in
// [2^14, 2^15) fits fp16 (max 65504) with room for its rounding; 1 for a zero or non-finite amax.
__device__ __forceinline__ float fp16_power_of_two(float amax) {
  const int e = amax > 0.f && amax <= 3.4e38f ? max(-126, min(126, 14 - ilogbf(amax))) : 0;
  return __int_as_float((e + 127) << 23);
}
__device__ __forceinline__ uint4 bf16x8_to_f16x8(uint4 v, float s2k) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = pack_f16x2(bf16_bits_to_f32(w[i] & 0xffffu) * s2k, bf16_bits_to_f32(w[i] >> 16) * s2k);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <Kind K, bool kQBf16, int MW>
__global__ void __launch_bounds__(kThreads, 1) mla_kernel(const MLAParams p) {
  using T = Tile<MW>;
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr bool kNopeBf16 = K == Kind::BF16;  // FP8 latents widen to fp16; 16-bit ones are the query's dtype
  constexpr bool kRescale = kFp8 && kQBf16;
  static_assert(kFp8 || (K == Kind::BF16) == kQBf16, "a 16-bit latent has the query's dtype");
  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem);     // [M][kStr]: q_nope (MMA type) | q_pe
  uint16_t* sk = sq + T::M * kStr;                      // [2][N][kStr]: latent (MMA type) | rope
  uint16_t* sp = sk + 2 * T::N * kStr;                  // [M][PStr]: probabilities
  float* sred = reinterpret_cast<float*>(sp + T::M * T::PStr);  // [kWarps][16]

  Item it;
  if (!mla_item<T::M>(p, it)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int rg = warp / T::CW, cg = warp % T::CW;
  const int H = p.num_heads;
  const int seq = it.seq, q0 = it.q0, qlen = it.qlen, rows = it.rows, r0 = it.r0, L = it.L, p0 = it.p0, p1 = it.p1;
  const bool split = it.split();

  // This thread's two rows (g, g + 8 of its row group): causal limit (exclusive) and output slot.
  int lim[2], orow[2], ohead[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + rg * 16 + g + 8 * e;
    const int tq = r / H;
    lim[e] = r < rows ? L - qlen + tq + 1 : 0;  // padding rows see nothing
    orow[e] = r < rows ? q0 + tq : -1;
    ohead[e] = r - tq * H;
  }
  if (split && p0 >= L) {  // CTA-uniform: an empty partition says so to the merge
    if (cg == 0 && t == 0)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (orow[e] >= 0) {
          const int64_t slot = it.slot(r0 + rg * 16 + g + 8 * e);
          p.part_ml[2 * slot] = -INFINITY;
          p.part_ml[2 * slot + 1] = 0.f;
        }
    if (p.counters) merge_if_last<T::M>(p, it, sred);
    return;
  }
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  const float ps = p.kpe_scale_ptr ? *p.kpe_scale_ptr : p.kpe_scale;

  // ---- Q tile -> shared (8-element chunks: 64 of q_nope, 8 of q_pe per row) ----
  float amax = 0.f;
  for (int c = tid; c < T::M * 72; c += kThreads) {
    const int row = c / 72, ch = c % 72;
    const uint4 v = q_chunk(p, q0, rows, r0 + row, ch);
    if (kRescale && ch < 64) amax = fmaxf(amax, absmax_bf16x8(v));
    *reinterpret_cast<uint4*>(sq + row * kStr + ch * 8) = v;
  }
  float s2k = 1.f;  // the power of two q_nope was multiplied by
  if constexpr (kRescale) {
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) sred[warp] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, sred[w]);
    s2k = fp16_power_of_two(amax);
    for (int c = tid; c < T::M * 64; c += kThreads) {  // in place: each thread its own chunks
      uint4* q = reinterpret_cast<uint4*>(sq + (c / 64) * kStr + (c % 64) * 8);
      *q = bf16x8_to_f16x8(*q, s2k);
    }
    __syncthreads();  // sred is reused below
  }

  // ---- K/V tiles ----
  const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
  const int bmask = p.block_size - 1;
  // A tile starts at a multiple of N, so with block_size >= N it lies in one page: one table read.
  const bool one_page = p.block_size >= T::N;
  int64_t page = 0;
  uint4 pre[kFp8 ? T::kPre : 1];
  // Issue tile s's loads into buffer b: rope (and a 16-bit latent) by cp.async, an FP8 latent into pre.
  // Loops with constant trip counts (unrolled): a thread's chunks of a tile are rows j0 + step * i
  // at one column, so a row's address is the previous one plus a constant on a one-page tile.
  auto load_tile = [&](int b, int s) {
    uint16_t* dst = sk + b * T::N * kStr;
    constexpr int NR = T::N * 8 / kThreads, NL = T::N * 64 / kThreads;  // chunks a thread (NL: 16-bit)
    // A tile over several pages: the page id of each of this thread's rows, all read before any is used
    // so that their latencies overlap (read beside each chunk's copy, each read's latency was paid in
    // turn before the copy could be issued: 2.5-5 % on pages of 16, H100). An FP8 latent's rows are
    // warp-uniform (row warp + 8i of chunk i): lane i reads row i's page id and the others take it by
    // shfl, so no address waits on a load issued beside the prefetch (read by each thread, ptxas gave
    // the ids and the prefetch one scoreboard, and every later address then waited for the prefetch
    // itself: 1.43x slower on pages of 16, H100, 64x4096x32; this way 4.7 % faster there than a read
    // beside each chunk).
    int pr[NR], pl[kFp8 ? 1 : NL], pf = 0;
    if (one_page) {
      page = table[s >> p.block_shift];
    } else {
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const int pos = s + ((tid + i * kThreads) >> 3);
        pr[i] = pos < p1 ? table[pos >> p.block_shift] : 0;
      }
      if constexpr (kFp8) {
        const int pos = s + warp + 8 * lane;
        if (lane < T::kPre && pos < p1) pf = table[pos >> p.block_shift];
      } else {
#pragma unroll
        for (int i = 0; i < NL; ++i) {
          const int pos = s + ((tid + i * kThreads) >> 6);
          pl[i] = pos < p1 ? table[pos >> p.block_shift] : 0;
        }
      }
    }
    const uint8_t* c0 = p.ckv + page * p.ckv_block_stride + (int64_t)(s & bmask) * p.ckv_token_stride;
    const uint8_t* k0 = p.kpe + page * p.kpe_block_stride + (int64_t)(s & bmask) * p.kpe_token_stride;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int c = tid + i * kThreads, j = c >> 3, ch = c & 7, pos = s + j;
      const bool ok = pos < p1;
      const uint8_t* src = one_page ? k0 + (int64_t)j * p.kpe_token_stride
                                    : p.kpe + (int64_t)pr[i] * p.kpe_block_stride + (int64_t)(pos & bmask) * p.kpe_token_stride;
      cp_async16(smem_addr(dst + j * kStr + kR + ch * 8), ok ? src + ch * 16 : p.kpe, ok);
    }
    if constexpr (!kFp8) {
#pragma unroll
      for (int i = 0; i < NL; ++i) {
        const int c = tid + i * kThreads, j = c >> 6, ch = c & 63, pos = s + j;
        const bool ok = pos < p1;
        const uint8_t* src = one_page ? c0 + (int64_t)j * p.ckv_token_stride
                                      : p.ckv + (int64_t)pl[i] * p.ckv_block_stride + (int64_t)(pos & bmask) * p.ckv_token_stride;
        cp_async16(smem_addr(dst + j * kStr + ch * 8), ok ? src + ch * 16 : p.ckv, ok);
      }
    } else {
#pragma unroll
      for (int i = 0; i < T::kPre; ++i) {
        const int c = tid + i * kThreads, j = c >> 5, ch = c & 31, pos = s + j;
        const int pg = __shfl_sync(0xffffffffu, pf, i);  // (warp-uniform: every lane takes part)
        const uint8_t* src = one_page ? c0 + (int64_t)j * p.ckv_token_stride
                                      : p.ckv + (int64_t)pg * p.ckv_block_stride + (int64_t)(pos & bmask) * p.ckv_token_stride;
        pre[i] = pos < p1 ? __ldg(reinterpret_cast<const uint4*>(src + ch * 16)) : make_uint4(0, 0, 0, 0);
      }
    }
    cp_async_commit();
  };
  // FP8 only: widen the prefetched latent into buffer b (16 bytes -> 32 bytes of fp16).
  auto store_tile = [&](int b) {
    if constexpr (kFp8) {
      uint16_t* dst = sk + b * T::N * kStr;
#pragma unroll
      for (int i = 0; i < T::kPre; ++i) {
        const int c = tid + i * kThreads, j = c >> 5, ch = c & 31;
        const uint32_t w[4] = {pre[i].x, pre[i].y, pre[i].z, pre[i].w};
        uint32_t h[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          h[2 * k] = fp8x2_to_f16x2<K>(w[k]);
          h[2 * k + 1] = fp8x2_to_f16x2<K, true>(w[k]);
        }
        uint4* d = reinterpret_cast<uint4*>(dst + j * kStr + ch * 16);
        d[0] = make_uint4(h[0], h[1], h[2], h[3]);
        d[1] = make_uint4(h[4], h[5], h[6], h[7]);
      }
    }
  };

  const int ntiles = p1 > p0 ? (p1 - p0 + T::N - 1) / T::N : 0;
  if (ntiles > 0) {
    load_tile(0, p0);
    store_tile(0);
    cp_async_wait_all();
  }
  __syncthreads();

  const float ratio = ps * s2k / cs;            // rope logits into the latent's (rescaled) units
  const float c2 = cs / s2k * p.scale * kLog2e;  // to log2 units
  float o[T::ON][4];
#pragma unroll
  for (int n = 0; n < T::ON; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m2[2] = {-INFINITY, -INFINITY}, l2[2] = {0.f, 0.f};
  const uint32_t qa = smem_addr(sq + (rg * 16 + (lane & 15)) * kStr + (lane >> 4) * 8);
  // One row group (16 rows) over a 16-bit latent: its Q fragments fit in registers, loaded once
  // instead of every tile (with FP8, the prefetched latent needs those registers).
  constexpr bool kQRegs = MW == 1 && !kFp8;
  constexpr int kChains = T::NT == 1 ? 2 : 1;
  uint32_t qf[kQRegs ? kW / 16 : 1][4];
  if constexpr (kQRegs) {
#pragma unroll
    for (int kk = 0; kk < kW / 16; ++kk) ldsm_x4(qf[kk], qa + kk * 32);
  }
  const uint32_t pa = smem_addr(sp + (rg * 16 + (lane & 15)) * T::PStr + (lane >> 4) * 8);

  for (int it = 0; it < ntiles; ++it) {
    const int b = it & 1, s = p0 + it * T::N;
    const bool more = it + 1 < ntiles;
    if (more) load_tile(b ^ 1, s + T::N);
    const uint16_t* kb = sk + b * T::N * kStr;

    // ---- S = Q K^T: rope dims first (query dtype), scaled into latent units, then the latent ----
    // kChains independent accumulator sets (alternate k steps) so the MMAs of a warp do not wait
    // on each other when it has a single n8 tile; summed after the product.
    float acc[kChains][T::NT][4];
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int j = 0; j < T::NT; ++j) acc[c][j][0] = acc[c][j][1] = acc[c][j][2] = acc[c][j][3] = 0.f;
    // B fragments: tokens cg*NW + j*8 + (lane & 7), dims +8 for lanes 8-15 (x4: lanes 16-31 the next n8)
    const uint32_t kaddr = smem_addr(kb + (cg * T::NW + (lane & 7) + ((lane >> 4) & 1) * 8) * kStr + ((lane >> 3) & 1) * 8);
    auto qk = [&](int kk, auto bf16_tag) {
      constexpr bool kBf = decltype(bf16_tag)::value;
      float (&sc)[T::NT][4] = acc[kk % kChains];
      uint32_t a[4];
      if constexpr (kQRegs) {
        a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3];
      } else {
        ldsm_x4(a, qa + kk * 32);
      }
      if constexpr (T::NT == 1) {
        uint32_t bb[2];
        ldsm_x2(bb, kaddr + kk * 32);
        mma16816<kBf>(sc[0], a, bb[0], bb[1]);
      } else {
#pragma unroll
        for (int j = 0; j < T::NT; j += 2) {
          uint32_t bb[4];
          ldsm_x4(bb, kaddr + j * 8 * kStr * 2 + kk * 32);
          mma16816<kBf>(sc[j], a, bb[0], bb[1]);
          mma16816<kBf>(sc[j + 1], a, bb[2], bb[3]);
        }
      }
    };
#pragma unroll
    for (int kk = kR / 16; kk < kW / 16; ++kk) qk(kk, std::integral_constant<bool, kQBf16>{});
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int j = 0; j < T::NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[c][j][e] *= ratio;
#pragma unroll
    for (int kk = 0; kk < kR / 16; ++kk) qk(kk, std::integral_constant<bool, kNopeBf16>{});
    float sc[T::NT][4];
#pragma unroll
    for (int j = 0; j < T::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[j][e] = acc[0][j][e];
#pragma unroll
        for (int c = 1; c < kChains; ++c) sc[j][e] += acc[c][j][e];
      }

    // ---- online softmax over the row group (log2 units) ----
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < T::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = s + cg * T::NW + j * 8 + 2 * t + (e & 1);
        const float x = pos < min(lim[e >> 1], p1) ? sc[j][e] * c2 : -INFINITY;
        sc[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
      mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
    }
    if (t == 0) sred[warp * 16 + g] = mx[0], sred[warp * 16 + g + 8] = mx[1];
    group_sync(1 + rg, T::CW * 32);
    float alpha[2], msafe[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mt = m2[e];
#pragma unroll
      for (int c = 0; c < T::CW; ++c) mt = fmaxf(mt, sred[(rg * T::CW + c) * 16 + g + 8 * e]);
      alpha[e] = mt == -INFINITY ? 1.f : fast_exp2(m2[e] - mt);
      msafe[e] = mt == -INFINITY ? 0.f : mt;
      m2[e] = mt;
    }
    float rs[2] = {0.f, 0.f};
    uint16_t* prow = sp + (rg * 16 + g) * T::PStr + cg * T::NW + 2 * t;
#pragma unroll
    for (int j = 0; j < T::NT; ++j) {
      float pe[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) pe[e] = fast_exp2(sc[j][e] - msafe[e >> 1]), rs[e >> 1] += pe[e];
      const uint32_t lo = kNopeBf16 ? pack_bf16x2(pe[0], pe[1]) : pack_f16x2(pe[0], pe[1]);
      const uint32_t hi = kNopeBf16 ? pack_bf16x2(pe[2], pe[3]) : pack_f16x2(pe[2], pe[3]);
      *reinterpret_cast<uint32_t*>(prow + j * 8) = lo;
      *reinterpret_cast<uint32_t*>(prow + 8 * T::PStr + j * 8) = hi;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) l2[e] = l2[e] * alpha[e] + rs[e];
#pragma unroll
    for (int n = 0; n < T::ON; ++n) o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    group_sync(1 + rg, T::CW * 32);

    // ---- O += P V (V = the latent: k = tokens, n = this warp's columns) ----
    const uint32_t vaddr = smem_addr(kb + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStr + cg * T::OC + (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < T::N / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4(a, pa + kk * 32);
#pragma unroll
      for (int n2 = 0; n2 < T::ON / 2; ++n2) {
        uint32_t bb[4];
        ldsm_x4_t(bb, vaddr + (kk * 16 * kStr + n2 * 16) * 2);
        mma16816<kNopeBf16>(o[2 * n2], a, bb[0], bb[1]);
        mma16816<kNopeBf16>(o[2 * n2 + 1], a, bb[2], bb[3]);
      }
    }
    if (more) {
      store_tile(b ^ 1);
      cp_async_wait_all();
    }
    __syncthreads();
  }

  // ---- the row sums over the group, then the output or this partition's partial ----
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l2[e] += __shfl_xor_sync(0xffffffffu, l2[e], 1);
    l2[e] += __shfl_xor_sync(0xffffffffu, l2[e], 2);
  }
  if (t == 0) sred[warp * 16 + g] = l2[0], sred[warp * 16 + g + 8] = l2[1];
  group_sync(1 + rg, T::CW * 32);
  float lsum[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    lsum[e] = 0.f;
#pragma unroll
    for (int c = 0; c < T::CW; ++c) lsum[e] += sred[(rg * T::CW + c) * 16 + g + 8 * e];
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (orow[e] < 0) continue;
    // lsum == 0: no key (an empty sequence gives zeros; an empty partition is skipped by the merge)
    const float inv = lsum[e] == 0.f ? 0.f : 1.f / lsum[e];
    if (!split) {
      char* base = static_cast<char*>(p.out) + ((int64_t)orow[e] * p.out_stride0 + (int64_t)ohead[e] * p.out_stride1) * 2;
#pragma unroll
      for (int n = 0; n < T::ON; ++n) {
        const int col = cg * T::OC + n * 8 + 2 * t;
        const float x = o[n][2 * e] * inv * cs, y = o[n][2 * e + 1] * inv * cs;
        *reinterpret_cast<uint32_t*>(base + col * 2) = p.q_is_bf16 ? pack_bf16x2(x, y) : pack_f16x2(x, y);
      }
    } else {
      const int64_t slot = it.slot(r0 + rg * 16 + g + 8 * e);
      float* dst = p.part_out + slot * kR;
#pragma unroll
      for (int n = 0; n < T::ON; ++n) {
        const int col = cg * T::OC + n * 8 + 2 * t;
        *reinterpret_cast<float2*>(dst + col) = make_float2(o[n][2 * e] * inv, o[n][2 * e + 1] * inv);
      }
      if (cg == 0 && t == 0) p.part_ml[2 * slot] = m2[e], p.part_ml[2 * slot + 1] = lsum[e];
    }
  }
  if (split && p.counters) merge_if_last<T::M>(p, it, sred);
}

}  // namespace mla
}  // namespace hal_cuda
