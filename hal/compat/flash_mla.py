"""FlashMLA's entry points as ``sgl-flash-mla`` 1.0.0 ships them (``flash_mla``) served by hal:
``from hal.compat.flash_mla import get_mla_metadata, flash_mla_with_kvcache``.

Same parameters, defaults and results; the dense MLA decode of DeepSeek models: ``q``
[batch, s_q, h_q, R + P] (R = ``head_dim_v`` = 512 the latent, P = 64 the rotary part), ``k_cache``
[num_blocks, page_block_size, 1, R + P] whose first R columns are also the value, served by
``hal.mla_decode`` over two views of that cache (nothing is copied). As in this release,
``get_mla_metadata`` takes any arguments and returns ``(FlashMLASchedMeta(), None)``, an object the
first ``flash_mla_with_kvcache`` call fills: here with the ``hal.plan`` of the batch, which the other
layers' calls run. Returns ``(out [batch, s_q, h_q, R], softmax_lse [batch, h_q, s_q])``, natural
log, ``+inf`` for a row with no key (FlashMLA's convention).

An FP8 cache is a torch FP8 dtype with ``descale_k`` its scale (hal's e4m3 latent); FlashMLA's packed
FP8 formats (``uint8`` caches with scales inline) are refused by name, as are the sparse decode
(``indices``, ``topk_length``, ``extra_*``), attention sinks, ``descale_q`` (an FP8 query),
``num_splits`` other than None (this release asserts it), and ``causal=False`` with several rows
a sequence (hal's multi-row MLA is causal). ``use_legacy``, ``enable_batch_invariant`` and
``kv_format`` are accepted and have no effect.

The log-sum-exp is always returned, so every call asks hal for it (the op's ``lse`` output): today
only the emu pack writes it, so on a GPU these calls run on emu with a ``hal.FallbackWarning``
(docs/engines.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from hal import fp8, planning
from hal.compat import _common as c
from hal.validate import ArgumentError

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache"]


@dataclasses.dataclass
class FlashMLASchedMeta:
    """What ``get_mla_metadata`` returns: filled by the first ``flash_mla_with_kvcache`` call with the
    hal plan of its batch (reused while the batch tensors and layouts stay those of that call)."""
    have_initialized: bool = False
    key: Optional[tuple] = None
    plan: Optional[object] = None
    held: tuple = ()


def get_mla_metadata(*args, **kwargs):
    """As sgl-flash-mla 1.0.0: the arguments are ignored; ``(FlashMLASchedMeta(), None)``."""
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: Optional[bool] = None,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    enable_batch_invariant: bool = False,
    use_legacy: bool = False,
    kv_format: Optional[str] = None,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
):
    """FlashMLA's dense decode on hal. Returns ``(out, softmax_lse)``."""
    fn = "flash_mla.flash_mla_with_kvcache"
    for name, value in (("indices", indices), ("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
                        ("extra_indices_in_kvcache", extra_indices_in_kvcache), ("topk_length", topk_length),
                        ("extra_topk_length", extra_topk_length), ("num_splits", num_splits),
                        ("descale_q", descale_q)):
        if value is not None:
            c.refuse(fn, name, "hal serves FlashMLA's dense decode with a 16-bit query (sparse decode, sinks, "
                     "an FP8 query and split counts have no hal equivalent); pass None", c.desc(value))
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        c.fail(fn, "tile_scheduler_metadata", "what hal.compat.flash_mla.get_mla_metadata returned",
               c.desc(tile_scheduler_metadata))
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        c.fail(fn, "q", "4-d [batch, s_q, h_q, head_dim]", c.desc(q))
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4 or k_cache.shape[2] != 1:
        c.fail(fn, "k_cache", "4-d [num_blocks, page_block_size, 1, head_dim] (one latent head)", c.desc(k_cache))
    if k_cache.dtype == torch.uint8 or (is_fp8_kvcache and not fp8.is_fp8(k_cache.dtype)):
        c.refuse(fn, "is_fp8_kvcache", "FlashMLA's packed FP8 cache formats (scales inline) are not hal's; an FP8 "
                 "latent is a torch float8 cache with descale_k", is_fp8_kvcache)
    b, sq, h, dq = q.shape
    if not (0 < head_dim_v < dq) or k_cache.shape[3] != dq:
        c.fail(fn, "head_dim_v", f"the latent width, < q's head_dim {dq} (= k_cache's)", repr(head_dim_v))
    if sq > 1 and not causal:
        c.refuse(fn, "causal", "several query rows a sequence are causal in hal's MLA (speculative decoding)", causal)
    scale = softmax_scale if softmax_scale is not None else dq ** -0.5
    kc = k_cache[:, :, 0]
    ckv, kpe = kc[..., :head_dim_v], kc[..., head_dim_v:]
    s = None if descale_k is None else c.kv_scale(fn, "descale_k", descale_k, 1)
    qn, qp = q[..., :head_dim_v].reshape(b * sq, h, head_dim_v), q[..., head_dim_v:].reshape(b * sq, h, dq - head_dim_v)
    out = torch.empty((b, sq, h, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    lse_rows = lse.permute(0, 2, 1).reshape(b * sq, h) if sq == 1 else None
    hal_lse = lse_rows if lse_rows is not None else torch.empty((b * sq, h), dtype=torch.float32, device=q.device)
    o = out.view(b * sq, h, head_dim_v)
    meta = tile_scheduler_metadata
    key = (id(block_table), id(cache_seqlens), b, sq, h, float(scale), s is None)
    if meta.key == key:
        try:
            meta.plan.run(qn, qp, ckv, kpe, ckv_scale=s, kpe_scale=s, out=o, lse=hal_lse)
        except ArgumentError:
            meta.key = None
    if meta.key != key:
        qsl = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device) if sq > 1 else None
        seq = cache_seqlens if cache_seqlens.dtype == torch.int32 else cache_seqlens.to(torch.int32)
        tables = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        meta.plan = planning.plan("mla_decode", qn, qp, ckv, kpe, tables, seq, scale=float(scale), ckv_scale=s,
                                  kpe_scale=s, query_start_loc=qsl, max_query_len=sq if sq > 1 else None,
                                  max_seq_len=tables.shape[1] * ckv.shape[1], out=o, lse=hal_lse)
        meta.key, meta.held, meta.have_initialized = key, (block_table, cache_seqlens, qsl), True
        meta.plan.run(qn, qp, ckv, kpe, ckv_scale=s, kpe_scale=s, out=o, lse=hal_lse)
    if lse_rows is None:
        lse.copy_(hal_lse.view(b, sq, h).permute(0, 2, 1))
    lse.masked_fill_(lse == float("-inf"), float("inf"))   # FlashMLA: +inf for a row with no key
    return out, lse
