"""Which of the emu pack's paths runs a call: for decode, Triton for GPU tensors when it can compile
for the device, the PyTorch path otherwise; several query tokens per sequence (``query_start_loc``)
go to the PyTorch multi-token path on every device (the Triton kernel for them is not written yet),
and so do caches that are not dense within each block (an NHD view: the Triton kernels index blocks
densely).
Every path takes the op's call record (hal.call)."""

from __future__ import annotations

from .pack import triton_usable


def _dense_blocks(*caches) -> bool:
    # the Triton kernels index a block as dense [num_kv_heads, block_size, head_size]
    return all(c.stride(2) == c.shape[3] and c.stride(1) == c.shape[2] * c.shape[3] for c in caches)


def _module(device, *caches):
    if device.type == "cuda" and triton_usable() is None and _dense_blocks(*caches):
        from . import triton_path
        return triton_path
    from . import torch_path
    return torch_path


def paged_attention(call) -> None:
    if call.query_start_loc is not None:  # several rows per sequence: the PyTorch path, on any device
        from . import torch_prefill
        torch_prefill.paged_attention(call)
        return
    _module(call.query.device, call.key_cache, call.value_cache).paged_attention(call)


def cache_kv(call) -> None:
    _module(call.key.device, call.key_cache, call.value_cache).cache_kv(call)
