"""The compat entry points (hal.compat) as bench contenders and host-time rows: an engine's call as
the library it replaces takes it, served by hal, so the cost of the compatibility layer shows next
to hal's own call and the library itself.

Each maps the problem (hal's HND caches, block table, lengths) onto that library's arguments, made
once before timing: NHD caches (the problem's values in NHD copies, :func:`contenders.nhd_caches`),
cumulative offsets, FlashInfer's CSR pages. Decode problems are one row a sequence.
"""

from __future__ import annotations

import torch

from hal.bench.baselines import Skip


def _nhd(p):
    from hal.bench import contenders
    kc, vc = contenders.nhd_caches(p)
    return kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)       # the NHD tensors themselves


def _rows(p):
    """(cu_seqlens_q int32 [n + 1], max rows a sequence) of the problem."""
    if p.op == "prefill":
        return p.query_start_loc, p.max_query_len
    n = p.query.shape[0]
    return torch.arange(n + 1, dtype=torch.int32, device=p.query.device), 1


def _scales(p):
    if p.k_scale is None:
        return None, None
    dev = p.query.device
    return (torch.tensor([p.k_scale], dtype=torch.float32, device=dev),
            torch.tensor([p.v_scale], dtype=torch.float32, device=dev))


def fa2_varlen(p):
    """``hal.compat.flash_attn.flash_attn_varlen_func`` over the block table (16-bit caches: FA2 has
    no FP8 descales)."""
    from hal.compat import flash_attn
    if p.k_scale is not None:
        raise Skip("FA2's interface has no K/V descales (FP8 caches: fa3-kvcache)")
    kc, vc = _nhd(p)
    cu_q, max_q = _rows(p)
    cu_k = torch.zeros(p.seq_lens.shape[0] + 1, dtype=torch.int32, device=p.query.device)
    cu_k[1:] = p.seq_lens.cumsum(0)
    q, bt, scale, max_k = p.query, p.block_tables, p.scale, p.max_seq_len
    return lambda: flash_attn.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                                     causal=True, block_table=bt)


def fa3_kvcache(p):
    """``hal.compat.flash_attn_interface.flash_attn_with_kvcache`` with ``page_table`` and varlen rows
    (vLLM's FA3 call), k/v descales for FP8 caches."""
    from hal.compat import flash_attn_interface
    kc, vc = _nhd(p)
    cu_q, max_q = _rows(p)
    ks, vs = _scales(p)
    q, bt, sl, scale = p.query, p.block_tables, p.seq_lens, p.scale
    return lambda: flash_attn_interface.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=sl, page_table=bt, cu_seqlens_q=cu_q, max_seqlen_q=max_q, softmax_scale=scale,
        causal=True, k_descale=ks, v_descale=vs)


def flashinfer_wrapper(p):
    """``hal.compat.flashinfer``'s decode wrapper (decode problems) or prefill wrapper (causal), planned
    before timing; the timed call is one ``run``."""
    from hal.compat import flashinfer
    indptr, indices, last = flashinfer.csr_pages(p.block_tables, p.lens, p.key_cache.shape[2])
    h, d = p.query.shape[1], p.query.shape[2]
    hkv, bs = p.key_cache.shape[1], p.key_cache.shape[2]
    ws = torch.empty(1, dtype=torch.uint8, device=p.query.device)
    caches = (p.key_cache, p.value_cache)                           # hal's layout is FlashInfer's HND
    if p.op == "prefill":
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND")
        w.plan(p.query_start_loc.cpu(), indptr, indices, last, h, hkv, d, bs, causal=True, sm_scale=p.scale)
    else:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND")
        w.plan(indptr, indices, last, h, hkv, d, bs, sm_scale=p.scale)
    q, ks, vs = p.query, p.k_scale, p.v_scale
    out = torch.empty_like(q)
    return lambda: w.run(q, caches, k_scale=ks, v_scale=vs, out=out)


ENTRY_POINTS = {"compat-fa2": fa2_varlen, "compat-fa3": fa3_kvcache, "compat-flashinfer": flashinfer_wrapper}
