// Every kernel of the rocm pack, instantiated for the arch being compiled. The names are the contract
// with the Python side (packs/rocm/kernels.py builds the same list and packs the same parameters):
//   hal_pa_decode_<query>_<cache>_d<head_size>   query f16|bf16; cache f16|bf16 (= query) or an FP8 encoding
//   hal_pa_reduce_<out>                          out f16|bf16
//   hal_cache_kv_<input>_<cache>                 input f16|bf16|f32
// FP8 encodings: gfx942 (MI300) converts e4m3fnuz / e5m2fnuz in hardware and is built for those only
// (an OCP e4m3fn cache there must be converted, never reinterpreted); other archs decode every
// encoding exactly in software.
#include "cache_kv.h"
#include "pa_decode.h"
#include "pa_reduce.h"

#define HAL_DECODE(QN, Q, CN, C, D)                                                            \
  HAL_KERNEL(hal_pa_decode_##QN##_##CN##_d##D)(HAL_PA_DECODE_PARAMS) {                         \
    pa::decode<Q, C, D>(HAL_PA_DECODE_ARGS);                                                   \
  }                                                                                            \
  HAL_REGISTER(hal_pa_decode_##QN##_##CN##_d##D)
#define HAL_DECODE_HEADS(QN, Q, CN, C) \
  HAL_DECODE(QN, Q, CN, C, 64) HAL_DECODE(QN, Q, CN, C, 128) HAL_DECODE(QN, Q, CN, C, 256)

#define HAL_CACHE_KV(IN_N, IN, CN, C)                                                          \
  HAL_KERNEL(hal_cache_kv_##IN_N##_##CN)(HAL_CACHE_KV_PARAMS) { kv::cache_kv<IN, C>(HAL_CACHE_KV_ARGS); } \
  HAL_REGISTER(hal_cache_kv_##IN_N##_##CN)
#define HAL_CACHE_KV_INPUTS(CN, C) \
  HAL_CACHE_KV(f16, F16, CN, C) HAL_CACHE_KV(bf16, BF16, CN, C) HAL_CACHE_KV(f32, F32, CN, C)

#define HAL_FP8_ENCODING(CN, ENC)                                                              \
  HAL_DECODE_HEADS(f16, F16, CN, CacheFp8<ENC>)                                                \
  HAL_DECODE_HEADS(bf16, BF16, CN, CacheFp8<ENC>)                                              \
  HAL_CACHE_KV_INPUTS(CN, CacheFp8<ENC>)

HAL_DECODE_HEADS(f16, F16, f16, Cache16<F16>)
HAL_DECODE_HEADS(bf16, BF16, bf16, Cache16<BF16>)
HAL_CACHE_KV_INPUTS(f16, Cache16<F16>)
HAL_CACHE_KV_INPUTS(bf16, Cache16<BF16>)
HAL_FP8_ENCODING(e4m3fnuz, E4m3fnuz)
HAL_FP8_ENCODING(e5m2fnuz, E5m2fnuz)
#if !HAL_FP8_FNUZ_HW
HAL_FP8_ENCODING(e4m3fn, E4m3fn)
HAL_FP8_ENCODING(e5m2, E5m2)
#endif

HAL_KERNEL(hal_pa_reduce_f16)(HAL_PA_REDUCE_PARAMS) { pa::reduce<F16>(HAL_PA_REDUCE_ARGS); }
HAL_REGISTER(hal_pa_reduce_f16)
HAL_KERNEL(hal_pa_reduce_bf16)(HAL_PA_REDUCE_PARAMS) { pa::reduce<BF16>(HAL_PA_REDUCE_ARGS); }
HAL_REGISTER(hal_pa_reduce_bf16)
