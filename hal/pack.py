"""What a pack is: a declaration of what it serves, as data, plus its implementations.

The dispatcher, the tests' parameter grids and the probe all read these declarations; nothing else
decides what a pack can do.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch

from hal import dtypes
from hal.targets import Target


def op_features(op: str) -> frozenset[str]:
    """The optional behaviours a call of ``op`` may use (its declaration in hal.ops): a pack lists,
    per op, those it implements."""
    from hal.ops import OPS
    return frozenset(OPS[op].features)


def _feature_text(op: str, feature: str) -> str:
    from hal.ops import OPS
    decl = OPS.get(op)
    return decl.features.get(feature, "") if decl is not None else ""


def _dtype_name(d: torch.dtype) -> str:
    return dtypes.name(d)


@dataclasses.dataclass(frozen=True)
class CallKey:
    """The static facts of a call that decide which pack may serve it (hashable, cheap)."""

    op: str
    device_type: str
    query_dtype: torch.dtype        # the query for paged_attention, the new K/V for cache_kv
    cache_dtype: torch.dtype
    head_size: int
    block_size: int
    gqa_ratio: int = 1
    features: frozenset[str] = frozenset()
    # MLA only: the rotary part's width P and its cache's dtype (head_size is the latent's width R)
    rope_dim: int = 0
    rope_dtype: torch.dtype | None = None

    def describe(self) -> str:
        feats = ", ".join(sorted(self.features)) or "none"
        role = "query" if self.op in ("paged_attention", "mla_decode") else "key/value"
        rope = (f", rope_dim {self.rope_dim} ({_dtype_name(self.rope_dtype)} cache)"
                if self.rope_dim and self.rope_dtype is not None else "")
        return (f"{role} {_dtype_name(self.query_dtype)} on {self.device_type}, cache "
                f"{_dtype_name(self.cache_dtype)}, head_size {self.head_size}{rope}, block_size "
                f"{self.block_size}, GQA ratio {self.gqa_ratio}, features: {feats}")


@dataclasses.dataclass(frozen=True)
class OpSupport:
    """What one pack supports for one op."""

    query_dtypes: frozenset[torch.dtype]
    cache_dtypes: frozenset[torch.dtype]
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    devices: frozenset[str]
    features: frozenset[str] = frozenset()
    max_gqa_ratio: int | None = None  # None: any ratio
    # cache dtypes the pack knows but sends elsewhere, with the reason (e.g. fnuz on NVIDIA)
    cache_dtype_notes: Mapping[torch.dtype, str] = dataclasses.field(default_factory=dict)
    rope_dims: tuple[int, ...] | None = None  # MLA: the rotary widths P served (None: any)

    def reasons(self, key: CallKey) -> list[str]:
        """Every reason this declaration rejects ``key``, as sentences; empty if it admits it."""
        out = []
        if key.device_type not in self.devices:
            out.append(f"tensors are on {key.device_type}; this pack runs on {_join(self.devices)}")
        if key.query_dtype not in self.query_dtypes:
            out.append(f"{'query' if key.op in ('paged_attention', 'mla_decode') else 'key/value'} dtype "
                       f"{_dtype_name(key.query_dtype)} is not supported (supported: "
                       f"{_join(_dtype_name(d) for d in self.query_dtypes)})")
        if key.cache_dtype not in self.cache_dtypes:
            note = self.cache_dtype_notes.get(key.cache_dtype)
            out.append(note or f"cache dtype {_dtype_name(key.cache_dtype)} is not supported (supported: "
                               f"{_join(_dtype_name(d) for d in self.cache_dtypes)})")
        if key.head_size not in self.head_sizes:
            out.append(f"head_size {key.head_size} is not supported (supported: {_ranges(self.head_sizes)})")
        if key.block_size not in self.block_sizes:
            out.append(f"block_size {key.block_size} is not supported (supported: {_ranges(self.block_sizes)})")
        if self.rope_dims is not None and key.rope_dim and key.rope_dim not in self.rope_dims:
            out.append(f"rope_dim {key.rope_dim} is not supported (supported: {_ranges(self.rope_dims)})")
        if self.max_gqa_ratio is not None and key.gqa_ratio > self.max_gqa_ratio:
            out.append(f"GQA ratio {key.gqa_ratio} exceeds the maximum {self.max_gqa_ratio}")
        for f in sorted(key.features - self.features):
            text = _feature_text(key.op, f)
            out.append(f"feature {f!r}{f' ({text})' if text else ''} is not implemented")
        return out

    def as_dict(self) -> dict:
        return {
            "query_dtypes": sorted(_dtype_name(d) for d in self.query_dtypes),
            "cache_dtypes": sorted(_dtype_name(d) for d in self.cache_dtypes),
            "head_sizes": _ranges(self.head_sizes),
            "block_sizes": _ranges(self.block_sizes),
            "devices": sorted(self.devices),
            "features": sorted(self.features),
            "max_gqa_ratio": self.max_gqa_ratio,
            **({"rope_dims": _ranges(self.rope_dims)} if self.rope_dims is not None else {}),
        }


@dataclasses.dataclass(frozen=True)
class Availability:
    ok: bool
    reasons: tuple[str, ...] = ()
    build_info: Mapping[str, object] = dataclasses.field(default_factory=dict)


class Pack:
    """Base of every pack. Subclasses set the class attributes and implement ``_probe``/``impl``."""

    NAME: ClassVar[str]
    DESCRIPTION: ClassVar[str]
    VENDORS: ClassVar[frozenset[str]]          # target vendors this pack is native for
    SUPPORTS: ClassVar[Mapping[str, OpSupport]]

    def native_for(self, target: Target) -> str | None:
        """None if this pack is native for ``target``, else the reason in words."""
        if target.vendor not in self.VENDORS:
            return f"the {self.NAME} pack serves {_join(self.VENDORS)} targets, not {target.vendor}:{target.arch}"
        return None

    @functools.cached_property
    def availability(self) -> Availability:
        try:
            return self._probe()
        except Exception as exc:  # a broken pack is reported, never fatal
            return Availability(False, (f"probing the {self.NAME} pack failed: {type(exc).__name__}: {exc}",))

    def _probe(self) -> Availability:
        raise NotImplementedError

    def supports(self, target: Target | None = None) -> Mapping[str, OpSupport]:
        """The declaration per op for ``target``: what dispatch checks and hal-probe shows. Packs
        whose rules differ per arch (rocm: gfx90a vs gfx942) override this; the default is
        ``SUPPORTS``."""
        return self.SUPPORTS

    def reasons(self, key: CallKey, target: Target) -> list[str]:
        """Why this pack cannot serve ``key`` on ``target`` (input reasons only)."""
        support = self.supports(target).get(key.op)
        if support is None:
            return [f"op {key.op} is not implemented by the {self.NAME} pack"]
        return support.reasons(key)

    # op -> "module:function" inside the pack's package; the function takes the op's call record
    # (hal.call). Imported on first use, so a pack whose compiled module is missing still loads.
    IMPLEMENTATIONS: ClassVar[Mapping[str, str]] = {}

    def impl(self, op: str) -> Callable:
        """The function that runs ``op`` on a call record."""
        found = _implementation(type(self), op)
        if found is None:
            raise NotImplementedError(f"the {self.NAME} pack declares no implementation of {op}")
        return found

    def prepare(self, op: str, call) -> Callable[[dict], None]:
        """A runner for a plan of ``op`` (:func:`hal.plan`): called once per plan with the planned
        call record, it returns a function that runs one layer, given that layer's fields of the
        record (the op's ``per_layer`` names -> tensors and scales, already checked to be laid out
        like the planned ones). The implementation function may carry a ``prepare`` attribute
        (call record -> runner, or None for the default) with what it can fix once: the cuda
        pack's split plan, workspace and launch arguments. The default runs the implementation on
        the planned record with the layer's fields swapped in (:func:`hal.planning.record_runner`)."""
        from hal.planning import record_runner
        impl = self.impl(op)
        factory = getattr(impl, "prepare", None)
        runner = factory(call) if factory is not None else None
        return runner if runner is not None else record_runner(impl, call)


@functools.cache
def _implementation(cls: type, op: str) -> Callable | None:
    where = cls.IMPLEMENTATIONS.get(op)
    if where is None:
        return None
    module, _, name = where.partition(":")
    package = cls.__module__.rpartition(".")[0]
    return getattr(importlib.import_module(f"{package}.{module}"), name)


def _join(items) -> str:
    return ", ".join(sorted(str(i) for i in items))


def _ranges(values: tuple[int, ...]) -> str:
    """Compact text for a sorted set of ints: '1-256' or '32-256 step 8' or '64, 128'."""
    v = sorted(values)
    if len(v) > 3:
        step = v[1] - v[0]
        if all(b - a == step for a, b in zip(v, v[1:])):
            return f"{v[0]}-{v[-1]}" + (f" step {step}" if step != 1 else "")
    return ", ".join(map(str, v))
