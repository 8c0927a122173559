"""The ``emu`` pack: software FP8 for every encoding, on any device; the reference every native pack
is tested against and the floor of dispatch.

Two paths with one declaration: a vectorised PyTorch path (CPU and any GPU) and a Triton path used
for GPU tensors when Triton can compile for the device (NVIDIA before sm89, AMD without FP8
hardware, or any GPU with ``pack="emu"``). ``HAL_EMU_PATH``-style switches are deliberately absent:
the path follows the tensors' device; tests and benchmarks call each path's module directly.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from hal.fp8 import FP8_DTYPES
from hal.pack import FEATURES, Availability, OpSupport, Pack

_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32})

SUPPORT = OpSupport(
    query_dtypes=_FLOAT,
    cache_dtypes=_FLOAT | FP8_DTYPES,
    head_sizes=tuple(range(32, 257, 8)),
    block_sizes=tuple(range(1, 257)),
    devices=frozenset({"cpu", "cuda"}),
    features=frozenset(FEATURES),
    max_gqa_ratio=None,
)


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
    SUPPORTS = {"paged_attention": SUPPORT, "cache_kv": SUPPORT}

    def _probe(self) -> Availability:
        why = triton_usable()
        return Availability(True, (), {
            "paths": ["torch"] + (["triton"] if why is None else []),
            "triton": "usable" if why is None else f"not used: {why}",
        })

    def impl(self, op: str):
        return functools.partial(_run, op)


def _run(op: str, *args) -> None:
    device = args[1].device if op == "paged_attention" else args[2].device
    module = _triton() if device.type == "cuda" and triton_usable() is None else _torch()
    getattr(module, op)(*args)


@functools.cache
def _torch():
    from hal.kernelpacks.emu import torch_path
    return torch_path


@functools.cache
def _triton():
    from hal.kernelpacks.emu import triton_path
    return triton_path


PACK = EmuPack()
