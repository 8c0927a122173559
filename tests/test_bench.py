"""CPU smoke test of hal-bench: tiny shapes through main() with --json; every contender appears,
every timed row carries its correctness figures, and a wrong or crashing contender is a FAIL row that
does not stop the run. Prefill (several query tokens per sequence): the SPEC syntax and sets, the
dry run (every code path that runs on a CPU; the CUDA-only contenders say why they skip), and the
inputs given to FlashInfer and FA3, read back the way those kernels read them, against the reference."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from hal.bench import contenders as contenders_mod
from hal.bench import data, shapes
from hal.bench.contenders import Contender, Prepared
from hal.cli import bench

TINY = ["2x64x4x2x64", "3x100x8x2x64:b32:ragged"]
PREFILL_TINY = "3x1@40+1x5@20+1x33/4x2x64"
FAST = ["--device", "cpu", "--reps", "2", "--warmup", "1", "--budget", "0.5", "--kv-dtype", "bf16,e4m3fn"]


def _run(tmp_path, *extra):
    path = tmp_path / "bench.json"
    rc = bench.main(["--shapes", *TINY, *FAST, "--json", str(path), "--plot", str(tmp_path / "b.png"), *extra])
    assert rc == 0
    return json.loads(path.read_text())


@pytest.mark.slow
def test_every_contender_has_a_row_and_a_correctness_figure(tmp_path):
    result = _run(tmp_path)
    names = [c.name for c in contenders_mod.all_contenders() if "decode" in c.ops]
    assert result["device"]["type"] == "cpu" and result["device"]["torch"] == torch.__version__
    assert result["copy_bandwidth"]["gbps"] > 0
    rows = result["rows"]
    problems = {(s, k) for s in (shapes.parse(x).spec for x in TINY) for k in ("bf16", "e4m3fn")}
    assert {(r["shape"], r["kv_dtype"]) for r in rows} == problems
    for shape, kv in problems:
        got = [r["contender"] for r in rows if (r["shape"], r["kv_dtype"]) == (shape, kv)]
        assert got == names
    by_name = {}
    for r in rows:
        by_name.setdefault(r["contender"], []).append(r)
        assert r["status"] in ("ok", "skip", "FAIL")
        if r["status"] == "ok":
            assert r["err_all"] is not None and r["err_f64"] is not None
            assert r["err_all"] <= r["tolerance"] and r["err_f64"] <= r["tolerance"]
            assert r["time_us"] > 0 and r["GBps"] > 0 and r["fraction_of_copy"] > 0 and r["reps"] >= 2
            assert r["bytes"] > 0 and r["speedup_vs_baseline"] > 0
        else:
            assert r["reason"], r
    # what must run on a CPU: the public call, the emu torch path and the baseline
    for name in ("hal", "emu-torch", contenders_mod.BASELINE):
        assert all(r["status"] == "ok" for r in by_name[name]), by_name[name]
    # what cannot run here is skipped with its reason, never FAIL
    for name in ("emu-triton", "flashinfer-tc", "flashinfer-cc"):
        assert all(r["status"] == "skip" and r["reason"] for r in by_name[name])
    assert all(p["reference_ok"] for p in result["problems"])
    assert "plot" in result


def _bad(kind):
    def setup(p, opts):
        out = torch.empty_like(p.query)

        def run():
            if kind == "raise":
                raise RuntimeError("kernel exploded")
            out.copy_(p.query * 0.5 if kind == "wrong" else p.query)  # no attention at all
            if kind == "partial":
                out[0] = float("nan")
        return Prepared(run, out)
    return setup


@pytest.mark.slow
def test_wrong_and_crashing_contenders_fail_without_stopping_the_run(tmp_path, monkeypatch):
    known = contenders_mod.all_contenders()
    extra = [Contender(f"bad-{k}", "test", k, _bad(k)) for k in ("raise", "wrong", "partial")]
    monkeypatch.setattr(contenders_mod, "all_contenders", lambda: known + extra)
    result = _run(tmp_path, "--contenders", "emu-torch,bad-*", "--shapes", TINY[0], PREFILL_TINY)
    rows = {(r["shape"], r["kv_dtype"], r["contender"]): r for r in result["rows"]}
    for kv, base in itertools.product(("bf16", "e4m3fn"), (TINY[0], PREFILL_TINY)):
        assert rows[(base, kv, "emu-torch")]["status"] == "ok"
        assert rows[(base, kv, "torch-sdpa")]["status"] == "ok"  # the baseline is always kept
        r = rows[(base, kv, "bad-raise")]
        assert r["status"] == "FAIL" and "kernel exploded" in r["reason"] and r["time_us"] is None
        r = rows[(base, kv, "bad-wrong")]
        assert r["status"] == "FAIL" and r["reason"].startswith("wrong") and r["time_us"] is None
        assert r["err_f64"] > r["tolerance"]
        r = rows[(base, kv, "bad-partial")]
        assert r["status"] == "FAIL" and "non-finite" in r["reason"]


def test_shape_specs_and_sets():
    s = shapes.parse("64x4096x32x8x128:b64:ragged")
    assert (s.batch, s.context, s.num_heads, s.num_kv_heads, s.head_size, s.block_size, s.ragged) == \
        (64, 4096, 32, 8, 128, 64, True)
    assert shapes.parse("64x4096x32x8x128:b16").spec == "64x4096x32x8x128"
    assert [x.spec for x in shapes.resolve(["issue"])] == list(shapes.ISSUE)
    assert len(shapes.resolve(["issue,sweep"])) == len(shapes.SETS["sweep"])
    for bad in ("64x4096x32x8", "64x4096x30x8x128", "1x1x1x1x64:q"):
        with pytest.raises(ValueError):
            shapes.parse(bad)
    with pytest.raises(ValueError):
        contenders_mod.select(["no-such-thing"])
    assert data.parse_dtypes("bf16, e4m3fn,fp8_e5m2") == [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def test_problem_pages_are_shuffled_and_bytes_count_referenced_tokens():
    p = data.build(shapes.parse("3x100x8x2x64:b16:ragged"), torch.float8_e4m3fn, "cpu", seed=3)
    assert p.lens[0] == 100 and all(1 <= L <= 100 for L in p.lens)
    used = torch.cat([p.block_tables[i, :p.pages(i)] for i in range(3)])
    assert used.unique().numel() == used.numel()                       # no page shared
    assert not torch.equal(used.sort().values, used)                   # not in pool order
    b = p.bytes_moved()
    assert b["kv"] == 2 * sum(p.lens) * 2 * 64 * 1
    assert b["total"] == b["kv"] + 2 * 3 * 8 * 64 * 2 + b["block_table_and_lens"]


def test_flashinfer_layout_describes_the_same_problem():
    """The NHD copy and indptr/indices/last_page_len given to FlashInfer, read back the way FlashInfer
    reads them, give the reference output (FlashInfer itself runs on the H200 only)."""
    from hal.bench import baselines, check

    p = data.build(shapes.parse("3x70x8x2x64:ragged"), torch.float8_e4m3fn, "cpu", seed=5)
    lay = baselines._fi_layout(p)
    n, h, d = p.query.shape
    bs, hkv = p.shape.block_size, p.shape.num_kv_heads
    assert lay["k"].shape == (p.key_cache.shape[0], bs, hkv, d)      # [pages, page_size, kv_heads, d]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i in range(n):
        pages = lay["indices"][lay["indptr"][i]:lay["indptr"][i + 1]].long()
        length = (len(pages) - 1) * bs + int(lay["last_page_len"][i])
        assert length == p.lens[i]
        k = lay["k"][pages].reshape(-1, hkv, d)[:length].to(torch.float64) * p.k_scale
        v = lay["v"][pages].reshape(-1, hkv, d)[:length].to(torch.float64) * p.v_scale
        q = p.query[i].to(torch.float64).reshape(hkv, h // hkv, d)
        w = torch.softmax(torch.einsum("hgd,thd->hgt", q, k) * p.scale, dim=-1)
        out[i] = torch.einsum("hgt,thd->hgd", w, v).reshape(h, d)
    ref = check.Reference(p)
    assert check.worst_rel_l2(out, ref.f32) < 1e-5


# ------------------------------------------------------------------------------------------ prefill

def test_prefill_specs_and_sets():
    from hal.bench import prefill

    s = shapes.parse("64x1@4096+2x1024/32x8x128:b64")
    assert isinstance(s, prefill.PrefillShape) and s.op == "prefill"
    assert (s.num_heads, s.num_kv_heads, s.head_size, s.block_size, s.batch, s.gqa) == (32, 8, 128, 64, 66, 4)
    assert [(g.count, g.q, g.context) for g in s.groups] == [(64, (1, 1), (4096, 4096)), (2, (1024, 1024), (0, 0))]
    assert s.spec == "64x1@4096+2x1024/32x8x128:b64" and not s.ragged
    r = shapes.parse("16x100-3000@0-50/32x8x128:b16")
    assert r.spec == "16x100-3000@0-50/32x8x128" and r.ragged and r.groups[0].q == (100, 3000)
    assert shapes.parse("8x2048/32x8x128").spec == "8x2048/32x8x128"
    for bad in ("8x2048/32x8", "8x2048/30x8x128", "8/32x8x128", "8x0/32x8x128", "2x30-10/4x2x64",
                "8x2048/32x8x128:ragged", "8x2048//32x8x128"):
        with pytest.raises(ValueError):
            shapes.parse(bad)
    # the prefill issue's shapes: bf16 and FP8 both run them; head 128, GQA 4, block 16
    main = shapes.resolve(["prefill"])
    assert [x.spec for x in main] == list(shapes.PREFILL) and len(main) == 4
    assert all((x.head_size, x.gqa, x.block_size) == (128, 4, 16) for x in main)
    extra = shapes.resolve(["prefill-extra"])
    assert {x.head_size for x in extra} >= {64, 128, 256} and {x.gqa for x in extra} >= {1, 4, 8}
    assert {x.block_size for x in extra} == {16, 64}
    assert len(shapes.resolve(["prefill", "prefill-sweep"])) == len(shapes.SETS["prefill-sweep"])
    # decode and prefill shapes mix in one list
    assert [x.op for x in shapes.resolve(["tiny", "prefill-tiny"])] == ["decode"] * 2 + ["prefill"] * 5


def test_prefill_problem_rows_lengths_and_flop():
    from hal.bench import prefill

    p = prefill.build(shapes.parse("2x1@30+1x20-30@5+3x4-9/4x2x64:b8"), torch.float8_e4m3fn, "cpu", seed=2)
    assert p.q_lens[:2] == [1, 1] and p.lens[:2] == [31, 31]
    assert p.q_lens[2] == 30 and p.lens[2] == 35                   # a range's first sequence takes its top
    assert p.q_lens[3:5] == [9, 4] and all(4 <= q <= 9 for q in p.q_lens[3:])  # ... and its second the bottom
    assert p.lens[3:] == p.q_lens[3:]                              # no cached context
    assert p.starts == [0, 1, 2, 32, 41, 45, 45 + p.q_lens[5]] and p.query.shape == (p.total_q, 4, 64)
    assert p.query_start_loc.tolist() == p.starts and p.seq_lens.tolist() == p.lens
    # keys attended, counted one row at a time: row t of q rows over L - q cached tokens sees L - q + t + 1
    brute = sum(L - q + t + 1 for q, L in zip(p.q_lens, p.lens) for t in range(q))
    assert p.keys_attended() == brute and p.flop() == 4 * 4 * 64 * brute
    used = torch.cat([p.block_tables[i, :p.pages(i)] for i in range(len(p.lens))])
    assert used.unique().numel() == used.numel() and not torch.equal(used.sort().values, used)
    b = p.bytes_moved()
    assert b["kv"] == 2 * sum(p.lens) * 2 * 64 and b["query"] == b["output"] == p.total_q * 4 * 64 * 2


@pytest.mark.slow
def test_dry_run_exercises_every_path_that_runs_on_a_cpu(tmp_path):
    """``--dry-run``: the tiny decode and prefill sets, checked and timed; what needs CUDA says so."""
    path = tmp_path / "dry.json"
    threads = torch.get_num_threads()
    try:  # one thread: a busy neighbour stalls OpenMP threads (docs/bench.md), and only paths count here
        assert bench.main(["--dry-run", "--device", "cpu", "--threads", "1", "--json", str(path)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(path.read_text())
    assert result["complete"] is True
    rows, problems = result["rows"], result["problems"]
    specs = {x.spec: x for x in shapes.resolve(["tiny", "prefill-tiny"])}
    assert {p["shape"]["spec"] for p in problems} == set(specs) and all(p["reference_ok"] for p in problems)
    assert result["matmul"]["tflops"] > 0 and result["copy_bandwidth"]["gbps"] > 0
    assert result["settings"]["reps"] == 2
    known = contenders_mod.all_contenders()
    for prob in problems:
        op = prob["op"]
        mine = [r for r in rows if (r["shape"], r["kv_dtype"]) == (prob["shape"]["spec"], prob["kv_dtype"])]
        assert [r["contender"] for r in mine] == [c.name for c in known if op in c.ops]
        by = {r["contender"]: r for r in mine}
        for name in ("hal", "emu-torch", contenders_mod.BASELINE):   # what must run on a CPU
            r = by[name]
            assert r["status"] == "ok", r
            assert r["err_f64"] <= r["tolerance"] and r["err_all"] <= r["tolerance"] and r["time_us"] > 0
            if op == "prefill":
                assert r["flop"] == prob["flop"] and r["TFLOPs"] > 0 and r["fraction_of_matmul"] > 0
            else:
                assert r["flop"] is None and r["fraction_of_copy"] > 0
        assert by["hal"]["note"] == "dispatched to emu"
        cuda_only = ("emu-triton", "flashinfer-prefill", "fa3", "fa3-fp8") if op == "prefill" else \
            ("emu-triton", "flashinfer-tc", "flashinfer-cc")
        for name in cuda_only:
            assert by[name]["status"] == "skip" and "GPU" in by[name]["reason"], by[name]
    prefill_rows = [r for r in rows if r["op"] == "prefill"]
    assert {r["kv_dtype"] for r in prefill_rows} == {"bf16", "e4m3fn"}
    fp8_rows = [r for r in prefill_rows if r["contender"] == "fa3-fp8"]
    assert fp8_rows and all(r["tolerance"] is None for r in fp8_rows)   # skipped: no check ran


def _varlen_causal(q, k, v, cu_q, cu_k, scale, hkv):
    """Causal (bottom-right) varlen attention in float64 over packed K/V, the way FA3 reads it."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    h, d = q.shape[1], q.shape[2]
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        nq, L = q1 - q0, k1 - k0
        qi = q[q0:q1].view(nq, hkv, h // hkv, d)
        s = torch.einsum("rhgd,thd->rhgt", qi, k[k0:k1]) * scale
        keep = torch.arange(L)[None, :] <= (torch.arange(nq) + L - nq)[:, None]
        w = torch.softmax(s.masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("rhgt,thd->rhgd", w, v[k0:k1]).reshape(nq, h, d)
    return out


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_fa3_inputs_describe_the_same_problem(kv):
    """The packed K/V, cu_seqlens and descales given to FA3 (a GPU-only kernel), computed with FA3's
    semantics here, give the reference output: bf16 mode within the bf16 tolerance, FP8 mode (Q
    quantized, its descales applied; no P rounding here) well within its own."""
    from hal.bench import prefill, prefill_baselines

    p = prefill.build(shapes.parse("2x1@30+1x9@7+1x20/8x2x64:b8"), kv, "cpu", seed=4)
    ref = prefill.PrefillReference(p)
    modes = [False] + ([True] if kv == torch.float8_e4m3fn else [])
    for fp8_mode in modes:
        (q, k, v, cu_q, cu_k, mq, mk), kw, _ = prefill_baselines.fa3_args(p, fp8_mode)
        assert (mq, mk) == (max(p.q_lens), max(p.lens)) and kw["causal"] and kw["softmax_scale"] == p.scale
        assert k.shape == (sum(p.lens), 2, 64) and cu_k.tolist()[-1] == sum(p.lens) and cu_q is p.query_start_loc
        qf, kf, vf = (x.to(torch.float64) for x in (q, k, v))
        if fp8_mode:
            assert q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn and kw["q_descale"].shape == (4, 2)
            qf = qf * kw["q_descale"][0, 0].item()
            kf, vf = kf * kw["k_descale"][0, 0].item(), vf * kw["v_descale"][0, 0].item()
        else:
            assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        out = _varlen_causal(qf, kf, vf, cu_q, cu_k, kw["softmax_scale"], 2)
        err = ref.check(out.to(torch.bfloat16)).err_f64
        assert err < (prefill_baselines.FA3_FP8_TOLERANCE / 3 if fp8_mode else ref.tolerance), (fp8_mode, err)


def test_flashinfer_prefill_layout_describes_the_same_problem():
    """qo_indptr (= query_start_loc) and the NHD pages FlashInfer's prefill wrapper is planned with,
    read back as FlashInfer reads them (causal: the query rows are the last tokens), give the reference."""
    from hal.bench import baselines, prefill

    p = prefill.build(shapes.parse("2x1@40+1x12@20+1x17/8x2x64"), torch.float8_e4m3fn, "cpu", seed=6)
    lay = baselines._fi_layout(p)
    bs, hkv, d = p.shape.block_size, p.shape.num_kv_heads, p.shape.head_size
    ks, vs, cu_k = [], [], [0]
    for i in range(len(p.lens)):
        pages = lay["indices"][lay["indptr"][i]:lay["indptr"][i + 1]].long()
        length = (len(pages) - 1) * bs + int(lay["last_page_len"][i])
        assert length == p.lens[i]
        ks.append(lay["k"][pages].reshape(-1, hkv, d)[:length].to(torch.float64) * p.k_scale)
        vs.append(lay["v"][pages].reshape(-1, hkv, d)[:length].to(torch.float64) * p.v_scale)
        cu_k.append(cu_k[-1] + length)
    out = _varlen_causal(p.query.to(torch.float64), torch.cat(ks), torch.cat(vs), p.query_start_loc.tolist(),
                         cu_k, p.scale, hkv)
    ref = prefill.PrefillReference(p)
    assert check_rel(out, ref.f32) < 1e-5


def check_rel(a, b):
    from hal.bench import check
    return check.worst_rel_l2(a, b)


def test_prefill_reference_judges_per_row_and_takes_a_tolerance_override():
    """One wrong row among many fails the check (per-row errors, not per-sequence); a contender's own
    tolerance (FA3's FP8 mode) replaces the dtype's."""
    from hal.bench import prefill

    p = prefill.build(shapes.parse("1x40@10/4x2x64"), torch.bfloat16, "cpu")
    ref = prefill.PrefillReference(p)
    good = ref.f32.to(torch.bfloat16)
    assert ref.check(good).ok
    bad = good.clone()
    bad[17] *= 1.1                                     # one row of 40 off by 10%
    v = ref.check(bad)
    assert not v.ok and 0.05 < v.err_f64 < 0.2
    assert ref.check(bad, tolerance=0.2).ok
    assert "float64 on all sequences" in ref.describe() and ref.ref_ok


def test_partial_results_after_every_problem(tmp_path):
    """The run hands its result so far to ``partial`` after each problem (the CLI rewrites its JSON
    with it), so a run stopped by a time limit keeps what it measured."""
    from hal.bench import runner

    seen = []
    opts = runner.Options(device=torch.device("cpu"), reps=2, warmup=1, budget_s=0.2)
    chosen = contenders_mod.select(["emu-torch"])
    result = runner.run(opts, shapes.resolve([PREFILL_TINY, TINY[0]]), [torch.bfloat16], chosen,
                        partial=lambda r: seen.append((r["complete"], len(r["problems"]), len(r["rows"]))))
    assert seen == [(False, 1, 2), (False, 2, 4)]
    assert result["complete"] and result["matmul"]["tflops"] > 0
    assert [r["op"] for r in result["rows"]] == ["prefill"] * 2 + ["decode"] * 2


@pytest.mark.parametrize("spec", ["4x200x8x2x64", "3x100x8x2x64:b16:ragged"])
def test_torch_sdpa_baseline_masks_the_last_blocks_tail(spec):
    """Equal lengths that are not a multiple of the block size: the gathered tail slots (garbage in the
    problem's cache) must be masked; the baseline matches the float64 reference."""
    from hal import reference
    from hal.bench import baselines

    p = data.build(shapes.parse(spec), torch.bfloat16, torch.device("cpu"))
    got = baselines.torch_sdpa(p)()
    ref = reference.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, scale=p.scale)
    assert reference.relative_l2(got, ref) <= 5e-3
