// The balanced split of MLA decode's context, computed on the device from seq_lens (graph-safe): one
// CTA writes the work list the decode kernels read (mla_item.cuh), before them in the same stream.
//
// Why: the uniform split cuts every row tile (a sequence's rows, 16-64 of them) of a batch by the
// longest sequence's length, so on a ragged batch the CTAs of the long sequences set the time while
// those of short ones idle. Here each row tile of b blocks (64 tokens) is cut into ceil(b / B)
// partitions of about equal size, under a cap of B blocks a partition chosen for the whole batch, and
// the list puts the longest partitions first, so the hardware's in-order dispatch (one CTA an SM)
// packs them about as a longest-first greedy schedule would.
//
// The cap B. Where every row tile is as long (a uniform batch): the longest cut into G / tiles
// partitions (one wave of G = sched_ctas CTAs, one an SM; never under 4 blocks), which is the uniform
// split's. Otherwise 32 candidates, the longest tile cut 1..8 times, then 8 x 1.127^i (up to ~140), each
// scored by an estimate of the greedy schedule's makespan with a fixed cost of c0 blocks a CTA
// (sched_overhead: the Q load, the partial's write and its merge), the longest partition taken as B:
//   items <= G (one wave):  B + c0,   else:  max(B + c0, (W + c0 items) / G + (B + c0) / 2)
// with W the batch's blocks (tools/mla_split_model.py, this rule against a greedy dispatch: within 3 % of
// the best candidate on average over random ragged batches; docs/cuda.md). Candidates that need more CTAs than sched_cap or more
// partial slots than sched_slots (the workspace the host sized) are out; cutting nothing always fits.
//
// A plan's launches pass `sched_seen` (the row tiles' block counts the list was made for, INT_MIN at
// first): where they are unchanged (the layers of one step) the list stands and the launch ends after
// reading seq_lens.
#include <climits>

#include "launch.h"
#include "params.h"

namespace hal_cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32, kCands = 32, kBuckets = 1024, kBlock = 64;
constexpr int kMinBlocks = 4;  // partitions of at least 256 tokens, as the uniform split

// ceil(a / d) for 0 <= a < 2^24, d >= 1, without an integer division: the float quotient is within
// one of a / d, and one correction step each way makes it exact.
__device__ __forceinline__ int cdiv(int a, int d) {
  int q = (int)ceilf(__fdividef((float)a, (float)d));
  if (q > 0 && (q - 1) * d >= a) --q;
  else if (q * d < a) ++q;
  return q;
}

// {partitions, blocks a partition} of a row tile of b blocks under a cap of B: n = ceil(b / B) partitions
// of ceil(b / n) blocks (the last may be shorter, none is empty: ceil(b / ceil(b / n)) == n); b == 0:
// one empty partition.
__device__ __forceinline__ int2 cut(int b, int B) {
  if (b <= B) return make_int2(1, b);
  const int n = cdiv(b, B);
  return make_int2(n, cdiv(b, n));
}

__device__ __forceinline__ long long warp_sum64(long long v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void __launch_bounds__(kThreads) mla_schedule_kernel(const MLAParams p) {
  __shared__ int s_blocks[kMlaScheduleTiles];  // a row tile's blocks, -1 where it has no rows
  __shared__ int s_bucket[kBuckets];           // partitions by size, longest first
  __shared__ int s_items[kWarps][kCands], s_split[kWarps][kCands];  // a warp's share, by candidate
  __shared__ long long s_w[kWarps];
  __shared__ int s_max[kWarps], s_min[kWarps], s_tiles[kWarps], s_scan[kWarps], s_slots, s_cap;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int U = p.num_seqs * p.row_tiles, G = p.sched_ctas;
  const float c0 = (float)p.sched_overhead;

  // ---- every row tile's blocks; the batch's sum W, longest and shortest; unchanged since the last list? ----
  long long w = 0;
  int bmax = 0, bmin = INT_MAX, tiles = 0, changed = p.sched_seen == nullptr;
  for (int u = tid; u < U; u += kThreads) {
    const int s = u / p.row_tiles, tile = u - s * p.row_tiles;
    const int qlen = p.query_start_loc ? p.query_start_loc[s + 1] - p.query_start_loc[s] : 1;
    const int b = tile * p.tile_rows < qlen * p.num_heads ? (max(p.seq_lens[s], 0) + kBlock - 1) / kBlock : -1;
    s_blocks[u] = b;
    if (b > 0) w += b, bmax = max(bmax, b);
    if (b >= 0) bmin = min(bmin, b), ++tiles;
    if (!changed) changed = p.sched_seen[u] != b;
  }
  for (int i = tid; i < kBuckets; i += kThreads) s_bucket[i] = 0;
  if (tid == 0) s_slots = 0;
  w = warp_sum64(w);
  bmax = __reduce_max_sync(0xffffffffu, bmax);
  bmin = __reduce_min_sync(0xffffffffu, bmin);
  tiles = __reduce_add_sync(0xffffffffu, tiles);
  if (lane == 0) s_w[warp] = w, s_max[warp] = bmax, s_min[warp] = bmin, s_tiles[warp] = tiles;
  if (!__syncthreads_or(changed)) return;  // the list in the workspace is this batch's
  for (int i = tid; i < p.sched_cap; i += kThreads) p.work[i] = make_int4(-1, 0, 0, 0);  // (entries win: later)
  bmax = __reduce_max_sync(0xffffffffu, s_max[lane]);
  bmin = __reduce_min_sync(0xffffffffu, s_min[lane]);
  tiles = __reduce_add_sync(0xffffffffu, s_tiles[lane]);

  if (bmin == bmax) {  // ---- one length: the uniform split's cut, one wave ----
    if (tid == 0) s_cap = max(kMinBlocks, cdiv(bmax, max(1, G / max(1, tiles))));
  } else {
    // ---- the candidates: lane c scores candidate c over this warp's row tiles (k, k + 32, ...) ----
    const int cuts = lane < 8 ? lane + 1 : (int)(8.f * exp2f(0.1725f * (lane - 7)) + 0.5f);  // 1..8, then x1.127
    const int cb = max(kMinBlocks, cdiv(bmax, cuts));
    int items = 0, split = 0;
    for (int u = warp; u < U; u += kWarps) {
      const int b = s_blocks[u];
      const int n = b < 0 ? 0 : b <= cb ? 1 : cdiv(b, cb);
      items += n;
      split += n > 1 ? n : 0;
    }
    s_items[warp][lane] = items, s_split[warp][lane] = split;
    __syncthreads();
    if (warp == 0) {  // each candidate's estimate, and the least (on a tie the fewest cuts)
      items = 0, split = 0;
#pragma unroll 8
      for (int k = 0; k < kWarps; ++k) items += s_items[k][lane], split += s_split[k][lane];
      w = warp_sum64(s_w[lane]);
      const float mx = (float)min(cb, bmax) + c0;
      float e = items > p.sched_cap || split > p.sched_slots ? INFINITY
              : items <= G ? mx : fmaxf(mx, ((float)w + c0 * items) / G + 0.5f * mx);
      int best = lane;
#pragma unroll
      for (int o = 16; o; o >>= 1) {
        const float e2 = __shfl_xor_sync(0xffffffffu, e, o);
        const int b2 = __shfl_xor_sync(0xffffffffu, best, o);
        if (e2 < e || (e2 == e && b2 < best)) e = e2, best = b2;
      }
      if (lane == best) s_cap = cb;
    }
  }
  __syncthreads();
  const int B = s_cap;

  // ---- the list, longest partitions first: a histogram by size, its exclusive scan, then each row
  // tile takes its place (within a size bucket in any order: a tile's partitions stay adjacent and in
  // order, so the merge, and the result, do not depend on it) ----
  // (exact below kBuckets blocks a partition; above, sizes within B / 1023 blocks may share one)
  auto bucket_of = [&](int size) {
    return kBuckets - 1 - (B < kBuckets ? size : (int)((long long)size * (kBuckets - 1) / B));
  };
  for (int u = tid; u < U; u += kThreads) {
    const int b = s_blocks[u];
    if (b >= 0) {
      const int2 k = cut(b, B);
      atomicAdd(&s_bucket[bucket_of(k.y)], k.x);
    }
  }
  __syncthreads();
  {
    static_assert(kBuckets == kThreads, "one bucket a thread");
    const int v = s_bucket[tid];
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) s_scan[warp] = x;
    __syncthreads();
    const int before = __reduce_add_sync(0xffffffffu, lane < warp ? s_scan[lane] : 0);
    s_bucket[tid] = before + x - v;
  }
  __syncthreads();
  for (int u = tid; u < U; u += kThreads) {
    const int b = s_blocks[u];
    if (p.sched_seen) p.sched_seen[u] = b;
    if (b < 0) {
      p.tile_parts[u] = make_int4(0, 0, 0, 0);
      continue;
    }
    const int2 k = cut(b, B);
    const int pos = atomicAdd(&s_bucket[bucket_of(k.y)], k.x);
    const int first = k.x > 1 ? atomicAdd(&s_slots, k.x) : 0;
    p.tile_parts[u] = make_int4(first, k.x, k.y * kBlock, 0);
    const int s = u / p.row_tiles, tile = u - s * p.row_tiles;
    for (int j = 0; j < k.x; ++j) p.work[pos + j] = make_int4(s, tile, j, 0);
  }
}

}  // namespace

int launch_mla_schedule(const MLAParams& p, cudaStream_t stream) {
  if (p.num_seqs * p.row_tiles > kMlaScheduleTiles || p.num_seqs * p.row_tiles > p.sched_cap || p.sched_ctas < 1)
    return (int)cudaErrorInvalidValue;
  mla_schedule_kernel<<<1, kThreads, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
