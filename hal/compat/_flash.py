"""The one implementation behind every FlashAttention-style entry point (FA2's ``flash_attn``,
vLLM's ``vllm_flash_attn``, FA3's ``flash_attn_interface``): their arguments, checked and mapped
onto ``hal.paged_attention`` (several rows per sequence through ``query_start_loc``) and
``hal.cache_kv``, on whatever pack this machine has.

FlashAttention's conventions and hal's agree where it matters: causal rows are aligned to the end
of their sequence (row t of q_len sits at position seq_len - q_len + t), ``softcap`` caps the
scaled logits, ALiBi adds ``-slope * |i + seqlen_k - seqlen_q - j|`` (hal's ``slope * (j - p)`` on
the keys a causal row sees), ``window_size=(left, right)`` keeps keys ``p - left .. p + right``.
The log-sum-exp is natural-log, ``[num_heads, total_q]`` (varlen) or ``[batch, num_heads,
seqlen_q]``.
"""

from __future__ import annotations

import torch

from hal import api
from hal.compat import _common as c
from hal.compat import _plans
from hal.validate import ArgumentError


def forward_only(fn: str, dropout_p=0.0, return_attn_probs=False, deterministic=False) -> None:
    if dropout_p not in (0, 0.0, None):
        c.refuse(fn, "dropout_p", "hal serves inference: no dropout (expected 0.0)", dropout_p)
    if return_attn_probs:
        c.refuse(fn, "return_attn_probs", "hal never forms the attention matrix; return_softmax_lse gives the "
                 "log-sum-exp", return_attn_probs)


def no_fp8_query(fn: str, q: torch.Tensor, q_descale) -> None:
    if q_descale is not None or q.dtype.itemsize == 1:
        c.refuse(fn, "q_descale", "hal keeps the query in 16 bits (FP8 attention math is not served yet); pass "
                 "a float16/bfloat16 query and the FP8 cache's k_descale/v_descale", q_descale
                 if q_descale is None else c.desc(q_descale))


def unused(fn: str, **named) -> None:
    """Arguments whose only served value is None (or 0 / 1 where stated by the caller)."""
    for name, value in named.items():
        if value is not None:
            c.refuse(fn, name, "hal has no equivalent; pass None", value if not isinstance(value, torch.Tensor)
                     else c.desc(value))


def _lse_buffer(total_q: int, h: int, device) -> torch.Tensor:
    # hal writes [total_q, num_heads] through any strides: the transpose of FlashAttention's layout
    return torch.empty((h, total_q), dtype=torch.float32, device=device).t()


def varlen(fn: str, q, k, v, *, cu_seqlens_q, max_seqlen_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
           block_table=None, softmax_scale=None, causal=False, window_size=None, softcap=0.0, alibi_slopes=None,
           k_descale=None, v_descale=None, out=None, return_lse=False):
    """``flash_attn_varlen_func``: rows ``cu_seqlens_q[i] .. [i+1]-1`` of ``q`` [total_q, heads, d]
    attend to sequence i's keys: pages of the NHD cache ``k``/``v`` [num_blocks, page, kv_heads, d]
    through ``block_table`` (``seqused_k`` keys, else ``cu_seqlens_k``'s lengths), or without a block
    table the rows ``cu_seqlens_k[i] ..`` of a dense ``k``/``v`` [total_k, kv_heads, d] (viewed as
    pages of one token). ``max_seqlen_k=None`` with a block table: the table's capacity. Returns
    ``out`` or ``(out, softmax_lse)``."""
    key = None
    if block_table is not None:
        # The fast path: a call with the batch arguments of an earlier served call runs that call's plan
        # (plan.run checks this layer's q, caches and out, and refuses what differs: then the full path)
        key = (fn, id(block_table), id(seqused_k), id(cu_seqlens_k), id(cu_seqlens_q), id(alibi_slopes),
               id(k_descale), id(v_descale), max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
               return_lse)
        hit = _plans.recall(key)
        if hit is not None:
            plan, ks, vs, lengths_of = hit
            try:
                kc, vc = c.kept_nhd_view(fn, "k", k), c.kept_nhd_view(fn, "v", v)
                if lengths_of is not None:
                    _plans.lengths(lengths_of)
                lse = _lse_buffer(q.shape[0], q.shape[1], q.device) if return_lse else None
                o = plan.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out, lse=lse)
            except ArgumentError:  # the full path below names what is wrong, or plans this layout
                pass
            else:
                return (o, lse.t()) if return_lse else o
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q)):
        if not isinstance(t, torch.Tensor):
            c.fail(fn, name, "a torch.Tensor", c.desc(t))
    if q.dim() != 3:
        c.fail(fn, "q", "3-d [total_q, num_heads, head_size]", c.desc(q))
    total_q, h = q.shape[0], q.shape[1]
    if block_table is not None:
        if max_seqlen_k is None:  # FA3's paged call: the table's capacity bounds every sequence
            max_seqlen_k = block_table.shape[1] * k.shape[1] if block_table.dim() == 2 and k.dim() == 4 else 0
        key_cache, value_cache = c.kept_nhd_view(fn, "k", k), c.kept_nhd_view(fn, "v", v)
        if seqused_k is not None:
            seq_lens = seqused_k if seqused_k.dtype == torch.int32 else seqused_k.to(torch.int32)
        elif cu_seqlens_k is not None:  # into a buffer kept per cu_seqlens_k: a plan's lengths stay one tensor
            seq_lens = _plans.lengths(cu_seqlens_k)
        else:
            c.fail(fn, "seqused_k", "given (or cu_seqlens_k) with a block_table: each sequence's number of keys",
                   "None for both")
        tables = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    else:
        if cu_seqlens_k is None:
            c.fail(fn, "cu_seqlens_k", "the key rows' offsets [num_seqs + 1] when there is no block_table", "None")
        if k.dim() != 3 or v.dim() != 3:
            c.fail(fn, "k", "3-d [total_k, num_kv_heads, head_size] without a block_table", c.desc(k))
        total_k = k.shape[0]
        # a dense K/V is a paged cache of one-token pages whose table walks each sequence's rows
        key_cache, value_cache = k.unsqueeze(2), v.unsqueeze(2)
        span = max(int(max_seqlen_k), 1)
        steps = torch.arange(span, device=k.device, dtype=torch.int32)
        tables = (cu_seqlens_k[:-1, None].to(torch.int32) + steps[None, :]).clamp_(max=max(total_k - 1, 0))
        seq_lens = c.lengths_from_cu(cu_seqlens_k) if seqused_k is None else seqused_k.to(torch.int32)
    hkv = key_cache.shape[1]
    sliding, causal = c.window(fn, window_size, bool(causal))
    qsl = cu_seqlens_q if cu_seqlens_q.dtype == torch.int32 else cu_seqlens_q.to(torch.int32)
    lse = _lse_buffer(total_q, h, q.device) if return_lse else None
    ks, vs = c.kv_scale(fn, "k_descale", k_descale, hkv), c.kv_scale(fn, "v_descale", v_descale, hkv)
    slopes = c.alibi(fn, alibi_slopes, h)
    if block_table is None:  # the one-token page table is new each call: nothing to plan
        o = api.paged_attention(
            q, key_cache, value_cache, tables, seq_lens, scale=softmax_scale, k_scale=ks, v_scale=vs,
            alibi_slopes=slopes, logits_soft_cap=c.soft_cap(softcap), sliding_window=sliding,
            max_seq_len=int(max_seqlen_k), query_start_loc=qsl, max_query_len=int(max_seqlen_q), causal=causal,
            out=out, lse=lse)
        return (o, lse.t()) if return_lse else o
    # An engine calls this once a layer with one step's batch tensors: the hal plan of that batch is
    # made on the first layer and run by the others (docs/engines.md, "Per-call cost").
    o, plan = _plans.run(q, key_cache, value_cache, tables, seq_lens, qsl, ks, vs, slopes, out, lse,
                         scale=softmax_scale, logits_soft_cap=c.soft_cap(softcap), sliding_window=sliding,
                         max_seq_len=int(max_seqlen_k), max_query_len=int(max_seqlen_q), causal=causal)
    # Kept for the fast path only where the plan reads the caller's own tensors (an int64 table or
    # lengths converted here would be a copy: values written later into the caller's would not be seen)
    if tables is block_table and qsl is cu_seqlens_q and (seqused_k is None or seq_lens is seqused_k) \
            and (alibi_slopes is None or slopes is alibi_slopes or slopes._base is alibi_slopes):
        _plans.remember(key, (block_table, seqused_k, cu_seqlens_k, cu_seqlens_q, alibi_slopes, k_descale, v_descale),
                        (plan, ks, vs, cu_seqlens_k if seqused_k is None else None))
    return (o, lse.t()) if return_lse else o


def with_kvcache(fn: str, q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, block_table=None,
                 softmax_scale=None, causal=False, window_size=None, softcap=0.0, alibi_slopes=None,
                 k_descale=None, v_descale=None, out=None, return_lse=False):
    """``flash_attn_with_kvcache``: ``q`` [batch, seqlen_q, heads, d] over each sequence's
    ``cache_seqlens`` cached keys, after appending the new ``k``/``v`` [batch, seqlen_new, kv_heads, d]
    at those positions (``hal.cache_kv``). The cache is paged (``block_table``, NHD pages) or one
    [batch, seqlen_cache, kv_heads, d] region a sequence (viewed as pages). Returns ``out``
    [batch, seqlen_q, heads, d] or ``(out, softmax_lse)`` with lse [batch, heads, seqlen_q]."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        c.fail(fn, "q", "4-d [batch, seqlen_q, num_heads, head_size]", c.desc(q))
    b, sq, h, d = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            c.fail(fn, name, "4-d (NHD pages [num_blocks, page, kv_heads, d], or [batch, seqlen_cache, kv_heads, d])",
                   c.desc(t))
    dev = q.device
    if cache_seqlens is None:
        c.fail(fn, "cache_seqlens", "each sequence's cached length (an int32 [batch] tensor or an int)", "None")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=dev)
    cached = cache_seqlens.to(torch.int32)
    if block_table is not None:
        key_cache, value_cache = c.nhd_view(fn, "k_cache", k_cache), c.nhd_view(fn, "v_cache", v_cache)
        tables = block_table.to(torch.int32)
    else:  # one region a sequence: pages of the largest power of two (<= 256) dividing its length
        span = k_cache.shape[1]
        page = 256
        while page > 1 and span % page:
            page //= 2
        try:
            key_cache = c.nhd_view(fn, "k_cache", k_cache.view(b * (span // page), page, *k_cache.shape[2:]))
            value_cache = c.nhd_view(fn, "v_cache", v_cache.view(b * (span // page), page, *v_cache.shape[2:]))
        except RuntimeError:
            c.fail(fn, "k_cache", "a [batch, seqlen_cache, kv_heads, d] tensor whose first two dims merge (a view "
                   "splits it into pages)", f"strides {tuple(k_cache.stride())}")
        tables = torch.arange(b * (span // page), dtype=torch.int32, device=dev).view(b, span // page)
    bs = key_cache.shape[2]
    hkv = key_cache.shape[1]
    ks, vs = c.kv_scale(fn, "k_descale", k_descale, hkv), c.kv_scale(fn, "v_descale", v_descale, hkv)
    seq_lens = cached
    if k is not None or v is not None:
        if k is None or v is None or k.dim() != 4 or k.shape[0] != b:
            c.fail(fn, "k", "given with v, both [batch, seqlen_new, kv_heads, d]", c.desc(k) if k is not None else "None")
        sn = k.shape[1]
        pos = cached[:, None].to(torch.int64) + torch.arange(sn, device=dev)[None, :]          # [b, sn]
        page_ids = tables.to(torch.int64).gather(1, (pos // bs).clamp_(max=tables.shape[1] - 1))
        slots = (page_ids * bs + pos % bs).reshape(-1)
        api.cache_kv(k.reshape(b * sn, *k.shape[2:]), v.reshape(b * sn, *v.shape[2:]), key_cache, value_cache,
                     slots, k_scale=ks, v_scale=vs)
        seq_lens = cached + sn
    sliding, causal = c.window(fn, window_size, bool(causal))
    qsl = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=dev)
    o = None if out is None else out.view(b * sq, h, d)
    lse = _lse_buffer(b * sq, h, dev) if return_lse else None
    res = api.paged_attention(
        q.reshape(b * sq, h, d), key_cache, value_cache, tables, seq_lens, scale=softmax_scale, k_scale=ks,
        v_scale=vs, alibi_slopes=c.alibi(fn, alibi_slopes, h), logits_soft_cap=c.soft_cap(softcap),
        sliding_window=sliding, max_seq_len=tables.shape[1] * bs, query_start_loc=qsl, max_query_len=sq,
        causal=causal, out=o, lse=lse)
    res = res.view(b, sq, h, d) if out is None else out
    if not return_lse:
        return res
    return res, lse.view(b, sq, h).permute(0, 2, 1)
