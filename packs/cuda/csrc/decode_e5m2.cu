// Decode kernels for e5m2 caches (one translation unit per cache kind keeps builds parallel).
#include "decode.cuh"
#include "launch.h"

namespace hal_cuda {

int launch_decode_e5m2(int head_size, const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_seqs, p.num_kv_heads * p.head_tiles, p.num_parts);
  const bool two = p.gqa > 8;  // a second 8-head MMA tile shares the K/V fragments
  switch (head_size) {
#define HAL_CASE(D)                                                                        \
    case D:                                                                                \
      if (two) decode_kernel<Kind::E5M2, D, 2><<<grid, kThreads, 0, stream>>>(p);        \
      else decode_kernel<Kind::E5M2, D, 1><<<grid, kThreads, 0, stream>>>(p);            \
      break;
    HAL_CUDA_HEAD_SIZES(HAL_CASE)
#undef HAL_CASE
    default: return (int)cudaErrorInvalidValue;
  }
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
