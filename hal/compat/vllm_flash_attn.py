"""vLLM's FlashAttention entry point (``vllm.vllm_flash_attn.flash_attn_varlen_func`` as vLLM 0.34.0
bundles it: what vLLM's FlashAttention backend calls on NVIDIA, FA2 and FA3 builds alike) served by
hal: ``from hal.compat.vllm_flash_attn import flash_attn_varlen_func``.

Same parameters, defaults and results. Served: ``block_table`` with ``seqused_k`` (vLLM's paged call)
or dense K/V with ``cu_seqlens_k``, ``out``, ``return_softmax_lse``, ``window_size`` (None or
(left, right)), ``softcap``, ``alibi_slopes``, ``k_descale``/``v_descale`` for an FP8 cache.
Accepted without effect: ``fa_version``, ``scheduler_metadata``, ``num_splits``, ``deterministic``
(hal plans its own launch). Refused by name (:class:`hal.compat.NotServedError`): dropout,
``return_attn_probs``, ``q_descale`` (FP8 query math), ``q_v``, ``output_scale``, attention sinks
(``s_aux``), context parallelism (``cp_world_size`` > 1), and the mask / gather extensions.
"""

from __future__ import annotations

from hal.compat import _common as c
from hal.compat import _flash

__all__ = ["flash_attn_varlen_func", "DEFAULT_FA_VERSION"]

DEFAULT_FA_VERSION = 2


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=None,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    scheduler_metadata=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits=0,
    output_scale=None,
    fa_version=DEFAULT_FA_VERSION,
    s_aux=None,
    cp_world_size=1,
    cp_rank=0,
    cp_tot_seqused_k=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_tensor_leading_dims=None,
    dynamic_causal=None,
    gather_kv_indices=None,
    gather_kv_valid_length=None,
):
    """vLLM's varlen attention on hal. Returns ``out`` [total_q, heads, d], or with
    ``return_softmax_lse=True`` ``(out, softmax_lse [heads, total_q])``."""
    fn = "vllm_flash_attn.flash_attn_varlen_func"
    _flash.forward_only(fn, dropout_p=dropout_p, return_attn_probs=return_attn_probs)
    _flash.no_fp8_query(fn, q, q_descale)
    _flash.unused(fn, q_v=q_v, output_scale=output_scale, s_aux=s_aux, cp_tot_seqused_k=cp_tot_seqused_k,
                  mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors,
                  aux_tensor_leading_dims=aux_tensor_leading_dims, dynamic_causal=dynamic_causal,
                  gather_kv_indices=gather_kv_indices, gather_kv_valid_length=gather_kv_valid_length)
    if cp_world_size != 1:
        c.refuse(fn, "cp_world_size", "context parallelism is the engine's: merge partial outputs with the "
                 "returned softmax_lse", cp_world_size)
    return _flash.varlen(fn, q, k, v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table,
                         softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale, out=out,
                         return_lse=return_softmax_lse)
