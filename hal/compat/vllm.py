"""vLLM's cache writers (``vllm._custom_ops`` as of vLLM 0.34.0) served by hal:
``from hal.compat.vllm import reshape_and_cache_flash, concat_and_cache_mla``.

Same parameters. The caches are vLLM's, passed as views (nothing is copied):

- ``reshape_and_cache_flash``: NHD pages ``[num_blocks, block_size, num_kv_heads, head_size]``
  (``kv_cache[0]`` / ``kv_cache[1]`` of a stacked ``[2, num_blocks, ...]`` tensor are such views); an
  FP8 cache allocated as ``uint8`` takes its encoding from ``kv_cache_dtype`` on this target ("fp8"
  and "fp8_e4m3" are e4m3fnuz on gfx942, e4m3fn elsewhere, as vLLM reads them: see
  :func:`hal.fp8.kv_cache_dtype`). ``k_scale``/``v_scale``: vLLM's float32 layer scales ([1] or 0-d
  tensors) or floats. ``slot_mapping`` int64, negative slots skipped (padding).
- ``concat_and_cache_mla``: one ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` cache a layer,
  written as hal's two MLA parts (``hal.cache_mla``), both with ``scale``.
"""

from __future__ import annotations

import torch

from hal import api
from hal.compat import _common as c

__all__ = ["reshape_and_cache_flash", "concat_and_cache_mla", "kv_cache_view"]


def kv_cache_view(cache: torch.Tensor, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """vLLM's NHD cache ``[num_blocks, block_size, num_kv_heads, head_size]`` (``uint8`` for FP8) as
    the hal cache ``hal.paged_attention`` reads: a typed, permuted view."""
    fn = "vllm.kv_cache_view"
    return c.nhd_view(fn, "cache", c.typed_cache(fn, "cache", cache, kv_cache_dtype))


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [num_tokens, num_kv_heads, head_size] into vLLM's NHD caches at
    ``slot_mapping`` (``stored = sat(x / scale)`` in the cache's encoding)."""
    fn = "vllm.reshape_and_cache_flash"
    kc = c.nhd_view(fn, "key_cache", c.typed_cache(fn, "key_cache", key_cache, kv_cache_dtype))
    vc = c.nhd_view(fn, "value_cache", c.typed_cache(fn, "value_cache", value_cache, kv_cache_dtype))
    hkv = kc.shape[1]
    api.cache_kv(key, value, kc, vc, slot_mapping, k_scale=c.kv_scale(fn, "k_scale", k_scale, hkv),
                 v_scale=c.kv_scale(fn, "v_scale", v_scale, hkv))


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    skip_scale: bool = False,
) -> None:
    """Write the latents ``kv_c`` [num_tokens, kv_lora_rank] and rotary parts ``k_pe``
    [num_tokens, rope_dim] (a 3-d [num_tokens, 1, rope_dim] as vLLM passes it too) into the MLA
    cache ``kv_cache`` [num_blocks, block_size, kv_lora_rank + rope_dim] at ``slot_mapping``.
    ``skip_scale=True`` (vLLM 0.34) is refused by name."""
    fn = "vllm.concat_and_cache_mla"
    if skip_scale:
        c.refuse(fn, "skip_scale", "hal always stores sat(x / scale); pass scale=1.0 for unscaled values", skip_scale)
    cache = c.typed_cache(fn, "kv_cache", kv_cache, kv_cache_dtype)
    if cache.dim() != 3:
        c.fail(fn, "kv_cache", "3-d [num_blocks, block_size, kv_lora_rank + rope_dim]", c.desc(kv_cache))
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe.squeeze(1)
    r = kv_c.shape[-1]
    s = c.kv_scale(fn, "scale", scale, 1)
    api.cache_mla(kv_c, k_pe, cache[..., :r], cache[..., r:], slot_mapping, ckv_scale=s, kpe_scale=s)
