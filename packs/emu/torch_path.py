"""The emu pack's vectorised PyTorch path (any device torch runs on).

Decode attention walks the context in chunks of whole blocks (one chunk for short contexts),
gathers the chunk's pages for every sequence at once (:mod:`pages`: FP8 bytes decode exactly
through the encoding's 256-entry table) and merges chunks with an online softmax. There is no Python loop per token or per
block; the number of chunks is bounded by the memory a chunk may take. Scales are folded as the
native kernels fold them: ``scale * k_scale`` multiplies the logits once, ``v_scale`` the output.
"""

from __future__ import annotations

import math

import torch

from hal import fp8

from . import pages

# Elements of float32 K (or V) one chunk may hold: 4 MiB on CPUs (the chunk's K, V and indices stay
# in a core's L2: 55-62 ms at 8x2048 and 32x512 e4m3fn on 2 cores, against 65-87 ms at 16 MiB and
# 71-76 ms at 2 MiB, where the per-chunk overhead grows), 64 MiB on GPUs.
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_CHUNK_ELEMENTS_DEFAULT = 1 << 24


def _per_head(s, hkv: int, device) -> torch.Tensor | float:
    """A scale as float or a tensor broadcastable over [n, hkv, g, *]."""
    if isinstance(s, torch.Tensor):
        return s.to(device=device, dtype=torch.float32).reshape(-1).expand(hkv).reshape(1, hkv, 1, 1)
    return float(s)


def _paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len) -> None:
    n, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    g = h // hkv
    if n == 0:
        return
    dev = query.device
    max_len = max_seq_len  # a host int: resolved once by validation (hal.ops.paged_attention.check)
    lens = seq_lens.to(torch.int64)
    q = query.to(torch.float32).reshape(n, hkv, g, d)
    logit_scale = _per_head(k_scale, hkv, dev)
    logit_scale = logit_scale * scale if isinstance(logit_scale, torch.Tensor) else logit_scale * scale
    first = (lens - sliding_window).clamp_min(0) if sliding_window is not None else torch.zeros_like(lens)
    start_block = (int(first.min()) // bs) if sliding_window is not None else 0
    slopes = alibi_slopes.to(torch.float32).reshape(1, hkv, g, 1) if alibi_slopes is not None else None

    m = torch.full((n, hkv, g), -math.inf, device=dev)
    l = torch.zeros((n, hkv, g), device=dev)
    acc = torch.zeros((n, hkv, g, d), device=dev)
    chunk = _CHUNK_ELEMENTS.get(dev.type, _CHUNK_ELEMENTS_DEFAULT)
    blocks_per_chunk = max(1, chunk // max(1, n * hkv * bs * d))
    total_blocks = (max_len + bs - 1) // bs
    work = pages.workspace(dev)
    for b0 in range(start_block, total_blocks, blocks_per_chunk):
        cols = torch.arange(b0, min(b0 + blocks_per_chunk, total_blocks), device=dev)
        used = cols[None, :] * bs < lens[:, None]
        blocks = torch.where(used, block_tables[:, cols].to(torch.int64), 0)  # unused entries may be junk
        t = cols.numel() * bs
        k = pages.gather(key_cache, blocks, work=work, name="k")
        s = torch.matmul(q, k.transpose(-1, -2)) * logit_scale            # [n, hkv, g, t]
        if logits_soft_cap is not None:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        pos = b0 * bs + torch.arange(t, device=dev)
        if slopes is not None:
            s = s + slopes * (pos[None, :] - (lens[:, None] - 1)).to(torch.float32).reshape(n, 1, 1, t)
        keep = (pos[None, :] < lens[:, None]) & (pos[None, :] >= first[:, None])
        drop = ~keep.reshape(n, 1, t, 1)
        s = s.masked_fill(drop.transpose(-1, -2), -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        # Masked positions must contribute nothing: p = 0 there, but 0 * NaN (any byte can sit in an
        # unused slot, in a block only another sequence uses, or before a window) is NaN.
        v = pages.gather(value_cache, blocks, drop=~keep, work=work, name="v")
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.matmul(p, v)
        m = m_new
    out_scale = _per_head(v_scale, hkv, dev)
    result = acc * out_scale / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    # Only an empty sequence gives zeros; NaN in a query, a key that is read or a slope stays NaN.
    empty = (lens == 0).reshape(n, 1, 1, 1)
    result = result.masked_fill(empty, 0.0)
    out.copy_(result.reshape(n, h, d))


def live_slots(slot_mapping: torch.Tensor, num_slots: int, block_size: int):
    """(keep, block, offset) of the tokens whose slot is in [0, num_slots), or None if there are none.
    Out-of-range slots were rejected by validation where it could look (CPU, HAL_DEBUG); on a GPU
    without HAL_DEBUG they are skipped here, never written out of bounds."""
    keep = (slot_mapping >= 0) & (slot_mapping < num_slots)
    slots = slot_mapping[keep]
    if slots.numel() == 0:
        return None
    return keep, slots // block_size, slots % block_size


def store_rows(cache: torch.Tensor, index: tuple, rows: torch.Tensor, scale: torch.Tensor) -> None:
    """``cache[index] = rows / scale`` in the cache's encoding (hal.fp8.encode_bytes for FP8).
    ``scale`` is a float32 tensor on the rows' device: with a Python float, CUDA torch multiplies by
    the reciprocal, which differs from true division at rounding ties (hal.fp8 defines x / scale)."""
    q = rows / scale
    if fp8.is_fp8(cache.dtype):
        cache.view(torch.uint8)[index] = fp8.encode_bytes(q, cache.dtype)
    else:
        cache[index] = q.to(cache.dtype)


def _cache_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    nb, hkv, bs, d = key_cache.shape
    live = live_slots(slot_mapping, nb * bs, bs)
    if live is None:
        return
    keep, blk, off = live
    for x, cache, s in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = x[keep].to(torch.float32)
        s = torch.as_tensor(s, dtype=torch.float32, device=rows.device).reshape(-1).expand(hkv).reshape(1, hkv, 1)
        store_rows(cache, (blk, slice(None), off), rows, s)


def paged_attention(call) -> None:
    """Run a validated :class:`hal.call.AttentionCall`."""
    _paged_attention(call.out, call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens, call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap, call.sliding_window, call.max_seq_len)


def cache_kv(call) -> None:
    """Run a validated :class:`hal.call.CacheWriteCall`."""
    _cache_kv(call.key, call.value, call.key_cache, call.value_cache, call.slot_mapping, call.k_scale, call.v_scale)
