"""``hal-scales``: look at KV-cache scales before trusting them, and write them as JSON.

    hal-scales inspect SOURCE [--num-layers N] [--tp-rank R --tp-size S] [--model-type T]
    hal-scales convert SOURCE --to-json OUT [--encoding e4m3fnuz]

``inspect`` prints one row per layer and flags what usually means a calibration went wrong: 1.0
everywhere (uncalibrated defaults), k and v identical in every layer (a legacy single scale, or a
copy), and layers far from the median. ``convert`` loads any source :func:`hal.load_kv_scales`
reads, converts to ``--encoding`` (e4m3fn -> e4m3fnuz doubles the scales) and writes vLLM's schema;
OUT's folder must exist (it is not created). Every error is one line on stderr.
Exit status: 0 on success, 1 when the scales do not load or OUT cannot be written (the error says why),
2 for bad usage.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import sys

import torch
from rich.console import Console
from hal.cli import hal_log_to
from rich.markup import escape
from rich.table import Table

from hal.scales import KVScaleError, KVScales, load_kv_scales, same_scale

OUTLIER_RATIO = 10.0  # a layer's scale this far above or below the median is flagged


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hal-scales", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("source", help="JSON scale file, .safetensors file, or checkpoint directory")
    common.add_argument("--num-layers", type=int, default=None, help="the model's layer count (checked)")
    common.add_argument("--tp-rank", type=int, default=0)
    common.add_argument("--tp-size", type=int, default=None)
    common.add_argument("--model-type", default=None, help="checked against the file / config.json")
    common.add_argument("--on-missing", choices=("error", "one"), default="error",
                        help="'one': use 1.0 for layers without scales (reported)")
    sub.add_parser("inspect", parents=[common], help="print the scales per layer and flag suspicious ones")
    conv = sub.add_parser("convert", parents=[common], help="write the scales as a JSON scale file")
    conv.add_argument("--to-json", required=True, metavar="OUT", help="where to write the JSON file")
    conv.add_argument("--encoding", default=None,
                      help="FP8 encoding of the cache the file is for, e.g. e4m3fnuz (MI300); "
                           "default: the encoding the scales were calibrated for")
    return p


def _show(s) -> str:
    if isinstance(s, torch.Tensor):
        return f"{float(s.min()):.6g} .. {float(s.max()):.6g} ({s.numel()} heads)"
    return f"{s:.6g}"


def _peak(s) -> float:
    return float(s.max()) if isinstance(s, torch.Tensor) else float(s)


def suspicious(scales: KVScales) -> tuple[list[str], dict[int, list[str]]]:
    """Findings about the whole set, and per layer: what a person should look at before trusting
    these scales. Never an error: a real model can have any of these for a reason."""
    overall: list[str] = []
    per_layer: dict[int, list[str]] = {}
    values = [(_peak(k), _peak(v)) for k, v in scales]
    if values and all(k == 1.0 and v == 1.0 for k, v in values):
        overall.append("every scale is 1.0: these look like uncalibrated defaults, not calibrated scales")
    elif len(values) > 1 and all(same_scale(k, v) for k, v in scales):
        overall.append("k and v scales are identical in every layer: a legacy single kv_scale or a "
                       "copy; fine only if the calibration really produced one scale per layer")
    for role, idx in (("k", 0), ("v", 1)):
        column = [pair[idx] for pair in values]
        if len(column) < 3:
            continue
        median = statistics.median(column)
        for layer, x in enumerate(column):
            ratio = x / median
            if ratio > OUTLIER_RATIO or ratio < 1 / OUTLIER_RATIO:
                per_layer.setdefault(layer, []).append(f"{role} is {ratio:.3g}x the median {role} scale")
    return overall, per_layer


def _inspect(scales: KVScales, console: Console) -> None:
    overall, per_layer = suspicious(scales)
    kind = f"per head ({scales.num_kv_heads} KV heads)" if scales.per_head else "per tensor"
    console.print(f"[bold]KV scales[/]: {escape(scales.source)}")
    console.print(f"{len(scales)} layers, {kind}, calibrated for {scales.encoding.name}"
                  + (f", model type {scales.model_type}" if scales.model_type else ""), highlight=False)
    table = Table()
    table.add_column("layer", justify="right")
    table.add_column("k_scale", justify="right")
    table.add_column("v_scale", justify="right")
    table.add_column("note")
    for layer, (k, v) in enumerate(scales):
        notes = per_layer.get(layer, [])
        table.add_row(str(layer), _show(k), _show(v), "[yellow]" + "; ".join(notes) + "[/]" if notes else "",
                      style="bold" if notes else None)
    console.print(table)
    for line in overall:
        console.print(f"[yellow]warning:[/] {line}")


def _output_problem(out: str) -> str | None:
    """Why ``--to-json OUT`` cannot be written, before anything is loaded; None if it can be tried.
    A missing folder is refused, not created: a mistyped path should not grow a directory tree."""
    path = pathlib.Path(out).expanduser()
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        return (f"--to-json {out}: the folder {folder} {what}; expected an existing folder "
                f"(hal-scales does not create folders: mkdir -p it first)")
    if path.is_dir():
        return f"--to-json {out}: {path} is a folder; expected the path of the JSON file to write"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Console()
    err = Console(stderr=True)
    with hal_log_to(err, level=logging.INFO, show_time=False):
        try:
            problem = _output_problem(args.to_json) if args.command == "convert" else None
            if problem:
                raise KVScaleError(problem)
            scales = load_kv_scales(args.source, num_layers=args.num_layers, tp_rank=args.tp_rank,
                                    tp_size=args.tp_size, model_type=args.model_type, on_missing=args.on_missing)
            if args.command == "inspect":
                _inspect(scales, out)
            else:
                target = scales.for_encoding(args.encoding) if args.encoding else scales
                target.to_json(args.to_json)
                note = (f", converted from {scales.encoding.name}" if target.encoding != scales.encoding else "")
                out.print(f"wrote {args.to_json}: {len(target)} layers for {target.encoding.name}{note}")
            return 0
        except (KVScaleError, ValueError, TypeError) as exc:
            return _error(err, str(exc))
        except OSError as exc:  # writing --to-json (the loader reports its own as KVScaleError)
            return _error(err, f"{exc.filename or args.source}: {exc.strerror or exc}")


def _error(err: Console, message: str) -> int:
    err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # one line, unwrapped
    return 1


if __name__ == "__main__":
    sys.exit(main())
