"""The declaration of ``hal::cache_mla``: writing MLA latents and rotary parts into their paged caches
(stored = x / scale rounded to the cache's encoding, saturating), validated into an :class:`MLAWriteCall`."""

from __future__ import annotations

import torch

from hal import dtypes, fp8
from hal import validate as v
from hal.call import Geometry, MLAWriteCall
from hal.ops.decl import OpDecl, fake_checks
from hal.ops.mla_decode import latent_caches
from hal.pack import CallKey
from hal.targets import target

NAME = "cache_mla"
SCHEMA = ("(Tensor kv_c, Tensor k_pe, Tensor(a!) ckv_cache, Tensor(b!) kpe_cache, Tensor slot_mapping, "
          "float? ckv_scale, float? kpe_scale, Tensor? ckv_scale_tensor, Tensor? kpe_scale_tensor, str? pack) -> ()")
FEATURES = {
    "strided_cache": "caches whose tokens are not dense (views into one [num_blocks, block_size, R + P] allocation)",
    "fp8_rope": "an FP8 rotary cache (kpe_cache)",
}


def schema_args(kv_c, k_pe, ckv_cache, kpe_cache, slot_mapping, *, ckv_scale=None, kpe_scale=None, pack=None) -> tuple:
    cs, cst = v.split_scale(NAME, "ckv_scale", ckv_scale)
    ps, pst = v.split_scale(NAME, "kpe_scale", kpe_scale)
    return (kv_c, k_pe, ckv_cache, kpe_cache, slot_mapping, cs, ps, cst, pst, pack)


def tensors(kv_c, k_pe, ckv_cache, kpe_cache, slot_mapping, ckv_scale, kpe_scale, ckv_scale_tensor,
            kpe_scale_tensor, pack) -> dict:
    return dict(kv_c=kv_c, k_pe=k_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache, slot_mapping=slot_mapping,
                ckv_scale=ckv_scale_tensor, kpe_scale=kpe_scale_tensor)


def check(kv_c, k_pe, ckv_cache, kpe_cache, slot_mapping, ckv_scale, kpe_scale, ckv_scale_tensor, kpe_scale_tensor,
          pack) -> MLAWriteCall:
    op = NAME
    nb, bs, r, p, dev, cs, ps = latent_caches(op, ckv_cache, kpe_cache, ckv_scale, kpe_scale, ckv_scale_tensor,
                                              kpe_scale_tensor)
    for name, t, w in (("kv_c", kv_c, r), ("k_pe", k_pe, p)):
        v.tensor(op, name, t)
        if t.dtype not in v.QUERY_DTYPES:
            v.fail(op, name, "float16, bfloat16 or float32", v.desc(t))
        if t.dim() != 2 or t.shape[1] != w:
            v.fail(op, name, f"2-d [num_tokens, {w}] (the cache's last dim)", v.desc(t))
        v.same_device(op, name, t, dev)
    if k_pe.shape[0] != kv_c.shape[0] or k_pe.dtype != kv_c.dtype:
        v.fail(op, "k_pe", f"a {dtypes.name(kv_c.dtype)} tensor of {kv_c.shape[0]} tokens like kv_c", v.desc(k_pe))
    v.slot_mapping(op, slot_mapping, kv_c.shape[0], nb * bs, dev)
    feats = set()
    if not (ckv_cache.is_contiguous() and kpe_cache.is_contiguous()):
        feats.add("strided_cache")
    if fp8.is_fp8(kpe_cache.dtype):
        feats.add("fp8_rope")
    key = CallKey(op, dev.type, kv_c.dtype, ckv_cache.dtype, r, bs, 1, frozenset(feats), p, kpe_cache.dtype)
    return MLAWriteCall(call_key=key, target=target(), geometry=Geometry(0, 0, 1, r, bs, nb, kv_c.shape[0]),
                        rope_dim=p, kv_c=v.unit_last(kv_c), k_pe=v.unit_last(k_pe), ckv_cache=ckv_cache,
                        kpe_cache=kpe_cache, slot_mapping=slot_mapping, ckv_scale=cs, kpe_scale=ps)


def example(device: str, cache_dtype: torch.dtype) -> dict:
    """A typical write: 5 tokens (one skipped) into views of one combined [4, 8, 512 + 64] cache."""
    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(4, 8, 576, dtype=cache_dtype, device=device)
    is8 = cache_dtype in v.FP8_DTYPES
    return dict(kv_c=torch.randn(5, 512, generator=g).to(device), k_pe=torch.randn(5, 64, generator=g).to(device),
                ckv_cache=kv[..., :512], kpe_cache=kv[..., 512:],
                slot_mapping=torch.tensor([3, 9, -1, 20, 31], device=device),
                ckv_scale=0.01 if is8 else None, kpe_scale=0.02 if is8 else None)


DECL = OpDecl(name=NAME, schema=SCHEMA, features=FEATURES, schema_args=schema_args, check=check, tensors=tensors,
              fake=fake_checks(NAME, tensors, (("ckv_scale", 5, 7), ("kpe_scale", 6, 8))),
              result=lambda args: None, example=example,
              per_layer=("kv_c", "k_pe", "ckv_cache", "kpe_cache", "ckv_scale", "kpe_scale"),
              scale_args=("ckv_scale", "kpe_scale"))
