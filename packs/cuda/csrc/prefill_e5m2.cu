// Multi-token attention kernels for e5m2 caches.
#define HAL_KIND E5M2
#define HAL_NAME e5m2
#include "prefill_launch.inc"
