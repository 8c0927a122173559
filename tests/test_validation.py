"""Bad input gets an error that names the argument, what was expected and what was given."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

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
    "head_size strided": (lambda c: dict(key_cache=c.key_cache.transpose(2, 3).contiguous().transpose(2, 3),
                                         value_cache=c.value_cache),
                          r"key_cache must be contiguous in head_size .*permute\(0, 2, 1, 3\) view"),
    "v differs": (lambda c: dict(value_cache=c.value_cache.to(torch.float8_e5m2)),
                  r"value_cache must be the same shape and dtype as key_cache"),
    "query 2-d": (lambda c: dict(query=c.query[0]), r"query must be 3-d \[total_q, num_heads, head_size\]"),
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
    "k_scale string": (lambda c: dict(k_scale="0.1"), r"k_scale must be a float or a float32 tensor; got '0.1' \(str\)"),
    "alibi": (lambda c: dict(alibi_slopes=torch.ones(4)), r"alibi_slopes must be a float32 \[num_heads=8\] tensor"),
    "soft cap": (lambda c: dict(logits_soft_cap=0.0), r"logits_soft_cap must be None or a finite float > 0"),
    "window 0": (lambda c: dict(sliding_window=0), r"sliding_window must be None \(no window; .*\) or an int >= 1; got 0"),
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


def test_fp8_cache_without_scales_warns_once(case):
    """A user must see it (a warning, not only a log record with no handler), once per op."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call(case, k_scale=None, v_scale=None)
        call(case, k_scale=None, v_scale=None)
    msgs = [str(w.message) for w in seen if issubclass(w.category, hal.MissingScaleWarning)]
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
    monkeypatch.setenv("HAL_CUDA_PREFILL", "fast")
    with pytest.raises(ValueError, match=r"HAL_CUDA_PREFILL='fast' is not understood: expected one of auto, mma, wgmma, cute"):
        hal.env.check()
    monkeypatch.setenv("HAL_CUDA_PREFILL", " WGMMA ")
    assert hal.env.cuda_prefill_kernel() == "wgmma"
    monkeypatch.delenv("HAL_CUDA_PREFILL")
    monkeypatch.setenv("HAL_PACK", "fastest")
    with pytest.raises(hal.EnvValueError, match=r"HAL_PACK='fastest' is not understood: expected the name of a "
                                                r"pack: .*emu"):
        call(case)
    with pytest.raises(ValueError, match=r"no pack named 'fastest': known packs are .*emu"):
        call(case, pack="fastest")


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


# ---------------------------------------------------------------------------------------------
# The second catalogue of bad and edge inputs (hardening issue).

def _cache_kv_args(dtype=torch.bfloat16):
    kc = torch.zeros(4, 2, 8, 64, dtype=dtype)
    return torch.randn(3, 2, 64), torch.randn(3, 2, 64), kc, kc.clone(), torch.tensor([0, 9, 17])


@pytest.mark.parametrize("which", ["block_tables", "seq_lens", "k_scale", "out"])
def test_a_meta_tensor_among_real_ones_is_refused(case, which):
    """Torch routes a call with any meta tensor to the shape-only kernel: it must refuse the mix
    instead of returning uninitialised memory."""
    if which == "k_scale":
        over = dict(k_scale=torch.tensor([0.01, 0.02], device="meta"))
    elif which == "out":
        over = dict(out=torch.empty(case.query.shape, dtype=case.query.dtype, device="meta"))
    else:
        over = {which: getattr(case, which).to("meta")}
    with pytest.raises(hal.ArgumentError, match=rf"{which} is on the meta device while .* on cpu"):
        call(case, **over)


def test_cache_kv_meta_slot_mapping_is_refused():
    k, v, kc, vc, slots = _cache_kv_args()
    with pytest.raises(hal.ArgumentError, match=r"slot_mapping is on the meta device"):
        hal.cache_kv(k, v, kc, vc, slots.to("meta"))


def test_all_meta_call_still_infers_shapes(case):
    m = lambda t: t.to("meta")  # noqa: E731
    out = hal.paged_attention(m(case.query), m(case.key_cache), m(case.value_cache), m(case.block_tables),
                              m(case.seq_lens), k_scale=0.5, v_scale=0.5)
    assert out.device.type == "meta" and out.shape == case.query.shape


@pytest.mark.parametrize("arg", ["sliding_window", "max_seq_len"])
def test_bools_are_not_ints(case, arg):
    with pytest.raises(hal.ArgumentError, match=rf"{arg} must be None .* or an int >= \d; got True \(bool\)"):
        call(case, **{arg: True})


@pytest.mark.parametrize("arg", ["scale", "logits_soft_cap", "k_scale"])
def test_bools_are_not_floats(case, arg):
    with pytest.raises(hal.ArgumentError, match=rf"{arg} must be .*; got True \(bool\)"):
        call(case, **{arg: True})


def test_autograd_is_refused_on_every_op(case):
    """hal's ops are inference-only: a tensor that requires grad (with grad mode on) is an error,
    never a cache silently attached to the autograd graph."""
    k, v, kc, vc, slots = _cache_kv_args(torch.bfloat16)
    k.requires_grad_(True)
    with pytest.raises(hal.ArgumentError, match=r"key requires grad; hal's ops are inference-only"):
        hal.cache_kv(k, v, kc, vc, slots)
    assert not kc.requires_grad and kc.grad_fn is None
    q = case.query.float().requires_grad_(True)
    with pytest.raises(hal.ArgumentError, match=r"query requires grad.*torch.no_grad\(\)"):
        call(case, query=q)
    with torch.no_grad():  # the documented way: fine, and nothing is tracked
        hal.cache_kv(k, v, kc, vc, slots)
        out = call(case, query=q)
    assert kc.grad_fn is None and not out.requires_grad


def test_a_scale_given_twice_to_the_torch_op_is_an_error(case):
    args = list(hal.ops.OPS["paged_attention"].schema_args(case.query, case.key_cache, case.value_cache,
                                                           case.block_tables, case.seq_lens, k_scale=0.5))
    args[9] = torch.tensor(0.25)  # the k_scale tensor slot, beside the float slot's 0.5
    with pytest.raises(hal.ArgumentError, match=r"k_scale was given twice, as the float 0.5 and as a tensor"):
        torch.ops.hal.paged_attention.default(*args)


def test_strict_raises_every_time_even_after_a_warning(case, monkeypatch):
    with pytest.warns(hal.MissingScaleWarning):
        call(case, k_scale=None, v_scale=None)
    monkeypatch.setenv("HAL_STRICT", "1")
    for _ in range(2):
        with pytest.raises(hal.ArgumentError, match="HAL_STRICT=1"):
            call(case, k_scale=None, v_scale=None)


def test_fallback_warning_is_visible_without_logging_setup(monkeypatch):
    """No handler on the 'hal' logger: the user still sees the fallback (a warning)."""
    monkeypatch.setenv("HAL_TARGET", "gfx942")
    c = make_case(seq_lens=[5], cache_dtype=torch.float8_e4m3fnuz)
    with pytest.warns(hal.FallbackWarning, match=r"falls back to the emu pack on rocm:gfx942"):
        call(c)


@pytest.mark.parametrize("name,make,pattern", [
    ("head_size 0", lambda c: dict(query=c.query[..., :0], key_cache=c.key_cache[..., :0],
                                   value_cache=c.value_cache[..., :0]),
     r"key_cache must be \[num_blocks, num_kv_heads, block_size, head_size\] with head_size >= 1"),
    ("1-d key_cache", lambda c: dict(key_cache=c.key_cache.flatten(), k_scale=torch.tensor([1.0, 1.0])),
     r"key_cache must be 4-d"),
    ("block_size 0", lambda c: dict(key_cache=c.key_cache[:, :, :0], value_cache=c.value_cache[:, :, :0]),
     r"key_cache must be .* with block_size >= 1"),
    ("k_scale overflows float32", lambda c: dict(k_scale=1e39),
     r"k_scale must be finite and > 0 as a float32 .*; got 1e\+39"),
    ("scale overflows float32", lambda c: dict(scale=1e39), r"scale must be a finite float > 0 .* as a float32"),
    ("0-d query", lambda c: dict(query=torch.tensor(1.0, dtype=torch.bfloat16)), r"query must be 3-d"),
])
def test_edge_shapes_and_values_get_named_errors(case, name, make, pattern):
    with pytest.raises(hal.ArgumentError, match=pattern):
        call(case, **make(case))


def test_strided_last_dim_query_and_out_are_accepted(case):
    """Any strides, as torch's own ops accept: a transposed view is copied where a kernel needs it."""
    want = call(case)
    n, h, d = case.query.shape
    q_t = case.query.transpose(1, 2).contiguous().transpose(1, 2)  # same values, last-dim stride h
    out_t = torch.full((n, d, h), float("nan"), dtype=case.query.dtype).transpose(1, 2)
    assert q_t.stride(-1) != 1 and out_t.stride(-1) != 1
    got = call(case, query=q_t, out=out_t)
    assert got is out_t and torch.equal(out_t, want)
    k, v, kc, vc, slots = _cache_kv_args(torch.bfloat16)
    kc2, vc2 = kc.clone(), vc.clone()
    hal.cache_kv(k, v, kc, vc, slots)
    hal.cache_kv(k.transpose(1, 2).contiguous().transpose(1, 2), v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def _import_hal(env: dict) -> subprocess.CompletedProcess:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, *(p for p in sys.path if p)])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    return subprocess.run([sys.executable, "-W", "always", "-c", "import hal; print(hal.env.debug())"],
                          env={**clean, "PYTHONPATH": path, **env}, capture_output=True, text=True, timeout=120)


def test_environment_is_checked_at_import():
    """Unknown HAL_* names warn and values hal cannot parse raise when hal is imported, not at a
    first use that may never come (HAL_DEBUG is read only for GPU tensors)."""
    bad = _import_hal({"HAL_DEBUG": "maybe"})
    assert bad.returncode != 0 and "HAL_DEBUG='maybe' is not understood" in bad.stderr
    typo = _import_hal({"HAL_FOO": "1"})
    assert typo.returncode == 0 and "HAL_FOO is set but hal knows no such variable" in typo.stderr
    on = _import_hal({"HAL_DEBUG": "on"})
    assert on.returncode == 0 and on.stdout.strip() == "True"
    target = _import_hal({"HAL_TARGET": "tpu_v5"})
    assert target.returncode != 0 and "HAL_TARGET='tpu_v5' is not understood" in target.stderr
