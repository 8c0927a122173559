"""What every compat module shares: the named refusal, cache views in hal's layout, scales as hal
takes them, and the small device tensors a library's batch description becomes.

Views only: an NHD cache ``[num_blocks, block_size, num_kv_heads, head_size]`` is hal's
``[num_blocks, num_kv_heads, block_size, head_size]`` through ``permute(0, 2, 1, 3)`` (the
``strided_cache`` feature), a ``uint8`` cache is a ``.view`` of the encoding its ``kv_cache_dtype``
string names on this target (:func:`hal.fp8.kv_cache_dtype`). Nothing here copies a cache.
"""

from __future__ import annotations

import weakref

import torch

from hal import fp8
from hal.validate import ArgumentError

__all__ = ["NotServedError", "refuse", "nhd_view", "typed_cache", "kv_scale", "window", "soft_cap",
           "alibi", "lengths_from_cu"]


class NotServedError(ArgumentError):
    """An argument asks for something hal does not serve (dropout, attention probabilities, a
    backward, rotary embedding inside the call, ...): named, never a silent difference."""


def refuse(fn: str, arg: str, why: str, given) -> None:
    raise NotServedError(f"hal.compat {fn}: {arg}={given!r} is not served: {why}")


def fail(fn: str, arg: str, expected: str, given: str) -> None:
    raise ArgumentError(f"hal.compat {fn}: {arg} must be {expected}; got {given}")


def desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"{t!r} ({type(t).__name__})"
    return f"{str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)} on {t.device}"


def typed_cache(fn: str, arg: str, cache: torch.Tensor, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """``cache`` with the dtype of its encoding: a ``uint8`` cache viewed as the FP8 dtype that
    ``kv_cache_dtype`` names on this target (fnuz on gfx942); any other dtype as it is (and then
    ``kv_cache_dtype`` must agree with it)."""
    if not isinstance(cache, torch.Tensor):
        fail(fn, arg, "a torch.Tensor", desc(cache))
    if cache.dtype == torch.uint8:
        if kv_cache_dtype in ("auto", None) or not kv_cache_dtype.startswith("fp8"):
            fail(fn, "kv_cache_dtype", "an FP8 name ('fp8', 'fp8_e4m3', 'fp8_e5m2', ...) for a uint8 cache",
                 repr(kv_cache_dtype))
        return cache.view(fp8.kv_cache_dtype(kv_cache_dtype))
    if kv_cache_dtype not in ("auto", None) and kv_cache_dtype.startswith("fp8"):
        want = fp8.kv_cache_dtype(kv_cache_dtype)
        if cache.dtype != want:
            fail(fn, arg, f"a uint8 or {str(want).removeprefix('torch.')} cache for kv_cache_dtype="
                 f"{kv_cache_dtype!r}", desc(cache))
    return cache


def nhd_view(fn: str, arg: str, cache: torch.Tensor) -> torch.Tensor:
    """An NHD paged cache ``[num_blocks, block_size, num_kv_heads, head_size]`` as hal's
    ``[num_blocks, num_kv_heads, block_size, head_size]`` (a view)."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        fail(fn, arg, "a 4-d [num_blocks, block_size, num_kv_heads, head_size] tensor", desc(cache))
    return cache.permute(0, 2, 1, 3)


_CACHE_VIEWS: dict = {}  # id(cache) -> (weakref to the cache, its data_ptr, hal's view of it or None)


def kept_nhd_view(fn: str, arg: str, cache: torch.Tensor) -> torch.Tensor:
    """:func:`nhd_view` of a cache an engine passes every call (a layer's cache tensor), kept from
    its second call on (``permute`` costs ~2.5 us on the host, twice a call). What is kept is a
    tensor over the cache's storage, not a view of the cache's tensor, so it does not keep that
    tensor alive: when the engine drops the cache, its weakref removes the entry and the memory is
    freed. A cache whose storage moved (``data_ptr`` changed) gets a new one."""
    key = id(cache)
    hit = _CACHE_VIEWS.get(key)
    if hit is not None and hit[0]() is cache and hit[1] == cache.data_ptr():
        if hit[2] is not None:
            return hit[2]
        view = nhd_view(fn, arg, cache)
        alias = torch.empty(0, dtype=cache.dtype, device=cache.device).set_(
            cache.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        _CACHE_VIEWS[key] = (hit[0], hit[1], alias)
        return alias
    view = nhd_view(fn, arg, cache)
    try:  # first seen: remembered, not kept (a view made per call, e.g. .view(fp8), dies at once)
        ref = weakref.ref(cache, lambda _r, k=key: _CACHE_VIEWS.pop(k, None))
    except TypeError:
        return view
    _CACHE_VIEWS[key] = (ref, cache.data_ptr(), None)
    return view


_SCALE_VIEWS: dict = {}   # id(scale tensor) -> (the tensor, its view as hal takes it): layer scales persist


def kv_scale(fn: str, arg: str, s, num_kv_heads: int):
    """:func:`scale_view`, its view kept per scale tensor (an engine passes the same layer scales every
    step; the tensors are a few bytes, so holding them costs nothing)."""
    if s is None or not isinstance(s, torch.Tensor):
        return scale_view(fn, arg, s, num_kv_heads)
    hit = _SCALE_VIEWS.get(id(s))
    if hit is not None and hit[0] is s and hit[2] == num_kv_heads:
        return hit[1]
    view = scale_view(fn, arg, s, num_kv_heads)
    if len(_SCALE_VIEWS) >= 1024:
        _SCALE_VIEWS.clear()
    _SCALE_VIEWS[id(s)] = (s, view, num_kv_heads)
    return view


def scale_view(fn: str, arg: str, s, num_kv_heads: int):
    """A library's K or V scale as hal takes it: None, a float, a 0-d or ``[num_kv_heads]`` float32
    tensor. Also FA3's ``[batch, num_kv_heads]`` descale when every row is the same view (vLLM
    passes ``layer._k_scale.expand(batch, num_kv_heads)``, batch stride 0) or batch is 1, and a
    ``[1]`` tensor (vLLM's layer scales)."""
    if s is None or isinstance(s, float | int) and not isinstance(s, bool):
        return None if s is None else float(s)
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        fail(fn, arg, "None, a float or a float32 tensor", desc(s))
    if s.dim() == 0:
        return s
    if s.dim() == 1 and s.shape[0] in (1, num_kv_heads):
        return s[0] if s.shape[0] == 1 and num_kv_heads != 1 or s.stride(0) == 0 else s
    if s.dim() == 2 and s.shape[1] == num_kv_heads and (s.shape[0] == 1 or s.stride(0) == 0):
        # one layer scale expanded over heads too (stride 0): its one value, as a 0-d view
        return s[0, 0] if s.stride(1) == 0 or num_kv_heads == 1 else s[0]
    if s.dim() == 2 and s.shape[1] == 1 and (s.shape[0] == 1 or s.stride(0) == 0):
        return s[0, 0]
    refuse(fn, arg, f"hal takes one scale per KV head ([num_kv_heads={num_kv_heads}]) for the whole batch; a "
           "[batch, num_kv_heads] descale whose rows differ has no hal equivalent", desc(s))


def window(fn: str, window_size, causal: bool) -> tuple[int | None, bool]:
    """FlashAttention's ``window_size=(left, right)`` (-1: unbounded) as hal's ``sliding_window``
    (keys ``p - left .. p``: ``left + 1`` keys) and ``causal``. A causal call ignores ``right``, as
    FlashAttention does; a non-causal window is served only as ``(left, 0)``, which is causal."""
    if window_size is None:
        return None, causal
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        fail(fn, "window_size", "a pair (left, right) of ints, -1 for unbounded", repr(window_size))
    if not causal:
        if right == 0:
            causal = True
        elif left >= 0 or right >= 0:
            refuse(fn, "window_size", "hal's windows are causal (keys p - left .. p): give causal=True or "
                   "right=0", (left, right))
    return (left + 1 if left >= 0 else None), causal


def soft_cap(softcap) -> float | None:
    return None if softcap is None or float(softcap) == 0.0 else float(softcap)


def alibi(fn: str, slopes, num_heads: int):
    """``[num_heads]`` float32 slopes; ``[batch, num_heads]`` only when the rows are one view."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
        fail(fn, "alibi_slopes", "None or a float32 [num_heads] tensor", desc(slopes))
    if slopes.dim() == 2 and slopes.shape[1] == num_heads and (slopes.shape[0] == 1 or slopes.stride(0) == 0):
        slopes = slopes[0]
    if slopes.dim() == 2:
        refuse(fn, "alibi_slopes", "hal takes one slope per query head for the whole batch ([num_heads]); "
               "per-sequence slopes have no hal equivalent", desc(slopes))
    return slopes.contiguous() if slopes.dim() == 1 and slopes.stride(0) != 1 else slopes


def lengths_from_cu(cu: torch.Tensor) -> torch.Tensor:
    """int32 per-sequence lengths from cumulative offsets ``[num_seqs + 1]``."""
    return (cu[1:] - cu[:-1]).to(torch.int32)
