"""The ``emu`` pack: software FP8 for every encoding, on any device; the reference every native pack
is tested against and the floor of dispatch.

Two paths with one declaration: a vectorised PyTorch path (CPU and any GPU) and a Triton path used
for GPU tensors when Triton can compile for the device (NVIDIA before sm89, AMD without FP8
hardware, or any GPU with ``pack="emu"``). ``HAL_EMU_PATH``-style switches are deliberately absent:
the path follows the tensors' device; tests and benchmarks call each path's module directly.
"""

from __future__ import annotations

import dataclasses

import functools
import importlib.util

import torch

from hal.fp8 import FP8_DTYPES
from hal.pack import Availability, OpSupport, Pack, op_features

_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32})


def _support(op: str) -> OpSupport:
    return OpSupport(
        query_dtypes=_FLOAT,
        cache_dtypes=_FLOAT | FP8_DTYPES,
        head_sizes=tuple(range(32, 257, 8)),
        block_sizes=tuple(range(1, 257)),
        devices=frozenset({"cpu", "cuda"}),
        features=op_features(op),  # every feature of the op
        max_gqa_ratio=None,
    )


SUPPORT = _support("paged_attention")


@functools.cache
def triton_usable() -> str | None:
    """None when the Triton path can run on this process's GPU, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no GPU visible to torch"
    return None


class EmuPack(Pack):
    NAME = "emu"
    DESCRIPTION = "software FP8 (every encoding): PyTorch on any device, Triton on GPUs"
    VENDORS = frozenset({"cpu", "cuda", "rocm"})
    SUPPORTS = {"paged_attention": SUPPORT, "cache_kv": _support("cache_kv"),
                # MLA: R (head_size here) any multiple of 16 up to 1024, any number of heads (one latent)
                "mla_decode": dataclasses.replace(_support("mla_decode"), head_sizes=tuple(range(16, 1025, 16))),
                "cache_mla": dataclasses.replace(_support("cache_mla"), head_sizes=tuple(range(16, 1025, 16)))}
    # the path follows the call's device: routing.py sends GPU tensors to Triton where it runs
    IMPLEMENTATIONS = {"paged_attention": "routing:paged_attention", "cache_kv": "routing:cache_kv",
                       "mla_decode": "routing:mla_decode", "cache_mla": "routing:cache_mla"}

    def _probe(self) -> Availability:
        why = triton_usable()
        return Availability(True, (), {
            "paths": ["torch"] + (["triton"] if why is None else []),
            "triton": "usable" if why is None else f"not used: {why}",
        })

PACK = EmuPack()
