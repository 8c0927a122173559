"""Argument checks shared by every pack; they run before any kernel.

Each error names the argument, what was expected and what was given. Checks that would need a
device-to-host sync (block-table entries, slots and scale values on a GPU) run on CPU tensors
always and on GPU tensors only under ``HAL_DEBUG=1``; without it the native kernels skip
out-of-range slots instead of writing out of bounds.
"""

from __future__ import annotations

import math

import torch

from hal import diagnostics, env
from hal.fp8 import FP8_DTYPES, encoding_of
from hal.pack import CallKey

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


def integer(op: str, name: str, v, minimum: int, meaning: str) -> None:
    """``v`` is None or a Python int >= ``minimum`` (a bool is refused: True is not a window of 1)."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
        _fail(op, name, f"None ({meaning}) or an int >= {minimum}", f"{v!r} ({type(v).__name__})")


def real(op: str, name: str, v, expected: str = "a float") -> float:
    """A Python number (not a bool, not a string) as a float."""
    if isinstance(v, (bool, str, bytes)) or isinstance(v, torch.Tensor) or not hasattr(v, "__float__"):
        _fail(op, name, expected, f"{v!r} ({type(v).__name__})")
    return float(v)


_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_MIN_SUBNORMAL = 2.0 ** -149


def positive_f32(f: float) -> bool:
    """Finite and > 0 once stored as float32 (1e39 would be inf in a kernel, 1e-46 would be 0)."""
    return math.isfinite(f) and _F32_MIN_SUBNORMAL <= f <= _F32_MAX


def positive_f32_text(f: float, what: str = "finite and > 0") -> str:
    if math.isfinite(f) and f > 0:  # a positive double that float32 turns into inf or 0
        return f"{what} as a float32 (which holds 1.4e-45 to 3.4e38)"
    return what


def no_autograd(op: str, tensors: dict) -> None:
    """hal's ops are inference-only: no backward is defined, and writing a graph-tracked tensor into
    a cache would attach the cache to autograd (memory growing over a generation). Refused loudly."""
    if not torch.is_grad_enabled():
        return
    names = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if names:
        raise ArgumentError(
            f"hal.{op}: {', '.join(names)} require{'s' if len(names) == 1 else ''} grad; hal's ops are "
            f"inference-only (no backward): call under torch.no_grad() or torch.inference_mode(), or pass "
            f"detached tensors")


def devices(op: str, tensors: dict) -> None:
    """A meta tensor among real ones would route the whole call to the shape-only (fake) kernel:
    nothing validated, nothing computed. All-meta calls (shape inference) are fine; a 0-d CPU
    tensor is a host scalar and may accompany any device."""
    kinds = {n: t.device.type for n, t in tensors.items() if isinstance(t, torch.Tensor)
             and not (t.dim() == 0 and t.device.type == "cpu")}
    meta = sorted(n for n, k in kinds.items() if k == "meta")
    real_ = sorted(n for n, k in kinds.items() if k != "meta")
    if meta and real_:
        t0 = tensors[real_[0]]
        raise ArgumentError(f"hal.{op}: {', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device "
                            f"while {', '.join(real_)} {'is' if len(real_) == 1 else 'are'} on {t0.device}: "
                            f"every tensor must be on one device (all-meta calls infer shapes only)")


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
        for dim, what in ((h, "num_kv_heads"), (bs, "block_size"), (d, "head_size")):
            if dim < 1:
                _fail(op, name, f"[num_blocks, num_kv_heads, block_size, head_size] with {what} >= 1", _desc(c))
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
    device (the cache is validated first). ``None`` is 1.0; with an FP8 cache that warns once per op
    (:class:`hal.MissingScaleWarning`), and is an error under HAL_STRICT on every call."""
    num_kv_heads = cache.shape[1]
    if value is None:
        if cache.dtype in FP8_DTYPES:
            msg = (f"hal.{op}: no k_scale/v_scale given for a {str(cache.dtype).removeprefix('torch.')} cache; "
                   f"using 1.0 (pass calibrated scales, see hal.load_kv_scales)")
            if env.strict():  # before the warn-once check: strict mode raises on every such call
                raise ArgumentError(msg + " (HAL_STRICT=1 makes this an error)")
            if op not in _warned_unscaled:
                _warned_unscaled.add(op)
                diagnostics.warn(msg, diagnostics.MissingScaleWarning, stacklevel=5)
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            _fail(op, name, "a float32 tensor", _desc(value))
        if value.dim() == 0 and value.device.type == "cpu" and cache.device.type != "cpu":
            value = float(value.item())  # a host scalar: no device sync involved
        else:
            if value.dim() not in (0, 1) or (value.dim() == 1 and value.shape[0] != num_kv_heads):
                _fail(op, name, f"a float, a 0-d tensor or a [num_kv_heads={num_kv_heads}] tensor", _desc(value))
            _same_device(op, name, value, cache.device)
            if _on_host_or_debug(value):
                bad = ~(torch.isfinite(value) & (value > 0))
                if bool(bad.any()):
                    _fail(op, name, "finite and > 0", f"{value.tolist()}")
            return value.contiguous()
    f = real(op, name, value, "a float or a float32 tensor")
    if not positive_f32(f):
        _fail(op, name, positive_f32_text(f), repr(f))
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
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, out):
    """Check every argument of paged_attention; return the call's key and the scales normalised
    (float or float32 tensor on the caches' device)."""
    op = "paged_attention"
    tensor(op, "query", query)
    _check_caches(op, key_cache, value_cache)
    k_scale = scale_(op, "k_scale", k_scale, key_cache)
    v_scale = scale_(op, "v_scale", v_scale, value_cache)
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

    if isinstance(scale, bool) or not isinstance(scale, float) or not positive_f32(scale):
        _fail(op, "scale", "a finite float > 0 (or None for head_size**-0.5)"
              + (" as a float32" if isinstance(scale, float) and scale > 0 and math.isfinite(scale) else ""),
              repr(scale))
    if alibi_slopes is not None:
        tensor(op, "alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32 or alibi_slopes.shape != (h,):
            _fail(op, "alibi_slopes", f"a float32 [num_heads={h}] tensor", _desc(alibi_slopes))
        _same_device(op, "alibi_slopes", alibi_slopes, dev)
    if logits_soft_cap is not None:
        cap = real(op, "logits_soft_cap", logits_soft_cap, "None or a finite float > 0")
        if not positive_f32(cap):
            _fail(op, "logits_soft_cap", "None or " + positive_f32_text(cap, "a finite float > 0"),
                  repr(logits_soft_cap))
    integer(op, "sliding_window", sliding_window, 1, "no window; else keys at positions >= seq_len - window")
    integer(op, "max_seq_len", max_seq_len, 0, "read from seq_lens")
    if max_seq_len is not None:
        if max_seq_len > capacity:
            _fail(op, "max_seq_len", f"<= the block table's capacity {capacity} tokens", str(max_seq_len))
    elif dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _fail(op, "max_seq_len", "given while a CUDA graph is being captured (it sizes the split-K "
              "workspace without a device sync)", "None")

    if out is not None:
        tensor(op, "out", out)
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            _fail(op, "out", f"like query ({_desc(query)})", _desc(out))

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
                             (key_cache, value_cache))), k_scale, v_scale


def cache_kv(key, value, key_cache, value_cache, slot_mapping, *, k_scale, v_scale):
    """Check every argument of cache_kv; return the call's key and the normalised scales."""
    op = "cache_kv"
    tensor(op, "key", key)
    tensor(op, "value", value)
    _check_caches(op, key_cache, value_cache)
    k_scale = scale_(op, "k_scale", k_scale, key_cache)
    v_scale = scale_(op, "v_scale", v_scale, value_cache)
    nb, hkv, bs, d = key_cache.shape
    dev = key_cache.device
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in QUERY_DTYPES:
            _fail(op, name, "float16, bfloat16 or float32", _desc(t))
        if t.dim() != 3 or t.shape[1:] != (hkv, d):
            _fail(op, name, f"3-d [num_tokens, num_kv_heads={hkv}, head_size={d}]", _desc(t))
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
                   _features(None, None, None, k_scale, v_scale, (key_cache, value_cache))), k_scale, v_scale


scale_ = scale  # the name `scale` is also paged_attention's softmax-scale argument
