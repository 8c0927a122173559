"""The declaration of ``hal::paged_attention``: schema, validation into an :class:`AttentionCall`,
fake, float64 reference, and a typical call for the probe."""

from __future__ import annotations

import math

import torch

from hal import reference as _reference
from hal import validate as v
from hal.call import AttentionCall, Geometry
from hal.ops.decl import OpDecl, copy_out_back, fake_checks
from hal.pack import CallKey
from hal.targets import target

NAME = "paged_attention"
SCHEMA = ("(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
          "Tensor seq_lens, float scale, float? k_scale, float? v_scale, Tensor? k_scale_tensor, "
          "Tensor? v_scale_tensor, Tensor? alibi_slopes, float? logits_soft_cap, int? sliding_window, "
          "int? max_seq_len, Tensor? query_start_loc, int? max_query_len, bool causal, Tensor(b!)? lse, "
          "str? pack) -> ()")
FEATURES = {
    "alibi": "ALiBi slopes",
    "soft_cap": "logits soft-cap",
    "sliding_window": "a sliding window",
    "per_head_scales": "[num_kv_heads] k/v scales",
    "misaligned_cache": "caches whose data pointer or block, head or token stride is not a multiple of 16 bytes",
    "strided_cache": "caches that are not dense within each block (e.g. an NHD cache's permute(0, 2, 1, 3) view)",
    "varlen": "several query tokens per sequence (query_start_loc: prefill, chunked prefill, mixed batches)",
    "lse": "each row's log-sum-exp of its logits written to lse (cascade and context-parallel merges)",
}


def schema_args(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, k_scale=None,
                v_scale=None, alibi_slopes=None, logits_soft_cap=None, sliding_window=None, max_seq_len=None,
                query_start_loc=None, max_query_len=None, causal=True, out=None, lse=None, pack=None) -> tuple:
    """The public keywords as the schema's arguments: Python numbers are checked before torch's
    schema coerces them (True -> 1), scales go to their float or tensor slot, ``out`` is allocated."""
    v.tensor(NAME, "query", query)
    if scale is None:  # head_size 0 (or a 0-d query) is reported by validation, not as a ZeroDivisionError
        scale = query.shape[-1] ** -0.5 if query.dim() and query.shape[-1] > 0 else 1.0
    else:
        scale = v.real(NAME, "scale", scale, "a finite float > 0 (or None for head_size**-0.5)")
    if logits_soft_cap is not None:
        logits_soft_cap = v.real(NAME, "logits_soft_cap", logits_soft_cap, "None or a finite float > 0")
    v.integer(NAME, "sliding_window", sliding_window, 1, "no window; else keys at positions >= seq_len - window")
    v.integer(NAME, "max_seq_len", max_seq_len, 0, "read from seq_lens")
    v.integer(NAME, "max_query_len", max_query_len, 0, "read from query_start_loc")
    if not isinstance(causal, bool):
        v.fail(NAME, "causal", "True or False", f"{causal!r} ({type(causal).__name__})")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ks, kst = v.split_scale(NAME, "k_scale", k_scale)
    vs, vst = v.split_scale(NAME, "v_scale", v_scale)
    return (out, query, key_cache, value_cache, block_tables, seq_lens, scale, ks, vs, kst, vst, alibi_slopes,
            logits_soft_cap, sliding_window, max_seq_len, query_start_loc, max_query_len, causal, lse, pack)


def tensors(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, k_scale_tensor,
            v_scale_tensor, alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, query_start_loc,
            max_query_len, causal, lse, pack) -> dict:
    t = dict(out=out, query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
             seq_lens=seq_lens, k_scale=k_scale_tensor, v_scale=v_scale_tensor, alibi_slopes=alibi_slopes,
             query_start_loc=query_start_loc)
    if lse is not None:
        t["lse"] = lse
    return t


def check(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, k_scale_tensor,
          v_scale_tensor, alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, query_start_loc, max_query_len,
          causal, lse, pack) -> AttentionCall:
    """Every argument checked (errors name the argument, what was expected, what was given)."""
    op = NAME
    v.tensor(op, "query", query)
    v.caches(op, key_cache, value_cache)
    ks = v.scale(op, "k_scale", v.pick(op, "k_scale", k_scale, k_scale_tensor), key_cache)
    vs = v.scale(op, "v_scale", v.pick(op, "v_scale", v_scale, v_scale_tensor), value_cache)
    nb, hkv, bs, d = key_cache.shape
    dev = key_cache.device
    if query.dtype not in v.QUERY_DTYPES:
        v.fail(op, "query", "float16, bfloat16 or float32", v.desc(query))
    if query.dim() != 3:
        v.fail(op, "query", "3-d [total_q, num_heads, head_size]", v.desc(query))
    v.same_device(op, "query", query, dev)
    total_q, h, qd = query.shape
    n = total_q if query_start_loc is None else _num_seqs(query_start_loc)
    if qd != d:
        v.fail(op, "query", f"head_size {d} like the caches (last dim)", v.desc(query))
    if h % hkv != 0:
        v.fail(op, "query", f"a number of heads divisible by num_kv_heads={hkv}", f"{h} heads")

    if query_start_loc is not None and isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 \
            and seq_lens.shape[0] != n:
        v.fail(op, "query_start_loc", f"[num_seqs + 1] = [{seq_lens.shape[0] + 1}] entries (one more than seq_lens)",
               v.desc(query_start_loc))
    v.tensor(op, "block_tables", block_tables)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != n:
        v.fail(op, "block_tables", f"an int32 [num_seqs={n}, max_blocks_per_seq] tensor", v.desc(block_tables))
    v.same_device(op, "block_tables", block_tables, dev)
    v.tensor(op, "seq_lens", seq_lens)
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] != n:
        v.fail(op, "seq_lens", f"an int32 [num_seqs={n}] tensor", v.desc(seq_lens))
    v.same_device(op, "seq_lens", seq_lens, dev)
    capacity = block_tables.shape[1] * bs

    if isinstance(scale, bool) or not isinstance(scale, float) or not v.positive_f32(scale):
        v.fail(op, "scale", "a finite float > 0 (or None for head_size**-0.5)"
               + (" as a float32" if isinstance(scale, float) and scale > 0 and math.isfinite(scale) else ""),
               repr(scale))
    if alibi_slopes is not None:
        v.tensor(op, "alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32 or alibi_slopes.shape != (h,):
            v.fail(op, "alibi_slopes", f"a float32 [num_heads={h}] tensor", v.desc(alibi_slopes))
        v.same_device(op, "alibi_slopes", alibi_slopes, dev)
    if logits_soft_cap is not None:
        cap = v.real(op, "logits_soft_cap", logits_soft_cap, "None or a finite float > 0")
        if not v.positive_f32(cap):
            v.fail(op, "logits_soft_cap", "None or " + v.positive_f32_text(cap, "a finite float > 0"),
                   repr(logits_soft_cap))
    v.integer(op, "sliding_window", sliding_window, 1, "no window; else keys at positions >= seq_len - window")
    v.integer(op, "max_seq_len", max_seq_len, 0, "read from seq_lens")
    if max_seq_len is not None:
        if max_seq_len > capacity:
            v.fail(op, "max_seq_len", f"<= the block table's capacity {capacity} tokens", str(max_seq_len))
    elif dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        v.fail(op, "max_seq_len", "given while a CUDA graph is being captured (it sizes the split-K "
               "workspace without a device sync)", "None")

    varlen = query_start_loc is not None
    if varlen:
        max_query_len = _check_query_start_loc(query_start_loc, total_q, seq_lens, max_query_len, causal,
                                               alibi_slopes, sliding_window, dev)
    else:
        v.integer(op, "max_query_len", max_query_len, 0, "read from query_start_loc")
        if max_query_len is not None and max_query_len != 1 and total_q:
            v.fail(op, "max_query_len", "None or 1 without query_start_loc (one row per sequence)", repr(max_query_len))
        max_query_len = 1
    v.tensor(op, "out", out)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        v.fail(op, "out", f"like query ({v.desc(query)})", v.desc(out))

    if lse is not None:
        v.tensor(op, "lse", lse)
        if lse.dtype != torch.float32 or lse.shape != (total_q, h) or lse.device != query.device:
            v.fail(op, "lse", f"None or a float32 [total_q={total_q}, num_heads={h}] tensor on {query.device} "
                   "(any strides)", v.desc(lse))
    max_seq_len = v.context_bounds(op, seq_lens, block_tables, nb, bs, max_seq_len)  # decided once, for every pack

    feats = v.features(alibi_slopes, logits_soft_cap, sliding_window, ks, vs, (key_cache, value_cache))
    if v.rows_misaligned(key_cache, 16) or v.rows_misaligned(value_cache, 16):  # heads / tokens of a view too
        feats = feats | {"misaligned_cache"}
    feats = feats | ({"varlen"} if varlen else set()) | ({"lse"} if lse is not None else set())
    key = CallKey(op, dev.type, query.dtype, key_cache.dtype, d, bs, h // hkv, feats)
    return AttentionCall(
        call_key=key, target=target(), geometry=Geometry(n, h, hkv, d, bs, nb, total_q),
        out=v.unit_last(out), query=v.unit_last(query), key_cache=key_cache, value_cache=value_cache,
        block_tables=block_tables, seq_lens=seq_lens, scale=scale, k_scale=ks, v_scale=vs,
        alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
        max_seq_len=max_seq_len, query_start_loc=query_start_loc, max_query_len=max_query_len,
        causal=causal if varlen else True, lse=lse)


def _num_seqs(qsl) -> int:
    v.tensor(NAME, "query_start_loc", qsl)
    if qsl.dtype != torch.int32 or qsl.dim() != 1 or qsl.shape[0] < 1:
        v.fail(NAME, "query_start_loc", "an int32 [num_seqs + 1] tensor (row offsets, starting at 0)", v.desc(qsl))
    return qsl.shape[0] - 1


def _check_query_start_loc(qsl, total_q, seq_lens, max_query_len, causal, alibi_slopes, sliding_window, dev) -> int:
    """Row offsets: 0 first, non-decreasing, total_q last, each sequence's rows within its length.
    Values are read on the host only for CPU tensors or under HAL_DEBUG; returns max_query_len."""
    op = NAME
    v.same_device(op, "query_start_loc", qsl, dev)
    v.integer(op, "max_query_len", max_query_len, 0, "read from query_start_loc")
    if not causal and (alibi_slopes is not None or sliding_window is not None):
        v.fail(op, "causal", "True with ALiBi or a sliding window (a non-causal window or bias has no agreed "
               "meaning, so hal does not guess one)", "False")
    if max_query_len is None and not v.on_host_or_debug(qsl) and dev.type == "cuda" \
            and torch.cuda.is_current_stream_capturing():
        v.fail(op, "max_query_len", "given while a CUDA graph is being captured (no device read plans the "
               "launch)", "None")
    return v.query_rows(op, qsl, total_q, seq_lens, max_query_len, "the query", "hal.cache_kv")


def reference(call: AttentionCall) -> torch.Tensor:
    if call.query_start_loc is not None:
        return _reference.paged_attention_varlen(
            call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens, call.query_start_loc,
            causal=call.causal, scale=call.scale, k_scale=call.k_scale, v_scale=call.v_scale,
            alibi_slopes=call.alibi_slopes, logits_soft_cap=call.logits_soft_cap, sliding_window=call.sliding_window)
    return _reference.paged_attention(call.query, call.key_cache, call.value_cache, call.block_tables,
                                      call.seq_lens, scale=call.scale, k_scale=call.k_scale, v_scale=call.v_scale,
                                      alibi_slopes=call.alibi_slopes, logits_soft_cap=call.logits_soft_cap,
                                      sliding_window=call.sliding_window)


# The probe's typical decode call (and the shape its dispatch table describes).
EXAMPLE_SHAPE = dict(num_seqs=4, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, context=1000)


def example(device: str, cache_dtype: torch.dtype) -> dict:
    """A typical decode call on ``device``: pages written by ``hal.cache_kv`` (calibrated scales,
    shuffled blocks, one spare block), ragged lengths, a NaN-poisoned ``out``."""
    from hal import api
    s = EXAMPLE_SHAPE
    g = torch.Generator().manual_seed(0)
    nb = s["num_seqs"] * ((s["context"] + s["block_size"] - 1) // s["block_size"]) + 1
    shape = (nb, s["num_kv_heads"], s["block_size"], s["head_size"])
    kc = torch.empty(shape, dtype=cache_dtype, device=device)
    vc = torch.empty_like(kc)
    tokens = (nb - 1) * s["block_size"]
    k = torch.randn(tokens, s["num_kv_heads"], s["head_size"], generator=g).to(device)
    val = torch.randn(tokens, s["num_kv_heads"], s["head_size"], generator=g).to(device)
    fmax = torch.finfo(cache_dtype).max
    ks, vs = k.abs().max().item() / fmax, val.abs().max().item() / fmax
    perm = torch.randperm(nb - 1, generator=g)
    slots = (perm[:, None] * s["block_size"] + torch.arange(s["block_size"])).reshape(-1).to(device)
    api.cache_kv(k, val, kc, vc, slots, k_scale=ks, v_scale=vs)
    per_seq = (s["context"] + s["block_size"] - 1) // s["block_size"]
    tables = perm[: s["num_seqs"] * per_seq].reshape(s["num_seqs"], per_seq).to(torch.int32).to(device)
    lens = torch.tensor([s["context"] - 3 * i for i in range(s["num_seqs"])], dtype=torch.int32, device=device)
    q = torch.randn(s["num_seqs"], s["num_heads"], s["head_size"], generator=g).to(torch.bfloat16).to(device)
    return dict(query=q, key_cache=kc, value_cache=vc, block_tables=tables, seq_lens=lens, k_scale=ks, v_scale=vs,
                max_seq_len=s["context"], out=torch.full_like(q, float("nan")))


DECL = OpDecl(name=NAME, schema=SCHEMA, features=FEATURES, schema_args=schema_args, check=check, tensors=tensors,
              fake=fake_checks(NAME, tensors, (("k_scale", 7, 9), ("v_scale", 8, 10))),
              result=lambda args: args[0], finish=copy_out_back, reference=reference, example=example,
              per_layer=("query", "key_cache", "value_cache", "k_scale", "v_scale", "out", "lse"),
              scale_args=("k_scale", "v_scale"), extra_outputs=("lse",))
