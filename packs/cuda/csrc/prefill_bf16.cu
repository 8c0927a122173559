// Multi-token attention kernels for bf16 caches.
#define HAL_KIND BF16
#define HAL_NAME bf16
#include "prefill_launch.inc"
