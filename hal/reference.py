"""A float64 reference for paged attention, for the probe's and the benchmark's correctness checks.

Deliberately plain: one sequence at a time, positions gathered through the block table, FP8 bytes
decoded through :func:`hal.fp8.decode_table` in float64 (that table is tested bit for bit against
ml_dtypes). The test suite keeps its own reference (tests/reference.py) built on ml_dtypes instead,
so the packs are never checked only against code that shares their FP8 decoding.
"""

from __future__ import annotations

import torch

from hal import fp8


def cache_values(cache: torch.Tensor) -> torch.Tensor:
    """The numbers a cache holds (before any scale) as float64 on the CPU."""
    c = cache.detach().cpu()
    if fp8.is_fp8(c.dtype):
        return fp8.decode_table(c.dtype, torch.float64)[c.view(torch.uint8).to(torch.int64)]
    return c.to(torch.float64)


def _per_head(s, hkv: int) -> torch.Tensor:
    if isinstance(s, torch.Tensor):
        return s.detach().cpu().to(torch.float64).reshape(-1).expand(hkv)
    return torch.full((hkv,), 1.0 if s is None else float(s), dtype=torch.float64)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, k_scale=None,
                    v_scale=None, alibi_slopes=None, logits_soft_cap=None, sliding_window=None,
                    sequences=None) -> torch.Tensor:
    """float64 [num_seqs, num_heads, head_size] on the CPU (rows not in ``sequences`` stay zero)."""
    q = query.detach().cpu().to(torch.float64)
    n, h, d = q.shape
    kv, vv = cache_values(key_cache), cache_values(value_cache)
    hkv, bs = kv.shape[1], kv.shape[2]
    g = h // hkv
    ks, vs = _per_head(k_scale, hkv), _per_head(v_scale, hkv)
    sm = d ** -0.5 if scale is None else scale
    tables, lens = block_tables.cpu().to(torch.int64), seq_lens.cpu().to(torch.int64)
    slopes = None if alibi_slopes is None else alibi_slopes.detach().cpu().to(torch.float64)
    out = torch.zeros((n, h, d), dtype=torch.float64)
    for i in (range(n) if sequences is None else sequences):
        length = int(lens[i])
        lo = 0 if sliding_window is None else max(0, length - sliding_window)
        pos = torch.arange(lo, length)
        if pos.numel() == 0:
            continue
        blocks, offs = tables[i, pos // bs], pos % bs
        keys = kv[blocks, :, offs] * ks[None, :, None]          # [len, hkv, d]
        vals = vv[blocks, :, offs] * vs[None, :, None]
        qi = q[i].view(hkv, g, d)
        logits = torch.einsum("hgd,thd->hgt", qi, keys) * sm    # [hkv, g, len]
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
