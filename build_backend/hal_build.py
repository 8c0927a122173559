"""hal's PEP 517 build backend: scikit-build-core's, with CUTLASS's C++ headers (the ``nvidia-cutlass``
wheel, for the cuda pack's CuTe kernels: packs/cuda/CMakeLists.txt) added to the build requirements
only where the build will compile them: a CUDA compiler is found and the cuda pack's arch decision
(packs/cuda/archs.py, the rule CMake applies) includes sm_90a. Elsewhere (no nvcc, no Hopper GPU, a CPU
machine) that wheel and the packages it declares are not downloaded for nothing. Where the check and
CMake disagree, the pack builds without the CuTe kernels and ``hal-probe --verbose`` says why."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil

from scikit_build_core import build as _backend
from scikit_build_core.build import *  # noqa: F401,F403  (every hook not redefined below)

CUTLASS = "nvidia-cutlass==4.2.0.0"
_ARCHS = pathlib.Path(__file__).resolve().parents[1] / "packs" / "cuda" / "archs.py"


def _cuda_compiler() -> bool:
    if os.environ.get("CUDACXX") or shutil.which("nvcc"):
        return True
    homes = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
    return any(h and os.path.isfile(os.path.join(h, "bin", "nvcc")) for h in homes)


def _builds_sm90a(config_settings) -> bool:
    """Whether the cuda pack's archs (as CMake will decide them) include 90a."""
    if not _ARCHS.is_file() or not _cuda_compiler():
        return False
    spec = importlib.util.spec_from_file_location("hal_cuda_archs", _ARCHS)
    archs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(archs)
    settings = config_settings or {}
    try:
        decision = archs.decide(hal_cuda_archs=settings.get("cmake.define.HAL_CUDA_ARCHS"),
                                cmake_archs=settings.get("cmake.define.CMAKE_CUDA_ARCHITECTURES"))
    except archs.ArchError:
        return False  # CMake reports the bad value itself
    return any(a.split("-")[0] == "90a" for a in decision["archs"])


def _with_cutlass(requires: list[str], config_settings) -> list[str]:
    return [*requires, CUTLASS] if _builds_sm90a(config_settings) else list(requires)


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return _with_cutlass(_backend.get_requires_for_build_wheel(config_settings), config_settings)


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return _with_cutlass(_backend.get_requires_for_build_editable(config_settings), config_settings)
