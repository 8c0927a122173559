// Decode kernels for f16 caches.
#define HAL_KIND F16
#define HAL_NAME f16
#include "decode_launch.inc"
