"""CPU tests of hal-bench's MLA decode family (hal/bench/mla.py, hal/bench/mla_baselines.py): the
SPEC syntax and sets, the FLOP and byte accounting (by hand for small shapes), the data (cache bytes
are hal.fp8.encode_bytes of latent / scale; vLLM's combined layout; NaN in spare pages), the check
(a wrong contender is caught, an FP8 one is flagged), an end-to-end CPU run through main() with the
hal, emu and torch contenders, the skip reasons of the GPU-only ones, and the inputs given to
FlashInfer and FlashMLA FP8, read back the way those kernels read them, against the reference."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import hal
from hal import fp8
from hal import reference as hal_reference
from hal.bench import check, mla, mla_baselines, shapes
from hal.bench import contenders as contenders_mod
from hal.bench.baselines import Skip
from hal.bench.contenders import Contender, Prepared
from hal.cli import bench

MLA_TINY = list(shapes.SETS["mla-tiny"])
FAST = ["--device", "cpu", "--reps", "2", "--warmup", "1", "--budget", "0.5", "--kv-dtype", "bf16,e4m3fn"]


# ------------------------------------------------------------------------------------------- specs

def test_mla_specs_and_sets():
    s = shapes.parse("mla:64x4096x128")
    assert isinstance(s, mla.MlaShape) and s.op == "mla"
    assert (s.batch, s.context, s.num_heads, s.block_size, s.q_len, s.ragged, s.latent, s.rope) == \
        (64, 4096, 128, 64, 1, False, 512, 64)
    assert s.spec == "mla:64x4096x128"
    t = shapes.parse("MLA:16x32768x16:ragged:b16:q2:r256:p32")
    assert (t.block_size, t.q_len, t.ragged, t.latent, t.rope) == (16, 2, True, 256, 32)
    assert t.spec == "mla:16x32768x16:b16:q2:ragged:r256:p32" and shapes.parse(t.spec) == t
    assert shapes.parse("mla:2x10x4:b64").spec == "mla:2x10x4"          # page 64 is the default
    for bad in ("mla:64x4096", "mla:64x4096x128x1", "mla:1x10x4:z", "mla:1x10x4:r", "mla:0x10x4", "mla:2x10x4:q11",
                "mla:2x10x4:b0", "mla:2x10x4:p0", "mla:2x10x4/4x1x64"):
        with pytest.raises(ValueError):
            shapes.parse(bad)
    # the MLA issue's shapes: batch x context pairs, 128 and 16 heads each, page 64, one ragged batch
    got = shapes.resolve(["mla"])
    assert [x.spec for x in got] == list(shapes.MLA) and len(got) == 12
    pairs = {(x.batch, x.context) for x in got}
    assert pairs == {(64, 4096), (128, 2048), (32, 8192), (16, 32768), (1, 65536), (64, 8192)}
    assert {x.num_heads for x in got} == {128, 16} and {x.block_size for x in got} == {64}
    assert [x.spec for x in got if x.ragged] == ["mla:64x8192x128:ragged", "mla:64x8192x16:ragged"]
    assert all((x.latent, x.rope, x.q_len) == (512, 64, 1) for x in got)
    # page-16 twins, each of a page-64 shape in "mla"
    b16 = shapes.resolve(["mla-b16"])
    assert b16 and {x.block_size for x in b16} == {16}
    assert all(dataclasses.replace(x, block_size=64) in got for x in b16)
    assert len(shapes.resolve(["mla", "mla-sweep"])) == len(shapes.SETS["mla-sweep"])
    # decode, prefill and MLA shapes mix in one list
    assert [x.op for x in shapes.resolve(["tiny", "mla-tiny"])] == ["decode"] * 2 + ["mla"] * 3
    assert [x.spec for x in shapes.resolve(["mla-tiny"])] == MLA_TINY


# --------------------------------------------------------------------------------- FLOP and bytes

def test_flop_and_byte_accounting_by_hand():
    # 2 sequences of 10 tokens, 4 heads, 2 query rows each (causal), R 32, P 16, page 8, e4m3fn latent
    p = mla.build(shapes.parse("mla:2x10x4:b8:q2:r32:p16"), torch.float8_e4m3fn, "cpu", seed=1)
    assert p.lens == [10, 10] and p.q_lens == [2, 2] and p.starts == [0, 2, 4] and p.total_q == 4
    # rows of a sequence sit at positions 8 and 9: they attend 9 + 10 keys
    assert p.keys_attended() == 2 * (9 + 10)
    # 2 H k (R + P) for the scores + 2 H k R for the weighted latents = 2 * 4 * (64 + 16) * 38
    assert p.flop() == 2 * 4 * 38 * (32 + 16) + 2 * 4 * 38 * 32 == 24_320
    b = p.bytes_moved()
    assert b["latent"] == 20 * 32 * 1                  # every referenced token once, 1-byte latent
    assert b["rope"] == 20 * 16 * 2                    # bf16 rotary part
    assert b["query"] == 4 * 4 * (32 + 16) * 2 and b["output"] == 4 * 4 * 32 * 2
    assert b["block_table_and_lens"] == (2 + 2) * 4 + 2 * 4 + 3 * 4     # 2 pages each, seq_lens, query_start_loc
    assert b["total"] == 640 + 640 + 1536 + 1024 + 36 == 3876
    # the MLA roofline's numbers (shared/docs/anchors-prefill-mla.md 3.8): 128 heads, one row, 576/512, bf16
    q = mla.build(shapes.parse("mla:1x64x128"), torch.bfloat16, "cpu")
    assert q.flop() == 64 * 2 * 128 * 1088 and q.flop() // 64 == 278_528
    assert (q.bytes_moved()["latent"] + q.bytes_moved()["rope"]) // 64 == 1152
    assert q.query_start_loc is None and q.bytes_moved()["block_table_and_lens"] == 4 + 4


# -------------------------------------------------------------------------------------------- data

@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_data_is_hal_cache_mla_encode_in_the_vllm_layout(kv):
    p = mla.build(shapes.parse("mla:3x100x8:b16:ragged"), kv, "cpu", seed=3, keep_source=True)
    r, pr, bs = 512, 64, 16
    assert p.lens[0] == 100 and all(7 <= L <= 100 for L in p.lens)
    src = p.extra["source"]
    slots = src["slots"]
    latent = p.ckv_cache.reshape(-1, r)[slots]
    rope = p.kpe_cache.reshape(-1, pr)[slots]
    if kv == torch.float8_e4m3fn:
        assert p.ckv_scale == pytest.approx(4.5 / 448) and p.kpe_scale is None
        assert torch.equal(latent.view(torch.uint8), fp8.encode_bytes(src["kv_c"] / p.ckv_scale, kv))
        # one byte allocation per page: 512 latent bytes, then 64 bf16 (128 bytes)
        assert p.kv_cache.dtype == torch.uint8 and p.kv_cache.shape == (p.num_blocks, bs, r + 2 * pr)
        assert p.ckv_cache.dtype == kv and p.kpe_cache.dtype == torch.bfloat16
        assert p.kpe_cache.data_ptr() == p.kv_cache.data_ptr() + r
    else:
        assert p.ckv_scale is None
        assert torch.equal(latent, src["kv_c"].to(kv))
        assert p.kv_cache.dtype == kv and p.kv_cache.shape == (p.num_blocks, bs, r + pr)   # FlashMLA's k_cache
        assert p.kpe_cache.data_ptr() == p.kv_cache.data_ptr() + r * 2
    assert torch.equal(rope, src["k_pe"].to(torch.bfloat16))
    assert p.ckv_cache.data_ptr() == p.kv_cache.data_ptr() and p.ckv_cache.stride(1) == p.kv_cache.shape[2] * \
        p.kv_cache.element_size() // p.ckv_cache.element_size()
    # pages shuffled over the pool, none shared, padding entries 0 (a used page); spare pages are NaN bytes
    used = torch.cat([p.block_tables[i, :p.pages(i)] for i in range(3)])
    assert used.unique().numel() == used.numel() and not torch.equal(used.sort().values, used)
    assert 0 in used.tolist()
    assert all(int(p.block_tables[i, p.pages(i):].abs().sum()) == 0 for i in range(3))
    spare = sorted(set(range(p.num_blocks)) - set(used.tolist()))
    assert len(spare) == 7 and bool((p.kv_cache.view(torch.uint8)[spare] == 0xFF).all())
    assert torch.isnan(p.ckv_cache[spare].float()).all() and torch.isnan(p.kpe_cache[spare].float()).all()
    assert torch.isfinite(p.ckv_cache[used.long()].float()).all()       # the tails of last pages are written too
    # the query: one [total_q, H, R + P] bf16 tensor, q_nope and q_pe its views
    assert p.query.shape == (3, 8, r + pr) and p.query.dtype == torch.bfloat16
    assert p.q_nope.data_ptr() == p.query.data_ptr() and p.q_pe.data_ptr() == p.query.data_ptr() + r * 2
    assert p.scale == pytest.approx(192 ** -0.5)


# ------------------------------------------------------------------------------------------- check

def test_the_check_catches_a_wrong_output_and_flags_an_fp8_one():
    p = mla.build(shapes.parse("mla:3x60x8:b16:q2"), torch.float8_e4m3fn, "cpu", seed=2)
    ref = mla.MlaReference(p)
    assert ref.ref_ok and ref.tolerance == 5e-3 and "float64 on all sequences" in ref.describe()
    assert ref.f64.shape == (6, 8, 512) and ref.subset == [0, 1, 2]
    good = ref.f32.to(torch.bfloat16)
    v = ref.check(good)
    assert v.ok and v.err_f64 < 2e-3 and v.reason == ""
    bad = good.clone()
    bad[4] *= 1.01                                     # one row of six off by 1%: 1e-2 > 5e-3
    v = ref.check(bad)
    assert not v.ok and v.reason.startswith("wrong") and 5e-3 < v.err_f64 < 2e-2
    # a contender's own bound (it rounds to FP8 on purpose): passes, but is flagged, never hidden
    v = ref.check(bad, tolerance=5e-2)
    assert v.ok and v.reason.startswith("FLAGGED") and "5e-03" in v.reason
    assert ref.check(good, tolerance=5e-2).reason == ""            # within 5e-3: nothing to flag
    nan = good.clone()
    nan[0, 0, 0] = float("nan")
    assert "non-finite" in ref.check(nan).reason
    assert "shape" in ref.check(good[:, :4]).reason


def test_float64_subset_is_chosen_by_cost():
    """Sequences' rows x keys x heads above the budget: the costliest, the cheapest and random ones."""
    p = mla.build(shapes.parse("mla:6x400x8:b16:ragged"), torch.bfloat16, "cpu", seed=4)
    costs = [q * L * 8 for q, L in zip(p.q_lens, p.lens)]
    old = mla.F64_COST["cpu"]
    mla.F64_COST["cpu"] = max(costs) + min(costs)
    try:
        ref = mla.MlaReference(p)
    finally:
        mla.F64_COST["cpu"] = old
    assert costs.index(max(costs)) in ref.subset and costs.index(min(costs)) in ref.subset
    assert 2 <= len(ref.subset) < 6 and ref.ref_ok
    assert f"float64 on {len(ref.subset)} of 6 sequences" in ref.describe()


# ------------------------------------------------------------------------------------- end to end

def _bad(kind: str):
    def setup(p, opts: dict) -> Prepared:
        if kind == "raise":
            raise RuntimeError("kernel exploded")
        out = torch.empty((p.total_q, p.shape.num_heads, p.shape.latent), dtype=p.query.dtype)

        def run():
            out.copy_(p.q_nope * 0.5)                  # no attention at all
            if kind == "partial":
                out[0] = float("nan")
        return Prepared(run, out)
    return setup


@pytest.mark.slow
def test_end_to_end_cpu_run(tmp_path, monkeypatch):
    """main() on the tiny MLA shapes and one decode shape, bf16 and e4m3fn: hal, emu-torch and the
    torch baseline are checked (5e-3) and timed with both fractions; wrong or crashing contenders
    are FAIL rows that do not stop the run; the GPU-only contenders say why they skip."""
    known = contenders_mod.all_contenders()
    extra = [Contender(f"bad-{k}", "test", k, _bad(k), ops=frozenset({"mla"})) for k in ("raise", "wrong", "partial")]
    monkeypatch.setattr(contenders_mod, "all_contenders", lambda: known + extra)
    path = tmp_path / "mla.json"
    threads = torch.get_num_threads()
    try:  # one thread: a busy neighbour stalls OpenMP threads (docs/bench.md), and only paths count here
        rc = bench.main(["--shapes", "2x64x4x2x64", *MLA_TINY, *FAST, "--threads", "1",
                         "--contenders", "hal", "emu-*", "flash*", "bad-*", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    result = json.loads(path.read_text())
    assert result["complete"] and result["matmul"]["tflops"] > 0 and result["copy_bandwidth"]["gbps"] > 0
    assert result["settings"]["baseline"] == "torch-sdpa / torch (mla)" and "5e-3" in result["settings"]["check_mla"]
    problems = [x for x in result["problems"] if x["op"] == "mla"]
    assert {x["shape"]["spec"] for x in problems} == set(MLA_TINY) and len(problems) == 6
    assert all(x["reference_ok"] and x["tolerance"] == 5e-3 for x in problems)
    selected = [c.name for c in contenders_mod.select(["hal", "emu-*", "flash*", "bad-*"], known + extra)
                if "mla" in c.ops]
    assert "torch" in selected and "torch-sdpa" not in selected        # each op's baseline is kept
    for prob in problems:
        key = (prob["shape"]["spec"], prob["kv_dtype"])
        mine = [r for r in result["rows"] if (r["shape"], r["kv_dtype"]) == key]
        assert [r["contender"] for r in mine] == selected
        by = {r["contender"]: r for r in mine}
        for name in ("hal", "emu-torch", "torch"):
            r = by[name]
            assert r["status"] == "ok" and r["op"] == "mla", r
            assert r["err_f64"] <= 5e-3 and r["err_all"] <= 5e-3 and r["tolerance"] == 5e-3
            assert r["time_us"] > 0 and r["reps"] >= 2 and r["bytes"] == prob["bytes"]["total"]
            assert r["flop"] == prob["flop"] and r["TFLOPs"] == pytest.approx(r["flop"] / r["time_us"] / 1e6)
            assert r["GBps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
            assert r["fraction_of_copy"] > 0 and r["fraction_of_matmul"] > 0 and r["speedup_vs_baseline"] > 0
        assert by["torch"]["speedup_vs_baseline"] == 1.0
        assert by["hal"]["note"] == "dispatched to emu"
        for name in ("emu-triton", "flashmla", "flashmla-fp8", "flashinfer-mla"):
            assert by[name]["status"] == "skip" and "GPU" in by[name]["reason"], by[name]
        assert by["bad-raise"]["status"] == "FAIL" and "kernel exploded" in by["bad-raise"]["reason"]
        assert by["bad-wrong"]["status"] == "FAIL" and by["bad-wrong"]["reason"].startswith("wrong")
        assert by["bad-wrong"]["time_us"] is None and by["bad-wrong"]["err_f64"] > 5e-3
        assert "non-finite" in by["bad-partial"]["reason"]
    decode = [r for r in result["rows"] if r["op"] == "decode"]
    assert {r["contender"] for r in decode} >= {"hal", "torch-sdpa"} and "torch" not in {r["contender"] for r in decode}
    assert all(r["status"] == "ok" for r in decode if r["contender"] in ("hal", "emu-torch", "torch-sdpa"))


def test_cpu_skip_reasons_of_the_gpu_only_contenders():
    p = mla.build(shapes.parse("mla:2x70x16"), torch.bfloat16, "cpu")
    for fn in (mla_baselines.flashmla_bf16, mla_baselines.flashmla_fp8, mla_baselines.flashinfer_mla):
        with pytest.raises(Skip, match="GPU"):
            fn(p)
    by = {c.name: c for c in contenders_mod.all_contenders()}
    with pytest.raises(Skip, match="GPUs only"):
        by["emu-triton"].setup(p, {})
    assert by["flashmla-fp8"].tolerance == mla_baselines.FLASHMLA_FP8_TOLERANCE
    assert {n for n, c in by.items() if c.ops == frozenset({"mla"}) and not n.startswith("hal")} == \
        {"torch", "flashmla", "flashmla-fp8", "flashinfer-mla"}
    if "hal:cuda" in by:  # the cuda pack's kernel choices: the mma.sync MLA kernel forced is MLA-only
        assert by["hal:cuda-mma"].ops == frozenset({"mla"}) and by["hal:cuda-wgmma"].ops == frozenset({"prefill", "mla"})
        assert by["hal:cuda-uniform"].ops == frozenset({"mla"})
        cuda = next(x for x in hal.packs() if x.NAME == "cuda")
        if not cuda.availability.ok:  # a skip with the pack's reason, not an import error of its module
            for n in ("hal:cuda-mma", "hal:cuda-wgmma", "hal:cuda-narrow", "hal:cuda-uniform"):
                with pytest.raises(Skip, match="unavailable"):
                    by[n].setup(p, {})
    assert all("mla" in by[n].ops for n in ("hal", "emu-torch", "emu-triton"))
    assert "mla" not in by["torch-sdpa"].ops


# ------------------------------------------------------------------ inputs of the GPU-only baselines

def _mla_f64(q_nope, q_pe, pages_of, lens, c_rows, k_rows, scale, q_lens):
    """MLA in float64 the way a paged kernel reads it: sequence i's pages ``pages_of(i)``, rows
    ``c_rows(pages)`` / ``k_rows(pages)`` (already scaled), its q rows causal at the end."""
    out, at = [], 0
    for i, L in enumerate(lens):
        pages = pages_of(i)
        c, k = c_rows(pages)[:L], k_rows(pages)[:L]
        q = q_lens[i]
        qn, qp = q_nope[at:at + q].to(torch.float64), q_pe[at:at + q].to(torch.float64)
        s = (torch.einsum("rhc,tc->rht", qn, c) + torch.einsum("rhp,tp->rht", qp, k)) * mla.SOFTMAX_SCALE
        pos = torch.arange(L)
        s = s.masked_fill((pos[None, :] > (L - q + torch.arange(q))[:, None])[:, None, :], float("-inf"))
        out.append(torch.einsum("rht,tc->rhc", torch.softmax(s, dim=-1), c))
        at += q
    return torch.cat(out)


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_flashinfer_mla_inputs_describe_the_same_problem(kv):
    """qo_indptr / kv_indptr / kv_indices / kv_len_arr and the (FP8-copied) rotary cache given to
    FlashInfer, read back as FlashInfer reads them: the reference (bf16), or within FlashInfer's own
    bound with an error over 5e-3 (e4m3fn: its rotary part is rounded to FP8, hence the flag)."""
    p = mla.build(shapes.parse("mla:3x90x8:b16:ragged:q2"), kv, "cpu", seed=5)
    ref = mla.MlaReference(p)
    lay = mla_baselines.flashinfer_layout(p)
    assert lay["qo_indptr"].tolist() == [0, 2, 4, 6] and lay["kv_len_arr"].tolist() == p.lens
    bs = p.shape.block_size

    def pages_of(i):
        pages = lay["kv_indices"][lay["kv_indptr"][i]:lay["kv_indptr"][i + 1]].long()
        assert (len(pages) - 1) * bs < int(lay["kv_len_arr"][i]) <= len(pages) * bs
        return pages

    cs = 1.0 if p.ckv_scale is None else p.ckv_scale
    ks = 1.0 if lay["kpe_scale"] is None else lay["kpe_scale"]
    kpe = lay["kpe"]
    assert kpe.dtype == p.kv_dtype                      # FlashInfer: ckv and kpe in one dtype
    out = _mla_f64(p.q_nope, p.q_pe, pages_of, p.lens,
                   lambda pg: p.ckv_cache[pg].reshape(-1, 512).to(torch.float64) * cs,
                   lambda pg: kpe[pg].reshape(-1, 64).to(torch.float64) * ks, p.scale, p.q_lens)
    err = check.worst_rel_l2(out, ref.f32)
    if kv == torch.bfloat16:
        assert kpe.data_ptr() == p.kpe_cache.data_ptr() and lay["note"] == "" and err < 1e-5
    else:
        assert "e4m3fn" in lay["note"] and 5e-3 < err < mla_baselines.FLASHINFER_FP8_TOLERANCE / 2


def test_flashmla_fp8_inputs_describe_the_same_problem():
    """FlashMLA FP8's cache (the latent's own bytes, the rotary part encoded with the latent's scale),
    its quantized query and descales, computed with FlashMLA's semantics (no P rounding here), give
    the reference within a third of its bound."""
    p = mla.build(shapes.parse("mla:2x130x16"), torch.float8_e4m3fn, "cpu", seed=6)
    ref = mla.MlaReference(p)
    x = mla_baselines.flashmla_fp8_inputs(p)
    k8, q8 = x["k8"], x["q8"]
    assert k8.shape == (p.num_blocks, 64, 1, 576) and k8.dtype == torch.float8_e4m3fn
    assert q8.shape == (2, 1, 16, 576) and q8.dtype == torch.float8_e4m3fn
    assert torch.equal(k8[:, :, 0, :512].view(torch.uint8), p.ckv_cache.view(torch.uint8))
    rope = p.kpe_cache.to(torch.float32)
    assert torch.equal(k8[:, :, 0, 512:].view(torch.uint8), fp8.encode_bytes(rope / p.ckv_scale, torch.float8_e4m3fn))
    assert x["descale_q"].tolist() == [pytest.approx(x["q_scale"])] and x["descale_k"].item() == pytest.approx(p.ckv_scale)
    q = q8.reshape(2, 16, 576).to(torch.float64) * x["descale_q"].item()
    k = k8[:, :, 0].to(torch.float64) * x["descale_k"].item()                 # [blocks, 64, 576]
    out = hal_reference.mla_decode(q[..., :512], q[..., 512:], k[..., :512], k[..., 512:], p.block_tables,
                                   p.seq_lens, scale=p.scale)
    err = check.worst_rel_l2(out, ref.f32)
    assert 5e-3 < err < mla_baselines.FLASHMLA_FP8_TOLERANCE / 3
    # the dense bf16 kernel reads the problem's own combined cache as [blocks, 64, 1, 576]
    b = mla.build(shapes.parse("mla:2x130x16"), torch.bfloat16, "cpu", seed=6)
    view = b.kv_cache.view(b.num_blocks, 64, 1, 576)
    assert view.data_ptr() == b.ckv_cache.data_ptr()
    assert torch.equal(view[:, :, 0, :512].view(torch.int16), b.ckv_cache.view(torch.int16))  # bits: spare pages are NaN
    assert torch.equal(view[:, :, 0, 512:].view(torch.int16), b.kpe_cache.view(torch.int16))
