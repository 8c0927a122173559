"""hal.load_kv_scales / KVScales: every source form, every spelling, every error, the encoding
conversion, the JSON round trip, and end to end through hal.cache_kv + hal.paged_attention.

All files are real: JSON written with json.dumps, checkpoints with safetensors.torch.save_file, in
tmp_path. Every error test checks that the message names the file and the key.
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import hal
import reference
from hal import fp8, scale_files, scale_names
from hal.scales import KVScaleError, KVScales, load_kv_scales

pytestmark = pytest.mark.emu

E4M3FN, E4M3FNUZ, E5M2 = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2


# -- helpers --------------------------------------------------------------------------------------
def _json(path, doc):
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def _vllm_doc(layers=4, ranks=1, dtype="float8_e4m3fn", model_type="llama", base=0.01):
    return {"model_type": model_type, "kv_cache": {"dtype": dtype, "scaling_factor": {
        str(r): {str(i): base * (i + 1) + r for i in range(layers)} for r in range(ranks)}}}


def _ckpt(path, layers=4, k_suffix="self_attn.k_scale", v_suffix="self_attn.v_scale", prefix="model.",
          per_head=None, skip=(), extra=None):
    """A small checkpoint: a weight per layer plus the k/v scales (k = 0.01*(i+1), v = 0.02*(i+1))."""
    t = {}
    for i in range(layers):
        t[f"{prefix}layers.{i}.self_attn.q_proj.weight"] = torch.randn(8, 8)
        if i in skip:
            continue
        for suffix, base in ((k_suffix, 0.01), (v_suffix, 0.02)):
            if suffix is None:
                continue
            s = base * (i + 1)
            value = torch.full((per_head,), s) * torch.arange(1, per_head + 1) if per_head else torch.tensor(s)
            t[f"{prefix}layers.{i}.{suffix}"] = value.to(torch.float32)
    t.update(extra or {})
    save_file(t, str(path))
    return path


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _expect(exc_info, *parts):
    """The error message names each of ``parts`` (file, key, problem)."""
    msg = str(exc_info.value)
    for p in parts:
        assert str(p) in msg, f"{p!r} not in: {msg}"


# -- valid forms: JSON ----------------------------------------------------------------------------
def test_json_vllm_schema(tmp_path):
    path = _json(tmp_path / "kv.json", _vllm_doc())
    s = load_kv_scales(path, num_layers=4, model_type="llama")
    assert s.k == s.v == (0.01, 0.02, 0.01 * 3, 0.04)
    assert s.encoding == fp8.encoding_of(E4M3FN) and s.model_type == "llama" and s.source == str(path)
    assert not s.per_head and s.num_kv_heads is None and len(s) == s.num_layers == 4


def test_json_tp_rank(tmp_path):
    path = _json(tmp_path / "kv.json", _vllm_doc(ranks=3))
    s = load_kv_scales(path, tp_rank=2, tp_size=3, num_layers=4)
    assert s.k[0] == 0.01 + 2


@pytest.mark.parametrize("dtype,name", [("float8_e4m3fn", "e4m3fn"), ("float8_e4m3fnuz", "e4m3fnuz"),
                                        ("float8_e5m2", "e5m2"), ("e4m3fn", "e4m3fn"),
                                        ("torch.float8_e5m2", "e5m2"), ("fp8_e4m3fnuz", "e4m3fnuz")])
def test_json_dtype_names(tmp_path, dtype, name):
    assert load_kv_scales(_json(tmp_path / "kv.json", _vllm_doc(dtype=dtype))).encoding.name == name


def test_json_per_head_extension(tmp_path):
    doc = {"kv_cache": {"dtype": "float8_e4m3fn",
                        "k_scaling_factor": {"0": {"0": [0.5, 0.25], "1": 0.125}},
                        "v_scaling_factor": {"0": {"0": [1.0, 2.0], "1": 0.0625}}}}
    s = load_kv_scales(_json(tmp_path / "kv.json", doc))
    assert torch.equal(s.k[0], torch.tensor([0.5, 0.25])) and s.k[1] == 0.125
    assert torch.equal(s.v[0], torch.tensor([1.0, 2.0])) and s.num_kv_heads == 2 and s.model_type is None


def test_directory_with_json_scale_file(tmp_path):
    _json(tmp_path / "config.json", {"model_type": "llama", "num_hidden_layers": 4})
    _json(tmp_path / "tokenizer.json", {"model": {"vocab": {"a": 1}}})
    _json(tmp_path / "kv_cache_scales.json", _vllm_doc())
    s = load_kv_scales(tmp_path, num_layers=4)
    assert s.k[3] == 0.04 and s.source == str(tmp_path / "kv_cache_scales.json")


# -- valid forms: checkpoints ---------------------------------------------------------------------
PAIRS = [(a.suffix, b.suffix) for a, b in zip(scale_names.SPELLINGS, scale_names.SPELLINGS[1:])
         if (a.role, b.role) == ("k", "v") and a.origin == b.origin]


@pytest.mark.parametrize("k_suffix,v_suffix", PAIRS, ids=[p[0] for p in PAIRS])
def test_every_spelling_in_the_table(tmp_path, k_suffix, v_suffix):
    path = _ckpt(tmp_path / "model.safetensors", k_suffix=k_suffix, v_suffix=v_suffix)
    s = load_kv_scales(path, num_layers=4)
    assert s.k == tuple(_f32(0.01 * (i + 1)) for i in range(4))
    assert s.v == tuple(_f32(0.02 * (i + 1)) for i in range(4))
    assert s.encoding.name == "e4m3fn"  # what every FP8 exporter calibrates for


@pytest.mark.parametrize("prefix", [p for p in scale_names.PREFIXES])
def test_every_prefix(tmp_path, prefix):
    s = load_kv_scales(_ckpt(tmp_path / "m.safetensors", prefix=prefix), num_layers=4)
    assert s.k[1] == _f32(0.02)


def test_legacy_kv_scale_is_used_for_both_and_logged(tmp_path, caplog):
    path = _ckpt(tmp_path / "m.safetensors", k_suffix="self_attn.kv_scale", v_suffix=None)
    with caplog.at_level(logging.INFO, logger="hal"):
        s = load_kv_scales(path, num_layers=4)
    assert s.k == s.v == tuple(_f32(0.01 * (i + 1)) for i in range(4))
    assert "legacy kv_scale" in caplog.text and "model.layers.0.self_attn.kv_scale" in caplog.text


def test_mla_latent_scale_alone_serves_the_whole_cache(tmp_path, caplog):
    path = _ckpt(tmp_path / "m.safetensors", k_suffix="self_attn.kv_a_proj_with_mqa.k_scale", v_suffix=None)
    with caplog.at_level(logging.INFO, logger="hal"):
        s = load_kv_scales(path, num_layers=4)
    assert s.k == s.v
    assert "MLA latent cache" in caplog.text


def test_scalar_shapes_and_dtypes(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.5]),              # [1]: per tensor
               "model.layers.0.self_attn.v_scale": torch.tensor(0.25, dtype=torch.bfloat16),
               "model.layers.1.self_attn.k_scale": torch.tensor(0.125, dtype=torch.float16),
               "model.layers.1.self_attn.v_scale": torch.tensor(1.5, dtype=torch.float64)},
              str(tmp_path / "m.safetensors"))
    s = load_kv_scales(tmp_path / "m.safetensors")
    assert s.k == (0.5, 0.125) and s.v == (0.25, 1.5) and not s.per_head


def test_sharded_directory_without_index(tmp_path):
    full = _ckpt(tmp_path / "tmp.safetensors", layers=6)
    from safetensors.torch import load_file
    tensors = load_file(str(full))
    full.unlink()
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in keys[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    s = load_kv_scales(tmp_path, num_layers=6)
    assert s.k[5] == _f32(0.06) and s.v[5] == _f32(0.12)


def test_sharded_directory_with_index_reads_only_scale_tensors(tmp_path, monkeypatch):
    weight_map = {}
    for shard, layers in (("model-00001-of-00002.safetensors", range(0, 2)),
                          ("model-00002-of-00002.safetensors", range(2, 4))):
        t = {}
        for i in layers:
            t[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(64, 64)
            t[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.5 * (i + 1))
            t[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.25 * (i + 1))
        save_file(t, str(tmp_path / shard))
        weight_map.update({k: shard for k in t})
    _json(tmp_path / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    _json(tmp_path / "config.json", {"model_type": "mllama", "text_config": {"model_type": "llama"}})

    fetched = []
    real_safe_open = scale_files.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self._f = real_safe_open(*a, **kw)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, key):
            fetched.append(key)
            return self._inner.get_tensor(key)

    monkeypatch.setattr(scale_files, "safe_open", Recording)
    s = load_kv_scales(tmp_path, num_layers=4, model_type="llama")  # matches text_config.model_type
    assert s.k == (0.5, 1.0, 1.5, 2.0) and s.v == (0.25, 0.5, 0.75, 1.0) and s.model_type == "mllama"
    assert fetched and all("scale" in k for k in fetched) and len(fetched) == 8


def test_per_head_checkpoint_sliced_for_tp(tmp_path):
    path = _ckpt(tmp_path / "m.safetensors", per_head=4)
    whole = load_kv_scales(path, num_layers=4, num_kv_heads=4)
    assert whole.num_kv_heads == 4 and torch.equal(whole.k[0], torch.tensor([0.01, 0.02, 0.03, 0.04]))
    rank1 = load_kv_scales(path, tp_rank=1, tp_size=2)
    assert torch.equal(rank1.k[0], whole.k[0][2:]) and rank1.num_kv_heads == 2
    rank5 = load_kv_scales(path, tp_rank=5, tp_size=8)  # more ranks than heads: heads replicate
    assert torch.equal(rank5.v[3], whole.v[3][2:3])


def test_identical_duplicates_are_fine_conflicting_ones_are_not(tmp_path):
    _ckpt(tmp_path / "m.safetensors", extra={"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.01)})
    assert load_kv_scales(tmp_path / "m.safetensors").k[0] == _f32(0.01)
    _ckpt(tmp_path / "m.safetensors", extra={"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5)})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path / "m.safetensors")
    _expect(e, "m.safetensors", "model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.k_scale",
            "two different k scales")


def test_on_missing_one_fills_and_logs(tmp_path, caplog):
    path = _ckpt(tmp_path / "m.safetensors", layers=6, skip=(2, 3, 5))
    with caplog.at_level(logging.WARNING, logger="hal"):
        s = load_kv_scales(path, num_layers=8, on_missing="one")
    assert [s.k[i] for i in (2, 3, 5, 6, 7)] == [1.0] * 5 and s.k[4] == _f32(0.05)
    assert "layers 2-3, 5-7 of 8" in caplog.text


def test_unknown_scale_like_names_are_reported(tmp_path, caplog):
    extra = {"vision_tower.encoder.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.3),
             "model.layers.0.self_attn.weird.kv_scale_extra": torch.tensor(0.3)}
    path = _ckpt(tmp_path / "m.safetensors", extra=extra)
    with caplog.at_level(logging.WARNING, logger="hal"):
        load_kv_scales(path, num_layers=4)
    assert "vision_tower.encoder.layers.0.self_attn.k_proj.k_scale" in caplog.text
    assert "model.layers.0.self_attn.weird.kv_scale_extra" in caplog.text
    # ... and in the error when loading fails: the unknown spelling is probably where the scales are
    save_file({"model.layers.0.self_attn.attention.k_quant_scale.k_scale": torch.tensor(0.1)},
              str(tmp_path / "other.safetensors"))
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path / "other.safetensors")
    _expect(e, "other.safetensors", "no KV scales found", "model.layers.0.self_attn.attention.k_quant_scale.k_scale")


# -- errors: JSON ---------------------------------------------------------------------------------
def test_malformed_json(tmp_path):
    path = _json(tmp_path / "kv.json", '{"kv_cache": {"dtype": "float8_e4m3fn",, }')
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, "malformed JSON at line 1, column", "kv_cache")  # the expected schema names the keys


@pytest.mark.parametrize("doc,key,problem", [
    ([1, 2], "'kv_cache'", "a list at the top level"),
    ({"model_type": "llama"}, "'kv_cache'", "no such key"),
    ({"kv_cache": [1]}, "'kv_cache'", "got a list"),
    ({"kv_cache": {"scaling_factor": {}}}, "'kv_cache.dtype'", "missing"),
    ({"kv_cache": {"dtype": "float8_e4m3fn"}}, "'kv_cache.scaling_factor'", "missing"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": [0.1]}}, "'kv_cache.scaling_factor'",
     "expected an object keyed by TP rank"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"rank0": {}}}}, "'kv_cache.scaling_factor'",
     "TP rank keys"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": 0.1}}}, """'kv_cache.scaling_factor["0"]'""",
     "keyed by layer"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"x": 0.1}}}},
     """'kv_cache.scaling_factor["0"]'""", "layer keys"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": "0.1"}}}},
     """'kv_cache.scaling_factor["0"]["0"]'""", "expected a number"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": True}}}},
     """'kv_cache.scaling_factor["0"]["0"]'""", "expected a number"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": []}}}},
     """'kv_cache.scaling_factor["0"]["0"]'""", "non-empty list"),
    ({"model_type": 3, "kv_cache": {}}, "'model_type'", "expected a string"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_json_wrong_schema(tmp_path, doc, key, problem):
    path = _json(tmp_path / "kv.json", doc)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, key, problem)


@pytest.mark.parametrize("dtype,problem", [("float16", "expected an FP8 encoding"), ("int8", "got 'int8'"),
                                           ("fp8_e4m3", "ambiguous"), (8, "got 8")])
def test_json_dtype_not_fp8(tmp_path, dtype, problem):
    path = _json(tmp_path / "kv.json", _vllm_doc(dtype=dtype))
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, "'kv_cache.dtype'", problem)


def test_json_tp_rank_missing(tmp_path):
    path = _json(tmp_path / "kv.json", _vllm_doc(ranks=2))
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, tp_rank=2)
    _expect(e, path, "'kv_cache.scaling_factor'", "TP rank 2 missing", "[0, 1]")


def test_json_tp_size_mismatch(tmp_path):
    path = _json(tmp_path / "kv.json", _vllm_doc(ranks=2))
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, tp_rank=0, tp_size=4)
    _expect(e, path, "'kv_cache.scaling_factor'", "TP size mismatch", "tp_size=4")


def test_json_other_rank_has_wrong_layer_count(tmp_path):
    doc = _vllm_doc(ranks=2)
    del doc["kv_cache"]["scaling_factor"]["1"]["3"]
    path = _json(tmp_path / "kv.json", doc)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, tp_rank=0, tp_size=2, num_layers=4)
    _expect(e, path, """'kv_cache.scaling_factor["1"]'""", "TP rank 1 holds 3 layers", "num_layers=4")


def test_json_layer_missing(tmp_path):
    doc = _vllm_doc()
    del doc["kv_cache"]["scaling_factor"]["0"]["2"]
    path = _json(tmp_path / "kv.json", doc)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, num_layers=4)
    _expect(e, path, """'kv_cache.scaling_factor["0"]["2"]'""", "no scales for layer 2", "on_missing='one'")
    with pytest.raises(KVScaleError) as e:  # without num_layers: a gap is still a missing layer
        load_kv_scales(path)
    _expect(e, path, "no scales for layer 2")


def test_json_layer_count_not_num_layers(tmp_path):
    path = _json(tmp_path / "kv.json", _vllm_doc(layers=6))
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, num_layers=4)
    _expect(e, path, """'kv_cache.scaling_factor["0"]["4"]'""", "num_layers=4", "6 layers")


def test_json_model_type_mismatch(tmp_path):
    path = _json(tmp_path / "kv.json", _vllm_doc(model_type="llama"))
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, model_type="qwen2")
    _expect(e, path, "'model_type'", "'llama'", "expected 'qwen2'")


@pytest.mark.parametrize("value,problem", [(0.0, "is zero"), (-0.5, "is negative"), (0, "is zero"),
                                           (1e-50, "becomes 0.0 in float32"), (1e39, "becomes inf in float32")])
def test_json_bad_values(tmp_path, value, problem):
    doc = _vllm_doc()
    doc["kv_cache"]["scaling_factor"]["0"]["1"] = value
    path = _json(tmp_path / "kv.json", doc)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, """'kv_cache.scaling_factor["0"]["1"]'""", problem)


@pytest.mark.parametrize("text,problem", [("NaN", "is NaN"), ("Infinity", "is infinite"),
                                          ("-Infinity", "is infinite")])
def test_json_non_finite_values(tmp_path, text, problem):
    doc = json.dumps(_vllm_doc()).replace('"3": 0.04', f'"3": {text}')
    path = _json(tmp_path / "kv.json", doc)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, """'kv_cache.scaling_factor["0"]["3"]'""", problem)


def test_json_only_k_table(tmp_path):
    path = _json(tmp_path / "kv.json", {"kv_cache": {"dtype": "float8_e4m3fn",
                                                     "k_scaling_factor": {"0": {"0": 0.1}}}})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, "'kv_cache.v_scaling_factor'", "missing", "k_scaling_factor is present")


def test_json_per_head_wrong_length(tmp_path):
    doc = {"kv_cache": {"dtype": "float8_e4m3fn",
                        "scaling_factor": {"0": {"0": [0.1, 0.2], "1": [0.1, 0.2, 0.3]}}}}
    path = _json(tmp_path / "kv.json", doc)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, """'kv_cache.scaling_factor["0"]["1"]'""", "3 heads", "expected 2")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, num_kv_heads=3)
    _expect(e, path, """'kv_cache.scaling_factor["0"]["0"]'""", "2 heads", "expected 3")


def test_json_per_head_zero(tmp_path):
    doc = {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": [0.1, 0.0]}}}}
    path = _json(tmp_path / "kv.json", doc)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, """'kv_cache.scaling_factor["0"]["0"]'""", "head 1 is zero")


def test_json_encoding_argument_contradicting_the_file(tmp_path):
    path = _json(tmp_path / "kv.json", _vllm_doc())
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, encoding=E4M3FNUZ)
    _expect(e, path, "'kv_cache.dtype'", "for_encoding")


# -- errors: checkpoints --------------------------------------------------------------------------
@pytest.mark.parametrize("value,problem", [(0.0, "is zero"), (-1.0, "is negative"), (math.nan, "is NaN"),
                                           (math.inf, "is infinite"), (-math.inf, "is infinite")])
def test_checkpoint_bad_values(tmp_path, value, problem):
    path = _ckpt(tmp_path / "m.safetensors",
                 extra={"model.layers.2.self_attn.v_scale": torch.tensor(value)})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, "'model.layers.2.self_attn.v_scale'", problem)


def test_checkpoint_bad_shape(tmp_path):
    path = _ckpt(tmp_path / "m.safetensors", extra={"model.layers.2.self_attn.v_scale": torch.ones(2, 2)})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, "'model.layers.2.self_attn.v_scale'", "shape (2, 2)")


@pytest.mark.parametrize("k_suffix,v_suffix,have,lack,expected_key", [
    ("self_attn.k_scale", None, "a k scale", "no v scale", "model.layers.0.self_attn.v_scale"),
    (None, "self_attn.v_scale", "a v scale", "no k scale", "model.layers.0.self_attn.k_scale"),
    ("self_attn.k_proj.k_scale", None, "a k scale", "no v scale", "model.layers.0.self_attn.v_proj.v_scale"),
])
def test_checkpoint_only_one_of_k_v(tmp_path, k_suffix, v_suffix, have, lack, expected_key):
    path = _ckpt(tmp_path / "m.safetensors", k_suffix=k_suffix, v_suffix=v_suffix)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, num_layers=4)
    _expect(e, path, f"layer 0 has {have} but {lack}", expected_key)


def test_checkpoint_layer_missing(tmp_path):
    path = _ckpt(tmp_path / "m.safetensors", layers=5, skip=(1, 3), prefix="language_model.model.",
                 k_suffix="self_attn.attn.k_scale", v_suffix="self_attn.attn.v_scale")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, num_layers=5)
    _expect(e, path, "'language_model.model.layers.1.self_attn.attn.k_scale'", "no scales for layer 1",
            "layers missing: 1, 3 of 5")


def test_checkpoint_layer_count_not_num_layers(tmp_path):
    path = _ckpt(tmp_path / "m.safetensors", layers=5)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, num_layers=3)
    _expect(e, path, "'model.layers.3.self_attn.k_scale'", "num_layers=3", "5 layers (0-4)")


def test_checkpoint_model_type_mismatch(tmp_path):
    _ckpt(tmp_path / "model.safetensors")
    _json(tmp_path / "config.json", {"model_type": "llama"})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path, model_type="qwen2")
    _expect(e, tmp_path / "config.json", "'model_type'", "llama", "expected model_type='qwen2'")


def test_checkpoint_per_head_wrong_length(tmp_path):
    path = _ckpt(tmp_path / "m.safetensors", per_head=4,
                 extra={"model.layers.3.self_attn.k_scale": torch.tensor([0.1, 0.2])})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, "'model.layers.3.self_attn.k_scale'", "2 heads", "expected 4",
            "model.layers.0.self_attn.k_scale")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path, tp_rank=0, tp_size=3)
    _expect(e, path, "'model.layers.0.self_attn.k_scale'", "tp_size=3")


def test_checkpoint_no_scales(tmp_path):
    save_file({"model.layers.0.mlp.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, tmp_path, "no KV scales found", "self_attn.k_scale")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path, num_layers=2)
    _expect(e, tmp_path, "'model.layers.0.self_attn.k_scale'", "no scales for layer 0")


def test_index_names_a_missing_shard(tmp_path):
    _ckpt(tmp_path / "model-00001-of-00002.safetensors")
    _json(tmp_path / "model.safetensors.index.json", {"weight_map": {
        "model.layers.0.self_attn.k_scale": "model-00001-of-00002.safetensors",
        "model.layers.9.self_attn.k_scale": "model-00002-of-00002.safetensors"}})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, "model.safetensors.index.json", "'model.layers.9.self_attn.k_scale'",
            "model-00002-of-00002.safetensors", "does not exist")


def test_malformed_index_and_corrupt_shard(tmp_path):
    _ckpt(tmp_path / "model.safetensors")
    _json(tmp_path / "model.safetensors.index.json", "{nope")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, "model.safetensors.index.json", "'weight_map'", "JSONDecodeError")
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, "model.safetensors", "not a readable safetensors file")


def test_source_kinds(tmp_path):
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path / "absent.json")
    _expect(e, "absent.json", "no such file")
    (tmp_path / "scales.txt").write_text("0.1")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path / "scales.txt")
    _expect(e, "scales.txt", "expected a .json scale file")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(empty)
    _expect(e, empty, "no KV scales found")


def test_directory_with_two_sources_is_ambiguous(tmp_path):
    _ckpt(tmp_path / "model.safetensors")
    _json(tmp_path / "kv_cache_scales.json", _vllm_doc())
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, tmp_path, "kv_cache_scales.json", "expected one source")
    (tmp_path / "model.safetensors").unlink()
    _json(tmp_path / "more_scales.json", _vllm_doc())
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, tmp_path, "kv_cache_scales.json, more_scales.json", "several JSON scale files")


@pytest.mark.parametrize("kw,problem", [({"on_missing": "zero"}, "on_missing"), ({"tp_rank": -1}, "tp_rank"),
                                        ({"tp_rank": 2, "tp_size": 2}, "tp_size"),
                                        ({"num_layers": 0}, "num_layers")])
def test_bad_arguments(tmp_path, kw, problem):
    with pytest.raises(KVScaleError, match=problem):
        load_kv_scales(_json(tmp_path / "kv.json", _vllm_doc()), **kw)


def test_error_class_is_a_value_error():
    assert issubclass(KVScaleError, ValueError)


# -- the value type -------------------------------------------------------------------------------
def test_kvscales_validates_what_it_is_given():
    with pytest.raises(KVScaleError, match="layer 1 v_scale'.*is zero"):
        KVScales((0.1, 0.2), (0.1, 0.0))
    with pytest.raises(KVScaleError, match="2 k scales but 1 v scales"):
        KVScales((0.1, 0.2), (0.1,))
    with pytest.raises(KVScaleError, match="3 heads; expected 2"):
        KVScales((torch.ones(2),), (torch.ones(3),))
    with pytest.raises(KVScaleError, match="FP8 encoding"):
        KVScales((0.1,), (0.1,), torch.bfloat16)
    mine = torch.tensor([0.5, 0.25])
    s = KVScales((mine,), (0.5,))
    mine.fill_(7.0)
    assert torch.equal(s.k[0], torch.tensor([0.5, 0.25]))  # a copy, not the caller's tensor
    assert "1 layers, per-head (2 KV heads), calibrated for e4m3fn" in repr(s)


# -- encoding conversion --------------------------------------------------------------------------
def test_for_encoding_fn_to_fnuz_doubles_and_back():
    s = KVScales((0.1, torch.tensor([0.5, 3.0])), (0.3, torch.tensor([1.0, 2.0])), E4M3FN)
    u = s.for_encoding(E4M3FNUZ)
    assert u.encoding.name == "e4m3fnuz" and u.k[0] == 0.2 and u.v[0] == 0.6
    assert torch.equal(u.k[1], torch.tensor([1.0, 6.0]))
    assert u.for_encoding("e4m3fn") == s and s.for_encoding(E4M3FN) is s
    assert s.for_encoding("float8_e4m3fnuz") is u  # converted once, reused
    e5 = KVScales((0.1,), (0.2,), E5M2).for_encoding(torch.float8_e5m2fnuz)
    assert e5.k == (0.2,)  # same rule, derived from the encodings' biases


def test_for_encoding_agrees_with_fn_to_fnuz_bytes():
    """The factor is the one hal.fp8.fn_to_fnuz uses for bytes: every finite byte's value survives."""
    raw = torch.arange(256, dtype=torch.uint8).view(E4M3FN)
    s = KVScales((0.37,), (0.37,), E4M3FN)
    moved = fp8.fn_to_fnuz(raw)
    before = fp8.decode(raw, s.k[0]).double()
    after = fp8.decode(moved, s.for_encoding(E4M3FNUZ).k[0]).double()
    finite = torch.isfinite(before)
    assert torch.equal(before[finite], after[finite])


@pytest.mark.parametrize("src,dst", [(E5M2, E4M3FN), (E4M3FN, E5M2), (E4M3FNUZ, torch.float8_e5m2fnuz)])
def test_for_encoding_refuses_e5m2_e4m3(src, dst):
    s = KVScales((0.1,), (0.1,), src, source="my_scales.json")
    with pytest.raises(KVScaleError) as e:
        s.for_encoding(dst)
    _expect(e, "my_scales.json", "different exponent and mantissa widths", "Re-calibrate")


def test_for_cache():
    s = KVScales((0.1, torch.tensor([0.5, 0.25])), (0.3, torch.tensor([1.0, 2.0])), E4M3FN)
    fn = torch.zeros(2, 2, 4, 32, dtype=E4M3FN)
    fnuz = torch.zeros(2, 2, 4, 32, dtype=E4M3FNUZ)
    assert s.for_cache(0, fn) == (0.1, 0.3)
    assert s.for_cache(0, fnuz) == (0.2, 0.6)
    k, v = s.for_cache(1, fnuz)
    assert torch.equal(k, torch.tensor([1.0, 0.5])) and k.device == fnuz.device
    assert s.for_cache(1, fnuz)[0] is k  # made once, reused
    kt, vt = s.for_cache(0, fnuz, as_tensor=True)
    assert kt.dim() == 0 and kt.dtype == torch.float32 and float(kt) == _f32(0.2)
    assert s.for_cache(0, torch.zeros(2, 2, 4, 32, dtype=torch.bfloat16)) == (None, None)
    with pytest.raises(KVScaleError, match="the cache has num_kv_heads=4"):
        s.for_cache(1, torch.zeros(2, 4, 4, 32, dtype=E4M3FN))
    with pytest.raises(KVScaleError, match="no scales for layer 2; these cover layers 0..1"):
        s.for_cache(2, fn)
    with pytest.raises(KVScaleError, match="different exponent and mantissa widths"):
        s.for_cache(0, torch.zeros(2, 2, 4, 32, dtype=E5M2))


# -- JSON export ----------------------------------------------------------------------------------
def _awkward(i):
    return [0.1, 1 / 3, _f32(math.pi / 100), 2.0 ** -20, 1e-7 * 3, 448.0 / 7][i % 6]


@pytest.mark.parametrize("kind", ["same", "k_ne_v", "per_head", "mixed"])
def test_to_json_round_trip_is_exact(tmp_path, kind):
    n = 6
    k = tuple(_awkward(i) for i in range(n))
    v = {"same": k, "k_ne_v": tuple(_awkward(i + 1) for i in range(n))}.get(kind)
    if kind in ("per_head", "mixed"):
        gen = torch.Generator().manual_seed(0)
        k = tuple(torch.rand(3, generator=gen) + 0.01 for _ in range(n))
        v = tuple(torch.rand(3, generator=gen) + 0.01 if kind == "per_head" or i % 2 else _awkward(i)
                  for i in range(n))
    s = KVScales(k, v, E4M3FNUZ, model_type="qwen2")
    s.to_json(tmp_path / "out.json")
    back = load_kv_scales(tmp_path / "out.json", num_layers=n, model_type="qwen2")
    assert back == s and back.encoding == s.encoding and back.model_type == "qwen2"
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["kv_cache"]["dtype"] == "float8_e4m3fnuz"
    plain = doc["kv_cache"]["scaling_factor"]["0"]
    assert all(isinstance(x, float) for x in plain.values())  # vLLM can always read scaling_factor
    if kind == "same":
        assert set(doc["kv_cache"]) == {"dtype", "scaling_factor"}  # exactly vLLM's schema
    else:
        assert set(doc["kv_cache"]) == {"dtype", "scaling_factor", "k_scaling_factor", "v_scaling_factor"}
        for i in range(n):  # the vLLM fallback never saturates: the largest of the layer's scales
            peak = max(x if isinstance(x, float) else float(x.max()) for x in (k[i], v[i]))
            assert plain[str(i)] == peak


def test_to_json_for_a_tp_rank(tmp_path):
    KVScales((0.5,), (0.5,)).to_json(tmp_path / "r1.json", tp_rank=1, model_type="llama")
    doc = json.loads((tmp_path / "r1.json").read_text())
    assert doc == {"model_type": "llama",
                   "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"1": {"0": 0.5}}}}
    assert load_kv_scales(tmp_path / "r1.json", tp_rank=1).k == (0.5,)


# -- end to end: checkpoint scales through hal.cache_kv and hal.paged_attention --------------------
def _attention_f64(q, k, v, scale):
    """Plain float64 attention of one query token over real (unquantised) K/V, GQA by repetition.
    q [n, h, d]; k, v [n, t, hkv, d]."""
    g = q.shape[1] // k.shape[2]
    k = k.double().repeat_interleave(g, dim=2)
    v = v.double().repeat_interleave(g, dim=2)
    logits = torch.einsum("nhd,nthd->nht", q.double(), k) * scale
    return torch.einsum("nht,nthd->nhd", torch.softmax(logits, dim=-1), v)


def _fp8_bound(q, k, v, sm, k_scale, v_scale, enc):
    """First-order bound on |out(FP8 K/V) - out(real K/V)| per output element, from FP8 rounding alone.

    Rounding to the nearest FP8 value moves x by at most u|x| + s*m/2 (u = 2^-(mantissa bits + 1),
    the relative half-ulp, 1/16 for e4m3; m the smallest subnormal, s the scale). So a logit moves by
    at most  e_j = sm * sum_d |q_d| (u|k_jd| + s_k m/2),  the softmax weights by at most 2*max_j e_j
    in L1, and  |d out| <= max|v| * 2 max_j e_j + (u max|v| + s_v m/2).  A wrong scale breaks it:
    saturation or underflow move values by far more than half an ulp.
    """
    u, m = 2.0 ** -(enc.mantissa_bits + 1), enc.min_subnormal
    g = q.shape[1] // k.shape[2]
    ks = torch.as_tensor(k_scale, dtype=torch.float64).reshape(-1).expand(k.shape[2]).repeat_interleave(g)
    vs = torch.as_tensor(v_scale, dtype=torch.float64).reshape(-1).expand(k.shape[2]).repeat_interleave(g)
    kk = k.double().abs().repeat_interleave(g, dim=2)                       # [n, t, h, d]
    vmax = v.double().abs().repeat_interleave(g, dim=2).amax(dim=(1, 3))   # [n, h]
    e = sm * torch.einsum("nhd,nthd->nht", q.double().abs(), u * kk + (ks * m / 2)[None, None, :, None])
    return (vmax * 2 * e.amax(dim=-1) + u * vmax + vs * m / 2)[..., None] * 1.01  # 1%: second order


@pytest.mark.parametrize("cache_dtype", [E4M3FN, E4M3FNUZ], ids=str)
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_checkpoint_scales_through_hal_ops(tmp_path, cache_dtype, per_head):
    """Scales from a checkpoint, through hal.cache_kv and hal.paged_attention, give the real
    attention within FP8 rounding error, on e4m3fn and (through for_cache -> for_encoding) e4m3fnuz.

    K values reach ~2000 in magnitude (far past e4m3's 448) and V ~0.005 (mostly below its smallest
    subnormal 2^-9): only the right scale, converted for the cache's encoding, keeps both inside the
    format. Tolerances: (1) each cached value within half an ulp of the real one,
    |err| <= 2^-4 |x| + s * min_subnormal / 2 (3 mantissa bits: the tightest statement of "FP8
    rounding error"); (2) the kernel against the float64 reference on the same bytes within 1e-5
    (float32 compute); (3) the output against float64 attention on the real K/V within _fp8_bound,
    the first-order propagation of (1) through the logits, the softmax and the weighted sum of V,
    and a relative L2 error below 2^-3.
    """
    gen = torch.Generator().manual_seed(1)
    layers, n, h, hkv, d, bs, t = 2, 3, 8, 2, 64, 16, 40
    real = {}
    tensors = {}
    for layer in range(layers):
        k = torch.randn(n, t, hkv, d, generator=gen) * 500 * (layer + 1)
        v = torch.randn(n, t, hkv, d, generator=gen) * 1e-3
        real[layer] = (k, v)
        for role, x in (("k", k), ("v", v)):
            amax = x.abs().amax(dim=(0, 1, 3)) if per_head else x.abs().amax()
            tensors[f"model.layers.{layer}.self_attn.{role}_scale"] = (amax / 448.0).float()  # e4m3fn calibration
    save_file(tensors, str(tmp_path / "model.safetensors"))
    scales = load_kv_scales(tmp_path, num_layers=layers)
    assert scales.encoding.name == "e4m3fn" and scales.per_head == per_head

    enc = fp8.encoding_of(cache_dtype)
    blocks_per_seq = (t + bs - 1) // bs
    block_tables = torch.arange(n * blocks_per_seq, dtype=torch.int32).reshape(n, blocks_per_seq).flip(0)
    seq_lens = torch.full((n,), t, dtype=torch.int32)
    slots = (block_tables.long()[:, :, None] * bs + torch.arange(bs)).reshape(n, -1)[:, :t].reshape(-1)
    for layer in range(layers):
        k, v = real[layer]
        key_cache = torch.zeros(n * blocks_per_seq, hkv, bs, d, dtype=cache_dtype)
        value_cache = torch.zeros_like(key_cache)
        k_scale, v_scale = scales.for_cache(layer, key_cache)
        if cache_dtype == E4M3FNUZ:  # for_cache applied for_encoding: the e4m3fn scales doubled
            assert scales.for_encoding(cache_dtype)[layer] == (k_scale, v_scale) or per_head
            assert np.allclose(np.asarray(torch.as_tensor(k_scale)), 2 * np.asarray(torch.as_tensor(scales.k[layer])))
        hal.cache_kv(k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), key_cache, value_cache, slots,
                     k_scale=k_scale, v_scale=v_scale)
        q = torch.randn(n, h, d, generator=gen) / (500 * (layer + 1)) * 3
        out = hal.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                  k_scale=k_scale, v_scale=v_scale, pack="emu")
        sm = d ** -0.5
        # 1. every cached value is the real one rounded to the nearest FP8 value: no saturation, no
        #    flush to zero beyond half the smallest subnormal (what a wrong scale would cause)
        u, m = 2.0 ** -(enc.mantissa_bits + 1), enc.min_subnormal
        for cache, x, s in ((key_cache, k, k_scale), (value_cache, v, v_scale)):
            s = torch.as_tensor(s, dtype=torch.float64).reshape(1, -1, 1).expand(1, hkv, 1)
            held = torch.from_numpy(reference.cache_values(cache)).permute(0, 2, 1, 3).reshape(-1, hkv, d)[slots] * s
            want = x.double().reshape(-1, hkv, d)
            assert bool(((held - want).abs() <= u * want.abs() + s * m / 2).all())
        # 2. the kernel computed what the cache holds (float32 arithmetic only)
        ref = reference.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                        k_scale=k_scale, v_scale=v_scale)
        assert np.allclose(out.double().numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        # 3. so the output is the real attention within the FP8 rounding bound
        exact = _attention_f64(q, k, v, sm)
        bound = _fp8_bound(q, k, v, sm, k_scale, v_scale, enc)
        err = (out.double() - exact).abs()
        assert bool((err <= bound).all()), f"worst error/bound {float((err / bound).max()):.3g}"
        assert reference.relative_l2(out.double().numpy(), exact.numpy()) < 2 * u  # ~5% seen: 3 mantissa bits


def test_unconverted_e4m3fn_scales_on_an_fnuz_cache_saturate():
    """The negative control for the test above: e4m3fn scales used as-is on an e4m3fnuz cache push
    the largest values past fnuz's 240 and they saturate, which FP8 rounding alone cannot explain."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2, 64, generator=gen) * 500
    s_fn = float(x.abs().max() / 448.0)
    scales = KVScales((s_fn,), (s_fn,), E4M3FN)
    enc = fp8.encoding_of(E4M3FNUZ)
    u = 2.0 ** -(enc.mantissa_bits + 1)
    for scale, ok in ((scales.for_encoding(E4M3FNUZ).k[0], True), (scales.k[0], False)):
        back = fp8.decode(fp8.encode(x, E4M3FNUZ, scale), scale).double()
        within = bool(((back - x.double()).abs() <= u * x.double().abs() + scale * enc.min_subnormal / 2).all())
        assert within == ok


# -- hardening: duplicate JSON keys, unreadable paths -----------------------------------------------
_SF = '"dtype": "float8_e4m3fn", "scaling_factor"'


@pytest.mark.parametrize("text,key,problem", [
    ('{"kv_cache": {%s: {"0": {"0": 0.1, "0": 0.2}}}}' % _SF,
     """'kv_cache.scaling_factor["0"]["0"]'""", "layer 0 appears twice"),
    ('{"kv_cache": {%s: {"0": {"0": 0.1, "1": 0.1, "00": 0.2}}}}' % _SF,
     """'kv_cache.scaling_factor["0"]["00"]'""", "layer 0 appears twice (also as \"0\")"),
    ('{"kv_cache": {%s: {"0": {"0": 0.1}, "1": {"1": 0.1, "01": 0.2}}}}' % _SF,  # a rank not loaded
     """'kv_cache.scaling_factor["1"]["01"]'""", "layer 1 appears twice (also as \"1\")"),
    ('{"kv_cache": {%s: {"0": {"0": 0.1}, "0": {"0": 0.2}}}}' % _SF,
     """'kv_cache.scaling_factor["0"]'""", "TP rank 0 appears twice"),
    ('{"kv_cache": {%s: {"0": {"0": 0.1}, "000": {"0": 0.2}}}}' % _SF,
     """'kv_cache.scaling_factor["000"]'""", "TP rank 0 appears twice (also as \"0\")"),
    ('{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.3}}, '
     '"k_scaling_factor": {"0": {"0": 0.1, "0": 0.3}}, "v_scaling_factor": {"0": {"0": 0.2}}}}',
     """'kv_cache.k_scaling_factor["0"]["0"]'""", "layer 0 appears twice"),
    ('{"kv_cache": {%s: {"0": {"0": 0.1}}, "scaling_factor": {"0": {"0": 0.2}}}}' % _SF,
     "'kv_cache.scaling_factor'", "appears twice"),
    ('{"kv_cache": {"dtype": "float8_e4m3fn", "dtype": "float8_e4m3fnuz", "scaling_factor": {"0": {"0": 0.1}}}}',
     "'kv_cache.dtype'", "appears twice"),
    ('{"kv_cache": {%s: {"0": {"0": 0.1}}}, "kv_cache": {%s: {"0": {"0": 0.2}}}}' % (_SF, _SF),
     "'kv_cache'", "appears twice"),
    ('{"model_type": "llama", "model_type": "qwen2", "kv_cache": {%s: {"0": {"0": 0.1}}}}' % _SF,
     "'model_type'", "appears twice"),
], ids=["layer", "layer-0-and-00", "layer-other-rank", "rank", "rank-0-and-000", "k-table-layer",
        "table", "dtype", "kv_cache", "model_type"])
def test_json_duplicate_keys_are_refused(tmp_path, text, key, problem):
    """json.loads lets the last of two equal keys win; "0" and "00" name one layer (or rank) too."""
    path = _json(tmp_path / "kv.json", text)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(path)
    _expect(e, path, key, problem, "expected each")


def _loop(link):
    link.symlink_to(link.name)  # a link to itself: resolving it is ELOOP
    return link


@pytest.mark.parametrize("name", ["kv_cache_scales.json", "model.safetensors.index.json", "loop.safetensors"])
def test_symlink_loop_in_a_checkpoint_directory(tmp_path, name):
    _ckpt(tmp_path / "model.safetensors")
    link = _loop(tmp_path / name)
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, link, "symlink loop")


def test_symlink_loop_as_the_source_or_a_shard_the_index_names(tmp_path):
    link = _loop(tmp_path / "kv.json")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(link)
    _expect(e, link, "symlink loop")
    link.unlink()
    _loop(tmp_path / "model-00001-of-00001.safetensors")
    _json(tmp_path / "model.safetensors.index.json",
          {"weight_map": {"model.layers.0.self_attn.k_scale": "model-00001-of-00001.safetensors"}})
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path)
    _expect(e, "model-00001-of-00001.safetensors", "symlink loop")


def test_symlink_loop_config_json_is_not_skipped_when_model_type_is_checked(tmp_path):
    _ckpt(tmp_path / "model.safetensors")
    link = _loop(tmp_path / "config.json")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(tmp_path, model_type="llama")
    _expect(e, link, "symlink loop")


def test_broken_symlink_source_says_where_it_points(tmp_path):
    link = tmp_path / "kv.json"
    link.symlink_to("gone.json")
    with pytest.raises(KVScaleError) as e:
        load_kv_scales(link)
    _expect(e, link, "no such file", "'gone.json'")
