"""The declaration of ``hal::mla_decode``: multi-head latent attention (absorbed form) over a paged
latent cache: schema, validation into an :class:`MLACall`, fake, float64 reference, probe example.

Contract (design.md, "MLA decode over an FP8 latent cache"): ``q_nope`` [total_q, H, R], ``q_pe``
[total_q, H, P]; ``ckv_cache`` [num_blocks, block_size, R] and ``kpe_cache`` [num_blocks,
block_size, P], each possibly a view into one [num_blocks, block_size, R + P] allocation;
``s_j = (q_nope . c_j * ckv_scale + q_pe . kpe_j * kpe_scale) * scale``, ``out = ckv_scale *
softmax(s) @ c``; several rows per sequence through ``query_start_loc`` are causal.
"""

from __future__ import annotations

import torch

from hal import dtypes, fp8
from hal import reference as _reference
from hal import validate as v
from hal.call import Geometry, MLACall
from hal.ops.decl import OpDecl, copy_out_back, fake_checks
from hal.pack import CallKey
from hal.targets import target

NAME = "mla_decode"
SCHEMA = ("(Tensor(a!) out, Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor block_tables, "
          "Tensor seq_lens, float scale, float? ckv_scale, float? kpe_scale, Tensor? ckv_scale_tensor, "
          "Tensor? kpe_scale_tensor, Tensor? query_start_loc, int? max_query_len, int? max_seq_len, "
          "Tensor(b!)? lse, str? pack) -> ()")
FEATURES = {
    "varlen": "several query tokens per sequence (query_start_loc: speculative decoding), causal",
    "strided_cache": "latent or rotary caches whose tokens are not dense (views into one [num_blocks, "
                     "block_size, R + P] allocation)",
    "fp8_rope": "an FP8 rotary cache (kpe_cache); 16-bit is recommended",
    "lse": "each row's log-sum-exp of its logits written to lse (merges of partial results)",
    "misaligned_cache": "latent or rotary caches whose data pointer, block or token stride is not a multiple "
                        "of 16 bytes (latent) / 8 bytes (rotary part): the native kernels' vector loads",
}
CACHE_DTYPES = frozenset(v.QUERY_DTYPES) | fp8.FP8_DTYPES


def schema_args(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, *, scale, ckv_scale=None,
                kpe_scale=None, query_start_loc=None, max_query_len=None, max_seq_len=None, out=None,
                lse=None, pack=None) -> tuple:
    v.tensor(NAME, "q_nope", q_nope)
    scale = v.real(NAME, "scale", scale, "a finite float > 0 (the softmax scale; MLA has no default)")
    v.integer(NAME, "max_seq_len", max_seq_len, 0, "read from seq_lens")
    v.integer(NAME, "max_query_len", max_query_len, 0, "read from query_start_loc")
    if out is None:
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    cs, cst = v.split_scale(NAME, "ckv_scale", ckv_scale)
    ps, pst = v.split_scale(NAME, "kpe_scale", kpe_scale)
    return (out, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale, cs, ps, cst, pst,
            query_start_loc, max_query_len, max_seq_len, lse, pack)


def tensors(out, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale, ckv_scale, kpe_scale,
            ckv_scale_tensor, kpe_scale_tensor, query_start_loc, max_query_len, max_seq_len, lse, pack) -> dict:
    t = dict(out=out, q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
             block_tables=block_tables, seq_lens=seq_lens, ckv_scale=ckv_scale_tensor,
             kpe_scale=kpe_scale_tensor, query_start_loc=query_start_loc)
    if lse is not None:
        t["lse"] = lse
    return t


def _cache(op, name, c, width_name):
    v.tensor(op, name, c)
    if c.dtype not in CACHE_DTYPES:
        v.fail(op, name, "a float16/bfloat16/float32 or float8 tensor", v.desc(c))
    if c.dim() != 3 or min(c.shape) < 1:
        v.fail(op, name, f"3-d [num_blocks, block_size, {width_name}] with every dim >= 1", v.desc(c))
    if c.stride(2) != 1:
        v.fail(op, name, "a unit stride in its last dim (a view into a combined cache is fine)", v.desc(c))


def latent_caches(op, ckv_cache, kpe_cache, ckv_scale, kpe_scale, ckv_scale_tensor, kpe_scale_tensor):
    """The latent and rotary caches and their scales, checked alike by hal.mla_decode and
    hal.cache_mla: ``(num_blocks, block_size, R, P, device, ckv_scale, kpe_scale)``."""
    _cache(op, "ckv_cache", ckv_cache, "R")
    _cache(op, "kpe_cache", kpe_cache, "P")
    nb, bs, r = ckv_cache.shape
    p = kpe_cache.shape[2]
    dev = ckv_cache.device
    if kpe_cache.shape[:2] != (nb, bs):
        v.fail(op, "kpe_cache", f"[num_blocks={nb}, block_size={bs}, P] like ckv_cache", v.desc(kpe_cache))
    v.same_device(op, "kpe_cache", kpe_cache, dev)
    cs = v.scale(op, "ckv_scale", v.pick(op, "ckv_scale", ckv_scale, ckv_scale_tensor), ckv_cache, num_kv_heads=1)
    ps = v.scale(op, "kpe_scale", v.pick(op, "kpe_scale", kpe_scale, kpe_scale_tensor), kpe_cache, num_kv_heads=1)
    return nb, bs, r, p, dev, cs, ps


def check(out, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale, ckv_scale, kpe_scale,
          ckv_scale_tensor, kpe_scale_tensor, query_start_loc, max_query_len, max_seq_len, lse, pack) -> MLACall:
    """Every argument checked (errors name the argument, what was expected, what was given)."""
    op = NAME
    nb, bs, r, p, dev, cs, ps = latent_caches(op, ckv_cache, kpe_cache, ckv_scale, kpe_scale, ckv_scale_tensor,
                                              kpe_scale_tensor)
    v.tensor(op, "q_nope", q_nope)
    if q_nope.dtype not in v.QUERY_DTYPES:
        v.fail(op, "q_nope", "float16, bfloat16 or float32", v.desc(q_nope))
    if q_nope.dim() != 3 or q_nope.shape[2] != r or q_nope.shape[1] < 1:
        v.fail(op, "q_nope", f"3-d [total_q, num_heads, R={r}] (R: ckv_cache's last dim)", v.desc(q_nope))
    v.same_device(op, "q_nope", q_nope, dev)
    total_q, h, _ = q_nope.shape
    v.tensor(op, "q_pe", q_pe)
    if q_pe.dtype != q_nope.dtype or q_pe.shape != (total_q, h, p):
        v.fail(op, "q_pe", f"a {dtypes.name(q_nope.dtype)} [total_q={total_q}, num_heads={h}, P={p}] tensor "
               "(P: kpe_cache's last dim)", v.desc(q_pe))
    v.same_device(op, "q_pe", q_pe, dev)
    varlen = query_start_loc is not None
    if varlen:
        v.tensor(op, "query_start_loc", query_start_loc)
        if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
            v.fail(op, "query_start_loc", "an int32 [num_seqs + 1] tensor (row offsets, starting at 0)",
                   v.desc(query_start_loc))
        v.same_device(op, "query_start_loc", query_start_loc, dev)
        n = query_start_loc.shape[0] - 1
    else:
        n = total_q
    v.tensor(op, "block_tables", block_tables)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != n:
        v.fail(op, "block_tables", f"an int32 [num_seqs={n}, max_blocks_per_seq] tensor", v.desc(block_tables))
    v.same_device(op, "block_tables", block_tables, dev)
    v.tensor(op, "seq_lens", seq_lens)
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] != n:
        v.fail(op, "seq_lens", f"an int32 [num_seqs={n}] tensor", v.desc(seq_lens))
    v.same_device(op, "seq_lens", seq_lens, dev)
    if not v.positive_f32(scale):
        v.fail(op, "scale", v.positive_f32_text(scale, "a finite float > 0"), repr(scale))
    capacity = block_tables.shape[1] * bs
    if max_seq_len is not None and max_seq_len > capacity:
        v.fail(op, "max_seq_len", f"<= the block table's capacity {capacity} tokens", str(max_seq_len))
    if max_seq_len is None and dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        v.fail(op, "max_seq_len", "given while a CUDA graph is being captured", "None")
    if varlen and max_query_len is None and dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        v.fail(op, "max_query_len", "given while a CUDA graph is being captured", "None")
    if not varlen and max_query_len not in (None, 1) and total_q:
        v.fail(op, "max_query_len", "None or 1 without query_start_loc (one row per sequence)", repr(max_query_len))
    v.tensor(op, "out", out)
    if out.shape != q_nope.shape or out.dtype != q_nope.dtype or out.device != q_nope.device:
        v.fail(op, "out", f"like q_nope ({v.desc(q_nope)})", v.desc(out))
    if lse is not None:
        v.tensor(op, "lse", lse)
        if lse.dtype != torch.float32 or lse.shape != q_nope.shape[:2] or lse.device != q_nope.device:
            v.fail(op, "lse", f"None or a float32 [total_q, num_heads] = {list(q_nope.shape[:2])} tensor on "
                   f"{q_nope.device} (any strides)", v.desc(lse))

    max_seq_len = v.context_bounds(op, seq_lens, block_tables, nb, bs, max_seq_len)
    if varlen:
        max_query_len = v.query_rows(op, query_start_loc, total_q, seq_lens, max_query_len, "q_nope", "hal.cache_mla")
    else:
        max_query_len = 1

    feats = {"varlen"} if varlen else set()
    if lse is not None:
        feats.add("lse")
    if not (ckv_cache.is_contiguous() and kpe_cache.is_contiguous()):
        feats.add("strided_cache")
    if fp8.is_fp8(kpe_cache.dtype):
        feats.add("fp8_rope")
    if v.rows_misaligned(ckv_cache, 16) or v.rows_misaligned(kpe_cache, 8):
        feats.add("misaligned_cache")
    key = CallKey(op, dev.type, q_nope.dtype, ckv_cache.dtype, r, bs, h, frozenset(feats), p, kpe_cache.dtype)
    return MLACall(call_key=key, target=target(), geometry=Geometry(n, h, 1, r, bs, nb, total_q), rope_dim=p,
                   out=v.unit_last(out), q_nope=v.unit_last(q_nope), q_pe=v.unit_last(q_pe), ckv_cache=ckv_cache,
                   kpe_cache=kpe_cache, block_tables=block_tables, seq_lens=seq_lens, scale=scale, ckv_scale=cs,
                   kpe_scale=ps, max_seq_len=max_seq_len, query_start_loc=query_start_loc,
                   max_query_len=max_query_len, lse=lse)


def reference(call: MLACall) -> torch.Tensor:
    return _reference.mla_decode(call.q_nope, call.q_pe, call.ckv_cache, call.kpe_cache, call.block_tables,
                                 call.seq_lens, call.query_start_loc, scale=call.scale, ckv_scale=call.ckv_scale,
                                 kpe_scale=call.kpe_scale)


def example(device: str, cache_dtype: torch.dtype) -> dict:
    """A small typical call: 3 sequences over a combined [blocks, 16, 512 + 64] cache (the latent in
    ``cache_dtype``, written by hal.cache_mla), 16 heads, bf16 queries."""
    from hal import api
    g = torch.Generator().manual_seed(0)
    r, p, bs, lens = 512, 64, 16, [40, 17, 64]
    nb = sum((L + bs - 1) // bs for L in lens) + 1
    ckv = torch.zeros(nb, bs, r, dtype=cache_dtype, device=device)
    kpe = torch.zeros(nb, bs, p, dtype=torch.bfloat16, device=device)
    tokens = (nb - 1) * bs
    kv_c = torch.randn(tokens, r, generator=g).to(device)
    k_pe = torch.randn(tokens, p, generator=g).to(device)
    cs = kv_c.abs().max().item() / torch.finfo(cache_dtype).max if fp8.is_fp8(cache_dtype) else None
    perm = torch.randperm(nb - 1, generator=g)
    slots = (perm[:, None] * bs + torch.arange(bs)).reshape(-1).to(device)
    api.cache_mla(kv_c, k_pe, ckv, kpe, slots, ckv_scale=cs)
    per = [(L + bs - 1) // bs for L in lens]
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    at = 0
    for i, u in enumerate(per):
        tables[i, :u] = perm[at:at + u]
        at += u
    qn = torch.randn(len(lens), 16, r, generator=g).to(torch.bfloat16).to(device)
    qp = torch.randn(len(lens), 16, p, generator=g).to(torch.bfloat16).to(device)
    return dict(q_nope=qn, q_pe=qp, ckv_cache=ckv, kpe_cache=kpe, block_tables=tables.to(device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), scale=(r + p) ** -0.5,
                ckv_scale=cs, max_seq_len=max(lens), out=torch.full_like(qn, float("nan")))


DECL = OpDecl(name=NAME, schema=SCHEMA, features=FEATURES, schema_args=schema_args, check=check, tensors=tensors,
              fake=fake_checks(NAME, tensors, (("ckv_scale", 8, 10), ("kpe_scale", 9, 11))),
              result=lambda args: args[0], finish=copy_out_back, reference=reference, example=example,
              per_layer=("q_nope", "q_pe", "ckv_cache", "kpe_cache", "ckv_scale", "kpe_scale", "out", "lse"),
              scale_args=("ckv_scale", "kpe_scale"), extra_outputs=("lse",))
