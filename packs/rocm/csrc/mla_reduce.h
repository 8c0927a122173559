// The partition merge of MLA decode, one workgroup per (head, query row): out = ckv_scale *
// sum_p w_p acc_p / sum_p w_p l_p with w_p = 2^(m_p - max m) (m in log2 units). A partition in which
// the row had no key wrote m = -inf and no partial: its weight is 0 and its partial is never read.
// No key anywhere (an empty sequence) gives zeros; a NaN anywhere stays NaN. Partitions are weighed
// 256 at a time, so their number has no cap.
#pragma once
#include "formats.h"
#include "pa_reduce.h"

namespace mla {

struct ReduceLds {
  float w[256];  // weights of the current chunk of partitions
  float red_max[4];
  float red_sum[4];
};

#define HAL_MLA_REDUCE_PARAMS                                                                         \
  void *__restrict__ out, const float *__restrict__ tmp_out, const float *__restrict__ part_ml,     \
      const float *__restrict__ ckv_scale_ptr, i64 o_stride_tok, i64 o_stride_head, float ckv_scale_val, \
      i32 num_heads, i32 num_parts
#define HAL_MLA_REDUCE_ARGS \
  out, tmp_out, part_ml, ckv_scale_ptr, o_stride_tok, o_stride_head, ckv_scale_val, num_heads, num_parts

// grid (num_heads, total_q); each work-item owns 2 of the 512 columns.
template <class O> HAL_DEV void mla_reduce(HAL_MLA_REDUCE_PARAMS) {
  HAL_SHARED(ReduceLds, lds);
  const int head = (int)hal_bid_x(), row = (int)hal_bid_y(), t = (int)hal_tid();
  const i64 base = ((i64)row * num_heads + head) * num_parts;
  const f32x2* ml = reinterpret_cast<const f32x2*>(part_ml) + base;

  float M = kNegInf;
  for (int p = t; p < num_parts; p += 256) M = hal_fmaxf(M, hal_ld(ml + p)[0]);
  M = pa::block_max(M, lds.red_max);

  float a0 = 0.0f, a1 = 0.0f, lsum = 0.0f;
  for (int p0 = 0; p0 < num_parts; p0 += 256) {
    const int pp = p0 + t;
    float w = 0.0f;
    if (pp < num_parts) {
      const f32x2 v = hal_ld(ml + pp);
      const float m = v[0], l = v[1];
      w = m == kNegInf ? 0.0f : hal_exp2(m - M);
      lsum += w * l;
    }
    lds.w[t] = w;
    hal_syncthreads();
    const int n = num_parts - p0 < 256 ? num_parts - p0 : 256;
    for (int i = 0; i < n; ++i) {
      const float wi = lds.w[i];
      if (wi != 0.0f) {  // weight 0: no key there, and no partial was written (NaN weights are read)
        const f32x2 x = hal_ld(reinterpret_cast<const f32x2*>(tmp_out + (base + p0 + i) * kR) + t);
        a0 += wi * x[0];
        a1 += wi * x[1];
      }
    }
    hal_syncthreads();  // before the next chunk overwrites w
  }
  lsum = pa::block_sum(lsum, lds.red_sum);
  const float cs = ckv_scale_ptr ? hal_ld(ckv_scale_ptr) : ckv_scale_val;
  const float f = lsum == 0.0f ? 0.0f : cs / lsum;
  const u32 w = (u32)O::from_f32(a0 * f) | ((u32)O::from_f32(a1 * f) << 16);
  hal_st(reinterpret_cast<u32*>(static_cast<u16*>(out) + row * o_stride_tok + head * o_stride_head) + t, w);
}

}  // namespace mla
