"""The declaration of ``hal::cache_kv``: schema and validation into a :class:`CacheWriteCall`."""

from __future__ import annotations

import torch

from hal import validate as v
from hal.call import CacheWriteCall, Geometry
from hal.ops.decl import OpDecl, fake_checks
from hal.pack import CallKey
from hal.targets import target

NAME = "cache_kv"
SCHEMA = ("(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
          "float? k_scale, float? v_scale, Tensor? k_scale_tensor, Tensor? v_scale_tensor, str? pack) -> ()")
FEATURES = {
    "per_head_scales": "[num_kv_heads] k/v scales",
    "misaligned_cache": "caches whose data pointer or block stride is not a multiple of 16 bytes",
    "strided_cache": "caches that are not dense within each block (e.g. an NHD cache's permute(0, 2, 1, 3) view)",
}


def schema_args(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None, pack=None) -> tuple:
    ks, kst = v.split_scale(NAME, "k_scale", k_scale)
    vs, vst = v.split_scale(NAME, "v_scale", v_scale)
    return (key, value, key_cache, value_cache, slot_mapping, ks, vs, kst, vst, pack)


def tensors(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, k_scale_tensor, v_scale_tensor,
            pack) -> dict:
    return dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                k_scale=k_scale_tensor, v_scale=v_scale_tensor)


def check(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, k_scale_tensor, v_scale_tensor,
          pack) -> CacheWriteCall:
    op = NAME
    v.tensor(op, "key", key)
    v.tensor(op, "value", value)
    v.caches(op, key_cache, value_cache)
    ks = v.scale(op, "k_scale", v.pick(op, "k_scale", k_scale, k_scale_tensor), key_cache)
    vs = v.scale(op, "v_scale", v.pick(op, "v_scale", v_scale, v_scale_tensor), value_cache)
    nb, hkv, bs, d = key_cache.shape
    dev = key_cache.device
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in v.QUERY_DTYPES:
            v.fail(op, name, "float16, bfloat16 or float32", v.desc(t))
        if t.dim() != 3 or t.shape[1:] != (hkv, d):
            v.fail(op, name, f"3-d [num_tokens, num_kv_heads={hkv}, head_size={d}]", v.desc(t))
        v.same_device(op, name, t, dev)
    if value.shape != key.shape or value.dtype != key.dtype:
        v.fail(op, "value", f"the same shape and dtype as key ({v.desc(key)})", v.desc(value))
    v.slot_mapping(op, slot_mapping, key.shape[0], nb * bs, dev)
    call_key = CallKey(op, dev.type, key.dtype, key_cache.dtype, d, bs, 1,
                       v.features(None, None, None, ks, vs, (key_cache, value_cache)))
    return CacheWriteCall(call_key=call_key, target=target(), geometry=Geometry(0, 0, hkv, d, bs, nb, key.shape[0]),
                          key=v.unit_last(key), value=v.unit_last(value), key_cache=key_cache,
                          value_cache=value_cache, slot_mapping=slot_mapping, k_scale=ks, v_scale=vs)


def example(device: str, cache_dtype: torch.dtype) -> dict:
    """A typical write: 5 tokens (one skipped by a negative slot) into a 4-block cache, per-head k scales."""
    g = torch.Generator().manual_seed(0)
    kc = torch.zeros(4, 2, 8, 64, dtype=cache_dtype, device=device)
    k = torch.randn(5, 2, 64, generator=g).to(device)
    return dict(key=k, value=torch.randn(5, 2, 64, generator=g).to(device), key_cache=kc, value_cache=kc.clone(),
                slot_mapping=torch.tensor([3, 9, -1, 20, 31], device=device),
                k_scale=torch.tensor([0.01, 0.02], device=device), v_scale=0.015)


DECL = OpDecl(name=NAME, schema=SCHEMA, features=FEATURES, schema_args=schema_args, check=check, tensors=tensors,
              fake=fake_checks(NAME, tensors, (("k_scale", 5, 7), ("v_scale", 6, 8))),
              result=lambda args: None, example=example,
              per_layer=("key", "value", "key_cache", "value_cache", "k_scale", "v_scale"),
              scale_args=("k_scale", "v_scale"))
