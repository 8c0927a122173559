// MLA decode kernels for f16 latent caches.
#define HAL_KIND F16
#define HAL_NAME f16
#include "mla_launch.inc"
