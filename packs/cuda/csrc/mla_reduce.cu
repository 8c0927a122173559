// The partition merge of MLA decode: out = ckv_scale * sum_p w_p O_p / sum_p w_p with
// w_p = l_p 2^(m_p - max m), one CTA per (query row, head). Every partition wrote its (m, l); an
// empty one wrote m = -inf and is skipped without reading its O.
#include "common.cuh"
#include "launch.h"
#include "params.h"

namespace hal_cuda {

__global__ void __launch_bounds__(128) mla_reduce_kernel(const MLAParams p) {
  constexpr int kR = 512;
  const int row = blockIdx.x, h = blockIdx.y;
  const int64_t base = ((int64_t)row * p.num_heads + h) * p.num_parts;
  const float* ml = p.part_ml + 2 * base;
  float M = -INFINITY;
  for (int q = 0; q < p.num_parts; ++q) M = fmaxf(M, ml[2 * q]);
  float wsum = 0.f;
  for (int q = 0; q < p.num_parts; ++q)  // m == -inf: no finite logit; its sum is 0, or NaN (kept)
    wsum += ml[2 * q] == -INFINITY ? ml[2 * q + 1] * 0.f : ml[2 * q + 1] * fast_exp2(ml[2 * q] - M);
  const float cs = p.ckv_scale_ptr ? *p.ckv_scale_ptr : p.ckv_scale;
  const int d = threadIdx.x * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int q = 0; q < p.num_parts; ++q) {
    if (ml[2 * q] == -INFINITY) continue;
    const float w = ml[2 * q + 1] * fast_exp2(ml[2 * q] - M);
    const float4 v = *reinterpret_cast<const float4*>(p.part_out + (base + q) * kR + d);
    acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
  }
  const float f = wsum == 0.f ? 0.f : cs / wsum;  // 0 only for an empty row; NaN stays NaN
  char* out = static_cast<char*>(p.out) + ((int64_t)row * p.out_stride0 + (int64_t)h * p.out_stride1 + d) * 2;
  const float x[4] = {acc.x * f, acc.y * f, acc.z * f, acc.w * f};
  const uint2 v = p.q_is_bf16 ? make_uint2(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]))
                              : make_uint2(pack_f16x2(x[0], x[1]), pack_f16x2(x[2], x[3]));
  *reinterpret_cast<uint2*>(out) = v;
}

int launch_mla_reduce(const MLAParams& p, cudaStream_t stream) {
  if (p.total_q == 0) return 0;
  mla_reduce_kernel<<<dim3(p.total_q, p.num_heads), 128, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace hal_cuda
