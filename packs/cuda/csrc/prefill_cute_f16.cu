// The CuTe multi-token kernel (prefill_cute.cuh) for f16 caches, sm_90a.
#define HAL_KIND F16
#define HAL_NAME f16
#include "prefill_cute_launch.inc"
