// The partition-merge kernel, one instantiation per head size.
#include "common.cuh"
#include "launch.h"
#include "params.h"

namespace hal_cuda {

// Merge partitions: out = v_scale * sum_p w_p O_p / sum_p w_p with w_p = l_p 2^(m_p - max m), in one
// pass (a running max, rescaling what was summed), so that every partition's loads are independent
// of the arithmetic and go out together.
//
// On sm_90+ it is launched as a programmatic dependent of the decode kernel: its CTAs are placed as
// decode CTAs finish and wait here (griddepcontrol.wait) until the decode grid has completed and its
// writes are visible, instead of waiting for a launch after the decode kernel ends.
template <int D>
__global__ void __launch_bounds__(128) reduce_kernel(const DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int seq = blockIdx.x, h = blockIdx.y;
  const int L = p.seq_lens[seq];
  const int first = p.window > 0 ? max(0, L - p.window) : 0;
  const int pa = first / p.partition_size;
  const int pb = (L + p.partition_size - 1) / p.partition_size;
  const int64_t base = ((int64_t)seq * p.num_heads + h) * p.num_parts;
  const int kvh = h / p.gqa;
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float M = -INFINITY, wsum = 0.f, acc = 0.f;
#pragma unroll 4
    for (int q = pa; q < pb; ++q) {
      const float m = p.part_ml[2 * (base + q)];
      const float l = p.part_ml[2 * (base + q) + 1];
      const float o = p.part_out[(base + q) * D + d];
      if (m == -INFINITY) continue;
      const float mn = fmaxf(M, m);
      const float a = M == -INFINITY ? 0.f : fast_exp2(M - mn), w = l * fast_exp2(m - mn);
      wsum = wsum * a + w;
      acc = acc * a + w * o;
      M = mn;
    }
    const float x = wsum > 0.f ? acc / wsum * vs : 0.f;
    const int64_t off = (int64_t)seq * p.out_stride0 + (int64_t)h * p.out_stride1 + d;
    if (p.q_is_bf16) reinterpret_cast<__nv_bfloat16*>(p.out)[off] = __float2bfloat16_rn(x);
    else reinterpret_cast<__half*>(p.out)[off] = __float2half_rn(x);
  }
}

int launch_reduce(int head_size, const DecodeParams& p, cudaStream_t stream, bool dependent) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_seqs, p.num_heads);
  cfg.blockDim = dim3(128);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  cudaError_t err;
  switch (head_size) {
#define HAL_CASE(D) \
    case D: err = cudaLaunchKernelEx(&cfg, reduce_kernel<D>, p); break;
    HAL_CUDA_HEAD_SIZES(HAL_CASE)
#undef HAL_CASE
    default: return (int)cudaErrorInvalidValue;
  }
  return err != cudaSuccess ? (int)err : (int)cudaGetLastError();
}

}  // namespace hal_cuda
