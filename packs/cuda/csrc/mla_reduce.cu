// The partition merge of MLA decode as a second launch. The uniform split: one CTA per (query row,
// head); every partition wrote its (m, l), an empty one m = -inf, skipped without reading its O. The
// work list (mla_schedule.cu): one CTA per (sequence, row of its tiles); rows of unsplit tiles were
// written by the kernel and are skipped. mla.cuh merges in the kernel instead when the launch brings
// a counter per row tile.
#include "common.cuh"
#include "launch.h"
#include "merge.cuh"
#include "params.h"

namespace hal_cuda {

__global__ void __launch_bounds__(128) mla_reduce_kernel(const MLAParams p) {
  __shared__ float scratch[2];
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  if (p.work) {
    const int seq = blockIdx.x, r = blockIdx.y;
    int q0 = seq, qlen = 1;
    if (p.query_start_loc) q0 = p.query_start_loc[seq], qlen = p.query_start_loc[seq + 1] - q0;
    if (r >= qlen * p.num_heads) return;
    const int tile = r / p.tile_rows;
    const int4 tp = p.tile_parts[(int64_t)seq * p.row_tiles + tile];  // {first slot, partitions, size, 0}
    if (tp.y <= 1) return;
    const MergeOut dst{p.out, (int64_t)q0 * p.out_stride0, p.out_stride0, p.out_stride1, r, p.num_heads,
                       p.q_is_bf16 != 0};
    merge_partitions<512>(p.part_out, p.part_ml, (int64_t)tp.x * p.tile_rows + (r - tile * p.tile_rows), 1,
                          p.tile_rows, 1, 0, tp.y, cs, dst, scratch);
    return;
  }
  const int row = blockIdx.x, h = blockIdx.y;
  const MergeOut dst{p.out, (int64_t)row * p.out_stride0, p.out_stride0, p.out_stride1, h, p.num_heads, p.q_is_bf16 != 0};
  merge_partitions<512>(p.part_out, p.part_ml, ((int64_t)row * p.num_heads + h) * p.num_parts, p.num_parts, 1, 1, 0,
                        p.num_parts, cs, dst, scratch);
}

int launch_mla_reduce(const MLAParams& p, cudaStream_t stream) {
  if (p.total_q == 0) return 0;
  const dim3 grid = p.work ? dim3(p.num_seqs, p.row_tiles * p.tile_rows) : dim3(p.total_q, p.num_heads);
  mla_reduce_kernel<<<grid, 128, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
