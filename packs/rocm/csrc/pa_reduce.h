// Combines the partitions of one (sequence, head): out = sum_p w_p * acc_p / sum_p w_p * l_p with
// w_p = exp(max_p - max), acc_p the partition's unnormalised output and l_p its sum of probabilities. Partitions are read in chunks of 256 whatever their number, so the context
// length has no cap (vLLM's reduce stops at 8 x 64 partitions, 128K tokens at partition size 256).
#pragma once
#include "formats.h"

namespace pa {

struct ReduceLds {
  float w[256];     // weights of the current chunk of partitions
  float part[256];  // per work-item partial output
  float red_max[4];
  float red_sum[4];
};

HAL_DEV float block_max(float v, float* slots) {
  for (int m = 32; m >= 1; m >>= 1) v = hal_fmaxf(v, hal_shfl_xor(v, m));
  if (hal_lane() == 0) slots[hal_wave()] = v;
  hal_syncthreads();
  return hal_fmaxf(hal_fmaxf(slots[0], slots[1]), hal_fmaxf(slots[2], slots[3]));
}

HAL_DEV float block_sum(float v, float* slots) {
  for (int m = 32; m >= 1; m >>= 1) v += hal_shfl_xor(v, m);
  if (hal_lane() == 0) slots[hal_wave()] = v;
  hal_syncthreads();
  return (slots[0] + slots[1]) + (slots[2] + slots[3]);
}

#define HAL_PA_REDUCE_PARAMS                                                                            \
  void *__restrict__ out, const float *__restrict__ tmp_out, const float *__restrict__ exp_sums,        \
      const float *__restrict__ max_logits, const i32 *__restrict__ seq_lens,                           \
      const i32 *__restrict__ query_start_loc, i64 o_stride_seq,                                        \
      i64 o_stride_head, i32 num_heads, i32 head_size, i32 sliding_window, i32 partition_size,          \
      i32 max_parts
#define HAL_PA_REDUCE_ARGS                                                                              \
  out, tmp_out, exp_sums, max_logits, seq_lens, query_start_loc, o_stride_seq, o_stride_head, num_heads, head_size,      \
      sliding_window, partition_size, max_parts

// grid (num_heads, num_seqs); head_size divides 256.
template <class O> HAL_DEV void reduce(HAL_PA_REDUCE_PARAMS) {
  HAL_SHARED(ReduceLds, lds);
  const int head = (int)hal_bid_x(), seq = (int)hal_bid_y(), t = (int)hal_tid();
  int qrow = seq;  // as in pa_decode.h: with query_start_loc, only one-token sequences are ours
  if (query_start_loc) {
    qrow = hal_ld(query_start_loc + seq);
    if (hal_ld(query_start_loc + seq + 1) - qrow != 1) return;
  }
  const int L = hal_ld(seq_lens + seq);
  const int first = sliding_window > 0 && L > sliding_window ? L - sliding_window : 0;
  const int first_part = first / partition_size;
  const int nparts = L > 0 ? (L - 1) / partition_size - first_part + 1 : 0;
  if (nparts <= 1) return;  // the decode kernel wrote this row itself
  const i64 row0 = ((i64)seq * num_heads + head) * max_parts;

  float M = kNegInf;
  for (int p = t; p < nparts; p += 256) M = hal_fmaxf(M, hal_ld(max_logits + row0 + p));
  M = block_max(M, lds.red_max);

  const int D = head_size, G = 256 / head_size, d = t % D, g = t / D;
  float acc = 0.0f, lsum = 0.0f;
  for (int p0 = 0; p0 < nparts; p0 += 256) {
    const int pp = p0 + t;
    // partial p holds sum_j exp(s_j - max_p) v_j (times v_scale) and its sum l_p: rescale both to M
    const float w = pp < nparts ? hal_exp2((hal_ld(max_logits + row0 + pp) - M) * kLog2e) : 0.0f;
    lsum += pp < nparts ? hal_ld(exp_sums + row0 + pp) * w : 0.0f;
    lds.w[t] = w;
    hal_syncthreads();
    const int n = nparts - p0 < 256 ? nparts - p0 : 256;
    for (int i = g; i < n; i += G) acc += lds.w[i] * hal_ld(tmp_out + (row0 + p0 + i) * D + d);
    hal_syncthreads();
  }
  lsum = block_sum(lsum, lds.red_sum);
  lds.part[t] = acc;
  hal_syncthreads();
  if (t < D) {
    float x = 0.0f;
    for (int i = 0; i < G; ++i) x += lds.part[i * D + t];
    hal_st(static_cast<u16*>(out) + (i64)qrow * o_stride_seq + head * o_stride_head + t, O::from_f32(x / lsum));
  }
}

}  // namespace pa
