"""The contributor's quick loop: ``pytest -m "not slow"`` (README, under the test command) leaves out the
long emulation, interpreter, compile and model tests and keeps a check of every part; the README's test
command itself stays the full suite (CI runs it verbatim: tests/test_cuda_build_archs.py)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.emu

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the longest tests of a 2-core CI run (--durations), each 10-60 s: in the full suite only
LONG = ("test_rocm_prefill.py::test_64k_token_prefill_with_a_window", "test_rocm_prefill.py::test_64k_token_context",
        "test_bench.py::test_dry_run_exercises_every_path_that_runs_on_a_cpu",
        "test_emu_triton_mla.py::test_interpreter", "test_emu_triton_prefill.py::test_interpreter",
        "test_emu_triton.py::test_interpreter", "test_emu_triton_prefill.py::test_kernel_compiles_offline_for_gfx942",
        "test_bench_mla.py::test_end_to_end_cpu_run", "test_cuda_wgmma_build.py::test_wgmma_kernels_are_not_serialized",
        "test_integration_transformers.py::test_smollm2_bf16_cache_matches_stock_within_bf16_rounding",
        "test_observer.py::test_under_torch_compile_fullgraph")
FILES = ("test_rocm_prefill.py", "test_bench.py", "test_emu_triton_mla.py", "test_emu_triton_prefill.py",
         "test_emu_triton.py", "test_bench_mla.py", "test_cuda_wgmma_build.py", "test_integration_transformers.py",
         "test_observer.py", "test_rocm_emulation.py")


def _collected(*marker: str) -> set[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *marker,
                          *(str(ROOT / "tests" / f) for f in FILES)], capture_output=True, text=True, timeout=300,
                         cwd=str(ROOT))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {line.split("tests/", 1)[-1] for line in run.stdout.splitlines() if "::" in line}


def test_the_quick_loop_leaves_out_the_long_tests_and_keeps_the_rest():
    full, quick = _collected(), _collected("-m", "not slow")
    base = lambda node: node.split("[", 1)[0]  # noqa: E731
    for name in LONG:
        assert any(base(n) == name for n in full), f"{name} is not in the suite any more: update LONG"
        assert not any(base(n) == name for n in quick), f"{name} runs in the quick loop"
    # the rocm emulation grids keep MI300 (gfx942) in the quick loop; other archs run in the full suite
    emu = [n for n in quick if n.startswith("test_rocm_emulation.py::") and "[" in n]
    assert emu and all("gfx90a" not in n for n in emu) and any("gfx942" in n for n in emu)
    assert any("gfx90a" in n for n in full if n.startswith("test_rocm_emulation.py::"))
    assert len(quick) > len(full) // 3   # still a check of every part


def test_readme_gives_the_quick_loop_under_the_full_test_command():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert blocks[1].strip().endswith(".venv/bin/pytest")   # the full suite, what CI runs
    after = text.split(blocks[1], 1)[1]
    assert '.venv/bin/pytest -m "not slow"' in after.split("## ", 1)[0]
