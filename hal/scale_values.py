"""What a KV-cache scale value is and how a bad one is reported, shared by the loader
(:mod:`hal.scales`) and the readers of scale files (:mod:`hal.scale_files`): the error type, where a
value came from, and the checks every value passes (finite, > 0, per-tensor or per-head)."""

from __future__ import annotations

import math

import torch

from hal import dtypes

__all__ = ["KVScaleError", "Scale", "check_value", "same_scale", "where"]

Scale = float | torch.Tensor  # per-tensor float, or per-head float32 [num_kv_heads] (on the CPU)


class KVScaleError(ValueError):
    """KV scales are missing, malformed or inconsistent; the message names the file and the key."""


def where(file, key: str | None) -> str:
    """The ``file: key 'k':`` head every message starts with."""
    return f"{file}: key {key!r}:" if key else f"{file}:"


def check_value(raw, file, key: str) -> Scale:
    """A scale read from ``file`` under ``key`` as a float or a float32 [num_kv_heads] tensor.

    A 0-d tensor or a number is per-tensor; a list or a 1-d tensor is per-head (even of length 1).
    Refuses zero, negative, NaN and infinite scales (a zero scale divides by zero when writing the
    cache; sglang PR #27131 shows one sneaking through), and shapes other than scalar or 1-d.
    """
    if isinstance(raw, bool) or not isinstance(raw, (int, float, list, torch.Tensor)):
        raise KVScaleError(f"{where(file, key)} expected a number or a list of numbers (one per KV "
                           f"head); got {type(raw).__name__} {raw!r}")
    if isinstance(raw, list):
        if not raw or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in raw):
            raise KVScaleError(f"{where(file, key)} expected a non-empty list of numbers (one per KV "
                               f"head); got {raw!r}")
        raw = torch.tensor(raw, dtype=torch.float64)
    if isinstance(raw, torch.Tensor):
        if not (raw.is_floating_point() and raw.dim() <= 1 and raw.numel() >= 1):
            raise KVScaleError(f"{where(file, key)} expected a floating-point scalar or a 1-d "
                               f"[num_kv_heads] tensor; got {dtypes.name(raw.dtype)} "
                               f"of shape {tuple(raw.shape)}")
        t = raw.detach().to("cpu", torch.float32, copy=True)  # never alias the caller's tensor
        if t.dim() == 0:
            raw = float(t)
        else:
            bad = [(i, x) for i, x in enumerate(t.tolist()) if not (math.isfinite(x) and x > 0)]
            if bad:
                i, x = bad[0]
                raise KVScaleError(f"{where(file, key)} the per-head scale of head {i} {_problem(x)} "
                                   f"(expected finite and > 0; got {t.tolist()})")
            return t
    f = float(raw)
    if not (math.isfinite(f) and f > 0):
        raise KVScaleError(f"{where(file, key)} the scale {_problem(f)} (expected finite and > 0; got {f!r})")
    f32 = float(torch.tensor(f, dtype=torch.float32))  # what the kernels compute with
    if not (math.isfinite(f32) and f32 > 0):
        raise KVScaleError(f"{where(file, key)} the scale {f!r} becomes {f32!r} in float32, which the "
                           f"kernels compute in (expected a float32 value > 0)")
    return f


def _problem(x: float) -> str:
    if math.isnan(x):
        return "is NaN"
    if math.isinf(x):
        return "is infinite"
    return "is zero" if x == 0 else "is negative"


def same_scale(a: Scale, b: Scale) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a, b)))
    return a == b
