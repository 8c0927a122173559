// MLA decode kernels for e4m3 latent caches.
#define HAL_KIND E4M3
#define HAL_NAME e4m3
#include "mla_launch.inc"
