"""The rocm pack's operations: choose the kernel, size the workspace, fill in the arguments, launch.

The same code drives the HIP runtime on an AMD GPU (:class:`launcher.HipBackend`) and the CPU
emulation of the same kernels (:class:`emulator.EmulatorBackend`): a backend only needs ``arch(device)``
and ``launch(kernel, grid, values, tensors)``. Arguments were validated by hal before they get here
(shapes, dtypes, the pack's declaration); what is checked here is what the kernels additionally
assume (alignment for their vector loads).
"""

from __future__ import annotations

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


def _check_cache(name: str, c: torch.Tensor) -> None:
    if not _aligned(c, 16, (0,)):
        raise ValueError(f"rocm pack: {name} must start on a 16-byte boundary with blocks 16-byte aligned "
                         f"(data_ptr % 16 = {c.data_ptr() % 16}, stride(0) = {c.stride(0)} elements); "
                         f"allocate it with torch.empty or view it from an aligned allocation")


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
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len) -> None:
    n, h, d = query.shape
    nb, hkv, bs, _ = key_cache.shape
    if n == 0:
        return
    if bs & (bs - 1):
        raise ValueError(f"rocm pack: block_size {bs} is not a power of two")
    arch = backend.arch(query.device)
    psize = tuning.partition_size(arch)
    g = h // hkv
    tiles = -(-g // 16)
    max_len = max_seq_len  # a host int: resolved once by validation (hal.ops.paged_attention.check)
    parts = max_partitions(max_len, psize, sliding_window)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache(name, c)
    q = _rows(query, 16)
    o = out if _aligned(out, 16, (0, 1)) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.contiguous()
    ks = k_scale.contiguous() if isinstance(k_scale, torch.Tensor) else k_scale
    vs = v_scale.contiguous() if isinstance(v_scale, torch.Tensor) else v_scale
    alibi = alibi_slopes.contiguous() if alibi_slopes is not None else None
    dev = query.device
    if parts > 1:
        tmp = torch.empty((n, h, parts, d), dtype=torch.float32, device=dev)
        sums = torch.empty((n, h, parts), dtype=torch.float32, device=dev)
        maxes = torch.empty((n, h, parts), dtype=torch.float32, device=dev)
    else:  # never read: one partition per sequence writes the output directly
        tmp = sums = maxes = torch.empty(0, dtype=torch.float32, device=dev)
    qn, cn = TYPE_NAMES[query.dtype], TYPE_NAMES[key_cache.dtype]
    values = {
        "out": o.data_ptr(), "tmp_out": tmp.data_ptr(), "exp_sums": sums.data_ptr(), "max_logits": maxes.data_ptr(),
        "query": q.data_ptr(), "key_cache": key_cache.data_ptr(), "value_cache": value_cache.data_ptr(),
        "block_tables": tables.data_ptr(), "seq_lens": lens.data_ptr(),
        "alibi_slopes": alibi.data_ptr() if alibi is not None else 0,
        "q_stride_seq": q.stride(0), "q_stride_head": q.stride(1), "o_stride_seq": o.stride(0),
        "o_stride_head": o.stride(1), "k_block_stride": key_cache.stride(0), "v_block_stride": value_cache.stride(0),
        "bt_stride": tables.stride(0), "scale": float(scale),
        "soft_cap": float(logits_soft_cap) if logits_soft_cap is not None else 0.0,
        "num_kv_heads": hkv, "gqa_ratio": g, "num_tiles": tiles, "block_size_log2": bs.bit_length() - 1,
        "sliding_window": sliding_window or 0, "partition_size": psize, "max_parts": parts,
        **_scale_args(ks, "k_scale"), **_scale_args(vs, "v_scale"),
    }
    touched = [o, tmp, sums, maxes, q, key_cache, value_cache, tables, lens] + [
        t for t in (ks, vs, alibi) if isinstance(t, torch.Tensor)]
    backend.launch(kernels.decode_name(qn, cn, d), (n, parts, hkv * tiles), values, touched)
    if parts > 1:
        reduce_values = {
            "out": o.data_ptr(), "tmp_out": tmp.data_ptr(), "exp_sums": sums.data_ptr(),
            "max_logits": maxes.data_ptr(), "seq_lens": lens.data_ptr(), "o_stride_seq": o.stride(0),
            "o_stride_head": o.stride(1), "num_heads": h, "head_size": d, "sliding_window": sliding_window or 0,
            "partition_size": psize, "max_parts": parts,
        }
        backend.launch(kernels.reduce_name(qn), (h, n, 1), reduce_values, [o, tmp, sums, maxes, lens])
    if o is not out:
        out.copy_(o)


def _cache_kv(backend, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    t = key.shape[0]
    nb, hkv, bs, d = key_cache.shape
    if t == 0:
        return
    if d % 4:
        raise ValueError(f"rocm pack: cache_kv needs head_size % 4 == 0, got {d}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache(name, c)
    group = 4 * key.element_size()  # the kernel reads 4 elements at a time
    k, v = _rows(key, group), _rows(value, group)
    slots = slot_mapping.contiguous()
    ks = k_scale.contiguous() if isinstance(k_scale, torch.Tensor) else k_scale
    vs = v_scale.contiguous() if isinstance(v_scale, torch.Tensor) else v_scale
    values = {
        "key": k.data_ptr(), "value": v.data_ptr(), "key_cache": key_cache.data_ptr(),
        "value_cache": value_cache.data_ptr(), "slot_mapping": slots.data_ptr(),
        "k_stride_tok": k.stride(0), "k_stride_head": k.stride(1), "v_stride_tok": v.stride(0),
        "v_stride_head": v.stride(1), "k_block_stride": key_cache.stride(0), "v_block_stride": value_cache.stride(0),
        "num_slots": nb * bs, "num_kv_heads": hkv, "head_size": d, "block_size": bs,
        **_scale_args(ks, "k_scale"), **_scale_args(vs, "v_scale"),
    }
    touched = [k, v, key_cache, value_cache, slots] + [s for s in (ks, vs) if isinstance(s, torch.Tensor)]
    name = kernels.cache_kv_name(TYPE_NAMES[key.dtype], TYPE_NAMES[key_cache.dtype])
    backend.launch(name, (t, 1, 1), values, touched)


__all__ = ["paged_attention", "cache_kv", "max_partitions", "TYPE_NAMES"]


def paged_attention(backend, call) -> None:
    """Run a validated :class:`hal.call.AttentionCall` through ``backend`` (HIP or the emulation)."""
    _paged_attention(backend, call.out, call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens, call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap, call.sliding_window, call.max_seq_len)


def cache_kv(backend, call) -> None:
    """Run a validated :class:`hal.call.CacheWriteCall` through ``backend``."""
    _cache_kv(backend, call.key, call.value, call.key_cache, call.value_cache, call.slot_mapping, call.k_scale, call.v_scale)
