"""Triton kernel of the emu pack for MLA decode (multi-head latent attention, absorbed form).

A program serves one query row, one tile of ``BLOCK_H`` query heads and one KV split (a range of
``split_len`` context tokens), streaming the split's tokens in tiles of ``BLOCK_N`` gathered through
the block table. Every head attends the same latent, so each latent tile read serves the whole head
tile twice: as the key of the scores and as the value of the output.

The score product ``q_nope [BLOCK_H, R] @ c^T [R, BLOCK_N]`` is walked over R in chunks of
``R_CHUNK``: with M = 16 heads (one MMA row) every warp holds the whole K extent of both operands,
so one R = 512 product would keep a [16, 512] query operand (128 registers a thread) and a [512,
BLOCK_N] latent operand live at once and spill; a chunk keeps [16, 64] and [64, BLOCK_N] (measured:
no spills on sm_80 / sm_90 / gfx942, against 1-3 KiB of spills for one product on sm_80). The query
chunks are re-read each tile (16 KiB at R = 512, L1-resident); the latent's are read again, whole, as
the value of ``p @ c`` (the same bytes, from L1/L2: HBM traffic is one read of the split's tokens).

With one split (``DIRECT``) the program normalises and writes ``out``; otherwise it writes its
running max (log2 units), sum and unnormalised accumulator in :func:`triton_kernels.attn_merge_kernel`'s
workspace layout, plus the row's context length (that kernel's ``lens``), and the merge kernel
combines the splits. The caches are read through their (block, token) strides, so views into one
combined [num_blocks, block_size, R + P] allocation need no copy.

FP8 decoding, the tile loaders and the score/PV products are :mod:`triton_kernels`' and
:mod:`triton_prefill_kernels`' (imported, not copied); the precision rules are :mod:`triton_mla`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import _load_tile, _load_tile_full, _scores
from .triton_prefill_kernels import _pv


@triton.jit
def _sequence_of_row(qsl_ptr, row, num_seqs):
    """The sequence holding query row ``row``: the last i with qsl[i] <= row (an empty sequence,
    qsl[i] == qsl[i + 1], is never the last such i of a row that exists)."""
    lo = row * 0  # int32 tensors (a num_seqs specialised to the constexpr 1 must not be loop-carried)
    hi = lo + num_seqs
    while hi - lo > 1:  # invariant: qsl[lo] <= row < qsl[hi] (qsl[num_seqs] = total_q)
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) <= row:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _rows(base, rows, dims, tok_ok, width, MASKED: tl.constexpr, EVEN: tl.constexpr, FP8: tl.constexpr,
          FAST16: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr,
          SUBNORMAL: tl.constexpr):
    """Elements ``dims`` of cache rows ``rows`` [BLOCK_N, len(dims)], widened (triton_kernels._widen).
    Masked tokens and dims >= ``width`` read as 0, never as the slot's bytes: an unread slot may hold
    NaN, and 0 * NaN in p @ c is NaN. MASKED: some tokens may be dead; EVEN: every dim is < width."""
    if MASKED:
        tile = _load_tile(base, rows[:, None], dims[None, :], tok_ok[:, None] & (dims < width)[None, :],
                          FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    elif EVEN:
        tile = _load_tile_full(base, rows[:, None], dims[None, :], FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    else:  # every token live, padded dims masked (a full-shape mask: the interpreter needs one)
        tile = _load_tile(base, rows[:, None], dims[None, :], (rows >= 0)[:, None] & (dims < width)[None, :],
                          FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    return tile


@triton.jit
def _token_tile(m_i, l_i, acc, qn_rows, head_ok, qp, n0, end, c_logit, p_logit, bt_row, stride_bt_col, ckv_ptr,
                kpe_ptr, stride_cb, stride_ct, stride_pb, stride_pt,
                MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                R_CHUNK: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr, DOT16: tl.constexpr,
                C_FP8: tl.constexpr, C_FAST16: tl.constexpr, C_EXP: tl.constexpr, C_MAN: tl.constexpr,
                C_BIAS: tl.constexpr, C_FNUZ: tl.constexpr, C_SUBNORMAL: tl.constexpr,
                K_FP8: tl.constexpr, K_FAST16: tl.constexpr, K_EXP: tl.constexpr, K_MAN: tl.constexpr,
                K_BIAS: tl.constexpr, K_FNUZ: tl.constexpr, K_SUBNORMAL: tl.constexpr):
    """Tokens [n0, n0 + BLOCK_N) folded into the running (max, sum, accumulator) of every head of the
    tile. MASKED: the tile may reach past ``end`` (the split's or the row's last token); otherwise
    every token is live and only padded dims are masked."""
    toks = n0 + tl.arange(0, BLOCK_N)
    tok_ok = toks < end
    # Only table entries of live tokens are read: entries past a sequence's blocks may be junk.
    if MASKED:
        phys = tl.load(bt_row + (toks // BS) * stride_bt_col, mask=tok_ok, other=0).to(tl.int64)
    else:
        phys = tl.load(bt_row + (toks // BS) * stride_bt_col).to(tl.int64)
    off = (toks % BS).to(tl.int64)
    c_rows = phys * stride_cb + off * stride_ct
    # Operands in the query's 16-bit type (DOT16: FP8 and its own dtype are exact there), else
    # float32 (qp is float32 then). The scales multiply the float32 products (one multiply per score
    # each), not the 16-bit query: folding them into q would round q * scale to 16 bits. log2(e) is
    # folded in too (exp2 below).
    kp = _rows(kpe_ptr, phys * stride_pb + off * stride_pt, tl.arange(0, P_PAD), tok_ok, P, MASKED, P == P_PAD,
               K_FP8, K_FAST16, K_EXP, K_MAN, K_BIAS, K_FNUZ, K_SUBNORMAL)                 # [BLOCK_N, P_PAD]
    s = _scores(qp, tl.trans(kp), p_logit, 1.0, DOT16, False)
    for k in range(R_PAD // R_CHUNK):  # a loop, not unrolled: one chunk's operands live at a time
        dims = k * R_CHUNK + tl.arange(0, R_CHUNK)
        qn = tl.load(qn_rows + dims[None, :], mask=head_ok[:, None] & (dims < R)[None, :], other=0.0)
        c_k = _rows(ckv_ptr, c_rows, dims, tok_ok, R, MASKED, R == R_PAD,
                    C_FP8, C_FAST16, C_EXP, C_MAN, C_BIAS, C_FNUZ, C_SUBNORMAL)            # [BLOCK_N, R_CHUNK]
        s += _scores(qn.to(qp.dtype), tl.trans(c_k), c_logit, 1.0, DOT16, False)
    if MASKED:
        s = tl.where(tok_ok[None, :], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head that has only seen -inf logits
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    c = _rows(ckv_ptr, c_rows, tl.arange(0, R_PAD), tok_ok, R, MASKED, R == R_PAD,
              C_FP8, C_FAST16, C_EXP, C_MAN, C_BIAS, C_FNUZ, C_SUBNORMAL)                  # [BLOCK_N, R_PAD]
    acc = acc * alpha[:, None] + _pv(p, c.to(qp.dtype), DOT16)  # DOT16: p rounded to the 16-bit type
    return m_new, l_i, acc


@triton.jit
def mla_partition_kernel(
    out_ptr, qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, bt_ptr, lens_ptr, qsl_ptr, cs_ptr, ps_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_len_ptr,
    c_logit, p_logit, out_scale, num_seqs, num_heads, num_splits, split_len,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_pb, stride_pt, stride_bt, stride_bt_col,
    R: tl.constexpr, R_PAD: tl.constexpr, R_CHUNK: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, DIRECT: tl.constexpr, DOT16: tl.constexpr, CS_TENSOR: tl.constexpr, PS_TENSOR: tl.constexpr,
    C_FP8: tl.constexpr, C_FAST16: tl.constexpr, C_EXP: tl.constexpr, C_MAN: tl.constexpr, C_BIAS: tl.constexpr,
    C_FNUZ: tl.constexpr, C_SUBNORMAL: tl.constexpr,
    K_FP8: tl.constexpr, K_FAST16: tl.constexpr, K_EXP: tl.constexpr, K_MAN: tl.constexpr, K_BIAS: tl.constexpr,
    K_FNUZ: tl.constexpr, K_SUBNORMAL: tl.constexpr,
):
    """One (query row, head tile, split): online softmax in float32 (log2 units) over the split's
    part of the row's context [0, row_len)."""
    row = tl.program_id(0)
    ht = tl.program_id(1)
    split = tl.program_id(2)
    if VARLEN:  # row t of a sequence's q_len rows sits at L - q_len + t: it sees L - q_len + t + 1 tokens
        seq = _sequence_of_row(qsl_ptr, row, num_seqs)
        q0 = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q0
        row_len = tl.maximum(tl.load(lens_ptr + seq) - q_len + (row - q0) + 1, 0)
    else:
        seq = row
        row_len = tl.load(lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, row_len)
    if not DIRECT:
        if (ht == 0) & (split == 0):
            tl.store(ws_len_ptr + row, row_len)  # the merge kernel's per-row "sequence length"
        if start >= end:  # past this row's context: the merge reads only splits that start before row_len
            return

    row64 = row.to(tl.int64)
    heads = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    pd = tl.arange(0, P_PAD)
    qn_rows = qn_ptr + row64 * stride_qnt + heads[:, None] * stride_qnh
    qp = tl.load(qp_ptr + row64 * stride_qpt + heads[:, None] * stride_qph + pd[None, :],
                 mask=head_ok[:, None] & (pd < P)[None, :], other=0.0)
    if not DOT16:
        qp = qp.to(tl.float32)
    if CS_TENSOR:  # one latent: a 0-d or [1] scale, read at index 0
        cs = tl.load(cs_ptr)
        c_logit = c_logit * cs
        out_scale = out_scale * cs
    if PS_TENSOR:
        p_logit = p_logit * tl.load(ps_ptr)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    # Full tiles first, no token masked; then at most one tail tile, masked.
    n_full = tl.maximum(end - start, 0) // BLOCK_N
    n_tiles = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
    for k in range(n_full):
        m_i, l_i, acc = _token_tile(m_i, l_i, acc, qn_rows, head_ok, qp, start + k * BLOCK_N, end, c_logit, p_logit,
                                    bt_row, stride_bt_col, ckv_ptr, kpe_ptr, stride_cb, stride_ct, stride_pb,
                                    stride_pt, False, BLOCK_N, BS, R, R_PAD, R_CHUNK, P, P_PAD, DOT16,
                                    C_FP8, C_FAST16, C_EXP, C_MAN, C_BIAS, C_FNUZ, C_SUBNORMAL,
                                    K_FP8, K_FAST16, K_EXP, K_MAN, K_BIAS, K_FNUZ, K_SUBNORMAL)
    for k in range(n_full, n_tiles):
        m_i, l_i, acc = _token_tile(m_i, l_i, acc, qn_rows, head_ok, qp, start + k * BLOCK_N, end, c_logit, p_logit,
                                    bt_row, stride_bt_col, ckv_ptr, kpe_ptr, stride_cb, stride_ct, stride_pb,
                                    stride_pt, True, BLOCK_N, BS, R, R_PAD, R_CHUNK, P, P_PAD, DOT16,
                                    C_FP8, C_FAST16, C_EXP, C_MAN, C_BIAS, C_FNUZ, C_SUBNORMAL,
                                    K_FP8, K_FAST16, K_EXP, K_MAN, K_BIAS, K_FNUZ, K_SUBNORMAL)

    rd = tl.arange(0, R_PAD)
    out_mask = head_ok[:, None] & (rd < R)[None, :]
    if DIRECT:
        res = acc * (out_scale / tl.maximum(l_i, 1e-30))[:, None]
        # only an empty context gives zeros (a vector condition: the interpreter rejects scalar masks)
        res = tl.where(((heads * 0 + row_len) > 0)[:, None], res, 0.0)
        tl.store(out_ptr + row64 * stride_ot + heads[:, None] * stride_oh + rd[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        ws_row = (row * num_heads + heads) * num_splits + split  # int32: the workspace is < 2^28 elements
        tl.store(ws_m_ptr + ws_row, m_i, mask=head_ok)
        tl.store(ws_l_ptr + ws_row, l_i, mask=head_ok)
        tl.store(ws_acc_ptr + ws_row[:, None] * R + rd[None, :], acc, mask=out_mask)
