// Multi-token paged attention on Hopper (sm_90a), chosen per head size by the tuning entry's
// prefill.wgmma_head_sizes (or HAL_CUDA_PREFILL): the contract and the row mapping of prefill.cuh, with
// the two products on warpgroup MMAs (wgmma.cuh) fed by a producer warpgroup.
//
// One CTA of three warpgroups (384 threads) per (sequence, 128 query rows, KV head):
// * warpgroup 0, the producer (56 registers after setmaxnreg): Q into shared memory (a bf16 query over
//   an FP8 cache scaled into fp16 by a power of two), then every K/V tile through the block table with
//   cp.async, a token row a thread (its page id read one tile ahead, so no table read stalls a step),
//   kBufs - 2 (16-bit caches, straight into the operand buffers) or kStages - 1 (FP8, into byte staging
//   tiles; each thread widens exactly the bytes it copied, with the hardware cvt, so the copies need no
//   barrier) tiles ahead;
// * warpgroups 1 and 2, the consumers (224 registers): 64 rows each, warp v rows 16v .. 16v+15 as in
//   prefill.cuh with one m16 tile a warp; S = Q K^T (Q from registers for D <= 128, else from shared
//   memory; K K-major), online softmax in fp32, O += P V with P from registers (the S accumulators
//   repacked to 16 bits: the m64k16 A fragment is the mma.sync one) and V MN-major. Each step issues
//   S of tile i and the P V of tile i - 1 together, and runs the softmax of tile i while that P V is on
//   the tensor cores (FlashAttention-3's overlap inside a warpgroup); the rescale of O waits for it.
// Producer and consumers meet at mbarriers, a "full" and an "empty" one per operand buffer; the consumer
// warpgroups take turns at issuing their products (named barriers).
// Precision as in prefill.cuh: Q never below its 16 bits, P in the MMA's 16-bit type, never FP8.
#pragma once
#include "arch.h"
#include "prefill.cuh"
#include "sync.cuh"
#include "wgmma.cuh"

namespace hal_cuda {

constexpr int kWgThreads = 384;  // a producer warpgroup and two consumer warpgroups

// Pipeline depth in shared memory (227 KiB): 16-bit caches gather straight into kBufs operand buffers,
// kBufs - 2 tiles ahead of the consumers (who hold two); FP8 caches gather into kStages byte staging
// tiles (kStages - 1 ahead), widened into kBufs operand buffers.
template <Kind K, int D> struct WgShape {
  static constexpr int kRows = 128;      // query rows a CTA (two consumer warpgroups of 64)
  static constexpr int kN = 64;          // keys a step
  // bytes between FP8 staging rows: 4 consecutive rows x 32 bytes, what 8 producer threads copy at once,
  // fall in distinct banks (D + 16 where D + 32 would not fit)
  static constexpr int kStage = D <= 128 ? D + 32 : D + 16;
  static constexpr bool kFp8 = Traits<K>::kFp8;
  // a step holds two buffers (S of tile i, P V of tile i - 1): FP8 keeps a third one ahead where it fits
  static constexpr int kBufs = kFp8 ? (D <= 128 ? 3 : 2) : (D <= 128 ? 6 : 3);
  static constexpr int kStages = kFp8 ? (D <= 128 ? 4 : 3) : 0;
};

// D with a wgmma kernel: multiples of 64 (the products are issued as 64-column pieces) whose pipeline
// fits in shared memory at depth 3 (256: the mma.sync kernel)
__host__ __device__ constexpr bool wg_head_size(int d) { return d == 64 || d == 128 || d == 192; }

template <Kind K, int D> constexpr int wg_smem_bytes() {
  using S = WgShape<K, D>;
  return S::kRows * D * 2 + 2 * S::kBufs * S::kN * D * 2 + 2 * S::kStages * S::kN * S::kStage + 2 * S::kBufs * 8 + 16;
}

// Producer and consumers meet at mbarriers in shared memory, a "full" one (128 producer arrivals) and an
// "empty" one (256 consumer arrivals) per operand buffer: a consumer warpgroup waits on a phase without
// arriving, so the two never wait for each other there (a named barrier over all 384 threads would hold
// them in lockstep). Named barriers (0 is __syncthreads): the producer's own, and one per consumer
// warpgroup that orders their tensor-core work (kBarTurn + w: warpgroup w's turn to issue).
enum : int { kBarProducer = 1, kBarTurn = 2 };

template <Kind K, int D, bool kPlain>
__global__ void __launch_bounds__(kWgThreads, 1) prefill_wg_kernel(const PrefillParams p) {
#ifdef HAL_WGMMA
  using SH = WgShape<K, D>;
  constexpr int NB = SH::kBufs, NT = SH::kStages > 0 ? SH::kStages : 1;  // NT: 1 unused stage for 16-bit
  constexpr int ROWS = SH::kRows, N = SH::kN, DC = D / 64, KB = D / 16, CH = D / 8;
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr bool kBf = Traits<K>::kBf16Math;
  constexpr int kBpe = Traits<K>::kBytes;
  constexpr int kP = 128;  // producer threads
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr uint32_t kRowGroup = CH * 128;  // bytes between 8-row groups of a tile

  extern __shared__ __align__(16) uint8_t smem[];  // wgmma's no-swizzle operands need 16 bytes
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + ROWS * D;      // NB buffers of N x D
  uint16_t* sV = sK + NB * N * D;
  uint8_t* stg = reinterpret_cast<uint8_t*>(sV + NB * N * D);  // FP8: NT stages of K and V staging rows
  uint64_t* full = reinterpret_cast<uint64_t*>(stg + 2 * SH::kStages * N * SH::kStage);  // NB of each (8-aligned)
  uint64_t* empty = full + NB;
  float* s_qmul = reinterpret_cast<float*>(empty + NB);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg = warp / 4;
  PrefillTile tl;
  if (!prefill_tile(p, ROWS, tl)) return;
  const int seq = tl.seq, kvh = tl.kvh, q0 = tl.q0, R0 = tl.R0, R1 = tl.R1, L = tl.L, base = tl.base;
  const int kv_lo = tl.kv_lo, kv_hi = tl.kv_hi, full_lo = tl.full_lo, full_hi = tl.full_hi;
  const int j_begin = kv_lo & ~(N - 1);
  const int steps = kv_hi > j_begin ? (kv_hi - j_begin + N - 1) / N : 0;
  if (tid < NB) {
    mbar_init(full + tid, kP);
    mbar_init(empty + tid, 2 * kP);
  }
  __syncthreads();  // every CTA thread takes this path (prefill_tile depends on blockIdx alone)

  if (wg == 0) {
    // ================= producer: Q, then every K/V tile through the block table =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");  // registers to the consumers (O is theirs)
    const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
    const int64_t k_head = (int64_t)kvh * p.k_head_stride, v_head = (int64_t)kvh * p.v_head_stride;
    constexpr int kPieces = D * kBpe / 16;  // 16-byte pieces a cache row
    // Each producer thread owns one token row of a tile and every other 16-byte piece of it (half = 0
    // or 1): one block-table read a tile for K and V together, and the pieces' addresses are compile-time
    // offsets from the row's. The two threads of a row are neighbours, so each 32-byte sector of the
    // cache is asked for by one quarter-warp (a 16-byte copy instruction is served 8 threads at a time:
    // with the halves of a sector in two quarters, every sector crossed from L2 twice).
    static_assert(N * 2 == kP, "two producer threads a token row");
    const int r = tid >> 1, half = tid & 1;
    const int cm_row = cm_offset(r, 0, D);
    auto page_of = [&](int i) -> int {  // this thread's row of tile i: its page (0 outside the keys)
      const int j = j_begin + i * N + r;
      return i < steps && j >= kv_lo && j < kv_hi ? table[j >> p.block_shift] : 0;
    };
    auto load = [&](int i, int64_t page) {  // tile i: FP8 into staging stage i % NT, 16-bit into buffer i % NB
      const int j = j_begin + i * N + r, b = i % NB;
      const bool ok = j >= kv_lo && j < kv_hi;
      const int64_t slot = j & (p.block_size - 1);
      const uint8_t* ks = ok ? p.key_cache + page * p.k_stride0 + k_head + slot * p.k_row : p.key_cache;
      const uint8_t* vs = ok ? p.value_cache + page * p.v_stride0 + v_head + slot * p.v_row : p.value_cache;
      if constexpr (kFp8) {
        uint8_t* st = stg + (i % NT) * 2 * N * SH::kStage + r * SH::kStage;
#pragma unroll
        for (int k = half; k < kPieces; k += 2) {
          cp_async16(st + k * 16, ks + (ok ? k * 16 : 0), ok);
          cp_async16(st + N * SH::kStage + k * 16, vs + (ok ? k * 16 : 0), ok);
        }
      } else {
        uint16_t* kd = sK + b * N * D + cm_row;
        uint16_t* vd = sV + b * N * D + cm_row;
#pragma unroll
        for (int k = half; k < kPieces; k += 2) {
          cp_async16(kd + k * 64, ks + (ok ? k * 16 : 0), ok);
          cp_async16(vd + k * 64, vs + (ok ? k * 16 : 0), ok);
        }
      }
    };
    auto widen = [&](int i) {  // FP8 staging stage i % NT -> fp16 tiles of buffer i % NB: the pieces this thread copied
      const int b = i % NB;
      const uint8_t* st = stg + (i % NT) * 2 * N * SH::kStage + r * SH::kStage;
      uint16_t* k16 = sK + b * N * D + cm_row;
      uint16_t* v16 = sV + b * N * D + cm_row;
      auto cvt8 = [](uint32_t x, uint32_t y) {  // 8 FP8 bytes -> 8 fp16 (one 16-byte chunk of a row)
        return make_uint4(fp8x2_to_f16x2<K>(x), fp8x2_to_f16x2<K, true>(x), fp8x2_to_f16x2<K>(y), fp8x2_to_f16x2<K, true>(y));
      };
#pragma unroll
      for (int k = half; k < kPieces; k += 2) {  // 16 bytes in, two 8-column chunks (2k, 2k + 1) out
        const uint4 kb = *reinterpret_cast<const uint4*>(st + k * 16);
        const uint4 vb = *reinterpret_cast<const uint4*>(st + N * SH::kStage + k * 16);
        *reinterpret_cast<uint4*>(k16 + 2 * k * 64) = cvt8(kb.x, kb.y);
        *reinterpret_cast<uint4*>(k16 + (2 * k + 1) * 64) = cvt8(kb.z, kb.w);
        *reinterpret_cast<uint4*>(v16 + 2 * k * 64) = cvt8(vb.x, vb.y);
        *reinterpret_cast<uint4*>(v16 + (2 * k + 1) * 64) = cvt8(vb.z, vb.w);
      }
    };
    const float qmul = stage_query<kFp8, D, ROWS, kP>(
        p, tl, sQ, tid, [](int r, int ch) { return cm_offset(r, ch, D); }, [] { bar_sync(kBarProducer, kP); });
    if (tid == 0) *s_qmul = qmul;
    // tile i's buffer is refilled only after the consumers arrive on its "empty" barrier (they do for
    // tile k when k + NB < steps: exactly the tiles the producer waits for). Q's copies join tile 0's
    // group; every producer thread waits for its own groups before it arrives on a "full" barrier.
    if constexpr (kFp8) {
      // NT - 1 tiles in flight in the staging stages while tile i is widened
#pragma unroll 1
      for (int i = 0; i < NT - 1; ++i) {
        if (i < steps) load(i, page_of(i));
        cp_async_commit();
      }
      int page = page_of(NT - 1);
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        cp_async_wait_group<NT - 2>();  // this thread's pieces of tile i (and of Q) landed
        if (i + NT - 1 < steps) load(i + NT - 1, page);  // into the stage of tile i - 1, widened by now
        cp_async_commit();
        page = page_of(i + NT);  // read while tile i is widened
        if (i >= NB) mbar_wait(empty + i % NB, (i / NB - 1) & 1);  // tile i - NB's use of the buffer is over
        widen(i);
        fence_proxy_async();
        mbar_arrive(full + i % NB);
      }
    } else {
      // The consumers hold two buffers in a step (tile i - 1's V, tile i's K) and free tile k when they
      // start step k + 2, just before they wait for tile k + 2. So the producer makes tile i ready first
      // and only then waits for tile i - 2 to refill its buffer with tile i + NB - 2 (waiting before
      // would put a round trip through both sides into every step): NB - 2 tiles in flight.
      static_assert(NB >= 3, "16-bit caches: two buffers in use and one in flight at least");
#pragma unroll 1
      for (int i = 0; i < NB - 2; ++i) {
        if (i < steps) load(i, page_of(i));
        cp_async_commit();
      }
      int page = page_of(NB - 2);
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        cp_async_wait_group<NB - 3>();  // tile i (and Q) landed, this thread's part
        fence_proxy_async();
        mbar_arrive(full + i % NB);
        if (i + NB - 2 < steps) {  // into the buffer of tile i - 2
          if (i >= 2) mbar_wait(empty + (i - 2) % NB, ((i - 2) / NB) & 1);
          load(i + NB - 2, page);
        }
        cp_async_commit();
        page = page_of(i + NB - 1);
      }
    }
    cp_async_wait_all();
    return;
  }

  // ================= consumers: 64 rows a warpgroup, warp v (1..8 minus 4) rows 16v .. 16v+15 =================
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  const int cw = wg - 1, cwarp = warp - 4;
  int pos[2];
  float slope[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int R = min(R0 + cwarp * 16 + g + 8 * hi, R1);
    pos[hi] = base + R / p.gqa;
    slope[hi] = (!kPlain && p.alibi) ? p.alibi[kvh * p.gqa + R % p.gqa] : 0.f;
  }
  const float ks = p.k_scale_ptr ? p.k_scale_ptr[kvh * p.k_scale_stride] : p.k_scale;

  float o[DC][32];
#pragma unroll
  for (int c = 0; c < DC; ++c)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[c][i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float step_scale = 0.f;

  // Q as the A operand: from registers (this warp's m16k16 fragments, loaded once) where they fit
  // beside O, S and P (D <= 128: 32 registers), else from shared memory
  constexpr bool kQRegs = D <= 128;
  const uint16_t* qwg = sQ + cm_offset(64 * cw, 0, D);
  uint32_t qa[kQRegs ? KB : 1][4];
  float s[32];            // S of the newest tile, then its probabilities (fp32)
  uint32_t pa[N / 16][4];  // P of the tile whose P V is next, in the MMA's 16-bit type

  auto issue_s = [&](int b) {  // S = Q K^T of buffer b: one commit group
    const uint16_t* kt = sK + b * N * D;
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] = 0.f;
    wg_fence();
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
      if constexpr (kQRegs)
        wgmma_rs<kBf, false>(s, qa[kb], wg_desc(kt + 2 * kb * 64, 128, kRowGroup));
      else
        wgmma_ss<kBf>(s, wg_desc(qwg + kb * 16 * 8, 128, kRowGroup), wg_desc(kt + 2 * kb * 64, 128, kRowGroup));
    }
    wg_commit();
  };
  auto issue_pv = [&](int b) {  // O += P V of buffer b: one commit group
    const uint16_t* vt = sV + b * N * D;
#pragma unroll
    for (int c = 0; c < DC; ++c) wg_pin(o[c]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
      for (int c = 0; c < DC; ++c)
        wgmma_rs<kBf, true>(o[c], pa[kk], wg_desc(vt + cm_offset(16 * kk, 8 * c, D), kRowGroup, 128));
    wg_commit();
  };
  // scale, soft-cap, ALiBi, mask; online softmax per row over tile i's S (O untouched: the caller
  // rescales it by alpha once the P V in flight is done)
  auto softmax = [&](int i, float (&alpha)[2]) {
    const int j0 = j_begin + i * N;
    const bool masked = !(j0 >= full_lo && j0 + N <= full_hi);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int lo_j = p.window > 0 ? pos[hi] - p.window + 1 : 0;
      const int hi_j = p.causal ? pos[hi] : L - 1;
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[4 * nt + 2 * hi + e] * step_scale;
          const int j = j0 + nt * 8 + 2 * t + e;
          if constexpr (!kPlain) {
            if (p.soft_cap > 0.f) x = p.soft_cap * tanhf(x / p.soft_cap);
            if (p.alibi) x += slope[hi] * (float)(j - pos[hi]);
            x *= kLog2e;
          }
          if (masked && (j < lo_j || j > hi_j)) x = -INFINITY;
          s[4 * nt + 2 * hi + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[hi], mx);
      const float ref = mn == -INFINITY ? 0.f : mn;
      alpha[hi] = fast_exp2(m[hi] - ref);
      m[hi] = mn;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = fast_exp2(s[4 * nt + 2 * hi + e] - ref);
          s[4 * nt + 2 * hi + e] = x;
          sum += x;
        }
      l[hi] = l[hi] * alpha[hi] + sum;
    }
  };
  auto pack_p = [&] {  // P's k16 slices from the S accumulators (n8 tiles 2kk and 2kk+1)
    auto pack = [](float lo, float hi) { return kBf ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi); };
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      const float* sc = s + 8 * kk;
      pa[kk][0] = pack(sc[0], sc[1]);
      pa[kk][1] = pack(sc[2], sc[3]);
      pa[kk][2] = pack(sc[4], sc[5]);
      pa[kk][3] = pack(sc[6], sc[7]);
    }
  };

  if (steps > 0) {
    mbar_wait(full, 0);  // tile 0, Q and its scale in shared memory
    const float logit_scale = p.scale * ks * *s_qmul;
    step_scale = kPlain ? logit_scale * kLog2e : logit_scale;
    if constexpr (kQRegs) {
      const int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lc = lane >> 4;  // ldmatrix x4: (rows, k-half) of the 4 8x8s
#pragma unroll
      for (int kb = 0; kb < KB; ++kb) ldsm_x4(qa[kb], qwg + cm_offset(16 * (cwarp & 3) + lr, 2 * kb + lc, D));
    }
    // Turns (FlashAttention-3's ping-pong): the warpgroups issue their products alternately, so one's
    // softmax runs while the other's products hold the tensor cores.
    const int turn = kBarTurn + cw, other = kBarTurn + 1 - cw;
    if (cw == 1) bar_arrive(kBarTurn, 2 * kP);  // warpgroup 0 goes first
    float alpha[2];
    bar_sync(turn, 2 * kP);
    issue_s(0);
    bar_arrive(other, 2 * kP);
    wg_wait<0>();
    wg_pin(s);
    softmax(0, alpha);
    // Step i: finish tile i - 1 (its P V's wait, the rescale of O, P packed), then issue S of tile i and
    // the P V of tile i - 1 together and run tile i's softmax while that P V is on the tensor cores. The
    // wait for a P V opens the next step (past the loop's back edge) because ptxas schedules a wgmma
    // wait like any other instruction of its block and would hoist it above the softmax.
    auto finish = [&](int i) {  // the P V of tile i - 2 done; O rescaled to tile i - 1's maximum; its P packed
      wg_wait<0>();
#pragma unroll
      for (int c = 0; c < DC; ++c) wg_pin(o[c]);
      wg_pin_regs(pa);
      if (i >= 2 && i - 2 + NB < steps) mbar_arrive(empty + (i - 2) % NB);  // its buffer is free
#pragma unroll
      for (int c = 0; c < DC; ++c)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            o[c][4 * nt + 2 * hi] *= alpha[hi];
            o[c][4 * nt + 2 * hi + 1] *= alpha[hi];
          }
      pack_p();
    };
#pragma unroll 1
    for (int i = 1; i < steps; ++i) {
      finish(i);
      mbar_wait(full + i % NB, (i / NB) & 1);  // tile i in shared memory
      bar_sync(turn, 2 * kP);
      issue_s(i % NB);
      issue_pv((i - 1) % NB);
      bar_arrive(other, 2 * kP);
      wg_wait<1>();  // S of tile i done; the P V of tile i - 1 may still run
      wg_pin(s);
      softmax(i, alpha);
    }
    finish(steps);
    bar_sync(turn, 2 * kP);
    issue_pv((steps - 1) % NB);
    bar_arrive(other, 2 * kP);
    if (cw == 0) bar_sync(turn, 2 * kP);  // warpgroup 1's last arrival: each barrier ends balanced
    wg_wait<0>();
#pragma unroll
    for (int c = 0; c < DC; ++c) wg_pin(o[c]);
  }

  // ---- normalise and write this thread's rows ----
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float lsum = l[hi];
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
    const int R = R0 + cwarp * 16 + g + 8 * hi;
    if (R > R1) continue;
    const float f = lsum == 0.f ? 0.f : vs / lsum;
    uint8_t* orow = reinterpret_cast<uint8_t*>(p.out) +
                    ((int64_t)(q0 + R / p.gqa) * p.out_stride0 + (int64_t)(kvh * p.gqa + R % p.gqa) * p.out_stride1) * 2;
#pragma unroll
    for (int c = 0; c < DC; ++c)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float x0 = o[c][4 * nt + 2 * hi] * f, x1 = o[c][4 * nt + 2 * hi + 1] * f;
        *reinterpret_cast<uint32_t*>(orow + (64 * c + nt * 8 + 2 * t) * 2) = p.q_is_bf16 ? pack_bf16x2(x0, x1) : pack_f16x2(x0, x1);
      }
  }
#else
  __trap();  // launched only where the module holds sm_90a code (launch_prefill checks)
#endif
}

}  // namespace hal_cuda
