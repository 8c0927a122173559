"""Triton kernels of the emu pack: split-K paged decode attention and the quantizing cache write.

FP8 bytes are read and written as uint8 and converted with integer bit arithmetic, never through
Triton's fp8 dtypes: those exist only on some GPUs, and the interpreter gets their edges wrong
(NaN bytes decode as numbers, overflow wraps). The encodings' bit layouts come from ``hal.fp8``
as constexprs (exponent bits, mantissa bits, bias, fnuz), so one kernel body serves all four.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def decode_fp8(raw, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr,
               SUBNORMAL: tl.constexpr):
    """uint8 FP8 bytes -> float32, exactly; NaN bytes -> NaN, e5m2 infinities -> inf.

    Normal numbers are re-biased straight into float32 bits; subnormals are ``mantissa * 2^(1-bias-MAN)``
    (``SUBNORMAL``), exact in float32.
    """
    x = raw.to(tl.int32)
    e = (x >> MAN) & ((1 << EXP) - 1)
    m = x & ((1 << MAN) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MAN))).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * SUBNORMAL, normal)
    if FNUZ:  # no -0 and no infinities: 0x80 is the only NaN
        mag = tl.where(x == 0x80, float("nan"), mag)
    elif EXP == 4:  # OCP e4m3fn: S.1111.111 is NaN, no infinities
        mag = tl.where((x & 0x7F) == 0x7F, float("nan"), mag)
    else:  # OCP e5m2: IEEE-like top exponent
        mag = tl.where(e == (1 << EXP) - 1, tl.where(m == 0, float("inf"), float("nan")), mag)
    return tl.where(x >= 0x80, -mag, mag)


@triton.jit
def encode_fp8(q, MAN: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr, MAX_BYTE: tl.constexpr,
               NAN_BYTE: tl.constexpr):
    """float32 -> FP8 byte: round to nearest even, saturate to the largest finite (inf too), NaN ->
    NAN_BYTE; fnuz has no -0. Integer arithmetic on the float32 bits, so it is exact everywhere."""
    bits = q.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    e32 = a >> 23
    # Normal target: drop 23-MAN mantissa bits with ties-to-even; a carry walks into the exponent
    # field, which is exactly the next binade. Re-bias the exponent to the encoding's.
    SHIFT: tl.constexpr = 23 - MAN
    r = (a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    normal = r - ((127 - BIAS) << MAN)
    # Subnormal target: the magnitude in units of the subnormal quantum, rounded to an integer with
    # ties-to-even; 2^MAN (a round-up into the smallest normal) is that normal's byte as well.
    full = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum((151 - BIAS - MAN) - e32, 30)  # >= 24 - MAN here; 30 shifts everything out
    sub = (full + (1 << (s - 1)) - 1 + ((full >> s) & 1)) >> s
    mag = tl.where(e32 <= 127 - BIAS, sub, normal)
    mag = tl.minimum(mag, MAX_BYTE)  # bytes are monotone in magnitude up to inf/NaN: this saturates
    neg = bits < 0
    if FNUZ:
        neg = neg & (mag != 0)
    out = tl.where(neg, mag | 0x80, mag)
    out = tl.where(a > 0x7F800000, NAN_BYTE, out)
    return out.to(tl.uint8)


@triton.jit
def decode_fp8_fp16(raw, EXP: tl.constexpr, FNUZ: tl.constexpr):
    """uint8 FP8 bytes -> float16 holding ``value * 2^(bias - 15)``, exactly, for every encoding but
    e5m2fnuz (its top binade would land on float16's inf/NaN exponent).

    The FP8 exponent and mantissa fields are placed straight into float16's fields: subnormals line up
    with float16 subnormals and e5m2's inf/NaN with float16's. Callers fold ``2^(15 - bias)`` into
    their scales. Three integer ops per value instead of the general decode's dozen.
    """
    x = raw.to(tl.int32)
    if EXP == 4:
        bits = ((x & 0x7F) << 7) | ((x & 0x80) << 8)
    else:
        bits = x << 8
    h = bits.to(tl.uint16).to(tl.float16, bitcast=True)
    if FNUZ:
        h = tl.where(x == 0x80, float("nan"), h)
    elif EXP == 4:
        h = tl.where((x & 0x7F) == 0x7F, float("nan"), h)
    return h


@triton.jit
def _widen(raw, FP8: tl.constexpr, FAST16: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
           FNUZ: tl.constexpr, SUBNORMAL: tl.constexpr):
    """Loaded cache elements as numbers: FP8 scaled by 2^(bias-15) when FAST16, else exact float32;
    other caches unchanged."""
    if FP8:  # one return: Triton checks every return's type, even in untaken constexpr branches
        if FAST16:
            raw = decode_fp8_fp16(raw, EXP, FNUZ)
        else:
            raw = decode_fp8(raw, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
    return raw


@triton.jit
def _load_tile(cache_ptr, rows, dims, mask, FP8: tl.constexpr, FAST16: tl.constexpr, EXP: tl.constexpr,
               MAN: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr, SUBNORMAL: tl.constexpr):
    """A gathered K or V tile (masked elements are 0, never NaN: they meet p = 0), widened."""
    return _widen(tl.load(cache_ptr + rows + dims, mask=mask, other=0), FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)


@triton.jit
def _load_tile_full(cache_ptr, rows, dims, FP8: tl.constexpr, FAST16: tl.constexpr, EXP: tl.constexpr,
                    MAN: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr, SUBNORMAL: tl.constexpr):
    """:func:`_load_tile` of a tile every element of which is read (no mask to evaluate)."""
    return _widen(tl.load(cache_ptr + rows + dims), FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)


@triton.jit
def _scores(q, kt, qk_scale, soft_cap, DOT16: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """q [M, D] @ kt [D, N] times the folded logit scale, soft-capped: 16-bit operands where DOT16
    (FP8 and same-dtype values are exact in the query's 16-bit type), else IEEE float32."""
    if DOT16:
        s = tl.dot(q, kt.to(q.dtype))
    else:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    s = s * qk_scale
    if HAS_SOFTCAP:
        s = soft_cap * _tanh(s / soft_cap)
    return s


@triton.jit
def _tanh(x):
    # exp-based (the interpreter has no libdevice); |error| ~1e-7, negligible against the cap.
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def attn_partition_kernel(
    out_ptr, q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, ks_ptr, vs_ptr, alibi_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    qk_scale, v_scale, soft_cap, window, num_heads, num_parts,
    stride_qn, stride_qh, stride_on, stride_oh, stride_kb, stride_vb, stride_bt, stride_bt_col,
    G: tl.constexpr, G_TILE: tl.constexpr, NUM_TILES: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, PART: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, FAST16: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
    FNUZ: tl.constexpr, SUBNORMAL: tl.constexpr, DOT16: tl.constexpr,
    K_SCALE_STRIDE: tl.constexpr, V_SCALE_STRIDE: tl.constexpr,  # -1: host float, 0: 0-d, 1: per head
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
):
    """One (sequence, KV head, head tile, partition): every query head of the tile shares each K/V
    tile read. DIRECT (one partition covers the context): normalise and write ``out``; otherwise
    write the partition's running max (log2 units), sum and unnormalised accumulator."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_TILES
    tile = tl.program_id(1) % NUM_TILES
    part = tl.program_id(2)
    seq64 = seq.to(tl.int64)

    L = tl.load(lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    start = tl.maximum(part * PART, lo)
    end = tl.minimum(part * PART + PART, L)

    rows = tile * G_TILE + tl.arange(0, G_TILE)  # query heads of the group; >= G is padding
    row_ok = rows < G
    heads = kvh * G + rows
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D

    q = tl.load(q_ptr + seq64 * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if not DOT16:
        q = q.to(tl.float32)
    if K_SCALE_STRIDE >= 0:
        qk_scale = qk_scale * tl.load(ks_ptr + kvh * K_SCALE_STRIDE)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0)

    m_i = tl.full([G_TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([G_TILE], tl.float32)
    acc = tl.zeros([G_TILE, D_PAD], tl.float32)
    head_off = kvh * (BS * D)  # blocks are dense: [hkv, BS, D] inside each
    # Tiles start at `start`, so each holds at least one live token and m_i is finite after it.
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        # Only table entries of live tokens are read: entries past a sequence's blocks may be junk.
        phys = tl.load(bt_ptr + seq64 * stride_bt + (toks // BS) * stride_bt_col, mask=tok_ok, other=0).to(tl.int64)
        slot = head_off + (toks % BS) * D

        k_rows = phys * stride_kb + slot
        kt = _load_tile(kc_ptr, k_rows[None, :], dims[:, None], tok_ok[None, :] & dim_ok[:, None],
                        FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)  # [D_PAD, BLOCK_N]
        s = _scores(q, kt, qk_scale, soft_cap, DOT16, HAS_SOFTCAP)
        if HAS_ALIBI:
            s = s + slopes[:, None] * (toks - (L - 1)).to(tl.float32)[None, :]
        s = tl.where(tok_ok[None, :], s * LOG2E, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_rows = phys * stride_vb + slot
        v = _load_tile(vc_ptr, v_rows[:, None], dims[None, :], tok_ok[:, None] & dim_ok[None, :],
                       FP8, FAST16, EXP, MAN, BIAS, FNUZ, SUBNORMAL)  # [BLOCK_N, D_PAD]
        if DOT16:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if DIRECT:
        if V_SCALE_STRIDE >= 0:
            v_scale = v_scale * tl.load(vs_ptr + kvh * V_SCALE_STRIDE)
        res = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
        res = tl.where(((rows * 0 + L) > 0)[:, None], res, 0.0)  # only an empty sequence gives zeros (NaN stays NaN)
        tl.store(out_ptr + seq64 * stride_on + heads[:, None] * stride_oh + dims[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Empty partitions write nothing; the merge derives which partitions are live from L.
        live = (rows * 0 + start) < end  # a vector: the interpreter rejects scalar & tensor masks
        ws_row = (seq64 * num_heads + heads) * num_parts + part
        tl.store(ws_m_ptr + ws_row, m_i, mask=row_ok & live)
        tl.store(ws_l_ptr + ws_row, l_i, mask=row_ok & live)
        tl.store(ws_acc_ptr + ws_row[:, None] * D + dims[None, :], acc, mask=out_mask & live[:, None])


@triton.jit
def attn_merge_kernel(
    out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, lens_ptr, vs_ptr,
    v_scale, window, num_heads, num_parts, stride_on, stride_oh,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PART: tl.constexpr, P_TILE: tl.constexpr,
    V_SCALE_STRIDE: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, query head)'s partitions, times v_scale, into ``out``."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq64 = seq.to(tl.int64)
    L = tl.load(lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    # Exactly the partitions the first kernel wrote: those meeting [lo, L).
    p_first = lo // PART
    p_end = (L + PART - 1) // PART
    base = (seq64 * num_heads + head) * num_parts
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D

    m_max = tl.full([P_TILE], float("-inf"), tl.float32)
    for p0 in range(p_first, p_end, P_TILE):
        ps = p0 + tl.arange(0, P_TILE)
        m_max = tl.maximum(m_max, tl.load(ws_m_ptr + base + ps, mask=ps < p_end, other=float("-inf")))
    big_m = tl.max(m_max, 0)

    total = tl.zeros([P_TILE], tl.float32)
    acc = tl.zeros([P_TILE, D_PAD], tl.float32)
    for p0 in range(p_first, p_end, P_TILE):
        ps = p0 + tl.arange(0, P_TILE)
        ok = ps < p_end
        m = tl.load(ws_m_ptr + base + ps, mask=ok, other=float("-inf"))
        w = tl.where(ok, tl.exp2(m - big_m), 0.0)
        total += w * tl.load(ws_l_ptr + base + ps, mask=ok, other=0.0)
        part_acc = tl.load(ws_acc_ptr + (base + ps)[:, None] * D + dims[None, :],
                           mask=ok[:, None] & dim_ok[None, :], other=0.0)
        acc += w[:, None] * part_acc
    l_sum = tl.sum(total, 0)
    if V_SCALE_STRIDE >= 0:
        v_scale = v_scale * tl.load(vs_ptr + (head // G) * V_SCALE_STRIDE)
    res = tl.sum(acc, 0) * (v_scale / tl.maximum(l_sum, 1e-30))
    res = tl.where((dims * 0 + L) > 0, res, 0.0)  # only an empty sequence gives zeros (NaN stays NaN)
    tl.store(out_ptr + seq64 * stride_on + head * stride_oh + dims, res.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


@triton.jit
def _write_rows(src_ptr, stride_t, stride_h, dst_ptr, stride_b, scale_ptr, scale, tok, heads, head_ok, dims,
                mask, blk, off, D: tl.constexpr, BS: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                FP8: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr,
                MAX_BYTE: tl.constexpr, NAN_BYTE: tl.constexpr):
    x = tl.load(src_ptr + tok * stride_t + heads[:, None] * stride_h + dims[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if SCALE_STRIDE >= 0:
        s = tl.load(scale_ptr + heads * SCALE_STRIDE, mask=head_ok, other=1.0)[:, None]
        q = tl.math.div_rn(x, s + tl.zeros_like(x))
    else:
        q = tl.math.div_rn(x, scale + tl.zeros_like(x))  # IEEE division, as hal.fp8 defines the write
    dst = dst_ptr + blk * stride_b + heads[:, None] * (BS * D) + off * D + dims[None, :]
    if FP8:
        tl.store(dst, encode_fp8(q, MAN, BIAS, FNUZ, MAX_BYTE, NAN_BYTE), mask=mask)
    else:
        tl.store(dst, q.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cache_kv_kernel(
    key_ptr, val_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, k_scale, v_scale, num_slots, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_vcb,
    D: tl.constexpr, D_PAD: tl.constexpr, H_TILE: tl.constexpr, BS: tl.constexpr,
    K_SCALE_STRIDE: tl.constexpr, V_SCALE_STRIDE: tl.constexpr,
    FP8: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr,
    MAX_BYTE: tl.constexpr, NAN_BYTE: tl.constexpr,
):
    """One token, H_TILE KV heads: quantize key and value rows into their slot. A negative slot
    (padding) or one past the cache is skipped: nothing is written out of bounds."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * H_TILE + tl.arange(0, H_TILE)
    dims = tl.arange(0, D_PAD)
    slot = tl.load(slot_ptr + tok + heads * 0)  # per head row: the interpreter rejects scalar masks
    head_ok = heads < num_kv_heads
    ok = (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot[:, None] // BS
    off = slot[:, None] % BS
    mask = (ok & head_ok)[:, None] & (dims < D)[None, :]
    _write_rows(key_ptr, stride_kt, stride_kh, kc_ptr, stride_kcb, ks_ptr, k_scale, tok, heads, head_ok, dims,
                mask, blk, off, D, BS, K_SCALE_STRIDE, FP8, MAN, BIAS, FNUZ, MAX_BYTE, NAN_BYTE)
    _write_rows(val_ptr, stride_vt, stride_vh, vc_ptr, stride_vcb, vs_ptr, v_scale, tok, heads, head_ok, dims,
                mask, blk, off, D, BS, V_SCALE_STRIDE, FP8, MAN, BIAS, FNUZ, MAX_BYTE, NAN_BYTE)
