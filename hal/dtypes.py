"""The one table of dtype names: the short names the CLIs and tables use ("bf16", "e4m3fn", ...),
torch's names without the prefix ("bfloat16", "float8_e4m3fn") for messages, and parsing either.
vLLM's ``kv_cache_dtype`` strings ("auto", "fp8", "fp8_e5m2") are :func:`hal.fp8.kv_cache_dtype`'s."""

from __future__ import annotations

import torch

SHORT: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz",
    torch.float8_e5m2: "e5m2", torch.float8_e5m2fnuz: "e5m2fnuz",
}
_ALIASES = {"half": torch.float16}
_BY_TEXT = {**{v: k for k, v in SHORT.items()}, **{str(d).removeprefix("torch."): d for d in SHORT}, **_ALIASES}


def name(dtype: torch.dtype) -> str:
    """torch's name without ``torch.``: for messages ("float8_e4m3fn tensor of shape ...")."""
    return str(dtype).removeprefix("torch.")


def short(dtype: torch.dtype) -> str:
    """The short name tables and command lines use ("bf16", "e4m3fn"); torch's name otherwise."""
    return SHORT.get(dtype, name(dtype))


def parse(text: str, *, what: str = "dtype") -> torch.dtype:
    """A dtype from its short or torch name (``bf16``, ``bfloat16``, ``e4m3fn``, ``float8_e4m3fn``)."""
    key = text.strip().lower().removeprefix("torch.")
    if key not in _BY_TEXT:
        raise ValueError(f"{what} {text!r} is not a dtype hal knows: expected one of {', '.join(SHORT.values())}")
    return _BY_TEXT[key]
