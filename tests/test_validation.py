"""Bad input gets an error that names the argument, what was expected and what was given."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import hal
from cases import make_case

pytestmark = pytest.mark.emu


@pytest.fixture
def case():
    return make_case(seq_lens=[10, 33], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)


def call(case, **over):
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=case.k_scale,
                v_scale=case.v_scale)
    args.update(over)
    q = args.pop("query")
    return hal.paged_attention(q, args.pop("key_cache"), args.pop("value_cache"), args.pop("block_tables"),
                               args.pop("seq_lens"), **args)


BAD = {
    "uint8 cache": (lambda c: dict(key_cache=c.key_cache.view(torch.uint8), value_cache=c.value_cache.view(torch.uint8)),
                    r"key_cache is uint8: .*view\(torch.float8_e4m3fn\)"),
    "int cache": (lambda c: dict(key_cache=c.key_cache.view(torch.int8), value_cache=c.value_cache.view(torch.int8)),
                  r"key_cache must be float16, bfloat16, float32 or a torch float8 dtype; got int8"),
    "3-d cache": (lambda c: dict(key_cache=c.key_cache[0], value_cache=c.value_cache[0]),
                  r"key_cache must be 4-d \[num_blocks, num_kv_heads, block_size, head_size\]"),
    "NHD cache": (lambda c: dict(key_cache=c.key_cache.transpose(1, 2).contiguous().transpose(1, 2),
                                 value_cache=c.value_cache),
                  r"key_cache must be dense within each block"),
    "v differs": (lambda c: dict(value_cache=c.value_cache.to(torch.float8_e5m2)),
                  r"value_cache must be the same shape and dtype as key_cache"),
    "query 2-d": (lambda c: dict(query=c.query[0]), r"query must be 3-d \[num_seqs, num_heads, head_size\]"),
    "query int": (lambda c: dict(query=c.query.to(torch.int32)), r"query must be float16, bfloat16 or float32; got int32"),
    "head size": (lambda c: dict(query=c.query[..., :32]), r"query must be head_size 64 like the caches"),
    "heads": (lambda c: dict(query=torch.randn(2, 7, 64, dtype=torch.bfloat16)),
              r"query must be a number of heads divisible by num_kv_heads=2; got 7 heads"),
    "table int64": (lambda c: dict(block_tables=c.block_tables.long()), r"block_tables must be an int32 \[num_seqs=2"),
    "table rows": (lambda c: dict(block_tables=c.block_tables[:1]), r"block_tables must be an int32 \[num_seqs=2"),
    "seq_lens int64": (lambda c: dict(seq_lens=c.seq_lens.long()), r"seq_lens must be an int32 \[num_seqs=2\]"),
    "seq_lens too long": (lambda c: dict(seq_lens=torch.tensor([10, 1000], dtype=torch.int32)),
                          r"seq_lens must be within \[0, 64\] \(block_tables has 4 blocks of 16 tokens per sequence\); got values from 10 to 1000"),
    "seq_lens negative": (lambda c: dict(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
                          r"seq_lens must be within \[0, 64\].*got values from -1 to 3"),
    "table entry": (lambda c: dict(block_tables=c.block_tables.clone().fill_(10**6)),
                    r"block_tables must be entries in \[0, \d+\) for every block a sequence uses"),
    "scale": (lambda c: dict(scale=-1.0), r"scale must be a finite float > 0"),
    "k_scale zero": (lambda c: dict(k_scale=0.0), r"k_scale must be finite and > 0; got 0.0"),
    "v_scale nan": (lambda c: dict(v_scale=math.nan), r"v_scale must be finite and > 0; got nan"),
    "k_scale wrong heads": (lambda c: dict(k_scale=torch.ones(3)), r"k_scale must be a float, a 0-d tensor or a \[num_kv_heads=2\] tensor"),
    "k_scale float64": (lambda c: dict(k_scale=torch.ones(2, dtype=torch.float64)), r"k_scale must be a float32 tensor"),
    "k_scale tensor negative": (lambda c: dict(k_scale=torch.tensor([1.0, -2.0])), r"k_scale must be finite and > 0; got \[1.0, -2.0\]"),
    "k_scale string": (lambda c: dict(k_scale="0.1"), r"k_scale must be a float or a float32 tensor; got str"),
    "alibi": (lambda c: dict(alibi_slopes=torch.ones(4)), r"alibi_slopes must be a float32 \[num_heads=8\] tensor"),
    "soft cap": (lambda c: dict(logits_soft_cap=0.0), r"logits_soft_cap must be None or a finite float > 0"),
    "window 0": (lambda c: dict(sliding_window=0), r"sliding_window must be None \(no window\) or an int >= 1"),
    "window -1": (lambda c: dict(sliding_window=-1), r"sliding_window must be None"),
    "max_seq_len small": (lambda c: dict(max_seq_len=20), r"max_seq_len must be >= every seq_len \(max is 33\); got 20"),
    "max_seq_len huge": (lambda c: dict(max_seq_len=10**6), r"max_seq_len must be <= the block table's capacity 64 tokens; got 1000000"),
    "out dtype": (lambda c: dict(out=torch.empty(2, 8, 64)), r"out must be like query"),
    "out shape": (lambda c: dict(out=torch.empty(2, 8, 32, dtype=torch.bfloat16)), r"out must be like query"),
    "not a tensor": (lambda c: dict(query=[1, 2]), r"query must be a torch.Tensor; got list"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_paged_attention_arguments(case, name):
    make, pattern = BAD[name]
    with pytest.raises((hal.ArgumentError, ValueError)) as err:
        call(case, **make(case))
    if pattern:
        assert err.value.args and __import__("re").search(pattern, str(err.value)), str(err.value)
    assert str(err.value).startswith("hal.paged_attention:") or "k_scale" in str(err.value)


def test_unsupported_head_size_names_the_pack_and_reason():
    c = make_case(seq_lens=[5], head_size=20)
    with pytest.raises(hal.NotSupportedError, match=r"head_size 20 is not supported \(supported: 32-256 step 8\)"):
        call(c)


def test_fp8_cache_without_scales_warns_once(case, caplog):
    with caplog.at_level(logging.WARNING, logger="hal"):
        call(case, k_scale=None, v_scale=None)
        call(case, k_scale=None, v_scale=None)
    msgs = [r.getMessage() for r in caplog.records if "no k_scale/v_scale" in r.getMessage()]
    assert len(msgs) == 1 and "using 1.0" in msgs[0]


def test_fp8_cache_without_scales_is_an_error_when_strict(case, monkeypatch):
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(hal.ArgumentError, match="HAL_STRICT=1"):
        call(case, k_scale=None, v_scale=None)


def test_unknown_env_values_raise(case, monkeypatch):
    monkeypatch.setenv("HAL_STRICT", "maybe")
    with pytest.raises(ValueError, match=r"HAL_STRICT='maybe' is not understood: expected 0 or 1"):
        call(case)
    monkeypatch.delenv("HAL_STRICT")
    monkeypatch.setenv("HAL_TARGET", "tpu_v5")
    with pytest.raises(ValueError, match=r"HAL_TARGET='tpu_v5' is not understood"):
        call(case)
    monkeypatch.delenv("HAL_TARGET")
    monkeypatch.setenv("HAL_PACK", "fastest")
    with pytest.raises(ValueError, match=r"no pack named 'fastest': known packs are .*emu"):
        call(case)


def test_unknown_hal_variable_names_warn(monkeypatch):
    monkeypatch.setenv("HAL_STICT", "1")
    with pytest.warns(UserWarning, match="HAL_STICT is set but hal knows no such variable"):
        hal.packs()


def test_cache_kv_bad_arguments():
    kc = torch.zeros(4, 2, 8, 64, dtype=torch.float8_e4m3fn)
    k = torch.randn(3, 2, 64)
    with pytest.raises(hal.ArgumentError, match=r"slot_mapping must be an int64 \[num_tokens=3\] tensor; got int32"):
        hal.cache_kv(k, k, kc, kc.clone(), torch.arange(3, dtype=torch.int32), k_scale=1.0, v_scale=1.0)
    with pytest.raises(hal.ArgumentError, match=r"key must be 3-d \[num_tokens, num_kv_heads=2, head_size=64\]"):
        hal.cache_kv(k[:, :1], k[:, :1], kc, kc.clone(), torch.arange(3), k_scale=1.0, v_scale=1.0)
    with pytest.raises(hal.ArgumentError, match=r"value must be the same shape and dtype as key"):
        hal.cache_kv(k, k.half(), kc, kc.clone(), torch.arange(3), k_scale=1.0, v_scale=1.0)
    with pytest.raises(hal.ArgumentError, match=r"key_cache is uint8"):
        hal.cache_kv(k, k, kc.view(torch.uint8), kc.view(torch.uint8), torch.arange(3))
