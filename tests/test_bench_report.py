"""hal-bench's markdown table and `--render` of a saved run (no timing: a hand-made result)."""

from __future__ import annotations

import json

from hal.bench import report
from hal.cli import bench


def _row(shape, kv, who, status="ok", **kw):
    r = {"shape": shape, "op": "mla", "kv_dtype": kv, "contender": who, "kind": "hal", "status": status,
         "reason": "", "note": "", "time_us": None, "host_us": None, "GBps": None, "fraction_of_copy": None,
         "TFLOPs": None, "fraction_of_matmul": None, "speedup_vs_baseline": None, "err_all": None,
         "err_f64": None, "tolerance": 5e-3}
    return r | kw


def _result():
    rows = [_row("mla:64x4096x16", "e4m3fn", "hal", time_us=86.71, TFLOPs=101.2, fraction_of_copy=0.4651,
                 err_f64=1.7e-3, speedup_vs_baseline=20.0),
            _row("mla:64x4096x16", "e4m3fn", "flashmla", "skip", reason="bf16 only"),
            _row("mla:64x4096x16", "e4m3fn", "flashmla-fp8", time_us=67.0, TFLOPs=135.0, fraction_of_copy=0.59,
                 err_f64=6.0e-2),
            _row("mla:64x4096x16", "e4m3fn", "never", "skip", reason="not here"),
            _row("mla:64x4096x16", "bf16", "hal", "FAIL", reason="wrong"),
            _row("mla:64x4096x16", "bf16", "flashmla", time_us=1234.5, TFLOPs=90.0, fraction_of_copy=0.78,
                 err_f64=2e-3),
            _row("64x4096x32x8x128", "e4m3fn", "hal", time_us=100.0, fraction_of_copy=0.9, op="decode")]
    return {"device": {"type": "cuda", "name": "NVIDIA H200", "torch": "x", "hal": "y"},
            "copy_bandwidth": {"gbps": 4230.0, "method": "m"}, "matmul": {"tflops": 788.0, "method": "m"},
            "settings": {"baseline": "torch", "timer": "t"}, "problems": [], "rows": rows, "complete": False}


def test_markdown_pivots_rows_by_problem_and_columns_by_contender():
    md = report.markdown(_result()).splitlines()
    assert md[0].startswith("NVIDIA H200: copy 4.23 TB/s, bf16 matmul 788 TFLOP/s") and "partial" in md[0]
    assert md[2] == "| shape | kv | hal | flashmla | flashmla-fp8 |"       # a contender skipped everywhere: no column
    assert md[4] == "| mla:64x4096x16 | e4m3fn | 86.7 (101 TF, 0.47) | - | 67.0 (135 TF, 0.59) [err 6.0e-02] |"
    assert md[5] == "| mla:64x4096x16 | bf16 | FAIL | 1,234.5 (90 TF, 0.78) | - |"
    assert md[6] == "| 64x4096x32x8x128 | e4m3fn | 100.0 (0.90) | - | - |"   # decode: no FLOP column
    assert len(md) == 7


def test_render_a_saved_run_and_refuse_what_is_not_one(tmp_path):
    saved, md = tmp_path / "run.json", tmp_path / "t" / "run.md"
    saved.write_text(json.dumps(_result()))
    assert bench.main(["--render", str(saved), "--markdown", str(md)]) == 0
    assert md.read_text() == report.markdown(_result())
    assert bench.main(["--render", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text('{"rows": [1]}')
    assert bench.main(["--render", str(tmp_path / "bad.json")]) == 2
    (tmp_path / "rows.json").write_text(json.dumps(_result() | {"rows": [{"shape": "x"}]}))
    assert bench.main(["--render", str(tmp_path / "rows.json")]) == 2      # a row without its fields
    (tmp_path / "list.json").write_text("[]")
    assert bench.main(["--render", str(tmp_path / "list.json")]) == 2
    empty = _result() | {"rows": []}
    (tmp_path / "empty.json").write_text(json.dumps(empty))
    assert bench.main(["--render", str(tmp_path / "empty.json")]) == 2
