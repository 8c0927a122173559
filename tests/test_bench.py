"""CPU smoke test of hal-bench: tiny shapes through main() with --json; every contender appears,
every timed row carries its correctness figures, and a wrong or crashing contender is a FAIL row that
does not stop the run."""

from __future__ import annotations

import json

import pytest
import torch

from hal.bench import contenders as contenders_mod
from hal.bench import data, shapes
from hal.bench.contenders import Contender, Prepared
from hal.cli import bench

TINY = ["2x64x4x2x64", "3x100x8x2x64:b32:ragged"]
FAST = ["--device", "cpu", "--reps", "2", "--warmup", "1", "--budget", "0.5", "--kv-dtype", "bf16,e4m3fn"]


def _run(tmp_path, *extra):
    path = tmp_path / "bench.json"
    rc = bench.main(["--shapes", *TINY, *FAST, "--json", str(path), "--plot", str(tmp_path / "b.png"), *extra])
    assert rc == 0
    return json.loads(path.read_text())


def test_every_contender_has_a_row_and_a_correctness_figure(tmp_path):
    result = _run(tmp_path)
    names = [c.name for c in contenders_mod.all_contenders()]
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


def test_wrong_and_crashing_contenders_fail_without_stopping_the_run(tmp_path, monkeypatch):
    known = contenders_mod.all_contenders()
    extra = [Contender(f"bad-{k}", "test", k, _bad(k)) for k in ("raise", "wrong", "partial")]
    monkeypatch.setattr(contenders_mod, "all_contenders", lambda: known + extra)
    result = _run(tmp_path, "--contenders", "emu-torch,bad-*", "--shapes", TINY[0])
    rows = {(r["shape"], r["kv_dtype"], r["contender"]): r for r in result["rows"]}
    for kv in ("bf16", "e4m3fn"):
        base = TINY[0]
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
