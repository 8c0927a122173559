"""KV-cache scales: load them, validate them, convert them between encodings, write them back.

Why this module is strict: vLLM falls back to 1.0 when a scale file is missing, malformed or partial
(its JSON loader returns ``[]`` on any error), and its users lost accuracy without knowing. Here every
problem is a :class:`KVScaleError` naming the file, the key, what was expected and what was found;
1.0 for absent layers happens only with ``on_missing="one"``, and is logged.

A scale is tagged with the FP8 encoding it was calibrated for, because the same scale means
different things in different encodings: the same byte decodes to half the value in e4m3fnuz, so
e4m3fn scales double on MI300 (:meth:`KVScales.for_encoding`, :meth:`KVScales.for_cache`).

Sources (:func:`load_kv_scales`): a JSON file in vLLM's ``--quantization-param-path`` schema (plus
the per-head / separate k-v extension documented in docs/scales.md), a ``.safetensors`` file, a
directory of safetensors shards (with or without ``model.safetensors.index.json``), or a directory
holding a JSON scale file. Where scales live in those sources (file kinds, key spellings, the
JSON schema) are :mod:`hal.scale_names` (the key spellings) and :mod:`hal.scale_files` (the
readers).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Iterator

import torch

from hal import scale_files
from hal.fp8 import Encoding, encoding_of, is_fp8

__all__ = ["KVScaleError", "KVScales", "load_kv_scales", "Scale"]

log = logging.getLogger("hal")

from hal.scale_values import KVScaleError, Scale, check_value, same_scale, where  # noqa: F401  (re-exported)


def _peak(s: Scale) -> float:
    return float(s.max()) if isinstance(s, torch.Tensor) else s


def encoding_factor(src: Encoding, dst: Encoding) -> float:
    """What a scale calibrated for ``src`` is multiplied by to serve a ``dst`` cache.

    Two encodings with the same bit layout but different exponent bias decode the same byte to
    values that differ by ``2 ** (src.bias - dst.bias)``; the scale makes up the difference
    (e4m3fn -> e4m3fnuz: x2, as :func:`hal.fp8.fn_to_fnuz` does for bytes). Different layouts
    (e5m2 vs e4m3) have different ranges and precisions: no factor maps one calibration onto the
    other, so that is refused.
    """
    if (src.exponent_bits, src.mantissa_bits) != (dst.exponent_bits, dst.mantissa_bits):
        raise KVScaleError(
            f"cannot convert KV scales calibrated for {src.name} (largest value {src.max_finite:g}) to "
            f"{dst.name} (largest value {dst.max_finite:g}): the encodings have different exponent and "
            f"mantissa widths, so a scale chosen for one range does not fit the other. Re-calibrate for "
            f"{dst.name} (hal.KVScaleObserver(...).scales({dst.dtype})) or allocate the cache in {src.name}.")
    return 2.0 ** (dst.bias - src.bias)


@dataclasses.dataclass(frozen=True, eq=False)
class KVScales:
    """Per layer, a k scale and a v scale (float, or float32 ``[num_kv_heads]`` tensor), tagged with
    the FP8 encoding they were calibrated for. ``source`` names where they came from (every error
    names it); ``model_type`` is the model they belong to when known.

    ``real = decode(byte) * scale``: pass ``for_cache(layer, key_cache)`` to ``hal.cache_kv`` and
    ``hal.paged_attention``; it converts to the cache's encoding and device.
    """

    k: tuple[Scale, ...]
    v: tuple[Scale, ...]
    encoding: Encoding | torch.dtype | str = torch.float8_e4m3fn
    source: str = "<memory>"
    model_type: str | None = None
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        try:
            enc = encoding_of(self.encoding)
        except (TypeError, ValueError) as exc:
            raise KVScaleError(f"{self.source}: the scales' encoding must be an FP8 encoding; {exc}") from None
        object.__setattr__(self, "encoding", enc)
        if len(self.k) != len(self.v):
            raise KVScaleError(f"{self.source}: {len(self.k)} k scales but {len(self.v)} v scales; "
                               f"expected one of each per layer")
        heads = None
        for role, seq in (("k", self.k), ("v", self.v)):
            checked = []
            for i, s in enumerate(seq):
                s = check_value(s, self.source, f"layer {i} {role}_scale")
                if isinstance(s, torch.Tensor):
                    if heads is not None and s.numel() != heads[0]:
                        raise KVScaleError(
                            f"{where(self.source, f'layer {i} {role}_scale')} per-head scale has "
                            f"{s.numel()} heads; expected {heads[0]} like {heads[1]} (all layers must "
                            f"agree on num_kv_heads)")
                    heads = heads or (s.numel(), f"layer {i} {role}_scale")
                checked.append(s)
            object.__setattr__(self, role, tuple(checked))

    # -- reading ---------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_kv_heads(self) -> int | None:
        """The per-head scales' length, or None when every scale is per-tensor."""
        return next((s.numel() for s in (*self.k, *self.v) if isinstance(s, torch.Tensor)), None)

    @property
    def per_head(self) -> bool:
        return self.num_kv_heads is not None

    def __len__(self) -> int:
        return len(self.k)

    def __getitem__(self, layer: int) -> tuple[Scale, Scale]:
        return self.k[layer], self.v[layer]

    def __iter__(self) -> Iterator[tuple[Scale, Scale]]:
        return iter(zip(self.k, self.v))

    def __eq__(self, other) -> bool:
        """Exact equality: same encoding, and every scale bit for bit (source is not compared)."""
        if not isinstance(other, KVScales):
            return NotImplemented
        return (self.encoding == other.encoding and len(self) == len(other)
                and all(same_scale(a, b) for a, b in zip((*self.k, *self.v), (*other.k, *other.v))))

    __hash__ = None

    def __repr__(self) -> str:
        kind = f"per-head ({self.num_kv_heads} KV heads)" if self.per_head else "per-tensor"
        return (f"KVScales({len(self)} layers, {kind}, calibrated for {self.encoding.name}, "
                f"source={self.source!r})")

    # -- converting ------------------------------------------------------------------------------
    def for_encoding(self, encoding: Encoding | torch.dtype | str) -> KVScales:
        """These scales for a cache in ``encoding``: e4m3fn -> e4m3fnuz doubles them (the same byte
        decodes to half the value in fnuz), fnuz -> fn halves them; e5m2 <-> e4m3 is refused."""
        dst = encoding_of(encoding)
        if dst == self.encoding:
            return self
        if dst not in self._memo:
            try:
                f = encoding_factor(self.encoding, dst)
            except KVScaleError as exc:
                raise KVScaleError(f"{self.source}: {exc}") from None
            self._memo[dst] = KVScales(tuple(s * f for s in self.k), tuple(s * f for s in self.v), dst,
                                       self.source, self.model_type)
        return self._memo[dst]

    def for_cache(self, layer: int, key_cache: torch.Tensor, *, as_tensor: bool = False
                  ) -> tuple[Scale | None, Scale | None]:
        """``(k_scale, v_scale)`` of ``layer``, ready for ``hal.cache_kv`` / ``hal.paged_attention``
        with this cache: converted to ``key_cache.dtype`` (so e4m3fn scales double for an MI300
        e4m3fnuz cache without the caller having to remember) and, for tensors, moved to its device.

        Per-tensor scales come back as floats (no device traffic), or with ``as_tensor=True`` as 0-d
        float32 tensors on the cache's device. Device tensors are made once and reused, so calling
        this every step costs no copies (and none during CUDA graph capture after the first call).
        A cache that is not FP8 takes no scales: ``(None, None)``.
        """
        if not is_fp8(key_cache.dtype):
            return None, None
        if not 0 <= layer < len(self):
            raise KVScaleError(f"{self.source}: no scales for layer {layer}; these cover layers "
                               f"0..{len(self) - 1}")
        memo_key = (layer, key_cache.dtype, key_cache.device, as_tensor)
        if memo_key not in self._memo:
            scales = self.for_encoding(key_cache.dtype)
            heads = key_cache.shape[1]
            out = []
            for role, s in zip("kv", scales[layer]):
                if isinstance(s, torch.Tensor) and s.numel() != heads:
                    raise KVScaleError(
                        f"{where(self.source, f'layer {layer} {role}_scale')} per-head scale has "
                        f"{s.numel()} heads; the cache has num_kv_heads={heads}")
                if isinstance(s, torch.Tensor) or as_tensor:
                    s = torch.as_tensor(s, dtype=torch.float32).to(key_cache.device)
                out.append(s)
            self._memo[memo_key] = tuple(out)
        return self._memo[memo_key]

    # -- writing ---------------------------------------------------------------------------------
    def to_json(self, path: str | os.PathLike, *, tp_rank: int = 0, model_type: str | None = None) -> None:
        """Write vLLM's ``--quantization-param-path`` schema, for one TP rank.

        ``kv_cache.scaling_factor[rank][layer]`` always holds one per-tensor float per layer, as
        vLLM reads it (used for both k and v). When k and v differ in some layer, or a scale is
        per head, that float is the largest of the layer's k and v scales (safe: a larger scale never
        saturates), and ``kv_cache.k_scaling_factor`` / ``v_scaling_factor`` (same nesting, a float
        or a list per layer) carry the exact scales; hal reads those first. Floats are written with
        ``repr``, so reading the file back gives these scales bit for bit.
        """
        def table(values) -> dict:
            return {str(tp_rank): {str(i): (s.tolist() if isinstance(s, torch.Tensor) else s)
                                   for i, s in enumerate(values)}}

        mt = model_type if model_type is not None else self.model_type
        kv: dict = {"dtype": f"float8_{self.encoding.name}"}
        exact = not self.per_head and all(a == b for a, b in zip(self.k, self.v))
        kv["scaling_factor"] = table(self.k if exact else
                                     [max(_peak(a), _peak(b)) for a, b in zip(self.k, self.v)])
        if not exact:
            kv["k_scaling_factor"] = table(self.k)
            kv["v_scaling_factor"] = table(self.v)
        doc = ({"model_type": mt} if mt is not None else {}) | {"kv_cache": kv}
        pathlib.Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_kv_scales(source: str | os.PathLike, *, num_layers: int | None = None, tp_rank: int = 0,
                   tp_size: int | None = None, model_type: str | None = None, on_missing: str = "error",
                   num_kv_heads: int | None = None, encoding: torch.dtype | str | None = None) -> KVScales:
    """Load and validate the KV scales in ``source``.

    ``source``: a JSON scale file (vLLM schema), a ``.safetensors`` file, a directory of safetensors
    shards (only the scale tensors are read, through the header, never the weights), or a directory
    holding a JSON scale file.
    ``num_layers``: the model's layer count; every layer ``0..num_layers-1`` must have scales and
    none beyond (None: layers ``0..max`` found, without gaps). ``tp_rank``/``tp_size``: the rank to
    load (JSON files hold one table per rank; per-head checkpoint scales are sliced to the rank's KV
    heads). ``model_type``: checked against the file's (JSON) or ``config.json``'s (checkpoints).
    ``on_missing="one"``: absent layers get 1.0, logged; the default ``"error"`` raises.
    ``num_kv_heads``: when given, per-head scales must have this length. ``encoding``: the FP8
    encoding the scales were calibrated for; JSON files say it (``kv_cache.dtype``), checkpoints
    default to e4m3fn, which every FP8 exporter (ModelOpt, compressed-tensors, Quark) calibrates for.
    """

    if on_missing not in ("error", "one"):
        raise KVScaleError(f"on_missing must be 'error' or 'one' (1.0 for absent layers, logged); "
                           f"got {on_missing!r}")
    if not (isinstance(tp_rank, int) and tp_rank >= 0):
        raise KVScaleError(f"tp_rank must be an int >= 0; got {tp_rank!r}")
    if tp_size is not None and not (isinstance(tp_size, int) and tp_size > tp_rank):
        raise KVScaleError(f"tp_size must be an int > tp_rank={tp_rank}; got {tp_size!r}")
    if num_layers is not None and not (isinstance(num_layers, int) and num_layers > 0):
        raise KVScaleError(f"num_layers must be an int > 0 or None; got {num_layers!r}")
    found = scale_files.read(pathlib.Path(source).expanduser(), tp_rank=tp_rank, tp_size=tp_size,
                               num_layers=num_layers, model_type=model_type)
    if encoding is not None and found.declares_encoding and encoding_of(encoding) != found.encoding:
        raise KVScaleError(
            f"{where(found.file, 'kv_cache.dtype')} the file's scales are for {found.encoding.name}; "
            f"encoding={encoding_of(encoding).name} contradicts it (to convert them, call "
            f".for_encoding({encoding_of(encoding).name!r}) on the result)")
    try:
        k, v = _assemble(found, num_layers, on_missing, num_kv_heads)
        scales = KVScales(k, v, encoding if encoding is not None else found.encoding, str(found.file),
                          found.model_type or model_type)
    except KVScaleError as exc:
        if found.unknown:
            raise KVScaleError(f"{exc}\n{found.unknown_note()}") from None
        raise
    if found.unknown:
        log.warning("%s", found.unknown_note())
    return scales


def _assemble(found, num_layers, on_missing, num_kv_heads):
    """Per-layer (k, v) tuples from what a source holds: pairs completed, layers checked."""
    k: dict[int, Scale] = {}
    v: dict[int, Scale] = {}
    for layer in sorted(found.entries):
        roles = found.entries[layer]
        if "k" in roles and "v" not in roles and layer in found.latent:
            log.info("%s: layer %d: MLA latent cache scale %r used for the whole cache (k and v)",
                     roles["k"].file, layer, roles["k"].key)
            roles["v"] = roles["k"]
        for have, lack in (("k", "v"), ("v", "k")):
            if have in roles and lack not in roles:
                e = roles[have]
                raise KVScaleError(
                    f"{where(e.file, e.key)} layer {layer} has a {have} scale but no {lack} scale "
                    f"(expected a key like {found.example(layer, lack)!r}); a half-present pair is "
                    f"never completed with 1.0")
        k[layer], v[layer] = roles["k"].value, roles["v"].value

    layers = sorted(k)
    if num_layers is not None and layers and layers[-1] >= num_layers:
        extra = [i for i in layers if i >= num_layers]
        e = found.entries[extra[0]]["k"]
        raise KVScaleError(
            f"{where(e.file, e.key)} scales for layer {extra[0]}, but num_layers={num_layers}: the "
            f"source holds {len(layers)} layers ({_ranges(layers)}); expected layers 0..{num_layers - 1} "
            f"(pass num_layers=None to load every layer found)")
    if not layers and num_layers is None:
        raise KVScaleError(f"{found.file}: no KV scales found ({found.looked_for()})")
    total = num_layers if num_layers is not None else layers[-1] + 1
    missing = [i for i in range(total) if i not in k]
    if missing:
        if on_missing == "error":
            raise KVScaleError(
                f"{where(found.file, found.example(missing[0], 'k'))} no scales for layer "
                f"{missing[0]}; layers missing: {_ranges(missing)} of {total} "
                f"({found.looked_for()}). Pass on_missing='one' to use 1.0 for them (logged).")
        log.warning("%s: no KV scales for layers %s of %d: using 1.0 for them (on_missing='one')",
                    found.file, _ranges(missing), total)
        for i in missing:
            k[i] = v[i] = 1.0

    first = None
    for layer in range(total):
        for role, s in (("k", k[layer]), ("v", v[layer])):
            if not isinstance(s, torch.Tensor):
                continue
            e = found.entries[layer][role]
            want = num_kv_heads if num_kv_heads is not None else (first[0] if first else None)
            if want is not None and s.numel() != want:
                like = "num_kv_heads" if num_kv_heads is not None else f"key {first[1]!r}"
                raise KVScaleError(f"{where(e.file, e.key)} per-head scale has {s.numel()} heads; "
                                   f"expected {want} (like {like}; all layers must agree on num_kv_heads)")
            first = first or (s.numel(), e.key)
    return tuple(k[i] for i in range(total)), tuple(v[i] for i in range(total))


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start = [], None
    for i, x in enumerate(xs):
        start = x if start is None else start
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out)

