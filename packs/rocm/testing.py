"""Helpers for the rocm pack's tests: code objects and CPU emulation libraries built once per process.

Code objects come from the installed pack when they were built from the same sources (the source hash
in ``build_info.json``), otherwise they are compiled into a temporary folder with the same flags
(:func:`build.build_code_objects`), so the tests work from a checkout without ``pip install``.
"""

from __future__ import annotations

import atexit
import functools
import pathlib
import re
import shutil
import subprocess
import tempfile

from . import build, emulator, kernels, pack

_TMP: list[str] = []


def _tmpdir() -> pathlib.Path:
    if not _TMP:
        _TMP.append(tempfile.mkdtemp(prefix="hal-rocm-"))
        atexit.register(shutil.rmtree, _TMP[0], True)
    return pathlib.Path(_TMP[0])


def compiler_missing() -> str | None:
    """None when a clang with the AMDGPU target is available, else why not (tests skip with it)."""
    path, how = build.find_clang()
    return None if path else how


@functools.cache
def code_objects(csrc: str) -> pathlib.Path:
    """A folder with ``<arch>/hal_rocm.hsaco`` and ``build_info.json`` built from ``csrc``."""
    installed = pack.build_info(pack.CODE_OBJECTS)
    if installed.get("source_hash") == build.source_hash(csrc) and pack.built_archs(pack.CODE_OBJECTS):
        return pack.CODE_OBJECTS
    out = _tmpdir() / "codeobjects"
    build.build_code_objects(out, csrc=csrc, log=lambda *_: None)
    return out


@functools.cache
def emulation(csrc: str, arch: str) -> emulator.Emulator:
    """The CPU emulation of ``arch`` ("gfx942": hardware fnuz FP8 conversions; "gfx90a": software)."""
    if arch not in ("gfx942", "gfx90a"):
        raise ValueError(f"the emulation covers gfx942 and gfx90a, not {arch}")
    lib = build.emulation_library(_tmpdir() / "wave64", fnuz_hw=arch == "gfx942", csrc=csrc)
    return emulator.Emulator(lib)


@functools.cache
def mla_emulation(csrc: str, arch: str) -> emulator.Emulator:
    """The CPU emulation of ``arch``'s MLA code object (csrc/mla_kernels.hip), flavours as :func:`emulation`."""
    if arch not in ("gfx942", "gfx90a"):
        raise ValueError(f"the emulation covers gfx942 and gfx90a, not {arch}")
    lib = build.emulation_library(_tmpdir() / "wave64", fnuz_hw=arch == "gfx942", csrc=csrc, source=build.MLA_SOURCE)
    return emulator.Emulator(lib)


@functools.cache
def prefill_emulation(csrc: str, arch: str) -> emulator.Emulator:
    """The CPU emulation of ``arch``'s multi-token code object (csrc/prefill_kernels.hip)."""
    if arch not in ("gfx942", "gfx90a"):
        raise ValueError(f"the emulation covers gfx942 and gfx90a, not {arch}")
    lib = build.emulation_library(_tmpdir() / "wave64", fnuz_hw=arch == "gfx942", csrc=csrc,
                                  source=build.PREFILL_SOURCE)
    return emulator.Emulator(lib)


OBJDUMPS = ("llvm-objdump-19", "llvm-objdump-20", "llvm-objdump-21", "/opt/rocm/llvm/bin/llvm-objdump", "llvm-objdump")


def objdump() -> str | None:
    """An llvm-objdump that disassembles AMDGPU code objects, or None."""
    for name in OBJDUMPS:
        path = shutil.which(name) or (name if pathlib.Path(name).exists() else None)
        if path:
            return path
    return None


def disassembly(folder: pathlib.Path, archs, code_object: str, tool: str) -> dict[str, dict[str, str]]:
    """arch -> kernel -> its disassembly, for ``folder/<arch>/<code_object>``."""
    out = {}
    for arch in archs:
        text = subprocess.run([tool, "-d", f"--mcpu={arch}", str(pathlib.Path(folder) / arch / code_object)],
                              capture_output=True, text=True, check=True).stdout
        parts = re.split(r"^[0-9a-f]+ <(\w+)>:$", text, flags=re.MULTILINE)
        out[arch] = dict(zip(parts[1::2], parts[2::2]))
    return out


def kernarg_mismatches(co) -> list[str]:
    """Kernels of code object ``co`` whose explicit arguments (offset, size, kind) in the metadata differ
    from what the launcher packs (:func:`kernels.layout`), or whose segment is too small."""
    bad = []
    for name, k in co.kernels.items():
        explicit = [a for a in k.args if not a.value_kind.startswith("hidden_")]
        want = kernels.layout(kernels.family(name))
        if [(a.offset, a.size, a.value_kind) for a in explicit] != [(a.offset, a.size, a.value_kind) for a in want] \
                or k.kernarg_segment_size < kernels.kernarg_size(kernels.family(name)):
            bad.append(name)
    return bad


def built_or_skip(csrc: str) -> pathlib.Path:
    """:func:`code_objects`, or a pytest skip with the reason no clang with the AMDGPU target is here."""
    import pytest
    why = compiler_missing()
    if why:
        pytest.skip(why)
    return code_objects(csrc)


def disassembly_or_skip(folder: pathlib.Path, archs, code_object: str) -> dict[str, dict[str, str]]:
    """:func:`disassembly`, or a pytest skip when no llvm-objdump is here."""
    import pytest
    tool = objdump()
    if tool is None:
        pytest.skip("no llvm-objdump (apt-get install llvm-19) to disassemble the code objects")
    return disassembly(folder, archs, code_object, tool)
