"""The torch ops ``hal::paged_attention`` and ``hal::cache_kv``.

Registered with ``torch.library`` (schema, CPU and CUDA implementations, fake implementations), so
``torch.compile(fullgraph=True)`` sees one opaque op and CUDA graphs capture whatever the selected
pack launches. Both ops write into tensors they are given (``out``; the caches) and return nothing.
The implementation validates, asks the dispatcher for a pack and runs that pack's implementation;
calling ``torch.ops.hal.*`` directly is therefore as safe as calling ``hal.paged_attention``.
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


def _pick(f, t):
    return t if t is not None else f


def paged_attention_impl(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                         v_scale, k_scale_tensor, v_scale_tensor, alibi_slopes, logits_soft_cap,
                         sliding_window, max_seq_len, pack):
    ks = validate.scale("paged_attention", "k_scale", _pick(k_scale, k_scale_tensor), key_cache)
    vs = validate.scale("paged_attention", "v_scale", _pick(v_scale, v_scale_tensor), value_cache)
    key = validate.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   k_scale=ks, v_scale=vs, alibi_slopes=alibi_slopes,
                                   logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                                   max_seq_len=max_seq_len, out=out)
    chosen = dispatch.select(key, pack)
    chosen.impl("paged_attention")(out, query, key_cache, value_cache, block_tables, seq_lens, scale, ks, vs,
                                   alibi_slopes, logits_soft_cap, sliding_window, max_seq_len)


def cache_kv_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, k_scale_tensor,
                  v_scale_tensor, pack):
    ks = validate.scale("cache_kv", "k_scale", _pick(k_scale, k_scale_tensor), key_cache)
    vs = validate.scale("cache_kv", "v_scale", _pick(v_scale, v_scale_tensor), value_cache)
    call = validate.cache_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=ks, v_scale=vs)
    chosen = dispatch.select(call, pack)
    chosen.impl("cache_kv")(key, value, key_cache, value_cache, slot_mapping, ks, vs)


for _device in ("CPU", "CUDA"):  # ROCm torch registers its GPUs under CUDA too
    LIB.impl("paged_attention", paged_attention_impl, _device)
    LIB.impl("cache_kv", cache_kv_impl, _device)


@torch.library.register_fake("hal::paged_attention")
def _paged_attention_fake(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                          v_scale, k_scale_tensor, v_scale_tensor, alibi_slopes, logits_soft_cap,
                          sliding_window, max_seq_len, pack):
    return None


@torch.library.register_fake("hal::cache_kv")
def _cache_kv_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, k_scale_tensor,
                   v_scale_tensor, pack):
    return None
