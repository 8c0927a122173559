"""Which of the emu pack's paths runs a call: Triton for GPU tensors when it can compile for the
device (triton_path for decode, triton_prefill for several query tokens per sequence), the PyTorch
paths otherwise (torch_path, torch_prefill); caches that are not dense within each block (an NHD
view) take the PyTorch paths, because the Triton decode kernel indexes blocks densely.
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
    if call.query_start_loc is not None:  # several rows per sequence
        gpu = call.query.device.type == "cuda" and triton_usable() is None
        # triton_prefill hands pure-decode batches to triton_path, which indexes blocks densely
        if gpu and _dense_blocks(call.key_cache, call.value_cache):
            from . import triton_prefill  # imports triton: only where triton is usable
            triton_prefill.paged_attention(call)
        else:
            from . import torch_prefill
            torch_prefill.paged_attention(call)
        return
    _module(call.query.device, call.key_cache, call.value_cache).paged_attention(call)


def cache_kv(call) -> None:
    _module(call.key.device, call.key_cache, call.value_cache).cache_kv(call)


def mla_decode(call) -> None:
    """The PyTorch MLA path on every device for now (a Triton one is issue 15's next step)."""
    from . import torch_mla
    torch_mla.mla_decode(call.out, call.q_nope, call.q_pe, call.ckv_cache, call.kpe_cache, call.block_tables,
                         call.seq_lens, call.scale, call.ckv_scale, call.kpe_scale, call.max_seq_len,
                         call.query_start_loc)


def cache_mla(call) -> None:
    from . import torch_mla
    torch_mla.cache_mla(call.kv_c, call.k_pe, call.ckv_cache, call.kpe_cache, call.slot_mapping, call.ckv_scale,
                        call.kpe_scale)
