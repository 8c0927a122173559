"""Drop-in entry points: the kernel-library calls engines already make, with those libraries'
parameters, defaults and results, served by ``hal.paged_attention`` / ``hal.cache_kv`` /
``hal.mla_decode`` / ``hal.cache_mla`` on whatever pack this machine has. Switching is an import
(docs/engines.md):

- :mod:`hal.compat.flash_attn`: FlashAttention-2 (``flash_attn_varlen_func``, ``flash_attn_with_kvcache``)
- :mod:`hal.compat.flash_attn_interface`: FlashAttention-3 as the ``fa3-fwd`` wheel ships it
- :mod:`hal.compat.vllm`: vLLM's cache writers (``reshape_and_cache_flash``, ``concat_and_cache_mla``)
- :mod:`hal.compat.vllm_flash_attn`: vLLM's ``flash_attn_varlen_func`` (its FlashAttention backend's call)
- :mod:`hal.compat.flashinfer`: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` /
  ``BatchPrefillWithPagedKVCacheWrapper``
- :mod:`hal.compat.flash_mla`: FlashMLA's ``get_mla_metadata`` / ``flash_mla_with_kvcache`` (sgl-flash-mla)

What hal does not serve (dropout, attention probabilities, rotary inside the call, ...) raises
:class:`NotServedError` naming the argument: never a silent difference. The recorded signatures
these follow, with the version each came from, are in ``signatures.json`` (tests compare them).
"""

from hal.compat._common import NotServedError

__all__ = ["NotServedError"]
