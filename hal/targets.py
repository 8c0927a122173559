"""What silicon this process runs on, found without creating a CUDA context.

Order: ``HAL_TARGET`` (so dispatch is testable with no hardware), then NVML / amdsmi, then torch's
device properties (which initialise the runtime, so only as a last resort), then the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import platform
import re

import torch

from hal import diagnostics, env

log = logging.getLogger(__name__)

_SM = re.compile(r"^sm_(\d+)(a|f)?$")
_GFX = re.compile(r"^(gfx[0-9a-f]+)((?::[a-z0-9_-]+[+-])*)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """Facts about one device kind. Hashable: dispatch caches on it."""

    vendor: str                          # "cuda" | "rocm" | "cpu"
    arch: str                            # "sm_90", "gfx942", "x86_64"
    name: str = ""                       # marketing name when known
    warp_size: int = 1
    features: frozenset[str] = frozenset()  # e.g. {"sramecc+", "xnack-"}; "sm_90a" -> {"arch-specific"}
    fp8_encodings: tuple[torch.dtype, ...] = ()  # encodings converted in hardware
    matrix_units: tuple[str, ...] = ()
    source: str = "detected"             # "detected" | "HAL_TARGET" | how it was found

    @property
    def sm(self) -> int | None:
        m = _SM.match(self.arch)
        return int(m.group(1)) if m else None

    def describe(self) -> str:
        enc = ", ".join(str(d).removeprefix("torch.float8_") for d in self.fp8_encodings) or "none"
        feats = f" [{', '.join(sorted(self.features))}]" if self.features else ""
        return (f"{self.vendor}:{self.arch}{feats} {self.name or ''} (warp {self.warp_size}, "
                f"native FP8: {enc}, matrix units: {', '.join(self.matrix_units) or 'none'}; "
                f"{self.source})").replace("  ", " ")


def _cuda_facts(sm: int) -> tuple[tuple[torch.dtype, ...], tuple[str, ...]]:
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2) if sm >= 89 else ()
    units = []
    if sm >= 70:
        units.append("mma.sync")
    if sm in (90,):
        units.append("wgmma")
    if sm >= 100 and sm < 110:
        units.append("tcgen05")
    return fp8, tuple(units)


def _rocm_facts(arch: str) -> tuple[tuple[torch.dtype, ...], tuple[str, ...], int]:
    if arch in ("gfx940", "gfx941", "gfx942"):
        fp8 = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    elif arch in ("gfx950", "gfx1200", "gfx1201"):
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    else:
        fp8 = ()
    if arch.startswith("gfx9") and arch not in ("gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"):
        units, warp = ("mfma",), 64
    elif arch.startswith("gfx9"):
        units, warp = (), 64
    elif arch.startswith(("gfx11", "gfx12")):
        units, warp = ("wmma",), 32
    else:
        units, warp = (), 32
    return fp8, units, warp


def cuda_target(arch: str, name: str = "", source: str = "detected") -> Target:
    m = _SM.match(arch)
    if not m:
        raise ValueError(f"not an NVIDIA arch: {arch!r} (expected sm_XX, e.g. sm_90)")
    sm = int(m.group(1))
    fp8, units = _cuda_facts(sm)
    feats = frozenset({"arch-specific"}) if m.group(2) else frozenset()
    return Target("cuda", f"sm_{sm}", name, 32, feats, fp8, units, source)


def rocm_target(arch: str, name: str = "", source: str = "detected") -> Target:
    m = _GFX.match(arch.strip().lower())
    if not m:
        raise ValueError(f"not an AMD arch: {arch!r} (expected gfxNNN[:sramecc+][:xnack-], e.g. gfx942)")
    base, flags = m.group(1), m.group(2)
    fp8, units, warp = _rocm_facts(base)
    feats = frozenset(f for f in flags.split(":") if f)
    return Target("rocm", base, name, warp, feats, fp8, units, source)


def cpu_target(source: str = "detected") -> Target:
    return Target("cpu", platform.machine() or "unknown", platform.processor() or "", 1, frozenset(), (), (), source)


def parse(text: str, source: str = "HAL_TARGET") -> Target:
    """Parse a target string: ``cpu``, ``sm_90``, ``sm_90a``, ``gfx942``, ``gfx942:sramecc+:xnack-``."""
    t = text.strip().lower()
    try:
        if t == "cpu":
            return cpu_target(source)
        if t.startswith("sm_"):
            return cuda_target(t, source=source)
        if t.startswith("gfx"):
            return rocm_target(t, source=source)
        raise ValueError("unknown vendor prefix")
    except ValueError as exc:
        if source == "HAL_TARGET":
            raise env.EnvValueError("HAL_TARGET", text, env.TARGET_FORMS, str(exc)) from None
        raise ValueError(f"{source}: target {text!r} is not understood ({exc}): expected {env.TARGET_FORMS}") from None


def _detect_nvidia() -> Target | None:
    try:
        import pynvml  # nvidia-ml-py: no CUDA context
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                if pynvml.nvmlDeviceGetCount() == 0:
                    return None
                h = pynvml.nvmlDeviceGetHandleByIndex(_visible_index())
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else name
                return cuda_target(f"sm_{major}{minor}", name, "nvml")
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # NVML missing or broken: fall through to torch
            log.debug("NVML detection failed: %s", exc)
    if not torch.cuda.is_available():  # NVML-based count when PYTORCH_NVML_BASED_CUDA_CHECK=1
        return None
    major, minor = torch.cuda.get_device_capability()
    return cuda_target(f"sm_{major}{minor}", torch.cuda.get_device_name(), "torch.cuda")


def _visible_index() -> int:
    import os
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _detect_amd() -> Target | None:
    try:
        import amdsmi
        amdsmi.amdsmi_init()
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
            if handles:
                info = amdsmi.amdsmi_get_gpu_asic_info(handles[0])
                arch = info.get("target_graphics_version", "")
                if arch:
                    return rocm_target(arch, info.get("market_name", ""), "amdsmi")
        finally:
            amdsmi.amdsmi_shut_down()
    except Exception as exc:
        log.debug("amdsmi detection failed: %s", exc)
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return rocm_target(props.gcnArchName, props.name, "torch.cuda")


@functools.cache
def _detect(override: str | None) -> Target:
    if override:
        return parse(override)
    try:
        if getattr(torch.version, "hip", None):
            found = _detect_amd()
        elif getattr(torch.version, "cuda", None):
            found = _detect_nvidia()
        else:
            found = None
    except Exception as exc:  # detection must never take the process down
        diagnostics.warn(f"hal: GPU detection failed ({type(exc).__name__}: {exc}); using the CPU target",
                         diagnostics.PackLoadWarning)
        found = None
    return found or cpu_target()


def target() -> Target:
    """The target this process dispatches for (``HAL_TARGET`` overrides detection)."""
    return _detect(env.target_override())
