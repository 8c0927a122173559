"""FlashAttention-3's entry points as the ``fa3-fwd`` 0.0.3 wheel ships them (``fa3_fwd_interface``,
FA3's ``hopper/flash_attn_interface.py``) served by hal:
``from hal.compat.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache``.

Same parameters, defaults and results. Served beyond FA2's set: ``page_table``, varlen queries over
a cache (``cu_seqlens_q`` + ``max_seqlen_q``), ``k_descale``/``v_descale`` for an FP8 cache (one
scale per KV head, or FA3's ``[batch, kv_heads]`` when its rows are one view, as vLLM passes them).
Refused by name: ``q_descale`` (an FP8 query: FP8 attention math is not served yet), ``qv``,
``attention_chunk`` != 0, ``seqused_q``, rotary embedding, ``cache_batch_idx``, ``cache_leftpad``,
``cu_seqlens_k_new``. ``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata`` and
``deterministic`` are accepted and have no effect (hal plans its own launch).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from hal.compat import _common as c
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
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """FA3's varlen attention over dense K/V on hal. Returns ``out``, or with
    ``return_attn_probs=True`` ``(out, softmax_lse [heads, total_q])``."""
    fn = "flash_attn_interface.flash_attn_varlen_func"
    _flash.unused(fn, seqused_q=seqused_q, qv=qv)
    _flash.no_fp8_query(fn, q, q_descale)
    if attention_chunk:
        c.refuse(fn, "attention_chunk", "chunked (local) attention has no hal equivalent; pass 0", attention_chunk)
    return _flash.varlen(fn, q, k, v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, k_descale=k_descale, v_descale=v_descale,
                         return_lse=bool(return_attn_probs))


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """FA3's attention over a (paged) KV cache on hal: ``q`` [batch, seqlen_q, heads, d], or with
    ``cu_seqlens_q`` [total_q, heads, d] rows per sequence. Returns ``out`` or, as FA3 does,
    ``(out, softmax_lse, out_accum, softmax_lse_accum)`` (the last two None: no partials leave hal)."""
    fn = "flash_attn_interface.flash_attn_with_kvcache"
    if not (qv is None and rotary_cos is None and rotary_sin is None and cache_batch_idx is None
            and cache_leftpad is None and cu_seqlens_k_new is None and rotary_seqlens is None):
        _flash.unused(fn, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                      cache_leftpad=cache_leftpad, cu_seqlens_k_new=cu_seqlens_k_new, rotary_seqlens=rotary_seqlens)
    _flash.no_fp8_query(fn, q, q_descale)
    if attention_chunk:
        c.refuse(fn, "attention_chunk", "chunked (local) attention has no hal equivalent; pass 0", attention_chunk)
    if cu_seqlens_q is not None:  # varlen rows over a paged cache: vLLM's FA3 decode and chunked prefill
        if page_table is None:
            c.fail(fn, "page_table", "given with cu_seqlens_q (rows per sequence over a paged cache)", "None")
        if k is not None or v is not None:
            c.refuse(fn, "k", "appending new keys with varlen queries is not served; write them with "
                     "hal.compat.vllm.reshape_and_cache_flash first", c.desc(k) if k is not None else k)
        if max_seqlen_q is None:
            c.fail(fn, "max_seqlen_q", "given with cu_seqlens_q", "None")
        if isinstance(cache_seqlens, int):
            cache_seqlens = torch.full((cu_seqlens_q.shape[0] - 1,), cache_seqlens, dtype=torch.int32, device=q.device)
        res = _flash.varlen(fn, q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=None, seqused_k=cache_seqlens, block_table=page_table,
                             softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                             k_descale=k_descale, v_descale=v_descale, return_lse=return_softmax_lse)
    else:
        res = _flash.with_kvcache(fn, q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=page_table,
                                  softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                                  k_descale=k_descale, v_descale=v_descale, return_lse=return_softmax_lse)
    # FA3 returns (out, softmax_lse, out_accum, softmax_lse_accum): hal's split-K partials stay inside
    return (*res, None, None) if return_softmax_lse else res
