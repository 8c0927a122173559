"""The ``HAL_*`` environment variables, parsed in one place and checked once when hal is imported:
an unknown ``HAL_*`` name warns (usually a typo), a value hal does not understand raises
:class:`EnvValueError` (the one exception type for that, at import and at every later read)."""

from __future__ import annotations

import functools
import os

from hal import diagnostics

# name -> what it does (shown by hal-probe and in errors)
VARIABLES = {
    "HAL_TARGET": "override target detection: cpu, sm_XX[a], gfxNNN[:feature...]",
    "HAL_PACK": "force a pack by name (emu, cuda, rocm); a forced pack that cannot serve a call raises",
    "HAL_STRICT": "1: a fallback from the target's native pack to emu, or an FP8 cache without scales, is an error",
    "HAL_DEBUG": "1: checks that need a device sync (block-table entries, slots, scale values on GPU)",
    "HAL_CUDA_ARCHS": "build time (pip install): the cuda pack's archs: all, none, auto or a CMake list (docs/cuda.md)",
    "HAL_CUDA_PREFILL": "the cuda pack's multi-token kernel: auto (the tuning table), mma (mma.sync, every arch), "
                        "wgmma (sm_90a, where it runs) or cute (sm_90a on CuTe, head 64/128; docs/cuda.md)",
}
CUDA_PREFILL_KERNELS = ("auto", "mma", "wgmma", "cute")
BOOL_VARIABLES = ("HAL_STRICT", "HAL_DEBUG")
TARGET_FORMS = "cpu, sm_XX (e.g. sm_90) or gfxNNN[:feature+] (e.g. gfx942)"
_BOOL = {"": False, "0": False, "1": True, "false": False, "true": True, "no": False, "yes": True,
         "off": False, "on": True}


class EnvValueError(ValueError):
    """A ``HAL_*`` variable has a value hal does not understand. ``variable``, ``value`` and
    ``expected`` say which, what it was and what is accepted; the message says all three in one line."""

    def __init__(self, variable: str, value: str, expected: str, detail: str = ""):
        self.variable, self.value, self.expected = variable, value, expected
        why = f" ({detail})" if detail else ""
        super().__init__(f"{variable}={value!r} is not understood{why}: expected {expected}")

    def __reduce__(self):  # picklable across processes (pytest-xdist, multiprocessing)
        return type(self), (self.variable, self.value, self.expected)


@functools.cache
def _parse_bool(name: str, raw: str) -> bool:
    key = raw.strip().lower()
    if key not in _BOOL:
        raise EnvValueError(name, raw, "0 or 1 (also accepted: true/false, yes/no, on/off)")
    return _BOOL[key]


def flag(name: str) -> bool:
    return _parse_bool(name, os.environ.get(name, ""))


def strict() -> bool:
    return flag("HAL_STRICT")


def debug() -> bool:
    return flag("HAL_DEBUG")


def forced_pack() -> str | None:
    raw = os.environ.get("HAL_PACK", "").strip()
    if not raw:
        return None
    from hal import registry

    known = registry.names()
    if raw not in known:
        raise EnvValueError("HAL_PACK", raw, f"the name of a pack: {', '.join(known)}")
    return raw


def cuda_prefill_kernel() -> str:
    raw = os.environ.get("HAL_CUDA_PREFILL", "").strip().lower() or "auto"
    if raw not in CUDA_PREFILL_KERNELS:
        raise EnvValueError("HAL_CUDA_PREFILL", raw, f"one of {', '.join(CUDA_PREFILL_KERNELS)}")
    return raw


def target_override() -> str | None:
    raw = os.environ.get("HAL_TARGET", "").strip()
    return raw or None


@functools.cache
def _warn_unknown(names: tuple[str, ...]) -> None:
    for name in names:
        diagnostics.warn(f"{name} is set but hal knows no such variable (known: {', '.join(VARIABLES)})",
                         diagnostics.EnvironmentWarning, stacklevel=4)


def check_unknown() -> None:
    """Warn (once per set of names) about HAL_* variables hal does not know: usually a typo."""
    unknown = tuple(sorted(k for k in os.environ if k.startswith("HAL_") and k not in VARIABLES))
    if unknown:
        _warn_unknown(unknown)


def _check_target() -> None:
    override = target_override()
    if override:
        from hal.targets import parse
        parse(override)


# HAL_CUDA_ARCHS is read by the build (packs/cuda/archs.py), not here.
_CHECKS = {"HAL_STRICT": lambda: flag("HAL_STRICT"), "HAL_DEBUG": lambda: flag("HAL_DEBUG"),
           "HAL_CUDA_PREFILL": cuda_prefill_kernel, "HAL_TARGET": _check_target, "HAL_PACK": forced_pack}


def problems() -> list[EnvValueError]:
    """Every HAL_* value hal does not understand, one error each (hal-probe reports them all)."""
    found = []
    for check_one in _CHECKS.values():
        try:
            check_one()
        except EnvValueError as exc:
            found.append(exc)
    return found


def check() -> None:
    """Check every HAL_* variable now: unknown names warn, a value hal cannot parse raises
    :class:`EnvValueError` (the first found). Run once at import; the accessors above re-read the
    environment on each call."""
    check_unknown()
    found = problems()
    if found:
        raise found[0]


def snapshot() -> dict[str, str]:
    """The HAL_* variables as set now (for the probe)."""
    return {k: os.environ[k] for k in sorted(os.environ) if k.startswith("HAL_")}
