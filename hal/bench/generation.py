"""Time per generated token of a transformers model: stock attention against :class:`HalRunner`
eager (one-shot calls), with plans (``hal.plan`` once per step), and with CUDA graphs.

What is timed, per mode: a greedy generation of ``1 + steps`` new tokens for a batch of equal
prompts, minus one of 1 new token (the prompt pass and the first token are the same in both), over
``steps``: the milliseconds of one decode step of the whole batch, host and GPU, synchronised at the
end. The median of ``reps`` such pairs. The model is randomly initialised from a config (its
numbers do not matter for time); every mode runs the same model on the same prompts.

Modes:
- ``stock``: the model's own attention (its ``attn_implementation``, sdpa by default) over a
  transformers DynamicCache;
- ``hal eager``: ``HalRunner(cuda_graphs=False)``, every layer a one-shot ``hal.paged_attention``;
- ``hal plans``: ``HalRunner(cuda_graphs=False)``, a plan per step shared by the layers;
- ``hal graphs``: ``HalRunner()`` (the default): plans, and the decode step replayed as a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings

import torch

MODES = ("stock", "hal eager", "hal plans", "hal graphs")


@dataclasses.dataclass
class Row:
    model: str
    cache: str
    batch: int
    prompt: int
    mode: str
    ms_per_step: float
    tokens_per_s: float
    note: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def llama_config(layers: int = 16, hidden: int = 2048, heads: int = 32, kv_heads: int = 8, head_dim: int = 64,
                 vocab: int = 32000):
    """A Llama-3.2-1B-shaped config (its vocabulary cut: the logits are not what is timed)."""
    import transformers
    return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                    vocab_size=vocab, max_position_embeddings=8192)


def random_model(config, device, dtype=torch.bfloat16):
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _stock_generate(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    import transformers

    from hal.integrations.models import cache_keyword
    cache = transformers.DynamicCache(config=model.config)
    kw = cache_keyword(model)
    logits = model(input_ids=prompts, use_cache=True, **{kw: cache}).logits[:, -1]
    out = []
    for i in range(new):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 < new:
            logits = model(input_ids=nxt, use_cache=True, **{kw: cache}).logits[:, -1]
    return torch.cat(out, 1)


def _generator(model, mode: str, cache_dtype, scales):
    """``generate(prompts, new)`` for a mode."""
    if mode == "stock":
        return lambda p, new: _stock_generate(model, p, new)
    from hal.integrations.transformers import HalRunner
    runner = HalRunner(model, cache_dtype=cache_dtype, scales=scales, cuda_graphs=mode == "hal graphs")
    planned = mode != "hal eager"
    return lambda p, new: runner.generate(p.tolist(), new, planned=planned)


def _time(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def measure(model, *, batch: int, prompt: int, steps: int = 32, reps: int = 3, cache_dtype=torch.bfloat16,
            scales=None, modes=MODES, name: str = "model") -> list[Row]:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
    rows = []
    cache = str(cache_dtype).removeprefix("torch.")
    for mode in modes:
        if mode == "stock" and cache_dtype.itemsize == 1:
            continue  # stock attention has no FP8 cache of this kind
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # missing FP8 scales (1.0): timing only
            fn = _generator(model, mode, cache_dtype, scales)
            fn(prompts, 1 + steps)  # warm-up: compiles, allocates, captures
            per = []
            for _ in range(reps):
                one = _time(lambda fn=fn: fn(prompts, 1), device)
                many = _time(lambda fn=fn: fn(prompts, 1 + steps), device)
                per.append((many - one) / steps)
        ms = statistics.median(per) * 1e3
        rows.append(Row(name, "model dtype" if mode == "stock" else cache, batch, prompt, mode, ms, batch / ms * 1e3))
    return rows
