// The rocm pack's multi-token attention code object (hal_rocm_prefill.hsaco), instantiated for the arch
// being compiled. A code object of its own because its kernels are designed for 2 waves per SIMD (an O
// tile of D/4 VGPRs a lane and an 8 KiB K + V tile resident), not the 4 of hal_rocm.hsaco's decode
// kernels (docs/rocm.md, "Prefill"). Names, the contract with packs/rocm/kernels.py:
//   hal_pa_prefill_<query>_<cache>_d<head_size>   query f16|bf16; cache f16|bf16 (= query) or an FP8
//                                                 encoding; head size 64, 128, 256
// FP8 encodings as in kernels.hip: gfx942 builds its fnuz ones (hardware conversion), other archs all
// four (exact software conversion). A mixed batch's one-token sequences run through hal_rocm.hsaco's
// decode kernels in the same call.
#include "pa_prefill.h"

#define HAL_PREFILL(QN, Q, CN, C, D)                                                           \
  HAL_KERNEL_WAVES(hal_pa_prefill_##QN##_##CN##_d##D, 2)(HAL_PA_PREFILL_PARAMS) {              \
    pa::prefill<Q, C, D>(HAL_PA_PREFILL_ARGS);                                                 \
  }                                                                                            \
  HAL_REGISTER(hal_pa_prefill_##QN##_##CN##_d##D)
#define HAL_PREFILL_HEADS(QN, Q, CN, C) \
  HAL_PREFILL(QN, Q, CN, C, 64) HAL_PREFILL(QN, Q, CN, C, 128) HAL_PREFILL(QN, Q, CN, C, 256)
#define HAL_PREFILL_FP8(CN, ENC) \
  HAL_PREFILL_HEADS(f16, F16, CN, CacheFp8<ENC>) HAL_PREFILL_HEADS(bf16, BF16, CN, CacheFp8<ENC>)

HAL_PREFILL_HEADS(f16, F16, f16, Cache16<F16>)
HAL_PREFILL_HEADS(bf16, BF16, bf16, Cache16<BF16>)
HAL_PREFILL_FP8(e4m3fnuz, E4m3fnuz)
HAL_PREFILL_FP8(e5m2fnuz, E5m2fnuz)
#if !HAL_FP8_FNUZ_HW
HAL_PREFILL_FP8(e4m3fn, E4m3fn)
HAL_PREFILL_FP8(e5m2, E5m2)
#endif
