// The partition-merge kernel, one instantiation per head size.
#include "common.cuh"
#include "launch.h"
#include "merge.cuh"
#include "params.h"

namespace hal_cuda {

// The merge as a second launch: one CTA per (sequence, query head); decode.cuh merges in the kernel
// instead when the launch brings a counter per row.
template <int D>
__global__ void __launch_bounds__(128) reduce_kernel(const DecodeParams p) {
  __shared__ float scratch[2];
  const int seq = blockIdx.x, h = blockIdx.y;
  int qrow = seq;
  if (p.query_start_loc) {  // a multi-token call: one-row sequences only (decode.cuh)
    qrow = p.query_start_loc[seq];
    if (p.query_start_loc[seq + 1] - qrow != 1) return;
  }
  const int L = p.seq_lens[seq];
  const int first = p.window > 0 ? max(0, L - p.window) : 0;
  const int pa = first / p.partition_size;
  const int pb = (L + p.partition_size - 1) / p.partition_size;
  const int kvh = h / p.gqa;
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
  const MergeOut dst{p.out, (int64_t)qrow * p.out_stride0, p.out_stride0, p.out_stride1, h, p.num_heads, p.q_is_bf16 != 0};
  merge_partitions<D>(p.part_out, p.part_ml, ((int64_t)seq * p.num_heads + h) * p.num_parts, p.num_parts, 1, 1, pa, pb,
                      vs, dst, scratch);
}

int launch_reduce(int head_size, const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_seqs, p.num_heads);
  switch (head_size) {
#define HAL_CASE(D) \
    case D: reduce_kernel<D><<<grid, 128, 0, stream>>>(p); break;
    HAL_CUDA_HEAD_SIZES(HAL_CASE)
#undef HAL_CASE
    default: return (int)cudaErrorInvalidValue;
  }
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
