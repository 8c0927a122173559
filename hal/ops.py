"""The torch ops ``hal::paged_attention`` and ``hal::cache_kv``.

Registered with ``torch.library`` (schema, CPU and CUDA implementations, fake implementations), so
``torch.compile(fullgraph=True)`` sees one opaque op and CUDA graphs capture whatever the selected
pack launches. Both ops write into tensors they are given (``out``; the caches) and return nothing.
The implementation validates, asks the dispatcher for a pack and runs that pack's implementation;
calling ``torch.ops.hal.*`` directly is therefore as safe as calling ``hal.paged_attention``.

Every pack receives a query, ``out`` and new K/V with a unit stride in their last dimension: other
views are copied here (and ``out`` copied back), as torch's own ops accept any strides.
"""

from __future__ import annotations

import torch

from hal import dispatch, validate

LIB = torch.library.Library("hal", "DEF")  # noqa: TOR901 - the library lives as long as the process

LIB.define(
    "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor block_tables, Tensor seq_lens, float scale, float? k_scale, float? v_scale, "
    "Tensor? k_scale_tensor, Tensor? v_scale_tensor, Tensor? alibi_slopes, float? logits_soft_cap, "
    "int? sliding_window, int? max_seq_len, str? pack) -> ()"
)
LIB.define(
    "cache_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, float? k_scale, float? v_scale, Tensor? k_scale_tensor, "
    "Tensor? v_scale_tensor, str? pack) -> ()"
)


def _pick(op: str, name: str, f, t):
    """The op's float and tensor slots of one scale: at most one may be given."""
    if f is not None and t is not None:
        raise validate.ArgumentError(f"hal.{op}: {name} was given twice, as the float {f!r} and as a tensor "
                                     f"({name}_tensor); pass one of them")
    return t if t is not None else f


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _pa_tensors(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale_tensor, v_scale_tensor,
                alibi_slopes) -> dict:
    return dict(out=out, query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                seq_lens=seq_lens, k_scale=k_scale_tensor, v_scale=v_scale_tensor, alibi_slopes=alibi_slopes)


def paged_attention_impl(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                         v_scale, k_scale_tensor, v_scale_tensor, alibi_slopes, logits_soft_cap,
                         sliding_window, max_seq_len, pack):
    op = "paged_attention"
    validate.no_autograd(op, _pa_tensors(out, query, key_cache, value_cache, block_tables, seq_lens,
                                         k_scale_tensor, v_scale_tensor, alibi_slopes))
    key, ks, vs = validate.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
        k_scale=_pick(op, "k_scale", k_scale, k_scale_tensor), v_scale=_pick(op, "v_scale", v_scale, v_scale_tensor),
        alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
        max_seq_len=max_seq_len, out=out)
    chosen = dispatch.select(key, pack)
    dst = _unit_last(out)
    chosen.impl(op)(dst, _unit_last(query), key_cache, value_cache, block_tables, seq_lens, scale, ks, vs,
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len)
    if dst is not out:
        out.copy_(dst)


def cache_kv_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, k_scale_tensor,
                  v_scale_tensor, pack):
    op = "cache_kv"
    validate.no_autograd(op, dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                                  k_scale=k_scale_tensor, v_scale=v_scale_tensor))
    call, ks, vs = validate.cache_kv(key, value, key_cache, value_cache, slot_mapping,
                                     k_scale=_pick(op, "k_scale", k_scale, k_scale_tensor),
                                     v_scale=_pick(op, "v_scale", v_scale, v_scale_tensor))
    chosen = dispatch.select(call, pack)
    chosen.impl(op)(_unit_last(key), _unit_last(value), key_cache, value_cache, slot_mapping, ks, vs)


for _device in ("CPU", "CUDA"):  # ROCm torch registers its GPUs under CUDA too
    LIB.impl("paged_attention", paged_attention_impl, _device)
    LIB.impl("cache_kv", cache_kv_impl, _device)


# The fake implementations serve torch.compile (FakeTensors carry their real device) and all-meta
# calls for shape inference. A meta tensor among real ones also lands here, so they refuse it.
@torch.library.register_fake("hal::paged_attention")
def _paged_attention_fake(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                          v_scale, k_scale_tensor, v_scale_tensor, alibi_slopes, logits_soft_cap,
                          sliding_window, max_seq_len, pack):
    tensors = _pa_tensors(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale_tensor,
                          v_scale_tensor, alibi_slopes)
    validate.devices("paged_attention", tensors)
    validate.no_autograd("paged_attention", tensors)
    _pick("paged_attention", "k_scale", k_scale, k_scale_tensor)
    _pick("paged_attention", "v_scale", v_scale, v_scale_tensor)
    return None


@torch.library.register_fake("hal::cache_kv")
def _cache_kv_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, k_scale_tensor,
                   v_scale_tensor, pack):
    tensors = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                   k_scale=k_scale_tensor, v_scale=v_scale_tensor)
    validate.devices("cache_kv", tensors)
    validate.no_autograd("cache_kv", tensors)
    _pick("cache_kv", "k_scale", k_scale, k_scale_tensor)
    _pick("cache_kv", "v_scale", v_scale, v_scale_tensor)
    return None
