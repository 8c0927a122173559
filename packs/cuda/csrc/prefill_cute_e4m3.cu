// The CuTe multi-token kernel (prefill_cute.cuh) for e4m3 caches, sm_90a.
#define HAL_KIND E4M3
#define HAL_NAME e4m3
#include "prefill_cute_launch.inc"
