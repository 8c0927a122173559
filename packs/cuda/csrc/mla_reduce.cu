// The partition merge of MLA decode as a second launch: one CTA per (query row, head). Every
// partition wrote its (m, l); an empty one wrote m = -inf and is skipped without reading its O.
// mla.cuh merges in the kernel instead when the launch brings a counter per row tile.
#include "common.cuh"
#include "launch.h"
#include "merge.cuh"
#include "params.h"

namespace hal_cuda {

__global__ void __launch_bounds__(128) mla_reduce_kernel(const MLAParams p) {
  __shared__ float scratch[2];
  const int row = blockIdx.x, h = blockIdx.y;
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  const MergeOut dst{p.out, (int64_t)row * p.out_stride0, p.out_stride0, p.out_stride1, h, p.num_heads, p.q_is_bf16 != 0};
  merge_partitions<512>(p.part_out, p.part_ml, ((int64_t)row * p.num_heads + h) * p.num_parts, p.num_parts, 1, 0,
                        p.num_parts, cs, dst, scratch);
}

int launch_mla_reduce(const MLAParams& p, cudaStream_t stream) {
  if (p.total_q == 0) return 0;
  mla_reduce_kernel<<<dim3(p.total_q, p.num_heads), 128, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
