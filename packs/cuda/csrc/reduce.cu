// The partition-merge kernel, one instantiation per head size.
#include "common.cuh"
#include "launch.h"
#include "params.h"

namespace hal_cuda {

// Merge partitions: out = v_scale * sum_p w_p O_p / sum_p w_p with w_p = l_p 2^(m_p - max m).
template <int D>
__global__ void __launch_bounds__(128) reduce_kernel(const DecodeParams p) {
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
  const int64_t base = ((int64_t)seq * p.num_heads + h) * p.num_parts;
  float M = -INFINITY;
  for (int q = pa; q < pb; ++q) M = fmaxf(M, p.part_ml[2 * (base + q)]);
  float wsum = 0.f;
  for (int q = pa; q < pb; ++q) {
    const float m = p.part_ml[2 * (base + q)];
    // m == -inf: the partition saw no finite logit, so its sum is NaN (keep it) or 0
    wsum += m == -INFINITY ? p.part_ml[2 * (base + q) + 1] * 0.f : p.part_ml[2 * (base + q) + 1] * fast_exp2(m - M);
  }
  const int kvh = h / p.gqa;
  const float vs = p.v_scale_ptr ? p.v_scale_ptr[kvh * p.v_scale_stride] : p.v_scale;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int q = pa; q < pb; ++q) {
      const float m = p.part_ml[2 * (base + q)];
      if (m == -INFINITY) continue;
      acc += p.part_ml[2 * (base + q) + 1] * fast_exp2(m - M) * p.part_out[(base + q) * D + d];
    }
    const float x = wsum == 0.f ? 0.f : acc / wsum * vs;  // 0 only for an empty sequence; NaN stays NaN
    const int64_t off = (int64_t)qrow * p.out_stride0 + (int64_t)h * p.out_stride1 + d;
    if (p.q_is_bf16) reinterpret_cast<__nv_bfloat16*>(p.out)[off] = __float2bfloat16_rn(x);
    else reinterpret_cast<__half*>(p.out)[off] = __float2half_rn(x);
  }
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
