"""hal-bench: time every available hal pack and the baselines side by side, each checked first.

    hal-bench [--shapes issue|sweep|cpu|prefill|prefill-extra|mla|mla-b16|...|SPEC ...] [--kv-dtype bf16,e4m3fn]
              [--device cpu|cuda] [--reps N] [--json PATH] [--plot PATH] [--markdown PATH] [--contenders NAME|GLOB ...]
    hal-bench --dry-run          # tiny decode and prefill shapes, 2 reps: every code path in seconds
    hal-bench --render run.json --markdown run.md   # a saved run as the docs' markdown table, nothing timed

A decode SPEC is BATCHxCONTEXTxQHEADSxKVHEADSxHEADSIZE[:bBLOCK][:ragged], e.g. 64x4096x32x8x128:b16;
a prefill SPEC is GROUP[+GROUP...]/QHEADSxKVHEADSxHEADSIZE[:bBLOCK] with GROUP = NxQ[@C] (N sequences
of Q new tokens over C cached ones; Q and C may be ranges A-B), e.g. 64x1@4096+2x1024/32x8x128;
an MLA decode SPEC (hal.mla_decode) is mla:BATCHxCONTEXTxHEADS[:bPAGE][:qROWS][:ragged][:rR][:pP]
(page 64, one query row per sequence, latent R 512, rotary part P 64 unless given), e.g.
mla:64x4096x128 or mla:16x32768x16:b16; `--dry-run --shapes mla-tiny` runs every MLA code path.
See docs/bench.md for what each column means.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from hal.bench import contenders as contenders_mod
from hal.bench import data, report, runner, shapes
from hal.cli import hal_log_to


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hal-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="shape sets: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in shapes.SETS.items()))
    ap.add_argument("--shapes", nargs="+", metavar="SET|SPEC",
                    help=f"shape sets ({', '.join(shapes.SETS)}) and/or SPECs (decode, prefill or mla:...); default: "
                         f"issue on a GPU, cpu on the CPU (with --dry-run: tiny prefill-tiny)")
    ap.add_argument("--kv-dtype", default="bf16,e4m3fn",
                    help="KV cache dtypes, comma-separated: bf16, fp16, e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, fp8 "
                         "(= this machine's native e4m3); default bf16,e4m3fn")
    ap.add_argument("--query-dtype", default="bf16", choices=("bf16", "fp16"), help="query/output dtype")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible, else cpu")
    ap.add_argument("--reps", type=int, help="timed reps per row (median reported); default 20 GPU, 5 CPU")
    ap.add_argument("--warmup", type=int, help="untimed calls after the checked one; default 3 GPU, 1 CPU")
    ap.add_argument("--budget", type=float,
                    help="seconds of timed reps per row; reps are cut to fit, at least 3 (default 10 GPU, 3 CPU)")
    ap.add_argument("--contenders", nargs="+", metavar="NAME|GLOB",
                    help="which contenders (comma-separated or repeated, globs allowed); default all; "
                         f"{contenders_mod.BASELINE} is always kept")
    ap.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    ap.add_argument("--markdown", metavar="PATH",
                    help="write the run as one markdown table (a row per shape and KV dtype, a column per contender)")
    ap.add_argument("--render", metavar="JSON",
                    help="time nothing: render a run saved with --json (the table; --markdown, --plot as asked)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (torch.set_num_threads); default torch's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-flush", action="store_true", help="do not flush caches between timed calls")
    ap.add_argument("--flashinfer-jit", action="store_true",
                    help="let FlashInfer compile modules that were not prebuilt (slow; off by default); also for "
                         "flashinfer-mla")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes (sets tiny and prefill-tiny unless --shapes), 2 reps, 1 warm-up, 0.5 s per row: "
                         "every contender that can run here, checked and timed, in seconds")
    ap.add_argument("--list", action="store_true", help="list shape sets and contenders, then exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Console(width=None if sys.stdout.isatty() else 200)  # a file or pipe gets whole rows
    err = Console(stderr=True)
    if args.list:
        for name, specs in shapes.SETS.items():
            out.print(f"[bold]{name}[/]: {' '.join(specs)}")
        for c in contenders_mod.all_contenders():
            out.print(f"[bold]{c.name}[/] ({c.kind}; {', '.join(sorted(c.ops))}): {c.what}")
        return 0
    if args.render:
        return _render(args, out, err)
    if args.device == "cuda" and not torch.cuda.is_available():
        err.print("[red]--device cuda: no GPU is visible to torch[/]")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    try:
        default = ["tiny", "prefill-tiny"] if args.dry_run else (["issue"] if gpu else ["cpu"])
        shape_list = shapes.resolve(args.shapes or default)
        kv_dtypes = data.parse_dtypes(args.kv_dtype)
        chosen = contenders_mod.select(args.contenders)
    except ValueError as exc:
        err.print(f"[red]{exc}[/]")
        return 2
    if not shape_list or not kv_dtypes:
        err.print("[red]nothing to run: no shapes or no KV dtypes[/]")
        return 2
    dry = args.dry_run
    opts = runner.Options(
        device=device, reps=args.reps or (2 if dry else 20 if gpu else 5),
        warmup=args.warmup if args.warmup is not None else (1 if dry or not gpu else 3),
        budget_s=args.budget if args.budget is not None else (0.5 if dry else 10.0 if gpu else 3.0),
        seed=args.seed, query_dtype=data.DTYPES[args.query_dtype], flashinfer_jit=args.flashinfer_jit,
        flush=not args.no_flush)

    def partial(res: dict) -> None:  # a run cut short (a time limit) keeps what it measured
        if args.json:
            report.write_json(res | {"command": command}, args.json)

    command = ["hal-bench"] + list(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    with hal_log_to(err), err.status("starting") as status:
        def progress(msg: str) -> None:
            status.update(msg)
            if not err.is_terminal and (": building" in msg or msg.startswith(("copy", "matmul"))):
                print(f"[{time.time() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)  # a log: a line a problem
        result = runner.run(opts, shape_list, kv_dtypes, chosen, progress=progress, partial=partial)
    result["command"] = command
    report.render(result, out)
    if args.plot:
        path, msg = report.plot(result, args.plot)
        result["plot"] = {"path": str(path) if path else None, "message": msg}
        out.print(msg)
    if args.markdown:
        out.print(f"markdown written to {_write(args.markdown, report.markdown(result))}")
    if args.json:
        out.print(f"JSON written to {report.write_json(result, args.json)}")
    return 0


def _write(path: str, text: str) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def _render(args: argparse.Namespace, out: Console, err: Console) -> int:
    try:
        result = json.loads(Path(args.render).read_text())
        if not result["rows"]:
            err.print(f"[red]--render {args.render}: the run has no rows[/]")
            return 2
        md = report.markdown(result)   # reads every row, so a malformed file fails here, before any output
        report.render(result, out)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        err.print(f"[red]--render {args.render}: not a hal-bench JSON file ({type(exc).__name__}: {exc})[/]")
        return 2
    if args.plot:
        out.print(report.plot(result, args.plot)[1])
    if args.markdown:
        out.print(f"markdown written to {_write(args.markdown, md)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
