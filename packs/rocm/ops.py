"""The rocm pack's operations: choose the kernel, size the workspace, fill in the arguments, launch.

The same code drives the HIP runtime on an AMD GPU (:class:`launcher.HipBackend`) and the CPU
emulation of the same kernels (:class:`emulator.EmulatorBackend`): a backend only needs ``arch(device)``
and ``launch(kernel, grid, values, tensors)``. Arguments were validated by hal before they get here
(shapes, dtypes, the pack's declaration); what is checked here is what the kernels additionally
assume (alignment for their vector loads).
"""

from __future__ import annotations

import dataclasses

import torch

from . import kernels, tuning

TYPE_NAMES = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
    torch.float8_e4m3fnuz: "e4m3fnuz", torch.float8_e5m2fnuz: "e5m2fnuz",
    torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2",
}


def _aligned(t: torch.Tensor, nbytes: int, dims) -> bool:
    isz = t.element_size()
    return t.data_ptr() % nbytes == 0 and all((t.stride(d) * isz) % nbytes == 0 for d in dims)


def _rows(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t`` itself if its rows start on ``nbytes`` boundaries, else an aligned contiguous copy."""
    if _aligned(t, nbytes, range(t.dim() - 1)):
        return t
    c = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return c.copy_(t)


def _check_cache(name: str, c: torch.Tensor, rows: int = 16) -> None:
    """A cache's start and blocks on 16-byte boundaries, its head and token rows on ``rows``-byte ones
    (the kernels' vector accesses: 16-byte loads in attention, 4-element stores in cache_kv)."""
    if not (_aligned(c, 16, (0,)) and _aligned(c, rows, (1, 2))):
        raise ValueError(f"rocm pack: {name} must start on a 16-byte boundary with its blocks 16-byte and its heads "
                         f"and tokens {rows}-byte aligned (data_ptr % 16 = {c.data_ptr() % 16}, strides "
                         f"{tuple(c.stride())} x {c.element_size()} bytes); allocate it with torch.empty or view it "
                         f"from an aligned allocation (an NHD cache's permute(0, 2, 1, 3) view is fine)")


def _scale_args(s, prefix: str) -> dict:
    if isinstance(s, torch.Tensor):
        return {f"{prefix}_ptr": s.data_ptr(), f"{prefix}_val": 0.0, f"{prefix}_stride": s.stride(0) if s.dim() else 0}
    return {f"{prefix}_ptr": 0, f"{prefix}_val": float(s), f"{prefix}_stride": 0}


def max_partitions(max_len: int, partition_size: int, sliding_window: int | None) -> int:
    parts = -(-max_len // partition_size)
    if sliding_window is not None:  # a window of w tokens spans at most this many partitions
        parts = min(parts, (sliding_window + partition_size - 2) // partition_size + 1)
    return max(parts, 1)  # partition 0 also writes the zeros of empty sequences


def _paged_attention(backend, out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                     alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, query_start_loc=None,
                     max_query_len=1, causal=True) -> None:
    """Decode (one row a sequence), or with ``query_start_loc`` a multi-token call: sequences of more
    than one row through the prefill kernel, those of one row through the decode kernels (their
    split-K and merge), both launched from host ints (``max_query_len``, ``max_seq_len``)."""
    total_q, h, d = query.shape
    nb, hkv, bs, _ = key_cache.shape
    n = seq_lens.shape[0]
    if total_q == 0 or n == 0:
        return
    if bs & (bs - 1):
        raise ValueError(f"rocm pack: block_size {bs} is not a power of two")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache(name, c)
    g = h // hkv
    q = _rows(query, 16)
    o = out if _aligned(out, 16, (0, 1)) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.contiguous()
    qsl = query_start_loc.contiguous() if query_start_loc is not None else None
    ks = k_scale.contiguous() if isinstance(k_scale, torch.Tensor) else k_scale
    vs = v_scale.contiguous() if isinstance(v_scale, torch.Tensor) else v_scale
    alibi = alibi_slopes.contiguous() if alibi_slopes is not None else None
    qn, cn = TYPE_NAMES[query.dtype], TYPE_NAMES[key_cache.dtype]
    common = {
        "out": o.data_ptr(), "query": q.data_ptr(), "key_cache": key_cache.data_ptr(),
        "value_cache": value_cache.data_ptr(), "block_tables": tables.data_ptr(), "seq_lens": lens.data_ptr(),
        "query_start_loc": qsl.data_ptr() if qsl is not None else 0,
        "alibi_slopes": alibi.data_ptr() if alibi is not None else 0,
        "k_block_stride": key_cache.stride(0), "k_head_stride": key_cache.stride(1),
        "k_token_stride": key_cache.stride(2), "v_block_stride": value_cache.stride(0),
        "v_head_stride": value_cache.stride(1), "v_token_stride": value_cache.stride(2),
        "bt_stride": tables.stride(0), "scale": float(scale),
        "soft_cap": float(logits_soft_cap) if logits_soft_cap is not None else 0.0,
        "block_size_log2": bs.bit_length() - 1, "sliding_window": sliding_window or 0,
        **_scale_args(ks, "k_scale"), **_scale_args(vs, "v_scale"),
    }
    inputs = [o, q, key_cache, value_cache, tables, lens] + [t for t in (qsl, ks, vs, alibi) if isinstance(t, torch.Tensor)]
    multi = qsl is not None and max_query_len > 1
    if multi:
        row_tiles = -(-max_query_len * g // kernels.PREFILL_ROWS)
        values = {**common, "q_stride_tok": q.stride(0), "q_stride_head": q.stride(1), "o_stride_tok": o.stride(0),
                  "o_stride_head": o.stride(1), "gqa_ratio": g, "causal": int(causal)}
        backend.launch(kernels.prefill_name(qn, cn, d), (n, row_tiles, hkv), values, inputs)
    _decode_rows(backend, common, inputs, o, q, n, h, hkv, d, qn, cn, max_seq_len, sliding_window)
    if o is not out:
        out.copy_(o)


def _decode_rows(backend, common, inputs, o, q, n, h, hkv, d, qn, cn, max_seq_len, sliding_window) -> None:
    """The decode kernel (and its merge when the context is split) over every sequence; with
    ``query_start_loc`` in ``common`` only sequences of one query row are computed."""
    psize = tuning.partition_size(backend.arch(q.device))
    g = h // hkv
    tiles = -(-g // 16)
    parts = max_partitions(max_seq_len, psize, sliding_window)  # max_seq_len: a host int from validation
    dev = q.device
    if parts > 1:
        tmp = torch.empty((n, h, parts, d), dtype=torch.float32, device=dev)
        sums = torch.empty((n, h, parts), dtype=torch.float32, device=dev)
        maxes = torch.empty((n, h, parts), dtype=torch.float32, device=dev)
    else:  # never read: one partition per sequence writes the output directly
        tmp = sums = maxes = torch.empty(0, dtype=torch.float32, device=dev)
    values = {
        **common, "tmp_out": tmp.data_ptr(), "exp_sums": sums.data_ptr(), "max_logits": maxes.data_ptr(),
        "q_stride_seq": q.stride(0), "q_stride_head": q.stride(1), "o_stride_seq": o.stride(0),
        "o_stride_head": o.stride(1), "num_kv_heads": hkv, "gqa_ratio": g, "num_tiles": tiles,
        "partition_size": psize, "max_parts": parts,
    }
    backend.launch(kernels.decode_name(qn, cn, d), (n, parts, hkv * tiles), values, inputs + [tmp, sums, maxes])
    if parts > 1:
        reduce_values = {
            "out": o.data_ptr(), "tmp_out": tmp.data_ptr(), "exp_sums": sums.data_ptr(),
            "max_logits": maxes.data_ptr(), "seq_lens": common["seq_lens"],
            "query_start_loc": common["query_start_loc"], "o_stride_seq": o.stride(0),
            "o_stride_head": o.stride(1), "num_heads": h, "head_size": d, "sliding_window": sliding_window or 0,
            "partition_size": psize, "max_parts": parts,
        }
        backend.launch(kernels.reduce_name(qn), (h, n, 1), reduce_values, inputs + [tmp, sums, maxes])


def _cache_kv(backend, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    t = key.shape[0]
    nb, hkv, bs, d = key_cache.shape
    if t == 0:
        return
    if d % 4:
        raise ValueError(f"rocm pack: cache_kv needs head_size % 4 == 0, got {d}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache(name, c, 4 * c.element_size())  # 4 elements a store
    group = 4 * key.element_size()  # the kernel reads 4 elements at a time
    k, v = _rows(key, group), _rows(value, group)
    slots = slot_mapping.contiguous()
    ks = k_scale.contiguous() if isinstance(k_scale, torch.Tensor) else k_scale
    vs = v_scale.contiguous() if isinstance(v_scale, torch.Tensor) else v_scale
    values = {
        "key": k.data_ptr(), "value": v.data_ptr(), "key_cache": key_cache.data_ptr(),
        "value_cache": value_cache.data_ptr(), "slot_mapping": slots.data_ptr(),
        "k_stride_tok": k.stride(0), "k_stride_head": k.stride(1), "v_stride_tok": v.stride(0),
        "v_stride_head": v.stride(1), "k_block_stride": key_cache.stride(0), "k_head_stride": key_cache.stride(1),
        "k_token_stride": key_cache.stride(2), "v_block_stride": value_cache.stride(0),
        "v_head_stride": value_cache.stride(1), "v_token_stride": value_cache.stride(2), "num_slots": nb * bs, "num_kv_heads": hkv, "head_size": d, "block_size": bs,
        **_scale_args(ks, "k_scale"), **_scale_args(vs, "v_scale"),
    }
    touched = [k, v, key_cache, value_cache, slots] + [s for s in (ks, vs) if isinstance(s, torch.Tensor)]
    name = kernels.cache_kv_name(TYPE_NAMES[key.dtype], TYPE_NAMES[key_cache.dtype])
    backend.launch(name, (t, 1, 1), values, touched)


# ---------------------------------------------------------------------------------------------------
# MLA decode and cache_mla (csrc/mla_decode.h, mla_reduce.h, cache_rows.h: the MLA code object)

@dataclasses.dataclass(frozen=True)
class MlaPlan:
    """How one MLA decode call is launched, from host ints only (no device read)."""

    decode: str          # kernel names
    reduce: str | None   # None: one partition, the decode kernel writes the output
    rows: int            # rows (query token x head pairs) per workgroup: 16 or 32
    row_tiles: int
    partition_size: int  # tokens, a multiple of kernels.MLA_STEP
    num_parts: int

    def grid_for(self, num_seqs: int) -> tuple[int, int, int]:
        return (num_seqs, self.row_tiles, self.num_parts)


def mla_split(units: int, max_len: int, compute_units: int, workgroups_per_cu: int,
              min_partition: int) -> tuple[int, int]:
    """(partition_size, num_parts): cut the context until ``units`` (sequences x row tiles) times the
    partitions about fill the GPU's resident workgroups once, never into partitions under
    ``min_partition`` tokens; sizes are multiples of the decode step (16 tokens)."""
    max_len = max(max_len, 1)
    slots = compute_units * workgroups_per_cu
    parts = max(1, slots // max(1, units))
    parts = min(parts, max(1, max_len // min_partition))
    step = kernels.MLA_STEP
    per_part = -(-max_len // parts)
    size = -(-per_part // step) * step
    return size, -(-max_len // size)


def mla_plan(arch: str, compute_units: int | None, num_seqs: int, num_heads: int, max_query_len: int,
             max_seq_len: int, query: str, latent: str) -> MlaPlan:
    """The kernels, row tiling and split of one call: 16 rows a workgroup when a sequence has at most
    16 (one wave per 9 of the 36 S chunks), else 32 (two row groups)."""
    t = tuning.mla_decode(arch)
    rows_per_seq = max(1, max_query_len * num_heads)
    rows = kernels.MLA_ROWS[0] if rows_per_seq <= kernels.MLA_ROWS[0] else kernels.MLA_ROWS[1]
    row_tiles = -(-rows_per_seq // rows)
    size, parts = mla_split(num_seqs * row_tiles, max_seq_len, compute_units or t["compute_units"],
                            t["workgroups_per_cu"], t["min_partition"])
    return MlaPlan(kernels.mla_decode_name(query, latent, rows), kernels.mla_reduce_name(query) if parts > 1 else None,
                   rows, row_tiles, size, parts)


def _mla_scale(s, prefix: str) -> dict:
    if isinstance(s, torch.Tensor):
        return {f"{prefix}_ptr": s.data_ptr(), f"{prefix}_val": 0.0}
    return {f"{prefix}_ptr": 0, f"{prefix}_val": float(s)}


def _token_rows(name: str, c: torch.Tensor, nbytes: int) -> None:
    """An MLA cache's token rows must start on ``nbytes`` boundaries (the kernels' vector accesses)."""
    isz = c.element_size()
    if c.data_ptr() % nbytes or (c.stride(0) * isz) % nbytes or (c.stride(1) * isz) % nbytes:
        raise ValueError(f"rocm pack: {name} needs {nbytes}-byte aligned token rows (data pointer, block and token "
                         f"strides multiples of {nbytes} bytes); got data_ptr % {nbytes} = {c.data_ptr() % nbytes}, "
                         f"strides {tuple(c.stride())} x {isz} bytes. View it from an aligned allocation, or pass "
                         f"pack='emu'")


def _compute_units(backend, device) -> int | None:
    f = getattr(backend, "compute_units", None)
    return f(device) if f is not None else None


def _mla_decode(backend, out, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale, ckv_scale,
                kpe_scale, query_start_loc, max_query_len, max_seq_len) -> MlaPlan | None:
    total_q, h, r = q_nope.shape
    bs = ckv_cache.shape[1]
    p = kpe_cache.shape[2]
    n = seq_lens.shape[0]
    if r != 512 or p != 64:
        raise ValueError(f"rocm pack: mla_decode serves R = 512, P = 64; got R = {r}, P = {p}")
    if bs & (bs - 1):
        raise ValueError(f"rocm pack: block_size {bs} is not a power of two")
    if kpe_cache.dtype != q_nope.dtype:
        raise ValueError(f"rocm pack: kpe_cache must have the query's dtype {q_nope.dtype}; got {kpe_cache.dtype}")
    if ckv_cache.element_size() != 1 and ckv_cache.dtype != q_nope.dtype:
        raise ValueError(f"rocm pack: a 16-bit ckv_cache must have the query's dtype {q_nope.dtype}; "
                         f"got {ckv_cache.dtype}")
    if total_q == 0 or n == 0:
        return None
    dev = q_nope.device
    qn, cn = TYPE_NAMES[q_nope.dtype], TYPE_NAMES[ckv_cache.dtype]
    plan = mla_plan(backend.arch(dev), _compute_units(backend, dev), n, h, max_query_len, max_seq_len, qn, cn)
    _token_rows("ckv_cache", ckv_cache, 16)   # 16-byte latent loads
    _token_rows("kpe_cache", kpe_cache, 8)    # 8-byte rope loads
    qn_t, qp_t = _rows(q_nope, 8), _rows(q_pe, 8)
    o = out if _aligned(out, 16, (0, 1)) else torch.empty(out.shape, dtype=out.dtype, device=dev)
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.contiguous()
    qsl = query_start_loc.contiguous() if query_start_loc is not None else None
    cs = ckv_scale.reshape(()).contiguous() if isinstance(ckv_scale, torch.Tensor) else ckv_scale
    ps = kpe_scale.reshape(()).contiguous() if isinstance(kpe_scale, torch.Tensor) else kpe_scale
    parts = plan.num_parts
    if parts > 1:
        tmp = torch.empty((total_q, h, parts, r), dtype=torch.float32, device=dev)
        ml = torch.empty((total_q, h, parts, 2), dtype=torch.float32, device=dev)
    else:  # never touched: one partition writes the output directly
        tmp = ml = torch.empty(0, dtype=torch.float32, device=dev)
    values = {
        "out": o.data_ptr(), "tmp_out": tmp.data_ptr(), "part_ml": ml.data_ptr(), "q_nope": qn_t.data_ptr(),
        "q_pe": qp_t.data_ptr(), "ckv_cache": ckv_cache.data_ptr(), "kpe_cache": kpe_cache.data_ptr(),
        "block_tables": tables.data_ptr(), "seq_lens": lens.data_ptr(),
        "query_start_loc": qsl.data_ptr() if qsl is not None else 0,
        "qn_stride_tok": qn_t.stride(0), "qn_stride_head": qn_t.stride(1), "qp_stride_tok": qp_t.stride(0),
        "qp_stride_head": qp_t.stride(1), "o_stride_tok": o.stride(0), "o_stride_head": o.stride(1),
        "ckv_block_stride": ckv_cache.stride(0), "ckv_token_stride": ckv_cache.stride(1),
        "kpe_block_stride": kpe_cache.stride(0), "kpe_token_stride": kpe_cache.stride(1),
        "bt_stride": tables.stride(0), "scale": float(scale), "num_heads": h, "block_size_log2": bs.bit_length() - 1,
        "partition_size": plan.partition_size, "num_parts": parts,
        **_mla_scale(cs, "ckv_scale"), **_mla_scale(ps, "kpe_scale"),
    }
    touched = [o, tmp, ml, qn_t, qp_t, ckv_cache, kpe_cache, tables, lens] + [
        t for t in (qsl, cs, ps) if isinstance(t, torch.Tensor)]
    backend.launch(plan.decode, plan.grid_for(n), values, touched)
    if plan.reduce is not None:
        reduce_values = {
            "out": o.data_ptr(), "tmp_out": tmp.data_ptr(), "part_ml": ml.data_ptr(),
            "o_stride_tok": o.stride(0), "o_stride_head": o.stride(1), "num_heads": h, "num_parts": parts,
            **_mla_scale(cs, "ckv_scale"),
        }
        backend.launch(plan.reduce, (h, total_q, 1), reduce_values,
                       [o, tmp, ml] + [cs] * isinstance(cs, torch.Tensor))
    if o is not out:
        out.copy_(o)
    return plan


def _cache_rows(backend, src, cache, slot_mapping, s, name: str) -> None:
    t, width = src.shape
    nb, bs, _ = cache.shape
    if width % 4:
        raise ValueError(f"rocm pack: cache_mla writes groups of 4 elements; {name}'s width {width} is not a "
                         f"multiple of 4")
    _token_rows(name, cache, 4 * cache.element_size())  # 4 elements per store
    x = _rows(src, 4 * src.element_size())              # 4 elements per load
    scale = s.reshape(()).contiguous() if isinstance(s, torch.Tensor) else s
    values = {
        "src": x.data_ptr(), "cache": cache.data_ptr(), "slot_mapping": slot_mapping.data_ptr(),
        "src_stride": x.stride(0), "block_stride": cache.stride(0), "token_stride": cache.stride(1),
        "num_slots": nb * bs, "width": width, "block_size": bs,
        **({"scale_ptr": scale.data_ptr(), "scale_val": 0.0} if isinstance(scale, torch.Tensor)
           else {"scale_ptr": 0, "scale_val": float(scale)}),
    }
    touched = [x, cache, slot_mapping] + [scale] * isinstance(scale, torch.Tensor)
    backend.launch(kernels.cache_rows_name(TYPE_NAMES[src.dtype], TYPE_NAMES[cache.dtype]), (t, 1, 1), values, touched)


__all__ = ["TYPE_NAMES", "cache_kv", "cache_mla", "max_partitions", "mla_decode", "mla_plan", "mla_split",
           "paged_attention"]


def paged_attention(backend, call) -> None:
    """Run a validated :class:`hal.call.AttentionCall` through ``backend`` (HIP or the emulation)."""
    _paged_attention(backend, call.out, call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens,
                     call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap,
                     call.sliding_window, call.max_seq_len, call.query_start_loc, call.max_query_len, call.causal)


def cache_kv(backend, call) -> None:
    """Run a validated :class:`hal.call.CacheWriteCall` through ``backend``."""
    _cache_kv(backend, call.key, call.value, call.key_cache, call.value_cache, call.slot_mapping, call.k_scale, call.v_scale)


def mla_decode(backend, call) -> None:
    """Run a validated :class:`hal.call.MLACall` through ``backend`` (R = 512, P = 64)."""
    _mla_decode(backend, call.out, call.q_nope, call.q_pe, call.ckv_cache, call.kpe_cache, call.block_tables,
                call.seq_lens, call.scale, call.ckv_scale, call.kpe_scale, call.query_start_loc, call.max_query_len,
                call.max_seq_len)


def cache_mla(backend, call) -> None:
    """Run a validated :class:`hal.call.MLAWriteCall`: the latent rows, then the rotary rows."""
    if call.kv_c.shape[0] == 0:
        return
    slots = call.slot_mapping.contiguous()
    _cache_rows(backend, call.kv_c, call.ckv_cache, slots, call.ckv_scale, "ckv_cache")
    _cache_rows(backend, call.k_pe, call.kpe_cache, slots, call.kpe_scale, "kpe_cache")
