// Writes new tokens into the paged caches: stored = encode(saturate(x / scale)) (hal/fp8.py), or the
// quotient rounded to nearest even for a float16 / bfloat16 cache. One workgroup per token; a negative
// slot skips the token and so does a slot past the cache (never a write out of bounds).
#pragma once
#include "formats.h"

namespace kv {

// Four consecutive input elements as floats; the primary template serves the 16-bit inputs (F16,
// BF16: each has to_f32 from its raw bits).
template <class IN> struct Input {
  static HAL_DEV void load4(const void* p, float* f) {
    const u32x2 w = hal_ld(static_cast<const u32x2*>(p));
    #pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = IN::to_f32((u16)(w[i / 2] >> (16 * (i % 2))));
  }
  static constexpr int kBytes = 2;
};
template <> struct Input<F32> {
  static HAL_DEV void load4(const void* p, float* f) {
    const u32x4 w = hal_ld(static_cast<const u32x4*>(p));
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      // through a scalar: clang 19 reads element 0 for __builtin_bit_cast(float, w[i]) of a vector
      // element (the CPU emulation caught it; the device build does the same)
      const u32 u = w[i];
      f[i] = __builtin_bit_cast(float, u);
    }
  }
  static constexpr int kBytes = 4;
};

template <class CACHE> struct Writer;
template <class ENC> struct Writer<CacheFp8<ENC>> {
  static HAL_DEV void store4(void* cache, i64 elem, const float* q) {
    hal_st(reinterpret_cast<u32*>(static_cast<u8*>(cache) + elem), fp8x4_encode<ENC>(q));
  }
};
template <class T16> struct Writer<Cache16<T16>> {
  static HAL_DEV void store4(void* cache, i64 elem, const float* q) {
    u32x2 w = {(u32)T16::from_f32(q[0]) | ((u32)T16::from_f32(q[1]) << 16),
               (u32)T16::from_f32(q[2]) | ((u32)T16::from_f32(q[3]) << 16)};
    hal_st(reinterpret_cast<u32x2*>(static_cast<u16*>(cache) + elem), w);
  }
};

#define HAL_CACHE_KV_PARAMS                                                                                 \
  const void *__restrict__ key, const void *__restrict__ value, void *__restrict__ key_cache,               \
      void *__restrict__ value_cache, const i64 *__restrict__ slot_mapping,                                 \
      const float *__restrict__ k_scale_ptr, const float *__restrict__ v_scale_ptr, i64 k_stride_tok,       \
      i64 k_stride_head, i64 v_stride_tok, i64 v_stride_head, i64 k_block_stride, i64 k_head_stride,        \
      i64 k_token_stride, i64 v_block_stride, i64 v_head_stride, i64 v_token_stride,                        \
      i64 num_slots,                                                                                         \
      float k_scale_val, float v_scale_val, i32 num_kv_heads, i32 head_size, i32 block_size,                \
      i32 k_scale_stride, i32 v_scale_stride
#define HAL_CACHE_KV_ARGS                                                                                   \
  key, value, key_cache, value_cache, slot_mapping, k_scale_ptr, v_scale_ptr, k_stride_tok, k_stride_head,  \
      v_stride_tok, v_stride_head, k_block_stride, k_head_stride, k_token_stride, v_block_stride,            \
      v_head_stride, v_token_stride, num_slots, k_scale_val, v_scale_val, num_kv_heads,                       \
      head_size, block_size, k_scale_stride, v_scale_stride

// grid (num_tokens); head_size is a multiple of 4.
template <class IN, class CACHE> HAL_DEV void cache_kv(HAL_CACHE_KV_PARAMS) {
  const int tok = (int)hal_bid_x();
  const i64 slot = hal_ld(slot_mapping + tok);
  if (slot < 0 || slot >= num_slots) return;
  const i64 blk = slot / block_size;
  const int off = (int)(slot - blk * block_size);
  const int groups = num_kv_heads * head_size / 4;
  for (int gi = (int)hal_tid(); gi < groups; gi += 256) {
    const int h = 4 * gi / head_size, d = 4 * gi % head_size;
    // cache rows through their strides (an NHD cache's HND view too); the head dimension is contiguous
    const i64 k_at = blk * k_block_stride + (i64)h * k_head_stride + (i64)off * k_token_stride + d;
    const i64 v_at = blk * v_block_stride + (i64)h * v_head_stride + (i64)off * v_token_stride + d;
    float x[4], q[4];
    Input<IN>::load4(static_cast<const char*>(key) + (tok * k_stride_tok + h * k_stride_head + d) * Input<IN>::kBytes, x);
    const float ks = k_scale_ptr ? hal_ld(k_scale_ptr + h * k_scale_stride) : k_scale_val;
    #pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = x[i] / ks;  // IEEE division, as hal.fp8 defines the write
    Writer<CACHE>::store4(key_cache, k_at, q);
    Input<IN>::load4(static_cast<const char*>(value) + (tok * v_stride_tok + h * v_stride_head + d) * Input<IN>::kBytes, x);
    const float vs = v_scale_ptr ? hal_ld(v_scale_ptr + h * v_scale_stride) : v_scale_val;
    #pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = x[i] / vs;
    Writer<CACHE>::store4(value_cache, v_at, q);
  }
}

}  // namespace kv
