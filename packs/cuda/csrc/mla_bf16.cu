// MLA decode kernels for bf16 latent caches.
#define HAL_KIND BF16
#define HAL_NAME bf16
#include "mla_launch.inc"
