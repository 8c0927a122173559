"""Which of the emu pack's paths runs a call: Triton for GPU tensors when it can compile for the
device (triton_path for decode, triton_prefill for several query tokens per sequence, triton_mla for
MLA decode), the PyTorch paths otherwise (torch_path, torch_prefill, torch_mla); paged-attention
caches that are not dense within each block (an NHD view), and calls that ask for the log-sum-exp
(``lse``: torch_prefill writes it, for decode too), take the PyTorch paths, because the Triton
decode kernel indexes blocks densely (the MLA kernel takes every cache's strides, so combined-cache
views stay on Triton). Triton is imported only once a call has chosen it: a CPU install without
triton never imports it. Every path takes the op's call record (hal.call)."""

from __future__ import annotations

from hal.planning import record_runner

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


def _paged_attention_path(call):
    """The function of the path that runs this paged-attention call."""
    if call.lse is not None:  # the log-sum-exp is written by the PyTorch multi-token path (decode too)
        from . import torch_prefill
        return torch_prefill.paged_attention
    if call.query_start_loc is not None:  # several rows per sequence
        gpu = call.query.device.type == "cuda" and triton_usable() is None
        # triton_prefill hands pure-decode batches to triton_path, which indexes blocks densely
        if gpu and _dense_blocks(call.key_cache, call.value_cache):
            from . import triton_prefill  # imports triton: only where triton is usable
            return triton_prefill.paged_attention
        from . import torch_prefill
        return torch_prefill.paged_attention
    return _module(call.query.device, call.key_cache, call.value_cache).paged_attention


def paged_attention(call) -> None:
    _paged_attention_path(call)(call)


def cache_kv(call) -> None:
    _module(call.key.device, call.key_cache, call.value_cache).cache_kv(call)


# A plan (hal.plan) picks the path once: its layers share the planned device and cache layout.
paged_attention.prepare = lambda call: record_runner(_paged_attention_path(call), call)
cache_kv.prepare = lambda call: record_runner(_module(call.key.device, call.key_cache, call.value_cache).cache_kv,
                                              call)


def mla_decode(call) -> None:
    if call.q_nope.device.type == "cuda" and triton_usable() is None and call.lse is None:
        from . import triton_mla  # imports triton: only where triton is usable
        triton_mla.mla_decode(call)
        return
    from . import torch_mla
    torch_mla.mla_decode(call.out, call.q_nope, call.q_pe, call.ckv_cache, call.kpe_cache, call.block_tables,
                         call.seq_lens, call.scale, call.ckv_scale, call.kpe_scale, call.max_seq_len,
                         call.query_start_loc, call.lse)


def cache_mla(call) -> None:
    from . import torch_mla
    torch_mla.cache_mla(call.kv_c, call.k_pe, call.ckv_cache, call.kpe_cache, call.slot_mapping, call.ckv_scale,
                        call.kpe_scale)
