// Multi-token paged attention on Hopper (sm_90a): the contract and the row mapping of prefill.cuh,
// with the two products on warpgroup MMAs (wgmma.mma_async, wgmma.cuh) instead of mma.sync.
//
// One CTA of two warpgroups (256 threads) per (sequence, 128 query rows, KV head); warpgroup w owns
// rows 64w .. 64w+63, warp v of the CTA rows 16v .. 16v+15 exactly as in prefill.cuh with one m16
// tile a warp, so the softmax and the output code are the same.
// * Operand tiles in shared memory in the core-matrix layout of wgmma.cuh: Q (128 x D), and two
//   buffers each of K and V (kN x D): the next step's tile is gathered (cp.async through the block
//   table; FP8 through a byte staging tile, widened by all 256 threads with the hardware cvt) while
//   this step's products run.
// * S = Q K^T: A and B from shared memory (K-major). O += P V: P from registers (the S accumulators
//   repacked to 16 bits, the m64k16 A fragment is the mma.sync one), V MN-major from shared memory.
// * Precision as in prefill.cuh: Q never below its 16 bits (a bf16 query over an FP8 cache scaled by a
//   power of two into fp16), P in the MMA's 16-bit type, fp32 accumulation, never FP8.
#pragma once
#include "prefill.cuh"
#include "wgmma.cuh"

namespace hal_cuda {

constexpr int kWgThreads = 256;

template <int D> struct WgShape {
  static constexpr int kRows = 128;                 // query rows a CTA (two warpgroups of 64)
  static constexpr int kN = D <= 128 ? 128 : 64;    // keys a step (shared memory: 227 KiB at D = 256)
  static constexpr int kStage = D + 16;             // bytes between FP8 staging rows (conflict-free reads)
};

// D with a wgmma kernel: multiples of 64 (the products are issued as 64-column pieces)
__host__ __device__ constexpr bool wg_head_size(int d) { return d == 64 || d == 128 || d == 192 || d == 256; }

// Whether the current device runs the sm_90a kernel: an sm_90 GPU, and sm_90a code in this module
// (HAL_CUDA_SM90A: CMake saw 90a among the archs; other sm_90 builds hold an empty body that traps).
inline bool prefill_uses_wgmma() {
#ifdef HAL_CUDA_SM90A
  static int cc[64] = {};  // per device: 0 not asked yet, else major * 10 + minor
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (cc[dev] == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    cc[dev] = major * 10 + minor;
  }
  return cc[dev] == 90;
#else
  return false;
#endif
}

template <Kind K, int D> constexpr int wg_smem_bytes() {
  using S = WgShape<D>;
  return S::kRows * D * 2 + 4 * S::kN * D * 2 + (Traits<K>::kFp8 ? 2 * S::kN * S::kStage : 0);
}

template <Kind K, int D, bool kPlain>
__global__ void __launch_bounds__(kWgThreads, 1) prefill_wg_kernel(const PrefillParams p) {
#ifdef HAL_WGMMA
  using SH = WgShape<D>;
  constexpr int ROWS = SH::kRows, N = SH::kN, NC = N / 64, DC = D / 64, KB = D / 16, CH = D / 8;
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr bool kBf = Traits<K>::kBf16Math;
  constexpr int kBpe = Traits<K>::kBytes;
  constexpr int kWarps = kWgThreads / 32;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr uint32_t kRowGroup = CH * 128;  // bytes between 8-row groups of a tile

  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + ROWS * D;      // two buffers of N x D
  uint16_t* sV = sK + 2 * N * D;
  uint8_t* stK = reinterpret_cast<uint8_t*>(sV + 2 * N * D);  // FP8 staging: N rows of kStage bytes
  uint8_t* stV = stK + N * SH::kStage;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg = warp / 4;
  const int seq = blockIdx.x / p.row_tiles;
  const int tile = p.row_tiles - 1 - blockIdx.x % p.row_tiles;  // the longest rows (last tokens) first
  const int kvh = blockIdx.y;
  const int q0 = p.query_start_loc[seq];
  const int qlen = p.query_start_loc[seq + 1] - q0;
  if (qlen < p.min_rows) return;
  const int nrows = qlen * p.gqa;
  const int R0 = tile * ROWS;
  if (R0 >= nrows) return;
  const int R1 = min(R0 + ROWS, nrows) - 1;
  const int L = p.seq_lens[seq];
  const int base = L - qlen;
  const int pos_first = base + R0 / p.gqa, pos_last = base + R1 / p.gqa;
  const int kv_lo = p.window > 0 ? max(0, pos_first - p.window + 1) : 0;
  const int kv_hi = min(L, p.causal ? pos_last + 1 : L);
  const int full_lo = p.window > 0 ? max(0, pos_last - p.window + 1) : 0;
  const int full_hi = p.causal ? pos_first + 1 : L;

  const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
  const int64_t k_head = (int64_t)kvh * p.k_head_stride, v_head = (int64_t)kvh * p.v_head_stride;

  // ---- gathers: 16-byte pieces, the 8 rows of a core matrix on 8 neighbouring threads ----
  constexpr int kPieces = D * kBpe / 16;  // 16-byte pieces a cache row
  auto gather = [&](int j0, const uint8_t* cache, int64_t block_stride, int64_t head_off, int64_t row,
                    uint16_t* tile16, uint8_t* staging) {
#pragma unroll 4
    for (int c = tid; c < N * kPieces; c += kWgThreads) {
      const int r = (c & 7) + 8 * (c / (8 * kPieces)), piece = (c >> 3) % kPieces;
      const int j = j0 + r;
      const bool ok = j >= kv_lo && j < kv_hi;
      const int64_t page = ok ? table[j >> p.block_shift] : 0;
      const uint8_t* src = cache + page * block_stride + head_off + (int64_t)(j & (p.block_size - 1)) * row + piece * 16;
      void* dst = kFp8 ? static_cast<void*>(staging + r * SH::kStage + piece * 16)
                       : static_cast<void*>(tile16 + cm_offset(r, piece, D));
      cp_async16(dst, ok ? src : cache, ok);
    }
  };
  auto load = [&](int j0, int buf) {
    gather(j0, p.key_cache, p.k_stride0, k_head, p.k_row, sK + buf * N * D, stK);
    gather(j0, p.value_cache, p.v_stride0, v_head, p.v_row, sV + buf * N * D, stV);
  };
  auto widen = [&](int buf) {  // FP8 staging -> fp16 tiles of buffer buf, one 8-column chunk a pass
    uint16_t* k16 = sK + buf * N * D;
    uint16_t* v16 = sV + buf * N * D;
#pragma unroll 4
    for (int c = tid; c < N * CH; c += kWgThreads) {
      const int r = (c & 7) + 8 * (c / (8 * CH)), ch = (c >> 3) % CH;
      const uint2 kb = *reinterpret_cast<const uint2*>(stK + r * SH::kStage + ch * 8);
      const uint2 vb = *reinterpret_cast<const uint2*>(stV + r * SH::kStage + ch * 8);
      *reinterpret_cast<uint4*>(k16 + cm_offset(r, ch, D)) =
          make_uint4(fp8x2_to_f16x2<K>(kb.x), fp8x2_to_f16x2<K>(kb.x >> 16), fp8x2_to_f16x2<K>(kb.y), fp8x2_to_f16x2<K>(kb.y >> 16));
      *reinterpret_cast<uint4*>(v16 + cm_offset(r, ch, D)) =
          make_uint4(fp8x2_to_f16x2<K>(vb.x), fp8x2_to_f16x2<K>(vb.x >> 16), fp8x2_to_f16x2<K>(vb.y), fp8x2_to_f16x2<K>(vb.y >> 16));
    }
  };

  // ---- Q tile: row r -> (token (R0 + r) / gqa, head kvh * gqa + (R0 + r) % gqa); rows past R1 zero ----
  auto q_row = [&](int r) -> const uint8_t* {
    const int R = R0 + r;
    return reinterpret_cast<const uint8_t*>(p.query) +
           ((int64_t)(q0 + R / p.gqa) * p.q_stride0 + (int64_t)(kvh * p.gqa + R % p.gqa) * p.q_stride1) * 2;
  };
  float qmul = 1.f;
  if (kFp8 && p.q_is_bf16) {
    __shared__ float red[kWarps];
    float amax = 0.f;
    for (int c = tid; c < ROWS * CH; c += kWgThreads) {
      const int r = c / CH, col = (c % CH) * 8;
      if (R0 + r > R1) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(q_row(r) + col * 2);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w[i] << 16)), fabsf(__uint_as_float(w[i] & 0xffff0000u))));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    amax = red[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) amax = fmaxf(amax, red[w]);
    float up = 1.f;
    if (amax > 0.f && isfinite(amax)) {
      int e;
      frexpf(amax, &e);
      qmul = exp2f((float)(e - 15));
      up = exp2f((float)(15 - e));
    }
    for (int c = tid; c < ROWS * CH; c += kWgThreads) {
      const int r = c / CH, ch = c % CH;
      uint4 h = make_uint4(0u, 0u, 0u, 0u);
      if (R0 + r <= R1) {
        const uint4 v = *reinterpret_cast<const uint4*>(q_row(r) + ch * 16);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        uint32_t o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = pack_f16x2(__uint_as_float(w[i] << 16) * up, __uint_as_float(w[i] & 0xffff0000u) * up);
        h = make_uint4(o[0], o[1], o[2], o[3]);
      }
      *reinterpret_cast<uint4*>(sQ + cm_offset(r, ch, D)) = h;
    }
  } else {
    for (int c = tid; c < ROWS * CH; c += kWgThreads) {
      const int r = c / CH, ch = c % CH;
      const bool ok = R0 + r <= R1;
      cp_async16(sQ + cm_offset(r, ch, D), ok ? q_row(r) + ch * 16 : static_cast<const uint8_t*>(p.query), ok);
    }
  }

  const int j_begin = kv_lo & ~(N - 1);
  if (j_begin < kv_hi) load(j_begin, 0);
  cp_async_commit();

  // ---- per-row facts of this thread's two rows: warp*16 + g + 8*hi ----
  int pos[2];
  float slope[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int R = min(R0 + warp * 16 + g + 8 * hi, R1);
    pos[hi] = base + R / p.gqa;
    slope[hi] = (!kPlain && p.alibi) ? p.alibi[kvh * p.gqa + R % p.gqa] : 0.f;
  }
  const float ks = p.k_scale_ptr ? p.k_scale_ptr[kvh * p.k_scale_stride] : p.k_scale;
  const float logit_scale = p.scale * ks * qmul;
  const float step_scale = kPlain ? logit_scale * kLog2e : logit_scale;

  float o[DC][32];
#pragma unroll
  for (int c = 0; c < DC; ++c)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[c][i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  const uint16_t* qwg = sQ + cm_offset(64 * wg, 0, D);
  int buf = 0;
  if constexpr (kFp8) {  // the first tile widened before the loop
    cp_async_wait_all();
    __syncthreads();
    widen(0);
  }
  for (int j0 = j_begin; j0 < kv_hi; j0 += N) {
    const bool more = j0 + N < kv_hi;
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // this step's tile (16-bit: K and V; FP8: its widened tiles) ready; the other buffer free
    if (more) load(j0 + N, buf ^ 1);  // FP8: into the staging tile (widened below, after S is issued)
    cp_async_commit();

    // ---- S = Q K^T: 64 rows a warpgroup x N keys, as N/64 pieces of 64 ----
    float s[NC][32];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int i = 0; i < 32; ++i) s[c][i] = 0.f;
    const uint16_t* kt = sK + buf * N * D;
    wg_fence();
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
      const uint64_t da = wg_desc(qwg + kb * 16 * 8, 128, kRowGroup);
#pragma unroll
      for (int c = 0; c < NC; ++c) wgmma_ss<kBf>(s[c], da, wg_desc(kt + cm_offset(64 * c, 2 * kb, D), 128, kRowGroup));
    }
    wg_commit();
    if constexpr (kFp8) {
      if (more) {  // widen the next tile while the products run
        cp_async_wait_all();
        __syncthreads();
        widen(buf ^ 1);
      }
    }
    wg_wait<0>();
#pragma unroll
    for (int c = 0; c < NC; ++c) wg_pin(s[c]);

    // ---- scale, soft-cap, ALiBi, mask; online softmax per row ----
    const bool masked = !(j0 >= full_lo && j0 + N <= full_hi);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int lo_j = p.window > 0 ? pos[hi] - p.window + 1 : 0;
      const int hi_j = p.causal ? pos[hi] : L - 1;
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[c][4 * nt + 2 * hi + e] * step_scale;
            const int j = j0 + 64 * c + nt * 8 + 2 * t + e;
            if constexpr (!kPlain) {
              if (p.soft_cap > 0.f) x = p.soft_cap * tanhf(x / p.soft_cap);
              if (p.alibi) x += slope[hi] * (float)(j - pos[hi]);
              x *= kLog2e;
            }
            if (masked && (j < lo_j || j > hi_j)) x = -INFINITY;
            s[c][4 * nt + 2 * hi + e] = x;
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
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = fast_exp2(s[c][4 * nt + 2 * hi + e] - ref);
            s[c][4 * nt + 2 * hi + e] = x;
            sum += x;
          }
      l[hi] = l[hi] * alpha + sum;
#pragma unroll
      for (int c = 0; c < DC; ++c)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) { o[c][4 * nt + 2 * hi] *= alpha; o[c][4 * nt + 2 * hi + 1] *= alpha; }
    }

    // ---- O += P V: P's k16 slices from the S accumulators, V MN-major ----
    const uint16_t* vt = sV + buf * N * D;
    auto pack = [](float lo, float hi) { return kBf ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi); };
    uint32_t pa[N / 16][4];  // all of P packed before the first product (no fence between them)
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      const float* sc = s[kk / 4] + 8 * (kk % 4);  // n8 tiles 2kk and 2kk+1 of the S piece
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
    buf ^= 1;
  }
  cp_async_wait_all();

  // ---- normalise and write this thread's rows ----
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float lsum = l[hi];
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
    const int R = R0 + warp * 16 + g + 8 * hi;
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
