"""tools/tune: choose the cuda pack's launch parameters per shape class on this GPU.

For each shape class of ``packs/cuda/tuning.json`` (fp8 | 16bit cache x short | long context) it
times ``hal.paged_attention`` on a few representative shapes under every candidate of a small grid
(``ctas_per_sm`` x ``waves`` x ``min_partition`` x ``warp_rows``), scores a candidate by
the geometric mean over the shapes of its time relative to the best candidate's time for that shape,
and keeps the best. Every candidate's output is compared with the first one's (a split of the context
changes only the order of float sums). ``--write`` stores the result under this GPU's arch.
``--prefill`` chooses the multi-token kernel per head size instead (packs/cuda/tune_prefill.py).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys

import torch

from hal import dtypes

CLASS_SHAPES = {
    "long": ["64x4096x32x8x128", "16x32768x32x8x128", "32x8192x64x8x128", "4x16384x32x8x128",
             "1x32768x32x8x128", "32x8192x32x8x64:ragged"],
    "short": ["256x1024x32x8x128", "128x2048x32x8x128", "64x2048x32x8x128", "32x1024x32x8x128", "128x512x32x4x64:ragged"],
}
WIDTH_DTYPES = {"fp8": torch.float8_e4m3fn, "16bit": torch.bfloat16}
# A call aims for sms * ctas_per_sm * waves CTAs; the grid spans 3 to 24 CTAs per SM in all.
CTAS_PER_SM = (3, 4)
WAVES = (1, 1.5, 2, 3, 4, 6)
MIN_PARTITIONS = (256, 512, 1024)
# A warp per row from warp_rows x the target CTA count of rows (0: never); see tuning.warp_rows.
WARP_ROWS = (0, 2)


def candidates(ctas_per_sm=CTAS_PER_SM, waves=WAVES, min_partitions=MIN_PARTITIONS, warp_rows=WARP_ROWS) -> list[dict]:
    return [{"ctas_per_sm": c, "waves": w, "min_partition": m, "warp_rows": r}
            for c, w, m, r in itertools.product(ctas_per_sm, waves, min_partitions, warp_rows)]


def _numbers(text: str, kind=float) -> tuple:
    """``"1,1.5"`` -> (1, 1.5): comma-separated numbers (floats that are whole become ints)."""
    xs = tuple(kind(x) for x in text.split(",") if x.strip())
    return tuple(int(x) if isinstance(x, float) and x.is_integer() else x for x in xs)


def score(times: dict[str, list[float]], n: int) -> list[float]:
    """Per candidate: the geometric mean over shapes of its time / the best time for that shape
    (1.0: best on every shape)."""
    best = {s: min(r) for s, r in times.items()}
    return [math.exp(sum(math.log(times[s][i] / best[s]) for s in times) / len(times)) for i in range(n)]


def _time_shape(spec: str, kv: torch.dtype, cands: list[dict], timer, device, budget_s: float) -> list[float]:
    """Median time of ``hal.paged_attention`` on the cuda pack for each candidate, on one shape."""
    import hal
    from hal.bench import data, shapes

    from . import tuning

    prob = data.build(shapes.parse(spec), kv, device)
    kw = {"k_scale": prob.k_scale, "v_scale": prob.v_scale} if prob.k_scale is not None else {}
    out = torch.empty_like(prob.query)

    # max_seq_len given, as an engine would: without it the call reads seq_lens back (a host sync
    # inside the timed interval) and the timing would include launch overhead.
    def call():
        hal.paged_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_tables, prob.seq_lens,
                            scale=prob.scale, out=out, pack="cuda", max_seq_len=prob.max_seq_len, **kw)

    row, first = [], None
    for c in cands:
        tuning.set_override(c)
        try:
            call()
            got = out.float().clone()
            if first is None:
                first = got
            elif not torch.allclose(got, first, rtol=1e-2, atol=1e-3):
                raise RuntimeError(f"{spec} {c}: the output differs from the first candidate's "
                                   f"(max abs diff {(got - first).abs().max().item():.3g})")
            row.append(timer.run(call, reps=20, warmup=2, budget_s=budget_s).median_s)
        finally:
            tuning.set_override(None)
    return row


def tune_class(cls: str, timer, device, budget_s: float, cands: list[dict] | None = None) -> dict:
    from . import launch, tuning

    width, length = cls.split("-")
    kv = WIDTH_DTYPES[width]
    cands = cands or candidates()
    times = {spec: _time_shape(spec, kv, cands, timer, device, budget_s) for spec in CLASS_SHAPES[length]}
    scores = score(times, len(cands))
    pick = min(range(len(cands)), key=lambda i: (scores[i], i))
    current = tuning.tuning_for(launch._device_facts(device.index or 0)[1], cls)
    cur_i = next((i for i, c in enumerate(cands) if c == current), None)
    return {"class": cls, "kv_dtype": dtypes.name(kv), "shapes": list(times),
            "candidates": cands, "times_s": times, "scores": scores, "best": cands[pick],
            "best_score": scores[pick], "current": current,
            "current_score": None if cur_i is None else scores[cur_i]}


def _stamp_with_history(stamp: dict, old: dict | None) -> dict:
    """The entry's new ``measured`` stamp. Earlier stamps that still account for a class (one no newer
    run retuned) are kept under ``earlier``, newest first, so every class's values keep the command
    that chose them (a stamp without ``classes`` covered them all)."""
    if not old:
        return stamp
    from .tuning import CLASSES

    covered = set(stamp["classes"])
    earlier = []
    for st in ({k: v for k, v in old.items() if k != "earlier"}, *old.get("earlier", [])):
        own = set(st.get("classes", CLASSES))
        if own - covered:
            earlier.append(st)
        covered |= own
    return {**stamp, "earlier": earlier} if earlier else stamp


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="tools/tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", default="fp8-long,fp8-short,16bit-long,16bit-short",
                    help="comma-separated shape classes to tune")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of timed reps per shape and candidate")
    ap.add_argument("--ctas-per-sm", default=",".join(map(str, CTAS_PER_SM)), help="candidates, comma-separated")
    ap.add_argument("--waves", default=",".join(map(str, WAVES)), help="candidates, comma-separated")
    ap.add_argument("--min-partition", default=",".join(map(str, MIN_PARTITIONS)),
                    help="candidates (tokens, multiples of 64), comma-separated")
    ap.add_argument("--warp-rows", default=",".join(map(str, WARP_ROWS)),
                    help="candidates (0: never a warp per row; f: from f x the target CTA count of rows), comma-separated")
    ap.add_argument("--write", action="store_true", help="store the choices in packs/cuda/tuning.json under this arch")
    ap.add_argument("--json", help="write every timing here")
    ap.add_argument("--prefill", action="store_true",
                    help="instead: time the multi-token kernels (mma.sync vs the sm_90a wgmma one) per head size and "
                         "choose the tuning entry's prefill.wgmma_head_sizes (packs/cuda/tune_prefill.py)")
    ap.add_argument("--head-sizes", default="64,128,192", help="--prefill: head sizes to time, comma-separated")
    ap.add_argument("--margin", type=float, default=0.02,
                    help="--prefill: the wgmma kernel must win by this fraction on the geometric mean and lose by "
                         "no more on any shape")
    args = ap.parse_args(argv)
    console = Console()
    if args.prefill:
        from . import tune_prefill
        return tune_prefill.run(args, console, " ".join(argv if argv is not None else sys.argv[1:]))
    try:
        grid = {"--ctas-per-sm": _numbers(args.ctas_per_sm, int), "--waves": _numbers(args.waves),
                "--min-partition": _numbers(args.min_partition, int), "--warp-rows": _numbers(args.warp_rows)}
    except ValueError as exc:
        console.print(f"[red]tools/tune: candidates must be comma-separated numbers ({exc})[/red]")
        return 2
    for flag, values in grid.items():
        need_64, zero_ok = flag == "--min-partition", flag == "--warp-rows"
        if not values or any(v < 0 or (v == 0 and not zero_ok) or (need_64 and v % 64) for v in values):
            what = ("positive multiples of 64" if need_64 else "numbers >= 0" if zero_ok else "positive numbers")
            console.print(f"[red]tools/tune: {flag} expects {what}, got {', '.join(map(str, values)) or 'none'}[/red]")
            return 2
    cands = candidates(*grid.values())
    if not torch.cuda.is_available():
        console.print("[red]tools/tune needs an NVIDIA GPU (the cuda pack)[/red]")
        return 2
    from hal.bench.timing import Timer

    from . import launch, tuning

    device = torch.device("cuda", torch.cuda.current_device())
    arch = launch._device_facts(device.index)[1]
    timer = Timer(device)
    results = []
    for cls in args.classes.split(","):
        res = tune_class(cls.strip(), timer, device, args.budget, cands)
        results.append(res)
        t = Table(title=f"{cls} ({res['kv_dtype']} cache) on {torch.cuda.get_device_name(device)} ({arch})")
        t.add_column("ctas/SM")
        t.add_column("waves")
        t.add_column("min_partition")
        t.add_column("warp_rows")
        for s in res["shapes"]:
            t.add_column(s + " µs", justify="right")
        t.add_column("score", justify="right")
        for i, c in enumerate(res["candidates"]):
            mark = " *" if c == res["best"] else ""
            t.add_row(str(c["ctas_per_sm"]), str(c["waves"]), str(c["min_partition"]), str(c["warp_rows"]),
                      *[f"{res['times_s'][s][i] * 1e6:.1f}" for s in res["shapes"]], f"{res['scores'][i]:.3f}{mark}")
        console.print(t)
        cur = res["current_score"]
        console.print(f"{cls}: best {res['best']} (score {res['best_score']:.3f}); the table's current entry "
                      f"{res['current']} scores {'n/a' if cur is None else f'{cur:.3f}'}")
    stamp = {"device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
             "command": "tools/tune " + " ".join(argv if argv is not None else sys.argv[1:]),
             "torch": torch.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": arch, **stamp, "results": results}, f, indent=1)
    if args.write:
        table = json.loads(tuning.TUNING_FILE.read_text())
        entry = table.setdefault(arch, {"classes": dict(table["default"]["classes"])})
        for res in results:
            entry["classes"][res["class"]] = res["best"]
        entry["measured"] = _stamp_with_history({**stamp, "classes": [r["class"] for r in results]},
                                                entry.get("measured"))
        tuning.TUNING_FILE.write_text(json.dumps(table, indent=2) + "\n")
        tuning.tuning_table.cache_clear()
        console.print(f"wrote {arch} into {tuning.TUNING_FILE}")
    return 0
