"""The emu pack's PyTorch path for several query tokens per sequence (prefill, chunked prefill, mixed
batches: ``query_start_loc``), on any device torch runs on; built for CPUs.

Semantics (docs/semantics.md, "Several query tokens per sequence"): sequence ``i`` owns query rows
``qsl[i] .. qsl[i+1]-1``; row ``t`` of its ``q_len`` rows sits at position ``p = L - q_len + t``
(bottom-right aligned). Causal keeps keys ``j <= p``, ``causal=False`` every ``j < L``; a window ``w``
keeps ``j > p - w``; ALiBi adds ``slope_h * (j - p)`` after the soft-cap.

Entry points: ``paged_attention(call)`` (a validated ``hal.call.AttentionCall`` with
``query_start_loc``) and ``paged_attention_varlen(out, query, ..., query_start_loc, max_query_len,
causal)`` on plain arguments. The batch is planned on the host from ``query_start_loc`` and
``seq_lens`` (one small copy of each: free on a CPU, one sync on a GPU; ``max_seq_len`` is not
needed, and ``max_query_len == 1`` with one row per sequence skips reading ``query_start_loc``),
then split by ``q_len``:

- ``q_len == 1`` (decode rows): batched exactly as ``torch_path.paged_attention`` batches decode
  (the same operations on the same shapes, so the same bits; tested), only with a faster FP8
  decode. A call with one row per sequence (``max_query_len == 1`` and ``total_q == num_seqs``)
  does not read ``query_start_loc``.
- ``2 <= q_len <= _SHORT_MAX`` (speculative decoding, short chunks): batched like decode, every
  sequence of a bucket padded to the bucket's row count (2, 4, 8, ...), its pages gathered for all
  those sequences at once per chunk of whole blocks.
- longer ``q_len``: one sequence at a time. Its pages are decoded once per chunk of whole blocks (the
  whole read range when it fits ``_CHUNK_ELEMENTS``); tiles of query rows (``_TILE_ROWS`` rows of
  query heads, a KV group's heads of consecutive tokens) meet sub-tiles of ``_TILE_KEYS`` keys,
  restricted to the keys the tile's rows can see (causal and window tiles skip the rest), with an
  online softmax (m, l, acc in float32). Masks are built only for sub-tiles that cross the
  diagonal or a window edge.

Precision as in torch_path: float32 arithmetic, the query cast to float32, pages read and FP8
decoded exactly by :mod:`pages` (as torch_path); ``scale * k_scale`` multiplies the logits once (on the long path it is folded into the
float32 query, one multiply per query element), ``v_scale`` the output once.

Masked positions contribute exactly nothing. Positions outside every row's read set are never
multiplied (sliced away, or zeroed in V on the batched paths, as in torch_path). A position inside
a tile that some rows read and others mask (the causal band, a window edge) normally holds a finite
V; where it does not (a NaN produced by the model for a new token), P @ V would turn the masked
rows' ``0 * NaN`` into NaN, so V's non-finite elements are zeroed for the product and added back
exactly, only into the rows that keep them (one ``isfinite`` check per chunk decides; rare).
A NaN in a query, a read key or a slope gives NaN in the rows it takes part in (no ``l > 0`` guard).
"""

from __future__ import annotations

import math

import torch

from . import pages

# Elements of float32 K (or V) one chunk may hold (as torch_path): 16 MiB on CPUs, 64 MiB elsewhere.
_CHUNK_ELEMENTS = {"cpu": 1 << 22}
_CHUNK_ELEMENTS_DEFAULT = 1 << 24
# Long path tiles: query-head rows (tokens x heads of one KV group) and keys per logits tile; the
# logits tile is num_kv_heads x _TILE_ROWS x _TILE_KEYS float32 (4 MiB for 8 KV heads).
_TILE_ROWS = 256
_TILE_KEYS = 512
# Sequences with at most this many rows run batched (bucketed by powers of two), longer ones in tiles.
_SHORT_MAX = 8
# Elements of the temporary [.., rows, nb, head_size] product when V holds non-finite values.
_FIX_ELEMENTS = 1 << 22


def _per_head(s, hkv: int, device) -> torch.Tensor | float:
    """A scale as a float or a float32 tensor broadcastable over [n, hkv, rows, *] (torch_path's)."""
    if s is None:
        return 1.0
    if isinstance(s, torch.Tensor):
        return s.to(device=device, dtype=torch.float32).reshape(-1).expand(hkv).reshape(1, hkv, 1, 1)
    return float(s)


def _logit_scale(scale: float, k_scale, hkv: int, device) -> torch.Tensor | float:
    return _per_head(k_scale, hkv, device) * scale


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Pages ``blocks`` [..., nblk] of ``cache`` as float32 [..., hkv, nblk * bs, d] (:mod:`pages`)."""
    return pages.gather(cache, blocks)


def _finite_part(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(v), v, torch.zeros((), dtype=v.dtype, device=v.device))


def _add_nonfinite(acc5: torch.Tensor, p5: torch.Tensor, keep5, v: torch.Tensor) -> None:
    """acc5 [..., R, g, d] += sum over positions j where V is not finite of keep * p_j * v_j,
    exactly (a kept position's inf/NaN reaches its row, a masked one reaches none).
    p5 [..., R, g, T]; keep5 None (all kept) or bool broadcastable to [..., R, 1, T]; v [..., T, d]
    with the same leading dims as p5."""
    bad = ~torch.isfinite(v)
    idx = bad.reshape(-1, v.shape[-2], v.shape[-1]).any(dim=-1).any(dim=0).nonzero().reshape(-1)
    if idx.numel() == 0:
        return
    per = max(1, _FIX_ELEMENTS // max(1, p5[..., :1].numel() * v.shape[-1]))
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    for i0 in range(0, idx.numel(), per):
        sel = idx[i0:i0 + per]
        vb = v.index_select(-2, sel)
        vb = torch.where(torch.isfinite(vb), zero, vb)                      # only the non-finite entries
        prod = p5.index_select(-1, sel)[..., None] * vb[..., None, None, :, :]   # [..., R, g, nb, d]
        if keep5 is not None:
            kb = keep5.index_select(-1, sel)[..., None]
            prod = torch.where(kb, prod, zero)
        acc5 += prod.sum(dim=-2)


def paged_attention_varlen(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                           alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, query_start_loc,
                           max_query_len, causal, lse=None) -> None:
    """Writes ``out`` [total_q, num_heads, head_size] in place (see the module docstring), and with
    ``lse`` (float32 [total_q, num_heads]) each row's natural-log log-sum-exp of its logits."""
    total_q, h, d = query.shape
    n = seq_lens.shape[0]
    if total_q == 0 or n == 0:
        return
    if scale is None:
        scale = d ** -0.5
    feats = (scale, k_scale, v_scale, alibi_slopes, logits_soft_cap, sliding_window)
    if lse is not None:
        lse.fill_(-math.inf)  # rows no tile reaches (none today) stay -inf
    lens = seq_lens.to("cpu", torch.int64)
    if max_query_len is not None and max_query_len <= 1 and total_q == n:
        qsl = torch.arange(n + 1)            # one row per sequence: decode, query_start_loc not read
    else:
        qsl = query_start_loc.to("cpu", torch.int64)
    qlen = qsl[1:] - qsl[:-1]

    lo_r, rq = 1, 1
    while lo_r <= _SHORT_MAX:  # buckets of q_len: 1, 2, 3..4, 5..8, ... (rows padded to the bucket's top)
        hi_r = min(rq, _SHORT_MAX)
        bucket = ((qlen >= lo_r) & (qlen <= hi_r)).nonzero().reshape(-1)
        if bucket.numel():
            _short(out, query, key_cache, value_cache, block_tables, bucket, qsl, lens, qlen, hi_r,
                   *feats, causal, lse)
        lo_r, rq = hi_r + 1, 2 * rq

    for i in (qlen > _SHORT_MAX).nonzero().reshape(-1).tolist():
        _long(out, query, key_cache, value_cache, block_tables[i], int(qsl[i]), int(qlen[i]), int(lens[i]),
              *feats, causal, lse)


def _short(out, query, key_cache, value_cache, block_tables, seqs, qsl, lens, qlen, rq, scale, k_scale, v_scale,
           alibi_slopes, logits_soft_cap, sliding_window, causal, lse=None) -> None:
    """Sequences ``seqs`` (host int64) with 1..rq rows each, batched as torch_path batches decode:
    rows padded to ``rq`` per sequence, laid out (token, head of the group) per KV head. For rq == 1
    these are torch_path's operations on the same shapes (its bits), with a faster FP8 decode."""
    dev = query.device
    _, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    g = h // hkv
    ns = seqs.numel()
    L_h, ql_h, q0_h = lens[seqs], qlen[seqs], qsl[seqs]
    t_ar = torch.arange(rq)
    valid_h = t_ar[None, :] < ql_h[:, None]                                   # [ns, rq]
    rows_h = torch.where(valid_h, q0_h[:, None] + t_ar, q0_h[:, None])        # padding repeats row 0
    first_h = (L_h - ql_h - sliding_window + 1).clamp_min(0) if sliding_window is not None else torch.zeros_like(L_h)
    start_block = int(first_h.min()) // bs
    total_blocks = (int(L_h.max()) + bs - 1) // bs

    lens_d = L_h.to(dev)
    first = first_h.to(dev)
    P = (L_h[:, None] - ql_h[:, None] + t_ar).to(dev)                          # [ns, rq] positions
    rows = rows_h.to(dev)
    tables = block_tables.index_select(0, seqs.to(dev))
    q = query.index_select(0, rows.reshape(-1)).to(torch.float32)
    q = q.reshape(ns, rq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(ns, hkv, rq * g, d)
    logit_scale = _logit_scale(scale, k_scale, hkv, dev)
    slopes = alibi_slopes.to(torch.float32).reshape(1, hkv, 1, g, 1) if alibi_slopes is not None else None

    m = torch.full((ns, hkv, rq * g), -math.inf, device=dev)
    l = torch.zeros((ns, hkv, rq * g), device=dev)
    acc = torch.zeros((ns, hkv, rq * g, d), device=dev)
    chunk = _CHUNK_ELEMENTS.get(dev.type, _CHUNK_ELEMENTS_DEFAULT)
    blocks_per_chunk = max(1, chunk // max(1, ns * hkv * bs * max(d, rq * g)))
    for b0 in range(start_block, total_blocks, blocks_per_chunk):
        cols = torch.arange(b0, min(b0 + blocks_per_chunk, total_blocks), device=dev)
        used = cols[None, :] * bs < lens_d[:, None]
        blocks = torch.where(used, tables[:, cols].to(torch.int64), 0)       # unused entries may be junk
        t = cols.numel() * bs
        k = _gather(key_cache, blocks)                     # [ns, hkv, t, d]
        s = torch.matmul(q, k.transpose(-1, -2)) * logit_scale              # [ns, hkv, rq*g, t]
        if logits_soft_cap is not None:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        pos = b0 * bs + torch.arange(t, device=dev)
        s5 = s.view(ns, hkv, rq, g, t)
        if slopes is not None:
            s5 = s5 + slopes * (pos[None, None, :] - P[:, :, None]).to(torch.float32).reshape(ns, 1, rq, 1, t)
        keep = (pos[None, None, :] < lens_d[:, None, None]).expand(ns, rq, t)  # [ns, rq, t]
        if causal:
            keep = keep & (pos[None, None, :] <= P[:, :, None])
        if sliding_window is not None:
            keep = keep & (pos[None, None, :] > P[:, :, None] - sliding_window)
        keep5 = keep.reshape(ns, 1, rq, 1, t)
        s5 = s5.masked_fill(~keep5, -math.inf)
        s = s5.reshape(ns, hkv, rq * g, t)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        # Positions no row of a sequence reads: zero V, as torch_path does (0 * NaN is NaN).
        read = (pos[None, :] < lens_d[:, None]) & (pos[None, :] >= first[:, None])
        v = _gather(value_cache, blocks).masked_fill_(~read.reshape(ns, 1, t, 1), 0.0)
        l = l * alpha + p.sum(dim=-1)
        if rq == 1 or bool(torch.isfinite(v).all()):   # one row per sequence: nothing read is masked
            acc = acc * alpha[..., None] + torch.matmul(p, v)
        else:  # a non-finite V some rows read and others mask (the causal band)
            acc = acc * alpha[..., None] + torch.matmul(p, _finite_part(v))
            _add_nonfinite(acc.view(ns, hkv, rq, g, d), p.view(ns, hkv, rq, g, t), keep5, v)
        m = m_new
    out_scale = _per_head(v_scale, hkv, dev)
    result = acc * out_scale / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    result = result.view(ns, hkv, rq, g, d).permute(0, 2, 1, 3, 4).reshape(ns, rq, h, d)
    valid = valid_h.to(dev)
    out.index_copy_(0, rows[valid], result[valid].to(out.dtype))
    if lse is not None:  # m + log l in logit units (natural log); -inf where no key took part
        rl = (m + torch.log(l)).masked_fill(l == 0, -math.inf)
        rl = rl.view(ns, hkv, rq, g).permute(0, 2, 1, 3).reshape(ns, rq, h)
        lse.index_copy_(0, rows[valid], rl[valid])


def _long(out, query, key_cache, value_cache, table, q0: int, ql: int, L: int, scale, k_scale, v_scale,
          alibi_slopes, logits_soft_cap, sliding_window, causal, lse=None) -> None:
    """One sequence's ``ql`` rows (query rows q0.., context L) in tiles against its decoded pages."""
    dev = query.device
    _, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    g = h // hkv
    w = sliding_window
    lo_seq = max(0, L - ql - w + 1) if w is not None else 0                   # first key any row reads
    logit_scale = _logit_scale(scale, k_scale, hkv, dev)
    ls = logit_scale.reshape(hkv, 1, 1, 1) if isinstance(logit_scale, torch.Tensor) else logit_scale
    q = torch.empty((hkv, ql, g, d), dtype=torch.float32, device=dev)
    q.copy_(query[q0:q0 + ql].view(ql, hkv, g, d).permute(1, 0, 2, 3)).mul_(ls)   # widen + head-major, one pass
    q = q.view(hkv, ql * g, d)
    slopes = None if alibi_slopes is None else alibi_slopes.to(device=dev, dtype=torch.float32).reshape(hkv, 1, g, 1)
    cap = logits_soft_cap

    R = max(1, _TILE_ROWS // g)
    tiles = []  # (rows, positions, keys it sees, its own contiguous m, l, acc)
    for r0 in range(0, ql, R):
        r1 = min(r0 + R, ql)
        P0, P1 = L - ql + r0, L - ql + r1 - 1
        lo_t = max(0, P0 - w + 1) if w is not None else 0
        state = (torch.full((hkv, r1 - r0, g), -math.inf, device=dev), torch.zeros((hkv, r1 - r0, g), device=dev),
                 torch.zeros((hkv, (r1 - r0) * g, d), device=dev))
        tiles.append((r0, r1, P0, P1, lo_t, P1 + 1 if causal else L, state))
    chunk = _CHUNK_ELEMENTS.get(dev.type, _CHUNK_ELEMENTS_DEFAULT)
    per = max(1, chunk // (hkv * d * bs)) * bs                                 # positions per chunk
    kt = _TILE_KEYS
    for c0 in range(lo_seq // bs * bs, L, per):
        c1 = min(c0 + per, L)
        blocks = table[c0 // bs:(c1 + bs - 1) // bs].to(torch.int64)
        K = _gather(key_cache, blocks)                                     # [hkv, T, d], position c0 first
        V = _gather(value_cache, blocks)
        finite = bool(torch.isfinite(V[:, max(lo_seq, c0) - c0:c1 - c0]).all())
        Vmul = V if finite else _finite_part(V)
        for r0, r1, P0, P1, lo_t, hi_t, (mt, lt, at) in tiles:
            R_ = r1 - r0
            qt = q[:, r0 * g:r1 * g]
            for k0 in range(max(lo_t, c0), min(hi_t, c1), kt):
                k1 = min(k0 + kt, hi_t, c1)
                T = k1 - k0
                s = torch.matmul(qt, K[:, k0 - c0:k1 - c0].transpose(1, 2))  # [hkv, R_*g, T]
                if cap is not None:
                    s.div_(cap).tanh_().mul_(cap)
                s4 = s.view(hkv, R_, g, T)
                if slopes is not None or (causal and k1 - 1 > P0) or (w is not None and k0 < P1 - w + 1):
                    jj = torch.arange(k0, k1, device=dev)
                    pp = torch.arange(P0, P1 + 1, device=dev)
                if slopes is not None:
                    s4.add_(slopes * (jj[None, :] - pp[:, None]).to(torch.float32).view(1, R_, 1, T))
                keep4 = None
                if causal and k1 - 1 > P0:
                    keep4 = jj[None, :] <= pp[:, None]
                if w is not None and k0 < P1 - w + 1:
                    inside = jj[None, :] > pp[:, None] - w
                    keep4 = inside if keep4 is None else keep4 & inside
                if keep4 is not None:
                    keep4 = keep4.view(1, R_, 1, T)
                    s4.masked_fill_(~keep4, -math.inf)
                m_new = torch.maximum(mt, s4.amax(dim=-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
                alpha = torch.exp(mt - m_safe)
                p4 = s4.sub_(m_safe[..., None]).exp_()
                lt.mul_(alpha).add_(p4.sum(dim=-1))
                at.mul_(alpha.view(hkv, R_ * g, 1))
                at.baddbmm_(s, Vmul[:, k0 - c0:k1 - c0])
                if not finite:
                    _add_nonfinite(at.view(hkv, R_, g, d), p4, keep4, V[:, k0 - c0:k1 - c0])
                mt.copy_(m_new)
    out_scale = _per_head(v_scale, hkv, dev)
    tiny = torch.finfo(torch.float32).tiny
    for r0, r1, _, _, _, _, (mt, lt, at) in tiles:
        R_ = r1 - r0
        res = at.view(1, hkv, R_ * g, d) * out_scale / lt.reshape(1, hkv, R_ * g, 1).clamp_min(tiny)
        out[q0 + r0:q0 + r1].copy_(res.view(hkv, R_, g, d).permute(1, 0, 2, 3).reshape(R_, h, d))
        if lse is not None:  # [hkv, R_, g] -> rows r0..r1 of [total_q, h]
            rl = (mt + torch.log(lt)).masked_fill(lt == 0, -math.inf)
            lse[q0 + r0:q0 + r1].copy_(rl.permute(1, 0, 2).reshape(R_, h))


def paged_attention(call) -> None:
    """Run a validated ``hal.call.AttentionCall``: several rows per sequence, or decode with ``lse``."""
    paged_attention_varlen(call.out, call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens,
                           call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap,
                           call.sliding_window, call.max_seq_len, call.query_start_loc, call.max_query_len,
                           call.causal, call.lse)
