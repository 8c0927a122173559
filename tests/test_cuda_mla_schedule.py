"""The cuda pack's balanced split of MLA decode (packs/cuda/csrc/mla_schedule.cu, launch.MLA_SCHEDULE =
"device"): a one-CTA launch cuts each row tile by its own length from the device's seq_lens and lists the
partitions longest first; the decode kernels take a list entry a CTA (mla_item.cuh) and the reduce
merges the split tiles.

Checked on an NVIDIA GPU (marker ``cuda``): the list read back from the workspace (every partition of
every row tile exactly once, adjacent and in order, longest first, disjoint partial slots, the rest of
the list empty), the output against the float64 reference (tolerance: tests/test_cuda_mla.py's,
relative L2 <= 5e-3) with every kernel, and a CUDA graph replayed after the lengths were rewritten in
place (the schedule follows them: it is computed on the device at every run).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from cases import gpu_tolerance_ok

import hal

CUDA_PRESENT = importlib.util.find_spec("hal.kernelpacks.cuda") is not None
pytestmark = [pytest.mark.skipif(not CUDA_PRESENT, reason="the cuda pack is not in this tree"), pytest.mark.cuda]

# (seq_lens, q_lens or None, heads): ragged batches over 16-, 32- and 64-row tiles, tiles without rows
# (48 heads: a sequence of one query row has rows in the first of two 64-row tiles), empty sequences, two long
# sequences of one length, and a uniform batch (which must keep one partition size for every tile)
SCHEDULE_CASES = {
    "ragged-16-heads": ([8192, 300, 5000, 64, 7000, 2500, 1, 4096] * 4, None, 16),
    "ragged-128-heads": ([6000, 257, 3000, 1200, 5999, 64], None, 128),
    "speculative-padding": ([3000, 700, 9, 4000], [2, 1, 2, 1], 48),
    "32-rows": ([4000, 100, 2000], [2, 2, 1], 16),
    "empty-sequences": ([0, 3000, 0, 1], [0, 3, 0, 1], 16),
    "two-long": ([40000, 40000], None, 16),
    "uniform": ([2048] * 40, None, 16),
}


def _query_for(cache):
    return cache if cache in (torch.float16, torch.bfloat16) else torch.bfloat16


def _run_capturing(case, monkeypatch, kernel="auto", schedule="device"):
    """(output, workspace of the launch): the cuda pack's call with launch._mla_decode_args wrapped."""
    from test_cuda_mla import _call

    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", kernel)
    monkeypatch.setattr(launch, "MLA_SCHEDULE", schedule)
    real, seen = launch._mla_decode_args, []

    def spy(*a, **k):
        built = real(*a, **k)
        seen.append(built)
        return built
    monkeypatch.setattr(launch, "_mla_decode_args", spy)
    out = _call(case, "cuda", multi=True)
    torch.cuda.synchronize()
    return out, seen[-1]


@pytest.mark.parametrize("name", SCHEDULE_CASES)
def test_schedule_lists_every_partition_once(name, monkeypatch):
    from test_cuda_mla import _ref
    from test_emu_mla import make_mla

    from hal.kernelpacks.cuda import launch
    lens, q_lens, heads = SCHEDULE_CASES[name]
    case = make_mla(lens, q_lens, heads=heads, block_size=64, seed=len(name))
    out, (args, workspace) = _run_capturing(case, monkeypatch)
    ok, msg = gpu_tolerance_ok(out, _ref(case))
    assert ok, msg
    assert len(workspace) >= 4, "the balanced split did not run"
    work, tile_parts = workspace[2].cpu().tolist(), workspace[3].cpu().tolist()
    sms, cap, slots = args[-4], args[-3], args[-2]
    row_tiles = args[-7]
    tile_rows = 16 * args[1]
    q_lens = q_lens or [1] * len(lens)
    assert len(work) == cap and len(tile_parts) == len(lens) * row_tiles

    expected, used_slots = [], []
    for s, L in enumerate(lens):
        for tile in range(row_tiles):
            first, parts, size, _ = tile_parts[s * row_tiles + tile]
            if tile * tile_rows >= q_lens[s] * heads:
                assert (first, parts, size) == (0, 0, 0), (s, tile)
                continue
            assert parts >= 1 and size % 64 == 0, (s, tile, parts, size)
            if parts > 1:
                assert size >= launch.MLA_MIN_PARTITION and parts == math.ceil(L / size), (s, tile, parts, size, L)
                used_slots.append((first, first + parts))
            else:
                assert size >= L, (s, tile, size, L)
            expected += [(s, tile, j) for j in range(parts)]
    items = len(expected)
    assert items <= cap
    listed = [tuple(w[:3]) for w in work[:items]]
    assert sorted(listed) == sorted(expected), "every partition exactly once"
    assert all(w[0] == -1 for w in work[items:]), "the rest of the list is empty"
    for i, (s, tile, j) in enumerate(listed):  # a tile's partitions adjacent and in order
        if j > 0:
            assert listed[i - 1] == (s, tile, j - 1), (i, listed[i - 1], (s, tile, j))
    sizes = [tile_parts[s * row_tiles + tile][2] for s, tile, _ in listed]
    assert sizes == sorted(sizes, reverse=True), "longest partitions first"
    used_slots.sort()
    assert all(a[1] <= b[0] for a, b in zip(used_slots, used_slots[1:])), "disjoint partial slots"
    assert all(0 <= a and b <= slots for a, b in used_slots)
    if name == "uniform":
        assert len({tuple(tp[1:3]) for tp in tile_parts}) == 1, tile_parts
    if name == "two-long":  # cut to about fill the SMs once
        assert sms // 4 <= tile_parts[0][1] <= sms // 2 and tile_parts[0][1:] == tile_parts[1][1:], (tile_parts, sms)


@pytest.mark.parametrize("kernel", ("mma", "wgmma", "narrow"))
@pytest.mark.parametrize("cache", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_balanced_and_uniform_splits_agree(cache, kernel, monkeypatch):
    """Both splits against float64 with each kernel where its tiles allow (mla.cuh takes the rest), on a
    ragged batch whose tiles the balanced split cuts unevenly."""
    from test_cuda_mla import _ref
    from test_emu_mla import make_mla
    heads = 16 if kernel == "narrow" else 128
    q = _query_for(cache)
    case = make_mla([7000, 300, 4100, 2, 6500, 1500], heads=heads, ckv_dtype=cache, kpe_dtype=q, query_dtype=q,
                    block_size=32, seed=5)
    for schedule in ("device", "uniform"):
        out, _ = _run_capturing(case, monkeypatch, kernel, schedule)
        ok, msg = gpu_tolerance_ok(out, _ref(case))
        assert ok, f"{schedule}: {msg}"


def test_graph_replay_follows_lengths_rewritten_in_place(monkeypatch):
    """A plan captured in a CUDA graph, then the step's lengths written into its seq_lens: the replay
    schedules the new lengths (a uniform split planned on the host could not)."""
    from test_cuda_mla import _ref, _to
    from test_emu_mla import make_mla

    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_SCHEDULE", "device")
    lens_a, lens_b = [8000, 100, 3000, 4000], [100, 8000, 5000, 1]
    case = make_mla([8000] * 4, heads=16, block_size=64, seed=3)  # tables cover 8000 tokens of each
    c = _to(case)
    c["seq_lens"].copy_(torch.tensor(lens_a, dtype=torch.int32))
    args = (c["q_nope"], c["q_pe"], c["ckv_cache"], c["kpe_cache"], c["block_tables"], c["seq_lens"])
    kw = {"scale": c["scale"], "ckv_scale": c["ckv_scale"], "kpe_scale": c["kpe_scale"], "max_seq_len": 8000}
    plan = hal.plan("mla_decode", *args, pack="cuda", **kw)
    out = torch.full_like(c["q_nope"], float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*args[:4], ckv_scale=c["ckv_scale"], kpe_scale=c["kpe_scale"], out=out)
    for lens in (lens_a, lens_b, lens_a):
        c["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_case = dict(case, seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=None)
        ok, msg = gpu_tolerance_ok(out, _ref(ref_case, multi=False))
        assert ok, f"{lens}: {msg}"
        assert torch.equal(out, hal.mla_decode(*args, **kw)), lens
