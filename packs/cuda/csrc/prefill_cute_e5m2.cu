// The CuTe multi-token kernel (prefill_cute.cuh) for e5m2 caches, sm_90a.
#define HAL_KIND E5M2
#define HAL_NAME e5m2
#include "prefill_cute_launch.inc"
