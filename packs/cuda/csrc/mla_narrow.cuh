// MLA decode for up to 16 rows a sequence (16 heads under tensor parallelism, or fewer heads with
// speculative tokens): the warps split the latent's 512 columns instead of the tokens, so no latent
// byte goes through shared memory.
//
// Why: with 16 rows the op is memory-bound, and mla.cuh's layout (each warp owns tokens for S and
// columns for O, so the whole latent tile passes through shared memory as fp16 and every warp reads Q
// from shared memory at every k step) costs ~750 instructions a warp per 64-token tile, 68 of them
// MMAs: an FP8 latent ran slower than a bf16 one. Here:
// * Warp w owns latent columns [64w, 64w + 64) and rope columns [8w, 8w + 8). Each thread loads 16
//   contiguous latent bytes of a token (FP8; 32 for a 16-bit latent) straight into registers; the dot
//   product's dims are permuted so those bytes are the B fragments of S = Q K^T as they are (k step kk,
//   k index 2t, 2t+1, 2t+8, 2t+9 <- columns 16t + 4kk + 0..3), and Q is loaded with the same
//   permutation once, into registers (16 rows x 64 columns: 16 registers).
// * The same fragments, transposed in registers (movmatrix), are V's B fragments for O += P V, whose
//   columns inherit the permutation: a thread's O is 16 contiguous columns of two rows.
// * S over 576 dims is the sum of the 8 warps' partial S: each warp writes its 16 x N partial to
//   shared memory and, after a barrier, reduces two rows of it and runs their online softmax (log2
//   units; the running max moves only when a logit exceeds it by 2^8, so most tiles skip rescaling O),
//   writing P (16 bits: fp16 for FP8 and fp16 latents, bf16 for bf16 ones; never FP8) and the rows'
//   rescale factors; after the next tile's barrier every warp multiplies P by its own V columns,
//   beside that tile's softmax (one barrier a tile; the shared buffers are doubled).
// * The next tile's latent and rope are loaded into registers while this one is computed.
// The rope part stays in the query's dtype and its logits are scaled into the latent's units in fp32;
// a bf16 query over an FP8 latent is moved into fp16 by an exact power of two chosen per CTA (as
// mla.cuh). Positions past the partition are zero-filled, never read; positions past a row's causal
// limit are masked.
#pragma once
#include "common.cuh"
#include "merge.cuh"
#include "mla.cuh"
#include "params.h"

namespace hal_cuda {
namespace mla {

template <bool kFp8> struct Narrow {
  static constexpr int N = kFp8 ? 64 : 32;  // tokens a tile (a 16-bit latent's fragments take twice the registers)
  static constexpr int NJ = N / 8;          // n8 token tiles of S a warp
  static constexpr int TL = N / 16;         // tokens a lane reduces (16 lanes a row)
  static constexpr int SStr = N + 8;        // partial-S row stride (floats): a fragment store is 2 wavefronts
  static constexpr int PStr = N + 8;        // P row stride (16-bit): ldmatrix rows 16 banks apart
  static constexpr int kWords = kFp8 ? 4 : 8;  // latent words a thread loads a token
  // Shared memory (dynamic: 76.9 KiB for FP8 tiles), two of each per-tile buffer (a tile's softmax and
  // the previous tile's P V run between the same two barriers)
  struct Smem {
    float part[2][kWarps][16][SStr];  // each warp's partial S
    uint16_t p[2][16][PStr];          // P
    float alpha[2][16];               // the tile's rescale factor a row
    float red[64];                    // amax, row sums, the merge's scratch
  };
  static constexpr size_t kSmem = sizeof(Smem);
};

// D = A(16x8, row) * B(8x8, col) + D, fp32 accumulators (the rope's k8 slice of a warp).
template <bool kBf16>
__device__ __forceinline__ void mma1688(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  if constexpr (kBf16) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(b0));
  }
}

template <Kind K, bool kQBf16>
__global__ void __launch_bounds__(kThreads, 1) mla_narrow_kernel(const MLAParams p) {
  constexpr bool kFp8 = Traits<K>::kFp8;
  constexpr bool kNopeBf16 = K == Kind::BF16;  // the latent products' MMA type (FP8 widens to fp16)
  constexpr bool kRescale = kFp8 && kQBf16;
  static_assert(kFp8 || (K == Kind::BF16) == kQBf16, "a 16-bit latent has the query's dtype");
  using T = Narrow<kFp8>;
  constexpr int N = T::N, NJ = T::NJ, TL = T::TL, W = T::kWords;
  extern __shared__ __align__(16) uint8_t smem[];
  typename T::Smem& sm = *reinterpret_cast<typename T::Smem*>(smem);
  auto& s_part = sm.part;
  auto& s_p = sm.p;
  auto& s_alpha = sm.alpha;
  float* s_red = sm.red;

  Item it;
  if (!mla_item<16>(p, it)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int H = p.num_heads;
  const int seq = it.seq, q0 = it.q0, qlen = it.qlen, rows = it.rows, r0 = it.r0, L = it.L, p0 = it.p0, p1 = it.p1;
  const bool split = it.split();

  // Rows g and g + 8 (this thread's MMA rows): output slot. Row hr (the row this lane reduces):
  // causal limit (exclusive; padding rows see nothing).
  int orow[2], ohead[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + g + 8 * e, tq = r / H;
    orow[e] = r < rows ? q0 + tq : -1;
    ohead[e] = r - tq * H;
  }
  const int hr = 2 * warp + (lane >> 4);
  const int lim = r0 + hr < rows ? L - qlen + (r0 + hr) / H + 1 : 0;
  if (split && p0 >= L) {  // CTA-uniform: an empty partition says so to the merge
    if (warp == 0 && t == 0)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (orow[e] >= 0) {
          const int64_t slot = it.slot(r0 + g + 8 * e);
          p.part_ml[2 * slot] = -INFINITY;
          p.part_ml[2 * slot + 1] = 0.f;
        }
    if (p.counters) merge_if_last<16>(p, it, s_red);
    return;
  }
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  const float ps = p.kpe_scale_ptr ? *p.kpe_scale_ptr : p.kpe_scale;
  const int col0 = warp * 64 + t * 16;  // this thread's 16 latent columns
  const int rope0 = warp * 8 + 2 * t;   // and its 2 rope columns

  // ---- the K/V tile loads: tokens s + 8j + g, j < NJ, into registers ----
  const int* table = p.block_tables + (int64_t)seq * p.bt_stride0;
  const int bmask = p.block_size - 1;
  const int64_t ckv_step = 8 * p.ckv_token_stride, kpe_step = 8 * p.kpe_token_stride;  // token g -> g + 8
  // A whole tile over pages of >= 8 tokens (the common case) walks two pointers 8 tokens a step and
  // looks a page up only where one starts: tiles start at multiples of N, so a tile either lies in one
  // page from row s mod block_size (pages of more than N tokens) or starts a page (N or fewer), and
  // token s + 8j + g is in page slot (s + 8j) / block_size. A tile past the partition's end or over
  // smaller pages takes the general path, a lookup and a bounds check a token.
  auto load_tile = [&](int s, uint32_t (&dst)[NJ][W], uint32_t (&dr)[NJ]) {
    if (p.block_size >= 8 && s + N <= p1) {
      const int* tp = table + (s >> p.block_shift);
      const uint8_t* c = nullptr;
      const uint8_t* r = nullptr;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        if (((8 * j) & bmask) == 0) {
          const int64_t page = tp[(8 * j) >> p.block_shift];
          const int64_t row = (int64_t)((s & bmask) + g);
          c = p.ckv + page * p.ckv_block_stride + row * p.ckv_token_stride + col0 * Traits<K>::kBytes;
          r = p.kpe + page * p.kpe_block_stride + row * p.kpe_token_stride + rope0 * 2;
        }
        load_bytes<16>(c, dst[j]);
        if constexpr (W == 8) load_bytes<16>(c + 16, dst[j] + 4);
        dr[j] = __ldg(reinterpret_cast<const uint32_t*>(r));
        c += ckv_step;
        r += kpe_step;
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int pos = s + 8 * j + g;
      if (pos < p1) {
        const int64_t page = table[pos >> p.block_shift];
        const int64_t off = (int64_t)(pos & bmask);
        const uint8_t* c = p.ckv + page * p.ckv_block_stride + off * p.ckv_token_stride + col0 * Traits<K>::kBytes;
        load_bytes<16>(c, dst[j]);
        if constexpr (W == 8) load_bytes<16>(c + 16, dst[j] + 4);
        dr[j] = __ldg(reinterpret_cast<const uint32_t*>(p.kpe + page * p.kpe_block_stride + off * p.kpe_token_stride) + rope0 / 2);
      } else {
#pragma unroll
        for (int i = 0; i < W; ++i) dst[j][i] = 0u;
        dr[j] = 0u;
      }
    }
  };
  // buf0 / rb0: where a tile's loads land (the tiles computed are copied out of it, below)
  uint32_t buf0[NJ][W], rb0[NJ];
  const int ntiles = p1 > p0 ? (p1 - p0 + N - 1) / N : 0;
  if (ntiles > 0) load_tile(p0, buf0, rb0);  // in flight while Q is read

  // ---- Q: rows g, g + 8; latent columns col0..col0+15 (permuted into k steps), rope columns rope0, +1 ----
  uint32_t qw[2][8], qr[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + g + 8 * e;
    if (r < rows) {
      const int tq = r / H, h = r - tq * H;
      const uint16_t* qn = static_cast<const uint16_t*>(p.q_nope) + (int64_t)(q0 + tq) * p.qn_stride0 + (int64_t)h * p.qn_stride1 + col0;
      load_bytes<16>(reinterpret_cast<const uint8_t*>(qn), qw[e]);
      load_bytes<16>(reinterpret_cast<const uint8_t*>(qn + 8), qw[e] + 4);
      qr[e] = __ldg(reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.q_pe) + (int64_t)(q0 + tq) * p.qp_stride0 +
                                                      (int64_t)h * p.qp_stride1 + rope0));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qw[e][i] = 0u;
      qr[e] = 0u;
    }
  }
  float s2k = 1.f;  // the power of two q_nope was multiplied by
  if constexpr (kRescale) {
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        amax = fmaxf(amax, fmaxf(fabsf(bf16_bits_to_f32(qw[e][i] & 0xffffu)), fabsf(bf16_bits_to_f32(qw[e][i] >> 16))));
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) s_red[warp] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, s_red[w]);
    s2k = fp16_power_of_two(amax);
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        qw[e][i] = pack_f16x2(bf16_bits_to_f32(qw[e][i] & 0xffffu) * s2k, bf16_bits_to_f32(qw[e][i] >> 16) * s2k);
  }
  // A fragments of the k steps: a0 = row g, k index 2t, 2t+1 (columns 16t + 4kk, +1); a1 = row g + 8;
  // a2, a3 = k index 2t + 8, 2t + 9 (columns 16t + 4kk + 2, +3).
  uint32_t qa[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) qa[kk][0] = qw[0][2 * kk], qa[kk][1] = qw[1][2 * kk], qa[kk][2] = qw[0][2 * kk + 1], qa[kk][3] = qw[1][2 * kk + 1];

  const float ratio = ps * s2k / cs;            // rope logits into the latent's (rescaled) units
  const float c2 = cs / s2k * p.scale * kLog2e;  // to log2 units
  float o[4][2][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) o[kk][h][0] = o[kk][h][1] = o[kk][h][2] = o[kk][h][3] = 0.f;
  float m2 = -INFINITY, l2 = 0.f;  // row hr: running max (log2 units) and this lane's share of the sum

  // A tile in three steps, pipelined a tile apart so that a CTA meets at one barrier a tile:
  //   partial_s(k) -> barrier -> softmax(k) beside pv(k - 1) -> partial_s(k + 1) -> barrier -> ...
  // partial_s writes this warp's partial S into s_part[k & 1]; softmax reads the 8 partials of its rows
  // and writes P and the rows' rescale factor into s_p[k & 1] / s_alpha[k & 1]; pv (after the next
  // barrier) rescales O and adds P V, V's fragments widened and transposed again from the tile's raw
  // bytes (kept a tile longer: cheaper in registers than the transposed fragments).
  auto partial_s = [&](const uint32_t (&cur)[NJ][W], const uint32_t (&cr)[NJ], int b) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      mma1688<kQBf16>(acc, qr[0], qr[1], cr[j]);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] *= ratio;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t b0, b1;
        if constexpr (kFp8) {
          b0 = fp8x2_to_f16x2<K>(cur[j][kk]);
          b1 = fp8x2_to_f16x2<K, true>(cur[j][kk]);
        } else {
          b0 = cur[j][2 * kk], b1 = cur[j][2 * kk + 1];
        }
        mma16816<kNopeBf16>(acc, qa[kk], b0, b1);
      }
      *reinterpret_cast<float2*>(&s_part[b][warp][g][8 * j + 2 * t]) = make_float2(acc[0], acc[1]);
      *reinterpret_cast<float2*>(&s_part[b][warp][g + 8][8 * j + 2 * t]) = make_float2(acc[2], acc[3]);
    }
  };
  // rows hr: S = the sum of the partials, online softmax, P and the rows' rescale factor
  auto softmax = [&](int s, int b) {
    const int c0 = TL * (lane & 15);
    float x[TL];
#pragma unroll
    for (int e = 0; e < TL; ++e) x[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if constexpr (TL == 4) {
        const float4 y = *reinterpret_cast<const float4*>(&s_part[b][w][hr][c0]);
        x[0] += y.x, x[1] += y.y, x[2] += y.z, x[3] += y.w;
      } else {
        const float2 y = *reinterpret_cast<const float2*>(&s_part[b][w][hr][c0]);
        x[0] += y.x, x[1] += y.y;
      }
    }
    const int end = min(lim, p1);
    float mx = -INFINITY;
#pragma unroll
    for (int e = 0; e < TL; ++e) {
      x[e] = s + c0 + e < end ? x[e] * c2 : -INFINITY;
      mx = fmaxf(mx, x[e]);
    }
#pragma unroll
    for (int o2 = 1; o2 < 16; o2 <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
    // lazy: the reference max moves only past 2^8, so P <= 2^8 (exact in fp16/bf16 and the sums)
    const float mn = mx > m2 + 8.f ? mx : m2;
    const float alpha = mn == m2 ? 1.f : fast_exp2(m2 - mn);  // m2 = -inf: alpha 0, l2 and O are 0
    const float msafe = mn == -INFINITY ? 0.f : mn;
    m2 = mn;
    float pr[TL], rs = 0.f;
#pragma unroll
    for (int e = 0; e < TL; ++e) pr[e] = fast_exp2(x[e] - msafe), rs += pr[e];
    l2 = l2 * alpha + rs;
    uint32_t pw[TL / 2];
#pragma unroll
    for (int e = 0; e < TL / 2; ++e)
      pw[e] = kNopeBf16 ? pack_bf16x2(pr[2 * e], pr[2 * e + 1]) : pack_f16x2(pr[2 * e], pr[2 * e + 1]);
    if constexpr (TL == 4) *reinterpret_cast<uint2*>(&s_p[b][hr][c0]) = make_uint2(pw[0], pw[1]);
    else *reinterpret_cast<uint32_t*>(&s_p[b][hr][c0]) = pw[0];
    if ((lane & 15) == 0) s_alpha[b][hr] = alpha;
  };
  auto rescale = [&](int b) {
    const float a0 = s_alpha[b][g], a1 = s_alpha[b][g + 8];
    if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) o[kk][h][0] *= a0, o[kk][h][1] *= a0, o[kk][h][2] *= a1, o[kk][h][3] *= a1;
    }
  };
  // O (rows g, g + 8; this warp's columns) += P V over the tile whose latent is in prev; P's A fragments
  // are read first (load_p), apart, so that the reads go out before the softmax beside which pv runs
  // (ldmatrix is an asm statement: ptxas keeps it after the softmax's shared-memory stores)
  auto load_p = [&](int b, uint32_t (&pf)[N / 16][4]) {
    const uint32_t pa = smem_addr(&s_p[b][lane & 15][(lane >> 4) * 8]);
#pragma unroll
    for (int J = 0; J < N / 16; ++J) ldsm_x4(pf[J], pa + J * 32);
  };
  auto pv = [&](const uint32_t (&prev)[NJ][W], const uint32_t (&pf)[N / 16][4]) {
#pragma unroll
    for (int J = 0; J < N / 16; ++J) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t v[2][2];  // [token n8 of the k16 step][half]
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          if constexpr (kFp8) {
            // the raw bytes transposed as 16-bit pairs: thread (g, t) gets tokens 2t, 2t + 1 of columns
            // c, c + 1 (c = 16 (g / 2) + 4 kk + 2 (g % 2)); one byte permute pairs each column's two
            // tokens, and the two widenings are column c's (half 0) and c + 1's (half 1) B fragments
            const uint32_t m = __byte_perm(transpose8x8(prev[2 * J + jj][kk]), 0u, 0x3120);
            v[jj][0] = fp8x2_to_f16x2<K>(m);
            v[jj][1] = fp8x2_to_f16x2<K, true>(m);
          } else {
            v[jj][0] = transpose8x8(prev[2 * J + jj][2 * kk]);
            v[jj][1] = transpose8x8(prev[2 * J + jj][2 * kk + 1]);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) mma16816<kNopeBf16>(o[kk][h], pf[J], v[0][h], v[1][h]);
      }
    }
  };
  // Tile k's raw bytes: loaded into buf0 a tile ahead, copied into cur when its turn comes and into
  // prev after it, for pv(k) in the next step. The first step is peeled off so that softmax(k) and
  // pv(k - 1) share a basic block (ptxas interleaves the MMAs with the softmax's dependent chain).
  uint32_t cur[NJ][W], cr[NJ], prev[NJ][W];
  auto begin_step = [&](int k) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      cr[j] = rb0[j];
#pragma unroll
      for (int i = 0; i < W; ++i) cur[j][i] = buf0[j][i];
    }
    if (k + 1 < ntiles) load_tile(p0 + (k + 1) * N, buf0, rb0);
    partial_s(cur, cr, k & 1);
    __syncthreads();
  };
  auto keep = [&]() {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int i = 0; i < W; ++i) prev[j][i] = cur[j][i];
  };
  if (ntiles > 0) {
    begin_step(0);
    softmax(p0, 0);
    keep();
#pragma unroll 1
    for (int k = 1; k < ntiles; ++k) {
      begin_step(k);
      rescale((k - 1) & 1);
      uint32_t pf[N / 16][4];
      load_p((k - 1) & 1, pf);
      softmax(p0 + k * N, k & 1);
      pv(prev, pf);
      keep();
    }
    __syncthreads();
    rescale((ntiles - 1) & 1);
    uint32_t pf[N / 16][4];
    load_p((ntiles - 1) & 1, pf);
    pv(prev, pf);
  }

  // ---- row sums (16 lanes a row), then the output or this partition's partial ----
#pragma unroll
  for (int o2 = 1; o2 < 16; o2 <<= 1) l2 += __shfl_xor_sync(0xffffffffu, l2, o2);
  __syncthreads();  // s_red may still be read by the Q rescale of a slow warp
  if ((lane & 15) == 0) s_red[hr] = l2, s_red[16 + hr] = m2;
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (orow[e] < 0) continue;
    const int row = g + 8 * e;
    const float lsum = s_red[row];
    // lsum == 0: no key (an empty sequence gives zeros; an empty partition is skipped by the merge)
    const float inv = lsum == 0.f ? 0.f : 1.f / lsum;
    float y[16];  // columns col0 + 4kk + 2h + {0, 1}
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // O's n8 blocks: column col0 + 4kk + 2h + q for a 16-bit latent, col0 + 4kk + 2q + h for FP8 (pv)
        y[kFp8 ? 4 * kk + h : 4 * kk + 2 * h] = o[kk][h][2 * e] * inv;
        y[kFp8 ? 4 * kk + 2 + h : 4 * kk + 2 * h + 1] = o[kk][h][2 * e + 1] * inv;
      }
    if (!split) {
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        w[i] = p.q_is_bf16 ? pack_bf16x2(y[2 * i] * cs, y[2 * i + 1] * cs) : pack_f16x2(y[2 * i] * cs, y[2 * i + 1] * cs);
      uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.out) + (int64_t)orow[e] * p.out_stride0 +
                                            (int64_t)ohead[e] * p.out_stride1 + col0);
      dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
      dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    } else {
      const int64_t slot = it.slot(r0 + row);
      float4* dst = reinterpret_cast<float4*>(p.part_out + slot * kR + col0);
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
      if (warp == 0 && t == 0) p.part_ml[2 * slot] = s_red[16 + row], p.part_ml[2 * slot + 1] = lsum;
    }
  }
  if (split && p.counters) {
    __syncthreads();  // s_red is the merge's scratch
    merge_if_last<16>(p, it, s_red);
  }
}

}  // namespace mla
}  // namespace hal_cuda
