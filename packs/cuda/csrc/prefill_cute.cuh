// Multi-token paged attention on Hopper (sm_90a) over 16-bit caches, built on CUTLASS's CuTe: the
// contract and row mapping of prefill.cuh, the warp specialisation of prefill_sm90.cuh, and what that
// kernel lacked of FlashAttention-3 (docs/cuda.md, "Multi-token attention"):
// * 128-key tiles (prefill_sm90.cuh steps 64): each step's fixed work (the barriers, the row maxima,
//   O's rescale) is paid half as often, and each product is one m64n128k16 (S) or m64nDk16 (O) GMMA
//   per k16 slice instead of pieces of 64 columns;
// * 128-byte swizzled operands (CuTe's GMMA::Layout_K_SW128_Atom): the producer's 16-byte cp.async
//   writes and the tensor cores' reads are free of bank conflicts;
// * the GMMAs, their shared-memory descriptors and the accumulator fragments are CuTe's (TiledMMA over
//   one warpgroup, SS for S = Q K^T with Q in shared memory, RS for O += P V with P in registers and V
//   read MN-major through a transposed view of the same swizzled tile).
// One CTA of three warpgroups (384 threads) per (sequence, 128 query rows, KV head): warpgroup 0
// gathers Q and every K/V tile through the block table with cp.async (two threads a token row, its
// page id read one tile ahead), warpgroups 1 and 2 compute 64 rows each. A step issues S of tile i and
// the P V of tile i - 1 together and runs tile i's softmax while that P V is on the tensor cores; the
// two consumer warpgroups take turns at issuing (FlashAttention-3's ping-pong); producer and consumers
// meet at mbarriers. Precision: Q in its own 16 bits, P in the cache's 16-bit type, fp32 accumulation.
// FP8 caches (fp16 math, as prefill_sm90.cuh): the producer copies a tile's bytes into a staging ring
// (two stages, each row's 16-byte chunks XOR-swizzled by the row) and widens exactly the bytes it copied
// into the fp16 K and V buffers, two of each with their own full/empty mbarriers: K of tile i is
// written once S of tile i - 2 is done, V of tile i once the P V of tile i - 2 is, so neither waits for
// the other and the 128-key operands fit beside the staging in 227 KiB.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "arch.h"
#include "prefill.cuh"
#include "sync.cuh"

namespace hal_cuda {

constexpr int kCuteThreads = 384;  // a producer warpgroup and two consumer warpgroups

template <Kind K, int D> struct CuteShape {
  static constexpr bool kFp8 = Traits<K>::kFp8;
  // the MMAs' 16-bit type: the cache's, fp16 for FP8 caches (their values are exact in fp16)
  using T = std::conditional_t<Traits<K>::kBf16Math, cute::bfloat16_t, cute::half_t>;
  static constexpr int kRows = 128;  // query rows a CTA (two consumer warpgroups of 64)
  static constexpr int kN = 128;     // keys a step
  // operand buffers (K and V of one tile each). 16-bit caches: the consumers hold two in a step (S of
  // tile i, P V of tile i - 1), the rest are in flight. FP8: two K and two V buffers with their own
  // barriers, beside two staging stages of a tile's bytes. 227 KiB of shared memory.
  static constexpr int kBufs = kFp8 ? 2 : (D <= 64 ? 6 : 3);
  static constexpr int kStages = kFp8 ? 2 : 0;
  static constexpr int kStageBytes = kN * D;  // FP8 bytes of one tile's K (or V)
  using LQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<T>{},
                                          cute::Shape<cute::Int<kRows>, cute::Int<D>>{}));
  using LK = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<T>{},
                                          cute::Shape<cute::Int<kN>, cute::Int<D>, cute::Int<kBufs>>{}));
  // V as the B operand of O += P V (N = D, K = keys): the same bytes read MN-major
  using LVt = decltype(cute::composition(
      LK{}, cute::make_ordered_layout(cute::Shape<cute::Int<D>, cute::Int<kN>, cute::Int<kBufs>>{},
                                      cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using MmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<T, T, float, cute::Shape<cute::_64, cute::Int<kN>, cute::Int<D>>>()));
  using MmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<T, T, float, cute::Shape<cute::_64, cute::Int<D>, cute::Int<kN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  static constexpr int kQBytes = kRows * D * 2, kTileBytes = kN * D * 2;
};

template <Kind K, int D> constexpr int cute_smem_bytes() {
  using S = CuteShape<K, D>;
  // Q, K and V buffers (1024-byte aligned: the swizzle's period), FP8 staging, the mbarriers (two a
  // buffer; FP8 four: K and V each), the query's scale
  return 1024 + S::kQBytes + 2 * S::kBufs * S::kTileBytes + 2 * S::kStages * S::kStageBytes +
         (S::kFp8 ? 4 : 2) * S::kBufs * 8 + 16;
}

enum : int { kCuteBarProducer = 1, kCuteBarTurn = 2 };

// One GMMA product over every k16 slice of A and B: one commit group (the caller waits). kRegA: A is a
// register fragment (RS), kept in place across the issue; else shared-memory descriptors (SS).
template <bool kAccumulate, bool kRegA, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void cute_gemm(Mma& mma, const TA& a, const TB& b, TC& c) {
  using namespace cute;
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kAccumulate ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
}

template <Kind K, int D, bool kPlain>
__global__ void __launch_bounds__(kCuteThreads, 1) prefill_cute_kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using SH = CuteShape<K, D>;
  using T = typename SH::T;
  constexpr int NB = SH::kBufs, ROWS = SH::kRows, N = SH::kN;
  constexpr int kP = 128;  // producer threads
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* q_ptr = reinterpret_cast<T*>(smem);
  T* k_ptr = reinterpret_cast<T*>(smem + SH::kQBytes);
  T* v_ptr = reinterpret_cast<T*>(smem + SH::kQBytes + NB * SH::kTileBytes);
  constexpr bool kFp8 = SH::kFp8;
  constexpr int NT = SH::kStages > 0 ? SH::kStages : 1;
  uint8_t* stg = smem + SH::kQBytes + 2 * NB * SH::kTileBytes;  // FP8: NT stages of K bytes then V bytes
  // 16-bit: full / empty per buffer (K and V together). FP8: full / empty for K (kfull, kempty) and for V
  uint64_t* full = reinterpret_cast<uint64_t*>(stg + 2 * SH::kStages * SH::kStageBytes);
  uint64_t* empty = full + NB;
  uint64_t* vfull = empty + NB;
  uint64_t* vempty = vfull + NB;
  float* s_qmul = reinterpret_cast<float*>(full + (kFp8 ? 4 : 2) * NB);
  Tensor sQ = make_tensor(make_smem_ptr(q_ptr), typename SH::LQ{});    // (128, D)
  Tensor sK = make_tensor(make_smem_ptr(k_ptr), typename SH::LK{});    // (N, D, NB)
  Tensor sV = make_tensor(make_smem_ptr(v_ptr), typename SH::LK{});    // (N, D, NB)
  Tensor sVt = make_tensor(make_smem_ptr(v_ptr), typename SH::LVt{});  // (D, N, NB)

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
    if constexpr (kFp8) {
      mbar_init(vfull + tid, kP);
      mbar_init(vempty + tid, 2 * kP);
    }
  }
  __syncthreads();  // every CTA thread takes this path (prefill_tile depends on blockIdx alone)

  if (wg == 0) {
    // ================= producer: Q, then every K/V tile through the block table =================
    cutlass::arch::warpgroup_reg_dealloc<56>();
    const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
    const int64_t k_head = (int64_t)kvh * p.k_head_stride, v_head = (int64_t)kvh * p.v_head_stride;
    constexpr int kPieces = D / 8;  // 16-byte pieces a row
    // Two threads a token row, neighbours (each 32-byte sector of the cache asked for by one
    // quarter-warp), rows r and r + 64 of each tile; every other piece a thread.
    const int r = tid >> 1, half = tid & 1;
    auto page_of = [&](int i, int rr) -> int {  // row rr of tile i: its page (0 outside the keys)
      const int j = j_begin + i * N + rr;
      return i < steps && j >= kv_lo && j < kv_hi ? table[j >> p.block_shift] : 0;
    };
    // FP8 staging: row rr of a stage is D bytes, its 16-byte chunk k stored at chunk k ^ (rr % chunks)
    // so the 16 rows a warp writes at once spread over the banks
    constexpr int kChunks8 = D / 16;  // 16-byte chunks of an FP8 row
    auto staged = [&](int stage, int v, int rr, int k) -> uint8_t* {
      return stg + (stage * 2 + v) * SH::kStageBytes + rr * D + ((k ^ (rr % kChunks8)) * 16);
    };
    auto load = [&](int i, const int (&page)[2]) {  // tile i into buffer i % NB (FP8: stage i % NT)
      const int b = i % NB;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = r + 64 * h, j = j_begin + i * N + rr;
        const bool ok = j >= kv_lo && j < kv_hi;
        const int64_t slot = j & (p.block_size - 1);
        const uint8_t* ks = ok ? p.key_cache + page[h] * p.k_stride0 + k_head + slot * p.k_row : p.key_cache;
        const uint8_t* vs = ok ? p.value_cache + page[h] * p.v_stride0 + v_head + slot * p.v_row : p.value_cache;
        if constexpr (kFp8) {
#pragma unroll
          for (int k = half; k < kChunks8; k += 2) {
            cp_async16(staged(i % NT, 0, rr, k), ks + (ok ? k * 16 : 0), ok);
            cp_async16(staged(i % NT, 1, rr, k), vs + (ok ? k * 16 : 0), ok);
          }
        } else {
#pragma unroll
          for (int k = half; k < kPieces; k += 2) {
            cp_async16(&sK(rr, 8 * k, b), ks + (ok ? k * 16 : 0), ok);
            cp_async16(&sV(rr, 8 * k, b), vs + (ok ? k * 16 : 0), ok);
          }
        }
      }
    };
    // FP8: the bytes this thread copied of tile i's K (v = 0) or V (v = 1), widened into buffer i % NB
    auto widen = [&](int i, int v) {
      auto cvt8 = [](uint32_t x, uint32_t y) {  // 8 FP8 bytes -> 8 fp16 (one 16-byte chunk of a row)
        return make_uint4(fp8x2_to_f16x2<K>(x), fp8x2_to_f16x2<K, true>(x), fp8x2_to_f16x2<K>(y),
                          fp8x2_to_f16x2<K, true>(y));
      };
      const int b = i % NB;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = r + 64 * h;
#pragma unroll
        for (int k = half; k < kChunks8; k += 2) {  // 16 bytes in, two 8-column chunks (2k, 2k + 1) out
          const uint4 x = *reinterpret_cast<const uint4*>(staged(i % NT, v, rr, k));
          T* dst0 = v ? &sV(rr, 16 * k, b) : &sK(rr, 16 * k, b);
          T* dst1 = v ? &sV(rr, 16 * k + 8, b) : &sK(rr, 16 * k + 8, b);
          *reinterpret_cast<uint4*>(dst0) = cvt8(x.x, x.y);
          *reinterpret_cast<uint4*>(dst1) = cvt8(x.z, x.w);
        }
      }
    };
    // Q: a bf16 query over an FP8 cache is scaled into fp16 by a power of two, folded into the logit scale
    const float qmul = stage_query<kFp8, D, ROWS, kP>(
        p, tl, reinterpret_cast<uint16_t*>(q_ptr),
        tid, [&](int rr, int ch) { return (int)(&sQ(rr, 8 * ch) - q_ptr); }, [] { bar_sync(kCuteBarProducer, kP); });
    if (tid == 0) *s_qmul = qmul;
    if constexpr (kFp8) {
      // Tile i + 1's bytes are in flight while tile i is widened (into the stage of tile i - 1, which this
      // thread widened last iteration). K of tile i goes into its buffer once S of tile i - NB is done,
      // V of tile i once the P V of tile i - NB is (the consumers arrive on kempty / vempty for exactly
      // the tiles waited for here). Q's copies join tile 0's group.
      {
        const int page0[2] = {page_of(0, r), page_of(0, r + 64)};
        if (steps > 0) load(0, page0);
        cp_async_commit();
      }
      int page[2] = {page_of(1, r), page_of(1, r + 64)};
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        if (i + 1 < steps) load(i + 1, page);
        cp_async_commit();
        page[0] = page_of(i + 2, r);
        page[1] = page_of(i + 2, r + 64);
        cp_async_wait_group<1>();  // tile i's bytes (and Q) landed, this thread's
        if (i >= NB) mbar_wait(empty + i % NB, (i / NB - 1) & 1);
        widen(i, 0);
        cutlass::arch::fence_view_async_shared();
        mbar_arrive(full + i % NB);
        if (i >= NB) mbar_wait(vempty + i % NB, (i / NB - 1) & 1);
        widen(i, 1);
        cutlass::arch::fence_view_async_shared();
        mbar_arrive(vfull + i % NB);
      }
    } else {
      // The consumers hold two buffers in a step (tile i - 1's V, tile i's K) and free tile k when they
      // start step k + 2: the producer makes tile i ready, then waits for tile i - 2's buffer to refill
      // it with tile i + NB - 2. Q's copies join tile 0's group.
      static_assert(NB >= 3, "two buffers in use and one in flight at least");
#pragma unroll 1
      for (int i = 0; i < NB - 2; ++i) {
        if (i < steps) {
          const int page0[2] = {page_of(i, r), page_of(i, r + 64)};
          load(i, page0);
        }
        cp_async_commit();
      }
      int page[2] = {page_of(NB - 2, r), page_of(NB - 2, r + 64)};
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        cp_async_wait_group<NB - 3>();  // tile i (and Q) landed, this thread's part
        cutlass::arch::fence_view_async_shared();
        mbar_arrive(full + i % NB);
        if (i + NB - 2 < steps) {  // into the buffer of tile i - 2
          if (i >= 2) mbar_wait(empty + (i - 2) % NB, ((i - 2) / NB) & 1);
          load(i + NB - 2, page);
        }
        cp_async_commit();
        page[0] = page_of(i + NB - 1, r);
        page[1] = page_of(i + NB - 1, r + 64);
      }
    }
    cp_async_wait_all();
    return;
  }

  // ================= consumers: 64 rows a warpgroup, warp v of it rows 16v .. 16v+15 =================
  cutlass::arch::warpgroup_reg_alloc<224>();
  const int cw = wg - 1, cwarp = warp - 4, wtid = tid - kP * wg;
  int pos[2];
  float slope[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int R = min(R0 + cwarp * 16 + g + 8 * hi, R1);
    pos[hi] = base + R / p.gqa;
    slope[hi] = (!kPlain && p.alibi) ? p.alibi[kvh * p.gqa + R % p.gqa] : 0.f;
  }
  const float ks = p.k_scale_ptr ? p.k_scale_ptr[kvh * p.k_scale_stride] : p.k_scale;
  float step_scale = 0.f;  // set once tile 0 (and the query's scale) landed

  typename SH::MmaS mma_s;
  typename SH::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(wtid);
  auto thr_o = mma_o.get_thread_slice(wtid);
  Tensor sQw = local_tile(sQ, Shape<_64, Int<D>>{}, make_coord(cw, _0{}));  // this warpgroup's 64 rows
  Tensor tSrQ = thr_s.partition_fragment_A(sQw);    // descriptors
  Tensor tSrK = thr_s.partition_fragment_B(sK);     // (MMA, 1, D / 16, NB)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);    // (MMA, 1, N / 16, NB)
  Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<N>>{});  // ((2, 2, N / 8), 1, 1): S, then P in fp32
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, Int<D>>{});  // ((2, 2, D / 8), 1, 1)
  // P as the A operand of O += P V: the m64k16 register fragment of each k16 slice holds the values of
  // n8 tiles 2kk and 2kk + 1 of S in the accumulator's own order, so P is S converted elementwise
  Tensor tOrP = make_tensor<T>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<N / 16>>>{});
  static_assert(size(tOrP) == size(tSrS), "P is S converted");
  static_assert(size<0>(tSrS) == N / 2 && size<0>(tOrO) == D / 2, "one m64 GMMA atom a warpgroup");
  clear(tOrO);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  // value e + 2 hi + 4 nt of an accumulator: row g + 8 hi of the warp's 16, column 8 nt + 2 t + e
  auto softmax = [&](int i, float (&alpha)[2]) {
    const int j0 = j_begin + i * N;
    const bool masked = !(j0 >= full_lo && j0 + N <= full_hi);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int lo_j = p.window > 0 ? pos[hi] - p.window + 1 : 0;
      const int hi_j = p.causal ? pos[hi] : L - 1;
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = tSrS(4 * nt + 2 * hi + e) * step_scale;
          const int j = j0 + nt * 8 + 2 * t + e;
          if constexpr (!kPlain) {
            if (p.soft_cap > 0.f) x = p.soft_cap * tanhf(x / p.soft_cap);
            if (p.alibi) x += slope[hi] * (float)(j - pos[hi]);
            x *= kLog2e;
          }
          if (masked && (j < lo_j || j > hi_j)) x = -INFINITY;
          tSrS(4 * nt + 2 * hi + e) = x;
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
      for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = fast_exp2(tSrS(4 * nt + 2 * hi + e) - ref);
          tSrS(4 * nt + 2 * hi + e) = x;
          sum += x;
        }
      l[hi] = l[hi] * alpha[hi] + sum;
    }
  };
  auto pack_p = [&] {
#pragma unroll
    for (int v = 0; v < size(tSrS); ++v) tOrP(v) = static_cast<T>(tSrS(v));
  };

  // FP8: K and V of a tile have their own barriers; the consumers free K after S, V after P V
  auto wait_v = [&](int i) {
    if constexpr (kFp8) mbar_wait(vfull + i % NB, (i / NB) & 1);
  };
  auto free_k = [&](int i) {
    if constexpr (kFp8) {
      if (i + NB < steps) mbar_arrive(empty + i % NB);
    }
  };

  if (steps > 0) {
    mbar_wait(full, 0);  // tile 0 (FP8: its K), Q and the query's scale in shared memory
    {
      const float logit_scale = p.scale * ks * *s_qmul;
      step_scale = kPlain ? logit_scale * kLog2e : logit_scale;
    }
    // Turns (FlashAttention-3's ping-pong): the warpgroups issue their products alternately, so one's
    // softmax runs while the other's products hold the tensor cores.
    const int turn = kCuteBarTurn + cw, other = kCuteBarTurn + 1 - cw;
    if (cw == 1) bar_arrive(kCuteBarTurn, 2 * kP);  // warpgroup 0 goes first
    float alpha[2];
    bar_sync(turn, 2 * kP);
    cute_gemm<false, false>(mma_s, tSrQ, tSrK(_, _, _, 0), tSrS);
    bar_arrive(other, 2 * kP);
    warpgroup_wait<0>();
    free_k(0);
    softmax(0, alpha);
    // finish(i): the P V of tile i - 2 done, O rescaled to tile i - 1's maximum, tile i - 1's P packed.
    // The wait for a P V opens the next step (past the loop's back edge): ptxas would hoist a GMMA wait
    // above the softmax if both sat in one block.
    auto finish = [&](int i) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      if (i >= 2 && i - 2 + NB < steps) mbar_arrive((kFp8 ? vempty : empty) + (i - 2) % NB);  // its buffer (FP8: V) is free
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          tOrO(4 * nt + 2 * hi) *= alpha[hi];
          tOrO(4 * nt + 2 * hi + 1) *= alpha[hi];
        }
      pack_p();
    };
#pragma unroll 1
    for (int i = 1; i < steps; ++i) {
      finish(i);
      mbar_wait(full + i % NB, (i / NB) & 1);  // tile i (FP8: its K) in shared memory
      wait_v(i - 1);
      bar_sync(turn, 2 * kP);
      cute_gemm<false, false>(mma_s, tSrQ, tSrK(_, _, _, i % NB), tSrS);
      cute_gemm<true, true>(mma_o, tOrP, tOrV(_, _, _, (i - 1) % NB), tOrO);
      bar_arrive(other, 2 * kP);
      warpgroup_wait<1>();  // S of tile i done; the P V of tile i - 1 may still run
      warpgroup_fence_operand(tSrS);
      free_k(i);
      softmax(i, alpha);
    }
    finish(steps);
    wait_v(steps - 1);
    bar_sync(turn, 2 * kP);
    cute_gemm<true, true>(mma_o, tOrP, tOrV(_, _, _, (steps - 1) % NB), tOrO);
    bar_arrive(other, 2 * kP);
    if (cw == 0) bar_sync(turn, 2 * kP);  // warpgroup 1's last arrival: each barrier ends balanced
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
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
    for (int nt = 0; nt < D / 8; ++nt) {
      const float x0 = tOrO(4 * nt + 2 * hi) * f, x1 = tOrO(4 * nt + 2 * hi + 1) * f;
      *reinterpret_cast<uint32_t*>(orow + (nt * 8 + 2 * t) * 2) = p.q_is_bf16 ? pack_bf16x2(x0, x1) : pack_f16x2(x0, x1);
    }
  }
#else
  __trap();  // compiled for sm_90a only; launched only where it runs (launch_prefill checks)
#endif
}

}  // namespace hal_cuda
