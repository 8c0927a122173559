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
// The cap B: 128 candidates (the longest row tile cut 1..64 times, then up to ~990 times
// geometrically, never under 4 blocks), each scored by an estimate of the greedy schedule's makespan
// over G CTAs at a time (G = sched_ctas, one an SM), with a fixed cost of c0 blocks a CTA
// (sched_overhead: the Q load, the partial's write and its merge):
//   items <= G (one wave):                  max size + c0
//   every partition of one size:            waves x (size + c0)
//   otherwise:                              max(max size + c0, (W + c0 items) / G + (max size + c0) / 2)
// with W the batch's blocks. Candidates that need more CTAs than sched_cap or more partial slots than
// sched_slots (the workspace the host sized) are out; cutting nothing (the first) always fits.
// On a uniform batch this picks the uniform split's partitions (one wave), so it costs only its launch
// and the reduce's.
#include <climits>

#include "launch.h"
#include "params.h"

namespace hal_cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32, kCands = 128, kBuckets = 1024, kBlock = 64;
constexpr int kMinBlocks = 4;  // partitions of at least 256 tokens, as the uniform split

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Candidate c's cuts of the longest row tile: 1..64, then 64 * 2^((c - 64) / 16).
__device__ __forceinline__ int cand_cuts(int c) { return c < 64 ? c + 1 : (int)(64.f * exp2f((c - 64) * 0.0625f)); }

// {partitions, blocks a partition} of a row tile of b blocks under a cap of B (the last partition may
// be shorter, none is empty); b == 0: one empty partition.
__device__ __forceinline__ int2 cut(int b, int B) {
  if (b <= B) return make_int2(1, b);
  const int size = cdiv(b, cdiv(b, B));
  return make_int2(cdiv(b, size), size);
}

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_min(int v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__global__ void __launch_bounds__(kThreads) mla_schedule_kernel(const MLAParams p) {
  __shared__ int s_blocks[kMlaScheduleTiles];  // a row tile's blocks, -1 where it has no rows
  __shared__ int s_bucket[kBuckets];           // partitions by size, longest first
  __shared__ float s_est[kCands];
  __shared__ int s_cap[kCands], s_items[kCands];
  __shared__ long long s_w[kWarps];
  __shared__ int s_max[kWarps], s_scan[kWarps], s_best, s_slots;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int U = p.num_seqs * p.row_tiles, G = p.sched_ctas;
  const float c0 = (float)p.sched_overhead;

  // ---- every row tile's blocks; the batch's sum W and the longest ----
  long long w = 0;
  int bmax = 0;
  for (int u = tid; u < U; u += kThreads) {
    const int s = u / p.row_tiles, tile = u - s * p.row_tiles;
    const int qlen = p.query_start_loc ? p.query_start_loc[s + 1] - p.query_start_loc[s] : 1;
    const int b = tile * p.tile_rows < qlen * p.num_heads ? cdiv(max(p.seq_lens[s], 0), kBlock) : -1;
    s_blocks[u] = b;
    if (b > 0) w += b, bmax = max(bmax, b);
  }
  w = warp_sum(w);
  bmax = warp_max(bmax);
  if (lane == 0) s_w[warp] = w, s_max[warp] = bmax;
  __syncthreads();
  w = 0, bmax = 0;
#pragma unroll 4
  for (int i = 0; i < kWarps; ++i) w += s_w[i], bmax = max(bmax, s_max[i]);

  // ---- the candidates' estimates: warp k scores candidates k, k + 32, ... ----
  for (int c = warp; c < kCands; c += kWarps) {
    const int B = max(kMinBlocks, cdiv(bmax, cand_cuts(c)));
    int items = 0, split = 0, mx = 0, mn = INT_MAX;
    for (int u = lane; u < U; u += 32) {
      const int b = s_blocks[u];
      if (b < 0) continue;
      const int2 k = cut(b, B);
      items += k.x;
      split += k.x > 1 ? k.x : 0;
      mx = max(mx, k.y), mn = min(mn, k.y);
    }
    items = warp_sum(items), split = warp_sum(split), mx = warp_max(mx), mn = warp_min(mn);
    if (lane == 0) {
      float est;
      if (items > p.sched_cap || split > p.sched_slots) est = INFINITY;
      else if (items <= G) est = mx + c0;
      else if (mx == mn) est = (float)cdiv(items, G) * (mx + c0);
      else est = fmaxf(mx + c0, ((float)w + c0 * items) / G + 0.5f * (mx + c0));
      s_est[c] = est, s_cap[c] = B, s_items[c] = items;
    }
  }
  for (int i = tid; i < kBuckets; i += kThreads) s_bucket[i] = 0;
  if (tid == 0) s_slots = 0;
  __syncthreads();
  if (warp == 0) {  // the least estimate; on a tie the fewest cuts (the lowest candidate)
    float e = INFINITY;
    int best = 0;
    for (int c = lane; c < kCands; c += 32)
      if (s_est[c] < e) e = s_est[c], best = c;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float e2 = __shfl_xor_sync(0xffffffffu, e, o);
      const int b2 = __shfl_xor_sync(0xffffffffu, best, o);
      if (e2 < e || (e2 == e && b2 < best)) e = e2, best = b2;
    }
    if (lane == 0) s_best = best;
  }
  __syncthreads();
  const int B = s_cap[s_best], items = s_items[s_best];

  // ---- the list, longest partitions first: a histogram by size, its exclusive scan, then each row
  // tile takes its place (within a size bucket in any order: a tile's partitions stay adjacent and in
  // order, so the merge, and the result, do not depend on it) ----
  auto bucket_of = [&](int size) { return kBuckets - 1 - (int)((long long)size * (kBuckets - 1) / B); };
  for (int u = tid; u < U; u += kThreads) {
    const int b = s_blocks[u];
    if (b >= 0) atomicAdd(&s_bucket[bucket_of(cut(b, B).y)], cut(b, B).x);
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
    int before = 0;
    for (int i = 0; i < warp; ++i) before += s_scan[i];
    s_bucket[tid] = before + x - v;
  }
  __syncthreads();
  for (int u = tid; u < U; u += kThreads) {
    const int b = s_blocks[u];
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
  for (int i = items + tid; i < p.sched_cap; i += kThreads) p.work[i] = make_int4(-1, 0, 0, 0);
}

}  // namespace

int launch_mla_schedule(const MLAParams& p, cudaStream_t stream) {
  if (p.num_seqs * p.row_tiles > kMlaScheduleTiles || p.num_seqs * p.row_tiles > p.sched_cap || p.sched_ctas < 1)
    return (int)cudaErrorInvalidValue;
  mla_schedule_kernel<<<1, kThreads, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
