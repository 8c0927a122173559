"""The cuda pack's multi-token paged attention and its mixed batches (the one-row sequences of the same
call through the decode kernel and its split-K), on an NVIDIA sm89+ GPU (marker ``cuda``); the
declaration on any machine. The grid runs the kernel the tuning entry picks (on an H200: csrc/prefill_sm90.cuh,
wgmma, for head sizes 128 and 192 where the grid is at least half rows, csrc/prefill.cuh, mma.sync, for the
rest; elsewhere mma.sync);
``test_forced_wgmma_kernel`` forces csrc/prefill_sm90.cuh (launch.PREFILL_KERNEL = "wgmma") on the same
checks, and HAL_CUDA_PREFILL=wgmma / mma runs the whole grid on one kernel (tools/gpu_prefill.sh).

Data as everywhere (cases.make_varlen): fresh random values, every cache slot no row reads poisoned with
NaN / inf bytes, outputs poisoned with NaN, block-table entries past a sequence's blocks junk.
Each case is checked against the float64 reference of the same FP8 bytes (tests/reference.py; for
large shapes hal.reference on the GPU) and against the emu pack.

Tolerance: relative L2 <= 5e-3 (cases.GPU_REL_L2). The arithmetic: Q, K and V enter the MMAs exactly
(FP8 values are exact in fp16; a bf16 query over an FP8 cache is carried in fp16 with a power-of-two
scale from the CTA's absmax, exact but for bf16 values below fp16's normal range relative to that
absmax: < 2^-14 of it), P is rounded to the PV type (fp16 for fp16 and FP8 caches: 2^-11 a weight;
bf16 for a bf16 cache: 2^-8, ~1.1e-3 relative L2), the output to the query's type (bf16: ~1.1e-3),
fp32 accumulation and the online softmax's rescales ~1e-6: ~1.6e-3 in quadrature at worst.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import reference
import torch
from cases import FEATURES, GEOMETRIES, GPU_REL_L2, alibi_slopes, gpu_tolerance_ok, make_varlen

import hal
from hal import registry

CUDA_PRESENT = importlib.util.find_spec("hal.kernelpacks.cuda") is not None
pytestmark = pytest.mark.skipif(not CUDA_PRESENT, reason="the cuda pack is not in this tree")
gpu = pytest.mark.cuda
FP8_CACHES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHES = (torch.float16, torch.bfloat16, *FP8_CACHES)


def _support():
    return registry.by_name("cuda").SUPPORTS["paged_attention"]


def _query_for(cache):
    return cache if cache in (torch.float16, torch.bfloat16) else torch.bfloat16


# ---------------------------------------------------------------- any machine

def test_varlen_is_declared_with_every_cache_head_and_block_size():
    s = _support()
    assert "varlen" in s.features
    assert set(CACHES) <= s.cache_dtypes and s.max_gqa_ratio is None


# ---------------------------------------------------------------- on the GPU

def _args(case, key_cache=None, value_cache=None):
    return dict(query=case.query, key_cache=case.key_cache if key_cache is None else key_cache,
                value_cache=case.value_cache if value_cache is None else value_cache, block_tables=case.block_tables,
                seq_lens=case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale,
                query_start_loc=case.query_start_loc, causal=case.causal, **case.kwargs)


def _run(case, pack="cuda", **kw):
    out = torch.full_like(case.query, float("nan"))
    hal.paged_attention(**_args(case, kw.pop("key_cache", None), kw.pop("value_cache", None)), out=out, pack=pack,
                        **kw)
    return out


def _spy(monkeypatch) -> list[str]:
    """The names of the _C launchers a call runs, in order."""
    from hal.kernelpacks.cuda import launch
    seen, real = [], launch._C

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name in ("prefill", "paged_attention"):
                def wrapped(*a):
                    seen.append(name)
                    return fn(*a)
                return wrapped
            return fn

    monkeypatch.setattr(launch, "_C", Spy())
    return seen


def _check(case, ref="test", **kw):
    """cuda vs float64 and vs the emu pack on the same bytes; returns the output."""
    d = hal.explain(**_args(case))
    assert d.pack.NAME == "cuda" and not d.fallback, d.text()
    out = _run(case, **kw)
    want = case.reference() if ref == "test" else case.hal_reference().cpu().numpy()
    ok, msg = gpu_tolerance_ok(out, want)
    assert ok, f"vs float64: {msg}"
    emu = _run(case, pack="emu", **kw)
    rel = reference.relative_l2(out.double().cpu().numpy(), emu.double().cpu().numpy())
    assert rel <= GPU_REL_L2, f"vs emu on the same bytes: relative L2 {rel:.3g}"
    return out


def _varlen(lens, qls, **kw):
    kw.setdefault("head_size", 128)
    kw.setdefault("cache_dtype", torch.float8_e4m3fn)
    kw.setdefault("query_dtype", _query_for(kw["cache_dtype"]))
    case = make_varlen(lens, qls, **kw)
    t = lambda x: x.cuda() if isinstance(x, torch.Tensor) else x  # noqa: E731
    fields = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc", "k_scale", "v_scale")
    return dataclasses.replace(case, **{f: t(getattr(case, f)) for f in fields},
                               kwargs={k: t(v) for k, v in case.kwargs.items()})


@gpu
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn), ids=str)
def test_geometries(geometry, cache, monkeypatch):
    """Prefill, chunked, mixed (empty, one-row and long sequences), speculative, decode only: the prefill
    kernel runs for sequences of 2+ rows, the decode kernel for the one-row ones, in one call."""
    seen = _spy(monkeypatch)
    _check(_varlen(*GEOMETRIES[geometry], cache_dtype=cache, seed=3))
    multi = max(GEOMETRIES[geometry][1]) > 1
    assert seen == (["prefill", "paged_attention"] if multi else ["paged_attention"]), seen


@gpu
@pytest.mark.parametrize("cache", CACHES, ids=str)
@pytest.mark.parametrize("query", (torch.float16, torch.bfloat16), ids=str)
def test_every_cache_and_query_dtype(cache, query):
    if cache in (torch.float16, torch.bfloat16) and query != cache:
        pytest.skip("a 16-bit cache is read with a query of its own dtype (the declaration)")
    _check(_varlen([40, 23, 1, 300], [17, 23, 1, 150], cache_dtype=cache, query_dtype=query, seed=5))


@gpu
@pytest.mark.parametrize("head_size", (64, 80, 96, 112, 128, 192, 256))
@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
def test_head_sizes(head_size, cache):
    _check(_varlen([150, 70, 1, 333], [150, 33, 1, 201], head_size=head_size, cache_dtype=cache, seed=head_size))


@gpu
@pytest.mark.parametrize("block_size", (8, 16, 32, 64, 128, 256))
def test_block_sizes(block_size):
    _check(_varlen([70, 3, 129, 600], [70, 3, 40, 257], block_size=block_size, cache_dtype=torch.float8_e5m2,
                   seed=block_size))


@gpu
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1), (12, 4), (16, 1), (17, 1), (34, 2), (64, 8), (24, 3)],
                         ids=str)
@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn), ids=str)
def test_gqa_ratios(heads, kv_heads, cache):
    """GQA 1 to 17: row tiles of 64 / 128 rows straddle tokens (no multiple of 3 or 17)."""
    _check(_varlen([90, 40, 1, 201], [90, 11, 1, 77], num_heads=heads, num_kv_heads=kv_heads, cache_dtype=cache,
                   seed=heads))


@gpu
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("cache", (torch.float16, torch.float8_e4m3fn), ids=str)
def test_features_with_per_head_scales(feature, cache):
    """ALiBi, soft-cap, windows 19 and 1, all together; per-head scales; the slots before every row's
    window poisoned (a row tile starts its keys at its first row's window)."""
    _check(_varlen(*GEOMETRIES["mixed"], cache_dtype=cache, per_head_scales=True, seed=6, **FEATURES[feature]))


WGMMA_CASES = {  # the sm_90a kernel forced: every geometry kind, features, windows, GQA 17, NHD views
    "mixed": (GEOMETRIES["mixed"], {}),
    "prefill": (GEOMETRIES["prefill"], {}),
    "chunked-gqa17": (GEOMETRIES["chunked"], dict(num_heads=17, num_kv_heads=1)),
    "speculative": (GEOMETRIES["speculative"], {}),
    "features": (GEOMETRIES["mixed"], dict(per_head_scales=True, **FEATURES["all"])),
    "window-1": (GEOMETRIES["mixed"], FEATURES["window_1"]),
    "not-causal": (([60, 33, 1, 250], [20, 33, 1, 130]), dict(causal=False)),
    "block-256": (([700, 3, 1290], [700, 3, 400]), dict(block_size=256)),
}


@gpu
@pytest.mark.parametrize("case", sorted(WGMMA_CASES))
@pytest.mark.parametrize("head_size", (64, 128, 192))
@pytest.mark.parametrize("cache", CACHES, ids=str)
def test_forced_wgmma_kernel(case, head_size, cache, monkeypatch):
    """launch.PREFILL_KERNEL = "wgmma": csrc/prefill_sm90.cuh on an sm_90 GPU (elsewhere the mma.sync kernel
    runs and this checks that), against float64 and emu like the default kernel."""
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "PREFILL_KERNEL", "wgmma")
    (lens, qls), kw = WGMMA_CASES[case]
    _check(_varlen(lens, qls, head_size=head_size, cache_dtype=cache, seed=head_size, **kw))


@gpu
def test_forced_wgmma_kernel_reads_nhd_views_bit_for_bit(monkeypatch):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "PREFILL_KERNEL", "wgmma")
    case = _varlen(*GEOMETRIES["mixed"], num_kv_heads=4, num_heads=16, seed=21)
    dense = _check(case)
    assert torch.equal(_run(case, key_cache=_nhd(case.key_cache), value_cache=_nhd(case.value_cache)), dense)


CUTE_CASES = {  # the CuTe kernel forced: the wgmma cases plus a long causal prefill (many 128-key steps,
    # the pipeline's buffers reused), a ragged batch and pages of 8 and 64
    **WGMMA_CASES,
    "long": (([2100, 1500], [2100, 700]), {}),
    "ragged": (([333, 1, 1029, 77, 512], [333, 1, 200, 77, 9]), dict(num_heads=32, num_kv_heads=8)),
    "block-8": (([300, 129], [300, 40]), dict(block_size=8)),
    "block-64": (([1000, 257], [513, 257]), dict(block_size=64)),
}


@gpu
@pytest.mark.parametrize("case", sorted(CUTE_CASES))
@pytest.mark.parametrize("head_size", (64, 128))
@pytest.mark.parametrize("cache", CACHES, ids=str)
def test_forced_cute_kernel(case, head_size, cache, monkeypatch):
    """launch.PREFILL_KERNEL = "cute": csrc/prefill_cute.cuh on an sm_90 GPU with the module built with
    CUTLASS (elsewhere prefill_sm90.cuh or mma.sync runs and this checks that)."""
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "PREFILL_KERNEL", "cute")
    (lens, qls), kw = CUTE_CASES[case]
    _check(_varlen(lens, qls, head_size=head_size, cache_dtype=cache, seed=head_size + 1, **kw))


@gpu
@pytest.mark.parametrize("kernel", ("cute", "wgmma"))
def test_forced_sm90_kernels_replay_in_a_cuda_graph(kernel, monkeypatch):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "PREFILL_KERNEL", kernel)
    test_cuda_graph_replay_matches_eager(cache=torch.bfloat16)
    test_cuda_graph_replay_matches_eager(cache=torch.float8_e4m3fn)


@gpu
def test_features_at_head_256_and_long_windows():
    _check(_varlen([700, 300, 1], [600, 300, 1], head_size=256, per_head_scales=True, sliding_window=200,
                   alibi_slopes=alibi_slopes(8), logits_soft_cap=30.0, seed=7))


@gpu
@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn), ids=str)
def test_not_causal(cache):
    _check(_varlen([60, 33, 1, 250], [20, 33, 1, 130], causal=False, cache_dtype=cache, seed=8))


@gpu
def test_alibi_slopes_of_the_query_heads():
    """ALiBi's slope is the query head's (kv head x G + g), not the row's."""
    _check(_varlen([50, 20, 131], [50, 20, 131], num_heads=12, num_kv_heads=3, cache_dtype=torch.bfloat16,
                   alibi_slopes=alibi_slopes(12), seed=9))


@gpu
def test_scale_forms():
    """Float scales and 0-d tensor scales; per-head scales are in the feature grid."""
    for kw in (dict(), dict(scale_as_tensor=True)):
        _check(_varlen([90, 33], [90, 7], num_heads=16, num_kv_heads=4, seed=10, **kw))


@gpu
def test_bf16_query_far_outside_fp16_range():
    """A bf16 query over an FP8 cache is carried in fp16 under a power-of-two scale: magnitudes of 1e6
    and 1e-6 (outside fp16's range either way) keep their accuracy."""
    for mag in (1e6, 1e-6):
        case = _varlen([130, 64], [130, 64], seed=11)
        case.query = case.query * mag
        _check(case)


def _nhd(c: torch.Tensor) -> torch.Tensor:
    return c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


@gpu
@pytest.mark.parametrize("head_size", (64, 128, 256))
@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn), ids=str)
def test_nhd_cache_views_give_the_hnd_bits(cache, head_size):
    """An NHD cache passed as its permute(0, 2, 1, 3) view: served by cuda, bit for bit the HND result."""
    case = _varlen(*GEOMETRIES["mixed"], num_kv_heads=4, num_heads=16, head_size=head_size, cache_dtype=cache, seed=12)
    kc, vc = _nhd(case.key_cache), _nhd(case.value_cache)
    d = hal.explain(**_args(case, kc, vc))
    assert d.pack.NAME == "cuda" and not d.fallback and "strided_cache" in d.key.features, d.text()
    dense = _check(case)
    assert torch.equal(_run(case, key_cache=kc, value_cache=vc), dense)


@gpu
def test_misaligned_query_and_output_rows_are_served():
    """Query / output views whose rows are off 16 bytes (a slice of a fused QKV): copied to aligned rows."""
    case = _varlen([90, 33, 1], [90, 33, 1], head_size=64, seed=13)
    wide = torch.randn(case.query.shape[0], case.query.shape[1], 72, device="cuda").to(case.query.dtype)
    wide[..., 4:68] = case.query
    q = wide[..., 4:68]
    assert q.data_ptr() % 16
    want = _run(case)
    out_wide = torch.full_like(wide, float("nan"))
    out = out_wide[..., 4:68]
    hal.paged_attention(**{**_args(case), "query": q}, out=out, pack="cuda")
    assert torch.equal(out, want)
    assert torch.isnan(out_wide[..., :4]).all() and torch.isnan(out_wide[..., 68:]).all()


@gpu
def test_cuda_graph_replay_matches_eager(cache=torch.float8_e4m3fn):
    case = _varlen(*GEOMETRIES["mixed"], per_head_scales=True, seed=14, cache_dtype=cache)
    mql = int((case.query_start_loc[1:] - case.query_start_loc[:-1]).max())
    out = torch.empty_like(case.query)

    def step():
        hal.paged_attention(**_args(case), out=out, max_seq_len=300, max_query_len=mql)

    step()
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
def test_plan_runs_equal_the_one_shot_call():
    case = _varlen(*GEOMETRIES["mixed"], seed=15)
    want = _run(case)
    mql = int((case.query_start_loc[1:] - case.query_start_loc[:-1]).max())
    plan = hal.plan("paged_attention", case.query, case.key_cache, case.value_cache, case.block_tables,
                    case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale, query_start_loc=case.query_start_loc,
                    max_query_len=mql, max_seq_len=300)
    out = torch.full_like(case.query, float("nan"))
    plan.run(case.query, case.key_cache, case.value_cache, k_scale=case.k_scale, v_scale=case.v_scale, out=out)
    assert torch.equal(out, want)


@gpu
def test_prefill_of_8_sequences_of_2048_tokens():
    _check(_varlen([2048] * 8, [2048] * 8, num_heads=32, num_kv_heads=8, seed=16), ref="hal")


@gpu
@pytest.mark.slow
def test_128k_token_prefill():
    """One 131072-token prompt (2048 row tiles, offsets past 2^31 bytes in the score loop's rows): the
    whole output checked against emu, and its first, middle and last 256 rows against float64 (the
    same rows of shorter calls: a row's result depends only on its position and keys)."""
    L, n = 131072, 256
    case = _varlen([L], [L], num_heads=8, num_kv_heads=1, block_size=256, seed=17)
    out = _run(case)
    assert torch.isfinite(out.float()).all()
    for p0 in (0, L // 2 - n, L - n):
        sub = _varlen([p0 + n], [n], num_heads=8, num_kv_heads=1, block_size=256, seed=17)
        sub.key_cache, sub.value_cache, sub.block_tables = case.key_cache, case.value_cache, case.block_tables
        sub.k_scale, sub.v_scale = case.k_scale, case.v_scale
        sub.query = case.query[p0:p0 + n]
        ok, msg = gpu_tolerance_ok(out[p0:p0 + n], sub.hal_reference().cpu().numpy())
        assert ok, f"rows {p0}..{p0 + n}: {msg}"
        assert torch.equal(_run(sub), out[p0:p0 + n])


@gpu
@pytest.mark.slow
def test_cache_over_4_gib():
    """64-bit offsets: a 4.3 GiB FP8 cache whose top blocks hold the prefill's keys."""
    hkv, bs, d = 8, 64, 128
    nb = (4 * 2**30 + 2**28) // (hkv * bs * d)
    case = _varlen([3000, 1, 700], [3000, 1, 300], num_heads=32, num_kv_heads=hkv, block_size=bs, seed=18)
    big_k = torch.empty((nb, hkv, bs, d), dtype=case.key_cache.dtype, device="cuda")
    big_v = torch.empty_like(big_k)
    used = case.key_cache.shape[0]
    big_k[nb - used:] = case.key_cache
    big_v[nb - used:] = case.value_cache
    want = _run(case)
    case.block_tables = case.block_tables + (nb - used)
    case.key_cache, case.value_cache = big_k, big_v
    got = _run(case)
    assert torch.equal(got, want)
