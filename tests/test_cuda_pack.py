"""The cuda pack. On any machine: its declaration, its availability reasons and dispatch around it.
On an NVIDIA sm89+ GPU (marker ``cuda``): the grid drawn from its declaration against the float64
reference (tests/reference.py) and the emu pack on the same bytes, cache writes bit for bit against
hal.fp8's definition, split-K against one pass, CUDA graphs, torch.compile, large caches.

Tolerance: relative L2 error <= 5e-3 against float64 (cases.GPU_REL_L2): probabilities are rounded
to 16 bits before the PV product (fp16 for FP8 and fp16 caches: 2^-11 relative; bf16 for bf16
caches: 2^-8), K/V are exact in the MMA operands, accumulation is fp32.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import hal
from cases import FEATURES, alibi_slopes, gpu_tolerance_ok, make_case, nan_input_cases, nan_rows_ok
from hal import registry

CUDA_PRESENT = importlib.util.find_spec("hal.kernelpacks.cuda") is not None
pytestmark = pytest.mark.skipif(not CUDA_PRESENT, reason="the cuda pack is not in this tree")


def _pack():
    return registry.by_name("cuda")


def _support():
    return _pack().SUPPORTS["paged_attention"]


# ---------------------------------------------------------------- any machine

def test_declaration_is_data():
    s = _support()
    assert torch.float8_e4m3fn in s.cache_dtypes and torch.float8_e4m3fnuz not in s.cache_dtypes
    assert set(s.head_sizes) >= {64, 80, 96, 112, 128, 192, 256}
    assert set(s.block_sizes) >= {8, 16, 32, 64, 128}
    assert {"alibi", "soft_cap", "sliding_window", "per_head_scales", "strided_cache"} <= s.features


def test_fnuz_goes_to_emu_with_a_reason(monkeypatch):
    monkeypatch.setenv("HAL_TARGET", "sm_90")
    from hal import dispatch
    from hal.pack import CallKey
    key = CallKey("paged_attention", "cuda", torch.bfloat16, torch.float8_e4m3fnuz, 128, 16, 4)
    reasons = _pack().reasons(key, hal.target())
    assert any("AMD's FP8 encoding" in r for r in reasons)
    d = dispatch.decide(key, hal.target())
    assert d.pack.NAME == "emu"


def test_not_native_before_sm89(monkeypatch):
    monkeypatch.setenv("HAL_TARGET", "sm_80")
    assert "needs sm_89+" in _pack().native_for(hal.target())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_unavailable_here_with_reasons(monkeypatch):
    a = _pack().availability
    assert not a.ok and a.reasons
    monkeypatch.setenv("HAL_TARGET", "sm_90")
    case = make_case(seq_lens=[5, 9], head_size=128)
    with pytest.warns(hal.FallbackWarning, match=r"falls back to the emu pack on cuda:sm_90.*cuda:"):
        hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                            k_scale=case.k_scale, v_scale=case.v_scale)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_compiled_module_reports_no_gpu():
    try:
        from hal.kernelpacks.cuda import _C
    except ImportError:
        pytest.skip("the compiled module is not built here (no nvcc at install time)")
    count, err, msg = _C.device_count()
    assert count == 0 and err != 0 and msg
    assert list(_C.head_sizes()) == list(_support().head_sizes)
    assert _C.prefill_wgmma() is False   # no sm_90 GPU: the multi-token calls would take mma.sync


def test_launcher_names_an_inconsistent_warp_rows_request():
    """Warp rows need one 8-head tile per CTA; the launcher says so before touching the GPU."""
    try:
        from hal.kernelpacks.cuda import _C
    except ImportError:
        pytest.skip("the compiled module is not built here (no nvcc at install time)")
    # 16 query heads per KV head in one 16-head tile (head_tiles=1), with warp rows asked for
    args = [2, 128] + [0] * 12 + [0] * 7 + [1.0, 1.0, 1.0, 0.0, 0, 0, 1, 16, 1, 1, 16, 1024, 1, 0, 1, 1] + [0] * 4 + [0, 0]  # strides, query_start_loc, stream
    with pytest.raises(ValueError, match=r"warp_rows=1 needs one 8-head tile per CTA .*got head_tiles=1"):
        _C.paged_attention(*args)


# ---------------------------------------------------------------- on the GPU

gpu = pytest.mark.cuda
FP8_CACHES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _run(case, pack="cuda", **kw):
    out = case.poisoned_out()
    hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                        k_scale=case.k_scale, v_scale=case.v_scale, out=out, pack=pack, **case.kwargs, **kw)
    return out


def _check(case, **kw):
    out = _run(case, **kw)
    ok, msg = gpu_tolerance_ok(out, case.reference())
    assert ok, msg
    emu = _run(case, pack="emu", **kw)
    rel = ((out.float() - emu.float()).norm() / emu.float().norm().clamp_min(1e-30)).item()
    assert rel <= 5e-3, f"vs emu on the same bytes: relative L2 {rel:.3g}"


def _query_for(cache):
    return cache if cache in (torch.float16, torch.bfloat16) else torch.bfloat16


@gpu
@pytest.mark.parametrize("head_size", (64, 80, 96, 112, 128, 192, 256))
@pytest.mark.parametrize("cache", (torch.float16, torch.bfloat16, *FP8_CACHES), ids=str)
def test_every_cache_and_head_size(cache, head_size):
    _check(make_case(seq_lens=[1, 0, 33, 16, 129, 300], head_size=head_size, cache_dtype=cache,
                     query_dtype=_query_for(cache), device="cuda", seed=head_size))


@gpu
@pytest.mark.parametrize("query", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("cache", FP8_CACHES, ids=str)
def test_fp8_with_both_query_dtypes(cache, query):
    _check(make_case(seq_lens=[77, 5, 512], cache_dtype=cache, query_dtype=query, head_size=128, device="cuda"))


@gpu
@pytest.mark.parametrize("block_size", (8, 16, 32, 64, 128, 256))
def test_block_sizes(block_size):
    lens = [1, block_size, 2 * block_size + 3, 700]
    _check(make_case(seq_lens=lens, block_size=block_size, head_size=128, device="cuda", seed=block_size))


@gpu
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 8), (64, 8), (16, 1), (32, 1), (40, 2), (96, 3)],
                         ids=str)
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_gqa_ratios(heads, kv_heads, cache):
    _check(make_case(seq_lens=[3, 200, 64], num_heads=heads, num_kv_heads=kv_heads, head_size=128,
                     cache_dtype=cache, query_dtype=_query_for(cache), device="cuda"))


@gpu
@pytest.mark.parametrize("head_size", (64, 128, 256))
@pytest.mark.parametrize("cache", FP8_CACHES, ids=str)
def test_fp8_head_tiles_of_16(cache, head_size, monkeypatch):
    """FP8 GQA 16: one CTA serves both 8-head tiles (two steps a load round) up to head 128, one tile a
    CTA at head 256; plain and with every feature (the kernel without the plain path), one-pass and
    split-K; and the one-tile-a-CTA kernel the same calls take when HEAD_TILE says 8."""
    from hal.kernelpacks.cuda import launch
    assert launch.head_tile(1, head_size) == (16 if head_size <= 128 else 8)
    every = dict(alibi_slopes=alibi_slopes(32), logits_soft_cap=4.0, sliding_window=1300)
    for kw in ({}, every):
        case = make_case(seq_lens=[0, 1, 18, 130, 5000], num_heads=32, num_kv_heads=2, head_size=head_size,
                         cache_dtype=cache, query_dtype=_query_for(cache), per_head_scales=bool(kw),
                         device="cuda", seed=head_size, **kw)
        _check(case, max_seq_len=5000)
        with monkeypatch.context() as m:
            m.setattr(launch, "HEAD_TILE", {1: 8, 2: 16})
            _check(case, max_seq_len=5000)


@gpu
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("cache", (*FP8_CACHES, torch.float16), ids=str)
def test_features(feature, cache):
    _check(make_case(seq_lens=[0, 1, 18, 19, 20, 130, 1000], cache_dtype=cache, query_dtype=_query_for(cache),
                     per_head_scales=True, head_size=64, device="cuda", **FEATURES[feature]))


@gpu
@pytest.mark.parametrize("scales", ["float", "tensor0d", "per_head"])
def test_scale_forms(scales):
    _check(make_case(seq_lens=[40, 3, 90], num_kv_heads=4, num_heads=16, head_size=128, device="cuda",
                     per_head_scales=scales == "per_head", scale_as_tensor=scales == "tensor0d"))


@gpu
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_split_k_long_contexts_and_windows(cache):
    case = make_case(seq_lens=[20000, 1, 5000, 8191, 0], head_size=128, block_size=64, cache_dtype=cache,
                     query_dtype=_query_for(cache), device="cuda")
    _check(case, max_seq_len=20000)
    case.kwargs = {"sliding_window": 3000}
    _check(case)


WARP_ROW_CASES = {
    # every cache kind, several head sizes; 7 rows (not a multiple of the CTA's 4 warps)
    "f16-h80": dict(seq_lens=[1, 0, 33, 129, 300, 16, 5], num_kv_heads=1, num_heads=4, head_size=80,
                    cache_dtype=torch.float16),
    "bf16-h128": dict(seq_lens=[7, 700, 0], num_kv_heads=3, num_heads=12, cache_dtype=torch.bfloat16),
    "e4m3-h64-block8": dict(seq_lens=[1, 19, 300, 8], block_size=8, head_size=64),
    "e5m2-h256": dict(seq_lens=[45, 512, 2], head_size=256, cache_dtype=torch.float8_e5m2),
    # two 8-head tiles, a warp each (FP8 GQA 16 takes 8-head tiles where they get warp rows)
    "e4m3-gqa16": dict(seq_lens=[90, 3], num_kv_heads=2, num_heads=32),
    "e4m3-features": dict(seq_lens=[0, 1, 18, 130, 1000], head_size=64, per_head_scales=True, **FEATURES["all"]),
}


def _spy_warp_rows(monkeypatch):
    """The warp_rows argument of every decode launch (argument 36 of _C.paged_attention: launch.py)."""
    from hal.kernelpacks.cuda import launch
    seen, real = [], launch._C

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def paged_attention(self, *args):
            seen.append(args[36])
            return real.paged_attention(*args)

    monkeypatch.setattr(launch, "_C", Spy())
    return seen


def _warp_row_case(name):
    kw = dict(WARP_ROW_CASES[name])
    kw.setdefault("head_size", 128)
    kw.setdefault("cache_dtype", torch.float8_e4m3fn)
    kw["query_dtype"] = _query_for(kw["cache_dtype"])
    return make_case(device="cuda", **kw)


@gpu
@pytest.mark.parametrize("name", WARP_ROW_CASES)
def test_warp_rows(name, monkeypatch):
    """A warp per (sequence, KV head): forced by a tuning entry whose target every call reaches."""
    from hal.kernelpacks.cuda import tuning
    case = _warp_row_case(name)
    seen = _spy_warp_rows(monkeypatch)
    tuning.set_override({"ctas_per_sm": 1, "waves": 1e-6, "min_partition": 1024, "warp_rows": 1})
    try:
        _check(case)
    finally:
        tuning.set_override(None)
    assert seen and all(seen), f"the warp-row kernel did not run: {seen}"


@gpu
@pytest.mark.parametrize("window", (None, 2500))
def test_warp_rows_over_a_split_context(window, monkeypatch):
    """The warp-row kernel's split-K path (partials merged by reduce.cu), reached by a forced plan:
    the planner asks for warp rows on one-pass calls only."""
    from hal.kernelpacks.cuda import launch
    case = make_case(seq_lens=[9000, 5, 3000, 1024], num_kv_heads=2, num_heads=32, head_size=128,
                     cache_dtype=torch.float8_e4m3fn, query_dtype=torch.bfloat16, device="cuda")
    if window:
        case.kwargs = {"sliding_window": window}
    seen = _spy_warp_rows(monkeypatch)
    monkeypatch.setattr(launch, "plan", lambda *a, **k: (1024, 9, True))
    _check(case, max_seq_len=9000)
    assert seen and all(seen)


def _nhd(c: torch.Tensor) -> torch.Tensor:
    """The HND view of an NHD copy of ``c``: what an engine holding [blocks, block_size, kv_heads, d] passes."""
    return c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


@gpu
@pytest.mark.parametrize("head_size", (64, 128, 256))
@pytest.mark.parametrize("cache", (torch.bfloat16, *FP8_CACHES), ids=str)
def test_nhd_cache_views_give_the_hnd_bits(cache, head_size):
    """Decode over NHD views (token stride kv_heads x d): served by the cuda pack (no fallback), bit for
    bit the HND cache's result, one-pass and split-K, GQA 4 and 16 (one and two head tiles)."""
    for heads, kv, lens in ((16, 4, [1, 0, 33, 129, 300]), (32, 2, [9000, 77])):
        case = make_case(seq_lens=lens, num_heads=heads, num_kv_heads=kv, head_size=head_size, cache_dtype=cache,
                         query_dtype=_query_for(cache), device="cuda", seed=head_size + heads)
        kc, vc = _nhd(case.key_cache), _nhd(case.value_cache)
        assert not kc.is_contiguous()
        d = hal.explain(case.query, kc, vc, case.block_tables, case.seq_lens, k_scale=case.k_scale,
                        v_scale=case.v_scale)
        assert d.pack.NAME == "cuda" and not d.fallback, d.text()
        dense = _run(case)
        out = case.poisoned_out()
        hal.paged_attention(case.query, kc, vc, case.block_tables, case.seq_lens, k_scale=case.k_scale,
                            v_scale=case.v_scale, out=out, pack="cuda")
        assert torch.equal(out, dense)
        ok, msg = gpu_tolerance_ok(out, case.reference())
        assert ok, msg


@gpu
@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn), ids=str)
def test_cache_kv_into_nhd_views(cache):
    g = torch.Generator().manual_seed(8)
    nb, hkv, bs, d, t = 7, 4, 16, 128, 50
    base = torch.full((nb, bs, hkv, d), 0x33, dtype=torch.uint8).view(cache) if hal.fp8.is_fp8(cache) \
        else torch.full((nb, bs, hkv, d), 0.25, dtype=cache)
    k = (torch.randn(t, hkv, d, generator=g) * 3).cuda()
    v = torch.randn(t, hkv, d, generator=g).cuda()
    slots = torch.randperm(nb * bs, generator=g)[:t].cuda()
    got = []
    for pack in ("cuda", "emu"):
        kn, vn = base.clone().cuda(), base.clone().cuda()
        hal.cache_kv(k, v, kn.permute(0, 2, 1, 3), vn.permute(0, 2, 1, 3), slots, k_scale=0.02, v_scale=0.03,
                     pack=pack)
        got.append([x.view(torch.uint8 if hal.fp8.is_fp8(cache) else torch.int16) for x in (kn, vn)])
    assert all(torch.equal(a, b) for a, b in zip(*got))


@gpu
def test_shared_prefix_blocks():
    _check(make_case(seq_lens=[300, 290, 264, 281], share_prefix=True, head_size=128, device="cuda"))


@gpu
@pytest.mark.parametrize("cache", (*FP8_CACHES, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("src", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_cache_kv_bytes_match_the_definition(cache, src):
    import math
    g = torch.Generator().manual_seed(7)
    nb, hkv, bs, d = 9, 3, 16, 128
    kc = torch.full((nb, hkv, bs, d), 0x11, dtype=torch.uint8).view(cache) if hal.fp8.is_fp8(cache) \
        else torch.full((nb, hkv, bs, d), 0.5, dtype=cache)
    kc = kc.cuda()
    vc = kc.clone()
    t = 40
    k = (torch.randn(t, hkv, d, generator=g) * 300).to(src)
    v = (torch.randn(t, hkv, d, generator=g) * 3).to(src)
    k[0, 0, :5] = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-30]).to(src)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[3] = -1
    ks = torch.tensor([0.5, 1.5, 0.75]).cuda()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    hal.cache_kv(k.cuda(), v.cuda(), kc, vc, slots.cuda(), k_scale=ks, v_scale=0.01, pack="cuda")
    # emu writes hal.fp8.encode_bytes(x / scale) (or the RNE cast for 16-bit caches): the definition
    hal.cache_kv(k.cuda(), v.cuda(), kc_ref, vc_ref, slots.cuda(), k_scale=ks, v_scale=0.01, pack="emu")
    raw = torch.uint8 if hal.fp8.is_fp8(cache) else torch.int16
    assert torch.equal(kc.view(raw), kc_ref.view(raw))
    assert torch.equal(vc.view(raw), vc_ref.view(raw))


@gpu
def test_cuda_graph_replay_matches_eager():
    case = make_case(seq_lens=[700, 5, 2000], head_size=128, device="cuda", per_head_scales=True)
    new_k = torch.randn(3, 2, 128, device="cuda")
    new_v = torch.randn_like(new_k)
    slots = torch.tensor([int(case.block_tables[0, 43]) * 16 + 12, -1, int(case.block_tables[2, 125]) * 16],
                         device="cuda")
    out = torch.empty_like(case.query)
    kc, vc = case.key_cache.clone(), case.value_cache.clone()

    def step():
        hal.cache_kv(new_k, new_v, kc, vc, slots, k_scale=case.k_scale, v_scale=case.v_scale)
        hal.paged_attention(case.query, kc, vc, case.block_tables, case.seq_lens, k_scale=case.k_scale,
                            v_scale=case.v_scale, out=out, max_seq_len=2000)

    step()
    torch.cuda.synchronize()
    eager = out.clone()
    kc.copy_(case.key_cache), vc.copy_(case.value_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    kc.copy_(case.key_cache), vc.copy_(case.value_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    case = make_case(seq_lens=[100, 37], head_size=128, device="cuda")
    f = torch.compile(lambda q: hal.paged_attention(q, case.key_cache, case.value_cache, case.block_tables,
                                                    case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale),
                      fullgraph=True)
    got = f(case.query)
    ok, msg = gpu_tolerance_ok(got, case.reference())
    assert ok, msg


@gpu
@pytest.mark.slow
def test_cache_over_4_gib_and_a_million_tokens():
    """64-bit offsets: a 4.3 GiB FP8 cache whose last blocks are used, and one 1M-token sequence."""
    hkv, bs, d = 8, 64, 128
    nb = (4 * 2**30 + 2**28) // (hkv * bs * d)          # > 4 GiB per cache
    kc = torch.empty((nb, hkv, bs, d), dtype=torch.float8_e4m3fn, device="cuda")
    vc = torch.empty_like(kc)
    g = torch.Generator(device="cuda").manual_seed(0)
    L = 1 << 20
    used = L // bs
    blocks = torch.arange(nb - used, nb, device="cuda", dtype=torch.int32)   # the top of the allocation
    kc.view(torch.uint8)[blocks.long()] = torch.randint(0, 0x7e, (used, hkv, bs, d), generator=g, device="cuda",
                                                        dtype=torch.uint8)
    vc.view(torch.uint8)[blocks.long()] = torch.randint(0, 0x7e, (used, hkv, bs, d), generator=g, device="cuda",
                                                        dtype=torch.uint8)
    q = torch.randn((1, 32, d), device="cuda", dtype=torch.bfloat16, generator=g)
    tables = blocks.view(1, -1)
    lens = torch.tensor([L], dtype=torch.int32, device="cuda")
    out = hal.paged_attention(q, kc, vc, tables, lens, k_scale=0.01, v_scale=0.01, max_seq_len=L, pack="cuda")
    emu = hal.paged_attention(q, kc, vc, tables, lens, k_scale=0.01, v_scale=0.01, max_seq_len=L, pack="emu")
    rel = ((out.float() - emu.float()).norm() / emu.float().norm()).item()
    assert torch.isfinite(out.float()).all() and rel <= 5e-3, rel


NAN_PLANS = {  # which kernel path a NaN must cross: one CTA, warp rows, split-K with the reduce kernel
    "one_pass": (dict(seq_lens=[37, 0, 21, 5]), None),
    "warp_rows": (dict(seq_lens=[37, 0, 21, 5]), {"ctas_per_sm": 1, "waves": 1e-6, "min_partition": 1024,
                                                   "warp_rows": 1}),
    "split": (dict(seq_lens=[3000, 0, 2100, 5]), None),
}


@gpu
@pytest.mark.parametrize("plan", NAN_PLANS)
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_nan_inputs_give_nan_rows_not_zeros(cache, plan):
    """A NaN in the query, a read key or an ALiBi slope gives NaN rows (the documented formula), on
    every kernel path; only an empty sequence gives zeros. Unread cache bytes are NaN/inf too."""
    from hal.kernelpacks.cuda import tuning
    lens, override = NAN_PLANS[plan]
    tuning.set_override(override)
    try:
        for where, (case, rows) in nan_input_cases(cache_dtype=cache, query_dtype=_query_for(cache), head_size=128,
                                                   device="cuda", **lens).items():
            ok, msg = nan_rows_ok(_run(case), case, rows, gpu_tolerance_ok)
            assert ok, f"{where}: {msg}"
    finally:
        tuning.set_override(None)
