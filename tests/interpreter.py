"""Running a test module's Triton checks under the Triton interpreter on a CPU machine, in one child
process (TRITON_INTERPRET must be set before triton is imported, and this process has imported it).

A test module keeps a dict of checks and an entry point ``_interpreter_main(path)`` that calls
:func:`run_checks`; its fixture calls :func:`results_in_subprocess` with the module's name."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys


def run_checks(checks: dict, result_path: str, *args) -> None:
    """The child's side: run every check (with ``args``), record 'ok' or the failure's traceback."""
    import traceback
    results = {}
    for name, fn in checks.items():
        try:
            fn(*args)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per check in the parent
            results[name] = traceback.format_exc(limit=6)
    with open(result_path, "w") as f:
        json.dump(results, f)


def results_in_subprocess(module: str, tmp: pathlib.Path, timeout: int) -> dict:
    """The parent's side: ``module._interpreter_main`` in a child with the interpreter on and no GPU
    visible, importing exactly what this process imports (an installed hal or the checkout)."""
    result = tmp / "results.json"
    path = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *(p for p in sys.path if p)])
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp / "cache"), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=path)
    code = f"import {module} as t; t._interpreter_main({str(result)!r})"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=str(tmp), capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0 and result.exists(), f"interpreter subprocess failed:\n{proc.stderr[-4000:]}"
    return json.loads(result.read_text())
