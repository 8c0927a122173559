"""Perplexity and KL divergence of a causal LM on a text, with the KV cache in hal or simulated.

Every variant sees the same token windows ``[windows, length]`` (each window starts with an empty
cache, its first token is context only; :func:`text_windows` starts every window with the
tokenizer's BOS when the tokenizer puts one before a text, as the model saw in training), processed
chunk by chunk, all variants in lockstep so the reference's log-probabilities are needed one chunk
at a time (never the whole ``[tokens, vocab]``):

- ``stock``: the model's own attention (SDPA) with an unquantized (model dtype) cache: the reference;
- ``hal``: attention through :func:`hal.cache_kv` + :func:`hal.paged_attention` with the cache in
  the variant's encoding (:class:`~hal.integrations.transformers.HalRunner`: each chunk of all
  windows is one multi-token call per layer);
- ``roundtrip``: stock attention over K/V round-tripped through the encoding in plain PyTorch
  (:class:`~hal.integrations.transformers.RoundTrip`), the simulation hal must reproduce.

Per variant: perplexity ``exp(mean NLL)``, KL divergence per token ``KL(P_stock || P_variant)``
(natural log), the share of positions whose top-1 token equals the reference's, and time. With
``decode_steps``, each window is then extended by greedy decode steps to time true decoding at the
window's context length.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch

import hal
from hal.integrations.models import cache_keyword
from hal.integrations.transformers import ROUNDTRIP_NAME, HalRunner, RoundTrip, using

__all__ = ["Result", "Variant", "bos_token_id", "evaluate", "make_windows", "text_windows"]

log = logging.getLogger("hal")


@dataclasses.dataclass
class Variant:
    kind: str                              # "stock" | "hal" | "roundtrip"
    cache_dtype: torch.dtype | None = None  # None for stock
    scales: "hal.KVScales | None" = None

    @property
    def name(self) -> str:
        return self.kind if self.cache_dtype is None else f"{self.kind} {dtype_name(self.cache_dtype)}"


@dataclasses.dataclass
class Result:
    variant: Variant
    tokens: int = 0
    nll: float = 0.0
    kl: float = 0.0
    kl_max: float = 0.0
    same_top1: int = 0
    seconds: float = 0.0
    prompt_tokens: int = 0                 # tokens run through the forward passes ``seconds`` measures
    decode_steps: int = 0
    decode_seconds: float = 0.0
    pack: str | None = None

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else math.nan

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens if self.tokens else math.nan

    @property
    def top1(self) -> float:
        return self.same_top1 / self.tokens if self.tokens else math.nan

    def as_dict(self, reference_ppl: float | None = None) -> dict:
        d = {"variant": self.variant.name, "kind": self.variant.kind,
             "cache_dtype": dtype_name(self.variant.cache_dtype) if self.variant.cache_dtype else "model",
             "tokens": self.tokens, "perplexity": self.ppl, "kl_mean": self.mean_kl, "kl_max": self.kl_max,
             "top1_agreement": self.top1, "seconds": self.seconds,
             "ms_per_token": 1e3 * self.seconds / self.tokens if self.tokens else None,
             "prompt_tokens": self.prompt_tokens,
             "ms_per_prompt_token": 1e3 * self.seconds / self.prompt_tokens if self.prompt_tokens else None,
             "pack": self.pack,
             "decode_steps": self.decode_steps,
             "decode_ms_per_step": 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else None}
        if reference_ppl:
            d["perplexity_delta"] = self.ppl / reference_ppl - 1
        return d


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").removeprefix("float8_")


def make_windows(ids: torch.Tensor, num: int, length: int, what: str = "text",
                 bos_token_id: int | None = None) -> torch.Tensor:
    """``[num, length]`` non-overlapping windows of the token ids ``ids``: the first ``num * length``
    tokens; with ``bos_token_id``, each window is that BOS followed by the next ``length - 1`` text
    tokens (a BOS already leading ``ids`` is not counted as text)."""
    ids = ids.reshape(-1)
    if bos_token_id is None:
        if ids.numel() < num * length:
            raise ValueError(f"{what}: {ids.numel()} tokens, fewer than {num} windows x {length}")
        return ids[: num * length].reshape(num, length)
    if length < 2:
        raise ValueError(f"make_windows: length must be >= 2 with a BOS (the BOS and one text token); got {length}")
    if ids.numel() and int(ids[0]) == bos_token_id:
        ids = ids[1:]
    body = length - 1
    if ids.numel() < num * body:
        raise ValueError(f"{what}: {ids.numel()} tokens, fewer than {num} windows x {body} (each window also "
                         f"gets a BOS)")
    bos = torch.full((num, 1), bos_token_id, dtype=ids.dtype, device=ids.device)
    return torch.cat([bos, ids[: num * body].reshape(num, body)], dim=1)


def bos_token_id(tok) -> int | None:
    """The BOS id ``tok`` puts before every text it encodes, or None when it adds none (SmolLM2's).

    Found by encoding a probe with and without special tokens, not from ``tok.add_bos_token``: a
    tokenizer whose post-processor adds the BOS may report False there (transformers 5)."""
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        return None
    special = list(tok("a").input_ids)
    plain = list(tok("a", add_special_tokens=False).input_ids)
    return bos if special[:1] == [bos] and plain[:1] != [bos] else None


def text_windows(tok, text: str, num: int, length: int, what: str = "text") -> torch.Tensor:
    """``text`` tokenized by ``tok`` as ``[num, length]`` windows the way the model expects each one to
    start: with the BOS when the tokenizer adds one (a window without it is not what the model saw in
    training: the hardening issue measured Gemma-3's perplexity of a second 1024-token window at
    44.2 without its BOS, 23.7 with it), else plain consecutive tokens."""
    bos = bos_token_id(tok)
    if bos is not None:
        log.info("hal-eval: %s: every window starts with the tokenizer's BOS (id %d)", what, bos)
    return make_windows(tok(text, return_tensors="pt").input_ids, num, length, what, bos_token_id=bos)


class _Stock:
    """The model's own attention (or the round-trip simulation) over a transformers DynamicCache."""

    def __init__(self, model, variant: Variant):
        from transformers import DynamicCache

        self.model, self.variant = model, variant
        self.cache = DynamicCache(config=model.config)
        self.kw = {} if variant.kind == "stock" else {"hal_roundtrip": RoundTrip(variant.cache_dtype, variant.scales)}

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ctx = using(self.model, ROUNDTRIP_NAME) if self.variant.kind == "roundtrip" else _nullcontext()
        with ctx:
            out = self.model(input_ids=ids, use_cache=True, **{cache_keyword(self.model): self.cache}, **self.kw)
        self.cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits.float()


class _Hal:
    def __init__(self, model, variant: Variant, windows: int, length: int, extra: int, **runner_kw):
        self.runner = HalRunner(model, cache_dtype=variant.cache_dtype, scales=variant.scales, **runner_kw)
        self.cache = self.runner.new_cache(windows * (length + extra), windows)
        self.sids = [self.cache.add_sequence() for _ in range(windows)]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.runner.logits(self.runner.step(self.cache, self.sids, ids))


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, variants: list[Variant], *, chunk: int = 512, decode_steps: int = 0,
             block_size: int = 16, pack: str | None = None, multi_token: bool | None = None) -> list[Result]:
    """Run every variant over ``windows`` ``[num, length]``; the first variant must be ``stock``
    (the reference for KL and top-1). ``multi_token`` is :class:`HalRunner`'s (None: its default).
    Returns one :class:`Result` per variant."""
    if not variants or variants[0].kind != "stock":
        raise ValueError("evaluate: the first variant must be the stock reference")
    device = next(model.parameters()).device
    windows = windows.to(device)
    num, length = windows.shape
    runners = []
    for v in variants:
        if v.kind == "hal":
            runners.append(_Hal(model, v, num, length, decode_steps + 1, block_size=block_size, pack=pack,
                                prefill_chunk=chunk, multi_token=multi_token))
        else:
            runners.append(_Stock(model, v))
    results = [Result(v) for v in variants]
    last = [None] * len(runners)                 # each variant's logits after the windows' last token
    for start in range(0, length, chunk):
        ids = windows[:, start:start + chunk]
        targets = windows[:, start + 1:start + chunk + 1]
        n = targets.shape[1]                     # the window's last token has no target
        ref_lp = None
        for i, (run, res) in enumerate(zip(runners, results)):
            t0 = time.perf_counter()
            logits = run(ids)
            _sync(device)
            res.seconds += time.perf_counter() - t0
            res.prompt_tokens += ids.numel()
            last[i] = logits[:, -1].clone()   # not a view: it would keep the chunk's logits alive
            lp = torch.log_softmax(logits[:, :n], dim=-1)
            del logits
            res.nll -= float(lp.gather(-1, targets[..., None]).sum())
            top = lp.argmax(-1)
            res.tokens += targets.numel()
            if ref_lp is None:
                ref_lp, ref_p, ref_top = lp, lp.exp(), lp.argmax(-1)
                res.same_top1 += targets.numel()
            else:
                kl = torch.sub(ref_lp, lp, out=lp).mul_(ref_p).sum(-1)   # in place: [windows, n, vocab] once
                res.kl += float(kl.sum())
                res.kl_max = max(res.kl_max, float(kl.max()))
                res.same_top1 += int((top == ref_top).sum())
            del lp
        log.info("hal-eval: %d/%d tokens per window; %s", min(start + chunk, length), length,
                 ", ".join(f"{r.variant.name} ppl {r.ppl:.3f}" for r in results))
    for run, res, lg in zip(runners, results, last):
        if isinstance(run, _Hal):
            prompt, decode = run.cache.served_by(prompt=True), run.cache.served_by()
            res.pack = prompt if prompt == decode else f"{prompt} (prompt) / {decode} (decode)"
        if decode_steps:
            _time_decode(run, res, lg, decode_steps, device)
    return results


def _time_decode(run, res: Result, logits: torch.Tensor, steps: int, device) -> None:
    """Greedy decode steps after the windows (batch = number of windows, context = window length);
    ``logits`` ``[windows, vocab]``: the prediction after each window's last token."""
    for i in range(steps + 1):
        nxt = logits.argmax(-1, keepdim=True)
        _sync(device)
        t0 = time.perf_counter()
        logits = run(nxt)[:, -1]
        _sync(device)
        if i > 0:  # the first step warms up
            res.decode_seconds += time.perf_counter() - t0
            res.decode_steps += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
