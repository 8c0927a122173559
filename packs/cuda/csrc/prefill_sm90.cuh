// Multi-token paged attention on Hopper (sm_90a), opt-in (launch.py PREFILL_KERNEL, the tuning entry's
// prefill.wgmma_head_sizes): the contract and the row mapping of prefill.cuh, with the two products on
// warpgroup MMAs (wgmma.cuh) fed by a producer warpgroup.
//
// One CTA of three warpgroups (384 threads) per (sequence, 128 query rows, KV head):
// * warpgroup 0, the producer (56 registers after setmaxnreg): Q into shared memory (a bf16 query over
//   an FP8 cache scaled into fp16 by a power of two), then every K/V tile through the block table with
//   cp.async, a token row a thread, kBufs - 1 (16-bit caches, straight into the operand buffers) or
//   kStages - 1 (FP8, into byte staging tiles it widens with the hardware cvt) tiles ahead;
// * warpgroups 1 and 2, the consumers (224 registers): 64 rows each, warp v rows 16v .. 16v+15 as in
//   prefill.cuh with one m16 tile a warp; S = Q K^T with both operands in shared memory (K-major),
//   online softmax in fp32, O += P V with P from registers (the S accumulators repacked to 16 bits: the
//   m64k16 A fragment is the mma.sync one) and V MN-major; they run free of each other.
// Producer and consumers meet at named barriers, a "full" and an "empty" one per operand buffer.
// Precision as in prefill.cuh: Q never below its 16 bits, P in the MMA's 16-bit type, never FP8.
#pragma once
#include "arch.h"
#include "prefill.cuh"
#include "wgmma.cuh"

namespace hal_cuda {

constexpr int kWgThreads = 384;  // a producer warpgroup and two consumer warpgroups

// Pipeline depth in shared memory (227 KiB): 16-bit caches gather straight into kBufs operand buffers,
// kBufs - 1 tiles ahead of the consumers; FP8 caches gather into kStages byte staging tiles (kStages - 1
// ahead), widened into 2 operand buffers.
template <Kind K, int D> struct WgShape {
  static constexpr int kRows = 128;      // query rows a CTA (two consumer warpgroups of 64)
  static constexpr int kN = 64;          // keys a step
  static constexpr int kStage = D + 16;  // bytes between FP8 staging rows (conflict-free reads)
  static constexpr bool kFp8 = Traits<K>::kFp8;
  static constexpr int kBufs = kFp8 ? 2 : (D <= 128 ? 4 : 3);
  static constexpr int kStages = kFp8 ? (D <= 128 ? 4 : 3) : 0;
};

// D with a wgmma kernel: multiples of 64 (the products are issued as 64-column pieces) whose pipeline
// fits in shared memory at depth 3 (256: the mma.sync kernel)
__host__ __device__ constexpr bool wg_head_size(int d) { return d == 64 || d == 128 || d == 192; }

template <Kind K, int D> constexpr int wg_smem_bytes() {
  using S = WgShape<K, D>;
  return S::kRows * D * 2 + 2 * S::kBufs * S::kN * D * 2 + 2 * S::kStages * S::kN * S::kStage + 16;
}

// Named barriers (0 is __syncthreads): the producer's own, and per buffer "full" (producer -> consumers)
// and "empty" (consumers -> producer), each over all 384 threads.
enum : int { kBarProducer = 1, kBarFull = 2, kBarEmpty = 6 };
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

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
  float* s_qmul = reinterpret_cast<float*>(stg + 2 * SH::kStages * N * SH::kStage);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg = warp / 4;
  PrefillTile tl;
  if (!prefill_tile(p, ROWS, tl)) return;
  const int seq = tl.seq, kvh = tl.kvh, q0 = tl.q0, R0 = tl.R0, R1 = tl.R1, L = tl.L, base = tl.base;
  const int kv_lo = tl.kv_lo, kv_hi = tl.kv_hi, full_lo = tl.full_lo, full_hi = tl.full_hi;
  const int j_begin = kv_lo & ~(N - 1);
  const int steps = kv_hi > j_begin ? (kv_hi - j_begin + N - 1) / N : 0;

  if (wg == 0) {
    // ================= producer: Q, then every K/V tile through the block table =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");  // registers to the consumers (O is theirs)
    const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
    const int64_t k_head = (int64_t)kvh * p.k_head_stride, v_head = (int64_t)kvh * p.v_head_stride;
    constexpr int kPieces = D * kBpe / 16;  // 16-byte pieces a cache row
    // Each producer thread owns one token row of a tile (r: 8 neighbouring threads hold the 8 rows of a
    // core matrix) and every other 16-byte piece of it (half = 0 or 1): one block-table read a tile for
    // K and V together, and the pieces' addresses are compile-time offsets from the row's.
    static_assert(N * 2 == kP, "two producer threads a token row");
    const int r = (tid & 7) + 8 * (tid >> 4), half = (tid >> 3) & 1;
    const int cm_row = cm_offset(r, 0, D);
    auto load = [&](int i) {  // tile i: FP8 into staging stage i % NT, 16-bit into buffer i % NB
      const int j = j_begin + i * N + r, b = i % NB;
      const bool ok = j >= kv_lo && j < kv_hi;
      const int64_t page = ok ? table[j >> p.block_shift] : 0;
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
    auto widen = [&](int i) {  // FP8 staging stage i % NT -> fp16 tiles of buffer i % NB: this thread's row
      const int b = i % NB;
      const uint8_t* st = stg + (i % NT) * 2 * N * SH::kStage + r * SH::kStage;
      uint16_t* k16 = sK + b * N * D + cm_row;
      uint16_t* v16 = sV + b * N * D + cm_row;
#pragma unroll
      for (int ch = half; ch < CH; ch += 2) {
        const uint2 kb = *reinterpret_cast<const uint2*>(st + ch * 8);
        const uint2 vb = *reinterpret_cast<const uint2*>(st + N * SH::kStage + ch * 8);
        *reinterpret_cast<uint4*>(k16 + ch * 64) =
            make_uint4(fp8x2_to_f16x2<K>(kb.x), fp8x2_to_f16x2<K>(kb.x >> 16), fp8x2_to_f16x2<K>(kb.y), fp8x2_to_f16x2<K>(kb.y >> 16));
        *reinterpret_cast<uint4*>(v16 + ch * 64) =
            make_uint4(fp8x2_to_f16x2<K>(vb.x), fp8x2_to_f16x2<K>(vb.x >> 16), fp8x2_to_f16x2<K>(vb.y), fp8x2_to_f16x2<K>(vb.y >> 16));
      }
    };
    const float qmul = stage_query<kFp8, D, ROWS, kP>(
        p, tl, sQ, tid, [](int r, int ch) { return cm_offset(r, ch, D); }, [] { bar_sync(kBarProducer, kP); });
    if (tid == 0) *s_qmul = qmul;
    // tile i's buffer is refilled only after the consumers arrive on its "empty" barrier (they do for
    // tile k when k + NB < steps: exactly the tiles the producer waits for)
    if constexpr (kFp8) {
      // NT - 1 tiles in flight in the staging stages while tile i is widened
#pragma unroll 1
      for (int i = 0; i < NT - 1; ++i) {
        if (i < steps) load(i);
        cp_async_commit();
      }
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        cp_async_wait_group<NT - 2>();  // tile i (and Q) landed, this thread's part
        bar_sync(kBarProducer, kP);     // ... every thread's; and every thread is done widening tile i - 1
        if (i + NT - 1 < steps) load(i + NT - 1);  // into the stage of tile i - 1
        cp_async_commit();
        if (i >= NB) bar_sync(kBarEmpty + i % NB, kWgThreads);
        widen(i);
        fence_proxy_async();
        bar_arrive(kBarFull + i % NB, kWgThreads);
      }
    } else {
#pragma unroll 1
      for (int i = 0; i < NB - 1; ++i) {
        if (i < steps) load(i);
        cp_async_commit();
      }
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        cp_async_wait_group<NB - 2>();
        fence_proxy_async();
        bar_arrive(kBarFull + i % NB, kWgThreads);
        if (i + NB - 1 < steps) {  // into the buffer of tile i - 1
          if (i >= 1) bar_sync(kBarEmpty + (i - 1) % NB, kWgThreads);
          load(i + NB - 1);
        }
        cp_async_commit();
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

  const uint16_t* qwg = sQ + cm_offset(64 * cw, 0, D);
  for (int i = 0; i < steps; ++i) {
    const int j0 = j_begin + i * N, b = i % NB;
    bar_sync(kBarFull + b, kWgThreads);  // tile i (and, first, Q and its scale) in shared memory
    if (i == 0) {
      const float logit_scale = p.scale * ks * *s_qmul;
      step_scale = kPlain ? logit_scale * kLog2e : logit_scale;
    }
    // ---- S = Q K^T: 64 rows x 64 keys ----
    float s[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] = 0.f;
    const uint16_t* kt = sK + b * N * D;
    wg_fence();
#pragma unroll
    for (int kb = 0; kb < KB; ++kb)
      wgmma_ss<kBf>(s, wg_desc(qwg + kb * 16 * 8, 128, kRowGroup), wg_desc(kt + 2 * kb * 64, 128, kRowGroup));
    wg_commit();
    wg_wait<0>();
    wg_pin(s);

    // ---- scale, soft-cap, ALiBi, mask; online softmax per row ----
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
      const float alpha = fast_exp2(m[hi] - ref);
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
      l[hi] = l[hi] * alpha + sum;
#pragma unroll
      for (int c = 0; c < DC; ++c)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) { o[c][4 * nt + 2 * hi] *= alpha; o[c][4 * nt + 2 * hi + 1] *= alpha; }
    }

    // ---- O += P V: P's k16 slices from the S accumulators, V MN-major ----
    const uint16_t* vt = sV + b * N * D;
    auto pack = [](float lo, float hi) { return kBf ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi); };
    uint32_t pa[N / 16][4];  // all of P packed before the first product (no fence between them)
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      const float* sc = s + 8 * kk;  // n8 tiles 2kk and 2kk+1
      pa[kk][0] = pack(sc[0], sc[1]);
      pa[kk][1] = pack(sc[2], sc[3]);
      pa[kk][2] = pack(sc[4], sc[5]);
      pa[kk][3] = pack(sc[6], sc[7]);
    }
#pragma unroll
    for (int c = 0; c < DC; ++c) wg_pin(o[c]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
      for (int c = 0; c < DC; ++c)
        wgmma_rs_t<kBf>(o[c], pa[kk], wg_desc(vt + cm_offset(16 * kk, 8 * c, D), kRowGroup, 128));
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int c = 0; c < DC; ++c) wg_pin(o[c]);
    if (i + NB < steps) bar_arrive(kBarEmpty + b, kWgThreads);  // buffer b free for tile i + NB
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
