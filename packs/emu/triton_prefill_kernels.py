"""Triton kernel of the emu pack for several query tokens per sequence (prefill, chunked prefill,
mixed batches): one launch for the whole batch, in the manner of vLLM's unified attention.

A program serves one tile of query rows of one sequence and one KV head: ``BLOCK_Q`` consecutive
tokens times ``G_TILE`` query heads of the KV group (row ``m``: token ``m // G_TILE``, head
``m % G_TILE``), so every K/V tile read through the block table serves all of them. Sequence ``i``
owns the tile slots ``qsl[i] // BLOCK_Q + i .. qsl[i+1] // BLOCK_Q + i`` (at least
``cdiv(q_len, BLOCK_Q)`` of them, one for ``q_len == 0``): the grid's first axis is the static
bound ``total_q // BLOCK_Q + num_seqs`` and a program finds its sequence by a binary search over
``query_start_loc``; slots past a sequence's rows exit at once. Nothing on the host reads device
data, so the launch can be captured in a CUDA graph.

FP8 decoding, the tile loader and tanh are :mod:`triton_kernels`' (imported, not copied); the
precision rules are the decode kernel's (see :mod:`triton_path`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import LOG2E, _load_tile, _load_tile_full, _scores

INF = tl.constexpr(float("inf"))


@triton.jit
def _find_sequence(qsl_ptr, slot, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose tile slots hold ``slot``: the last i with qsl[i] // BLOCK_Q + i <= slot."""
    left = slot * 0  # int32 tensors (a constexpr num_seqs == 1 must not become a loop-carried int)
    right = left + num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= slot:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _pv(p, v, DOT16: tl.constexpr):
    if DOT16:  # probabilities rounded to the query's 16-bit type (v already is)
        pv = tl.dot(p.to(v.dtype), v)
    else:  # one return: Triton types every return, even in untaken constexpr branches
        pv = tl.dot(p, v, input_precision="ieee")
    return pv


@triton.jit
def _nonfinite_part(keep, v, DOT16: tl.constexpr):
    """sum_j keep[r, j] * v[j, :] over the non-finite entries of ``v`` only, as IEEE gives it (inf,
    -inf, NaN where inf meets -inf or a NaN is kept), with ``keep == 0`` contributing nothing at
    all: counts of kept +inf / -inf / NaN entries from three exact 0/1 products."""
    kf = keep.to(v.dtype)
    pos = _pv(kf, (v == INF).to(v.dtype), DOT16)
    neg = _pv(kf, (v == -INF).to(v.dtype), DOT16)
    nan = _pv(kf, (v != v).to(v.dtype), DOT16)
    return tl.where(pos > 0, INF, 0.0) + tl.where(neg > 0, -INF, 0.0) + tl.where(nan > 0, float("nan"), 0.0)


@triton.jit
def _key_tile(m_i, l_i, acc, q, n0, hi, pos, row_ok, dims, dim_ok, slopes, qk_scale, soft_cap, window,
              bt_row, stride_bt_col, k_base, v_base, stride_kb, stride_kt, stride_vb, stride_vt,
              MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
              BS: tl.constexpr, FP8: tl.constexpr, FAST16: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr,
              BIAS: tl.constexpr, FNUZ: tl.constexpr, SUBNORMAL: tl.constexpr, DOT16: tl.constexpr,
              HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
              EVEN_D: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) folded into the running (max, sum, accumulator). MASKED: the
    tile may hold keys past ``hi`` or keys some rows drop (the causal band, a window edge);
    otherwise every row keeps every key and nothing is masked."""
    toks = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        tok_ok = toks < hi  # every token of [lo, hi) is one some row of the tile reads
        # Only table entries of live tokens are read: entries past a sequence's blocks may be junk.
        phys = tl.load(bt_row + (toks // BS) * stride_bt_col, mask=tok_ok, other=0).to(tl.int64)
    else:
        phys = tl.load(bt_row + (toks // BS) * stride_bt_col).to(tl.int64)
    off = (toks % BS).to(tl.int64)
    k_rows = (phys * stride_kb + off * stride_kt)[None, :]
    if MASKED:
        kt = _load_tile(k_base, k_rows, dims[:, None], (toks < hi)[None, :] & dim_ok[:, None],
                        FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    elif EVEN_D:
        kt = _load_tile_full(k_base, k_rows, dims[:, None], FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    else:
        kt = _load_tile(k_base, k_rows, dims[:, None], dim_ok[:, None] & (toks >= 0)[None, :],
                        FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    s = _scores(q, kt, qk_scale, soft_cap, DOT16, HAS_SOFTCAP)
    if HAS_ALIBI:
        s = s + slopes[:, None] * (toks[None, :] - pos[:, None]).to(tl.float32)
    if MASKED:
        keep = tok_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (toks[None, :] <= pos[:, None])
        if HAS_WINDOW:
            keep = keep & (toks[None, :] > pos[:, None] - window)
        s = tl.where(keep, s * LOG2E, float("-inf"))
    else:
        s = s * LOG2E

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key (or only -inf logits)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v_rows = (phys * stride_vb + off * stride_vt)[:, None]
    if MASKED:
        v = _load_tile(v_base, v_rows, dims[None, :], (toks < hi)[:, None] & dim_ok[None, :],
                       FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    elif EVEN_D:
        v = _load_tile_full(v_base, v_rows, dims[None, :], FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    else:
        v = _load_tile(v_base, v_rows, dims[None, :], (toks >= 0)[:, None] & dim_ok[None, :],
                       FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    if DOT16:
        v = v.to(q.dtype)
    else:
        v = v.to(tl.float32)
    pv = _pv(p, v, DOT16)
    # A token some rows of the tile keep and others mask (the causal band, a window edge): a
    # non-finite V there must reach only the rows that keep it (0 * NaN in the product would reach
    # the others). Checked only on masked tiles; the fix-up runs only when one is there. (Without
    # causality every row keeps every token: a window is refused with causal=False.)
    if MASKED:
        if CAUSAL:
            bad = tl.sum(tl.sum(((v != v) | (v == INF) | (v == -INF)).to(tl.int32), 1), 0)
            if bad > 0:
                v_fin = tl.where((v != v) | (v == INF) | (v == -INF), 0.0, v).to(v.dtype)
                pv = _pv(p, v_fin, DOT16) + _nonfinite_part(keep, v, DOT16)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def prefill_kernel(
    out_ptr, q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, qsl_ptr, ks_ptr, vs_ptr, alibi_ptr,
    qk_scale, v_scale, soft_cap, window, num_seqs,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bt, stride_bt_col,
    G: tl.constexpr, G_TILE: tl.constexpr, NUM_HT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    FP8: tl.constexpr, FAST16: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
    FNUZ: tl.constexpr, SUBNORMAL: tl.constexpr, DOT16: tl.constexpr,
    K_SCALE_STRIDE: tl.constexpr, V_SCALE_STRIDE: tl.constexpr,  # -1: host float, 0: 0-d, 1: per head
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """One (tile slot, KV head x head tile): rows of BLOCK_Q tokens x G_TILE heads against the key
    tiles some row of the tile sees, online softmax in float32 (log2 units), ``out`` written once."""
    slot = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_HT
    ht = tl.program_id(1) % NUM_HT
    seq = _find_sequence(qsl_ptr, slot, num_seqs, BLOCK_Q)
    q0 = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q0
    qt = slot - (q0 // BLOCK_Q + seq)  # this tile's index among the sequence's
    if qt * BLOCK_Q >= q_len:
        return
    seq64 = seq.to(tl.int64)
    L = tl.load(lens_ptr + seq)
    first = L - q_len + qt * BLOCK_Q                               # position of the tile's first row
    last = L - q_len + tl.minimum(qt * BLOCK_Q + BLOCK_Q, q_len) - 1  # ... and of its last row
    if CAUSAL:
        hi = last + 1
    else:
        hi = L
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)

    m = tl.arange(0, BLOCK_M)
    tok = qt * BLOCK_Q + m // G_TILE                               # token index within the sequence
    hg = ht * G_TILE + m % G_TILE                                  # head within the KV group
    row_ok = (m < BLOCK_Q * G_TILE) & (tok < q_len) & (hg < G)
    pos = L - q_len + tok                                          # the row's position p
    heads = kvh * G + hg
    rows64 = (q0 + tok).to(tl.int64)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D

    q = tl.load(q_ptr + rows64[:, None] * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if not DOT16:
        q = q.to(tl.float32)
    if K_SCALE_STRIDE >= 0:
        qk_scale = qk_scale * tl.load(ks_ptr + kvh * K_SCALE_STRIDE)
    slopes = qk_scale  # a placeholder scalar without ALiBi
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + seq64 * stride_bt
    k_base = kc_ptr + kvh * stride_kh
    v_base = vc_ptr + kvh * stride_vh
    # Key tiles start at lo, BLOCK_N apart. The middle ones, whose every key every row keeps (below
    # the first row's diagonal, inside the last row's window, before L), skip all masking; the
    # edge tiles mask. Padding rows (past q_len or the group) need no mask: their output is never
    # stored, and their q = 0 keeps them finite.
    if CAUSAL:
        full_hi = first + 1
    else:
        full_hi = L
    full_lo = lo
    if HAS_WINDOW:
        full_lo = tl.maximum(last - window + 1, lo)
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    k0 = tl.minimum(tl.cdiv(full_lo - lo, BLOCK_N), n_tiles)          # first full tile
    k1 = tl.maximum(tl.maximum(full_hi - lo, 0) // BLOCK_N, k0)          # one past the last
    for k in range(0, k0):
        m_i, l_i, acc = _key_tile(m_i, l_i, acc, q, lo + k * BLOCK_N, hi, pos, row_ok, dims, dim_ok,
                                  slopes, qk_scale, soft_cap, window, bt_row, stride_bt_col, k_base, v_base,
                                  stride_kb, stride_kt, stride_vb, stride_vt,
                                  True, BLOCK_M, BLOCK_N, D_PAD, BS, FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL,
                                  DOT16, HAS_ALIBI, HAS_SOFTCAP, HAS_WINDOW, CAUSAL, EVEN_D)
    for k in range(k0, k1):
        m_i, l_i, acc = _key_tile(m_i, l_i, acc, q, lo + k * BLOCK_N, hi, pos, row_ok, dims, dim_ok,
                                  slopes, qk_scale, soft_cap, window, bt_row, stride_bt_col, k_base, v_base,
                                  stride_kb, stride_kt, stride_vb, stride_vt,
                                  False, BLOCK_M, BLOCK_N, D_PAD, BS, FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL,
                                  DOT16, HAS_ALIBI, HAS_SOFTCAP, HAS_WINDOW, CAUSAL, EVEN_D)
    for k in range(k1, n_tiles):
        m_i, l_i, acc = _key_tile(m_i, l_i, acc, q, lo + k * BLOCK_N, hi, pos, row_ok, dims, dim_ok,
                                  slopes, qk_scale, soft_cap, window, bt_row, stride_bt_col, k_base, v_base,
                                  stride_kb, stride_kt, stride_vb, stride_vt,
                                  True, BLOCK_M, BLOCK_N, D_PAD, BS, FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL,
                                  DOT16, HAS_ALIBI, HAS_SOFTCAP, HAS_WINDOW, CAUSAL, EVEN_D)

    if V_SCALE_STRIDE >= 0:
        v_scale = v_scale * tl.load(vs_ptr + kvh * V_SCALE_STRIDE)
    # Every real row keeps its own key (l >= 1 unless NaN): no guard; padding rows divide by 1.
    res = acc * (v_scale / tl.where(row_ok, l_i, 1.0))[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_on + heads[:, None] * stride_oh + dims[None, :],
             res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
