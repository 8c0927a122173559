"""The cuda pack's sm_90a kernels as ptxas compiles them (CPU; needs nvcc, skipped without it).

ptxas serializes every warpgroup MMA of a kernel (a wait after each wgmma) when it finds a register
hazard it cannot order; it says so in `-v` notes C7510-C7520 ("Potential Performance Loss: wgmma.mma_async
instructions are serialized ...") and the kernel then runs at a fraction of its speed while staying
correct, so no GPU test would notice. docs/cuda.md ("MLA decode") lists what triggered it in
csrc/mla_sm90.cuh. This compiles the translation units holding the wgmma kernels for sm_90a and checks
that ptxas left every wgmma kernel unserialized, and the MLA one without spills (the multi-token kernel
at head 192 with ALiBi or soft-cap spills a few bytes, as it did when it was measured).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[1] / "packs" / "cuda" / "csrc"
UNITS = ("mla_e4m3.cu", "mla_bf16.cu", "prefill_e4m3.cu")
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if pathlib.Path("/usr/local/cuda/bin/nvcc").exists()
                                else None)


def _ptxas_notes(unit: str, tmp_path: pathlib.Path) -> str:
    if NVCC is None:
        pytest.skip("nvcc not found: the sm_90a kernels are not compiled on this machine")
    archs = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout.split()
    if "compute_90" not in archs:  # (the list names no "a" variants; sm_90a comes with compute_90)
        pytest.skip(f"{NVCC} cannot compile for sm_90 (its --list-gpu-arch: {' '.join(archs) or 'nothing'})")
    cmd = [NVCC, "-DHAL_CUDA_SM90A=1", "-O3", "-DNDEBUG", "-std=c++17",
           "--generate-code=arch=compute_90a,code=[sm_90a]", "-Xptxas=-v", "-x", "cu", "-c",
           str(CSRC / unit), "-o", str(tmp_path / "unit.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _kernels(notes: str) -> dict[str, list[str]]:
    """ptxas's lines per compiled entry function (its notes and resource lines follow its name)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in notes.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
            out.setdefault(current, [])
        elif current is not None:
            out[current].append(line)
    return out


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.slow
def test_wgmma_kernels_are_not_serialized(unit, tmp_path):
    notes = _ptxas_notes(unit, tmp_path)
    wg = {name: lines for name, lines in _kernels(notes).items() if "_wg_kernel" in name}
    assert wg, f"{unit}: no wgmma kernel compiled (ptxas said: {notes[-2000:]})"
    serialized = [line for line in notes.splitlines() if re.search(r"\(C75(1\d|20)\)", line)]
    assert not serialized, f"{unit}: ptxas serializes wgmma:\n" + "\n".join(serialized)
    for name, lines in wg.items():
        if "mla" not in name:
            continue
        spills = [line for line in lines if re.search(r"[1-9]\d* bytes spill (stores|loads)", line)]
        assert not spills, f"{unit}: {name} spills: {spills}"
