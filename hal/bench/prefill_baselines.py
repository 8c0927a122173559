"""The baselines of the prefill bench (several query tokens per sequence).

``torch-sdpa``: plain PyTorch on **dense** K/V: before timing, every sequence's pages are gathered
into contiguous ``[n, kv_heads, L, d]`` tensors in the query dtype (an FP8 cache decoded and
multiplied by its scale), sequences of one (q_len, seq_len) batched together. Timed: one
``F.scaled_dot_product_attention(..., enable_gqa=True)`` per such batch, causal and bottom-right
aligned (``is_causal=True`` when every key is new, ``torch.nn.attention.bias.causal_lower_right``
over cached context, no mask for single decode rows), and the copy of its output into the
[total_q, h, d] result. Where this torch refuses GQA for a variant, the K/V heads are expanded
before timing instead (the note says so).

``flashinfer-prefill``: FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` with the fa2 backend
(bf16 query over a bf16 or FP8 cache: FlashInfer's fa3 backend needs an FP8 query for an FP8 cache),
on its own NHD copy of the same pages (hal.bench.baselines' layout), ``qo_indptr`` =
``query_start_loc``, ``causal=True``. ``plan()`` once outside the timing; ``run(q, (k, v),
k_scale=, v_scale=)`` timed. Without ``--flashinfer-jit`` only the prebuilt module is used
(shared/tools/flashinfer: bf16 query, bf16 or e4m3fn KV, head_dim 128).

``fa3`` / ``fa3-fp8``: FlashAttention-3 forward from the ``fa3-fwd`` wheel
(``fa3_fwd_interface.flash_attn_varlen_func``) on **contiguous** K/V packed before timing
(``[sum(seq_lens), kv_heads, d]``, ``cu_seqlens_k``), causal (bottom-right, per sequence): the
compute ceiling, not a paged kernel (the wheel is built without paged KV). ``fa3`` computes in bf16
(an FP8 cache decoded to bf16 first). ``fa3-fp8`` runs FA3's FP8 mode on the e4m3fn problems: the
cache's own FP8 bytes as K and V with their scales as ``k_descale``/``v_descale``, and the query
quantized to e4m3fn with one per-tensor scale (``q_descale``) before timing; FA3 also rounds P to
FP8, so its error is larger than hal's semantics allow and it is checked against a looser bound
(reported beside its speed).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from hal import fp8
from hal.bench import baselines
from hal.bench.baselines import Skip
from hal.bench.prefill import PrefillProblem

FA3_FP8_TOLERANCE = 1.5e-1   # an emulation of its rounding (Q and P to e4m3) gives ~5e-2 worst per row


def _dense(p: PrefillProblem, seqs: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(seqs), hkv, L, d] K and V (all of seqs have length L), decoded and scaled, in dtype."""
    bs = p.shape.block_size
    L = p.lens[seqs[0]]
    nblk = (L + bs - 1) // bs
    idx = torch.tensor(seqs, dtype=torch.long, device=p.device)
    blocks = p.block_tables[idx, :nblk].to(torch.long)                     # [m, nblk]
    out = []
    for cache, s in ((p.key_cache, p.k_scale), (p.value_cache, p.v_scale)):
        x = cache[blocks]                                                   # [m, nblk, hkv, bs, d]
        x = x.permute(0, 2, 1, 3, 4).reshape(len(seqs), p.shape.num_kv_heads, nblk * bs, p.shape.head_size)
        x = x[:, :, :L]
        x = (x.to(torch.float32) * s).to(dtype) if s is not None else x.to(dtype)
        out.append(x.contiguous())
    return out[0], out[1]


def _groups(p: PrefillProblem) -> list[list[int]]:
    """Sequences with the same (q_len, seq_len), in order of first appearance."""
    by: dict[tuple[int, int], list[int]] = {}
    for i, (q, L) in enumerate(zip(p.q_lens, p.lens)):
        by.setdefault((q, L), []).append(i)
    return list(by.values())


def torch_sdpa(p: PrefillProblem):
    from torch.nn.attention.bias import causal_lower_right

    h, d = p.shape.num_heads, p.shape.head_size
    g = p.shape.gqa
    out = torch.empty_like(p.query)
    calls, notes = [], set()
    for seqs in _groups(p):
        q_len, L = p.q_lens[seqs[0]], p.lens[seqs[0]]
        m = len(seqs)
        rows = torch.cat([torch.arange(p.starts[i], p.starts[i + 1]) for i in seqs])
        r0 = p.starts[seqs[0]]
        contiguous = rows.tolist() == list(range(r0, r0 + m * q_len))
        k, v = _dense(p, seqs, p.query.dtype)
        if q_len == 1:
            kw = {}                                  # a decode row sees every key
        elif q_len == L:
            kw = {"is_causal": True}                 # every key is new: square causal
        else:
            kw = {"attn_mask": causal_lower_right(q_len, L)}
        qv = p.query[r0:r0 + m * q_len] if contiguous else p.query[rows.to(p.device)]
        qv = qv.view(m, q_len, h, d).transpose(1, 2)   # [m, h, q, d], a view
        try:                                          # this torch's SDPA with enable_gqa for this variant?
            F.scaled_dot_product_attention(qv, k, v, scale=p.scale, enable_gqa=True, **kw)
            kw = kw | {"enable_gqa": True}
        except (RuntimeError, TypeError, ValueError) as exc:
            if g == 1:
                raise
            # expanded heads, and no enable_gqa keyword at all (an older CausalBias takes none)
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            F.scaled_dot_product_attention(qv, k, v, scale=p.scale, **kw)
            notes.add(f"K/V heads expanded before timing for {'decode rows' if q_len == 1 else 'this mask'} "
                      f"(SDPA refused enable_gqa: {type(exc).__name__})")
        calls.append((r0, m, q_len, contiguous, rows.to(p.device), k, v, kw))
    q, scale = p.query, p.scale

    def run() -> torch.Tensor:
        for r0, m, q_len, contiguous, rows, k, v, kw in calls:
            qv = (q[r0:r0 + m * q_len] if contiguous else q[rows]).view(m, q_len, h, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qv, k, v, scale=scale, **kw)
            if contiguous:
                out[r0:r0 + m * q_len].view(m, q_len, h, d).copy_(o.transpose(1, 2))
            else:
                out[rows] = o.transpose(1, 2).reshape(m * q_len, h, d)
        return out

    return run, out, "; ".join(sorted(notes)) + ("; " if notes else "") + f"{len(calls)} SDPA call(s)"


# FlashInfer: the prefill module shared/tools/flashinfer builds (page size is a run-time argument)
FI_PREFILL_PREBUILT = {"query": (torch.bfloat16,), "kv": (torch.bfloat16, torch.float8_e4m3fn), "head_size": (128,)}


def flashinfer_prefill(p: PrefillProblem, allow_jit: bool = False):
    if p.device.type != "cuda":
        raise Skip("FlashInfer runs on NVIDIA GPUs only")
    fi = baselines.import_flashinfer(allow_jit)
    if not allow_jit:
        why = []
        if p.query.dtype not in FI_PREFILL_PREBUILT["query"]:
            why.append(f"query {p.query.dtype}")
        if p.kv_dtype not in FI_PREFILL_PREBUILT["kv"]:
            why.append(f"KV {p.kv_dtype}")
        if p.shape.head_size not in FI_PREFILL_PREBUILT["head_size"]:
            why.append(f"head_size {p.shape.head_size}")
        if why:
            raise Skip(f"no prebuilt FlashInfer prefill module for {', '.join(why)} (prebuilt: bf16 q, "
                       f"bf16/e4m3fn KV, head_dim 128; --flashinfer-jit lets FlashInfer compile one)")
    elif p.kv_dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        raise Skip(f"FlashInfer has no {p.kv_dtype} KV cache")
    lay = baselines._fi_layout(p)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(lay["workspace"], "NHD", backend="fa2")
    wrapper.plan(p.query_start_loc, lay["indptr"], lay["indices"], lay["last_page_len"], p.shape.num_heads,
                 p.shape.num_kv_heads, p.shape.head_size, p.shape.block_size, causal=True,
                 pos_encoding_mode="NONE", q_data_type=p.query.dtype, kv_data_type=p.kv_dtype, sm_scale=p.scale)
    out = torch.empty_like(p.query)
    q, kv = p.query, (lay["k"], lay["v"])
    scales = {"k_scale": p.k_scale, "v_scale": p.v_scale} if p.k_scale is not None else {}

    def run() -> torch.Tensor:
        return wrapper.run(q, kv, out=out, **scales)

    return run, out, f"flashinfer {getattr(fi, '__version__', '?')}, backend fa2, causal"


def import_fa3():
    try:
        return importlib.import_module("fa3_fwd_interface")
    except Exception as exc:  # ImportError, or a .so that does not load
        raise Skip(f"import fa3_fwd_interface failed ({type(exc).__name__}: {exc}); install the fa3-fwd 0.0.3 "
                   f"wheel (docs/bench.md)") from None


def fa3_layout(p: PrefillProblem) -> dict:
    """Contiguous K and V, ``[sum(seq_lens), kv_heads, d]`` in the cache's own encoding (sequence i's
    keys at rows ``cu_k[i] .. cu_k[i+1]-1``), and ``cu_k``; built once per problem, before timing."""
    if "fa3" not in p.extra:
        bs, hkv, d = p.shape.block_size, p.shape.num_kv_heads, p.shape.head_size
        ks, vs = [], []
        for i, L in enumerate(p.lens):
            nblk = (L + bs - 1) // bs
            blocks = p.block_tables[i, :nblk].to(torch.long)
            for cache, acc in ((p.key_cache, ks), (p.value_cache, vs)):
                acc.append(cache[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, hkv, d)[:L])
        cu_k = [0]
        for L in p.lens:
            cu_k.append(cu_k[-1] + L)
        p.extra["fa3"] = {"k": torch.cat(ks).contiguous(), "v": torch.cat(vs).contiguous(),
                          "cu_k": torch.tensor(cu_k, dtype=torch.int32, device=p.device)}
    return p.extra["fa3"]


def fa3_args(p: PrefillProblem, fp8_mode: bool) -> tuple[tuple, dict, str]:
    """``flash_attn_varlen_func``'s arguments for ``p``: bf16 Q/K/V (an FP8 cache decoded first), or
    FP8 Q/K/V with ``(num_seqs, kv_heads)`` float32 descales (Q quantized with one per-tensor scale)."""
    lay = fa3_layout(p)
    k, v = lay["k"], lay["v"]
    kw = dict(softmax_scale=p.scale, causal=True)
    if not fp8_mode:
        note = "bf16 Q/K/V, contiguous K/V"
        if p.is_fp8:
            k = (k.to(torch.float32) * p.k_scale).to(torch.bfloat16)
            v = (v.to(torch.float32) * p.v_scale).to(torch.bfloat16)
            note += " (FP8 cache decoded to bf16 before timing)"
        q = p.query
    else:
        n, hkv = len(p.lens), p.shape.num_kv_heads
        fmax = fp8.encoding_of(torch.float8_e4m3fn).max_finite
        q_scale = max(float(p.query.float().abs().max()) / fmax, 1e-12)
        q = (p.query.float() / q_scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn)

        def desc(x):
            return torch.full((n, hkv), x, dtype=torch.float32, device=p.device)

        kw.update(q_descale=desc(q_scale), k_descale=desc(p.k_scale), v_descale=desc(p.v_scale))
        note = (f"FP8 Q/K/V (Q quantized per tensor before timing, P rounded to FP8 in the kernel), "
                f"contiguous K/V; checked to {FA3_FP8_TOLERANCE:.2g}")
    return (q, k, v, p.query_start_loc, lay["cu_k"], p.max_query_len, p.max_seq_len), kw, note


def _fa3_module(p: PrefillProblem):
    if p.device.type != "cuda":
        raise Skip("FA3 runs on NVIDIA sm_90 GPUs only")
    major, minor = torch.cuda.get_device_capability(p.device)
    if (major, minor) != (9, 0):
        raise Skip(f"FA3 (fa3-fwd) is built for sm_90 only; this GPU is sm_{major}{minor}")
    return import_fa3()


def fa3_bf16(p: PrefillProblem):
    fa3 = _fa3_module(p)
    if p.query.dtype != torch.bfloat16:
        raise Skip("fa3-fwd is built without fp16 kernels: bf16 queries only")
    args, kw, note = fa3_args(p, False)

    def run() -> torch.Tensor:
        return fa3.flash_attn_varlen_func(*args, **kw)

    return run, None, note


def fa3_fp8(p: PrefillProblem):
    fa3 = _fa3_module(p)
    if p.kv_dtype != torch.float8_e4m3fn:
        raise Skip("FA3's FP8 mode runs on the e4m3fn cache problems (Q, K and V all e4m3fn)")
    args, kw, note = fa3_args(p, True)

    def run() -> torch.Tensor:
        return fa3.flash_attn_varlen_func(*args, **kw)

    return run, None, note
