"""hal's PEP 517 build backend: scikit-build-core's, with CUTLASS's C++ headers (the ``nvidia-cutlass``
wheel, for the cuda pack's CuTe kernels: packs/cuda/CMakeLists.txt) added to the build requirements
wherever the cuda pack may be built: a CUDA compiler is found and ``HAL_CUDA_ARCHS`` is not ``none``.
Elsewhere (no nvcc: a CPU laptop, an AMD machine) the wheel and the packages it declares are not
downloaded for nothing. Where the check misses a compiler CMake finds, the pack builds without the
CuTe kernels and ``hal-probe --verbose`` says why."""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _backend
from scikit_build_core.build import *  # noqa: F401,F403  (every hook not redefined below)

CUTLASS = "nvidia-cutlass==4.2.0.0"


def _cuda_compiler() -> bool:
    if os.environ.get("HAL_CUDA_ARCHS", "").strip().lower() == "none":
        return False
    if os.environ.get("CUDACXX") or shutil.which("nvcc"):
        return True
    homes = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
    return any(h and os.path.isfile(os.path.join(h, "bin", "nvcc")) for h in homes)


def _with_cutlass(requires: list[str]) -> list[str]:
    return [*requires, CUTLASS] if _cuda_compiler() else list(requires)


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return _with_cutlass(_backend.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return _with_cutlass(_backend.get_requires_for_build_editable(config_settings))
