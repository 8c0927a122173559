"""Rendering a run: a rich table (the copy bandwidth and, with prefill shapes, the matmul ceiling
first), the JSON file, a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hal.bench.mla import TOLERANCE as MLA_TOLERANCE  # the 16-bit bound; a row over it shows its error

STATUS_STYLE = {"ok": "green", "FAIL": "bold red", "skip": "dim"}


def _f(x, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def render(result: dict, console: Console) -> None:
    dev = result["device"]
    copy = result["copy_bandwidth"]
    s = result["settings"]
    console.print(f"[bold]hal-bench[/] on {dev['type']}: {dev.get('name', '')} (torch {dev['torch']}, "
                  f"hal {dev['hal']})")
    console.print(f"[bold]copy bandwidth: {copy['gbps']:.1f} GB/s[/] ({copy['method']})")
    mm = result.get("matmul")
    if mm:
        console.print(f"[bold]matmul: {mm['tflops']:.2f} TFLOP/s[/] ({mm['method']})")
    load = result.get("load_average") or {}
    if dev["type"] == "cpu" and load.get("before"):
        console.print(f"[dim]load average (1/5/15 min) before {load['before']}, after {load['after']} on "
                      f"{dev.get('cpus')} CPUs, {dev.get('torch_threads')} torch threads: CPU timings need a quiet "
                      f"machine[/]")
    # a contender skipped for one and the same reason on every problem gets one line under the table
    rows = result["rows"]
    reasons: dict[str, set] = {}
    for r in rows:
        reasons.setdefault(r["contender"], set()).add(r["reason"] if r["status"] == "skip" else None)
    skipped_everywhere = {c: next(iter(rs)) for c, rs in reasons.items() if len(rs) == 1 and None not in rs}
    ops = {r.get("op", "decode") for r in rows}
    # MLA rows fill both: bandwidth (decode's ceiling) and TFLOP/s (prefill's); 128 heads are compute-bound
    decode_cols, prefill_cols = bool(ops & {"decode", "mla"}), bool(ops & {"prefill", "mla"})
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    right = {"justify": "right"}
    cols = [("shape", {"overflow": "fold", "max_width": 28}), ("kv", {}), ("contender", {}), ("status", {}),
            ("time µs", right), ("host µs", right)]
    if decode_cols:
        cols += [("GB/s", right), ("of copy", right)]
    if prefill_cols:
        cols += [("TFLOP/s", right), ("of mm", right)]
    cols += [(f"vs {s['baseline']}", right), ("err all", right), ("err f64", right),
             ("note / reason", {"overflow": "fold", "max_width": 60})]
    for col, kw in cols:
        table.add_column(col, **kw)
    previous = None
    for r in rows:
        if r["contender"] in skipped_everywhere:
            continue
        key = (r["shape"], r["kv_dtype"])
        if previous is not None and key != previous:
            table.add_section()
        first = key != previous
        previous = key
        speed = r["speedup_vs_baseline"]
        op = r.get("op", "decode")
        pre = op == "prefill"
        cells = [r["shape"] if first else "", r["kv_dtype"] if first else "", r["contender"],
                 Text(r["status"], style=STATUS_STYLE.get(r["status"], "")),
                 _f(r["time_us"], ",.1f"), _f(r.get("host_us"), ",.0f")]
        if decode_cols:
            cells += ["", ""] if pre else [_f(r["GBps"], ".2f"), _f(r["fraction_of_copy"], ".3f")]
        if prefill_cols:
            cells += [_f(r.get("TFLOPs"), ".3g"), _f(r.get("fraction_of_matmul"), ".3g")] if op in ("prefill", "mla") \
                else ["", ""]
        cells += ["" if speed is None else f"{speed:.2f}x", _f(r["err_all"], ".1e"), _f(r["err_f64"], ".1e"),
                  " ".join(x for x in (r["note"], r["reason"]) if x)]
        table.add_row(*cells)
    console.print(table)
    for name, why in skipped_everywhere.items():
        console.print(f"[dim]{name}: skipped on every problem: {why}[/]")
    tol = sorted({r["tolerance"] for r in result["rows"] if r["tolerance"] is not None})
    legend = f"[dim]time: median of the timed reps after warm-up ({s['timer']}, caches flushed between calls); "
    if "decode" in ops:
        legend += ("GB/s: bytes the op must move (KV referenced + query + output + block table + seq_lens) / time; "
                   "of copy: GB/s / copy bandwidth; ")
    if "prefill" in ops:
        legend += ("TFLOP/s: 4 x heads x head_size x (sum over query rows of the keys each attends) / time; "
                   "of mm: TFLOP/s / the bf16 matmul's; ")
    if "mla" in ops:
        legend += ("MLA rows: bytes = latent and rotary part of every referenced token + query + output + tables, "
                   "FLOP = 2 x heads x (2R + P) x keys attended, checked to 5e-3 (FLAGGED rows round to FP8 on "
                   "purpose and are checked to their own bound); ")
    legend += (f"Checked before timing: err all = worst per-sequence (decode) or per-row (prefill, MLA) relative L2 "
               f"error vs the emu torch path in float32 (every sequence), err f64 = the same vs float64 on a subset "
               f"of sequences; tolerance {', '.join(f'{t:.2g}' for t in tol) or '-'}. A FAIL row is not timed.[/]")
    console.print(legend)
    for prob in result["problems"]:
        if not prob.get("reference_ok", True) or prob.get("error"):
            console.print(f"[red]{prob['shape']['spec']} {prob['kv_dtype']}: "
                          f"{prob.get('error') or prob['reference']}[/]")


def _fraction(r: dict):
    """A row's fraction of its ceiling: of the matmul's TFLOP/s for prefill, else of the copy bandwidth."""
    return r.get("fraction_of_matmul") if r.get("op") == "prefill" else r.get("fraction_of_copy")


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def plot(result: dict, path: str | Path) -> tuple[Path | None, str]:
    """A grouped bar chart of the fraction of copy bandwidth per problem and contender. Returns the
    path written, or None and the reason it was skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken backend
        return None, f"plot skipped: matplotlib is not importable ({type(exc).__name__}: {exc})"
    ok = [r for r in result["rows"] if r["status"] == "ok" and _fraction(r) is not None]
    if not ok:
        return None, "plot skipped: no timed rows"
    groups = list(dict.fromkeys(f"{r['shape']}\n{r['kv_dtype']}" for r in ok))
    names = list(dict.fromkeys(r["contender"] for r in ok))
    frac = {(f"{r['shape']}\n{r['kv_dtype']}", r["contender"]): _fraction(r) for r in ok}
    ops = {r.get("op", "decode") for r in ok}
    frac_label = " / ".join(x for x, o in (("fraction of copy bandwidth", "decode"), ("fraction of matmul TFLOP/s",
                                                                                      "prefill")) if o in ops)
    speed = {(f"{r['shape']}\n{r['kv_dtype']}", r["contender"]): r["speedup_vs_baseline"] for r in ok
             if r["speedup_vs_baseline"]}
    width = 0.8 / max(1, len(names))
    fig, axes = plt.subplots(2, 1, sharex=True,
                             figsize=(max(7.0, 0.3 * len(groups) * max(2, len(names)) + 2), 7.5))
    for ax, values, label in ((axes[0], frac, frac_label),
                              (axes[1], speed, f"speed-up vs {result['settings']['baseline']}")):
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i, g in enumerate(groups) if (g, name) in values]
            ys = [values[(g, name)] for g in groups if (g, name) in values]
            ax.bar(xs, ys, width, label=name)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", linewidth=0.3)
    if max(frac.values()) > 0.5:
        axes[0].axhline(1.0, color="grey", linewidth=0.6)
    axes[1].axhline(1.0, color="grey", linewidth=0.6)
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels(groups, fontsize=7, rotation=30 if len(groups) > 6 else 0)
    dev = result["device"]
    mm = result.get("matmul")
    axes[0].set_title(f"hal-bench on {dev.get('name', dev['type'])}: copy bandwidth "
                      f"{result['copy_bandwidth']['gbps']:.0f} GB/s"
                      + (f", bf16 matmul {mm['tflops']:.1f} TFLOP/s" if mm else ""), fontsize=9)
    axes[0].legend(fontsize=7, ncol=min(4, len(names)))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, f"plot written to {path}"


def _cell(r: dict) -> str:
    """One markdown cell: time in µs, then (TFLOP/s where the op counts FLOP, fraction of copy or of
    the matmul), then the error against float64 where it is over 5e-3 (FLAGGED rows)."""
    if r["status"] != "ok":
        return r["status"]
    op = r.get("op", "decode")
    parts = []
    if op in ("prefill", "mla") and r.get("TFLOPs") is not None:
        parts.append(f"{r['TFLOPs']:.3g} TF")
    frac = _fraction(r)
    if frac is not None:
        parts.append(f"{frac:.2f}")
    cell = f"{r['time_us']:,.1f}" + (f" ({', '.join(parts)})" if parts else "")
    err = r.get("err_f64")
    if err is not None and err > MLA_TOLERANCE:
        cell += f" [err {err:.1e}]"
    return cell


def markdown(result: dict) -> str:
    """The run as one markdown table for the docs: a row per (shape, KV dtype), a column per
    contender, each cell as :func:`_cell` writes it; skips are `-`, failures `FAIL`. A caption line
    gives the device and the copy bandwidth (and matmul) measured in the same run."""
    rows = result["rows"]
    names = list(dict.fromkeys(r["contender"] for r in rows))
    names = [n for n in names if any(r["contender"] == n and r["status"] != "skip" for r in rows)]
    by_key: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["shape"], r["kv_dtype"]), {})[r["contender"]] = r
    dev, copy, mm = result["device"], result["copy_bandwidth"], result.get("matmul")
    caption = (f"{dev.get('name', dev['type'])}: copy {copy['gbps'] / 1000:.2f} TB/s"
               + (f", bf16 matmul {mm['tflops']:.0f} TFLOP/s" if mm else "") + " measured in the same run; "
               "time in µs (TFLOP/s, fraction of copy; of the matmul for prefill); [err] = relative L2 vs float64 "
               f"where over {MLA_TOLERANCE:.0e}" + ("" if result.get("complete", True) else "; the run was cut short (partial)"))
    lines = [caption, "", "| shape | kv | " + " | ".join(names) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in names) + " |"]
    for (shape, kv), cells in by_key.items():
        vals = [_cell(cells[n]) if n in cells and cells[n]["status"] != "skip" else "-" for n in names]
        lines.append(f"| {shape} | {kv} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"
