"""hal-demo compares its FP8-cache answers with stock attention's: on a tiny random Llama and a
byte-level stand-in tokenizer (no model needed), and the comparison helpers on their own."""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[model]')")

from hal.cli import demo  # noqa: E402
from hal.integrations import models  # noqa: E402

pytestmark = pytest.mark.emu


class ByteTokenizer:
    """Enough of a tokenizer for hal-demo: bytes mod 120 as ids, 127 as EOS."""

    eos_token_id = 127

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [b % 120 for b in text.encode()]
        return types.SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self(messages[-1]["content"]).input_ids

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


@pytest.fixture
def tiny_demo(monkeypatch):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=2048)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(models, "missing", lambda: [])
    monkeypatch.setattr(models, "load_smollm2", lambda *a, **kw: (model, ByteTokenizer()))
    return model


@pytest.mark.parametrize("cache", ["fp32", "e4m3fn"])
def test_demo_compares_each_answer_with_stock_attention(tiny_demo, cache, capsys):
    prompts = ["hello", "a longer prompt here"]
    assert demo.main(["--cache", cache, "--max-new-tokens", "5", *prompts]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "stock attention:" in line]
    assert len(lines) == len(prompts), out
    assert "answers the same as stock" in " ".join(out.split())
    if cache == "fp32":   # no rounding: hal's greedy tokens are stock's
        assert all(line.startswith("= stock attention: the same 5 tokens") for line in lines), out


def test_first_difference():
    assert demo.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert demo.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert demo.first_difference([1, 2], [1, 2, 3]) == 2      # one stopped early (EOS)
    assert demo.first_difference([], []) is None


def test_comparison_names_where_and_what_stock_said():
    def decode(ids):
        return " ".join(f"t{i}" for i in ids)

    assert demo.comparison([4, 5], [4, 5], decode) == "[green]= stock attention: the same 2 tokens[/]"
    line = demo.comparison([4, 5, 6, 7], [4, 5, 9], decode)
    assert "the same first 2 of 3 tokens" in line and "'t9'" in line and "'t6 t7'" in line


def test_demo_runs_a_model_folder(tmp_path, capsys):
    """hal-demo --model FOLDER: a tiny Gemma 3 (head size 256, MQA, sliding and full layers) saved
    with a word-level tokenizer that has no chat template (the prompts go in as plain text)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    words = ["what", "is", "the", "capital", "of", "france", "paris"]
    t = Tokenizer(WordLevel({w: i for i, w in enumerate(["<bos>", "<eos>", "<unk>"] + words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>",
                                         unk_token="<unk>").save_pretrained(tmp_path)
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"])
    transformers.Gemma3ForCausalLM(cfg).eval().save_pretrained(tmp_path)
    capsys.readouterr()
    assert demo.main(["--model", str(tmp_path), "--cache", "fp32", "--max-new-tokens", "4",
                      "what is the capital of france"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "= stock attention: the same 4 tokens" in out and "1 of 1 answers the same as stock" in out
