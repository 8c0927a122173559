"""The emu pack's Triton path for several query tokens per sequence (packs/emu/triton_prefill.py)
against the float64 reference (tests/reference.py::paged_attention_varlen), with cases.gpu_tolerance_ok:
relative L2 <= cases.GPU_REL_L2 (5e-3) for 16-bit queries (P rounded to 16 bits for PV, as in the decode
kernel), the element-wise float32 bound for float32 queries. ``out`` is NaN-poisoned before every call;
cache slots no row reads hold NaN/inf (make_varlen).

CPU: small cases under the Triton interpreter in ONE subprocess (TRITON_INTERPRET must be set before
triton is imported), 16-bit queries as float16: the interpreter's bfloat16 ``tl.dot`` multiplies raw
bits (the decode kernel fails there too), so bfloat16 queries are checked on GPUs only. An offline
compile for AMD gfx942 (and sm_80) with Triton's own backends, as docs/toolchain.md describes.
GPU (markers emu + gpu): the same checks on CUDA tensors, larger shapes (8 x 2048 prefill and a long
mixed batch against hal.reference's float64 on the GPU: the test reference takes minutes there) and
CUDA-graph capture/replay.
"""

from __future__ import annotations

import dataclasses
import math
import re

import interpreter
import numpy as np
import pytest
import torch
from cases import (
    FEATURES,
    FP8,
    GEOMETRIES,
    alibi_slopes,
    attention_call,
    gpu_tolerance_ok,
    make_varlen,
    poison_unread,
    read_slots_varlen,
    row_positions,
    set_cache_element,
)

try:
    import triton
except ImportError:  # the CPU tests skip; GPU tests skip without a GPU anyway
    triton = None

pytestmark = pytest.mark.emu
NO_TRITON = "triton is not installed"
F16 = torch.float16
CACHES = (*FP8, torch.bfloat16, torch.float16, torch.float32)


def _qd(cache_dtype):  # the query dtype a GPU test pairs with a cache dtype
    return {torch.float16: F16, torch.float32: torch.float32}.get(cache_dtype, torch.bfloat16)


def _modules():  # imported late: the interpreter subprocess sets TRITON_INTERPRET first
    from hal.kernelpacks.emu import triton_path, triton_prefill
    return triton_path, triton_prefill


def _on(case, device):
    t = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    fields = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc", "k_scale", "v_scale")
    return dataclasses.replace(case, **{f: t(getattr(case, f)) for f in fields},
                               kwargs={k: t(v) for k, v in case.kwargs.items()})


def varlen_call(out, case, *, max_query_len, max_seq_len, key_cache=None, value_cache=None):
    """An AttentionCall with query_start_loc, built directly (not validated); host bounds given."""
    q, kw = case.query, case.kwargs
    base = attention_call(out, q, case.key_cache if key_cache is None else key_cache,
                          case.value_cache if value_cache is None else value_cache, case.block_tables, case.seq_lens,
                          q.shape[-1] ** -0.5, case.k_scale, case.v_scale, kw.get("alibi_slopes"),
                          kw.get("logits_soft_cap"), kw.get("sliding_window"), max_seq_len)
    geom = dataclasses.replace(base.geometry, num_seqs=case.seq_lens.shape[0], total_q=q.shape[0])
    return dataclasses.replace(base, geometry=geom, query_start_loc=case.query_start_loc,
                               max_query_len=max_query_len, causal=case.causal)


def _bounds(case):
    qsl = case.query_start_loc.cpu()
    return int((qsl[1:] - qsl[:-1]).max()), int(case.seq_lens.cpu().max())  # host bounds, read from CPU tensors


def run(case, device, *, layout="hnd", max_query_len=None):
    """triton_prefill.paged_attention on ``case`` moved to ``device``; a NaN-poisoned ``out``."""
    _, tp = _modules()
    dev = _on(case, device)
    mql, msl = _bounds(case)
    kc, vc = dev.key_cache, dev.value_cache
    if layout == "nhd":  # an engine's NHD storage passed as its permute(0, 2, 1, 3) view
        kc, vc = (c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in (kc, vc))
    elif layout == "combined":  # one [blocks, 2, hkv, bs, d] allocation: strided blocks
        kv = torch.stack([kc, vc], dim=1)
        kc, vc = kv[:, 0], kv[:, 1]
    out = torch.full_like(dev.query, float("nan"))
    tp.paged_attention(varlen_call(out, dev, max_query_len=mql if max_query_len is None else max_query_len,
                                   max_seq_len=msl, key_cache=kc, value_cache=vc))
    return out


def check(device, lens, qls, *, layout="hnd", max_query_len=None, table_pad=0, ref="test", tiles=None,
          **kw) -> None:
    """``tiles`` replaces the tile table (rows, keys): many key tiles, query tiles taller than key
    tiles (rows that see no key of a tile under a window), diagonals and window edges inside tiles."""
    _, tp = _modules()
    case = make_varlen(lens, qls, **kw)
    if table_pad:  # junk columns past every sequence's blocks
        junk = torch.full((len(lens), table_pad), 10**6, dtype=torch.int32)
        case.block_tables = torch.cat([case.block_tables, junk], dim=1)
    saved = dict(tp.TILES)
    tp.TILES.update({k: tiles or v for k, v in tp.TILES.items()})
    try:
        out = run(case, device, layout=layout, max_query_len=max_query_len)
    finally:
        tp.TILES.update(saved)
    # hal.reference: vectorised float64 on the device, for shapes the test reference is too slow for
    want = case.reference() if ref == "test" else _on(case, device).hal_reference().cpu().numpy()
    ok, msg = gpu_tolerance_ok(out, want)
    assert ok, msg


def check_nan(device, where, cache_dtype) -> None:
    """A NaN in a query element: that (row, head). In a key at position j of sequence s (KV head
    1): that group's heads in the rows of s with p >= j, none before (causally). In a value element
    there: that element of those rows only (0 * NaN must not reach rows that mask j, inside a tile
    that crosses the diagonal). A NaN slope: that head in every row. q_len 0 and decode rows too.
    Queries: float16 under the interpreter, the cache's 16-bit type on GPUs (bfloat16 for FP8)."""
    query_dtype = F16 if device == "cpu" else _qd(cache_dtype)
    g, kw = 4, dict(alibi_slopes=alibi_slopes(8)) if where == "alibi" else {}
    case = make_varlen([80, 30, 9, 40], [60, 6, 0, 1], num_heads=8, num_kv_heads=2, cache_dtype=cache_dtype,
                       query_dtype=query_dtype, seed=21, **kw)
    expect = np.zeros(case.query.shape, dtype=bool)
    if where == "query":
        for r in (5, 61, 66):  # a long prefill row, a short chunk's row, the decode row
            case.query[r, 2, 7] = float("nan")
            expect[r, 2, :] = True
    elif where == "alibi":
        case.kwargs["alibi_slopes"][2] = float("nan")
        expect[:, 2, :] = True
    else:
        cache = case.key_cache if where == "key" else case.value_cache
        for s, j in ((0, 50), (1, 27), (3, 39)):
            set_cache_element(cache, int(case.block_tables[s, j // 16]), 1, j % 16, 5, float("nan"))
            for i, r, p in row_positions(case):
                if i == s and p >= j:
                    expect[r, g:2 * g, slice(None) if where == "key" else 5] = True
    out, ref = run(case, device).cpu().to(torch.float64).numpy(), case.reference()
    assert np.array_equal(np.isnan(ref), expect), "the reference disagrees with the expected NaN set"
    got = np.isnan(out)  # exactly the expected NaNs, the rest close
    assert np.array_equal(got, expect), \
        f"{where}: {int((got & ~expect).sum())} unexpected NaNs, {int((expect & ~got).sum())} missing NaNs"
    ok, msg = gpu_tolerance_ok(torch.from_numpy(out[~expect]).to(case.query.dtype), ref[~expect])
    assert ok, msg


def check_inf_value_in_band(device) -> None:
    """+-inf in V at new tokens' positions: rows before them stay finite and match the reference."""
    case = make_varlen([70, 20], [70, 5], num_heads=8, num_kv_heads=2, cache_dtype=torch.float32,
                       query_dtype=torch.float32, seed=22)
    case.value_cache[int(case.block_tables[0, 40 // 16]), 0, 40 % 16, 3] = float("inf")
    case.value_cache[int(case.block_tables[1, 18 // 16]), 1, 18 % 16, 9] = float("-inf")
    out, ref = run(case, device).cpu().to(torch.float64).numpy(), case.reference()
    assert np.array_equal(np.isposinf(out), np.isposinf(ref)) and np.array_equal(np.isneginf(out), np.isneginf(ref))
    assert not np.isnan(out).any()
    fin = np.isfinite(ref)
    assert np.max(np.abs(out[fin] - ref[fin])) <= 1e-5 * np.abs(ref[fin]).max()


def check_unread_blocks(device, cache_dtype) -> None:
    """NaN/inf in every slot no row reads, with block 0 (where junk would point) partly unread."""
    lens, qls = [3, 40, 17, 1, 60, 90], [3, 11, 0, 1, 2, 45]
    case = make_varlen(lens, qls, block_size=16, cache_dtype=cache_dtype, query_dtype=F16, sliding_window=9, seed=20)
    b1, tables = int(case.block_tables[1, 0]), case.block_tables
    case.block_tables = torch.where(tables == b1, 0, torch.where(tables == 0, b1, tables)).to(torch.int32)
    read = read_slots_varlen(case.block_tables, lens, qls, 16, case.key_cache.shape[0], 9)
    for t in (case.key_cache, case.value_cache):
        t[[0, b1]] = t[[b1, 0]].clone()
        poison_unread(t, read)
    assert not bool(read.all(dim=1)[0])
    ok, msg = gpu_tolerance_ok(run(case, device), case.reference())
    assert ok, msg


def check_decode_batch(device) -> None:
    """One row per sequence: triton_path's decode kernel, its bits; a mixed batch with those rows is
    this kernel's and matches the reference."""
    tpath, _ = _modules()
    case = make_varlen([1, 33, 16, 64, 127], [1] * 5, cache_dtype=torch.float8_e4m3fn, query_dtype=F16,
                       per_head_scales=True, seed=18, **FEATURES["all"])
    got, dev = run(case, device), _on(case, device)
    old, kw = torch.full_like(dev.query, float("nan")), dev.kwargs
    tpath.paged_attention(attention_call(old, dev.query, dev.key_cache, dev.value_cache, dev.block_tables, dev.seq_lens,
                                         dev.query.shape[-1] ** -0.5, dev.k_scale, dev.v_scale, kw["alibi_slopes"],
                                         kw["logits_soft_cap"], kw["sliding_window"], 127))
    assert torch.equal(got, old)
    ok, msg = gpu_tolerance_ok(got, case.reference())
    assert ok, msg


MIXED, E4, E5 = GEOMETRIES["mixed"], torch.float8_e4m3fn, torch.float8_e5m2


def _c(*calls):
    """A check: ``check`` on each (lens, q_lens, kwargs) on the given device."""
    return lambda dev: [check(dev, lens, qls, **kw) for lens, qls, kw in calls]


# Small cases: under the interpreter on the CPU (float16 queries; a few seconds each there), and on GPUs.
CHECKS = {
    "prefill_e4m3fn_gqa4_bs16": _c((*GEOMETRIES["prefill"], dict(cache_dtype=E4, query_dtype=F16, seed=1))),
    "chunked_e4m3fnuz_gqa8_bs7": _c((*GEOMETRIES["chunked"], dict(
        num_heads=8, num_kv_heads=1, block_size=7, seed=2, cache_dtype=torch.float8_e4m3fnuz, query_dtype=F16))),
    "mixed_e5m2_gqa1_bs1": _c((*MIXED, dict(num_heads=2, num_kv_heads=2, block_size=1, cache_dtype=E5, query_dtype=F16,
                                            seed=3))),
    "mixed_e5m2fnuz_all_features_per_head": _c((*MIXED, dict(cache_dtype=torch.float8_e5m2fnuz, query_dtype=F16,
                                                             per_head_scales=True, seed=4, **FEATURES["all"]))),
    "window_1_fp16_cache_alibi_softcap": _c(
        ([40, 9, 30], [30, 9, 1], dict(cache_dtype=F16, query_dtype=F16, seed=5, **FEATURES["window_1"])),
        ([40, 9, 30], [30, 9, 1], dict(cache_dtype=F16, query_dtype=F16, scale_as_tensor=True, seed=6,
                                       alibi_slopes=alibi_slopes(8), logits_soft_cap=2.5))),
    "not_causal_speculative_chunked": _c(
        (*GEOMETRIES["speculative"], dict(causal=False, cache_dtype=E4, query_dtype=F16, seed=7)),
        ([40, 70, 3], [17, 9, 3], dict(causal=False, cache_dtype=torch.float32, query_dtype=torch.float32, seed=8))),
    "float32_path_fp8_bf16_caches": _c(*[([40, 70, 3, 0], [40, 9, 1, 0], dict(
        cache_dtype=dt, query_dtype=torch.float32, per_head_scales=True, seed=9, sliding_window=19))
        for dt in (torch.float8_e5m2fnuz, torch.bfloat16)]),
    "fp16_query_bf16_cache_ieee": _c(([40, 70], [17, 70], dict(cache_dtype=torch.bfloat16, query_dtype=F16, seed=10))),
    "head_tiles_gqa48": _c(([9, 20], [9, 3], dict(num_heads=48, num_kv_heads=1, head_size=32, cache_dtype=E4,
                                                  query_dtype=torch.float32, seed=11))),
    "small_tiles_windows_and_diagonal": _c(*[([110, 61, 45, 8], [80, 61, 1, 6], dict(
        tiles=(32, 16), num_heads=2, num_kv_heads=2, block_size=8, cache_dtype=E4, query_dtype=F16, seed=12,
        sliding_window=w)) for w in (None, 5, 1)]),
    "layouts_loose_bounds": _c(
        (*MIXED, dict(layout="nhd", cache_dtype=E4, query_dtype=F16, seed=13)),
        (*GEOMETRIES["chunked"], dict(layout="combined", cache_dtype=F16, query_dtype=F16, seed=14,
                                      max_query_len=1000, table_pad=5))),
    **{f"nan_{where}": (lambda dev, where=where: [check_nan(dev, where, dt) for dt in (E4, F16, torch.bfloat16)])
       for where in ("query", "key", "value", "alibi")},
    "inf_value_in_band": check_inf_value_in_band,
    "unread_blocks": lambda dev: [check_unread_blocks(dev, dt) for dt in (E5, torch.float32)],
    "decode_batch_uses_decode_kernel": check_decode_batch,
}


def _interpreter_main(result_path: str) -> None:
    """Entry point of the subprocess (tests/interpreter.py)."""
    interpreter.run_checks(CHECKS, result_path, "cpu")


# ---------------------------------------------------------------------------------------------
# CPU: the Triton interpreter and offline compiles.

@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    if triton is None or torch.cuda.is_available():
        pytest.skip(NO_TRITON if triton is None else "a GPU is present: the gpu tests run the compiled kernel")
    return interpreter.results_in_subprocess("test_emu_triton_prefill", tmp_path_factory.mktemp("triton_prefill_interp"), 400)


@pytest.mark.parametrize("name", list(CHECKS))
@pytest.mark.slow
def test_interpreter(interpreter_results, name):
    assert interpreter_results[name] == "ok", interpreter_results[name]


COMPILE_CASES = {  # (query dtype, cache dtype, head size, features, causal)
    "fp16_e4m3fn_d128": (F16, torch.float8_e4m3fn, 128, {}, True),
    "fp16_e5m2fnuz_d256_all_features": (F16, torch.float8_e5m2fnuz, 256, dict(FEATURES["all"], per_head_scales=True),
                                        True),
    "fp32_bf16_d64_not_causal": (torch.float32, torch.bfloat16, 64, dict(logits_soft_cap=3.0), False),
}


@pytest.mark.parametrize("case_name", list(COMPILE_CASES))
@pytest.mark.slow
def test_kernel_compiles_offline_for_gfx942(case_name, monkeypatch, tmp_path):
    """The host code's launch, compiled (not run) for AMD gfx942 (wave64, MFMA) and NVIDIA sm_80."""
    if triton is None or torch.cuda.is_available():
        pytest.skip(NO_TRITON if triton is None else "a GPU is present: the GPU tests compile and run the kernel")
    from test_emu_triton import _compile, _Recorder
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    if "amd" not in backends:
        pytest.skip(f"this triton has no AMD backend (backends: {sorted(backends)})")
    from hal.kernelpacks.emu import triton_prefill_kernels as TK
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.setattr(TK, "prefill_kernel", rec := _Recorder(TK.prefill_kernel))
    qd, cd, d, feats, causal = COMPILE_CASES[case_name]
    run(make_varlen([40, 100, 1], [17, 9, 1], cache_dtype=cd, query_dtype=qd, head_size=d, causal=causal, **feats),
        "cpu")
    (args, kw), = rec.calls
    k = _compile(rec.fn, args, kw, GPUTarget("hip", "gfx942", 64))
    asm = k.asm["amdgcn"]
    meta = {key: int(m.group(1)) for key in ("vgpr_count", "agpr_count", "sgpr_count", "private_segment_fixed_size",
                                              "vgpr_spill_count") if (m := re.search(rf"\.{key}:\s+(\d+)", asm))}
    mfma = sorted(set(re.findall("v_mfma_[a-z0-9_]+", asm)))
    print(f"gfx942 {case_name}: {meta}, LDS {k.metadata.shared} B, MFMA {mfma}")  # shown with -s
    assert "v_mfma" in asm, "the tile products should use MFMA on gfx942"
    nv = _compile(rec.fn, args, kw, GPUTarget("cuda", 80, 32))
    assert nv.metadata.shared <= 64 * 1024, f"{nv.metadata.shared} bytes of shared memory (> 64 KiB)"


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.slow
def test_sm90_tuned_tiles_compile_offline(cache_dtype, monkeypatch, tmp_path):
    """The H200's tuned tiles (triton_prefill.TUNED[(9, 0)]) are the ones the host code launches on
    sm_90, and compile for sm_90 within its shared memory (227 KiB a block)."""
    if triton is None or torch.cuda.is_available():
        pytest.skip(NO_TRITON if triton is None else "a GPU is present: the GPU tests compile and run the kernel")
    from hal.kernelpacks.emu import triton_prefill as TP
    from hal.kernelpacks.emu import triton_prefill_kernels as TK
    from test_emu_triton import _compile, _Recorder
    from triton.backends.compiler import GPUTarget
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(TK, "prefill_kernel", rec := _Recorder(TK.prefill_kernel))
    monkeypatch.setattr(TP, "_capability", lambda device: (9, 0))
    run(make_varlen([300, 40], [300, 17], cache_dtype=cache_dtype, query_dtype=torch.bfloat16, head_size=128), "cpu")
    (args, kw), = rec.calls
    rows, keys, warps, stages = TP.TUNED[(9, 0)][(True, True, cache_dtype != torch.bfloat16)]
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (rows, keys, warps, stages)
    k = _compile(rec.fn, args, kw, GPUTarget("cuda", 90, 32))
    assert k.metadata.shared <= 227 * 1024, f"{k.metadata.shared} bytes of shared memory (> 227 KiB)"


# ---------------------------------------------------------------------------------------------
# GPU.

def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(triton is None, reason=NO_TRITON)(fn))  # conftest skips without a GPU


@gpu_test
@pytest.mark.parametrize("name", list(CHECKS))
def test_gpu_small_checks(name):
    CHECKS[name]("cuda")


GPU_GEOMETRIES = {**GEOMETRIES, "one_sequence": ([1000], [1000]), "one_chunk": ([1000], [13]),
                  "one_row_and_empty": ([1000, 7], [1, 0])}  # num_seqs == 1: an int Triton may specialise


@gpu_test
@pytest.mark.parametrize("geometry", GPU_GEOMETRIES)
@pytest.mark.parametrize("cache_dtype", CACHES, ids=str)
def test_gpu_geometries_and_encodings(cache_dtype, geometry):
    check("cuda", *GPU_GEOMETRIES[geometry], cache_dtype=cache_dtype, query_dtype=_qd(cache_dtype), seed=len(geometry))


@gpu_test
@pytest.mark.parametrize("query_dtype,cache_dtype,head_size", [
    *[(qd, torch.float8_e4m3fn, d) for qd in (torch.bfloat16, F16, torch.float32) for d in (40, 64, 80, 128, 256)],
    (torch.float32, torch.float8_e5m2fnuz, 128), (torch.float32, torch.bfloat16, 256), (F16, torch.float32, 128),
    (torch.bfloat16, F16, 64)], ids=str)
def test_gpu_dtypes_and_head_sizes(query_dtype, cache_dtype, head_size):
    """The 16-bit path and the float32-operand path (float32 query, or a cache the query's dtype would round)."""
    check("cuda", *MIXED, query_dtype=query_dtype, cache_dtype=cache_dtype, head_size=head_size, seed=head_size,
          **FEATURES["all"])


@gpu_test
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (16, 2), (32, 4), (64, 1), (80, 1), (128, 2)], ids=str)
@pytest.mark.parametrize("block_size", [1, 7, 16, 64, 256])
def test_gpu_gqa_and_block_sizes(heads, kv_heads, block_size):
    lens = [2 * block_size, 3 * block_size + 1, 300, 5, 0]
    check("cuda", lens, [2 * block_size, min(20, lens[1]), 150, 1, 0], num_heads=heads, num_kv_heads=kv_heads,
          block_size=block_size, cache_dtype=torch.float8_e5m2fnuz, seed=heads + block_size)


@gpu_test
@pytest.mark.parametrize("scales", ["float", "tensor0d", "per_head"])
@pytest.mark.parametrize("feature", [*FEATURES, "window_700", "not_causal"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32],
                         ids=str)
def test_gpu_features_and_scales(cache_dtype, feature, scales):
    kw = {"not_causal": dict(causal=False), "window_700": dict(sliding_window=700)}.get(feature) or FEATURES[feature]
    check("cuda", [600, 1, 300, 50, 0, 900], [100, 1, 0, 50, 0, 60], num_kv_heads=4, cache_dtype=cache_dtype,
          query_dtype=_qd(cache_dtype), per_head_scales=scales == "per_head", scale_as_tensor=scales == "tensor0d",
          seed=7, **kw)


LARGE = {  # checked against hal.reference (float64 on the GPU)
    "prefill_8x2048_e4m3fn": ([2048] * 8, [2048] * 8, dict(cache_dtype=torch.float8_e4m3fn)),
    "prefill_8x2048_bf16": ([2048] * 8, [2048] * 8, dict(cache_dtype=torch.bfloat16)),
    # a 2048-token prefill, a 512-token chunk of a 4096 context, 64 decode rows at 3000, q_len 0
    "mixed_long": ([2048, 4096] + [3000] * 64 + [77], [2048, 512] + [1] * 64 + [0], dict(per_head_scales=True)),
    "mixed_long_features": ([2048, 4096] + [3000] * 64 + [77], [2048, 512] + [1] * 64 + [0], dict(
        per_head_scales=True, alibi_slopes=alibi_slopes(32), logits_soft_cap=4.0, sliding_window=1000)),
}


@gpu_test
@pytest.mark.parametrize("name", LARGE)
def test_gpu_large(name):
    lens, qls, kw = LARGE[name]
    check("cuda", lens, qls, num_heads=32, num_kv_heads=8, head_size=128, ref="hal", seed=10, **kw)


@gpu_test
def test_gpu_no_sync_and_cuda_graph_capture():
    """Host bounds given: no device->host sync, and the launch replays from a CUDA graph with new
    query values (the same geometry)."""
    _, tp = _modules()
    case = make_varlen([700, 5, 0, 1300, 64], [300, 5, 0, 1, 64], per_head_scales=True, alibi_slopes=alibi_slopes(8),
                       sliding_window=900, seed=12)
    (mql, msl), dev = _bounds(case), _on(case, "cuda")
    out = torch.full_like(dev.query, float("nan"))
    call = varlen_call(out, dev, max_query_len=mql, max_seq_len=msl)
    tp.paged_attention(call)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tp.paged_attention(call)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # torch.cuda.graph captures on its own side stream
        tp.paged_attention(call)
    case.query = torch.randn(case.query.shape, generator=torch.Generator().manual_seed(99)).to(case.query.dtype)
    dev.query.copy_(case.query.cuda())
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ok, msg = gpu_tolerance_ok(out, case.reference())
    assert ok, msg
