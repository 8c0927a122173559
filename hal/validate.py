"""Argument checks shared by every pack; they run before any kernel.

Each error names the argument, what was expected and what was given. Checks that would need a
device-to-host sync (block-table entries, slots and scale values on a GPU) run on CPU tensors
always and on GPU tensors only under ``HAL_DEBUG=1``; without it the native kernels skip
out-of-range slots instead of writing out of bounds.
"""

from __future__ import annotations

import math

import torch

from hal import diagnostics, dtypes, env
from hal.fp8 import FP8_DTYPES, encoding_of

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *sorted(FP8_DTYPES, key=str))


class ArgumentError(ValueError):
    """An argument is malformed; the message names it."""


def fail(op: str, arg: str, expected: str, given: str) -> None:
    raise ArgumentError(f"hal.{op}: {arg} must be {expected}; got {given}")


def desc(t: torch.Tensor) -> str:
    return f"{dtypes.name(t.dtype)} tensor of shape {tuple(t.shape)} on {t.device}"


def tensor(op: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(op, name, "a torch.Tensor", type(t).__name__)
    return t


def integer(op: str, name: str, v, minimum: int, meaning: str) -> None:
    """``v`` is None or a Python int >= ``minimum`` (a bool is refused: True is not a window of 1)."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
        fail(op, name, f"None ({meaning}) or an int >= {minimum}", f"{v!r} ({type(v).__name__})")


def real(op: str, name: str, v, expected: str = "a float") -> float:
    """A Python number (not a bool, not a string) as a float."""
    if isinstance(v, (bool, str, bytes)) or isinstance(v, torch.Tensor) or not hasattr(v, "__float__"):
        fail(op, name, expected, f"{v!r} ({type(v).__name__})")
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


def caches(op: str, key_cache, value_cache) -> None:
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        tensor(op, name, c)
        if c.dtype == torch.uint8:
            try:
                encoding_of(torch.uint8)
            except TypeError as exc:
                raise ArgumentError(f"hal.{op}: {name} is uint8: {exc}") from None
        if c.dtype not in CACHE_DTYPES:
            fail(op, name, "float16, bfloat16, float32 or a torch float8 dtype", desc(c))
        if c.dim() != 4:
            fail(op, name, "4-d [num_blocks, num_kv_heads, block_size, head_size] (HND)", desc(c))
        nb, h, bs, d = c.shape
        for dim, what in ((h, "num_kv_heads"), (bs, "block_size"), (d, "head_size")):
            if dim < 1:
                fail(op, name, f"[num_blocks, num_kv_heads, block_size, head_size] with {what} >= 1", desc(c))
        # Any strides for blocks, heads and tokens (a combined K/V allocation; an NHD cache
        # [num_blocks, block_size, num_kv_heads, head_size] passed as its permute(0, 2, 1, 3) view),
        # but each token's head_size elements are contiguous: packs load them as vectors.
        if c.stride(3) != 1 and d > 1:
            fail(op, name, "contiguous in head_size (stride 1 in the last dim; an NHD cache is passed as its "
                 "permute(0, 2, 1, 3) view)", f"strides {tuple(c.stride())}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        fail(op, "value_cache", f"the same shape and dtype as key_cache ({desc(key_cache)})", desc(value_cache))
    if value_cache.device != key_cache.device:
        fail(op, "value_cache", f"on key_cache's device {key_cache.device}", str(value_cache.device))


def same_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        fail(op, name, f"on {device} like the caches", str(t.device))


def on_host_or_debug(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or env.debug()


_warned_unscaled: set[str] = set()


def scale(op: str, name: str, value, cache: torch.Tensor, num_kv_heads: int | None = None):
    """Normalise a k/v scale to a float or a float32 tensor (0-d or [num_kv_heads]) on the cache's
    device (the cache is validated first). ``None`` is 1.0; with an FP8 cache that warns once per op
    (:class:`hal.MissingScaleWarning`), and is an error under HAL_STRICT on every call.
    ``num_kv_heads``: the heads a per-head scale has (default: the cache's dim 1; 1 for MLA caches,
    whose latent is shared by every head)."""
    if num_kv_heads is None:
        num_kv_heads = cache.shape[1]
    if value is None:
        if cache.dtype in FP8_DTYPES:
            msg = (f"hal.{op}: no {name} given for a {dtypes.name(cache.dtype)} cache; "
                   f"using 1.0 (pass calibrated scales, see hal.load_kv_scales)")
            if env.strict():  # before the warn-once check: strict mode raises on every such call
                raise ArgumentError(msg + " (HAL_STRICT=1 makes this an error)")
            if op not in _warned_unscaled:
                _warned_unscaled.add(op)
                diagnostics.warn(msg, diagnostics.MissingScaleWarning, stacklevel=5)
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            fail(op, name, "a float32 tensor", desc(value))
        if value.dim() == 0 and value.device.type == "cpu" and cache.device.type != "cpu":
            value = float(value.item())  # a host scalar: no device sync involved
        else:
            if value.dim() not in (0, 1) or (value.dim() == 1 and value.shape[0] != num_kv_heads):
                fail(op, name, f"a float, a 0-d tensor or a [num_kv_heads={num_kv_heads}] tensor", desc(value))
            same_device(op, name, value, cache.device)
            if on_host_or_debug(value):
                bad = ~(torch.isfinite(value) & (value > 0))
                if bool(bad.any()):
                    fail(op, name, "finite and > 0", f"{value.tolist()}")
            return value.contiguous()
    f = real(op, name, value, "a float or a float32 tensor")
    if not positive_f32(f):
        fail(op, name, positive_f32_text(f), repr(f))
    return f


def _misaligned(*caches: torch.Tensor) -> bool:
    return any(c.data_ptr() % 16 or (c.stride(0) * c.element_size()) % 16 for c in caches)


def rows_misaligned(c: torch.Tensor, nbytes: int) -> bool:
    """Whether ``c``'s start or any of its strides but the last dimension's is off ``nbytes`` bytes."""
    e = c.element_size()
    return c.data_ptr() % nbytes != 0 or any((s * e) % nbytes for s in c.stride()[:-1])


def _strided(*caches: torch.Tensor) -> bool:
    """Not HND-dense within each block (e.g. the HND view of an NHD cache)."""
    return any(c.stride(2) != c.shape[3] or c.stride(1) != c.shape[2] * c.shape[3] for c in caches)


def features(alibi_slopes, soft_cap, window, k_scale, v_scale, caches=()) -> frozenset[str]:
    f = set()
    if _misaligned(*caches):
        f.add("misaligned_cache")
    if _strided(*caches):
        f.add("strided_cache")
    if alibi_slopes is not None:
        f.add("alibi")
    if soft_cap is not None:
        f.add("soft_cap")
    if window is not None:
        f.add("sliding_window")
    if any(isinstance(s, torch.Tensor) and s.dim() == 1 for s in (k_scale, v_scale)):
        f.add("per_head_scales")
    return frozenset(f)


def pick(op: str, name: str, f, t):
    """A scale's float and tensor slots of the torch schema: at most one may be given."""
    if f is not None and t is not None:
        raise ArgumentError(f"hal.{op}: {name} was given twice, as the float {f!r} and as a tensor "
                            f"({name}_tensor); pass one of them")
    return t if t is not None else f


def split_scale(op: str, name: str, s):
    """A public scale argument as the schema's (float slot, tensor slot)."""
    if s is None:
        return None, None
    if isinstance(s, torch.Tensor):
        return None, s
    return real(op, name, s, "a float or a float32 tensor"), None


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has a unit stride (or at most one element), else a copy
    that has one: packs index the last dimension densely, callers may pass any view."""
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def context_bounds(op: str, seq_lens, block_tables, num_blocks: int, block_size: int, max_seq_len) -> int:
    """The host bound on ``seq_lens`` every pack plans with: checked against the block table (its
    capacity, every entry a sequence uses within [0, num_blocks)) where the values may be read (CPU
    tensors, HAL_DEBUG), else read once from the device (never while a graph is being captured;
    the caller refuses that first). ``seq_lens``/``block_tables`` are already shape-checked."""
    n = seq_lens.shape[0]
    capacity = block_tables.shape[1] * block_size
    hi = None
    if on_host_or_debug(seq_lens) and n > 0:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > capacity:
            fail(op, "seq_lens", f"within [0, {capacity}] (block_tables has {block_tables.shape[1]} blocks "
                 f"of {block_size} tokens per sequence)", f"values from {lo} to {hi}")
        if max_seq_len is not None and hi > max_seq_len:
            fail(op, "max_seq_len", f">= every seq_len (max is {hi})", str(max_seq_len))
        used = (seq_lens.to(torch.int64) + block_size - 1) // block_size
        cols = torch.arange(block_tables.shape[1], device=block_tables.device)
        refs = block_tables[cols[None, :] < used[:, None]]
        if refs.numel() and (int(refs.min()) < 0 or int(refs.max()) >= num_blocks):
            fail(op, "block_tables", f"entries in [0, {num_blocks}) for every block a sequence uses",
                 f"entries from {int(refs.min())} to {int(refs.max())}")
    if max_seq_len is not None:
        return max_seq_len
    return 0 if n == 0 else (hi if hi is not None else int(seq_lens.max()))


def slot_mapping(op: str, slots, num_tokens: int, num_slots: int, device) -> None:
    """An int64 [num_tokens] slot per token, every slot < num_slots (negative: skipped), checked
    where the values may be read (CPU tensors, HAL_DEBUG)."""
    tensor(op, "slot_mapping", slots)
    if slots.dtype != torch.int64 or slots.shape != (num_tokens,):
        fail(op, "slot_mapping", f"an int64 [num_tokens={num_tokens}] tensor", desc(slots))
    same_device(op, "slot_mapping", slots, device)
    if on_host_or_debug(slots) and slots.numel():
        hi = int(slots.max())
        if hi >= num_slots:
            fail(op, "slot_mapping", f"< num_blocks*block_size = {num_slots} (negative slots skip a token)",
                 f"a slot of {hi}")


def query_rows(op: str, qsl, total_q: int, seq_lens, max_query_len, rows_of: str, writer: str) -> int:
    """``query_start_loc`` row offsets: 0 first, non-decreasing, ``total_q`` (the row count of
    ``rows_of``) last, at most seq_lens[i] rows for sequence i (the new tokens are written by
    ``writer`` first). Read on the host only for CPU tensors or under HAL_DEBUG; else one device
    read when ``max_query_len`` is not given. Returns max_query_len."""
    if not on_host_or_debug(qsl):
        if max_query_len is not None:
            return max_query_len
        offs = qsl.to(torch.int64)
        return int((offs[1:] - offs[:-1]).max()) if offs.numel() > 1 else 0
    offs = qsl.to(torch.int64).cpu()
    q_lens = offs[1:] - offs[:-1]
    if int(offs[0]) != 0 or bool((q_lens < 0).any()):
        fail(op, "query_start_loc", "non-decreasing row offsets starting at 0", f"{offs.tolist()[:12]}")
    if int(offs[-1]) != total_q:
        fail(op, "query_start_loc", f"a last entry equal to {rows_of}'s row count {total_q}", str(int(offs[-1])))
    if on_host_or_debug(seq_lens) and q_lens.numel():
        over = (q_lens > seq_lens.to(torch.int64).cpu()).nonzero()
        if over.numel():
            i = int(over[0])
            fail(op, "query_start_loc", "at most seq_lens[i] rows for sequence i (the new tokens are part of "
                 f"the context, already written by {writer})",
                 f"{int(q_lens[i])} rows for sequence {i} of length {int(seq_lens[i])}")
    longest = int(q_lens.max()) if q_lens.numel() else 0
    if max_query_len is not None and longest > max_query_len:
        fail(op, "max_query_len", f">= every sequence's row count (max is {longest})", str(max_query_len))
    return longest if max_query_len is None else max_query_len
