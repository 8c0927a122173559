"""Calibration: running abs-max of K and V per layer (and per KV head), turned into KV scales.

Why the maxima stay on the device: an observer is called by every attention layer on every step, and
reading a maximum back (``.item()``) would stall the GPU pipeline each time and cannot happen during
CUDA graph capture at all (vLLM's ``calc_kv_scales`` had to turn graphs off while calibrating, PR
#25513). So the maxima live in two ``[num_layers, num_kv_heads]`` float32 tensors on the data's
device, updated in place with ``torch.maximum``; nothing in :meth:`KVScaleObserver.observe` reads a
value back, so it also traces under ``torch.compile(fullgraph=True)``. Only
:meth:`KVScaleObserver.scales` syncs.

``scale = absmax * margin / fmt_max`` (design.md, "FP8 semantics"): the largest value observed lands
on the encoding's largest finite value, or below it by ``margin`` for headroom.
"""

from __future__ import annotations

import logging
import math

import torch

from hal.fp8 import Encoding, encoding_of
from hal.scales import KVScaleError, KVScales

__all__ = ["KVScaleObserver"]

log = logging.getLogger("hal")

_UNSEEN = -1.0  # below any absolute value: marks a layer no call has observed yet


class KVScaleObserver:
    """Accumulates ``max |K|`` and ``max |V|`` per layer and KV head over calls.

    ``observer.observe(layer, key, value)`` (or ``observer(layer, key, value)``) with ``key``/``value``
    ``[num_tokens, num_kv_heads, head_size]``, the tensors handed to ``hal.cache_kv``, before they
    are quantised. ``num_kv_heads`` and ``device`` are best given up front, so the maxima are allocated
    outside any ``torch.compile`` region or CUDA graph capture; otherwise the first call sets them.
    ``observer.scales(torch.float8_e4m3fn, margin=1.0)`` -> :class:`hal.KVScales`; per-tensor by
    default, per head with ``per_head=True`` (here or at construction).
    """

    def __init__(self, num_layers: int, num_kv_heads: int | None = None, *, per_head: bool = False,
                 device: torch.device | str | None = None):
        if not (isinstance(num_layers, int) and num_layers > 0):
            raise ValueError(f"KVScaleObserver: num_layers must be an int > 0; got {num_layers!r}")
        if num_kv_heads is not None and not (isinstance(num_kv_heads, int) and num_kv_heads > 0):
            raise ValueError(f"KVScaleObserver: num_kv_heads must be None or an int > 0; got {num_kv_heads!r}")
        self.num_layers = num_layers
        self.per_head = per_head
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        if num_kv_heads is not None:
            self._allocate(num_kv_heads, torch.device(device if device is not None else "cpu"))

    def _allocate(self, num_kv_heads: int, device: torch.device) -> None:
        self._k = torch.full((self.num_layers, num_kv_heads), _UNSEEN, dtype=torch.float32, device=device)
        self._v = self._k.clone()

    @property
    def num_kv_heads(self) -> int | None:
        return None if self._k is None else self._k.shape[1]

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fold one call's K and V into the running maxima; no host sync. NaN in K or V is kept
        (and reported by :meth:`scales`), never silently dropped."""
        if self._k is None:
            self._allocate(key.shape[1], key.device)
        if not (isinstance(layer, int) and 0 <= layer < self.num_layers):
            raise ValueError(f"KVScaleObserver.observe: layer must be an int in [0, {self.num_layers}); "
                             f"got {layer!r}")
        heads = self._k.shape[1]
        for name, x in (("key", key), ("value", value)):
            if x.dim() != 3 or x.shape[1] != heads or not x.is_floating_point():
                raise ValueError(f"KVScaleObserver.observe: {name} must be a floating-point "
                                 f"[num_tokens, num_kv_heads={heads}, head_size] tensor; got "
                                 f"{x.dtype} of shape {tuple(x.shape)}")
            if x.device != self._k.device:
                raise ValueError(f"KVScaleObserver.observe: {name} is on {x.device}, the running maxima "
                                 f"on {self._k.device}; expected one device (pass device= at construction)")
        if key.shape[0] == 0:
            return
        for amax, x in ((self._k, key), (self._v, value)):
            seen = x.detach().abs().amax(dim=(0, 2)).to(torch.float32)  # [num_kv_heads]; NaN propagates
            amax[layer] = torch.maximum(amax[layer], seen)

    __call__ = observe

    def reset(self) -> None:
        """Forget every observation (keeps the device and head count)."""
        if self._k is not None:
            self._k.fill_(_UNSEEN)
            self._v.fill_(_UNSEEN)

    def absmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` maxima as CPU float32 ``[num_layers, num_kv_heads]`` copies (syncs); -1 marks a
        layer never observed."""
        if self._k is None:
            raise KVScaleError("KVScaleObserver: nothing observed yet (no call to observe())")
        return self._k.to("cpu", copy=True), self._v.to("cpu", copy=True)

    def scales(self, encoding: Encoding | torch.dtype | str = torch.float8_e4m3fn, *, margin: float = 1.0,
               per_head: bool | None = None, on_missing: str = "error") -> KVScales:
        """KV scales for a cache in ``encoding``: ``absmax * margin / fmt_max`` per layer (and head).

        ``margin`` > 1 leaves headroom for values larger than any observed (they would saturate).
        Each scale is rounded up to the next float32, so the largest observed value never exceeds
        the encoding's range. A layer never observed is an error, or 1.0 with ``on_missing="one"``
        (logged); NaN or infinity observed, or an all-zero layer, is an error naming the layer.
        """
        enc = encoding_of(encoding)
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
            raise KVScaleError(f"KVScaleObserver.scales: margin must be a finite number > 0; got {margin!r}")
        if on_missing not in ("error", "one"):
            raise KVScaleError(f"KVScaleObserver.scales: on_missing must be 'error' or 'one'; got {on_missing!r}")
        per_head = self.per_head if per_head is None else per_head
        if self._k is None:
            k = v = torch.full((self.num_layers, 1), _UNSEEN, dtype=torch.float64)
        else:
            k, v = (t.to("cpu", torch.float64) for t in (self._k, self._v))  # the one sync
        source = f"KVScaleObserver({self.num_layers} layers)"
        missing = [i for i in range(self.num_layers) if bool((k[i] == _UNSEEN).all())]
        if missing and on_missing == "error":
            raise KVScaleError(f"{source}: key 'layer {missing[0]}': never observed (layers never observed: "
                               f"{missing}); expected observe() calls for every layer, or on_missing='one' "
                               f"to use 1.0 for them (logged)")
        if missing:
            log.warning("%s: layers %s were never observed: using 1.0 for them (on_missing='one')",
                        source, missing)
        out = {"k": [], "v": []}
        for role, amax in (("k", k), ("v", v)):
            for i in range(self.num_layers):
                if i in missing:
                    out[role].append(1.0)
                    continue
                a = amax[i]
                what = "NaN" if bool(a.isnan().any()) else "an infinity" if bool(a.isinf().any()) else None
                if what:
                    raise KVScaleError(f"{source}: key 'layer {i} {role}_scale': the observed "
                                       f"{'keys' if role == 'k' else 'values'} held {what}; expected finite "
                                       f"K and V (absmax per head: {a.tolist()})")
                a = a if per_head else a.max().reshape(())
                if bool((a == 0).any()):
                    raise KVScaleError(f"{source}: key 'layer {i} {role}_scale': every observed "
                                       f"{'key' if role == 'k' else 'value'} was 0, which gives a zero scale; "
                                       f"expected real activations (absmax: {a.tolist()})")
                s = _round_up_f32(a * margin / enc.max_finite)
                out[role].append(s if per_head else float(s))
        return KVScales(tuple(out["k"]), tuple(out["v"]), enc, source)


def _round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the smallest float32 >= x, so ``absmax / scale`` never exceeds the format's max."""
    y = x.to(torch.float32)
    return torch.where(y.to(torch.float64) < x, torch.nextafter(y, torch.tensor(math.inf)), y)
