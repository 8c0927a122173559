"""The registered torch ops: torch.library.opcheck and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

import hal
from cases import make_case, tolerance_ok

pytestmark = pytest.mark.emu


def _args(case, scale_tensors: bool):
    """The schema's arguments, as the public function builds them (the declaration's translation)."""
    as_t = (lambda x: torch.tensor(x)) if scale_tensors else (lambda x: x)  # noqa: E731
    return hal.ops.OPS["paged_attention"].schema_args(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        k_scale=as_t(case.k_scale), v_scale=as_t(case.v_scale), logits_soft_cap=30.0, sliding_window=40,
        out=torch.empty_like(case.query))


def _utils(cache_dtype):
    # torch's SchemaCheckMode (opcheck's test_schema) compares inputs before/after with allclose,
    # which torch does not implement for float8 tensors on the CPU; FP8 caches run the other checks
    # and the same schema is checked in full with bf16 caches.
    all_utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return all_utils[1:] if hal.fp8.is_fp8(cache_dtype) else all_utils


@pytest.mark.parametrize("scale_tensors", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_opcheck_paged_attention(scale_tensors, cache_dtype):
    case = make_case(seq_lens=[17, 3, 0], cache_dtype=cache_dtype, query_dtype=torch.float32)
    torch.library.opcheck(torch.ops.hal.paged_attention.default, _args(case, scale_tensors),
                          test_utils=_utils(cache_dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(hal.ops.OPS))
def test_opcheck_every_declared_op_on_its_example(name, cache_dtype):
    """Each declared op's example call (the probe's smoke call) passes torch's opcheck."""
    decl = hal.ops.OPS[name]
    kwargs = decl.example("cpu", cache_dtype)
    if name == "paged_attention":
        kwargs["query"] = kwargs["query"].float()  # opcheck compares with allclose; fp32 keeps it exact
        kwargs["out"] = kwargs["out"].float()
    torch.library.opcheck(getattr(torch.ops.hal, name).default, decl.schema_args(**kwargs),
                          test_utils=_utils(cache_dtype))


@pytest.mark.parametrize("name", list(hal.ops.OPS))
def test_declaration_is_complete(name):
    """Registration, the public function, explain and the probe read these fields."""
    decl = hal.ops.OPS[name]
    assert hasattr(torch.ops.hal, name) and decl.schema.endswith("-> ()") and "str? pack)" in decl.schema
    assert decl.features and decl.example is not None
    assert all(isinstance(t, str) and t for t in decl.features.values())


@pytest.mark.parametrize("cache_dtype", [torch.float8_e5m2, torch.float16], ids=str)
def test_opcheck_cache_kv(cache_dtype):
    kc = torch.zeros(4, 2, 8, 64, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([3, 9, -1, 20, 31])
    torch.library.opcheck(torch.ops.hal.cache_kv.default, (k, v, kc, vc, slots, 0.5, None, None,
                                                           torch.tensor([1.0, 2.0]), None),
                          test_utils=_utils(cache_dtype))


def test_torch_compile_fullgraph_traces_both_ops():
    torch._dynamo.reset()
    case = make_case(seq_lens=[20, 9], cache_dtype=torch.float8_e4m3fn, query_dtype=torch.float32,
                     per_head_scales=True)
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    new_k = torch.randn(2, kc.shape[1], kc.shape[3])
    new_v = torch.randn_like(new_k)
    slots = torch.tensor([int(case.block_tables[0, 1]) * kc.shape[2] + 4, -1])  # overwrite token 20 of seq 0

    def step(q, k, v, kc, vc, slots, tables, lens, ks, vs):
        hal.cache_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        return hal.paged_attention(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs, logits_soft_cap=20.0) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    lens = case.seq_lens.clone()
    lens[0] = 21
    args = (case.query, new_k, new_v, kc, vc, slots, case.block_tables, lens, case.k_scale, case.v_scale)
    got = compiled(*args)
    kc2, vc2 = case.key_cache.clone(), case.value_cache.clone()
    want = step(case.query, new_k, new_v, kc2, vc2, slots, case.block_tables, lens, case.k_scale, case.v_scale)
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731 (NaN bytes compare)
    assert same(kc, kc2) and same(vc, vc2), "the compiled cache_kv wrote different bytes"
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    case.key_cache, case.value_cache, case.seq_lens = kc2, vc2, lens
    ok, msg = tolerance_ok(want / 2, _ref(case))
    assert ok, msg


def _ref(case):
    import reference
    return reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                     k_scale=case.k_scale, v_scale=case.v_scale, logits_soft_cap=20.0)
