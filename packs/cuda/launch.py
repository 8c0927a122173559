"""Host side of the cuda pack: choose the split of the context, allocate the workspace, launch.

Thin on purpose: validation happened in hal (hal/ops/, into the call record), the kernels live in csrc/.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import _C
from .tuning import mla_split, shape_class, split, tuning_for, warp_rows

KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
INPUTS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# Query heads per CTA: 16 (two 8-head MMA tiles sharing each K/V fragment) for 16-bit caches; 8 for
# FP8, where the lighter one-tile kernel wins even though a GQA group above 8 then has each KV page
# read by two CTAs (the second read mostly hits L2). H200, 2026-11-29, GQA 16 and 20: FP8 1.2-1.6x
# faster with 8; bf16 1.0-1.15x faster with 16 (docs/cuda.md).
HEAD_TILE = {1: 8, 2: 16}  # by cache element size


@functools.cache
def _device_facts(index: int) -> tuple[int, str]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, f"sm_{props.major}{props.minor}"


def plan(num_seqs: int, num_kv_heads: int, head_tiles: int, max_len: int, device: torch.device,
         cache_dtype: torch.dtype, one_tile: bool = True) -> tuple[int, int, bool]:
    """(partition_size, num_parts, warp_rows) for a call, from this GPU's tuning entry (see
    tuning.split and tuning.warp_rows). ``one_tile``: a CTA serves one 8-head MMA tile (warp rows
    need it)."""
    sms, arch = _device_facts(device.index if device.index is not None else torch.cuda.current_device())
    params = tuning_for(arch, shape_class(cache_dtype, max_len))
    rows = num_seqs * num_kv_heads * head_tiles
    size, parts = split(rows, max_len, sms, params)
    return size, parts, one_tile and parts == 1 and warp_rows(rows, sms, params)


def _on(device: torch.device):
    """(device guard, raw current stream) for a launch on ``device``: the guard switches devices only
    when needed, and the stream is read without torch.cuda.current_stream's Python layers (they cost
    ~10 us a call on the H200 host, a tenth of hal's per-call overhead)."""
    cur = torch.cuda.current_device()
    index = device.index if device.index is not None else cur
    guard = contextlib.nullcontext() if index == cur else torch.cuda.device(index)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    stream = raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
    return guard, stream


def _scale(s) -> tuple[float, int, int]:
    """(value, pointer, stride) for the kernels: a float, or a device tensor (0-d: stride 0)."""
    if isinstance(s, torch.Tensor):
        return 1.0, s.data_ptr(), 1 if s.dim() == 1 else 0
    return float(s), 0, 0


def _paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len) -> None:
    n, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    if n == 0:
        return
    dev = query.device
    head_tiles = -(-(h // hkv) // HEAD_TILE[key_cache.element_size()])
    max_len = max_seq_len  # a host int: resolved once by validation (hal.ops.paged_attention.check)
    size, parts, wrows = plan(n, hkv, head_tiles, max_len, dev, key_cache.dtype, one_tile=head_tiles * 8 >= h // hkv)
    if parts > 1:
        part_out = torch.empty((n, h, parts, d), dtype=torch.float32, device=dev)
        part_ml = torch.empty((n, h, parts, 2), dtype=torch.float32, device=dev)
        ws = (part_out.data_ptr(), part_ml.data_ptr())
    else:
        ws = (0, 0)
    ks, ksp, kss = _scale(k_scale)
    vs, vsp, vss = _scale(v_scale)
    elem = key_cache.element_size()
    guard, stream = _on(dev)
    with guard:
        _C.paged_attention(
            KINDS[key_cache.dtype], d, out.data_ptr(), query.data_ptr(), key_cache.data_ptr(),
            value_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
            0 if alibi_slopes is None else alibi_slopes.data_ptr(), ksp, vsp, *ws,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0) * elem,
            value_cache.stride(0) * elem, block_tables.stride(0), scale, ks, vs,
            0.0 if logits_soft_cap is None else float(logits_soft_cap), kss, vss, n, h, hkv, head_tiles, bs,
            size, parts, 0 if sliding_window is None else sliding_window, int(query.dtype == torch.bfloat16),
            int(wrows), stream)


def _cache_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    nb, hkv, bs, d = key_cache.shape
    ks, ksp, kss = _scale(k_scale)
    vs, vsp, vss = _scale(v_scale)
    elem = key_cache.element_size()
    dev = key.device
    guard, stream = _on(dev)
    with guard:
        _C.cache_kv(KINDS[key_cache.dtype], INPUTS[key.dtype], key.data_ptr(), value.data_ptr(),
                    key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), ksp, vsp,
                    key.stride(0), key.stride(1), value.stride(0), value.stride(1), key_cache.stride(0) * elem,
                    value_cache.stride(0) * elem, ks, vs, kss, vss, key.shape[0], hkv, d, bs, nb, stream)


def paged_attention(call) -> None:
    """Run a validated :class:`hal.call.AttentionCall`."""
    _paged_attention(call.out, call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens, call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap, call.sliding_window, call.max_seq_len)


def cache_kv(call) -> None:
    """Run a validated :class:`hal.call.CacheWriteCall`."""
    _cache_kv(call.key, call.value, call.key_cache, call.value_cache, call.slot_mapping, call.k_scale, call.v_scale)


def _rows16(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` (unit last stride) with 16-byte aligned rows for the MLA kernel's vector loads; a copy
    only for an unusual view."""
    if t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
        return t.contiguous()
    return t


def _cache_strides(c: torch.Tensor, name: str) -> tuple[int, int]:
    """(block stride, token stride) in bytes of an MLA cache; its rows must be 16-byte aligned."""
    e = c.element_size()
    bs, ts = c.stride(0) * e, c.stride(1) * e
    if c.data_ptr() % 16 or bs % 16 or ts % 16:
        raise ValueError(f"hal.mla_decode (cuda pack): {name} needs 16-byte aligned token rows (data pointer, block "
                         f"and token strides multiples of 16 bytes); got pointer %16 = {c.data_ptr() % 16}, strides "
                         f"{c.stride()} x {e} bytes. Pass pack='emu' for such a view.")
    return bs, ts


MLA_ROW_GROUPS = ((16, 1), (32, 2))  # rows a sequence -> MMA row groups a CTA (else 4: 64 rows)


def mla_decode(call) -> None:
    """Run a validated :class:`hal.call.MLACall` (R = 512, P = 64: the pack's declaration)."""
    total_q, h, r = call.q_nope.shape
    n = call.seq_lens.shape[0]
    if total_q == 0 or n == 0:
        return
    dev = call.q_nope.device
    rows = call.max_query_len * h
    groups = next((g for limit, g in MLA_ROW_GROUPS if rows <= limit), 4)
    row_tiles = -(-rows // (16 * groups))
    sms, _ = _device_facts(dev.index if dev.index is not None else torch.cuda.current_device())
    size, parts = mla_split(n * row_tiles, call.max_seq_len, sms)
    if parts > 1:
        part_out = torch.empty((total_q, h, parts, r), dtype=torch.float32, device=dev)
        part_ml = torch.empty((total_q, h, parts, 2), dtype=torch.float32, device=dev)
        ws = (part_out.data_ptr(), part_ml.data_ptr())
    else:
        ws = (0, 0)
    qn, qp = _rows16(call.q_nope, "q_nope"), _rows16(call.q_pe, "q_pe")
    out = call.out if _rows16(call.out, "out") is call.out else torch.empty_like(call.q_nope)
    cbs, cts = _cache_strides(call.ckv_cache, "ckv_cache")
    pbs, pts = _cache_strides(call.kpe_cache, "kpe_cache")
    cs, csp, _ = _scale(call.ckv_scale)
    ps, psp, _ = _scale(call.kpe_scale)
    qsl = call.query_start_loc
    guard, stream = _on(dev)
    with guard:
        _C.mla_decode(
            KINDS[call.ckv_cache.dtype], groups, out.data_ptr(), qn.data_ptr(), qp.data_ptr(),
            call.ckv_cache.data_ptr(), call.kpe_cache.data_ptr(), call.block_tables.data_ptr(),
            call.seq_lens.data_ptr(), 0 if qsl is None else qsl.data_ptr(), csp, psp, *ws, qn.stride(0), qn.stride(1),
            qp.stride(0), qp.stride(1), out.stride(0), out.stride(1), cbs, cts, pbs, pts, call.block_tables.stride(0),
            call.scale, cs, ps, n, h, total_q, call.ckv_cache.shape[1], size, parts, row_tiles,
            int(qn.dtype == torch.bfloat16), stream)
    if out is not call.out:
        call.out.copy_(out)


def cache_mla(call) -> None:
    """Run a validated :class:`hal.call.MLAWriteCall`: the latent and the rotary part, one launch each."""
    nb, bs, _ = call.ckv_cache.shape
    guard, stream = _on(call.kv_c.device)
    with guard:
        for src, cache, s in ((call.kv_c, call.ckv_cache, call.ckv_scale), (call.k_pe, call.kpe_cache, call.kpe_scale)):
            e = cache.element_size()
            value, sp, _ = _scale(s)
            _C.cache_rows(KINDS[cache.dtype], INPUTS[src.dtype], src.data_ptr(), cache.data_ptr(),
                          call.slot_mapping.data_ptr(), sp, src.stride(0), cache.stride(0) * e, cache.stride(1) * e,
                          value, src.shape[0], src.shape[1], bs, nb, stream)
