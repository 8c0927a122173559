"""Evaluation windows start the way the model expects: with the tokenizer's BOS in every window
when the tokenizer adds one (not only the first), unchanged when it adds none. Real transformers
tokenizers built from the ``tokenizers`` library (no hub), one with a BOS post-processor and one
without; then hal-eval's own windows."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[model]')")
tokenizers = pytest.importorskip("tokenizers")

from hal.cli import evaluate  # noqa: E402
from hal.integrations import models, perplexity  # noqa: E402

WORDS = "it is a truth universally acknowledged that single man in possession of good fortune must be want wife".split()
TEXT = " ".join(WORDS * 4)    # 76 words, one token each
BOS = 0


def _tokenizer(adds_bos: bool):
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {w: i for i, w in enumerate(["<bos>", "<eos>", "<unk>"] + WORDS)}
    t = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:
        t.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>",
                                                unk_token="<unk>")


def test_bos_token_id_is_what_the_tokenizer_adds():
    assert perplexity.bos_token_id(_tokenizer(True)) == BOS
    assert perplexity.bos_token_id(_tokenizer(False)) is None   # it has a BOS token, but does not add it


def test_every_window_starts_with_bos_when_the_tokenizer_adds_one():
    tok = _tokenizer(True)
    text_ids = tok(TEXT, add_special_tokens=False).input_ids
    w = perplexity.text_windows(tok, TEXT, 3, 16)
    assert w.shape == (3, 16) and w[:, 0].tolist() == [BOS] * 3
    assert w[:, 1:].reshape(-1).tolist() == text_ids[:45]      # the text, in order, none lost or doubled
    assert BOS not in w[:, 1:].tolist()


def test_windows_unchanged_when_the_tokenizer_adds_no_bos():
    tok = _tokenizer(False)
    w = perplexity.text_windows(tok, TEXT, 3, 16)
    assert torch.equal(w, torch.tensor(tok(TEXT).input_ids[:48]).reshape(3, 16))


def test_make_windows_with_bos():
    ids = torch.tensor([[7, 1, 2, 3, 4, 5, 6]])
    # a BOS leading the ids is not text
    assert perplexity.make_windows(ids, 2, 3, bos_token_id=7).tolist() == [[7, 1, 2], [7, 3, 4]]
    assert perplexity.make_windows(ids[:, 1:], 2, 3, bos_token_id=7).tolist() == [[7, 1, 2], [7, 3, 4]]
    assert perplexity.make_windows(ids, 2, 3).tolist() == [[7, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="fewer than 4 windows x 2"):
        perplexity.make_windows(ids, 4, 3, "t", bos_token_id=7)
    with pytest.raises(ValueError, match="length must be >= 2"):
        perplexity.make_windows(ids, 1, 1, bos_token_id=7)


@pytest.mark.parametrize("adds_bos", [True, False])
def test_hal_eval_windows_follow_the_tokenizer(adds_bos, tmp_path, monkeypatch, capsys):
    """hal-eval's windows (from --text), captured where they go to the evaluation."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    tok = _tokenizer(adds_bos)
    model = types_model()
    seen = []

    def capture(model, windows, variants, **kw):
        seen.append(windows)
        raise ValueError("captured")

    monkeypatch.setattr(models, "missing", lambda: [])
    monkeypatch.setattr(models, "load_smollm2", lambda *a, **kw: (model, tok))
    monkeypatch.setattr(perplexity, "evaluate", capture)
    assert evaluate.main(["--text", str(text), "--caches", "bf16", "--windows", "3", "--length", "16"]) == 1
    assert "captured" in capsys.readouterr().err
    (w,) = seen
    if adds_bos:
        assert w[:, 0].tolist() == [BOS] * 3 and w[1:, 1:].reshape(-1).tolist() == tok(TEXT).input_ids[16:46]
    else:
        assert torch.equal(w, torch.tensor(tok(TEXT).input_ids[:48]).reshape(3, 16))


def types_model():
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return transformers.LlamaForCausalLM(cfg).eval()
