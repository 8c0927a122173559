// The rocm pack's MLA code object (hal_rocm_mla.hsaco), instantiated for the arch being compiled. It is
// a code object of its own because its decode kernels are designed for 2 waves per SIMD (an O tile
// and a K/V tile resident), not the 4 of hal_rocm.hsaco's (docs/rocm.md, "MLA decode"). Names, the
// contract with packs/rocm/kernels.py (which builds the same list and packs the same parameters):
//   hal_mla_decode_<query>_<latent>_r<rows>   query f16|bf16; latent f16|bf16 (= query) or an FP8
//                                             encoding; rows 16 or 32 per workgroup
//   hal_mla_reduce_<out>                      out f16|bf16
//   hal_cache_rows_<input>_<cache>            input f16|bf16|f32 (cache_mla: latent and rope rows)
// FP8 encodings as in kernels.hip: gfx942 builds its fnuz ones (hardware conversion), other archs all
// four (exact software conversion).
#include "cache_rows.h"
#include "mla_decode.h"
#include "mla_reduce.h"

#define HAL_MLA_DECODE(QN, Q, CN, C, G, ROWS)                                                  \
  HAL_KERNEL_WAVES(hal_mla_decode_##QN##_##CN##_r##ROWS, 2)(HAL_MLA_DECODE_PARAMS) {           \
    mla::mla_decode<Q, C, G>(HAL_MLA_DECODE_ARGS);                                             \
  }                                                                                            \
  HAL_REGISTER(hal_mla_decode_##QN##_##CN##_r##ROWS)
#define HAL_MLA_DECODE_TILES(QN, Q, CN, C) HAL_MLA_DECODE(QN, Q, CN, C, 1, 16) HAL_MLA_DECODE(QN, Q, CN, C, 2, 32)

#define HAL_CACHE_ROWS(IN_N, IN, CN, C)                                                        \
  HAL_KERNEL(hal_cache_rows_##IN_N##_##CN)(HAL_CACHE_ROWS_PARAMS) { kv::cache_rows<IN, C>(HAL_CACHE_ROWS_ARGS); } \
  HAL_REGISTER(hal_cache_rows_##IN_N##_##CN)
#define HAL_CACHE_ROWS_INPUTS(CN, C) \
  HAL_CACHE_ROWS(f16, F16, CN, C) HAL_CACHE_ROWS(bf16, BF16, CN, C) HAL_CACHE_ROWS(f32, F32, CN, C)

#define HAL_MLA_FP8_ENCODING(CN, ENC)                                                          \
  HAL_MLA_DECODE_TILES(f16, F16, CN, CacheFp8<ENC>)                                            \
  HAL_MLA_DECODE_TILES(bf16, BF16, CN, CacheFp8<ENC>)                                          \
  HAL_CACHE_ROWS_INPUTS(CN, CacheFp8<ENC>)

HAL_MLA_DECODE_TILES(f16, F16, f16, Cache16<F16>)
HAL_MLA_DECODE_TILES(bf16, BF16, bf16, Cache16<BF16>)
HAL_CACHE_ROWS_INPUTS(f16, Cache16<F16>)
HAL_CACHE_ROWS_INPUTS(bf16, Cache16<BF16>)
HAL_MLA_FP8_ENCODING(e4m3fnuz, E4m3fnuz)
HAL_MLA_FP8_ENCODING(e5m2fnuz, E5m2fnuz)
#if !HAL_FP8_FNUZ_HW
HAL_MLA_FP8_ENCODING(e4m3fn, E4m3fn)
HAL_MLA_FP8_ENCODING(e5m2, E5m2)
#endif

HAL_KERNEL(hal_mla_reduce_f16)(HAL_MLA_REDUCE_PARAMS) { mla::mla_reduce<F16>(HAL_MLA_REDUCE_ARGS); }
HAL_REGISTER(hal_mla_reduce_f16)
HAL_KERNEL(hal_mla_reduce_bf16)(HAL_MLA_REDUCE_PARAMS) { mla::mla_reduce<BF16>(HAL_MLA_REDUCE_ARGS); }
HAL_REGISTER(hal_mla_reduce_bf16)
