"""hal.mla_decode / hal.cache_mla as declared ops: public calls against the tests' float64 MLA
reference, validation that names the argument, dispatch's reasons for packs without MLA, opcheck
and torch.compile. The arithmetic grid is tests/test_emu_mla.py."""

from __future__ import annotations

import pytest
import torch

import hal
from hal import ArgumentError, fp8
from cases import tolerance_ok
from test_emu_mla import make_mla, ref
from test_ops import _utils

pytestmark = pytest.mark.emu


def _kw(case, multi=False):
    kw = {k: case[k] for k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "scale",
                               "ckv_scale", "kpe_scale")}
    if multi:
        kw["query_start_loc"] = case["query_start_loc"]
    return kw


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("combined", [False, True])
def test_public_call_matches_float64(multi, combined):
    dt = torch.float8_e4m3fn
    case = make_mla([20, 70, 3], [3, 1, 2] if multi else None, ckv_dtype=dt, kpe_dtype=dt if combined else torch.bfloat16,
                    combined=combined, seed=11)
    out = hal.mla_decode(**_kw(case, multi))
    ok, msg = tolerance_ok(out, ref(case, multi=multi))
    assert ok, msg
    assert hal.explain(op="mla_decode", **_kw(case, multi)).pack.NAME == "emu"


def test_cache_mla_then_decode_round_trip():
    """Tokens written by hal.cache_mla into views of one combined FP8 cache, then read by mla_decode."""
    g = torch.Generator().manual_seed(12)
    r, p, bs, n_tok = 64, 16, 8, 21
    kv = torch.zeros(4, bs, r + p, dtype=torch.float8_e4m3fn)
    ckv, kpe = kv[..., :r], kv[..., r:]
    kv_c, k_pe = torch.randn(n_tok, r, generator=g), torch.randn(n_tok, p, generator=g)
    slots = torch.arange(n_tok) + 3                                   # blocks 0..2, from offset 3
    hal.cache_mla(kv_c, k_pe, ckv, kpe, slots, ckv_scale=0.01, kpe_scale=0.02)
    assert torch.equal(ckv.view(torch.uint8)[0, 3], fp8.encode_bytes(kv_c[0] / 0.01, torch.float8_e4m3fn))
    qn, qp = torch.randn(1, 4, r, generator=g), torch.randn(1, 4, p, generator=g)
    out = hal.mla_decode(qn, qp, ckv, kpe, torch.tensor([[0, 1, 2]], dtype=torch.int32),
                         torch.tensor([n_tok + 3], dtype=torch.int32), scale=0.1, ckv_scale=0.01, kpe_scale=0.02)
    assert torch.isfinite(out).all() and out.shape == (1, 4, r)


def _bad(case, **change):
    kw = _kw(case)
    kw.update(change)
    with pytest.raises(ArgumentError) as e:
        hal.mla_decode(**kw)
    return str(e.value)


@pytest.fixture
def case():
    return make_mla([20, 33], r=64, p=16, heads=4, seed=13)


def test_bad_inputs_name_the_argument(case):
    assert "q_pe" in _bad(case, q_pe=case["q_pe"][..., :8])
    assert "q_nope" in _bad(case, q_nope=case["q_nope"][..., :32])
    assert "kpe_cache" in _bad(case, kpe_cache=case["kpe_cache"][:-1])
    assert "block_tables" in _bad(case, block_tables=case["block_tables"].long())
    assert "seq_lens" in _bad(case, seq_lens=case["seq_lens"][:1])
    assert "scale" in _bad(case, scale=-1.0)
    assert "ckv_scale" in _bad(case, ckv_scale=torch.tensor([1.0, 2.0]))
    assert "query_start_loc" in _bad(case, query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32))
    assert "seq_lens" in _bad(case, seq_lens=torch.tensor([20, 999], dtype=torch.int32))
    assert "ckv_cache" in _bad(case, ckv_cache=case["ckv_cache"].view(torch.uint8))


def test_scale_is_required(case):
    kw = _kw(case)
    del kw["scale"]
    with pytest.raises(TypeError, match="scale"):
        hal.mla_decode(**kw)


def test_missing_fp8_scale_warns(case):
    kw = _kw(case)
    kw["ckv_scale"] = None
    from hal import validate
    validate._warned_unscaled.discard("mla_decode")
    with pytest.warns(hal.MissingScaleWarning, match="ckv_scale"):
        hal.mla_decode(**kw)


def test_rocm_declares_mla_and_cpu_tensors_go_to_emu(case, monkeypatch):
    """On an AMD target the rocm pack declares MLA (tests/test_rocm_mla.py proves it): CPU tensors go to
    emu, and rocm's reasons are the call's facts (device, encoding), not a missing op."""
    monkeypatch.setenv("HAL_TARGET", "gfx942")
    d = hal.explain(op="mla_decode", **_kw(case))
    assert d.pack.NAME == "emu"
    why = hal.registry.by_name("rocm").reasons(d.key, d.target)
    assert why[0] == "tensors are on cpu; this pack runs on cuda" and not any("not implemented" in r for r in why)


def test_cuda_mla_declaration_names_what_it_does_not_serve(monkeypatch):
    """The cuda pack serves R = 512 / P = 64 with a 16-bit rotary part in the query's dtype; every
    other call gets a reason that names the fact."""
    monkeypatch.setenv("HAL_TARGET", "sm_90")
    from hal.pack import CallKey
    from hal.targets import target
    cuda = hal.registry.by_name("cuda")
    bf, e4 = torch.bfloat16, torch.float8_e4m3fn

    def reasons(**kw):
        base = dict(op="mla_decode", device_type="cuda", query_dtype=bf, cache_dtype=e4, head_size=512, block_size=64,
                    gqa_ratio=128, features=frozenset(), rope_dim=64, rope_dtype=bf)
        return cuda.reasons(CallKey(**{**base, **kw}), target())

    assert reasons() == [] and reasons(block_size=1, features=frozenset({"varlen", "strided_cache"})) == []
    assert reasons(head_size=256) == ["head_size 256 is not supported (supported: 512)"]
    assert reasons(rope_dim=128) == ["rope_dim 128 is not supported (supported: 64)"]
    assert reasons(rope_dtype=torch.float16) == ["the rotary cache (kpe_cache) must have the query's dtype bfloat16 "
                                                 "(got float16)"]
    assert any("fp8_rope" in r for r in reasons(rope_dtype=e4, features=frozenset({"fp8_rope"})))
    assert reasons(cache_dtype=torch.float16) == ["a float16 cache needs a query of the same dtype (got bfloat16)"]
    assert any("e4m3fnuz" in r for r in reasons(cache_dtype=torch.float8_e4m3fnuz))


def test_opcheck_and_compile(case):
    args = hal.ops.OPS["mla_decode"].schema_args(**_kw(case))
    torch.library.opcheck(torch.ops.hal.mla_decode.default, args, test_utils=_utils(case["ckv_cache"].dtype))
    bf16 = make_mla([20, 33], r=64, p=16, heads=4, ckv_dtype=torch.bfloat16, seed=13)   # test_schema in full
    torch.library.opcheck(torch.ops.hal.mla_decode.default, hal.ops.OPS["mla_decode"].schema_args(**_kw(bf16)))
    torch._dynamo.reset()
    kw = _kw(case)

    def step(qn, qp):
        return hal.mla_decode(qn, qp, kw["ckv_cache"], kw["kpe_cache"], kw["block_tables"], kw["seq_lens"],
                              scale=kw["scale"], ckv_scale=kw["ckv_scale"], max_seq_len=33)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(kw["q_nope"], kw["q_pe"]), step(kw["q_nope"], kw["q_pe"]))


def test_misaligned_latent_rows_are_a_dispatch_reason_not_an_error(monkeypatch):
    """Latent rows off 16 bytes (a view at an 8-byte offset into a wider allocation): the native packs'
    vector loads cannot read them, so dispatch passes over cuda with the feature named and emu serves the
    call (correctly), instead of the cuda launcher raising."""
    from test_emu_mla import make_mla

    import reference
    from cases import tolerance_ok
    case = make_mla([20, 7], heads=16, ckv_dtype=torch.bfloat16, seed=4)
    nb, bs, r = case["ckv_cache"].shape
    wide = torch.empty(nb, bs, 4 + r + 64 + 4, dtype=torch.bfloat16)
    wide[..., 4:4 + r] = case["ckv_cache"]
    wide[..., 4 + r:4 + r + 64] = case["kpe_cache"]
    ckv, kpe = wide[..., 4:4 + r], wide[..., 4 + r:4 + r + 64]
    args = {**{k: case[k] for k in ("q_nope", "q_pe", "block_tables", "seq_lens", "scale", "ckv_scale",
                                    "kpe_scale")}, "ckv_cache": ckv, "kpe_cache": kpe}
    monkeypatch.setenv("HAL_TARGET", "sm_90")
    d = hal.explain(op="mla_decode", **args)
    assert "misaligned_cache" in d.key.features
    reasons = hal.registry.by_name("cuda").supports(d.target)["mla_decode"].reasons(d.key)
    assert any("misaligned_cache" in x for x in reasons), reasons
    out = hal.mla_decode(**args, pack="emu")
    ref = reference.mla_decode(case["q_nope"], case["q_pe"], ckv, kpe, case["block_tables"], case["seq_lens"], None,
                               scale=case["scale"], ckv_scale=case["ckv_scale"], kpe_scale=case["kpe_scale"])
    ok, msg = tolerance_ok(out, ref)
    assert ok, msg
