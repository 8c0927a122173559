// The partition-merge kernel, one instantiation per head size.
#include "decode.cuh"
#include "launch.h"

namespace hal_cuda {

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
