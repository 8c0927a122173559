// Multi-token attention kernels for e4m3 caches.
#define HAL_KIND E4M3
#define HAL_NAME e4m3
#include "prefill_launch.inc"
