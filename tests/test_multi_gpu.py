"""Issue 18 on GPUs: tests/multigpu/tp_step.py under torchrun, one process per visible GPU (up to 8;
one GPU runs the single-rank case: the whole step on a rank whose current device is set apart from
the tensors' only where there are two or more). Its docstring says what each rank checks."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

SCRIPT = pathlib.Path(__file__).resolve().parent / "multigpu" / "tp_step.py"


def _ranks() -> list[int]:
    n = min(torch.cuda.device_count(), 8)
    return sorted({r for r in (1, 2, 4, 8, n) if r <= n and 32 % r == 0 and 8 % r == 0})


@pytest.mark.parametrize("ranks", _ranks() if torch.cuda.is_available() else [1])
def test_tensor_parallel_step_equals_one_gpu(ranks, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(SCRIPT),
           "--dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0 and f"tp_step: {ranks} rank(s)" in res.stdout and "PASS" in res.stdout, tail
