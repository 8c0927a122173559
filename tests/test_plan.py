"""hal.plan: plan once per step, run per layer.

On the CPU (emu): ``plan.run`` gives the one-shot call's bits for decode, multi-token (varlen) and
MLA calls, FP8 and 16-bit caches, float, 0-d and per-head scales, over several layers with their own
caches and scales through one plan; cache writes through a plan store the one-shot bytes; per-layer
tensors laid out unlike the planned ones are errors naming the argument; a plan refuses bad
geometry with the one-shot call's own errors; HAL_DEBUG makes every run validate in full. The cuda
pack's prepared launches are checked without a GPU (a stand-in for its compiled module records the
arguments): a plan's launch for a layer equals the one-shot launch for that layer. HalRunner's
generation runs planned steps, and its CUDA-graph decode path (with a stand-in graph that replays
by re-running the captured step over the same buffers) generates the eager tokens.

On an NVIDIA GPU (marker ``cuda``): run equals the one-shot call on the cuda pack; CUDA-graph
capture of ``plan.run`` over several layers replays the eager bits; HalRunner's graph-captured
decode generates the eager tokens. Host time is measured by tools/host_time (never asserted here).
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import types

import pytest
import torch

import hal
from cases import make_case, make_varlen
from test_emu_mla import _fill as _mla_fill
from test_emu_mla import make_mla
from test_validation import BAD, call as one_shot_call

pytestmark = pytest.mark.emu


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (NaN included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(raw), b.contiguous().view(raw))


def _scale_form(s, form: str):
    if s is None or form == "float":
        return s
    if form == "tensor0":
        return torch.tensor(float(s) if not isinstance(s, torch.Tensor) else float(s.mean()))
    return s  # per_head: made by make_case


def _layers(case, n: int, scale_form: str, seed: int = 100):
    """``n`` layers over one geometry: layer 0 is the case's caches, the others caches drawn afresh
    (no poison: every slot random) with their own scales."""
    out = []
    for i in range(n):
        if i == 0:
            kc, vc = case.key_cache, case.value_cache
        else:
            other = make_case(seq_lens=[1], num_heads=case.query.shape[1], num_kv_heads=case.key_cache.shape[1],
                              head_size=case.key_cache.shape[3], block_size=case.key_cache.shape[2],
                              cache_dtype=case.key_cache.dtype, seed=seed + i, garbage=False,
                              extra_blocks=case.key_cache.shape[0] - 2)
            kc, vc = other.key_cache, other.value_cache
            assert kc.shape == case.key_cache.shape
        ks, vs = case.k_scale, case.v_scale
        if ks is not None:
            f = 1.0 + 0.25 * i
            ks = ks * f if isinstance(ks, torch.Tensor) else ks * f
            vs = vs / f if isinstance(vs, torch.Tensor) else vs / f
        g = torch.Generator().manual_seed(seed + 50 + i)
        q = torch.randn(case.query.shape, generator=g).to(case.query.dtype)
        out.append((q, kc, vc, _scale_form(ks, scale_form), _scale_form(vs, scale_form)))
    return out


# -------------------------------------------------------------------- decode and multi-token on emu

DECODE = [
    ("e4m3fn-float", dict(cache_dtype=torch.float8_e4m3fn), "float"),
    ("e4m3fn-tensor0", dict(cache_dtype=torch.float8_e4m3fn), "tensor0"),
    ("e5m2-per-head", dict(cache_dtype=torch.float8_e5m2, per_head_scales=True), "per_head"),
    ("bf16", dict(cache_dtype=torch.bfloat16, query_dtype=torch.bfloat16), "float"),
    ("fp16-window-softcap", dict(cache_dtype=torch.float16, query_dtype=torch.float16, sliding_window=20,
                                 logits_soft_cap=30.0), "float"),
]


@pytest.mark.parametrize("name,kw,scale_form", DECODE, ids=[d[0] for d in DECODE])
def test_decode_run_equals_the_one_shot_call_layer_by_layer(name, kw, scale_form):
    kw = dict(kw)
    extra = {k: kw.pop(k) for k in ("sliding_window", "logits_soft_cap") if k in kw}
    case = make_case(seq_lens=[37, 5, 0, 60], num_heads=8, num_kv_heads=2, **kw)
    layers = _layers(case, 3, scale_form)
    q0, kc0, vc0, ks0, vs0 = layers[0]
    p = hal.plan("paged_attention", q0, kc0, vc0, case.block_tables, case.seq_lens, k_scale=ks0, v_scale=vs0,
                 max_seq_len=60, **extra)
    assert p.pack == "emu" and p.per_layer == ("query", "key_cache", "value_cache", "k_scale", "v_scale", "out", "lse")
    for q, kc, vc, ks, vs in layers:
        want = hal.paged_attention(q, kc, vc, case.block_tables, case.seq_lens, k_scale=ks, v_scale=vs,
                                   max_seq_len=60, **extra)
        out = torch.full_like(q, float("nan"))
        got = p.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out)
        assert got is out and same_bits(got, want)
        assert same_bits(p.run(q, kc, vc, k_scale=ks, v_scale=vs), want)  # out allocated by run
    outs = [p.run(*layer[:3], k_scale=layer[3], v_scale=layer[4]) for layer in layers]
    assert not same_bits(outs[0], outs[1])   # the layers' own caches and scales were used


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
@pytest.mark.parametrize("geometry", ["mixed", "chunked"])
def test_multi_token_run_equals_the_one_shot_call(cache_dtype, geometry):
    lens, qlens = {"mixed": ([300, 1, 77, 50, 0, 20], [120, 1, 0, 1, 0, 3]),
                   "chunked": ([40, 100, 64], [17, 9, 64])}[geometry]
    vc_ = make_varlen(lens, qlens, cache_dtype=cache_dtype, num_heads=8, num_kv_heads=2, head_size=64)
    g = torch.Generator().manual_seed(3)
    layers = [(vc_.query, vc_.key_cache, vc_.value_cache, vc_.k_scale, vc_.v_scale)]
    for i in (1, 2):
        other = make_varlen(lens, qlens, cache_dtype=cache_dtype, num_heads=8, num_kv_heads=2, head_size=64,
                            seed=i, garbage=False)
        ks = None if vc_.k_scale is None else vc_.k_scale * (1 + i / 4)
        layers.append((torch.randn(vc_.query.shape, generator=g).to(vc_.query.dtype), other.key_cache,
                       other.value_cache, ks, ks))
    geo = dict(query_start_loc=vc_.query_start_loc, max_query_len=max(qlens), max_seq_len=max(lens))
    q0, kc0, vc0, ks0, vs0 = layers[0]
    p = hal.plan("paged_attention", q0, kc0, vc0, vc_.block_tables, vc_.seq_lens, k_scale=ks0, v_scale=vs0, **geo)
    for q, kc, vc, ks, vs in layers:
        want = hal.paged_attention(q, kc, vc, vc_.block_tables, vc_.seq_lens, k_scale=ks, v_scale=vs, **geo)
        assert same_bits(p.run(q, kc, vc, k_scale=ks, v_scale=vs), want)


@pytest.mark.parametrize("ckv_dtype,combined", [(torch.float8_e4m3fn, False), (torch.float8_e5m2, True),
                                                (torch.bfloat16, False)], ids=["e4m3fn", "e5m2-combined", "bf16"])
@pytest.mark.parametrize("multi", [False, True])
def test_mla_run_equals_the_one_shot_call(ckv_dtype, combined, multi):
    case = make_mla([20, 70, 3], [3, 1, 2] if multi else None, r=64, p=16, heads=4, ckv_dtype=ckv_dtype,
                    kpe_dtype=ckv_dtype if combined else torch.bfloat16, combined=combined, seed=5)
    geo = dict(block_tables=case["block_tables"], seq_lens=case["seq_lens"], scale=case["scale"], max_seq_len=70)
    if multi:
        geo.update(query_start_loc=case["query_start_loc"], max_query_len=3)
    gen = torch.Generator().manual_seed(9)
    layers = [(case["q_nope"], case["q_pe"], case["ckv_cache"], case["kpe_cache"], case["ckv_scale"],
               case["kpe_scale"])]
    for i in (1, 2):
        ckv = _mla_fill(case["ckv_cache"].shape, ckv_dtype, case["ckv_scale"] or 1.0, gen)
        kpe = _mla_fill(case["kpe_cache"].shape, case["kpe_cache"].dtype, case["kpe_scale"] or 1.0, gen)
        if combined:
            kv = torch.cat([ckv, kpe], dim=-1)
            ckv, kpe = kv[..., :64], kv[..., 64:]
        cs = None if case["ckv_scale"] is None else case["ckv_scale"] * (1 + i)
        ps = None if case["kpe_scale"] is None else torch.tensor(case["kpe_scale"] / (1 + i))
        if ps is not None and i == 2:
            ps = float(ps)
        layers.append((torch.randn(case["q_nope"].shape, generator=gen).to(torch.bfloat16),
                       torch.randn(case["q_pe"].shape, generator=gen).to(torch.bfloat16), ckv, kpe, cs,
                       case["kpe_scale"] if ps is None else float(ps)))
    qn, qp, ckv, kpe, cs, ps = layers[0]
    p = hal.plan("mla_decode", qn, qp, ckv, kpe, ckv_scale=cs, kpe_scale=ps, **geo)
    for qn, qp, ckv, kpe, cs, ps in layers:
        want = hal.mla_decode(qn, qp, ckv, kpe, ckv_scale=cs, kpe_scale=ps, **geo)
        got = p.run(qn, qp, ckv, kpe, ckv_scale=cs, kpe_scale=ps)
        assert same_bits(got, want)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float16], ids=str)
def test_cache_writes_through_a_plan_store_the_one_shot_bytes(cache_dtype):
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([3, 9, -1, 20, 31])
    raw = torch.uint8 if hal.fp8.is_fp8(cache_dtype) else torch.int16
    p = None
    for layer in range(3):
        k, v = torch.randn(5, 2, 64, generator=g), torch.randn(5, 2, 64, generator=g)
        ks = torch.tensor([0.01, 0.02]) * (layer + 1)
        a, b = torch.zeros(4, 2, 8, 64, dtype=cache_dtype), torch.zeros(4, 2, 8, 64, dtype=cache_dtype)
        hal.cache_kv(k, v, a, b, slots, k_scale=ks, v_scale=0.015)
        c, d = torch.zeros_like(a), torch.zeros_like(b)
        if p is None:
            p = hal.plan("cache_kv", k, v, c, d, slots, k_scale=ks, v_scale=0.015)
        assert p.run(k, v, c, d, k_scale=ks, v_scale=0.015) is None
        assert torch.equal(a.view(raw), c.view(raw)) and torch.equal(b.view(raw), d.view(raw))
    # MLA writes: views into one combined cache
    kv = torch.zeros(4, 8, 80, dtype=cache_dtype)
    kv2 = torch.zeros_like(kv)
    kv_c, k_pe = torch.randn(5, 64, generator=g), torch.randn(5, 16, generator=g)
    hal.cache_mla(kv_c, k_pe, kv[..., :64], kv[..., 64:], slots, ckv_scale=0.01, kpe_scale=0.02)
    q = hal.plan("cache_mla", kv_c, k_pe, kv2[..., :64], kv2[..., 64:], slots, ckv_scale=0.01, kpe_scale=0.02)
    q.run(kv_c, k_pe, kv2[..., :64], kv2[..., 64:], ckv_scale=0.01, kpe_scale=0.02)
    assert torch.equal(kv.view(raw), kv2.view(raw))


# -------------------------------------------------------------------- what run refuses

@pytest.fixture
def planned():
    case = make_case(seq_lens=[10, 33], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    p = hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                 k_scale=case.k_scale, v_scale=case.v_scale)
    return case, p


def _refused(p, case, pattern, **over):
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache, k_scale=case.k_scale,
                v_scale=case.v_scale)
    args.update(over)
    with pytest.raises((hal.ArgumentError, TypeError), match=pattern):
        p.run(**args)


def test_per_layer_tensors_laid_out_unlike_the_plan_are_errors_naming_them(planned):
    case, p = planned
    kc, q = case.key_cache, case.query
    _refused(p, case, r"key_cache must be laid out like the planned one \(float8_e4m3fn \[\d+, 2, 16, 64\].*got "
             r"float8_e5m2", key_cache=kc.view(torch.float8_e5m2))
    _refused(p, case, r"value_cache must be laid out like the planned one", value_cache=case.value_cache[:-1])
    nhd = kc.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)            # the same shape, NHD strides
    _refused(p, case, r"key_cache must be laid out like the planned one .* got .*strides", key_cache=nhd)
    _refused(p, case, r"query must be laid out like the planned one", query=q[:1])
    _refused(p, case, r"query must be laid out like the planned one", query=q.float())
    _refused(p, case, r"query must be laid out like the planned one .*on meta", query=q.to("meta"))
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)     # same strides, 2 bytes off
    _refused(p, case, r"query must be .*16-byte aligned\).*not 16-byte aligned", query=shifted)
    _refused(p, case, r"query must be laid out like the planned one .*got \[1, 2\] \(list\)", query=[1, 2])
    _refused(p, case, r"out must be laid out like the planned one", out=torch.empty(2, 8, 64))
    _refused(p, case, r"unexpected keyword argument .block_tables.", block_tables=case.block_tables)
    with pytest.raises(TypeError, match=r"run\(\) takes 4 positional arguments but 8 were given"):
        p.run(*range(7))


def test_scales_must_keep_their_planned_kind(planned):
    case, p = planned
    _refused(p, case, r"k_scale must be given to plan.run \(the plan was made with a float k_scale", k_scale=None)
    _refused(p, case, r"k_scale must be a float in plan.run .*a tensor scale needs a plan made with a tensor",
             k_scale=torch.tensor(0.1))
    _refused(p, case, r"v_scale must be finite and > 0; got 0.0", v_scale=0.0)
    _refused(p, case, r"v_scale must be finite and > 0 as a float32", v_scale=1e39)
    t = hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables,
                 case.seq_lens, k_scale=torch.tensor([0.1, 0.2]), v_scale=torch.tensor(0.1))
    _refused(t, case, r"k_scale must be a \[n\] tensor like the planned one .*a float scale needs a plan made "
             r"with a float", k_scale=0.1, v_scale=torch.tensor(0.3))
    _refused(t, case, r"k_scale must be laid out like the planned one \(float32 \[2\]", k_scale=torch.tensor(0.1),
             v_scale=torch.tensor(0.3))
    _refused(t, case, r"v_scale must be laid out like the planned one \(float32 \[\]", k_scale=torch.ones(2),
             v_scale=torch.ones(1))
    t.run(case.query, case.key_cache, case.value_cache, k_scale=torch.ones(2), v_scale=torch.tensor(0.3))


def test_scale_tensors_may_be_slices_of_one_per_layer_tensor():
    """A scale's address matters to no pack: layer i's scales as rows of one [layers, heads] tensor."""
    case = make_case(seq_lens=[10, 33], per_head_scales=True)
    ks = torch.stack([case.k_scale * (1 + i) for i in range(3)])
    p = hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                 k_scale=ks[0], v_scale=case.v_scale)
    for i in range(3):
        want = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                   k_scale=ks[i], v_scale=case.v_scale)
        assert same_bits(p.run(case.query, case.key_cache, case.value_cache, k_scale=ks[i], v_scale=case.v_scale),
                         want)


def test_a_plan_without_scales_runs_without_them_and_warned_once():
    case = make_case(seq_lens=[12], cache_dtype=torch.float8_e4m3fn)
    with pytest.warns(hal.MissingScaleWarning):
        p = hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables,
                     case.seq_lens)
    want = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               k_scale=1.0, v_scale=1.0)
    assert same_bits(p.run(case.query, case.key_cache, case.value_cache), want)


def test_run_refuses_tensors_that_require_grad(planned):
    case, p = planned
    with pytest.raises(hal.ArgumentError, match="query requires grad; hal's ops are inference-only"):
        p.run(case.query.float().requires_grad_().to(case.query.dtype), case.key_cache, case.value_cache,
              k_scale=case.k_scale, v_scale=case.v_scale)


def test_debug_runs_validate_in_full(monkeypatch):
    """Without HAL_DEBUG a per-layer scale tensor's values are not read (as the one-shot call on a
    GPU); with it, every run validates as the one-shot call does."""
    case = make_case(seq_lens=[10, 33])
    bad = torch.tensor(-1.0)
    p = hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                 k_scale=torch.tensor(0.1), v_scale=case.v_scale)
    p.run(case.query, case.key_cache, case.value_cache, k_scale=bad, v_scale=case.v_scale)  # not looked at
    monkeypatch.setenv("HAL_DEBUG", "1")
    p = hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                 k_scale=torch.tensor(0.1), v_scale=case.v_scale)
    with pytest.raises(hal.ArgumentError, match=r"k_scale must be finite and > 0; got -1.0"):
        p.run(case.query, case.key_cache, case.value_cache, k_scale=bad, v_scale=case.v_scale)


def test_views_with_a_strided_last_dim_cannot_be_planned():
    """The one-shot call copies such a query (and copies out back); a plan, which never copies, says so."""
    case = make_case(seq_lens=[10, 33])
    wide = torch.zeros(2, 8, 128, dtype=case.query.dtype)[..., ::2]
    wide.copy_(case.query)
    hal.paged_attention(wide, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                        k_scale=case.k_scale, v_scale=case.v_scale)
    with pytest.raises(hal.ArgumentError, match=r"query must be laid out with a unit stride in its last dim"):
        hal.plan("paged_attention", wide, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                 k_scale=case.k_scale, v_scale=case.v_scale)


# -------------------------------------------------------------------- bad geometry: the one-shot errors

@pytest.mark.parametrize("name", BAD)
def test_a_plan_refuses_bad_calls_with_the_one_shot_error(name):
    case = make_case(seq_lens=[10, 33], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    over = BAD[name][0](case)
    with pytest.raises(Exception) as one:
        one_shot_call(case, **over)
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale)
    args.update(over)
    with pytest.raises(Exception) as planned:
        hal.plan("paged_attention", **args)
    assert type(planned.value) is type(one.value) and str(planned.value) == str(one.value)


VARLEN_BAD = {
    "decreasing": dict(query_start_loc=torch.tensor([0, 5, 3], dtype=torch.int32)),
    "last entry": dict(query_start_loc=torch.tensor([0, 2, 7], dtype=torch.int32)),
    "rows past the length": dict(seq_lens=torch.tensor([1, 30], dtype=torch.int32)),
    "max_query_len small": dict(max_query_len=2),
    "non-causal window": dict(causal=False, sliding_window=4),
    "max_query_len without rows": dict(query_start_loc=None, max_query_len=3),
}


@pytest.mark.parametrize("name", VARLEN_BAD)
def test_a_plan_refuses_bad_multi_token_geometry_with_the_one_shot_error(name):
    c = make_varlen([20, 30], [3, 5], cache_dtype=torch.float8_e4m3fn, num_heads=8, num_kv_heads=2, head_size=64)
    args = dict(query=c.query, key_cache=c.key_cache, value_cache=c.value_cache, block_tables=c.block_tables,
                seq_lens=c.seq_lens, k_scale=c.k_scale, v_scale=c.v_scale, query_start_loc=c.query_start_loc)
    args.update(VARLEN_BAD[name])
    if args["query_start_loc"] is None:
        args["query"] = args["query"][:2]
    q = args.pop("query")
    with pytest.raises(hal.ArgumentError) as one:
        hal.paged_attention(q, **args)
    with pytest.raises(hal.ArgumentError) as planned:
        hal.plan("paged_attention", q, **args)
    assert str(planned.value) == str(one.value)


def test_a_plan_refuses_bad_mla_and_cache_write_calls_with_the_one_shot_error():
    case = make_mla([20, 33], r=64, p=16, heads=4, seed=13)
    kw = {k: case[k] for k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "scale",
                               "ckv_scale", "kpe_scale")}
    for over in (dict(q_pe=case["q_pe"][..., :8]), dict(seq_lens=torch.tensor([20, 999], dtype=torch.int32)),
                 dict(ckv_scale=torch.tensor([1.0, 2.0])), dict(block_tables=case["block_tables"].long())):
        with pytest.raises(hal.ArgumentError) as one:
            hal.mla_decode(**{**kw, **over})
        with pytest.raises(hal.ArgumentError) as planned:
            hal.plan("mla_decode", **{**kw, **over})
        assert str(planned.value) == str(one.value)
    k = torch.randn(5, 2, 64)
    kc = torch.zeros(4, 2, 8, 64, dtype=torch.float16)
    for slots in (torch.tensor([3, 9, -1, 20, 31], dtype=torch.int32), torch.tensor([3, 9, -1, 20, 99])):
        with pytest.raises(hal.ArgumentError) as one:
            hal.cache_kv(k, k, kc, kc.clone(), slots)
        with pytest.raises(hal.ArgumentError) as planned:
            hal.plan("cache_kv", k, k, kc, kc.clone(), slots)
        assert str(planned.value) == str(one.value)


def test_a_forced_pack_that_cannot_serve_is_the_one_shot_error():
    case = make_case(seq_lens=[10])
    kw = dict(k_scale=case.k_scale, v_scale=case.v_scale, pack="cuda")
    with pytest.raises(hal.NotSupportedError) as one:
        hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, **kw)
    with pytest.raises(hal.NotSupportedError) as planned:
        hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                 **kw)
    assert str(planned.value) == str(one.value)
    with pytest.raises(ValueError, match="hal.plan: op must be one of paged_attention"):
        hal.plan("attention", case.query)


def test_plan_is_the_declaration_s():
    """run's arguments are each op's declared per-layer keywords, each a field of its call record."""
    for name, decl in hal.ops.OPS.items():
        assert decl.per_layer and set(decl.scale_args) <= set(decl.per_layer)
        example = decl.example("cpu", torch.float8_e4m3fn)
        record = hal.ops.prepare(name, **example)
        assert all(hasattr(record, f) for f in decl.per_layer), name
        p = hal.plan(name, **example)
        p.run(**{k: example.get(k) for k in decl.per_layer if k in example})


# -------------------------------------------------------------------- the cuda pack's prepared launches (no GPU)

# Where a prepared launch's run puts a layer's tensors and scales in the launcher's argument list
# (bindings.cpp's take(): tensors in launch.PER_LAYER's order; a scale's (pointer, value) slots), for
# the stand-in below, which builds the argument list the one-shot launcher would have been given.
_TAKE = {"paged_attention": ((2, 3, 4, 5), ((9, 22), (10, 23))),
         "prefill": ((2, 3, 4, 5), ((10, 20), (11, 21))),
         "cache_kv": ((2, 3, 4, 5), ((7, 15), (8, 16))),
         "mla_decode": ((2, 3, 4, 5, 6), ((10, 30), (11, 31)))}


def _launch_under_test(monkeypatch):
    """packs/cuda/launch.py loaded against a stand-in for its compiled module that records every
    launch (the GPU facts and the stream faked), without touching the real module's import. A
    prepared launch's run records the argument list its launch would get, as bindings.cpp fills it."""
    import hal.kernelpacks.cuda as pkg
    seen = []
    fake = types.ModuleType("hal.kernelpacks.cuda._C")

    class Prepared:
        def __init__(self, steps):
            self.steps = steps

        def extend(self, other):
            self.steps += other.steps

        def run(self, *layer):
            *tensors, sp0, sp1, s0, s1, stream = layer
            for name, args in self.steps:
                slots, scales = _TAKE[name]
                a = list(args)
                for i, t in zip(slots, tensors):
                    a[i] = t
                for (ip, iv), ptr, value in zip(scales, (sp0, sp1), (s0, s1)):
                    if a[ip]:
                        a[ip] = ptr
                    else:
                        a[iv] = value
                seen.append((name, (*a, stream)))

    for fn in ("paged_attention", "prefill", "cache_kv", "mla_decode", "cache_rows"):
        setattr(fake, fn, lambda *a, _fn=fn: seen.append((_fn, a)))
        setattr(fake, f"{fn}_prepare", lambda *a, _fn=fn: Prepared([(_fn, a)]))
    monkeypatch.setattr(pkg, "_C", fake, raising=False)
    path = pathlib.Path(importlib.util.find_spec("hal.kernelpacks.cuda.launch").origin)  # editable installs too
    spec = importlib.util.spec_from_file_location("hal.kernelpacks.cuda._launch_under_test", path)
    launch = importlib.util.module_from_spec(spec)
    launch.__package__ = "hal.kernelpacks.cuda"
    spec.loader.exec_module(launch)
    monkeypatch.setattr(launch, "_device_facts", lambda index: (132, "sm_90"))
    monkeypatch.setattr(launch, "_resident", lambda index, kind, head_size, two: 4)
    monkeypatch.setattr(launch, "_on", lambda device: (contextlib.nullcontext(), 77))
    monkeypatch.setattr(launch, "_device_index", lambda device: 0)
    monkeypatch.setattr(launch, "_launch_context", lambda index: (lambda: 77))
    return launch, seen


def _same_launch(a: tuple, b: tuple, workspace: tuple[int, ...], counters: int | None = None,
                 plan_only: tuple[int, ...] = ()) -> None:
    """Two launches' arguments agree but for the workspace pointers (the plan's own, allocated once,
    vs the one-shot call's); both have a workspace or neither. ``counters``: the decode launch's row
    counters, which only the plan (``b``) brings, with a workspace (its merge is in the kernel);
    ``plan_only``: other workspace pointers only the plan brings (MLA's schedule lengths)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if i in workspace:
            assert (x == 0) == (y == 0), f"argument {i}: workspace {x} vs {y}"
        elif i in plan_only:
            assert x == 0 and y != 0, f"argument {i}: {x} vs {y} (the plan's only)"
        elif i == counters:
            assert x == 0 and (y != 0) == (b[workspace[0]] != 0), f"argument {i}: counters {x} vs {y}"
        else:
            assert x == y, f"argument {i}: {x!r} vs {y!r}"


@pytest.mark.parametrize("scales", ["float", "per_head"])
@pytest.mark.parametrize("lens", [[3000, 17], [40, 9, 0]], ids=["split", "one-pass"])
def test_cuda_plan_launches_equal_the_one_shot_launches(monkeypatch, scales, lens):
    launch, seen = _launch_under_test(monkeypatch)
    case = make_case(seq_lens=lens, num_heads=16, num_kv_heads=2, head_size=128, cache_dtype=torch.float8_e4m3fn,
                     per_head_scales=scales == "per_head", garbage=False)
    layers = _layers(case, 3, "per_head" if scales == "per_head" else "float")
    kw = dict(max_seq_len=max(lens), logits_soft_cap=20.0, sliding_window=2500)
    q0, kc0, vc0, ks0, vs0 = layers[0]
    planned = hal.ops.prepare("paged_attention", query=q0, key_cache=kc0, value_cache=vc0,
                              block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=ks0, v_scale=vs0, **kw)
    runner = launch.paged_attention.prepare(planned)
    for q, kc, vc, ks, vs in layers[1:]:
        out = torch.empty_like(q)
        seen.clear()
        record = hal.ops.prepare("paged_attention", query=q, key_cache=kc, value_cache=vc, out=out,
                                 block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=ks, v_scale=vs, **kw)
        launch.paged_attention(record)
        runner({"query": q, "key_cache": kc, "value_cache": vc, "out": out, "k_scale": record.k_scale,
                "v_scale": record.v_scale})
        # the raw launcher plan.run calls (runner.raw_layout's order) launches the same
        assert runner.raw_layout == (("out", "query", "key_cache", "value_cache"), 5, ("k_scale", "v_scale"))
        tensor_scales = isinstance(record.k_scale, torch.Tensor)
        runner.raw(out.data_ptr(), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0,
                   *((record.k_scale.data_ptr(), record.v_scale.data_ptr(), 1.0, 1.0) if tensor_scales
                     else (0, 0, record.k_scale, record.v_scale)))
        (n1, one), (n2, plan_args), (n3, raw_args) = seen
        assert n1 == n2 == n3 == "paged_attention" and plan_args[-1] == 77
        assert raw_args == plan_args
        _same_launch(one, plan_args, workspace=(11, 12), counters=13)
        assert (one[11] != 0) == (lens[0] == 3000)   # the long context is split
    ws = runner.keep[0]
    assert all(t.device.type == "cpu" for t in ws)  # allocated once, at prepare, held by the runner


class _RawRunner:
    """A runner that takes pointers (the cuda pack's protocol: ``raw`` with its ``raw_layout``) and
    records what it is given; its fields path must not be taken."""
    raw_layout = (("out", "query", "key_cache", "value_cache"), 5, ("k_scale", "v_scale"))

    def __init__(self):
        self.calls = []

    def __call__(self, fields):
        raise AssertionError("plan.run took the fields path for a runner with a raw layout")

    def raw(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("scales", ["float", "per_head"])
def test_plan_run_gives_a_raw_runner_each_pointer_and_scale(scales):
    """A runner with a raw layout gets the layer's data pointers in its order (padded with 0), and
    each scale as (pointer, 1.0) when planned as a tensor or (0, value) when planned as a float; an
    allocated ``out`` is the one returned; a misfit tensor is still the named error, with nothing run."""
    from hal import planning, registry
    case = make_case(seq_lens=[40, 9], num_heads=8, num_kv_heads=2, head_size=64, cache_dtype=torch.float8_e4m3fn,
                     per_head_scales=scales == "per_head", garbage=False)
    layers = _layers(case, 2, "per_head" if scales == "per_head" else "float")
    q0, kc0, vc0, ks0, vs0 = layers[0]
    made = hal.plan("paged_attention", q0, kc0, vc0, case.block_tables, case.seq_lens, k_scale=ks0, v_scale=vs0,
                    max_seq_len=40)
    runner = _RawRunner()
    # the planned record again (a plan keeps stand-ins of its layer's tensors, not the tensors)
    record = hal.ops.prepare("paged_attention", query=q0, key_cache=kc0, value_cache=vc0,
                             block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=ks0, v_scale=vs0,
                             max_seq_len=40)
    public = {**made._public, **{n: getattr(record, n) for n in made.per_layer}}
    plan = planning.Plan("paged_attention", record, registry.by_name(made.pack), runner, public, False)
    q, kc, vc, ks, vs = layers[1]
    out = torch.empty_like(q)
    assert plan.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out) is out
    if scales == "per_head":
        want_scales = (ks.data_ptr(), vs.data_ptr(), 1.0, 1.0)
    else:
        want_scales = (0, 0, ks, vs)
    assert runner.calls == [(out.data_ptr(), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0) + want_scales]
    runner.calls.clear()
    got = plan.run(q, kc, vc, k_scale=ks, v_scale=vs)
    assert runner.calls[0][0] == got.data_ptr() and got.shape == q.shape
    runner.calls.clear()
    with pytest.raises(hal.ArgumentError, match="key_cache"):
        plan.run(q, kc.view(torch.uint8), vc, k_scale=ks, v_scale=vs, out=out)
    assert runner.calls == []


@pytest.mark.parametrize("merge", ["auto", "kernel", "reduce"])
def test_cuda_decode_merge_choice(monkeypatch, merge):
    """Which decode launches bring row counters (argument 13: the last CTA of a split row merges, no
    reduce launch): a plan's under "auto", every split launch under "kernel", none under "reduce";
    never a one-pass launch. Fresh counters are zeros."""
    launch, seen = _launch_under_test(monkeypatch)
    monkeypatch.setattr(launch, "DECODE_MERGE", merge)
    for lens, split in (([3000, 17], True), ([40, 9, 0], False)):
        case = make_case(seq_lens=lens, num_heads=16, num_kv_heads=2, head_size=128, garbage=False)
        record = hal.ops.prepare("paged_attention", query=case.query, key_cache=case.key_cache,
                                 value_cache=case.value_cache, block_tables=case.block_tables, seq_lens=case.seq_lens,
                                 k_scale=case.k_scale, v_scale=case.v_scale, max_seq_len=max(lens))
        seen.clear()
        launch.paged_attention(record)
        runner = launch.paged_attention.prepare(record)
        runner({"query": case.query, "key_cache": case.key_cache, "value_cache": case.value_cache,
                "out": torch.empty_like(case.query), "k_scale": record.k_scale, "v_scale": record.v_scale})
        (_, one), (_, planned) = seen
        assert (one[11] != 0) == (planned[11] != 0) == split
        want = {"auto": (False, split), "kernel": (split, split), "reduce": (False, False)}[merge]
        assert ((one[13] != 0), (planned[13] != 0)) == want
        if split and merge != "reduce":
            counters = runner.keep[0][2]
            assert counters.dtype == torch.int32 and counters.shape == (2 * 2,) and not counters.any()
    # a merge too large for one CTA (16 heads a CTA x 128 partitions > IN_KERNEL_MERGE_MAX): "auto"
    # keeps the reduce launch in a plan too
    case = make_case(seq_lens=[131072], num_heads=32, num_kv_heads=2, head_size=64, block_size=256,
                     cache_dtype=torch.bfloat16, query_dtype=torch.bfloat16, garbage=False)
    record = hal.ops.prepare("paged_attention", query=case.query, key_cache=case.key_cache,
                             value_cache=case.value_cache, block_tables=case.block_tables, seq_lens=case.seq_lens,
                             max_seq_len=131072)
    seen.clear()
    launch.paged_attention.prepare(record)({"query": case.query, "key_cache": case.key_cache,
                                           "value_cache": case.value_cache, "out": torch.empty_like(case.query),
                                           "k_scale": 1.0, "v_scale": 1.0})
    (_, planned), = seen
    assert planned[33] > 1 and 16 * planned[33] > launch.IN_KERNEL_MERGE_MAX
    assert (planned[13] != 0) == (merge == "kernel")


@pytest.mark.parametrize("scales", ["float", "per_head"])
def test_cuda_multi_token_plan_launches_equal_the_one_shot_launches(monkeypatch, scales):
    """A mixed batch: the prefill launch (planned from max_query_len) then the decode launch with its
    split-K workspace, in that order, the plan's arguments the one-shot call's but the workspace."""
    launch, seen = _launch_under_test(monkeypatch)
    lens, qlens = [3000, 1, 77, 5, 0], [120, 1, 0, 5, 0]
    case = make_varlen(lens, qlens, num_heads=16, num_kv_heads=2, head_size=128, cache_dtype=torch.float8_e4m3fn,
                       per_head_scales=scales == "per_head", garbage=False)
    geo = dict(block_tables=case.block_tables, seq_lens=case.seq_lens, query_start_loc=case.query_start_loc,
               max_query_len=120, max_seq_len=3000, sliding_window=2500)
    planned = hal.ops.prepare("paged_attention", query=case.query, key_cache=case.key_cache,
                              value_cache=case.value_cache, k_scale=case.k_scale, v_scale=case.v_scale, **geo)
    runner = launch.paged_attention.prepare(planned)
    q = torch.randn_like(case.query.float()).to(case.query.dtype)
    kc, vc = torch.zeros_like(case.key_cache), torch.zeros_like(case.value_cache)
    ks = case.k_scale * 2 if isinstance(case.k_scale, torch.Tensor) else 0.5
    out = torch.empty_like(q)
    record = hal.ops.prepare("paged_attention", query=q, key_cache=kc, value_cache=vc, out=out, k_scale=ks,
                             v_scale=ks, **geo)
    seen.clear()
    launch.paged_attention(record)
    runner({"query": q, "key_cache": kc, "value_cache": vc, "out": out, "k_scale": record.k_scale,
            "v_scale": record.v_scale})
    assert [n for n, _ in seen] == ["prefill", "paged_attention"] * 2
    (_, pre1), (_, dec1), (_, pre2), (_, dec2) = seen
    assert pre1 == pre2 and pre1[3] == q.data_ptr() and pre1[4] == kc.data_ptr() and pre1[2] == out.data_ptr()
    assert pre1[32] == 120                                   # max_query_len sizes the grid
    _same_launch(dec1, dec2, workspace=(11, 12), counters=13)
    assert dec1[11] != 0 and dec1[-2] == case.query_start_loc.data_ptr()  # the long context is split


def test_cuda_multi_token_kernel_choice(monkeypatch):
    """The prefill launch's last argument asks for the sm_90a kernel: from launch.PREFILL_KERNEL (tests,
    bench), else HAL_CUDA_PREFILL, else the tuning entry's prefill.wgmma_head_sizes (sm_90: 128 and 192)."""
    launch, seen = _launch_under_test(monkeypatch)
    case = make_varlen([40, 9], [40, 9], num_heads=8, num_kv_heads=2, head_size=128, garbage=False)
    record = hal.ops.prepare("paged_attention", query=case.query, key_cache=case.key_cache,
                             value_cache=case.value_cache, k_scale=case.k_scale, v_scale=case.v_scale,
                             block_tables=case.block_tables, seq_lens=case.seq_lens,
                             query_start_loc=case.query_start_loc, max_query_len=40)

    def asked(env=None, attr="auto"):
        if env is None:
            monkeypatch.delenv("HAL_CUDA_PREFILL", raising=False)
        else:
            monkeypatch.setenv("HAL_CUDA_PREFILL", env)
        monkeypatch.setattr(launch, "PREFILL_KERNEL", attr)
        seen.clear()
        launch.paged_attention(record)
        return [a[-2] for name, a in seen if name == "prefill"]

    assert asked() == [1]                       # the shipped sm_90 entry lists head 128 (tools/tune --prefill)
    assert asked("wgmma") == [1] and asked("mma") == [0] and asked("auto") == [1]
    assert asked("wgmma", attr="mma") == [0] and asked(None, attr="wgmma") == [1] and asked("wgmma", attr="auto") == [1]
    real = launch.tuning_for
    for listed, want in (([], [0]), ([64, 192], [0]), ([128], [1])):
        monkeypatch.setattr(launch, "tuning_for", lambda arch, cls=None, listed=listed: real(arch, cls) if cls else
                            {**real(arch), "prefill": {"wgmma_head_sizes": listed}})
        assert asked() == want and asked("mma") == [0] and asked("wgmma") == [1]
    # a grid mostly of CTAs with no rows (a mixed batch's one-row sequences): mma.sync unless forced
    sparse = make_varlen([40, 9, 9, 9], [40, 1, 1, 1], num_heads=8, num_kv_heads=2, head_size=128, garbage=False)
    record = hal.ops.prepare("paged_attention", query=sparse.query, key_cache=sparse.key_cache,
                             value_cache=sparse.value_cache, k_scale=sparse.k_scale, v_scale=sparse.v_scale,
                             block_tables=sparse.block_tables, seq_lens=sparse.seq_lens,
                             query_start_loc=sparse.query_start_loc, max_query_len=40)
    assert 43 < launch.WGMMA_MIN_FILL * 4 * 40
    assert asked() == [0] and asked("wgmma") == [1] and asked(None, attr="wgmma") == [1]
    assert asked("cute") == [2] and asked(None, attr="cute") == [2]


def test_cuda_multi_token_cute_kernel_choice(monkeypatch):
    """The tuning entry asks for the CuTe kernel (2) before wgmma_head_sizes: prefill.cute_head_sizes for
    16-bit caches, prefill.cute_fp8_head_sizes for FP8 ones; HAL_CUDA_PREFILL=cute forces it (the launcher
    falls back by head size and arch). The shipped sm_90 entry lists head 128 for 16-bit caches only."""
    launch, seen = _launch_under_test(monkeypatch)
    real = launch.tuning_for
    shipped = real("sm_90").get("prefill", {})
    assert shipped.get("cute_head_sizes") == [128] and not shipped.get("cute_fp8_head_sizes")
    monkeypatch.setattr(launch, "tuning_for", lambda arch, cls=None: real(arch, cls) if cls else
                        {**real(arch), "prefill": {"wgmma_head_sizes": [128], "cute_head_sizes": [128],
                                                   "cute_fp8_head_sizes": [128]}})
    monkeypatch.delenv("HAL_CUDA_PREFILL", raising=False)
    monkeypatch.setattr(launch, "PREFILL_KERNEL", "auto")

    def asked(cache_dtype, env=None):
        if env is not None:
            monkeypatch.setenv("HAL_CUDA_PREFILL", env)
        case = make_varlen([40, 9], [40, 9], num_heads=8, num_kv_heads=2, head_size=128, garbage=False,
                           cache_dtype=cache_dtype, query_dtype=torch.bfloat16)
        record = hal.ops.prepare("paged_attention", query=case.query, key_cache=case.key_cache,
                                 value_cache=case.value_cache, k_scale=case.k_scale, v_scale=case.v_scale,
                                 block_tables=case.block_tables, seq_lens=case.seq_lens,
                                 query_start_loc=case.query_start_loc, max_query_len=40)
        seen.clear()
        launch.paged_attention(record)
        return [a[-2] for name, a in seen if name == "prefill"]

    assert asked(torch.bfloat16) == [2] and asked(torch.float8_e4m3fn) == [2]
    monkeypatch.setattr(launch, "tuning_for", lambda arch, cls=None: real(arch, cls) if cls else
                        {**real(arch), "prefill": {"wgmma_head_sizes": [128], "cute_head_sizes": [128]}})
    assert asked(torch.bfloat16) == [2] and asked(torch.float8_e4m3fn) == [1]
    monkeypatch.setattr(launch, "tuning_for", lambda arch, cls=None: real(arch, cls) if cls else
                        {**real(arch), "prefill": {"wgmma_head_sizes": [128], "cute_head_sizes": [64]}})
    assert asked(torch.bfloat16) == [1] and asked(torch.float8_e4m3fn, "cute") == [2]


def test_cuda_multi_token_call_copies_a_query_whose_rows_are_off_16_bytes(monkeypatch):
    """A contiguous query view starting 2 bytes into its storage: the prefill kernel's 16-byte loads get an
    aligned copy (``.contiguous()`` would return the same view)."""
    launch, seen = _launch_under_test(monkeypatch)
    case = make_varlen([40, 9, 1], [40, 9, 1], num_heads=8, num_kv_heads=2, head_size=64, garbage=False)
    flat = torch.empty(case.query.numel() + 1, dtype=case.query.dtype)
    q = flat[1:].view(case.query.shape).copy_(case.query)
    assert q.is_contiguous() and q.data_ptr() % 16
    record = hal.ops.prepare("paged_attention", query=q, key_cache=case.key_cache, value_cache=case.value_cache,
                             k_scale=case.k_scale, v_scale=case.v_scale, block_tables=case.block_tables,
                             seq_lens=case.seq_lens, query_start_loc=case.query_start_loc, max_query_len=40)
    launch.paged_attention(record)
    ptrs = {name: a[3] for name, a in seen}
    assert set(ptrs) == {"prefill", "paged_attention"} and ptrs["prefill"] == ptrs["paged_attention"]
    assert ptrs["prefill"] % 16 == 0 and ptrs["prefill"] != q.data_ptr()


def test_cuda_mla_kernel_choice(monkeypatch):
    """The MLA launch's last argument asks for the row tile's own kernel: csrc/mla_sm90.cuh for 64-row
    tiles (more than 32 rows a sequence; row groups 4, the argument before the output pointer),
    csrc/mla_narrow.cuh for 16-row tiles; from launch.MLA_KERNEL, else the tuning entry's mla.wgmma /
    an FP8 latent for 16-row tiles. 32-row tiles have none."""
    launch, seen = _launch_under_test(monkeypatch)

    def asked(heads, q_lens=None, attr="auto", latent=torch.float8_e4m3fn):
        q = torch.bfloat16
        case = make_mla([70, 9], q_lens, heads=heads, ckv_dtype=latent, kpe_dtype=q, query_dtype=q, seed=heads)
        qsl = case["query_start_loc"] if q_lens else None
        record = hal.ops.prepare("mla_decode", q_nope=case["q_nope"], q_pe=case["q_pe"], ckv_cache=case["ckv_cache"],
                                 kpe_cache=case["kpe_cache"], block_tables=case["block_tables"],
                                 seq_lens=case["seq_lens"], scale=case["scale"], ckv_scale=case["ckv_scale"],
                                 query_start_loc=qsl, max_query_len=max(q_lens) if q_lens else None)
        monkeypatch.setattr(launch, "MLA_KERNEL", attr)
        seen.clear()
        launch.mla_decode(record)
        (name, a), = seen
        return a[1], a[-6]  # row groups, own kernel (then the balanced split's 4 ints and the stream)

    assert asked(128) == (4, 1) and asked(16) == (1, 1) and asked(32) == (2, 0) and asked(48) == (4, 1)
    assert asked(16, latent=torch.bfloat16) == (1, 0) and asked(16, latent=torch.float8_e5m2) == (1, 1)
    assert asked(16, [4, 1]) == (4, 1)                        # 64 rows: speculative tokens x heads
    assert asked(128, attr="mma") == (4, 0) and asked(16, attr="wgmma") == (1, 0)
    assert asked(16, attr="narrow", latent=torch.bfloat16) == (1, 1) and asked(8, [2, 1]) == (1, 1)
    assert asked(8, [2, 1], "wgmma") == (1, 0)
    assert asked(128, attr="narrow") == (4, 0) and asked(32, attr="narrow") == (2, 0) and asked(16, attr="mma") == (1, 0)
    real = launch.tuning_for
    monkeypatch.setattr(launch, "tuning_for", lambda arch, cls=None: real(arch, cls) if cls else
                        {**real(arch), "mla": {"wgmma": False}})
    assert asked(128) == (4, 0) and asked(128, attr="wgmma") == (4, 1)


def test_cuda_mla_split_choice(monkeypatch):
    """MLA decode's balanced split (a work list: argument 15; then the CTAs a wave, the list's length, the
    partial slots and a CTA's fixed cost) for more than one sequence over 256 tokens; the uniform split
    (host ints, no list) for one sequence, whose tiles are all as long, for contexts of at most 256
    tokens, and under launch.MLA_SCHEDULE = "uniform"."""
    launch, seen = _launch_under_test(monkeypatch)

    def split(lens, schedule="device", heads=16):
        q = torch.bfloat16
        case = make_mla(lens, heads=heads, ckv_dtype=torch.float8_e4m3fn, kpe_dtype=q, query_dtype=q, seed=1)
        record = hal.ops.prepare("mla_decode", q_nope=case["q_nope"], q_pe=case["q_pe"], ckv_cache=case["ckv_cache"],
                                 kpe_cache=case["kpe_cache"], block_tables=case["block_tables"],
                                 seq_lens=case["seq_lens"], scale=case["scale"], ckv_scale=case["ckv_scale"])
        monkeypatch.setattr(launch, "MLA_SCHEDULE", schedule)
        seen.clear()
        launch.mla_decode(record)
        (name, a), = seen
        return a[15] != 0, tuple(a[-5:-1])

    assert split([300, 9]) == (True, (132, 2 + 2 * 132, 2 * 132, 2))
    assert split([300, 9], heads=128) == (True, (132, 4 + 2 * 132, 2 * 132, 2))  # two 64-row tiles a sequence
    assert split([300]) == (False, (0, 0, 0, 0))
    assert split([256, 9]) == (False, (0, 0, 0, 0))
    assert split([300, 9], "uniform") == (False, (0, 0, 0, 0))


def test_cuda_plan_launches_for_mla_and_cache_writes(monkeypatch):
    launch, seen = _launch_under_test(monkeypatch)
    case = make_mla([600, 70, 3], [2, 1, 1], r=512, p=64, heads=16, combined=True,
                    ckv_dtype=torch.float8_e4m3fn, kpe_dtype=torch.float8_e4m3fn, seed=2)
    geo = dict(block_tables=case["block_tables"], seq_lens=case["seq_lens"], scale=case["scale"],
               query_start_loc=case["query_start_loc"], max_query_len=2, max_seq_len=600)
    planned = hal.ops.prepare("mla_decode", q_nope=case["q_nope"], q_pe=case["q_pe"], ckv_cache=case["ckv_cache"],
                              kpe_cache=case["kpe_cache"], ckv_scale=torch.tensor(0.02), kpe_scale=0.5, **geo)
    runner = launch.mla_decode.prepare(planned)
    qn, qp = torch.randn_like(case["q_nope"]), torch.randn_like(case["q_pe"])
    kv = torch.zeros(case["ckv_cache"].shape[0], case["ckv_cache"].shape[1], 576, dtype=torch.float8_e4m3fn)
    ckv, kpe = kv[..., :512], kv[..., 512:]
    out = torch.empty_like(qn)
    record = hal.ops.prepare("mla_decode", q_nope=qn, q_pe=qp, ckv_cache=ckv, kpe_cache=kpe, out=out,
                             ckv_scale=torch.tensor(0.03), kpe_scale=0.25, **geo)
    seen.clear()
    launch.mla_decode(record)
    runner({"q_nope": qn, "q_pe": qp, "ckv_cache": ckv, "kpe_cache": kpe, "out": out, "ckv_scale": record.ckv_scale,
            "kpe_scale": 0.25})
    (_, one), (_, plan_args) = seen
    # the balanced split's workspace (partials, work list, row tiles' partitions); MLA merges by the reduce
    # launch, planned too; only the plan keeps the lengths its list was made for (argument 17)
    _same_launch(one, plan_args, workspace=(12, 13, 15, 16), plan_only=(17,))
    assert one[14] == plan_args[14] == 0   # no row counters
    assert plan_args[10] == record.ckv_scale.data_ptr() and plan_args[31] == 0.25
    # cache_kv: every argument but the stream
    k = torch.randn(5, 2, 64)
    kc = torch.zeros(4, 2, 8, 64, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([3, 9, -1, 20, 31])
    planned = hal.ops.prepare("cache_kv", key=k, value=k, key_cache=kc, value_cache=kc.clone(), slot_mapping=slots,
                              k_scale=torch.tensor([0.1, 0.2]), v_scale=0.3)
    runner = launch.cache_kv.prepare(planned)
    k2, kc2, vc2 = torch.randn(5, 2, 64), torch.zeros_like(kc), torch.zeros_like(kc)
    ks2 = torch.tensor([0.5, 0.6])
    seen.clear()
    launch.cache_kv(hal.ops.prepare("cache_kv", key=k2, value=k2, key_cache=kc2, value_cache=vc2, slot_mapping=slots,
                                    k_scale=ks2, v_scale=0.7))
    runner({"key": k2, "value": k2, "key_cache": kc2, "value_cache": vc2, "k_scale": ks2, "v_scale": 0.7})
    (_, one), (_, plan_args) = seen
    assert one == plan_args


# -------------------------------------------------------------------- HalRunner: planned steps, graph path

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[model]')")


def _tiny_llama(**extra):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**dict(vocab_size=128, hidden_size=128, intermediate_size=192,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=32, max_position_embeddings=512, bos_token_id=0,
                                             eos_token_id=1, pad_token_id=None), **extra})
    return transformers.LlamaForCausalLM(cfg).eval()


PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16]]


@pytest.mark.filterwarnings("ignore::hal.MissingScaleWarning")
def test_generation_plans_each_step_once_for_every_layer(monkeypatch):
    from hal.integrations.transformers import HalRunner
    model = _tiny_llama()
    made, real = [], hal.plan
    monkeypatch.setattr(hal, "plan", lambda op, *a, **kw: made.append(op) or real(op, *a, **kw))
    one_shot = []
    monkeypatch.setattr(hal, "paged_attention", lambda *a, **kw: one_shot.append(1))
    runner = HalRunner(model, cache_dtype=torch.float8_e4m3fn, block_size=4, prefill_chunk=4, cuda_graphs=False)
    new = runner.generate(PROMPTS, 5)
    # prompt chunks of 4: 2 steps; decode: 4 steps (the 5th token needs no forward); 2 plans a step
    assert made == ["cache_kv", "paged_attention"] * 6 and not one_shot
    assert all(len(t) == 5 for t in new)


def _fake_capture(captured: list):
    """A stand-in for a CUDA graph: capture runs the step once (as a recording), replay runs it again
    over the same buffers into the same output, as a graph's replay does."""
    def capture(fn, device, pool=None):
        out = fn()
        captured.append(out)
        return (lambda: out.copy_(fn())), out, types.SimpleNamespace()
    return capture


@pytest.mark.parametrize("cache", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_graph_decode_generates_the_eager_tokens(monkeypatch, cache):
    from hal.integrations import transformers as integ
    model = _tiny_llama(num_hidden_layers=2)
    scales = hal.KVScales((0.02, 0.03), (0.02, 0.025)) if cache != torch.float32 else None
    eager = integ.HalRunner(model, cache_dtype=cache, scales=scales, block_size=4, cuda_graphs=False)
    want = eager.generate(PROMPTS, 9, eos_token_id=[40, 77])
    captured = []
    monkeypatch.setattr(integ, "_graphs_possible", lambda device: True)
    monkeypatch.setattr(integ, "_capture", _fake_capture(captured))
    runner = integ.HalRunner(model, cache_dtype=cache, scales=scales, block_size=4)
    plans = []
    real = hal.plan
    monkeypatch.setattr(hal, "plan", lambda op, *a, **kw: plans.append(op) or real(op, *a, **kw))
    got = runner.generate(PROMPTS, 9, eos_token_id=[40, 77])
    assert got == want and runner.graph_fallback is None
    batches = len({len([t for t in got if len(t) > s]) for s in range(1, 9)})
    assert len(captured) == batches  # one capture per batch size; the other steps replayed
    assert plans.count("paged_attention") == 1 + batches  # 1 prompt step, then one per static batch


def test_a_failed_capture_decodes_eagerly_and_says_why(monkeypatch, caplog):
    import logging

    from hal.integrations import transformers as integ
    model = _tiny_llama(num_hidden_layers=2)
    want = integ.HalRunner(model, cache_dtype=torch.float32, block_size=4, cuda_graphs=False).generate(PROMPTS, 6)

    def broken(fn, device, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(integ, "_graphs_possible", lambda device: True)
    monkeypatch.setattr(integ, "_capture", broken)
    runner = integ.HalRunner(model, cache_dtype=torch.float32, block_size=4)
    with caplog.at_level(logging.WARNING, logger="hal"):
        got = runner.generate(PROMPTS, 6)
    assert got == want and "not permitted" in runner.graph_fallback
    assert "decodes eagerly" in caplog.text


# -------------------------------------------------------------------- on the GPU (cuda pack)

gpu = pytest.mark.cuda


def _shuffled_blocks(cache: torch.Tensor, seed: int) -> torch.Tensor:
    """Another layer's cache: the blocks of ``cache`` in another order (through the raw bytes: FP8
    tensors are not indexed directly), laid out as ``cache`` is."""
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed)).to(cache.device)
    raw = torch.uint8 if cache.element_size() == 1 else torch.int16
    out = torch.empty_like(cache)
    out.view(raw).copy_(cache.view(raw)[perm])
    return out


def _gpu_layers(n=3, cache=torch.float8_e4m3fn, per_head=False, lens=(3000, 700, 5, 0)):
    case = make_case(seq_lens=list(lens), num_heads=32, num_kv_heads=8, head_size=128, cache_dtype=cache,
                     query_dtype=torch.bfloat16, per_head_scales=per_head, device="cuda", garbage=False)
    layers = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(i)
        kc = case.key_cache if i == 0 else _shuffled_blocks(case.key_cache, 2 * i)
        vc = case.value_cache if i == 0 else _shuffled_blocks(case.value_cache, 2 * i + 1)
        f = 1 + i / 4
        ks = case.k_scale * f
        vs = case.v_scale / f
        if not per_head and hal.fp8.is_fp8(cache):
            ks, vs = torch.tensor(ks, device="cuda"), torch.tensor(vs, device="cuda")   # graph-safe scales
        elif not hal.fp8.is_fp8(cache):
            ks = vs = None
        layers.append((torch.randn(case.query.shape, generator=g, device="cuda").to(torch.bfloat16), kc, vc, ks, vs))
    return case, layers


@gpu
@pytest.mark.parametrize("cache,per_head", [(torch.float8_e4m3fn, False), (torch.float8_e5m2, True),
                                            (torch.bfloat16, False)], ids=["e4m3fn", "e5m2-per-head", "bf16"])
def test_gpu_run_equals_the_one_shot_call(cache, per_head):
    case, layers = _gpu_layers(cache=cache, per_head=per_head)
    q0, kc0, vc0, ks0, vs0 = layers[0]
    p = hal.plan("paged_attention", q0, kc0, vc0, case.block_tables, case.seq_lens, k_scale=ks0, v_scale=vs0,
                 max_seq_len=3000)
    assert p.pack == "cuda"
    for q, kc, vc, ks, vs in layers:
        want = hal.paged_attention(q, kc, vc, case.block_tables, case.seq_lens, k_scale=ks, v_scale=vs,
                                   max_seq_len=3000)
        assert same_bits(p.run(q, kc, vc, k_scale=ks, v_scale=vs), want)


@gpu
def test_gpu_run_refuses_tensors_off_the_planned_gpu():
    """A GPU plan compares device indices (cheaper than devices): a CPU or meta tensor is never taken
    for the planned GPU's."""
    case, layers = _gpu_layers(n=1)
    q, kc, vc, ks, vs = layers[0]
    p = hal.plan("paged_attention", q, kc, vc, case.block_tables, case.seq_lens, k_scale=ks, v_scale=vs,
                 max_seq_len=3000)
    for where, moved in (("cpu", q.cpu()), ("meta", q.to("meta"))):
        with pytest.raises(hal.ArgumentError, match=rf"query must be laid out like the planned one \(bfloat16 "
                                                    rf"\[4, 32, 128\] .* on GPU \d.*got .* on {where}"):
            p.run(moved, kc, vc, k_scale=ks, v_scale=vs)
    with pytest.raises(hal.ArgumentError, match=r"k_scale must be laid out like the planned one \(float32 \[\] .* on "
                                                r"GPU \d\).*got float32 \[\] .* on cpu"):
        p.run(q, kc, vc, k_scale=ks.cpu(), v_scale=vs)
    assert same_bits(p.run(q, kc, vc, k_scale=ks, v_scale=vs), p.run(q, kc, vc, k_scale=ks, v_scale=vs))


@gpu
def test_gpu_mla_run_equals_the_one_shot_call():
    case = make_mla([900, 70, 3], [2, 1, 1], heads=16, combined=True, ckv_dtype=torch.float8_e4m3fn,
                    kpe_dtype=torch.float8_e4m3fn, seed=4)
    kpe16 = case["kpe_cache"].float().to(torch.bfloat16).cuda()
    kv = torch.cat([case["ckv_cache"], case["kpe_cache"]], dim=-1).cuda()   # vLLM's combined [nb, bs, R + P]
    case["ckv_cache"] = kv[..., :512]
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    geo = dict(block_tables=dev["block_tables"], seq_lens=dev["seq_lens"], scale=dev["scale"],
               query_start_loc=dev["query_start_loc"], max_query_len=2, max_seq_len=900)
    cs = torch.tensor(case["ckv_scale"], device="cuda")
    p = hal.plan("mla_decode", dev["q_nope"], dev["q_pe"], dev["ckv_cache"], kpe16, ckv_scale=cs, **geo)
    assert p.pack == "cuda"
    for i in range(3):
        qn, qp = torch.randn_like(dev["q_nope"]), torch.randn_like(dev["q_pe"])
        ckv = dev["ckv_cache"] if i == 0 else _shuffled_blocks(kv, i)[..., :512]   # the planned view's strides
        s = cs * (1 + i)
        want = hal.mla_decode(qn, qp, ckv, kpe16, ckv_scale=s, **geo)
        assert same_bits(p.run(qn, qp, ckv, kpe16, ckv_scale=s), want)


@gpu
def test_gpu_graph_capture_of_plan_runs_equals_eager():
    """A step of 3 layers (cache write + attention each, through plans with device scales) captured
    in one CUDA graph: replay gives the eager bits, and a replay after the geometry buffers were
    rewritten in place (longer sequences, within the planned bounds) gives that step's eager bits."""
    case, layers = _gpu_layers(lens=(1990, 700, 5, 1))   # the second step stays within each last block
    bt, sl = case.block_tables.clone(), case.seq_lens.clone()
    hkv, d = case.key_cache.shape[1], case.key_cache.shape[3]
    caches = [(kc.clone(), vc.clone()) for _, kc, vc, _, _ in layers]
    new_k = torch.randn(4, hkv, d, device="cuda")
    slots = torch.zeros(4, dtype=torch.int64, device="cuda")
    outs = [torch.empty_like(layers[0][0]) for _ in layers]
    ks0, vs0 = layers[0][3], layers[0][4]
    write = hal.plan("cache_kv", new_k, new_k, *caches[0], slots, k_scale=ks0, v_scale=vs0)
    attend = hal.plan("paged_attention", layers[0][0], *caches[0], bt, sl, k_scale=ks0, v_scale=vs0,
                      max_seq_len=2000, out=outs[0])

    def step():
        for (q, _, _, ks, vs), (kc, vc), out in zip(layers, caches, outs):
            write.run(new_k, new_k, kc, vc, k_scale=ks, v_scale=vs)
            attend.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out)

    def set_geometry(lens):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        pos = sl.long() - 1
        slots.copy_(bt.long().gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16)

    def eager(lens):
        for (kc, vc), (_, k0, v0, _, _) in zip(caches, layers):
            kc.copy_(k0), vc.copy_(v0)
        set_geometry(lens)
        step()
        torch.cuda.synchronize()
        return [o.clone() for o in outs]

    first, second = eager([1990, 700, 5, 1]), eager([1991, 701, 6, 2])
    set_geometry([1990, 700, 5, 1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens, want in (([1990, 700, 5, 1], first), ([1991, 701, 6, 2], second)):
        for (kc, vc), (_, k0, v0, _, _) in zip(caches, layers):
            kc.copy_(k0), vc.copy_(v0)
        set_geometry(lens)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(same_bits(o, w) for o, w in zip(outs, want))


@gpu
@pytest.mark.filterwarnings("ignore::hal.MissingScaleWarning")
def test_gpu_runner_graph_decode_generates_the_eager_tokens(monkeypatch):
    """Real CUDA graphs against the same static steps run eagerly (the stand-in capture: the same
    plans, buffers and max_seq_len, so the same kernels): the same hidden states bit for bit, hence
    the same tokens. (Plain eager decoding plans with the exact max_seq_len, so the cuda pack may
    split contexts differently: equal within rounding, not bit for bit, so not compared here.)"""
    from hal.integrations import transformers as integ
    model = _tiny_llama(num_hidden_layers=2, head_dim=128, hidden_size=512, num_attention_heads=4,
                        num_key_value_heads=2).to("cuda", torch.bfloat16)
    hidden = {}
    real_step = integ._DecodeGraphs.step

    def recording(self, seq_ids, tokens):
        out = real_step(self, seq_ids, tokens)
        hidden.setdefault(self.runner.tag, []).append(out.clone())
        return out

    monkeypatch.setattr(integ._DecodeGraphs, "step", recording)
    graphs = integ.HalRunner(model, cache_dtype=torch.float8_e4m3fn)
    graphs.tag = "graph"
    got = graphs.generate(PROMPTS, 12, eos_token_id=[40])
    assert graphs.graph_fallback is None, graphs.graph_fallback
    monkeypatch.setattr(integ, "_capture", _fake_capture([]))
    static = integ.HalRunner(model, cache_dtype=torch.float8_e4m3fn)
    static.tag = "static"
    want = static.generate(PROMPTS, 12, eos_token_id=[40])
    assert got == want
    assert len(hidden["graph"]) == len(hidden["static"]) > 3
    assert all(same_bits(a, b) for a, b in zip(hidden["graph"], hidden["static"]))


def test_a_plan_keeps_none_of_its_layers_tensors_alive():
    """A plan holds layouts of the layer it was made over, not its tensors: a cache dropped by its
    owner is freed while the plan lives (hal.compat keeps plans across an engine's calls), and the
    plan still runs the next layer."""
    import gc
    import weakref

    case = make_case(seq_lens=[40, 9], num_heads=8, num_kv_heads=2, head_size=64, garbage=False)
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    plan = hal.plan("paged_attention", case.query, kc, vc, case.block_tables, case.seq_lens, k_scale=0.5,
                    v_scale=0.25, max_seq_len=40)
    refs = [weakref.ref(t) for t in (kc, vc)]
    del kc, vc
    gc.collect()
    assert all(r() is None for r in refs)
    got = plan.run(case.query, case.key_cache, case.value_cache, k_scale=0.5, v_scale=0.25)
    want = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               k_scale=0.5, v_scale=0.25, max_seq_len=40)
    assert torch.equal(got, want)
