// The partition merge of MLA decode as a second launch. The uniform split: one CTA per (query row,
// head); every partition wrote its (m, l), an empty one m = -inf, skipped without reading its O. The
// work list (mla_schedule.cu): one CTA per (row tile, kWorkRows of its rows); unsplit tiles were
// written by the kernel and are skipped. mla.cuh merges in the kernel instead when the launch brings
// a counter per row tile.
#include "common.cuh"
#include "launch.h"
#include "merge.cuh"
#include "params.h"

namespace hal_cuda {

// Rows a CTA merges from the work list (params.merge_rows, 1 to kWorkRows): the grid is fixed when a
// graph is captured, so it covers every row tile whether or not the schedule splits it. A row a CTA
// merges fastest (one long merge a CTA: one 64K sequence cut in 128 at 16 heads, H100, 2026-12-06, 4 rows
// a CTA took 2x the uniform split's reduce), but over many row tiles the empty CTAs cost (128 heads,
// 64 sequences, nothing split: 8192 of them, 6.6 us); bindings.cpp takes 4 rows a CTA from 2048 rows.
constexpr int kWorkRows = 4;

__global__ void __launch_bounds__(128) mla_reduce_kernel(const MLAParams p) {
  __shared__ float scratch[2 * kWorkRows];
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  if (p.work) {
    const int u = blockIdx.x, seq = u / p.row_tiles, tile = u - seq * p.row_tiles;
    const int4 tp = p.tile_parts[u];  // {first slot, partitions, size, 0}
    if (tp.y <= 1) return;            // unsplit (written by the kernel) or without rows
    int q0 = seq, qlen = 1;
    if (p.query_start_loc) q0 = p.query_start_loc[seq], qlen = p.query_start_loc[seq + 1] - q0;
    const int r1 = (int)blockIdx.y * p.merge_rows;  // (signed: the row counts below may go negative)
    const int r = tile * p.tile_rows + r1;           // this CTA's first row of the sequence
    const int rows = min(p.merge_rows, min(p.tile_rows - r1, qlen * p.num_heads - r));
    if (rows <= 0) return;
    const MergeOut dst{p.out, (int64_t)q0 * p.out_stride0, p.out_stride0, p.out_stride1, r, p.num_heads,
                       p.q_is_bf16 != 0};
    merge_partitions<512>(p.part_out, p.part_ml, (int64_t)tp.x * p.tile_rows + r1, 1,
                          p.tile_rows, rows, 0, tp.y, cs, dst, scratch);
    return;
  }
  const int row = blockIdx.x, h = blockIdx.y;
  const MergeOut dst{p.out, (int64_t)row * p.out_stride0, p.out_stride0, p.out_stride1, h, p.num_heads, p.q_is_bf16 != 0};
  merge_partitions<512>(p.part_out, p.part_ml, ((int64_t)row * p.num_heads + h) * p.num_parts, p.num_parts, 1, 1, 0,
                        p.num_parts, cs, dst, scratch);
}

int launch_mla_reduce(const MLAParams& p, cudaStream_t stream) {
  if (p.total_q == 0) return 0;
  if (p.work && (p.merge_rows < 1 || p.merge_rows > kWorkRows)) return (int)cudaErrorInvalidValue;
  const dim3 grid = p.work ? dim3(p.num_seqs * p.row_tiles, (p.tile_rows + p.merge_rows - 1) / p.merge_rows)
                           : dim3(p.total_q, p.num_heads);
  mla_reduce_kernel<<<grid, 128, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
