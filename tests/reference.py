"""An independent float64 reference for paged attention and cache writes.

Written apart from every pack: FP8 bytes are decoded with ``ml_dtypes`` (not hal.fp8), each
sequence is handled on its own with a plain loop over its tokens' pages, and softmax is the
textbook one in float64. Slow and obvious on purpose.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

_ML = {
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
}


def cache_values(cache: torch.Tensor) -> np.ndarray:
    """The numbers a cache holds, before any scale, as float64 (FP8 via ml_dtypes)."""
    c = cache.detach().cpu()
    if c.dtype in _ML:
        return c.view(torch.uint8).numpy().view(_ML[c.dtype]).astype(np.float64)
    return c.to(torch.float64).numpy()


def _per_head(s, hkv: int) -> np.ndarray:
    if isinstance(s, torch.Tensor):
        return np.broadcast_to(s.detach().cpu().to(torch.float64).numpy().reshape(-1), (hkv,)).copy()
    return np.full(hkv, 1.0 if s is None else float(s))


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, k_scale=None,
                    v_scale=None, alibi_slopes=None, logits_soft_cap=None, sliding_window=None) -> np.ndarray:
    """float64 [num_seqs, num_heads, head_size]."""
    q = query.detach().cpu().to(torch.float64).numpy()
    n, h, d = q.shape
    kv = cache_values(key_cache)
    vv = cache_values(value_cache)
    hkv, bs = kv.shape[1], kv.shape[2]
    g = h // hkv
    ks, vs = _per_head(k_scale, hkv), _per_head(v_scale, hkv)
    sm = d ** -0.5 if scale is None else scale
    tables = block_tables.cpu().numpy()
    lens = seq_lens.cpu().numpy()
    slopes = None if alibi_slopes is None else alibi_slopes.detach().cpu().to(torch.float64).numpy()
    out = np.zeros((n, h, d))
    for i in range(n):
        L = int(lens[i])
        lo = 0 if sliding_window is None else max(0, L - sliding_window)
        positions = np.arange(lo, L)
        if positions.size == 0:
            continue
        blocks = tables[i, positions // bs]
        offsets = positions % bs
        for head in range(h):
            kvh = head // g
            keys = kv[blocks, kvh, offsets] * ks[kvh]          # [len, d]
            vals = vv[blocks, kvh, offsets] * vs[kvh]
            logits = keys @ q[i, head] * sm
            if logits_soft_cap is not None:
                logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
            if slopes is not None:
                logits = logits + slopes[head] * (positions - (L - 1))
            w = np.exp(logits - logits.max())
            out[i, head] = (w / w.sum()) @ vals
    return out


def paged_attention_varlen(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *, causal=True,
                           scale=None, k_scale=None, v_scale=None, alibi_slopes=None, logits_soft_cap=None,
                           sliding_window=None) -> np.ndarray:
    """float64 [total_q, num_heads, head_size]: several query tokens per sequence.

    Sequence i owns query rows qsl[i] .. qsl[i+1]-1; row t of its q_len rows sits at position
    p = L - q_len + t (bottom-right aligned). It attends to keys j <= p (causal) or j < L (not
    causal), and with a window w only to j > p - w. ALiBi adds slope_h * (j - p) after the soft-cap.
    One row and one head at a time, over exactly the keys it keeps (for q_len 1 the operations of
    :func:`paged_attention`, so decode rows give its numbers)."""
    q = query.detach().cpu().to(torch.float64).numpy()
    total_q, h, d = q.shape
    kv = cache_values(key_cache)
    vv = cache_values(value_cache)
    hkv, bs = kv.shape[1], kv.shape[2]
    g = h // hkv
    ks, vs = _per_head(k_scale, hkv), _per_head(v_scale, hkv)
    sm = d ** -0.5 if scale is None else scale
    tables = block_tables.cpu().numpy()
    lens = seq_lens.cpu().numpy()
    qsl = query_start_loc.cpu().numpy()
    slopes = None if alibi_slopes is None else alibi_slopes.detach().cpu().to(torch.float64).numpy()
    out = np.zeros((total_q, h, d))
    for i in range(len(lens)):
        L = int(lens[i])
        q_len = int(qsl[i + 1]) - int(qsl[i])
        for t in range(q_len):
            row = int(qsl[i]) + t
            p = L - q_len + t
            hi = p + 1 if causal else L
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            positions = np.arange(lo, hi)
            blocks = tables[i, positions // bs]
            offsets = positions % bs
            for head in range(h):
                kvh = head // g
                keys = kv[blocks, kvh, offsets] * ks[kvh]      # [len, d]
                vals = vv[blocks, kvh, offsets] * vs[kvh]
                logits = keys @ q[row, head] * sm
                if logits_soft_cap is not None:
                    logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
                if slopes is not None:
                    logits = logits + slopes[head] * (positions - p)
                w = np.exp(logits - logits.max())
                out[row, head] = (w / w.sum()) @ vals
    return out


def quantize(x: torch.Tensor, dtype: torch.dtype, scale=1.0) -> np.ndarray:
    """Reference FP8 write: float32 x / scale, then ml_dtypes' round-to-nearest-even, with the
    saturation hal promises applied explicitly (ml_dtypes itself overflows to NaN/inf)."""
    s = scale.detach().cpu().numpy().reshape(1, -1, 1) if isinstance(scale, torch.Tensor) else np.float32(scale)
    q = (x.detach().cpu().to(torch.float32).numpy() / s).astype(np.float32)
    fmax = float(ml_dtypes.finfo(_ML[dtype]).max)
    nan = np.isnan(q)
    with np.errstate(invalid="ignore"):
        out = np.where(nan, 0, np.clip(q, -fmax, fmax)).astype(_ML[dtype]).view(np.uint8)
    # hal's NaN byte (its choice, documented in docs/semantics.md): 0x80 for fnuz, else 0x7f as
    # NVIDIA's saturating conversion writes (ml_dtypes would give 0x7e for e5m2)
    return np.where(nan, np.uint8(0x80 if dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) else 0x7F), out)


def relative_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / denom) if denom > 0 else float(np.linalg.norm(a - b))


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) if np.size(a) else 0.0


__all__ = ["cache_values", "paged_attention", "paged_attention_varlen", "quantize", "relative_l2", "max_abs", "math"]


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, query_start_loc=None, *, scale,
               ckv_scale=None, kpe_scale=None) -> np.ndarray:
    """float64 [total_q, num_heads, R]: MLA in its absorbed form (design.md). Row t of a sequence's
    q_len rows sits at position L - q_len + t and sees keys j <= that position;
    s_j = (q_nope . c_j * ckv_scale + q_pe . kpe_j * kpe_scale) * scale, out = ckv_scale * softmax(s) @ c."""
    qn = q_nope.detach().cpu().to(torch.float64).numpy()
    qp = q_pe.detach().cpu().to(torch.float64).numpy()
    c = cache_values(ckv_cache) * (1.0 if ckv_scale is None else float(ckv_scale))   # [nb, bs, R]
    kp = cache_values(kpe_cache) * (1.0 if kpe_scale is None else float(kpe_scale))   # [nb, bs, P]
    bs = c.shape[1]
    tables = block_tables.cpu().numpy()
    lens = seq_lens.cpu().numpy()
    n = len(lens)
    qsl = np.arange(n + 1) if query_start_loc is None else query_start_loc.cpu().numpy()
    out = np.zeros(qn.shape)
    for i in range(n):
        L, q0, q1 = int(lens[i]), int(qsl[i]), int(qsl[i + 1])
        for r in range(q0, q1):
            p = L - (q1 - q0) + (r - q0)
            positions = np.arange(0, p + 1)
            if positions.size == 0:
                continue
            blocks, offsets = tables[i, positions // bs], positions % bs
            cj, kj = c[blocks, offsets], kp[blocks, offsets]              # [t, R], [t, P]
            s = (qn[r] @ cj.T + qp[r] @ kj.T) * scale                     # [h, t]
            s = s - s.max(axis=-1, keepdims=True)
            w = np.exp(s)
            w /= w.sum(axis=-1, keepdims=True)
            out[r] = w @ cj
    return out
