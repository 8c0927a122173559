"""The emu pack's PyTorch path for MLA decode (multi-head latent attention, absorbed form) and the
MLA cache write, on any device. routing.py sends ``mla_decode`` on GPU tensors to :mod:`triton_mla`
where Triton is usable; this path serves the CPU, GPUs without triton, and ``cache_mla`` everywhere.

Contract (docs: shared design.md, "MLA decode over an FP8 latent cache"): every query head attends
to one shared latent ``c_j`` (``ckv_cache`` [num_blocks, block_size, R], also the value) and rotary
part ``kpe_j`` (``kpe_cache`` [num_blocks, block_size, P]) per token:
``s_j = (q_nope . c_j * ckv_scale + q_pe . kpe_j * kpe_scale) * scale``, ``out = ckv_scale *
softmax(s) @ c``. Several query rows per sequence (speculative decoding, ``query_start_loc``) are
causal: row t of q_len rows sits at position ``L - q_len + t``.

Each query row is served as its own decode row (its sequence's block table, length = its position
+ 1), so a sequence's pages are read once per row: right for the 1-4 rows per sequence MLA decode
sees. The context is walked in chunks of whole blocks, pages gathered for every row at once
(:mod:`pages`: FP8 decoded exactly), merged with an online softmax in float32; no Python loop per
token or block. Either cache may be a view into one [num_blocks, block_size, R + P] allocation.
"""

from __future__ import annotations

import math

import torch

from . import pages, torch_path

# Elements of float32 latent one chunk may hold (as torch_path: in a core's L2 on a CPU).
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_CHUNK_ELEMENTS_DEFAULT = 1 << 24


def _as_float(s) -> torch.Tensor | float:
    if s is None:
        return 1.0
    if isinstance(s, torch.Tensor):
        return s.to(torch.float32).reshape(())
    return float(s)


def row_geometry(seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None, total_q: int):
    """Per query row: its sequence and its length (position + 1), on the device, without a host sync."""
    dev = seq_lens.device
    lens = seq_lens.to(torch.int64)
    if query_start_loc is None:
        return torch.arange(lens.numel(), device=dev), lens
    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), q_lens, output_size=total_q)
    t = torch.arange(total_q, device=dev) - qsl[seq]
    return seq, lens[seq] - q_lens[seq] + t + 1


def mla_decode(out, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale, ckv_scale, kpe_scale,
               max_seq_len: int, query_start_loc=None, lse=None) -> None:
    """Writes ``out`` [total_q, num_heads, R] (see the module docstring), and with ``lse`` (float32
    [total_q, num_heads]) each row's natural-log log-sum-exp of its logits. ``max_seq_len``: a host
    int >= every sequence's length."""
    total_q, h, r = q_nope.shape
    if total_q == 0:
        return
    if lse is not None:
        lse.fill_(-math.inf)
    dev = q_nope.device
    bs = ckv_cache.shape[1]
    seq, lens = row_geometry(seq_lens, query_start_loc, total_q)
    tables = block_tables.index_select(0, seq)
    cs, ps = _as_float(ckv_scale), _as_float(kpe_scale)
    qn = q_nope.to(torch.float32) * (cs * scale)       # scales folded into the query (float32, once)
    qp = q_pe.to(torch.float32) * (ps * scale)
    ckv4, kpe4 = ckv_cache.unsqueeze(1), kpe_cache.unsqueeze(1)   # [nb, 1, bs, W]: one "head"

    m = torch.full((total_q, h), -math.inf, device=dev)
    l = torch.zeros((total_q, h), device=dev)
    acc = torch.zeros((total_q, h, r), device=dev)
    chunk = _CHUNK_ELEMENTS.get(dev.type, _CHUNK_ELEMENTS_DEFAULT)
    blocks_per_chunk = max(1, chunk // max(1, total_q * bs * r))
    total_blocks = (max_seq_len + bs - 1) // bs
    work = pages.workspace(dev)
    for b0 in range(0, total_blocks, blocks_per_chunk):
        cols = torch.arange(b0, min(b0 + blocks_per_chunk, total_blocks), device=dev)
        t = cols.numel() * bs
        pos = b0 * bs + torch.arange(t, device=dev)
        keep = pos[None, :] < lens[:, None]                                        # [rows, t]
        used = cols[None, :] * bs < lens[:, None]
        blocks = torch.where(used, tables[:, cols].to(torch.int64), 0)             # unused entries may be junk
        # Dropped positions read as 0 in the latent (it is also the value: p = 0 there, 0 * NaN is NaN).
        c = pages.gather(ckv4, blocks, drop=~keep, work=work, name="ckv")[:, 0]    # [rows, t, R]
        kp = pages.gather(kpe4, blocks, work=work, name="kpe")[:, 0]                # [rows, t, P]
        s = torch.bmm(qn, c.transpose(1, 2)) + torch.bmm(qp, kp.transpose(1, 2))   # [rows, h, t]
        s = s.masked_fill(~keep[:, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.bmm(p, c)
        m = m_new
    result = acc * cs / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    # Only an empty row gives zeros; NaN in a query or in a latent that is read stays NaN.
    out.copy_(result.masked_fill((lens == 0)[:, None, None], 0.0))
    if lse is not None:  # m + log l in logit units; -inf for a row with no key
        lse.copy_((m + torch.log(l)).masked_fill(l == 0, -math.inf))


def cache_mla(kv_c, k_pe, ckv_cache, kpe_cache, slot_mapping, ckv_scale, kpe_scale) -> None:
    """Write token t's latent ``kv_c[t]`` [R] and rotary part ``k_pe[t]`` [P] at slot
    ``slot_mapping[t]`` (block * block_size + offset; negative: skipped), stored as ``x / scale``
    rounded to the cache's encoding (saturating, ties to even: hal.fp8.encode_bytes)."""
    nb, bs, _ = ckv_cache.shape
    live = torch_path.live_slots(slot_mapping, nb * bs, bs)
    if live is None:
        return
    keep, blk, off = live
    for x, cache, s in ((kv_c, ckv_cache, ckv_scale), (k_pe, kpe_cache, kpe_scale)):
        rows = x[keep].to(torch.float32)
        s = torch.as_tensor(1.0 if s is None else s, dtype=torch.float32, device=rows.device).reshape(())
        torch_path.store_rows(cache, (blk, off), rows, s)
