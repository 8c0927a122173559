"""Several query tokens per sequence through the public op (``hal.paged_attention(...,
query_start_loc=...)``): validation of ``query_start_loc``, dispatch (packs without the op's
``varlen`` feature are passed over with that reason), the emu pack's result against the float64
reference, decode calls unchanged bit for bit, torch.compile and opcheck. The emu path itself is
swept in test_emu_prefill.py."""

from __future__ import annotations

import pytest
import torch

import hal
from cases import make_case, tolerance_ok
from cases import make_varlen

pytestmark = pytest.mark.emu


def _call(c, **over):
    kw = dict(k_scale=c.k_scale, v_scale=c.v_scale, query_start_loc=c.query_start_loc, causal=c.causal, **c.kwargs)
    kw.update(over)
    q = kw.pop("query", c.query)
    return hal.paged_attention(q, c.key_cache, c.value_cache, c.block_tables, kw.pop("seq_lens", c.seq_lens), **kw)


@pytest.fixture
def mixed():
    # a prefill, a chunk of a longer prompt, decode rows and a sequence with no new rows
    return make_varlen([40, 100, 7, 33, 5], [40, 17, 1, 1, 0], num_heads=8, num_kv_heads=2, head_size=64,
                       block_size=16, cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
def test_mixed_batch_matches_float64(cache_dtype):
    c = make_varlen([40, 100, 7, 33, 5], [40, 17, 1, 1, 0], num_heads=8, num_kv_heads=2, head_size=64,
                    block_size=16, cache_dtype=cache_dtype, seed=3)
    out = torch.full_like(c.query, float("nan"))
    assert _call(c, out=out, max_query_len=40) is out
    ok, msg = tolerance_ok(out, c.reference())
    assert ok, msg


def test_features_and_non_causal():
    c = make_varlen([60, 9], [25, 9], num_heads=8, num_kv_heads=2, head_size=64, block_size=8,
                    cache_dtype=torch.float8_e4m3fn, alibi_slopes=torch.linspace(0.1, 0.8, 8),
                    logits_soft_cap=5.0, sliding_window=13)
    ok, msg = tolerance_ok(_call(c), c.reference())
    assert ok, msg
    c = make_varlen([60, 9], [25, 9], num_heads=8, num_kv_heads=2, head_size=64, block_size=8, causal=False)
    ok, msg = tolerance_ok(_call(c), c.reference())
    assert ok, msg


def test_decode_rows_through_query_start_loc_equal_the_decode_call():
    """One row per sequence given as query_start_loc = 0..n gives the decode call's bits."""
    c = make_case(seq_lens=[1, 33, 16, 64, 127], head_size=64, cache_dtype=torch.float8_e4m3fn)
    plain = hal.paged_attention(c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens,
                                k_scale=c.k_scale, v_scale=c.v_scale)
    qsl = torch.arange(6, dtype=torch.int32)
    multi = hal.paged_attention(c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens,
                                k_scale=c.k_scale, v_scale=c.v_scale, query_start_loc=qsl)
    assert torch.equal(plain, multi)


BAD = {
    "dtype": (lambda c: dict(query_start_loc=c.query_start_loc.long()), r"query_start_loc must be an int32 \[num_seqs \+ 1\]"),
    "length": (lambda c: dict(query_start_loc=c.query_start_loc[:-1]), r"query_start_loc must be \[num_seqs \+ 1\] = \[6\]"),
    "decreasing": (lambda c: dict(query_start_loc=torch.tensor([0, 40, 30, 58, 59, 59], dtype=torch.int32)),
                   r"query_start_loc must be non-decreasing row offsets starting at 0"),
    "not from 0": (lambda c: dict(query_start_loc=c.query_start_loc + 1), r"starting at 0"),
    "last entry": (lambda c: dict(query_start_loc=torch.tensor([0, 40, 57, 58, 58, 58], dtype=torch.int32)),
                   r"query_start_loc must be a last entry equal to the query's row count 59; got 58"),
    "rows above seq_len": (lambda c: dict(seq_lens=torch.tensor([40, 100, 7, 33, 0], dtype=torch.int32),
                                          query_start_loc=torch.tensor([0, 40, 57, 58, 58, 59], dtype=torch.int32)),
                           r"at most seq_lens\[i\] rows for sequence i .*; got 1 rows for sequence 4 of length 0"),
    "max_query_len small": (lambda c: dict(max_query_len=8), r"max_query_len must be >= every sequence's row count \(max is 40\)"),
    "max_query_len bool": (lambda c: dict(max_query_len=True), r"max_query_len must be None .* or an int >= 0; got True"),
    "non-causal window": (lambda c: dict(causal=False, sliding_window=4), r"causal must be True with ALiBi or a sliding window"),
    "causal not bool": (lambda c: dict(causal=1), r"causal must be True or False; got 1 \(int\)"),
    "decode max_query_len": (lambda c: dict(query_start_loc=None, max_query_len=3, query=c.query[:5]),
                             r"max_query_len must be None or 1 without query_start_loc"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_query_start_loc_is_named(mixed, name):
    make, pattern = BAD[name]
    with pytest.raises(hal.ArgumentError, match=pattern):
        _call(mixed, **make(mixed))


def test_native_packs_declare_varlen_and_are_passed_over_only_for_the_device(mixed, monkeypatch):
    """cuda (csrc/prefill.cuh) and rocm (hal_rocm_prefill.hsaco) declare multi-token calls: on a CPU
    machine they are passed over for the device only, never for the feature."""
    for target, pack in (("sm_90", "cuda"), ("gfx942", "rocm")):
        monkeypatch.setenv("HAL_TARGET", target)
        c = mixed if target == "sm_90" else make_varlen([40, 9], [40, 9], head_size=64, block_size=16,
                                                         cache_dtype=torch.float8_e4m3fnuz)
        d = hal.explain(c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens, k_scale=c.k_scale,
                        v_scale=c.v_scale, query_start_loc=c.query_start_loc)
        assert d.pack.NAME == "emu"
        support = hal.registry.by_name(pack).supports(d.target)["paged_attention"]
        assert "varlen" in support.features
        assert not any("varlen" in r for r in support.reasons(d.key)), (pack, support.reasons(d.key))


def test_opcheck_and_compile_with_query_start_loc(mixed):
    c = make_varlen([40, 100, 7, 33, 5], [40, 17, 1, 1, 0], num_heads=8, num_kv_heads=2, head_size=64,
                    block_size=16, cache_dtype=torch.bfloat16, query_dtype=torch.float32)
    args = hal.ops.OPS["paged_attention"].schema_args(
        c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens, k_scale=c.k_scale, v_scale=c.v_scale,
        query_start_loc=c.query_start_loc, max_query_len=40, out=torch.empty_like(c.query))
    torch.library.opcheck(torch.ops.hal.paged_attention.default, args)
    torch._dynamo.reset()

    def step(q, kc, vc, bt, sl, qsl):
        return hal.paged_attention(q, kc, vc, bt, sl, k_scale=c.k_scale, v_scale=c.v_scale, query_start_loc=qsl,
                                   max_query_len=40, max_seq_len=100) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens, c.query_start_loc)
    want = step(c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens, c.query_start_loc)
    assert torch.equal(got, want)


def test_multi_token_and_decode_calls_run_without_triton(tmp_path):
    """A CPU install has no triton (the CPU torch wheel does not bring it): the emu PyTorch paths
    must not import it (a multi-token call once did, and hal-demo failed on a fresh machine)."""
    import subprocess
    import sys
    code = """
import sys
sys.modules["triton"] = None          # import triton raises ImportError
import torch, hal
kc = torch.randn(4, 2, 8, 64).to(torch.bfloat16); vc = torch.randn(4, 2, 8, 64).to(torch.bfloat16)
bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32); lens = torch.tensor([10, 16], dtype=torch.int32)
q = torch.randn(5, 4, 64).to(torch.bfloat16)
out = hal.paged_attention(q, kc, vc, bt, lens, query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32))
dec = hal.paged_attention(q[:2], kc, vc, bt, lens)
assert torch.isfinite(out).all() and torch.isfinite(dec).all()
print("ok")
"""
    import os
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
