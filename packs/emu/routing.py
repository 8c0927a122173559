"""Which of the emu pack's two paths runs a call: Triton for GPU tensors when it can compile for
the device, the PyTorch path otherwise (both take the op's call record, hal.call)."""

from __future__ import annotations

from .pack import triton_usable


def _module(device):
    if device.type == "cuda" and triton_usable() is None:
        from . import triton_path
        return triton_path
    from . import torch_path
    return torch_path


def paged_attention(call) -> None:
    _module(call.query.device).paged_attention(call)


def cache_kv(call) -> None:
    _module(call.key.device).cache_kv(call)
