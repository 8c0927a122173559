// Multi-token attention kernels for f16 caches.
#define HAL_KIND F16
#define HAL_NAME f16
#include "prefill_launch.inc"
