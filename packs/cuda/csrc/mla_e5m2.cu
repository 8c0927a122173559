// MLA decode kernels for e5m2 latent caches.
#define HAL_KIND E5M2
#define HAL_NAME e5m2
#include "mla_launch.inc"
