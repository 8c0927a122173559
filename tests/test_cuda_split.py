"""The cuda pack's split of a long context into partitions. Their merge runs by a second launch
(reduce.cu) or in the decode kernel, by the last CTA of a row to finish (decode.cuh with merge.cuh; a
plan's default). Both run the same merge code, so their outputs must be equal bit for bit; each is
also checked against the float64 reference (tolerance: tests/test_cuda_pack.py's, relative L2 <=
5e-3). The resident-CTA count the split is sized by comes from the CUDA occupancy API. MLA decode
(mla.cuh, mla_reduce.cu) can merge the same two ways (the reduce launch unless asked: the in-kernel
merge measured slower there); its sm_90a kernel always by the reduce launch.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import hal
from cases import FEATURES, gpu_tolerance_ok, make_case, make_varlen, nan_input_cases, nan_rows_ok

CUDA_PRESENT = importlib.util.find_spec("hal.kernelpacks.cuda") is not None
pytestmark = pytest.mark.skipif(not CUDA_PRESENT, reason="the cuda pack is not in this tree")
gpu = pytest.mark.cuda

# Cut every context above 256 tokens into up to ~24 partitions (the H200's 132 SMs x 4 x 6 CTAs).
FINE_SPLIT = {"ctas_per_sm": 4, "waves": 6, "min_partition": 256, "warp_rows": 0}
COUNTERS = 13  # argument index of the row counters in _C.paged_attention's list (launch.py)


def _query_for(cache):
    return cache if cache in (torch.float16, torch.bfloat16) else torch.bfloat16


def _run(case, merge, monkeypatch, **kw):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "DECODE_MERGE", merge)
    out = case.poisoned_out()
    hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                        k_scale=case.k_scale, v_scale=case.v_scale, out=out, pack="cuda", **case.kwargs, **kw)
    return out


@pytest.fixture
def fine_split():
    from hal.kernelpacks.cuda import tuning
    tuning.set_override(FINE_SPLIT)
    yield
    tuning.set_override(None)


MERGE_CASES = {
    # an empty sequence, a one-token one, odd lengths, one of 9 partitions
    "gqa4-h128": dict(seq_lens=[2049, 1, 0, 777, 5000], head_size=128, num_heads=16, num_kv_heads=4),
    # the window skips the first partitions; ALiBi and soft-cap (the kernel without the plain path)
    "features-h64": dict(seq_lens=[3000, 0, 1500, 19], head_size=64, per_head_scales=True, **FEATURES["all"]),
    "window-h256": dict(seq_lens=[4000, 600, 1], head_size=256, sliding_window=1300, block_size=64),
    # GQA 16: both 8-head tiles in one CTA (16 rows to merge; FP8 too at head 128)
    "gqa16-h128": dict(seq_lens=[1800, 3], head_size=128, num_heads=32, num_kv_heads=2),
}


@gpu
@pytest.mark.parametrize("name", MERGE_CASES)
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16), ids=str)
def test_in_kernel_merge_equals_the_reduce_launch(cache, name, fine_split, monkeypatch):
    case = make_case(cache_dtype=cache, query_dtype=_query_for(cache), device="cuda", seed=len(name),
                     **MERGE_CASES[name])
    by_reduce = _run(case, "reduce", monkeypatch)
    in_kernel = _run(case, "kernel", monkeypatch)
    ok, msg = gpu_tolerance_ok(in_kernel, case.reference())
    assert ok, msg
    assert torch.equal(in_kernel, by_reduce)
    again = _run(case, "kernel", monkeypatch)  # the counters were left zero for the next launch
    assert torch.equal(again, in_kernel)


@gpu
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_in_kernel_merge_in_a_mixed_batch(cache, fine_split, monkeypatch):
    """Sequences of several query rows are the prefill kernel's: their rows' CTAs never arrive."""
    case = make_varlen([3000, 1, 2777, 5, 0, 1300], [120, 1, 1, 5, 0, 1], num_heads=16, num_kv_heads=2,
                       head_size=128, cache_dtype=cache, query_dtype=_query_for(cache))
    t = lambda x: x.cuda() if isinstance(x, torch.Tensor) else x  # noqa: E731
    fields = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc", "k_scale", "v_scale")
    case = dataclasses.replace(case, **{f: t(getattr(case, f)) for f in fields})
    outs = {}
    for merge in ("reduce", "kernel"):
        from hal.kernelpacks.cuda import launch
        monkeypatch.setattr(launch, "DECODE_MERGE", merge)
        out = torch.full_like(case.query, float("nan"))
        hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                            query_start_loc=case.query_start_loc, max_query_len=120, k_scale=case.k_scale,
                            v_scale=case.v_scale, out=out, pack="cuda", **case.kwargs)
        outs[merge] = out
    ok, msg = gpu_tolerance_ok(outs["kernel"], case.reference())
    assert ok, msg
    assert torch.equal(outs["kernel"], outs["reduce"])


@gpu
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_in_kernel_merge_keeps_nan_rows(cache, fine_split, monkeypatch):
    for where, (case, rows) in nan_input_cases(cache_dtype=cache, query_dtype=_query_for(cache), head_size=128,
                                               device="cuda", seq_lens=[3000, 0, 2100, 5]).items():
        ok, msg = nan_rows_ok(_run(case, "kernel", monkeypatch), case, rows, gpu_tolerance_ok)
        assert ok, f"{where}: {msg}"


@gpu
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_a_plan_merges_in_the_kernel_layer_after_layer_and_in_a_graph(cache, monkeypatch):
    """A plan's runs (the shipped tuning: 3 short rows split the 20K context) reuse one set of
    counters; every run, eager or replayed from a CUDA graph, equals the one-shot call."""
    case = make_case(seq_lens=[20000, 7, 4097], head_size=128, block_size=64, cache_dtype=cache,
                     query_dtype=_query_for(cache), device="cuda", per_head_scales=True)
    from hal.kernelpacks.cuda import launch
    seen, real = [], launch._C

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def paged_attention(self, *args):
            seen.append(args[COUNTERS])
            return real.paged_attention(*args)

        def paged_attention_prepare(self, *args):  # a plan's launch: made once, run per layer
            seen.append(args[COUNTERS])
            return real.paged_attention_prepare(*args)

    monkeypatch.setattr(launch, "_C", Spy())
    one_shot = _run(case, "auto", monkeypatch, max_seq_len=20000)
    assert seen == [0]  # the one-shot call merges by the reduce launch
    plan = hal.plan("paged_attention", query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                    block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=case.k_scale,
                    v_scale=case.v_scale, max_seq_len=20000, pack="cuda")
    out = torch.empty_like(case.query)
    for _ in range(3):
        out.fill_(float("nan"))
        plan.run(case.query, case.key_cache, case.value_cache, k_scale=case.k_scale, v_scale=case.v_scale, out=out)
        assert torch.equal(out, one_shot)
    assert seen[-1] != 0  # the plan's launches brought counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.query, case.key_cache, case.value_cache, k_scale=case.k_scale, v_scale=case.v_scale, out=out)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, one_shot)


@gpu
def test_resident_ctas_per_sm_of_every_decode_kernel():
    from hal.kernelpacks.cuda import _C
    for kind in range(4):
        for d in _C.head_sizes():
            for two, rows in ((False, False), (True, False), (False, True)):
                n = _C.decode_ctas_per_sm(kind, d, two, rows)
                assert 1 <= n <= 16, (kind, d, two, rows, n)
        assert _C.decode_ctas_per_sm(kind, 72, False, False) == -1  # not compiled
    # 128 registers a thread for 4 CTAs of 128 threads (decode.cuh's LoopConfig): one FP8 tile at head 128
    assert _C.decode_ctas_per_sm(2, 128, False, False) == 4


# ---------------------------------------------------------------- MLA decode (mla.cuh, mla_reduce.cu)

# (seq_lens, q_lens or None, heads, block_size): 16-, 32- and 64-row tiles of the mma.sync kernel, row
# padding (20 heads x 2 tokens: 40 of 64 rows), empty sequences, contexts cut into up to ~40 partitions
MLA_MERGE_CASES = {
    "16-heads": ([5000, 1, 0, 2049], None, 16, 16),
    "32-rows-speculative": ([3000, 700, 9], [2, 1, 2], 16, 64),
    "64-rows-speculative-padding": ([2600, 1, 900], [2, 1, 2], 20, 32),
    "128-heads": ([4000, 3], None, 128, 64),
    "empty-sequences": ([0, 3000, 0], [0, 3, 0], 16, 16),
}


def _mla(case, merge, kernel, monkeypatch):
    from test_cuda_mla import _call

    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "DECODE_MERGE", merge)
    monkeypatch.setattr(launch, "MLA_KERNEL", kernel)
    return _call(case, "cuda", multi=True)


@gpu
@pytest.mark.parametrize("schedule", ("uniform", "device"))
@pytest.mark.parametrize("name", MLA_MERGE_CASES)
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16), ids=str)
def test_mla_in_kernel_merge_equals_the_reduce_launch(cache, name, schedule, monkeypatch):
    """Both splits of the context (launch.MLA_SCHEDULE: the uniform one planned on the host, the
    balanced work list of csrc/mla_schedule.cu), each merged both ways."""
    from test_cuda_mla import _ref
    from test_emu_mla import make_mla
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_SCHEDULE", schedule)
    lens, q_lens, heads, bs = MLA_MERGE_CASES[name]
    q = _query_for(cache)
    case = make_mla(lens, q_lens, heads=heads, ckv_dtype=cache, kpe_dtype=q, query_dtype=q, block_size=bs,
                    seed=len(name))
    by_reduce = _mla(case, "reduce", "mma", monkeypatch)
    in_kernel = _mla(case, "kernel", "mma", monkeypatch)
    ok, msg = gpu_tolerance_ok(in_kernel, _ref(case))
    assert ok, msg
    assert torch.equal(in_kernel, by_reduce)
    assert torch.equal(_mla(case, "kernel", "mma", monkeypatch), in_kernel)  # counters left zero
    if heads * max(q_lens or [1]) > 32:  # 64-row tiles: the sm_90a kernel merges by the reduce launch
        wg = _mla(case, "kernel", "wgmma", monkeypatch)
        ok, msg = gpu_tolerance_ok(wg, _ref(case))
        assert ok, msg
    if heads * max(q_lens or [1]) <= 16:  # 16-row tiles: the narrow kernel merges in the kernel too
        narrow = _mla(case, "kernel", "narrow", monkeypatch)
        ok, msg = gpu_tolerance_ok(narrow, _ref(case))
        assert ok, msg
        assert torch.equal(narrow, _mla(case, "reduce", "narrow", monkeypatch))
        assert torch.equal(_mla(case, "kernel", "narrow", monkeypatch), narrow)  # counters left zero


@gpu
@pytest.mark.parametrize("kernel", ("mma", "wgmma", "narrow"))
def test_mla_plan_runs_and_graph_replays_equal_the_one_shot_call(kernel, monkeypatch):
    from test_cuda_mla import _to
    from test_emu_mla import make_mla

    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", kernel)
    heads = 8 if kernel == "narrow" else 32  # the narrow kernel takes tiles of up to 16 rows
    c = _to(make_mla([6000, 41, 1000], [2, 1, 2], heads=heads, block_size=64, seed=11))
    args = (c["q_nope"], c["q_pe"], c["ckv_cache"], c["kpe_cache"], c["block_tables"], c["seq_lens"])
    kw = {"scale": c["scale"], "ckv_scale": c["ckv_scale"], "kpe_scale": c["kpe_scale"], "max_seq_len": 6000,
          "query_start_loc": c["query_start_loc"], "max_query_len": 2}
    one_shot = hal.mla_decode(*args, **kw)
    plan = hal.plan("mla_decode", *args, pack="cuda", **kw)
    out = torch.empty_like(one_shot)
    for _ in range(3):
        out.fill_(float("nan"))
        plan.run(*args[:4], ckv_scale=c["ckv_scale"], kpe_scale=c["kpe_scale"], out=out)
        assert torch.equal(out, one_shot)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*args[:4], ckv_scale=c["ckv_scale"], kpe_scale=c["kpe_scale"], out=out)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, one_shot)
