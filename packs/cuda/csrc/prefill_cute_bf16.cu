// The CuTe multi-token kernel (prefill_cute.cuh) for bf16 caches, sm_90a.
#define HAL_KIND BF16
#define HAL_NAME bf16
#include "prefill_cute_launch.inc"
