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
    """float64 [num_seqs, num_heads, head_size] on the query's device for one query row per
    sequence (decode: the row sits at position L - 1 and sees every key of its window); only the
    pages each sequence uses are read, so it scales to large caches (rows not in ``sequences`` and
    empty sequences stay zero). :func:`paged_attention_varlen` with one row per sequence."""
    n = query.shape[0]
    qsl = torch.arange(n + 1, dtype=torch.int64)
    return paged_attention_varlen(query, key_cache, value_cache, block_tables, seq_lens, qsl, causal=True,
                                  scale=scale, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                                  logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                                  sequences=sequences)


def paged_attention_varlen(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *, causal=True,
                           scale=None, k_scale=None, v_scale=None, alibi_slopes=None, logits_soft_cap=None,
                           sliding_window=None, sequences=None, rows_per_step=256, lse=None) -> torch.Tensor:
    """float64 [total_q, num_heads, head_size] on the query's device, for several query tokens per
    sequence: sequence i owns rows qsl[i] .. qsl[i+1]-1, row t of its q_len rows sits at position
    p = L - q_len + t; keys j <= p (causal) or j < L, j > p - w with a window w; ALiBi adds
    slope_h * (j - p) after the soft-cap. One sequence at a time, reading only the pages it uses (the
    keys its rows can see), ``rows_per_step`` rows at once; rows of sequences not in ``sequences``
    stay zero. Masked keys take no part at all (their weights are not multiplied by their values).
    ``lse``: a float64 [total_q, num_heads] tensor that receives each row's log-sum-exp of its
    logits (natural log; -inf for a row with no key)."""
    dev = query.device
    q = query.detach().to(torch.float64)
    total_q, h, d = q.shape
    hkv, bs = key_cache.shape[1], key_cache.shape[2]
    g = h // hkv
    ks, vs = _per_head(k_scale, hkv, dev), _per_head(v_scale, hkv, dev)
    sm = d ** -0.5 if scale is None else scale
    lens = seq_lens.cpu().to(torch.int64)
    qsl = query_start_loc.cpu().to(torch.int64)
    slopes = None if alibi_slopes is None else alibi_slopes.detach().to(dev, torch.float64)
    out = torch.zeros((total_q, h, d), dtype=torch.float64, device=dev)
    if lse is not None:
        lse.fill_(float("-inf"))
    for i in (range(len(lens)) if sequences is None else sequences):
        length, q0 = int(lens[i]), int(qsl[i])
        q_len = int(qsl[i + 1]) - q0
        if q_len == 0:
            continue
        lo = 0 if sliding_window is None else max(0, length - q_len - sliding_window + 1)
        pos = torch.arange(lo, length, device=dev)                          # every key some row sees
        if pos.numel() == 0:  # an empty sequence (its rows stay zero)
            continue
        blocks, offs = block_tables[i].to(torch.int64)[pos // bs], pos % bs
        keys = _rows(key_cache, blocks, offs) * ks[None, :, None]           # [len, hkv, d]
        vals = _rows(value_cache, blocks, offs) * vs[None, :, None]
        finite = torch.isfinite(vals)
        bad = (~finite).any(dim=-1).any(dim=-1).nonzero().reshape(-1)         # keys whose value is inf/NaN
        vals0 = torch.where(finite, vals, torch.zeros((), dtype=vals.dtype, device=dev))
        for r0 in range(0, q_len, rows_per_step):
            r1 = min(r0 + rows_per_step, q_len)
            p = torch.arange(length - q_len + r0, length - q_len + r1, device=dev)   # [r] positions
            qi = q[q0 + r0:q0 + r1].view(r1 - r0, hkv, g, d)
            logits = torch.einsum("rhgd,thd->rhgt", qi, keys) * sm           # [r, hkv, g, len]
            if logits_soft_cap is not None:
                logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
            if slopes is not None:
                rel = (pos[None, :] - p[:, None]).to(torch.float64)            # [r, len]
                logits = logits + slopes.view(1, hkv, g, 1) * rel[:, None, None, :]
            keep = torch.ones((r1 - r0, pos.numel()), dtype=torch.bool, device=dev)
            if causal:
                keep &= pos[None, :] <= p[:, None]
            if sliding_window is not None:
                keep &= pos[None, :] > p[:, None] - sliding_window
            logits = logits.masked_fill(~keep[:, None, None, :], float("-inf"))
            if lse is not None:
                lse[q0 + r0:q0 + r1] = torch.logsumexp(logits, dim=-1).reshape(r1 - r0, h).to(lse.dtype)
            w = torch.softmax(logits, dim=-1)
            res = torch.einsum("rhgt,thd->rhgd", w, vals0)
            if bad.numel():  # an inf/NaN value reaches exactly the rows that keep its key
                vb = torch.where(finite[bad], torch.zeros((), dtype=vals.dtype, device=dev), vals[bad])  # [nb, hkv, d]
                prod = w[..., bad].unsqueeze(-1) * vb.permute(1, 0, 2)[None, :, None]        # [r, hkv, g, nb, d]
                prod = torch.where(keep[:, bad][:, None, None, :, None], prod,
                                   torch.zeros((), dtype=prod.dtype, device=dev))
                res = res + prod.sum(dim=-2)
            out[q0 + r0:q0 + r1] = res.reshape(r1 - r0, h, d)
    return out


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().to(torch.float64), b.detach().cpu().to(torch.float64)
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def _latent_rows(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """MLA cache rows [num_blocks, block_size, W] at (blocks, offsets) as float64 [len, W]."""
    if fp8.is_fp8(cache.dtype):
        raw = cache.view(torch.uint8)[blocks, offsets]
        return fp8.decode_table(cache.dtype, torch.float64, cache.device)[raw.to(torch.int64)]
    return cache[blocks, offsets].to(torch.float64)


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, query_start_loc=None, *, scale,
               ckv_scale=None, kpe_scale=None, sequences=None, lse=None) -> torch.Tensor:
    """float64 [total_q, num_heads, R] on the query's device: multi-head latent attention in its
    absorbed form (design.md, "MLA decode"). Every head attends to one shared latent ``c_j`` (R
    wide, also the value) and rotary part ``kpe_j`` (P wide) per token: ``s_j = (q_nope . c_j *
    ckv_scale + q_pe . kpe_j * kpe_scale) * scale``, ``out = ckv_scale * softmax(s) @ c``. Row t of
    a sequence's q_len rows (``query_start_loc``; default one row per sequence) sits at position
    ``L - q_len + t`` and sees keys ``j <=`` it. Reads only the pages each sequence uses; rows of
    sequences not in ``sequences``, and of empty sequences, stay zero. ``lse``: a float64
    [total_q, num_heads] tensor for each row's log-sum-exp of its logits (natural log; -inf keyless)."""
    dev = q_nope.device
    qn, qp = q_nope.detach().to(torch.float64), q_pe.detach().to(torch.float64)
    bs = ckv_cache.shape[1]
    cs = 1.0 if ckv_scale is None else float(ckv_scale)
    ps = 1.0 if kpe_scale is None else float(kpe_scale)
    lens = seq_lens.cpu().to(torch.int64)
    n = lens.numel()
    qsl = torch.arange(n + 1) if query_start_loc is None else query_start_loc.cpu().to(torch.int64)
    out = torch.zeros(qn.shape, dtype=torch.float64, device=dev)
    if lse is not None:
        lse.fill_(float("-inf"))
    for i in (range(n) if sequences is None else sequences):
        length, q0, q1 = int(lens[i]), int(qsl[i]), int(qsl[i + 1])
        if q1 == q0 or length == 0:
            continue
        pos = torch.arange(length, device=dev)
        blocks, offs = block_tables[i].to(torch.int64)[pos // bs], pos % bs
        c = _latent_rows(ckv_cache, blocks, offs) * cs                        # [L, R]
        kpe = _latent_rows(kpe_cache, blocks, offs) * ps                      # [L, P]
        rows = torch.arange(length - (q1 - q0), length, device=dev)           # the rows' positions
        logits = (torch.einsum("rhc,tc->rht", qn[q0:q1], c) + torch.einsum("rhp,tp->rht", qp[q0:q1], kpe)) * scale
        logits = logits.masked_fill((pos[None, :] > rows[:, None])[:, None, :], float("-inf"))
        if lse is not None:
            lse[q0:q1] = torch.logsumexp(logits, dim=-1).to(lse.dtype)
        out[q0:q1] = torch.einsum("rht,tc->rhc", torch.softmax(logits, dim=-1), c)
    return out
