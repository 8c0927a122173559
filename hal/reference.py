"""A float64 reference for paged attention, for the probe's and the benchmark's correctness checks.

Deliberately plain: one sequence at a time, positions gathered through the block table, FP8 bytes
decoded through :func:`hal.fp8.decode_table` in float64 (that table is tested bit for bit against
ml_dtypes). The test suite keeps its own reference (tests/reference.py) built on ml_dtypes instead,
so the packs are never checked only against code that shares their FP8 decoding.
"""

from __future__ import annotations

import torch

from hal import fp8


def _rows(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The cache rows at (blocks, offsets) as float64 [len, num_kv_heads, head_size], on the cache's
    device; FP8 bytes decoded through the bit-layout table (not torch's casts)."""
    if fp8.is_fp8(cache.dtype):
        raw = cache.view(torch.uint8)[blocks, :, offsets]
        return fp8.decode_table(cache.dtype, torch.float64, cache.device)[raw.to(torch.int64)]
    return cache[blocks, :, offsets].to(torch.float64)


def _per_head(s, hkv: int, device) -> torch.Tensor:
    if isinstance(s, torch.Tensor):
        return s.detach().to(device=device, dtype=torch.float64).reshape(-1).expand(hkv)
    return torch.full((hkv,), 1.0 if s is None else float(s), dtype=torch.float64, device=device)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, k_scale=None,
                    v_scale=None, alibi_slopes=None, logits_soft_cap=None, sliding_window=None,
                    sequences=None) -> torch.Tensor:
    """float64 [num_seqs, num_heads, head_size] on the query's device; only the pages each sequence
    uses are read, so it scales to large caches (rows not in ``sequences`` stay zero)."""
    dev = query.device
    q = query.detach().to(torch.float64)
    n, h, d = q.shape
    hkv, bs = key_cache.shape[1], key_cache.shape[2]
    g = h // hkv
    ks, vs = _per_head(k_scale, hkv, dev), _per_head(v_scale, hkv, dev)
    sm = d ** -0.5 if scale is None else scale
    lens = seq_lens.cpu().to(torch.int64)
    slopes = None if alibi_slopes is None else alibi_slopes.detach().to(dev, torch.float64)
    out = torch.zeros((n, h, d), dtype=torch.float64, device=dev)
    for i in (range(n) if sequences is None else sequences):
        length = int(lens[i])
        lo = 0 if sliding_window is None else max(0, length - sliding_window)
        pos = torch.arange(lo, length, device=dev)
        if pos.numel() == 0:
            continue
        blocks, offs = block_tables[i].to(torch.int64)[pos // bs], pos % bs
        keys = _rows(key_cache, blocks, offs) * ks[None, :, None]          # [len, hkv, d]
        vals = _rows(value_cache, blocks, offs) * vs[None, :, None]
        qi = q[i].view(hkv, g, d)
        logits = torch.einsum("hgd,thd->hgt", qi, keys) * sm              # [hkv, g, len]
        if logits_soft_cap is not None:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        if slopes is not None:
            logits = logits + slopes.view(hkv, g, 1) * (pos - (length - 1)).to(torch.float64)
        w = torch.softmax(logits, dim=-1)
        out[i] = torch.einsum("hgt,thd->hgd", w, vals).reshape(h, d)
    return out


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().to(torch.float64), b.detach().cpu().to(torch.float64)
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff
