// cache_mla's writer: one row of `width` elements per token into a paged cache whose tokens may be
// strided (a view into one [num_blocks, block_size, R + P] allocation): stored = encode(saturate(x /
// scale)) (hal/fp8.py), or the quotient rounded to nearest even for a 16-bit cache, with cache_kv's
// conversions (cache_kv.h). Launched once for the latent and once for the rotary part. One workgroup
// per token; a negative slot skips the token and so does a slot past the cache.
#pragma once
#include "cache_kv.h"

namespace kv {

#define HAL_CACHE_ROWS_PARAMS                                                                        \
  const void *__restrict__ src, void *__restrict__ cache, const i64 *__restrict__ slot_mapping,       \
      const float *__restrict__ scale_ptr, i64 src_stride, i64 block_stride, i64 token_stride,        \
      i64 num_slots, float scale_val, i32 width, i32 block_size
#define HAL_CACHE_ROWS_ARGS \
  src, cache, slot_mapping, scale_ptr, src_stride, block_stride, token_stride, num_slots, scale_val, width, block_size

// grid (num_tokens); width, the strides and the cache's address are multiples of 4 elements.
template <class IN, class CACHE> HAL_DEV void cache_rows(HAL_CACHE_ROWS_PARAMS) {
  const int tok = (int)hal_bid_x();
  const i64 slot = hal_ld(slot_mapping + tok);
  if (slot < 0 || slot >= num_slots) return;
  const i64 blk = slot / block_size;
  const i64 row = blk * block_stride + (slot - blk * block_size) * token_stride;
  const float s = scale_ptr ? hal_ld(scale_ptr) : scale_val;
  for (int g = (int)hal_tid(); g < width / 4; g += 256) {
    float x[4], q[4];
    Input<IN>::load4(static_cast<const char*>(src) + (tok * src_stride + 4 * g) * Input<IN>::kBytes, x);
    #pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = x[i] / s;  // IEEE division, as hal.fp8 defines the write
    Writer<CACHE>::store4(cache, row + 4 * g, q);
  }
}

}  // namespace kv
