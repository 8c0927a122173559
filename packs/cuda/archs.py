"""Which GPU archs the cuda pack is compiled for, and why (docs/cuda.md, "Build").

CMake runs this at configure time with the build's own Python (``python archs.py``: one JSON object
on stdout, or exit 2 with the problem on stderr); pip builds in an isolated environment without
torch, so the decision reads only the environment and the GPU nvidia-smi sees. Stdlib only. The
first rule that applies wins:

1. ``CMAKE_CUDA_ARCHITECTURES`` given to CMake (or CMake's ``CUDAARCHS`` variable): used as given.
2. ``HAL_CUDA_ARCHS`` (a CMake define or the environment): ``all`` (every arch the pack supports,
   what CI builds), ``none``, ``auto`` (the rules below), or a CMake list such as ``90a;120-real``.
3. ``TORCH_CUDA_ARCH_LIST`` (the PyTorch convention: ``8.9;9.0a``, ``9.0+PTX``, ``Hopper``, space or
   semicolon separated, ``native`` = the visible GPUs). Archs below sm_89 are left out.
4. The GPUs ``nvidia-smi --query-gpu=compute_cap`` lists (real code for each, nothing else).
5. Nothing: the cuda pack is not built; the reason says how to build it anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

MIN_SM = 89  # hardware FP8 conversion (cvt.*.e4m3x2 / e5m2x2); keep equal to pack.py's MIN_SM
# HAL_CUDA_ARCHS=all: Ada, Hopper, Blackwell (datacenter) and Blackwell (consumer); PTX for the newest.
ALL = ("89-real", "90a-real", "100a-real", "120-real", "120-virtual")
# A plain X.Y maps to the name the all build uses for that chip: sm_90 -> 90a (the build measured on the
# H200), sm_100 -> 100a. The kernels use no arch-specific instruction (mma.sync, movmatrix, cvt e4m3x2
# are sm_89+ baseline PTX), so the code is the same either way; an explicit "9.0a" / "90" is honoured.
PREFER_A = frozenset({90, 100})
# torch.utils.cpp_extension's names (keep the combined ones first, as torch does)
NAMED = (("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
         ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
         ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
         ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"))
HOW = ("to build it anyway, reinstall with HAL_CUDA_ARCHS=all (every arch, the slow build) or one arch "
       "(HAL_CUDA_ARCHS=90a or TORCH_CUDA_ARCH_LIST=9.0)")

_TORCH_ENTRY = re.compile(r"(\d+)\.(\d)([af]?)(\+PTX)?")
_CMAKE_ENTRY = re.compile(r"(\d{2,3})([af]?)(-real|-virtual)?")


class ArchError(ValueError):
    """A variable that picks the archs has a value this build does not understand."""


def _sm_name(sm: int, suffix: str = "") -> str:
    return f"sm_{sm}{suffix}"


def from_cc(major: int, minor: int, suffix: str = "") -> str:
    """The CMake arch name for compute capability major.minor (real code): 9.0 -> 90a, 8.9 -> 89."""
    sm = major * 10 + minor
    if not suffix and sm in PREFER_A:
        suffix = "a"
    return f"{sm}{suffix}"


def parse_torch_list(value: str) -> tuple[list[str], list[str]]:
    """TORCH_CUDA_ARCH_LIST -> (CMake archs, entries left out for being below sm_89)."""
    text = value.replace(" ", ";").replace(",", ";")
    for name, expansion in NAMED:
        text = text.replace(name, expansion)
    archs, dropped = [], []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        m = _TORCH_ENTRY.fullmatch(entry)
        if not m:
            raise ArchError(f"TORCH_CUDA_ARCH_LIST={value!r}: {entry!r} is not an arch (expected PyTorch's forms: "
                            f"8.9, 9.0a, 9.0+PTX, Hopper, or native; separated by ';' or spaces)")
        major, minor, suffix, ptx = int(m[1]), int(m[2]), m[3], bool(m[4])
        if major * 10 + minor < MIN_SM:
            dropped.append(entry)
            continue
        real = f"{from_cc(major, minor, suffix)}-real"
        if real not in archs:
            archs.append(real)
        # PTX of an "a" arch JITs only on that chip: the portable PTX is the plain arch's
        if ptx and f"{major * 10 + minor}-virtual" not in archs:
            archs.append(f"{major * 10 + minor}-virtual")
    return archs, dropped


def parse_cmake_list(value: str, name: str = "HAL_CUDA_ARCHS") -> list[str]:
    """An explicit list of CMake CUDA arch names (90a, 89-real, 120-virtual), checked."""
    archs = []
    for entry in filter(None, (e.strip() for e in value.replace(",", ";").replace(" ", ";").split(";"))):
        m = _CMAKE_ENTRY.fullmatch(entry)
        if not m:
            hint = " (that is TORCH_CUDA_ARCH_LIST's form; CMake's is 90a)" if _TORCH_ENTRY.fullmatch(entry) else ""
            raise ArchError(f"{name}={value!r}: {entry!r} is not a CMake CUDA arch{hint}; expected all, none, "
                            f"auto, or a list such as 90a;120-real (names: 89, 90a, 100a, 120; optional "
                            f"-real/-virtual)")
        if int(m[1]) < MIN_SM:
            raise ArchError(f"{name}={value!r}: {entry!r} is below sm_{MIN_SM}; the cuda pack needs sm_{MIN_SM}+ "
                            f"(hardware FP8 conversion)")
        if entry not in archs:
            archs.append(entry)
    if not archs:
        raise ArchError(f"{name}={value!r} names no arch; expected all, none, auto, or a list such as 90a;120-real")
    return archs


def query_gpus(nvidia_smi: str | None = None) -> tuple[list[tuple[str, str]], str]:
    """[(compute capability "9.0", name)] of the GPUs nvidia-smi lists, and how they were found (or why not)."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if not exe:
        return [], "nvidia-smi not found"
    try:
        run = subprocess.run([exe, "--query-gpu=compute_cap,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"nvidia-smi failed ({exc})"
    if run.returncode != 0:
        msg = (run.stderr or run.stdout).strip().splitlines()
        return [], f"nvidia-smi failed ({msg[0] if msg else f'exit {run.returncode}'})"
    gpus = []
    for line in run.stdout.splitlines():
        cc, _, name = line.partition(",")
        if cc.strip():
            gpus.append((cc.strip(), name.strip()))
    return gpus, "nvidia-smi" if gpus else "nvidia-smi lists no GPU"


def _from_gpus(gpus, how: str, prefix: str) -> tuple[list[str], str]:
    if not gpus:
        return [], f"{prefix}no GPU is visible ({how})"
    archs, seen, low = [], [], []
    for cc, name in gpus:
        m = re.fullmatch(r"(\d+)\.(\d)", cc)
        if not m:
            raise ArchError(f"nvidia-smi reported compute capability {cc!r} for {name or 'a GPU'}; set HAL_CUDA_ARCHS "
                            f"or TORCH_CUDA_ARCH_LIST to choose the archs")
        sm = int(m[1]) * 10 + int(m[2])
        desc = f"{name + ' ' if name else ''}{_sm_name(sm)}"
        if desc not in seen:
            seen.append(desc)
        if sm < MIN_SM:
            low.append(desc)
        elif f"{from_cc(sm // 10, sm % 10)}-real" not in archs:
            archs.append(f"{from_cc(sm // 10, sm % 10)}-real")
    what = ", ".join(seen)
    if not archs:
        return [], f"{prefix}the visible GPU ({what}, {how}) is below sm_{MIN_SM}, which the cuda pack needs"
    extra = f"; left out: {', '.join(low)} (below sm_{MIN_SM})" if low else ""
    return sorted(archs), f"{prefix}the visible GPU ({what}, {how}){extra}"


def decide(env=None, hal_cuda_archs: str | None = None, cmake_archs: str | None = None, gpus=None) -> dict:
    """The archs to build and the reason, as {"archs": [CMake names], "reason": str, "source": str}.

    env: the environment (default os.environ). hal_cuda_archs: a -DHAL_CUDA_ARCHS value (wins over the
    environment's). cmake_archs: CMAKE_CUDA_ARCHITECTURES when given to CMake. gpus: a callable
    returning query_gpus()'s result (default: run nvidia-smi; only called when needed)."""
    env = os.environ if env is None else env
    gpus = gpus or query_gpus
    if cmake_archs is not None:
        return {"archs": [a for a in cmake_archs.split(";") if a], "source": "CMAKE_CUDA_ARCHITECTURES",
                "reason": f"CMAKE_CUDA_ARCHITECTURES={cmake_archs} was given"}
    if env.get("CUDAARCHS", "").strip():
        value = env["CUDAARCHS"].strip()
        return {"archs": [a for a in value.split(";") if a], "source": "CUDAARCHS",
                "reason": f"CUDAARCHS={value} was set"}
    if hal_cuda_archs is not None and hal_cuda_archs.strip():
        hal, src = hal_cuda_archs.strip(), "HAL_CUDA_ARCHS (CMake define)"
    else:
        hal, src = env.get("HAL_CUDA_ARCHS", "").strip(), "HAL_CUDA_ARCHS"
    key = hal.lower()
    if key == "all":
        return {"archs": list(ALL), "source": src, "reason": "HAL_CUDA_ARCHS=all: every arch the cuda pack supports"}
    if key in ("none", "off"):
        return {"archs": [], "source": src, "reason": f"HAL_CUDA_ARCHS={hal}: not built on request"}
    if key not in ("", "auto"):
        archs = parse_cmake_list(hal)
        return {"archs": archs, "source": src, "reason": f"HAL_CUDA_ARCHS={hal}"}

    torch_list = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if torch_list and torch_list != "native":
        archs, dropped = parse_torch_list(torch_list)
        left = f"; left out: {', '.join(dropped)} (below sm_{MIN_SM}, which the cuda pack needs)" if dropped else ""
        if not archs:
            return {"archs": [], "source": "TORCH_CUDA_ARCH_LIST",
                    "reason": f"TORCH_CUDA_ARCH_LIST={torch_list} names no sm_{MIN_SM}+ arch (the cuda pack "
                              f"needs hardware FP8 conversion): nothing built; {HOW}"}
        return {"archs": archs, "source": "TORCH_CUDA_ARCH_LIST", "reason": f"TORCH_CUDA_ARCH_LIST={torch_list}{left}"}

    found, how = gpus()
    prefix = "TORCH_CUDA_ARCH_LIST=native: " if torch_list == "native" else ""
    archs, why = _from_gpus(found, how, prefix)
    if archs:
        return {"archs": archs, "source": "nvidia-smi", "reason": why}
    unset = "" if prefix else " and neither HAL_CUDA_ARCHS nor TORCH_CUDA_ARCH_LIST is set"
    return {"archs": [], "source": "nvidia-smi",
            "reason": f"{why}{unset}: nothing built, as its kernels could not run here; {HOW}"}


def _needs(arch: str) -> tuple[int, str, str]:
    m = _CMAKE_ENTRY.fullmatch(arch)
    if not m:
        raise ValueError(arch)
    return int(m[1]), m[2], m[3] or ""


def runs_on(archs: list[str], sm: int) -> bool:
    """Whether a module built for these CMake archs has code for an sm_<sm> GPU: real code of the same
    major with a minor <= the GPU's ("a": that chip only), or PTX of an arch <= the GPU's (JIT).
    Unparseable names (CMake's own "all", "native") count as yes."""
    for arch in archs:
        try:
            n, suffix, kind = _needs(arch)
        except ValueError:
            return True
        if suffix == "a":
            fits = n == sm                          # arch-specific: that chip only, SASS or PTX
        elif kind != "-virtual":
            fits = n // 10 == sm // 10 and n <= sm  # real code (plain or family): same major, minor <= GPU's
        else:
            fits = False
        if kind != "-real" and not suffix and n <= sm:
            fits = True                             # portable PTX: JIT on any later GPU
        if fits:
            return True
    return False


def for_cmake(decision: dict) -> dict:
    """decide()'s result plus what CMake reads: "cmake" (the ';' list, empty: build nothing) and
    "build_info" (what build_info.json records; CMake adds cuda_compiler when it builds)."""
    archs = decision["archs"]
    return {**decision, "cmake": ";".join(archs),
            "build_info": {"built": bool(archs), "archs": ",".join(archs), "archs_reason": decision["reason"],
                           "archs_source": decision["source"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hal-cuda-archs", default=None, help="HAL_CUDA_ARCHS given as a CMake define")
    ap.add_argument("--cmake-archs", default=None, help="CMAKE_CUDA_ARCHITECTURES given to CMake")
    args = ap.parse_args(argv)
    try:
        out = decide(hal_cuda_archs=args.hal_cuda_archs, cmake_archs=args.cmake_archs)
    except ArchError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(for_cmake(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
