"""FlashAttention-2's entry points (``flash_attn`` 2.8.3, ``flash_attn.flash_attn_interface``) served
by hal: ``from hal.compat.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache``.

Same parameters, defaults and results. Served: paged caches (``block_table``, NHD pages), dense
varlen K/V, causal bottom-right alignment, ``window_size``, ``softcap``, ``alibi_slopes``
([num_heads]), ``return_softmax_lse`` / ``return_attn_probs`` with ``dropout_p=0`` (the
log-sum-exp; the probabilities slot is None, as FlashAttention returns without dropout), new-token
append in ``flash_attn_with_kvcache``. Refused by name (:class:`hal.compat.NotServedError`):
dropout, rotary embedding inside the call, ``cache_batch_idx``, ``cache_leftpad``, per-sequence
ALiBi slopes. ``deterministic`` and ``num_splits`` are accepted and have no effect (hal's forward is
deterministic; hal chooses its own split of the context).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from hal.compat import _flash

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache"]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """FlashAttention-2's varlen attention on hal. Returns ``out`` [total_q, heads, d], or with
    ``return_attn_probs=True`` ``(out, softmax_lse [heads, total_q], None)``."""
    fn = "flash_attn.flash_attn_varlen_func"
    if dropout_p not in (0, 0.0, None):
        _flash.forward_only(fn, dropout_p=dropout_p)
    res = _flash.varlen(fn, q, k, v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        cu_seqlens_k=cu_seqlens_k, block_table=block_table, softmax_scale=softmax_scale,
                        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        return_lse=bool(return_attn_probs))
    return (res[0], res[1], None) if return_attn_probs else res


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """FlashAttention-2's decode / chunked attention over a KV cache on hal. Returns ``out``
    [batch, seqlen_q, heads, d], or ``(out, softmax_lse [batch, heads, seqlen_q])``."""
    fn = "flash_attn.flash_attn_with_kvcache"
    _flash.unused(fn, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                  cache_leftpad=cache_leftpad)
    res = _flash.with_kvcache(fn, q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
                              softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, return_lse=return_softmax_lse)
    return res
