"""FlashInfer's paged-KV wrappers (``flashinfer`` 0.7.4) served by hal:
``from hal.compat.flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper``.

Same constructor, ``plan`` and ``run`` parameters. ``plan`` turns the CSR page description
(``indptr``, ``indices``, ``last_page_len``, as SGLang and vLLM's FlashInfer backend build it) into
hal's block table and lengths once per step (it reads ``indptr`` on the host, as FlashInfer's plan
does); ``run`` per layer goes through one ``hal.plan`` (validated and dispatched once, re-planned
only when a layer's layout differs). Caches: a ``(k, v)`` pair or one ``[pages, 2, ...]`` tensor, in
``NHD`` ``[pages, page_size, kv_heads, d]`` or ``HND`` ``[pages, kv_heads, page_size, d]`` (hal's own
layout), passed as views. The log-sum-exp comes in FlashInfer's base 2 unless ``lse_base="ln"``.

Refused by name (:class:`hal.compat.NotServedError`): ``pos_encoding_mode`` other than "NONE"
(rotary or ALiBi computed inside the kernel), custom masks, ``q_scale`` (an FP8 query), attention
sinks, block-scaled caches (``kv_cache_sf``), ``use_fp16_qk_reduction``, a different ``head_dim_vo``,
``use_cuda_graph=True`` (for graphs use ``hal.plan`` directly: its ``run`` is capture-safe), several
query rows a request in the decode wrapper. Accepted without effect: the workspace buffer,
``use_tensor_cores``, ``backend``, ``enable_pdl``, ``non_blocking``, split tuning arguments.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from hal import planning
from hal.compat import _common as c
from hal.validate import ArgumentError

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper", "csr_pages"]

_LOG2E = 1.0 / math.log(2.0)
_DECODE_PLAN_LEGACY = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                       "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
                       "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req")


def _pages(fn: str, indptr, indices, last_page_len, page_size: int, device):
    """CSR pages -> (int32 [n, max_pages] block table, int32 [n] lengths) on ``device``."""
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            c.fail(fn, name, "a 1-d integer tensor", c.desc(t))
    ptr = indptr.to("cpu", torch.int64)
    n = ptr.numel() - 1
    counts = ptr[1:] - ptr[:-1]
    width = max(int(counts.max()) if n > 0 else 0, 1)
    idx = ptr[:-1, None] + torch.arange(width)[None, :]
    inside = torch.arange(width)[None, :] < counts[:, None]
    flat = indices.to(device, torch.int64)
    gather = idx.clamp(max=max(flat.numel() - 1, 0)).to(device)
    table = torch.where(inside.to(device), flat[gather] if flat.numel() else torch.zeros_like(gather), 0)
    last = last_page_len.to(device, torch.int64)
    cnt = counts.to(device)
    lens = torch.where(cnt > 0, (cnt - 1) * page_size + last, 0)
    max_len = int(((counts - 1).clamp_min(0) * page_size + last_page_len.to("cpu", torch.int64)).max()) if n else 0
    return table.to(torch.int32), lens.to(torch.int32), max_len


def csr_pages(block_tables: torch.Tensor, seq_lens, page_size: int):
    """hal's block table and lengths as FlashInfer's CSR pages: (``indptr`` int32 [n + 1] on the host,
    ``indices`` int32 on the table's device, ``last_page_len`` int32 [n] on the host); the inverse of
    what ``plan`` builds (tests, the bench)."""
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    tables = block_tables.cpu()
    pages, ptr, last = [], [0], []
    for i, n in enumerate(lens):
        np_ = (n + page_size - 1) // page_size
        pages += tables[i, :np_].tolist()
        ptr.append(len(pages))
        last.append(n - (np_ - 1) * page_size if np_ else 0)
    return (torch.tensor(ptr, dtype=torch.int32), torch.tensor(pages, dtype=torch.int32, device=block_tables.device),
            torch.tensor(last, dtype=torch.int32))


def _caches(fn: str, paged_kv_cache, kv_layout: str):
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            c.fail(fn, "paged_kv_cache", "a (k_cache, v_cache) pair or one [pages, 2, ...] tensor",
                   f"a sequence of {len(paged_kv_cache)}")
        k, v = paged_kv_cache
    elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2:
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        c.fail(fn, "paged_kv_cache", "a (k_cache, v_cache) pair or one [pages, 2, ...] tensor", c.desc(paged_kv_cache))
    if kv_layout == "NHD":
        return c.nhd_view(fn, "paged_kv_cache", k), c.nhd_view(fn, "paged_kv_cache", v)
    return k, v


def _refuse_extras(fn: str, **named) -> None:
    for name, value in named.items():
        if value is not None and value is not False:
            c.refuse(fn, name, "hal has no equivalent; pass None", value if not isinstance(value, torch.Tensor)
                     else c.desc(value))


class _Wrapper:
    """What both wrappers share: the planned batch and one hal plan reused across layers."""

    _fn = "flashinfer"

    def __init__(self, float_workspace_buffer, kv_layout, use_cuda_graph):
        if kv_layout not in ("NHD", "HND"):
            c.fail(self._fn, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
        if use_cuda_graph:
            c.refuse(self._fn, "use_cuda_graph", "graph capture through the compat wrapper is not served yet; "
                     "hal.plan(...).run is capture-safe", use_cuda_graph)
        self._kv_layout = kv_layout
        self._device = float_workspace_buffer.device if isinstance(float_workspace_buffer, torch.Tensor) else None
        self._batch = None
        self._hal_plan = None

    def _plan_batch(self, tables, lens, max_len, qsl, max_q, *, num_qo_heads, num_kv_heads, head_dim, page_size,
                    sm_scale, window_left, logits_soft_cap, causal):
        if num_qo_heads % num_kv_heads:
            c.fail(self._fn, "num_qo_heads", f"a multiple of num_kv_heads={num_kv_heads}", str(num_qo_heads))
        self._batch = dict(block_tables=tables, seq_lens=lens, max_seq_len=max_len, query_start_loc=qsl,
                           max_query_len=max_q, scale=sm_scale, logits_soft_cap=logits_soft_cap,
                           causal=causal, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           page_size=page_size, window_left=window_left)
        self._hal_plan = None

    def _run(self, q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, window_left, lse_base="log2",
             lse_layout="NH"):
        fn = self._fn + ".run"
        if self._batch is None:
            raise ArgumentError(f"hal.compat {fn}: plan() must be called before run()")
        b = self._batch
        kc, vc = _caches(fn, paged_kv_cache, self._kv_layout)
        w = b["window_left"] if window_left is None else window_left
        sliding = w + 1 if w is not None and w >= 0 else None
        lse_hal, lse_ret = None, None
        if return_lse:
            total_q, h = q.shape[0], q.shape[1]
            if lse_layout == "HN":
                lse_ret = lse if lse is not None else torch.empty((h, total_q), dtype=torch.float32, device=q.device)
                lse_hal = lse_ret.t()
            else:
                lse_ret = lse if lse is not None else torch.empty((total_q, h), dtype=torch.float32, device=q.device)
                lse_hal = lse_ret
        hkv = kc.shape[1]
        ks, vs = c.kv_scale(fn, "k_scale", k_scale, hkv), c.kv_scale(fn, "v_scale", v_scale, hkv)
        key = (sliding,)
        p = self._hal_plan
        if p is not None and p[0] == key:
            try:
                o = p[1].run(q, kc, vc, k_scale=ks, v_scale=vs, out=out, lse=lse_hal)
            except ArgumentError:
                p = None  # this layer is laid out otherwise (or is malformed: planning it again says so)
        else:
            p = None
        if p is None:
            plan = planning.plan("paged_attention", q, kc, vc, b["block_tables"], b["seq_lens"], scale=b["scale"],
                                 k_scale=ks, v_scale=vs, logits_soft_cap=b["logits_soft_cap"], sliding_window=sliding,
                                 max_seq_len=b["max_seq_len"], query_start_loc=b["query_start_loc"],
                                 max_query_len=b["max_query_len"], causal=b["causal"], out=out, lse=lse_hal)
            self._hal_plan = (key, plan)
            o = plan.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out, lse=lse_hal)
        if not return_lse:
            return o
        if lse_base == "log2":
            lse_ret.mul_(_LOG2E)
        elif lse_base != "ln":
            c.fail(fn, "lse_base", "'log2' or 'ln'", repr(lse_base))
        return o, lse_ret


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's batch decode over a paged KV cache, on hal (one query row a request)."""

    _fn = "flashinfer.BatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
                 paged_kv_indices_buffer: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None, backend: str = "auto",
                 jit_args: Optional[List[Any]] = None, jit_kwargs: Optional[Dict[str, Any]] = None):
        if jit_args is not None or jit_kwargs is not None:
            c.refuse(self._fn, "jit_args", "custom JIT attention variants have no hal equivalent", jit_args)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *deprecated_positional_args: Any, **kwargs: Any) -> None:
        fn = self._fn + ".plan"
        if len(deprecated_positional_args) > len(_DECODE_PLAN_LEGACY):
            raise TypeError(f"{fn}() takes at most {len(_DECODE_PLAN_LEGACY)} optional positional arguments "
                            f"after page_size; got {len(deprecated_positional_args)}")
        opts = dict(zip(_DECODE_PLAN_LEGACY, deprecated_positional_args))
        unknown = set(kwargs) - set(_DECODE_PLAN_LEGACY)
        if unknown:
            raise TypeError(f"{fn}() got unexpected keyword arguments {sorted(unknown)}")
        opts.update(kwargs)
        if opts.get("pos_encoding_mode", "NONE") != "NONE":
            c.refuse(fn, "pos_encoding_mode", "rotary or ALiBi inside the kernel has no hal equivalent; apply "
                     "rotary before the call", opts["pos_encoding_mode"])
        if opts.get("q_len_per_req") not in (None, 1):
            c.refuse(fn, "q_len_per_req", "several rows a request: use BatchPrefillWithPagedKVCacheWrapper",
                     opts["q_len_per_req"])
        _refuse_extras(fn, block_tables=opts.get("block_tables"), seq_lens=opts.get("seq_lens"))
        dev = self._device or indices.device
        tables, lens, max_len = _pages(fn, indptr, indices, last_page_len, page_size, dev)
        self._plan_batch(tables, lens, max_len, None, None, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, page_size=page_size, sm_scale=opts.get("sm_scale"),
                         window_left=opts.get("window_left", -1), logits_soft_cap=opts.get("logits_soft_cap"),
                         causal=True)

    def run(self, q: torch.Tensor, paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], *args,
            q_scale: Optional[float] = None, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, return_lse: bool = False,
            enable_pdl: Optional[bool] = None, window_left: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
            q_len_per_req: Optional[int] = None, skip_softmax_threshold_scale_factor: Optional[float] = None,
            kv_cache_sf: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None):
        """``q`` [batch, num_qo_heads, head_dim]. Returns ``out`` or ``(out, lse [batch, heads], base 2)``."""
        fn = self._fn + ".run"
        if args:
            raise TypeError(f"{fn}() takes no positional arguments after paged_kv_cache (FlashInfer's are "
                            "legacy; pass scales by name)")
        _refuse_extras(fn, q_scale=q_scale, sinks=sinks, kv_cache_sf=kv_cache_sf,
                       skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)
        if q_len_per_req not in (None, 1):
            c.refuse(fn, "q_len_per_req", "several rows a request: use BatchPrefillWithPagedKVCacheWrapper",
                     q_len_per_req)
        return self._run(q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, window_left)

    forward = run


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's batch prefill (several query rows a request) over a paged KV cache, on hal."""

    _fn = "flashinfer.BatchPrefillWithPagedKVCacheWrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: Optional[torch.Tensor] = None, paged_kv_indptr_buf: Optional[torch.Tensor] = None,
                 paged_kv_indices_buf: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
                 custom_mask_buf: Optional[torch.Tensor] = None, mask_indptr_buf: Optional[torch.Tensor] = None,
                 backend: str = "auto", jit_args: Optional[List[Any]] = None,
                 jit_kwargs: Optional[Dict[str, Any]] = None, variant_owns_mask: bool = False,
                 max_total_num_rows: Optional[int] = None):
        if jit_args is not None or jit_kwargs is not None:
            c.refuse(self._fn, "jit_args", "custom JIT attention variants have no hal equivalent", jit_args)
        _refuse_extras(self._fn, custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf,
                       variant_owns_mask=variant_owns_mask)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: Optional[int] = None, custom_mask: Optional[torch.Tensor] = None,
             packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type: Union[str, torch.dtype] = "float16",
             kv_data_type: Optional[Union[str, torch.dtype]] = None,
             o_data_type: Optional[Union[str, torch.dtype]] = None, non_blocking: bool = True,
             prefix_len_ptr: Optional[torch.Tensor] = None, token_pos_in_items_ptr: Optional[torch.Tensor] = None,
             token_pos_in_items_len: int = 0, max_item_len_ptr: Optional[torch.Tensor] = None,
             seq_lens: Optional[torch.Tensor] = None, seq_lens_q: Optional[torch.Tensor] = None,
             block_tables: Optional[torch.Tensor] = None, max_token_per_sequence: Optional[int] = None,
             max_sequence_kv: Optional[int] = None, fixed_split_size: Optional[int] = None,
             disable_split_kv: bool = False, uniform_q_len: Optional[int] = None,
             use_token_head_sf: bool = False) -> None:
        fn = self._fn + ".plan"
        if pos_encoding_mode != "NONE":
            c.refuse(fn, "pos_encoding_mode", "rotary or ALiBi inside the kernel has no hal equivalent; apply "
                     "rotary before the call", pos_encoding_mode)
        if head_dim_vo is not None and head_dim_vo != head_dim_qk:
            c.refuse(fn, "head_dim_vo", f"hal's K and V share one head size ({head_dim_qk})", head_dim_vo)
        _refuse_extras(fn, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                       use_fp16_qk_reduction=use_fp16_qk_reduction, prefix_len_ptr=prefix_len_ptr,
                       token_pos_in_items_ptr=token_pos_in_items_ptr, max_item_len_ptr=max_item_len_ptr,
                       seq_lens=seq_lens, seq_lens_q=seq_lens_q, block_tables=block_tables,
                       use_token_head_sf=use_token_head_sf)
        if not isinstance(qo_indptr, torch.Tensor) or qo_indptr.dim() != 1:
            c.fail(fn, "qo_indptr", "a 1-d integer tensor [batch + 1]", c.desc(qo_indptr))
        dev = self._device or paged_kv_indices.device
        tables, lens, max_len = _pages(fn, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, dev)
        qo = qo_indptr.to("cpu", torch.int64)
        max_q = int((qo[1:] - qo[:-1]).max()) if qo.numel() > 1 else 0
        self._plan_batch(tables, lens, max_len, qo_indptr.to(dev, torch.int32), max_q, num_qo_heads=num_qo_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim_qk, page_size=page_size, sm_scale=sm_scale,
                         window_left=window_left, logits_soft_cap=logits_soft_cap, causal=bool(causal))

    def run(self, q: torch.Tensor, paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], *args,
            q_scale: Optional[Union[float, torch.Tensor]] = None, k_scale: Optional[Union[float, torch.Tensor]] = None,
            v_scale: Optional[Union[float, torch.Tensor]] = None, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False, lse_base: str = "log2",
            lse_layout: str = "NH", enable_pdl: Optional[bool] = None, window_left: Optional[int] = None,
            sinks: Optional[torch.Tensor] = None,
            kv_cache_sf: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
            skip_softmax_threshold_scale_factor: Optional[float] = None, use_fp16_softmax: Optional[bool] = None,
            uses_spcompress: Optional[bool] = None):
        """``q`` [qo_indptr[-1], num_qo_heads, head_dim]. Returns ``out`` or ``(out, lse)`` (``lse_layout``
        "NH" [tokens, heads] or "HN" [heads, tokens]; ``lse_base`` "log2" or "ln")."""
        fn = self._fn + ".run"
        if args:
            raise TypeError(f"{fn}() takes no positional arguments after paged_kv_cache (FlashInfer's are "
                            "legacy; pass scales by name)")
        _refuse_extras(fn, q_scale=q_scale, sinks=sinks, kv_cache_sf=kv_cache_sf,
                       skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                       use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress)
        if lse_layout not in ("NH", "HN"):
            c.fail(fn, "lse_layout", "'NH' or 'HN'", repr(lse_layout))
        return self._run(q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, window_left, lse_base, lse_layout)

    forward = run

