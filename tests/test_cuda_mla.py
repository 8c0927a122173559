"""The cuda pack's MLA decode and cache_mla kernels (packs/cuda/csrc/mla*.cu), on an NVIDIA sm89+ GPU
(marker ``cuda``): against the tests' float64 reference from the same cache bytes (tests/reference.py,
FP8 via ml_dtypes) and against the emu pack on the same bytes.

Data as in test_emu_mla: fresh random values, unread slots poisoned (NaN bytes), outputs poisoned with
NaN. Tolerance: relative L2 <= 5e-3 (cases.GPU_REL_L2): the kernel rounds the probabilities to 16 bits
before P V (2^-9 relative a weight for bf16, ~1e-3 in relative L2) and accumulates in fp32; the query
is exact (a bf16 query against an FP8 latent moves into fp16 by a power of two, exact in range).
"""

from __future__ import annotations

import pytest
import reference
import torch
from cases import GPU_REL_L2, gpu_tolerance_ok
from test_emu_mla import make_mla

import hal
from hal import fp8

pytestmark = pytest.mark.cuda
FP8_CACHES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _to(case, device="cuda"):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _call(case, pack, **kw):
    c = _to(case)
    out = torch.full(c["q_nope"].shape, float("nan"), dtype=c["q_nope"].dtype, device="cuda")
    multi = kw.pop("multi", True)
    hal.mla_decode(c["q_nope"], c["q_pe"], c["ckv_cache"], c["kpe_cache"], c["block_tables"], c["seq_lens"],
                   scale=c["scale"], ckv_scale=c["ckv_scale"], kpe_scale=c["kpe_scale"],
                   query_start_loc=c["query_start_loc"] if multi else None, out=out, pack=pack, **kw)
    return out


def _ref(case, multi=True):
    return reference.mla_decode(case["q_nope"], case["q_pe"], case["ckv_cache"], case["kpe_cache"],
                                case["block_tables"], case["seq_lens"], case["query_start_loc"] if multi else None,
                                scale=case["scale"], ckv_scale=case["ckv_scale"], kpe_scale=case["kpe_scale"])


def _check(case, multi=True, **kw):
    out = _call(case, "cuda", multi=multi, **kw)
    ok, msg = gpu_tolerance_ok(out, _ref(case, multi))
    assert ok, msg
    emu = _call(case, "emu", multi=multi, **kw).float()
    rel = ((out.float() - emu).norm() / emu.norm().clamp_min(1e-30)).item()
    assert rel <= GPU_REL_L2, f"vs emu on the same bytes: relative L2 {rel:.3g}"
    return out


def _query_for(cache):
    return cache if cache in (torch.float16, torch.bfloat16) else torch.bfloat16


def test_dispatch_picks_cuda():
    case = _to(make_mla([40, 17], heads=16))
    d = hal.explain(op="mla_decode", **{k: case[k] for k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache",
                                                                "block_tables", "seq_lens")},
                    scale=case["scale"], ckv_scale=case["ckv_scale"])
    assert d.pack.NAME == "cuda", d.text()


@pytest.mark.parametrize("heads", (1, 16, 20, 32, 64, 128))
@pytest.mark.parametrize("cache", (torch.float16, torch.bfloat16, *FP8_CACHES), ids=str)
def test_heads_and_caches(heads, cache):
    """Each row-tile kernel (16, 32, 64 rows; 128 heads: two tiles) on every latent kind, odd lengths."""
    q = _query_for(cache)
    _check(make_mla([77, 5, 300, 1], heads=heads, ckv_dtype=cache, kpe_dtype=q, query_dtype=q, seed=heads), multi=False)


@pytest.mark.parametrize("query", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("cache", FP8_CACHES, ids=str)
def test_fp8_latent_with_either_query(query, cache):
    _check(make_mla([129, 64, 3], heads=16, ckv_dtype=cache, kpe_dtype=query, query_dtype=query, seed=3), multi=False)


@pytest.mark.parametrize("block_size", (1, 2, 8, 16, 32, 64, 128, 256))
def test_block_sizes(block_size):
    _check(make_mla([333, 64, 1000, 17], heads=16, block_size=block_size, seed=block_size), multi=False)


@pytest.mark.parametrize("heads", (16, 128))
@pytest.mark.parametrize("q_lens", ([1, 2, 3, 4], [4, 4, 1], [2, 1, 3]), ids=str)
def test_speculative_rows(heads, q_lens):
    lens = [50, 200, 7, 64][:len(q_lens)]
    _check(make_mla(lens, q_lens, heads=heads, block_size=64, seed=len(q_lens) + heads))


@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn), ids=str)
def test_split_context_and_long_rows(cache):
    """Few sequences over long contexts take the split-K path (and the merge); one has length 1."""
    q = _query_for(cache)
    _check(make_mla([5000, 1, 2049], heads=128, ckv_dtype=cache, kpe_dtype=q, query_dtype=q, block_size=64,
                    seed=9), multi=False)
    _check(make_mla([20000], heads=16, ckv_dtype=cache, kpe_dtype=q, query_dtype=q, block_size=16, seed=10),
           multi=False)


def test_empty_sequence_gives_zeros():
    case = make_mla([0, 40, 0], [0, 2, 0], heads=16, block_size=16, seed=5)
    out = _check(case)
    assert out.shape[0] == 2


def test_combined_cache_views():
    """vLLM's layout: one [blocks, page, 576] bf16 allocation, ckv/kpe are views (strided tokens)."""
    case = make_mla([100, 37], heads=16, ckv_dtype=torch.bfloat16, kpe_dtype=torch.bfloat16, combined=True,
                    block_size=64, seed=4)
    assert not case["ckv_cache"].is_contiguous()
    _check(case, multi=False)


def test_fp8_latent_beside_bf16_rope_in_one_byte_buffer():
    """A combined byte allocation: 512 FP8 latent bytes + 64 bf16 rotary values per token."""
    case = make_mla([90, 31], heads=16, ckv_dtype=torch.float8_e4m3fn, kpe_dtype=torch.bfloat16, block_size=16,
                    seed=6)
    nb, bs = case["ckv_cache"].shape[:2]
    buf = torch.empty(nb, bs, 512 + 128, dtype=torch.uint8)
    buf[..., :512] = case["ckv_cache"].view(torch.uint8)
    buf[..., 512:] = case["kpe_cache"].view(torch.uint8)
    case["ckv_cache"] = buf[..., :512].view(torch.float8_e4m3fn)
    case["kpe_cache"] = buf[..., 512:].view(torch.bfloat16)
    _check(case, multi=False)


def test_nan_query_row_stays_nan_and_others_do_not():
    case = make_mla([40, 40], heads=16, seed=8)
    case["q_nope"][0, 3, 7] = float("nan")
    out = _call(case, "cuda", multi=False)
    assert torch.isnan(out[0, 3]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, 4]).all()


def test_device_scale_tensors():
    case = make_mla([70, 12], heads=16, seed=12)
    case["ckv_scale"] = torch.tensor(case["ckv_scale"], dtype=torch.float32)  # moved to the GPU by _to
    _check(case, multi=False)


def test_cuda_graph_replay_equals_eager():
    c = _to(make_mla([300, 41, 1000], heads=128, block_size=64, seed=11))
    args = (c["q_nope"], c["q_pe"], c["ckv_cache"], c["kpe_cache"], c["block_tables"], c["seq_lens"])
    kw = {"scale": c["scale"], "ckv_scale": c["ckv_scale"], "max_seq_len": 1000}
    eager = hal.mla_decode(*args, **kw)
    out = torch.empty_like(eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        hal.mla_decode(*args, out=out, **kw)  # warm (the first call sets the kernels' attributes)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hal.mla_decode(*args, out=out, **kw)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# launch.MLA_KERNEL = "wgmma": csrc/mla_sm90.cuh for 64-row tiles on an sm_90 GPU (elsewhere mla.cuh runs
# and these check that). Cases: (seq_lens, q_lens or None, heads, block_size); every one has 64-row tiles
# (more than 32 rows a sequence), odd lengths, and tokens past a tile's end.
WGMMA_MLA_CASES = {
    "128-heads": ([77, 5, 300, 1], None, 128, 16),
    "64-heads-page-64": ([333, 64, 1000, 17], None, 64, 64),
    "48-heads-one-tile-part-padding": ([129, 31], None, 48, 32),
    "speculative-16x4": ([50, 200, 7, 64], [1, 2, 3, 4], 16, 64),
    "speculative-128x3": ([50, 300, 9], [3, 1, 2], 128, 256),
    "page-1": ([70, 33], None, 128, 1),
    "split-long": ([5000, 1, 2049], None, 128, 64),
    "empty-sequences": ([0, 40, 0], [0, 3, 0], 32, 16),
}


@pytest.mark.parametrize("case", sorted(WGMMA_MLA_CASES))
@pytest.mark.parametrize("cache", (torch.float16, torch.bfloat16, *FP8_CACHES), ids=str)
def test_forced_wgmma_kernel(case, cache, monkeypatch):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", "wgmma")
    lens, q_lens, heads, bs = WGMMA_MLA_CASES[case]
    q = _query_for(cache)
    _check(make_mla(lens, q_lens, heads=heads, ckv_dtype=cache, kpe_dtype=q, query_dtype=q, block_size=bs,
                    seed=len(case)), multi=q_lens is not None)


@pytest.mark.parametrize("query", (torch.float16, torch.bfloat16), ids=str)
def test_forced_wgmma_kernel_fp8_latent_either_query_and_views(query, monkeypatch):
    """An FP8 latent with either query dtype, in one byte buffer beside its rope (strided rows), with a
    device scale."""
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", "wgmma")
    case = make_mla([90, 31, 257], heads=128, ckv_dtype=torch.float8_e4m3fn, kpe_dtype=query, query_dtype=query,
                    block_size=16, seed=13)
    nb, bs = case["ckv_cache"].shape[:2]
    buf = torch.empty(nb, bs, 512 + 128, dtype=torch.uint8)
    buf[..., :512] = case["ckv_cache"].view(torch.uint8)
    buf[..., 512:] = case["kpe_cache"].view(torch.uint8)
    case["ckv_cache"] = buf[..., :512].view(torch.float8_e4m3fn)
    case["kpe_cache"] = buf[..., 512:].view(query)
    case["ckv_scale"] = torch.tensor(case["ckv_scale"], dtype=torch.float32)
    _check(case, multi=False)


def test_forced_wgmma_kernel_graph_replay_equals_eager(monkeypatch):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", "wgmma")
    test_cuda_graph_replay_equals_eager()


# launch.MLA_KERNEL = "mma": csrc/mla.cuh's tile loads over every page class, for each row tile (16 rows:
# 64-token tiles; 32 rows: 64; 64 rows: 32): a tile in one page, or over several (its page ids read
# together, then a copy a row), and pages of fewer than 8 tokens; partial tiles at the sequences' ends.
@pytest.mark.parametrize("block_size", (1, 4, 8, 16, 32, 64))
@pytest.mark.parametrize("heads", (16, 32, 64))
@pytest.mark.parametrize("cache", (torch.bfloat16, torch.float8_e4m3fn), ids=str)
def test_forced_mma_kernel_pages(block_size, heads, cache, monkeypatch):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", "mma")
    q = _query_for(cache)
    _check(make_mla([77, 130, 5], heads=heads, ckv_dtype=cache, kpe_dtype=q, query_dtype=q, block_size=block_size,
                    seed=block_size + heads), multi=False)


# launch.MLA_KERNEL = "narrow": csrc/mla_narrow.cuh for 16-row tiles (up to 16 rows a sequence; every arch).
# Cases: (seq_lens, q_lens or None, heads, block_size): odd lengths and tokens past a tile's end, row
# padding (1 head; 5 heads x 3 tokens = 15 rows), every block size class of the tile loads (a tile in
# one page from its first row or from a later one, a page every 8-32 tokens, a lookup a token under 8),
# a context cut into partitions (merged by the reduce launch), empty sequences.
NARROW_MLA_CASES = {
    "16-heads": ([77, 5, 300, 1], None, 16, 16),
    "1-head": ([129, 31], None, 1, 32),
    "16-heads-page-64": ([333, 64, 1000, 17], None, 16, 64),
    "speculative-8x2": ([50, 200, 7, 64], [2, 1, 2, 2], 8, 64),
    "speculative-5x3-padding": ([50, 300, 9], [3, 1, 2], 5, 256),
    "page-1": ([70, 33], None, 16, 1),
    "page-8": ([70, 33], None, 16, 8),
    "split-long": ([20000, 1, 2049], None, 16, 64),
    "empty-sequences": ([0, 40, 0], [0, 3, 0], 4, 16),
}


@pytest.mark.parametrize("case", sorted(NARROW_MLA_CASES))
@pytest.mark.parametrize("cache", (torch.float16, torch.bfloat16, *FP8_CACHES), ids=str)
def test_forced_narrow_kernel(case, cache, monkeypatch):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", "narrow")
    lens, q_lens, heads, bs = NARROW_MLA_CASES[case]
    q = _query_for(cache)
    _check(make_mla(lens, q_lens, heads=heads, ckv_dtype=cache, kpe_dtype=q, query_dtype=q, block_size=bs,
                    seed=len(case) + 100), multi=q_lens is not None)


@pytest.mark.parametrize("query", (torch.float16, torch.bfloat16), ids=str)
def test_forced_narrow_kernel_fp8_latent_either_query_and_views(query, monkeypatch):
    """An FP8 latent with either query dtype, in one byte buffer beside its rope (strided rows), with a
    device scale; and a bf16 latent as a view of vLLM's combined 576-wide cache."""
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", "narrow")
    case = make_mla([90, 31, 257], heads=16, ckv_dtype=torch.float8_e4m3fn, kpe_dtype=query, query_dtype=query,
                    block_size=16, seed=14)
    nb, bs = case["ckv_cache"].shape[:2]
    buf = torch.empty(nb, bs, 512 + 128, dtype=torch.uint8)
    buf[..., :512] = case["ckv_cache"].view(torch.uint8)
    buf[..., 512:] = case["kpe_cache"].view(torch.uint8)
    case["ckv_cache"] = buf[..., :512].view(torch.float8_e4m3fn)
    case["kpe_cache"] = buf[..., 512:].view(query)
    case["ckv_scale"] = torch.tensor(case["ckv_scale"], dtype=torch.float32)
    _check(case, multi=False)
    test_combined_cache_views()


def test_forced_narrow_kernel_nan_query_row_and_graph_replay(monkeypatch):
    from hal.kernelpacks.cuda import launch
    monkeypatch.setattr(launch, "MLA_KERNEL", "narrow")
    test_nan_query_row_stays_nan_and_others_do_not()
    c = _to(make_mla([300, 41, 1000], heads=16, ckv_dtype=torch.float8_e4m3fn, block_size=64, seed=15))
    args = (c["q_nope"], c["q_pe"], c["ckv_cache"], c["kpe_cache"], c["block_tables"], c["seq_lens"])
    kw = {"scale": c["scale"], "ckv_scale": c["ckv_scale"], "max_seq_len": 1000}
    eager = hal.mla_decode(*args, **kw)
    out = torch.empty_like(eager)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hal.mla_decode(*args, out=out, **kw)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("cache", (torch.float16, torch.bfloat16, *FP8_CACHES), ids=str)
@pytest.mark.parametrize("source", (torch.float32, torch.bfloat16), ids=str)
def test_cache_mla_bytes_equal_encode(cache, source):
    """cache_mla on the GPU writes the bytes hal.fp8.encode_bytes defines (saturating, ties to even)
    into views of one combined cache; skipped slots are untouched."""
    g = torch.Generator().manual_seed(1)
    kv_c = (torch.randn(9, 512, generator=g) * 3).to(source)
    k_pe = (torch.randn(9, 64, generator=g) * 3).to(source)
    kv_c[0, :4] = torch.tensor([1e6, -1e6, float("nan"), 0.0]).to(source)
    kv = torch.full((4, 8, 576), 7, dtype=torch.uint8, device="cuda")
    view = kv.view(cache) if cache in FP8_CACHES else torch.zeros(4, 8, 576, dtype=cache, device="cuda")
    slots = torch.tensor([3, 9, -1, 20, 31, 0, 12, 13, 30], device="cuda")
    cs, ps = (0.05, 0.02) if cache in FP8_CACHES else (None, None)
    hal.cache_mla(kv_c.cuda(), k_pe.cuda(), view[..., :512], view[..., 512:], slots, ckv_scale=cs, kpe_scale=ps)
    got = view.reshape(32, 576).cpu()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for x, lo, hi, s in ((kv_c[t], 0, 512, cs), (k_pe[t], 512, 576, ps)):
            want = x.float() / (1.0 if s is None else s)
            if cache in FP8_CACHES:
                assert torch.equal(got[slot, lo:hi].view(torch.uint8), fp8.encode_bytes(want, cache)), (t, lo)
            else:
                torch.testing.assert_close(got[slot, lo:hi], want.to(cache), rtol=0, atol=0, equal_nan=True)
    written = {s for s in slots.tolist() if s >= 0}
    if cache in FP8_CACHES:  # the other slots keep their bytes
        untouched = [s for s in range(32) if s not in written]
        assert bool((got[untouched].view(torch.uint8) == 7).all())


def test_cache_mla_dispatches_to_cuda():
    kv = torch.zeros(2, 16, 576, dtype=torch.bfloat16, device="cuda")
    d = hal.explain(torch.zeros(3, 512, device="cuda"), torch.zeros(3, 64, device="cuda"), kv[..., :512],
                    kv[..., 512:], torch.tensor([0, 1, 2], device="cuda"), op="cache_mla")
    assert d.pack.NAME == "cuda", d.text()
