// MLA decode on Hopper (sm_90a): the contract and the row mapping of mla.cuh (rows are (query token,
// head) pairs, 64 a CTA), with both products on warpgroup MMAs (wgmma.cuh) fed by a producer warpgroup.
// Chosen for row tiles of 64 (more than 32 rows a sequence: 128 heads at TP 1, or speculative rows) by
// the tuning entry's "mla" "wgmma" (or launch.MLA_KERNEL).
//
// One CTA of three warpgroups (384 threads) per (sequence, 64 rows, partition of the context):
// * warpgroup 0, the producer (56 registers after setmaxnreg): Q into shared memory (a bf16 query over
//   an FP8 latent moved into fp16 by a power of two, as mla.cuh), then every K/V tile of 32 tokens
//   through the block table by cp.async: 16-bit caches straight into the operand buffers; FP8 latents
//   (and their 16-bit rope) into byte staging tiles a tile ahead, each thread widening the bytes it
//   copied with the hardware cvt (so the copies need no barrier).
// * warpgroups 1 and 2, the consumers (224 registers): both own the same 64 rows and half of O's 512
//   columns each (O: 128 fp32 registers a thread). S = Q K^T (64 x 32, Q and K from shared memory) is
//   split over its 576 dims: each consumer takes half of the latent's and half of the rope's (the rope in
//   its own accumulator, scaled into the latent's units in fp32). They swap their partial S through
//   shared memory, so both hold the same S and run the same online softmax; then O += P V (m64n256k16)
//   with P (16 bits, never FP8) and V (the latent, MN-major, from the K tile) in shared memory.
// The consumers issue S of tile i while the P V of tile i - 1 is still on the tensor cores; a K/V buffer
// is handed back (an "empty" mbarrier) once its P V is done. Producer and consumers meet at a "full" and
// an "empty" mbarrier per buffer.
//
// Shared-memory operand layout: wgmma's no-swizzle core matrices (8 rows x 16 bytes), as wgmma.cuh, but
// in the K/V tiles the core matrices of one row group lie 144 bytes apart instead of 128, so the 16-byte
// chunks a quarter-warp of the producer writes at once (4 chunks of each of two rows) land in distinct
// banks.
#pragma once
#include "mla.cuh"
#include "sync.cuh"
#include "wgmma.cuh"

namespace hal_cuda {
namespace mla {

struct Wg {
  static constexpr int kThreads = 384, kRows = 64, kN = 32;
  static constexpr int kChunks = kW / 8;           // 72 16-byte chunks of 16-bit elements in a K row
  static constexpr int kQCs = 128;                 // bytes between Q's core matrices along its dims
  static constexpr int kKCs = 144;                 // ... of the K/V tiles (padded, see above)
  static constexpr int kQGroup = kChunks * kQCs;   // bytes between 8-row groups of Q
  static constexpr int kKGroup = kChunks * kKCs;   // ... of a K/V tile
  static constexpr int kQBytes = kRows / 8 * kQGroup;
  static constexpr int kTile = kN / 8 * kKGroup;
  // FP8 staging rows: the latent's 512 bytes and the rope's 128; 704 = 64 mod 128, so the two rows a
  // quarter-warp copies (4 pieces each) fall in distinct banks
  static constexpr int kStageRow = 704;
  static constexpr int kStage = kN * kStageRow;
  // a consumer's area: its partial S (16 floats a thread), then its P (64 x 32, 16-bit: the A operand of
  // P V in wgmma's K-major core matrices)
  static constexpr int kXBytes = 2 * 16 * 128 * 4;
  template <bool kFp8> __host__ __device__ static constexpr int bufs() { return kFp8 ? 2 : 3; }
  template <bool kFp8> __host__ __device__ static constexpr int stages() { return kFp8 ? 2 : 0; }
  template <bool kFp8> __host__ __device__ static constexpr int smem() {
    return kQBytes + bufs<kFp8>() * kTile + stages<kFp8>() * kStage + kXBytes + 2 * bufs<kFp8>() * 8 + 32;
  }
};
static_assert(Wg::smem<true>() <= 227 * 1024 && Wg::smem<false>() <= 227 * 1024, "shared memory");

// Named barriers (0 is __syncthreads): the producer's own (Q's absmax), the consumers' swap of S, and
// one a consumer (its P in shared memory before its P V).
enum : int { kBarQ = 1, kBarSwap = 2, kBarP = 3 };

template <Kind K, bool kQBf16>
__global__ void __launch_bounds__(Wg::kThreads, 1) mla_wg_kernel(const MLAParams p) {
#ifdef HAL_WGMMA
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr bool kNopeBf16 = K == Kind::BF16;
  constexpr bool kRescale = kFp8 && kQBf16;
  static_assert(kFp8 || (K == Kind::BF16) == kQBf16, "a 16-bit latent has the query's dtype");
  constexpr int NB = Wg::bufs<kFp8>(), NT = kFp8 ? Wg::stages<kFp8>() : 1, N = Wg::kN;
  extern __shared__ __align__(16) uint8_t smem[];  // no-swizzle operands need 16 bytes
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + Wg::kQBytes;                       // NB tiles of N x 576
  uint8_t* stg = sK + NB * Wg::kTile;                   // FP8: NT staging tiles
  float* xS = reinterpret_cast<float*>(stg + Wg::stages<kFp8>() * Wg::kStage);  // [2][16][128]
  uint64_t* full = reinterpret_cast<uint64_t*>(xS + 2 * 16 * 128);
  uint64_t* empty = full + NB;
  // [4] the producer warps' absmax (16-byte aligned: read as one vector, apart from s_q2, which thread 0
  // writes meanwhile), then the power of two q_nope was scaled by
  float* s_red = reinterpret_cast<float*>(empty + NB);
  float* s_q2 = s_red + 4;

  Item it;
  if (!mla_item<Wg::kRows>(p, it)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg = warp / 4;
  const int H = p.num_heads;
  const int seq = it.seq, q0 = it.q0, qlen = it.qlen, rows = it.rows, r0 = it.r0, L = it.L, p0 = it.p0, p1 = it.p1;
  const bool split = it.split();
  if (split && p0 >= L) {  // CTA-uniform: an empty partition says so to the merge
    const int r = r0 + tid;
    if (tid < Wg::kRows && r < rows) {
      const int64_t slot = it.slot(r);
      p.part_ml[2 * slot] = -INFINITY;
      p.part_ml[2 * slot + 1] = 0.f;
    }
    return;
  }
  const int steps = p1 > p0 ? (p1 - p0 + N - 1) / N : 0;
  if (tid < NB) {
    mbar_init(full + tid, 128);
    mbar_init(empty + tid, 256);
  }
  __syncthreads();  // every thread of the CTA takes this path

  if (wg == 0) {
    // ================= producer: Q, then every K/V tile through the block table =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    // Q: 64 rows x 72 chunks, zeros past the rows; a quarter-warp writes one chunk of 8 rows (distinct banks)
    float amax = 0.f;
#pragma unroll 4
    for (int c = tid; c < Wg::kRows * Wg::kChunks; c += 128) {
      const int row = c & 63, ch = c >> 6;
      const uint4 v = q_chunk(p, q0, rows, r0 + row, ch);
      if (kRescale && ch < 64) amax = fmaxf(amax, absmax_bf16x8(v));
      *reinterpret_cast<uint4*>(sQ + (row >> 3) * Wg::kQGroup + ch * Wg::kQCs + (row & 7) * 16) = v;
    }
    float s2k = 1.f;
    if constexpr (kRescale) {
#pragma unroll
      for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (lane == 0) s_red[warp] = amax;
      bar_sync(kBarQ, 128);
      s2k = fp16_power_of_two(fmaxf(fmaxf(s_red[0], s_red[1]), fmaxf(s_red[2], s_red[3])));
#pragma unroll 4
      for (int c = tid; c < Wg::kRows * 64; c += 128) {  // in place: the chunks this thread wrote
        const int row = c & 63, ch = c >> 6;
        uint4* q = reinterpret_cast<uint4*>(sQ + (row >> 3) * Wg::kQGroup + ch * Wg::kQCs + (row & 7) * 16);
        *q = bf16x8_to_f16x8(*q, s2k);
      }
    }
    if (tid == 0) *s_q2 = s2k;  // released with thread 0's first "full" arrival

    const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
    const int bmask = p.block_size - 1;
    if constexpr (!kFp8) {
      // 16-bit: thread row 8 (q / 4) + q % 4 + 4 hb of a tile (q = tid / 8, hb = bit 2 of tid), chunks
      // cs + 4m (cs = tid % 4, m < 18; m >= 16 the rope): a quarter-warp copies 64 contiguous bytes of two
      // rows four apart, which land in 8 distinct banks (chunks 144 bytes apart, rows 16)
      const int qw = tid >> 3, cs = tid & 3;
      const int row = (qw >> 2) * 8 + (qw & 3) + 4 * ((tid >> 2) & 1);
      auto page_of = [&](int i) {
        const int j = p0 + i * N + row;
        return i < steps && j < p1 ? table[j >> p.block_shift] : 0;
      };
      auto load = [&](int i, int pg) {
        const int j = p0 + i * N + row;
        const bool ok = j < p1;
        const int64_t slot = j & bmask;
        const uint8_t* cr = p.ckv + (int64_t)pg * p.ckv_block_stride + slot * p.ckv_token_stride;
        const uint8_t* kr = p.kpe + (int64_t)pg * p.kpe_block_stride + slot * p.kpe_token_stride;
        uint8_t* d = sK + (i % NB) * Wg::kTile + (row >> 3) * Wg::kKGroup + (row & 7) * 16;
#pragma unroll
        for (int m = 0; m < 18; ++m) {
          const int ch = cs + 4 * m;
          const uint8_t* src = m < 16 ? cr + ch * 16 : kr + (ch - 64) * 16;
          cp_async16(smem_addr(d + ch * Wg::kKCs), ok ? src : p.ckv, ok);
        }
      };
      // Tile k's buffer is refilled once the consumers hand it back ("empty", when k + NB < steps: the
      // tiles waited for here). Tile i - 1 is announced after tile i's copies are issued, so two tiles'
      // copies are in flight.
      int pg = page_of(0);
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        if (i >= NB) mbar_wait(empty + i % NB, ((i - NB) / NB) & 1);
        load(i, pg);
        cp_async_commit();
        pg = page_of(i + 1);
        if (i >= 1) {
          cp_async_wait_group<1>();
          fence_proxy_async();
          mbar_arrive(full + (i - 1) % NB);
        }
      }
      cp_async_wait_all();
      if (steps > 0) {
        fence_proxy_async();
        mbar_arrive(full + (steps - 1) % NB);
      }
    } else {
      // FP8: thread row 2 (tid / 8) + (tid / 4) % 2 of a tile, latent pieces pl + 4m (16 bytes, m < 8)
      // and rope chunks pl, pl + 4: a quarter-warp copies 64 contiguous bytes of two rows
      const int row = 2 * (tid >> 3) + ((tid >> 2) & 1), pl = tid & 3;
      auto page_of = [&](int i) {
        const int j = p0 + i * N + row;
        return i < steps && j < p1 ? table[j >> p.block_shift] : 0;
      };
      auto load = [&](int i, int pg) {  // into staging tile i % NT
        const int j = p0 + i * N + row;
        const bool ok = j < p1;
        const int64_t slot = j & bmask;
        const uint8_t* cr = p.ckv + (int64_t)pg * p.ckv_block_stride + slot * p.ckv_token_stride;
        const uint8_t* kr = p.kpe + (int64_t)pg * p.kpe_block_stride + slot * p.kpe_token_stride;
        uint8_t* st = stg + (i % NT) * Wg::kStage + row * Wg::kStageRow;
#pragma unroll
        for (int m = 0; m < 8; ++m) cp_async16(smem_addr(st + (pl + 4 * m) * 16), ok ? cr + (pl + 4 * m) * 16 : p.ckv, ok);
#pragma unroll
        for (int m = 0; m < 2; ++m) cp_async16(smem_addr(st + 512 + (pl + 4 * m) * 16), ok ? kr + (pl + 4 * m) * 16 : p.kpe, ok);
      };
      auto widen = [&](int i) {  // this thread's pieces of staging tile i % NT -> operand buffer i % NB
        const uint8_t* st = stg + (i % NT) * Wg::kStage + row * Wg::kStageRow;
        uint8_t* d = sK + (i % NB) * Wg::kTile + (row >> 3) * Wg::kKGroup + (row & 7) * 16;
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int pc = pl + 4 * m;
          const uint4 b = *reinterpret_cast<const uint4*>(st + pc * 16);
          *reinterpret_cast<uint4*>(d + 2 * pc * Wg::kKCs) =
              make_uint4(fp8x2_to_f16x2<K>(b.x), fp8x2_to_f16x2<K, true>(b.x), fp8x2_to_f16x2<K>(b.y), fp8x2_to_f16x2<K, true>(b.y));
          *reinterpret_cast<uint4*>(d + (2 * pc + 1) * Wg::kKCs) =
              make_uint4(fp8x2_to_f16x2<K>(b.z), fp8x2_to_f16x2<K, true>(b.z), fp8x2_to_f16x2<K>(b.w), fp8x2_to_f16x2<K, true>(b.w));
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int c = pl + 4 * m;
          *reinterpret_cast<uint4*>(d + (64 + c) * Wg::kKCs) = *reinterpret_cast<const uint4*>(st + 512 + c * 16);
        }
      };
      if (steps > 0) load(0, page_of(0));
      cp_async_commit();
      int pg = page_of(1);
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        if (i + 1 < steps) load(i + 1, pg);  // into the staging tile of tile i - 1, widened by now
        cp_async_commit();
        pg = page_of(i + 2);
        cp_async_wait_group<1>();  // this thread's pieces of tile i landed
        if (i >= NB) mbar_wait(empty + i % NB, ((i - NB) / NB) & 1);
        widen(i);
        fence_proxy_async();
        mbar_arrive(full + i % NB);
      }
      cp_async_wait_all();
    }
    return;
  }

  // ================= consumers: the same 64 rows, O's columns 256 cw .. 256 cw + 255 =================
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  // cw through a shuffle: the compiler then knows it is warp-uniform and builds the wgmma descriptors in
  // uniform registers (in vector registers it borrows the accumulators of a wgmma not yet issued as
  // temporaries, and ptxas then serializes every wgmma)
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0), cwarp = warp & 3, ct = tid - 128 * wg;
  int lim[2], orow[2], ohead[2];  // this thread's rows (g, g + 8 of its warp's 16): causal limit, output slot
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + cwarp * 16 + g + 8 * e;
    const int tq = r / H;
    lim[e] = r < rows ? min(L - qlen + tq + 1, p1) : 0;  // padding rows see nothing
    orow[e] = r < rows ? q0 + tq : -1;
    ohead[e] = r - tq * H;
  }
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  const float ps = p.kpe_scale_ptr ? *p.kpe_scale_ptr : p.kpe_scale;

  float o[128];  // O(64 x 256): element 4 nt + 2 hi + e is row g + 8 hi, column 256 cw + 8 nt + 2 t + e
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m2[2] = {-INFINITY, -INFINITY}, l2[2] = {0.f, 0.f};

  if (steps > 0) {
    mbar_wait(full, 0);  // tile 0, Q and its power of two
    const float s2k = *s_q2;
    const float ratio = ps * s2k / cs;            // rope logits into the latent's (rescaled) units
    const float c2 = cs / s2k * p.scale * kLog2e;  // to log2 units
    const uint8_t* qwg = sQ;
    float s[16] = {}, sr[16] = {};  // (first written by wgmma; zeroed here only to be defined)
    float* x_own = xS + cw * 16 * 128 + ct;
    const float* x_other = xS + (1 - cw) * 16 * 128 + ct;
#pragma unroll 1
    for (int i = 0; i < steps; ++i) {
      const int b = i % NB;
      if (i > 0) mbar_wait(full + b, (i / NB) & 1);
      const uint8_t* kt = sK + b * Wg::kTile;
      // ---- partial S over this consumer's dims ----
      // The same instructions in both consumers (a branch around wgmma makes ptxas serialize them all):
      // consumer cw takes the latent's k16 steps 16 cw .. 16 cw + 15 and the rope's 2 cw, 2 cw + 1. The
      // first step of each product overwrites its accumulators (no zeroing: registers written among
      // in-flight wgmmas make ptxas serialize them too).
      // descriptors: a base a product, then compile-time steps (16-byte units in the address field)
      const int rb = kR / 16 + 2 * cw, lb = 16 * cw;
      const uint64_t qr = wg_desc(qwg + 2 * rb * Wg::kQCs, Wg::kQCs, Wg::kQGroup);
      const uint64_t kr = wg_desc(kt + 2 * rb * Wg::kKCs, Wg::kKCs, Wg::kKGroup);
      const uint64_t ql = wg_desc(qwg + 2 * lb * Wg::kQCs, Wg::kQCs, Wg::kQGroup);
      const uint64_t kl = wg_desc(kt + 2 * lb * Wg::kKCs, Wg::kKCs, Wg::kKGroup);
      constexpr uint64_t dq = 2 * Wg::kQCs / 16, dk = 2 * Wg::kKCs / 16;
      wg_fence();
      wgmma_ss_n32<kQBf16, false>(sr, qr, kr);
      wgmma_ss_n32<kQBf16, true>(sr, qr + dq, kr + dk);
      wgmma_ss_n32<kNopeBf16, false>(s, ql, kl);
#pragma unroll
      for (int kb = 1; kb < 16; ++kb) wgmma_ss_n32<kNopeBf16, true>(s, ql + kb * dq, kl + kb * dk);
      wg_commit();
      // S of tile i and the P V of tile i - 1 done (a wait for the older group alone, wait_group 1, makes
      // ptxas serialize every wgmma of the kernel); tile i - 1's buffer goes back to the producer
      wg_wait<0>();
      wg_pin(o);
      if (i >= 1 && i - 1 + NB < steps) mbar_arrive(empty + (i - 1) % NB);
      wg_pin(s);
      wg_pin(sr);
      // ---- swap the partial S: both consumers then hold s0 + s1 (the same bits: + commutes) ----
#pragma unroll
      for (int e = 0; e < 16; ++e) s[e] = fmaf(ratio, sr[e], s[e]);
#pragma unroll
      for (int e = 0; e < 16; ++e) x_own[e * 128] = s[e];  // (this area's P: its P V is done)
      bar_sync(kBarSwap, 256);
#pragma unroll
      for (int e = 0; e < 16; ++e) s[e] += x_other[e * 128];
      bar_sync(kBarSwap, 256);  // both partials read: each area takes its consumer's P next
      // ---- online softmax (log2 units): element 4 nt + 2 hi + e is row g + 8 hi, token 8 nt + 2 t + e ----
      const int jb = p0 + i * N + 2 * t;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[4 * nt + 2 * hi + e];
            x = jb + 8 * nt + e < lim[hi] ? x * c2 : -INFINITY;
            mx[hi] = fmaxf(mx[hi], x);
          }
      float alpha[2], rs[2] = {0.f, 0.f};
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
        const float mt = fmaxf(m2[hi], mx[hi]);
        alpha[hi] = mt == -INFINITY ? 1.f : fast_exp2(m2[hi] - mt);
        const float msafe = mt == -INFINITY ? 0.f : mt;
        m2[hi] = mt;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[4 * nt + 2 * hi + e];
            x = fast_exp2(x - msafe);
            rs[hi] += x;
          }
        l2[hi] = l2[hi] * alpha[hi] + rs[hi];
      }
      // (unconditional: a rescale skipped per warp would put the accumulators on a divergent path, and
      // ptxas then serializes every wgmma)
#pragma unroll
      for (int nt = 0; nt < 32; ++nt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          o[4 * nt + 2 * hi] *= alpha[hi];
          o[4 * nt + 2 * hi + 1] *= alpha[hi];
        }
      // ---- P (16 bits) into this consumer's area as wgmma's A operand (K-major core matrices: element
      // (r, k) at ((r / 8) * 4 + k / 8) * 128 + (r % 8) * 16 + (k % 8) * 2 bytes). In registers, ptxas
      // computed the second k16 slice after the first wgmma had been issued and then serialized them all.
      auto pack = [](float lo, float hi) { return kNopeBf16 ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi); };
      uint8_t* pw = reinterpret_cast<uint8_t*>(xS + cw * 16 * 128) + (2 * cwarp + 0) * 512 + g * 16 + 4 * t;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi)
          *reinterpret_cast<uint32_t*>(pw + hi * 512 + nt * 128) = pack(s[4 * nt + 2 * hi], s[4 * nt + 2 * hi + 1]);
      // The running sums, stored where nothing reads them: a store cannot sink below the fence, so their
      // sums over S's registers are done before P V is issued (ptxas reads an accumulator register
      // after a wgmma of the same stage only by serializing every wgmma).
      *reinterpret_cast<float2*>(reinterpret_cast<uint8_t*>(xS + cw * 16 * 128) + 4096 + 8 * ct) = make_float2(l2[0], l2[1]);
      fence_proxy_async();
      bar_sync(kBarP + cw, 128);
      // ---- O += P V: V = the tile's latent, MN-major, this consumer's 256 columns ----
      wg_pin(o);
      const uint64_t pd = wg_desc(xS + cw * 16 * 128, 128, 512);
      const uint64_t vd = wg_desc(kt + 32 * cw * Wg::kKCs, Wg::kKGroup, Wg::kKCs);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) wgmma_ss_n256<kNopeBf16, true>(o, pd + 2 * kk * 128 / 16, vd + 2 * kk * Wg::kKGroup / 16);
      wg_commit();
    }
    wg_wait<0>();
    wg_pin(o);
  }

  // ---- the row sums over the quad, then the output or this partition's partial ----
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l2[e] += __shfl_xor_sync(0xffffffffu, l2[e], 1);
    l2[e] += __shfl_xor_sync(0xffffffffu, l2[e], 2);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (orow[e] < 0) continue;
    // l == 0: no key (an empty sequence gives zeros; an empty partition is skipped by the merge)
    const float inv = l2[e] == 0.f ? 0.f : 1.f / l2[e];
    if (!split) {
      char* base = static_cast<char*>(p.out) + ((int64_t)orow[e] * p.out_stride0 + (int64_t)ohead[e] * p.out_stride1) * 2;
#pragma unroll
      for (int nt = 0; nt < 32; ++nt) {
          const int col = 256 * cw + 8 * nt + 2 * t;
          const float x = o[4 * nt + 2 * e] * inv * cs, y = o[4 * nt + 2 * e + 1] * inv * cs;
          *reinterpret_cast<uint32_t*>(base + col * 2) = p.q_is_bf16 ? pack_bf16x2(x, y) : pack_f16x2(x, y);
        }
    } else {
      const int64_t slot = it.slot(r0 + cwarp * 16 + g + 8 * e);
      float* dst = p.part_out + slot * kR;
#pragma unroll
      for (int nt = 0; nt < 32; ++nt) {
          const int col = 256 * cw + 8 * nt + 2 * t;
          *reinterpret_cast<float2*>(dst + col) = make_float2(o[4 * nt + 2 * e] * inv, o[4 * nt + 2 * e + 1] * inv);
        }
      if (cw == 0 && t == 0) p.part_ml[2 * slot] = m2[e], p.part_ml[2 * slot + 1] = l2[e];
    }
  }
#else
  __trap();  // launched only where the module holds sm_90a code (launch_mla checks)
#endif
}

}  // namespace mla
}  // namespace hal_cuda
