"""Argument checks shared by every pack; they run before any kernel.

Each error names the argument, what was expected and what was given. Checks that would need a
device-to-host sync (block-table entries, slots and scale values on a GPU) run on CPU tensors
always and on GPU tensors only under ``HAL_DEBUG=1``; without it the native kernels skip
out-of-range slots instead of writing out of bounds.
"""

from __future__ import annotations

import logging
import math

import torch

from hal import env
from hal.fp8 import FP8_DTYPES, encoding_of
from hal.pack import CallKey

log = logging.getLogger("hal")

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *sorted(FP8_DTYPES, key=str))


class ArgumentError(ValueError):
    """An argument is malformed; the message names it."""


def _fail(op: str, arg: str, expected: str, given: str) -> None:
    raise ArgumentError(f"hal.{op}: {arg} must be {expected}; got {given}")


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)} on {t.device}"


def tensor(op: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(op, name, "a torch.Tensor", type(t).__name__)
    return t


def _check_caches(op: str, key_cache, value_cache) -> None:
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        tensor(op, name, c)
        if c.dtype == torch.uint8:
            try:
                encoding_of(torch.uint8)
            except TypeError as exc:
                raise ArgumentError(f"hal.{op}: {name} is uint8: {exc}") from None
        if c.dtype not in CACHE_DTYPES:
            _fail(op, name, "float16, bfloat16, float32 or a torch float8 dtype", _desc(c))
        if c.dim() != 4:
            _fail(op, name, "4-d [num_blocks, num_kv_heads, block_size, head_size] (HND)", _desc(c))
        nb, h, bs, d = c.shape
        # Blocks may be strided (a combined K/V allocation), each block itself must be dense.
        if c.stride(3) != 1 or c.stride(2) != d or c.stride(1) != bs * d:
            _fail(op, name, "dense within each block (strides [*, block_size*head_size, head_size, 1])",
                  f"strides {tuple(c.stride())}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        _fail(op, "value_cache", f"the same shape and dtype as key_cache ({_desc(key_cache)})", _desc(value_cache))
    if value_cache.device != key_cache.device:
        _fail(op, "value_cache", f"on key_cache's device {key_cache.device}", str(value_cache.device))


def _same_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        _fail(op, name, f"on {device} like the caches", str(t.device))


def _on_host_or_debug(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or env.debug()


_warned_unscaled: set[str] = set()


def scale(op: str, name: str, value, cache: torch.Tensor):
    """Normalise a k/v scale to a float or a float32 tensor (0-d or [num_kv_heads]) on the cache's
    device. ``None`` is 1.0; with an FP8 cache that logs one warning (an error under HAL_STRICT)."""
    num_kv_heads = cache.shape[1]
    if value is None:
        if cache.dtype in FP8_DTYPES and op not in _warned_unscaled:
            msg = (f"hal.{op}: no k_scale/v_scale given for a {str(cache.dtype).removeprefix('torch.')} cache; "
                   f"using 1.0 (pass calibrated scales, see hal.load_kv_scales)")
            if env.strict():
                raise ArgumentError(msg + " (HAL_STRICT=1 makes this an error)")
            _warned_unscaled.add(op)
            log.warning(msg)
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            _fail(op, name, "a float32 tensor", _desc(value))
        if value.dim() == 0 and value.device.type == "cpu" and cache.device.type != "cpu":
            value = value.item()  # a host scalar: no device sync involved
        else:
            if value.dim() not in (0, 1) or (value.dim() == 1 and value.shape[0] != num_kv_heads):
                _fail(op, name, f"a float, a 0-d tensor or a [num_kv_heads={num_kv_heads}] tensor", _desc(value))
            _same_device(op, name, value, cache.device)
            if _on_host_or_debug(value):
                bad = ~(torch.isfinite(value) & (value > 0))
                if bool(bad.any()):
                    _fail(op, name, "finite and > 0", f"{value.tolist()}")
            return value.contiguous()
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError(value)
        f = float(value)
    except (TypeError, ValueError):
        _fail(op, name, "a float or a float32 tensor", type(value).__name__)
    if not (math.isfinite(f) and f > 0):
        _fail(op, name, "finite and > 0", repr(f))
    return f


def _misaligned(*caches: torch.Tensor) -> bool:
    return any(c.data_ptr() % 16 or (c.stride(0) * c.element_size()) % 16 for c in caches)


def _features(alibi_slopes, soft_cap, window, k_scale, v_scale, caches=()) -> frozenset[str]:
    f = set()
    if _misaligned(*caches):
        f.add("misaligned_cache")
    if alibi_slopes is not None:
        f.add("alibi")
    if soft_cap is not None:
        f.add("soft_cap")
    if window is not None:
        f.add("sliding_window")
    if any(isinstance(s, torch.Tensor) and s.dim() == 1 for s in (k_scale, v_scale)):
        f.add("per_head_scales")
    return frozenset(f)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale, k_scale, v_scale,
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, out) -> CallKey:
    """Check every argument of paged_attention (scales already normalised); return the call's key."""
    op = "paged_attention"
    tensor(op, "query", query)
    _check_caches(op, key_cache, value_cache)
    nb, hkv, bs, d = key_cache.shape
    dev = key_cache.device
    if query.dtype not in QUERY_DTYPES:
        _fail(op, "query", "float16, bfloat16 or float32", _desc(query))
    if query.dim() != 3:
        _fail(op, "query", "3-d [num_seqs, num_heads, head_size]", _desc(query))
    _same_device(op, "query", query, dev)
    n, h, qd = query.shape
    if qd != d:
        _fail(op, "query", f"head_size {d} like the caches (last dim)", _desc(query))
    if query.stride(-1) != 1:
        _fail(op, "query", "contiguous in its last dim", f"strides {tuple(query.stride())}")
    if h % hkv != 0:
        _fail(op, "query", f"a number of heads divisible by num_kv_heads={hkv}", f"{h} heads")

    tensor(op, "block_tables", block_tables)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != n:
        _fail(op, "block_tables", f"an int32 [num_seqs={n}, max_blocks_per_seq] tensor", _desc(block_tables))
    _same_device(op, "block_tables", block_tables, dev)
    tensor(op, "seq_lens", seq_lens)
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] != n:
        _fail(op, "seq_lens", f"an int32 [num_seqs={n}] tensor", _desc(seq_lens))
    _same_device(op, "seq_lens", seq_lens, dev)
    capacity = block_tables.shape[1] * bs

    if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0):
        _fail(op, "scale", "a finite float > 0 (or None for head_size**-0.5)", repr(scale))
    if alibi_slopes is not None:
        tensor(op, "alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32 or alibi_slopes.shape != (h,):
            _fail(op, "alibi_slopes", f"a float32 [num_heads={h}] tensor", _desc(alibi_slopes))
        _same_device(op, "alibi_slopes", alibi_slopes, dev)
    if logits_soft_cap is not None and not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0):
        _fail(op, "logits_soft_cap", "None or a finite float > 0", repr(logits_soft_cap))
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        _fail(op, "sliding_window", "None (no window) or an int >= 1 (keys at positions >= seq_len - window)",
              repr(sliding_window))
    if max_seq_len is not None:
        if not isinstance(max_seq_len, int) or max_seq_len < 0:
            _fail(op, "max_seq_len", "None or an int >= 0", repr(max_seq_len))
        if max_seq_len > capacity:
            _fail(op, "max_seq_len", f"<= the block table's capacity {capacity} tokens", str(max_seq_len))
    elif dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _fail(op, "max_seq_len", "given while a CUDA graph is being captured (it sizes the split-K "
              "workspace without a device sync)", "None")

    if out is not None:
        tensor(op, "out", out)
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
            _fail(op, "out", f"like query ({_desc(query)}, contiguous last dim)", _desc(out))

    if _on_host_or_debug(seq_lens) and n > 0:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > capacity:
            _fail(op, "seq_lens", f"within [0, {capacity}] (block_tables has {block_tables.shape[1]} blocks "
                  f"of {bs} tokens per sequence)", f"values from {lo} to {hi}")
        if max_seq_len is not None and hi > max_seq_len:
            _fail(op, "max_seq_len", f">= every seq_len (max is {hi})", str(max_seq_len))
        used = (seq_lens.to(torch.int64) + bs - 1) // bs
        cols = torch.arange(block_tables.shape[1], device=dev)
        refs = block_tables[cols[None, :] < used[:, None]]
        if refs.numel() and (int(refs.min()) < 0 or int(refs.max()) >= nb):
            _fail(op, "block_tables", f"entries in [0, {nb}) for every block a sequence uses",
                  f"entries from {int(refs.min())} to {int(refs.max())}")

    return CallKey(op, dev.type, query.dtype, key_cache.dtype, d, bs, h // hkv,
                   _features(alibi_slopes, logits_soft_cap, sliding_window, k_scale, v_scale,
                             (key_cache, value_cache)))


def cache_kv(key, value, key_cache, value_cache, slot_mapping, *, k_scale, v_scale) -> CallKey:
    op = "cache_kv"
    tensor(op, "key", key)
    tensor(op, "value", value)
    _check_caches(op, key_cache, value_cache)
    nb, hkv, bs, d = key_cache.shape
    dev = key_cache.device
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in QUERY_DTYPES:
            _fail(op, name, "float16, bfloat16 or float32", _desc(t))
        if t.dim() != 3 or t.shape[1:] != (hkv, d):
            _fail(op, name, f"3-d [num_tokens, num_kv_heads={hkv}, head_size={d}]", _desc(t))
        if t.stride(-1) != 1:
            _fail(op, name, "contiguous in its last dim", f"strides {tuple(t.stride())}")
        _same_device(op, name, t, dev)
    if value.shape != key.shape or value.dtype != key.dtype:
        _fail(op, "value", f"the same shape and dtype as key ({_desc(key)})", _desc(value))
    tensor(op, "slot_mapping", slot_mapping)
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        _fail(op, "slot_mapping", f"an int64 [num_tokens={key.shape[0]}] tensor", _desc(slot_mapping))
    _same_device(op, "slot_mapping", slot_mapping, dev)
    if _on_host_or_debug(slot_mapping) and slot_mapping.numel():
        hi = int(slot_mapping.max())
        if hi >= nb * bs:
            _fail(op, "slot_mapping", f"< num_blocks*block_size = {nb * bs} (negative slots skip a token)",
                  f"a slot of {hi}")
    return CallKey(op, dev.type, key.dtype, key_cache.dtype, d, bs, 1,
                   _features(None, None, None, k_scale, v_scale, (key_cache, value_cache)))
