// Merging the partitions of a split context by log-sum-exp, for decode and MLA decode: the reduce
// kernels (reduce.cu, mla_reduce.cu: a second launch) and the last CTA of a row to finish
// (decode.cuh, mla.cuh: in the kernel).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace hal_cuda {

// Where merged rows go: row r of a merge is (query row, head) pair first + r of a sequence whose
// query rows each hold `heads` heads (heads fastest), its first query row at element `base` of out.
struct MergeOut {
  void* out;
  int64_t base, row_stride, head_stride;  // elements
  int first, heads;
  bool bf16;
  __device__ int64_t offset(int r) const {
    const int x = first + r;
    return base + (int64_t)(x / heads) * row_stride + (int64_t)(x % heads) * head_stride;
  }
};

// Partitions [pa, pb) of `rows` rows whose partial results sit in part_out [slots, D] / part_ml [slots, 2]
// (max in log2 units, sum): partition q of row r at slot `slot0 + r * row_stride + q * part_stride` (a
// uniform split: rows num_parts slots apart, partitions adjacent; the MLA work list: partitions a row
// tile apart, rows adjacent). out = vs * sum_q w_q O_q / sum_q w_q with w_q = l_q 2^(m_q - max m).
// Called by every thread of the CTA (it synchronises). Partials are read through L2 (ld.cg): other
// CTAs wrote them, and L1 is not coherent. `scratch` holds 2 * rows floats of shared memory.
template <int D>
__device__ void merge_partitions(const float* part_out, const float* part_ml, int64_t slot0, int64_t row_stride,
                                 int64_t part_stride, int rows, int pa, int pb, float vs, const MergeOut& dst,
                                 float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  float* sM = scratch;
  float* sW = scratch + rows;
  for (int r = warp; r < rows; r += warps) {
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + slot0 + r * row_stride;
    float M = -INFINITY;
    for (int q = pa + lane; q < pb; q += 32) M = fmaxf(M, __ldcg(&ml[q * part_stride].x));
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float w = 0.f;
    // m == -inf: the partition saw no finite logit, so its sum is NaN (keep it) or 0
    for (int q = pa + lane; q < pb; q += 32) {
      const float2 x = __ldcg(&ml[q * part_stride]);
      w += x.x == -INFINITY ? x.y * 0.f : x.y * fast_exp2(x.x - M);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
    if (lane == 0) { sM[r] = M; sW[r] = w; }
  }
  __syncthreads();
  constexpr int kV = D / 4;  // float4 columns of a head
  for (int idx = threadIdx.x; idx < rows * kV; idx += blockDim.x) {
    const int r = idx / kV, c = idx % kV;
    const int64_t slot = slot0 + r * row_stride;
    const float M = sM[r], wsum = sW[r];
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int q = pa; q < pb; ++q) {
      const int64_t sq = slot + q * part_stride;
      const float2 x = __ldcg(reinterpret_cast<const float2*>(part_ml) + sq);
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part_out + sq * D) + c);
      if (x.x == -INFINITY) continue;
      const float f = x.y * fast_exp2(x.x - M);
      acc.x += f * v.x; acc.y += f * v.y; acc.z += f * v.z; acc.w += f * v.w;
    }
    // 0 only for an empty sequence; NaN stays NaN
    const float s = wsum == 0.f ? 0.f : vs / wsum;
    const float y[4] = {acc.x * s, acc.y * s, acc.z * s, acc.w * s};
    const int64_t off = dst.offset(r) + 4 * c;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (dst.bf16) reinterpret_cast<__nv_bfloat16*>(dst.out)[off + i] = __float2bfloat16_rn(wsum == 0.f ? 0.f : y[i]);
      else reinterpret_cast<__half*>(dst.out)[off + i] = __float2half_rn(wsum == 0.f ? 0.f : y[i]);
    }
  }
}

// The in-kernel merge's handshake, after a CTA wrote its partials: every thread fences its writes,
// one thread takes a ticket on the row's counter, and the CTA that takes the last of `arrivals`
// tickets returns true (and resets the counter for the next launch: every arrival has happened).
__device__ __forceinline__ bool last_to_arrive(int* counter, int arrivals) {
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(counter, 1);
    s_last = ticket == arrivals - 1;
    if (s_last) {
      *counter = 0;
      __threadfence();
    }
  }
  __syncthreads();
  return s_last;
}

}  // namespace hal_cuda
