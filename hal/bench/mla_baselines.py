"""What the MLA decode bench runs (:mod:`hal.bench.mla`): hal's own calls and the baselines.

Each function takes an :class:`~hal.bench.mla.MlaProblem` and returns ``(run, out, note)`` or
``(run, out, note, tolerance)`` (``run()`` computes the [total_q, H, R] output: it writes ``out``
or, where ``out`` is None, returns it), or raises :class:`~hal.bench.baselines.Skip` with the reason
it cannot run here. Everything a contender needs besides the call itself (its own copy of the cache
in its layout, its metadata, FlashInfer's plan) is made before timing.

``hal`` / ``hal:NAME``: ``hal.mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens,
scale=, ckv_scale=, kpe_scale=, max_seq_len=, out=)`` on the problem's own views (validation and
dispatch included; ``pack=NAME`` forces a pack). ``emu-torch`` / ``emu-triton``: the emu pack's
PyTorch and Triton MLA paths called directly on the validated call record.

``torch``: **the baseline**, plain PyTorch as a user writes it, all inside the timed call: gather every
sequence's pages up to the longest (``ckv_cache[block_tables]``, ``kpe_cache[...]``, padded), cast
to float32 (an FP8 latent decodes exactly; its scale is folded into the scores and the
probabilities, not rounded into a 16-bit copy), scores ``q_nope c^T + q_pe kpe^T`` as float32 batched
matrix products (TF32 on a GPU: the bf16 query and the bf16/FP8 cache values are exact in TF32, so
nothing is lost), a length (and causal) mask, softmax in float32, and the probabilities in the query
dtype times the latent (a bf16 matmul). Scores in bf16 would cost it ~1e-2 of error, over the 5e-3
bound. Runs on the CPU too.

``flashmla``: FlashMLA's dense bf16 decode from the ``sgl-flash-mla`` 1.0.0 wheel (module
``flash_mla``; its sm_90 kernels are the "legacy" ops, ``torch.ops.flash_mla_legacy``):
``get_mla_metadata()`` (an empty schedule, filled by the first call, which is the checked one, before
timing), then ``flash_mla_with_kvcache(q, k_cache, block_table, seq_lens, 512, meta,
softmax_scale=, causal=T > 1, use_legacy=True)`` with ``q`` the problem's [b, T, H, 576] query and
``k_cache`` the problem's own combined [blocks, 64, 1, 576] bf16 cache (no copy). Page 64 only,
R + P = 576 and R = 512, query and cache of one 16-bit dtype (the bf16 problems), sm_90 only.

``flashmla-fp8``: FlashMLA's dense FP8 decode (the same wheel; ``get_mla_decoding_metadata(seq_lens,
T * H, 1, is_fp8_kvcache=True, use_legacy=True)`` before timing, then ``flash_mla_with_kvcache(...,
is_fp8_kvcache=True, descale_q=, descale_k=)``) on the e4m3fn problems: its cache is one e4m3fn
[blocks, 64, 1, 576] tensor with one scale, so it gets a copy made before timing with the problem's
latent bytes as they are and the rotary part encoded to e4m3fn with the latent's scale (vLLM's "flat
FP8 576" layout); the query is quantized to e4m3fn with one per-tensor scale, before timing too. It
also rounds P to FP8. Its error (~5e-2) is over hal's semantics: checked against
:data:`FLASHMLA_FP8_TOLERANCE` and flagged.

``flashinfer-mla``: FlashInfer's ``BatchMLAPagedAttentionWrapper(workspace, backend="fa3")``, planned
once outside the timing with CSR metadata (``qo_indptr``, ``kv_indptr``, ``kv_indices`` from the
same block table, ``kv_len_arr`` = seq_lens), ``num_heads``, ``head_dim_ckv`` 512, ``head_dim_kpe``
64, the page size (any), ``causal`` = T > 1, ``q_data_type`` bf16, ``kv_data_type`` the latent's;
``run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=, ckv_scale=, kpe_scale=)`` timed on the
problem's own views. Its FP8 path reads the latent and the rotary part in one dtype: on an e4m3fn
problem it gets an e4m3fn copy of the rotary part (per-tensor ``kpe_scale``) made before timing,
the latent's bytes as they are. That rounding (~1e-2 of error) is flagged and checked against
:data:`FLASHINFER_FP8_TOLERANCE`; the bf16 problems are checked against 5e-3. Only the two modules
``tools/flashinfer_mla/prep.sh`` prebuilds are used (bf16 q/o, bf16 or e4m3fn KV, 512/64) unless
``--flashinfer-jit``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

import torch

import hal
from hal import fp8
from hal.bench.baselines import Skip, import_flashinfer
from hal.bench.mla import MlaProblem

FLASHMLA_FP8_TOLERANCE = 1.5e-1   # an emulation of its rounding (Q and the rotary part to e4m3, no P) gives ~5e-2
FLASHINFER_FP8_TOLERANCE = 5e-2   # an emulation of the rotary part rounded to e4m3 gives 1.0-1.5e-2
FI_WORKSPACE = 128 << 20
# What tools/flashinfer_mla/prep.sh builds (fa3 backend)
FI_MLA_PREBUILT = {"query": (torch.bfloat16,), "kv": (torch.bfloat16, torch.float8_e4m3fn), "latent": (512,),
                   "rope": (64,)}
FLASHMLA_HINT = ("install the sgl-flash-mla 1.0.0 wheel with --no-deps (docs/bench.md, \"MLA decode\"): its "
                 "METADATA asks for torch>=2.14.1, but its .so files use torch's stable ABI only")


def _hal_kwargs(p: MlaProblem) -> dict:
    return {"scale": p.scale, "ckv_scale": p.ckv_scale, "kpe_scale": p.kpe_scale,
            "query_start_loc": p.query_start_loc,
            "max_query_len": p.max_query_len if p.query_start_loc is not None else None,
            "max_seq_len": p.max_seq_len}


def _args(p: MlaProblem) -> tuple:
    return p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_tables, p.seq_lens


def _out(p: MlaProblem) -> torch.Tensor:
    return torch.empty((p.total_q, p.shape.num_heads, p.shape.latent), dtype=p.query.dtype, device=p.device)


def hal_mla(p: MlaProblem, pack: str | None):
    """``hal.mla_decode`` with automatic dispatch (``pack`` None) or one pack forced."""
    kw = _hal_kwargs(p)
    decision = hal.explain(*_args(p), op="mla_decode", pack=pack, **kw)
    if decision.pack is None:
        reasons = [r for v in decision.verdicts if v.kind in ("rejected", "unavailable") for r in v.reasons]
        raise Skip("cannot serve this call: " + ("; ".join(dict.fromkeys(reasons)) or "no pack fits"))
    note = "" if pack is not None else f"dispatched to {decision.pack.NAME}" + \
        (" (fallback)" if decision.fallback else "")
    out = _out(p)
    args = _args(p)

    def run():
        hal.mla_decode(*args, out=out, pack=pack, **kw)

    return run, out, note


def call_record(p: MlaProblem, out: torch.Tensor):
    """The validated ``mla_decode`` call record of ``p`` (built once, outside what is timed)."""
    from hal import ops
    q_nope, q_pe, ckv, kpe, bt, sl = _args(p)
    return ops.prepare("mla_decode", q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, block_tables=bt,
                       seq_lens=sl, out=out, **_hal_kwargs(p))


def emu_torch(p: MlaProblem):
    from hal.kernelpacks.emu import torch_mla
    out = _out(p)
    c = call_record(p, out)

    def run():
        torch_mla.mla_decode(c.out, c.q_nope, c.q_pe, c.ckv_cache, c.kpe_cache, c.block_tables, c.seq_lens,
                             c.scale, c.ckv_scale, c.kpe_scale, c.max_seq_len, c.query_start_loc)

    return run, out, "torch_mla"


EMU_TRITON_MLA = ("hal.kernelpacks.emu.triton_mla", "mla_decode")


def emu_triton(p: MlaProblem):
    """The emu pack's Triton MLA path on the call record; the caller has checked for a usable GPU."""
    name, fn = EMU_TRITON_MLA
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise Skip(f"the emu pack has no Triton MLA path in this tree (looked for {name.rsplit('.', 1)[1]}.{fn})")
    impl = getattr(importlib.import_module(name), fn, None)
    if impl is None:
        raise Skip(f"{name} has no {fn}()")
    out = _out(p)
    c = call_record(p, out)
    return (lambda: impl(c)), out, f"{name.rsplit('.', 1)[1]}.{fn}"


# ------------------------------------------------------------------------------------------ torch

@contextlib.contextmanager
def _tf32(device: torch.device):
    """float32 matrix products on TF32 tensor cores inside (a GPU; the CPU ignores the setting)."""
    if device.type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def torch_mla(p: MlaProblem):
    s = p.shape
    n, q_len, h, r, pr, bs = s.batch, s.q_len, s.num_heads, s.latent, s.rope, s.block_size
    nblk = (p.max_seq_len + bs - 1) // bs
    tokens = nblk * bs
    ragged = any(L != p.max_seq_len for L in p.lens)
    dev, qdt = p.device, p.query.dtype
    qn, qp = p.q_nope, p.q_pe
    ckv, kpe, bt, sl = p.ckv_cache, p.kpe_cache, p.block_tables, p.seq_lens
    cs = 1.0 if p.ckv_scale is None else p.ckv_scale
    ps = 1.0 if p.kpe_scale is None else p.kpe_scale
    scale = p.scale

    def run() -> torch.Tensor:
        blocks = bt[:, :nblk].to(torch.long)
        c = ckv[blocks].reshape(n, tokens, r)                          # [n, T, R], the cache's encoding
        k = kpe[blocks].reshape(n, tokens, pr)
        q1 = qn.reshape(n, q_len * h, r).to(torch.float32)             # rows of a sequence, then heads
        q2 = qp.reshape(n, q_len * h, pr).to(torch.float32)
        with _tf32(dev):
            logits = torch.bmm(q1, c.to(torch.float32).transpose(1, 2)) * (cs * scale)
            logits += torch.bmm(q2, k.to(torch.float32).transpose(1, 2)) * (ps * scale)
        if ragged or q_len > 1:
            # row t of a sequence of length L (q_len rows) sees keys j <= L - q_len + t
            last = sl.to(torch.long)[:, None] - q_len + torch.arange(q_len, device=dev)[None, :]   # [n, q]
            keep = torch.arange(tokens, device=dev)[None, None, :] <= last[:, :, None]             # [n, q, T]
            logits = logits.view(n, q_len, h, tokens).masked_fill(~keep[:, :, None, :], float("-inf"))
            logits = logits.view(n, q_len * h, tokens)
        else:
            logits[:, :, p.max_seq_len:] = float("-inf")               # the last page's tail
        w = torch.softmax(logits, dim=-1) * cs                         # the latent's scale, once, in float32
        o = torch.bmm(w.to(qdt), c.to(qdt))                            # [n, q*h, R]
        return o.view(n * q_len, h, r)

    note = "padded gather, float32 scores (TF32 on a GPU), bf16 probabilities x latent"
    if p.device.type != "cuda":
        note = "padded gather, float32 scores, bf16 probabilities x latent"
    return run, None, note


# --------------------------------------------------------------------------------------- FlashMLA

def import_flash_mla():
    try:
        mod = importlib.import_module("flash_mla")
    except Exception as exc:  # noqa: BLE001 - ImportError, or an OSError from torch.ops.load_library
        raise Skip(f"import flash_mla failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); "
                   f"{FLASHMLA_HINT}") from None
    has_legacy = getattr(mod, "has_legacy", None)
    if has_legacy is not None and not has_legacy():
        why = getattr(importlib.import_module("flash_mla._loader"), "_LEGACY_UNAVAILABLE", None)
        raise Skip(f"flash_mla {getattr(mod, '__version__', '?')} has no legacy (sm_90) kernels: {why}")
    return mod


def _flashmla_common(p: MlaProblem, fp8_mode: bool):
    if p.device.type != "cuda":
        raise Skip("FlashMLA runs on NVIDIA sm_90 GPUs only")
    major, minor = torch.cuda.get_device_capability(p.device)
    if (major, minor) != (9, 0):
        raise Skip(f"FlashMLA's dense kernels (sgl-flash-mla legacy ops) are sm_90 only; this GPU is sm_{major}{minor}")
    s = p.shape
    why = []
    if s.block_size != 64:
        why.append(f"page size {s.block_size} (FlashMLA takes page 64 only)")
    if (s.latent, s.rope) != (512, 64):
        why.append(f"R {s.latent} + P {s.rope} (FlashMLA: 512 + 64)")
    if fp8_mode:
        if p.kv_dtype != torch.float8_e4m3fn:
            why.append(f"a {p.kv_dtype} latent (the FP8 mode runs on the e4m3fn problems)")
    elif p.kv_dtype != p.query.dtype or p.rope_dtype != p.query.dtype:
        why.append(f"a {p.kv_dtype} latent (FlashMLA's dense kernel reads a cache of the query's dtype, "
                   f"{p.query.dtype}; flashmla-fp8 runs the e4m3fn problems)")
    if why:
        raise Skip("; ".join(why))
    return import_flash_mla()


def flashmla_bf16(p: MlaProblem):
    fm = _flashmla_common(p, False)
    s = p.shape
    q = p.query.view(s.batch, s.q_len, s.num_heads, s.latent + s.rope)
    k_cache = p.kv_cache.view(p.num_blocks, s.block_size, 1, s.latent + s.rope)   # the problem's own bytes
    meta, _ = fm.get_mla_metadata()
    bt, sl, scale, causal = p.block_tables, p.seq_lens, p.scale, s.q_len > 1
    shape = (p.total_q, s.num_heads, s.latent)

    def run() -> torch.Tensor:
        o, _ = fm.flash_mla_with_kvcache(q, k_cache, bt, sl, s.latent, meta, softmax_scale=scale, causal=causal,
                                         use_legacy=True)
        return o.view(shape)

    return run, None, (f"flash_mla {getattr(fm, '__version__', '?')} dense bf16 (legacy sm_90), the problem's own "
                       f"[blocks, 64, 1, 576] cache; schedule filled by the checked call")


def flashmla_fp8_inputs(p: MlaProblem) -> dict:
    """FlashMLA FP8's inputs, made once per problem before timing: ``k8`` e4m3fn [blocks, page, 1, R+P]
    (the latent's bytes as they are, the rotary part encoded to e4m3fn with the latent's scale), ``q8``
    e4m3fn [b, T, H, R+P] with one per-tensor scale, and both descales ([1] float32)."""
    if "flashmla-fp8" not in p.extra:
        s = p.shape
        e4m3 = torch.float8_e4m3fn
        k8 = torch.empty((p.num_blocks, s.block_size, 1, s.latent + s.rope), dtype=torch.uint8, device=p.device)
        k8[:, :, 0, :s.latent] = p.ckv_cache.view(torch.uint8)
        rope = p.kpe_cache.to(torch.float32) * (1.0 if p.kpe_scale is None else p.kpe_scale)
        k8[:, :, 0, s.latent:] = fp8.encode_bytes(rope / p.ckv_scale, e4m3)  # saturating; NaN stays NaN
        qf = p.query.to(torch.float32)
        q_scale = max(float(qf.abs().max()) / fp8.encoding_of(e4m3).max_finite, 1e-12)
        q8 = fp8.encode_bytes(qf / q_scale, e4m3).view(e4m3).view(s.batch, s.q_len, s.num_heads, s.latent + s.rope)
        p.extra["flashmla-fp8"] = {
            "k8": k8.view(e4m3), "q8": q8, "q_scale": q_scale,
            "descale_q": torch.tensor([q_scale], dtype=torch.float32, device=p.device),
            "descale_k": torch.tensor([p.ckv_scale], dtype=torch.float32, device=p.device),
        }
    return p.extra["flashmla-fp8"]


def flashmla_fp8(p: MlaProblem):
    fm = _flashmla_common(p, True)
    s = p.shape
    x = flashmla_fp8_inputs(p)
    tile, splits = fm.get_mla_decoding_metadata(p.seq_lens, s.q_len * s.num_heads, 1, is_fp8_kvcache=True,
                                                use_legacy=True)
    meta, _ = fm.get_mla_metadata()
    meta.tile_scheduler_metadata, meta.num_splits = tile, splits
    q8, k8, dq, dk = x["q8"], x["k8"], x["descale_q"], x["descale_k"]
    bt, sl, scale, causal = p.block_tables, p.seq_lens, p.scale, s.q_len > 1
    shape = (p.total_q, s.num_heads, s.latent)

    def run() -> torch.Tensor:
        o, _ = fm.flash_mla_with_kvcache(q8, k8, bt, sl, s.latent, meta, softmax_scale=scale, causal=causal,
                                         is_fp8_kvcache=True, use_legacy=True, descale_q=dq, descale_k=dk)
        return o.view(shape)

    return run, None, (f"flash_mla {getattr(fm, '__version__', '?')} dense FP8: Q quantized per tensor and the "
                       f"rotary part encoded to e4m3fn with the latent's scale before timing, P rounded to FP8 "
                       f"in the kernel")


# -------------------------------------------------------------------------------------- FlashInfer

def flashinfer_layout(p: MlaProblem) -> dict:
    """FlashInfer's CSR description of the problem (built once per problem): ``qo_indptr``,
    ``kv_indptr``/``kv_indices`` (each sequence's used pages from the block table), ``kv_len_arr``, and
    the rotary cache it reads: the problem's own view, or for an FP8 latent an e4m3fn copy with a
    per-tensor ``kpe_scale`` (FlashInfer's FP8 path reads both parts in one dtype)."""
    if "flashinfer-mla" not in p.extra:
        n = p.shape.batch
        pages = [p.pages(i) for i in range(n)]
        indptr = torch.zeros(n + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(pages, dtype=torch.int32).cumsum(0)
        bt = p.block_tables.cpu()
        indices = torch.cat([bt[i, :pages[i]] for i in range(n)]) if n else torch.zeros(0, dtype=torch.int32)
        lay = {"qo_indptr": p.qo_indptr(), "kv_indptr": indptr.to(p.device), "kv_indices": indices.to(p.device),
               "kv_len_arr": p.seq_lens, "kpe": p.kpe_cache, "kpe_scale": p.kpe_scale, "note": ""}
        if p.is_fp8:
            rope = p.kpe_cache.to(torch.float32) * (1.0 if p.kpe_scale is None else p.kpe_scale)
            used = indices.to(p.device, torch.long)
            absmax = float(rope[used].abs().amax()) if used.numel() else 1.0   # the pages sequences use (no NaN)
            kpe_scale = max(absmax, 1e-12) / fp8.encoding_of(p.kv_dtype).max_finite
            lay["kpe"] = fp8.encode_bytes(rope / kpe_scale, p.kv_dtype).view(p.kv_dtype)
            lay["kpe_scale"] = kpe_scale
            lay["note"] = "rotary part copied to e4m3fn (per-tensor kpe_scale) before timing"
        p.extra["flashinfer-mla"] = lay
    return p.extra["flashinfer-mla"]


def flashinfer_mla(p: MlaProblem, allow_jit: bool = False):
    if p.device.type != "cuda":
        raise Skip("FlashInfer runs on NVIDIA GPUs only")
    major, minor = torch.cuda.get_device_capability(p.device)
    if major != 9:
        raise Skip(f"FlashInfer's fa3 MLA backend is sm_90 only; this GPU is sm_{major}{minor}")
    s = p.shape
    if not allow_jit:
        why = []
        if p.query.dtype not in FI_MLA_PREBUILT["query"]:
            why.append(f"query {p.query.dtype}")
        if p.kv_dtype not in FI_MLA_PREBUILT["kv"]:
            why.append(f"latent {p.kv_dtype}")
        if s.latent not in FI_MLA_PREBUILT["latent"] or s.rope not in FI_MLA_PREBUILT["rope"]:
            why.append(f"R {s.latent} / P {s.rope}")
        if why:
            raise Skip(f"no prebuilt FlashInfer MLA module for {', '.join(why)} (prebuilt by tools/flashinfer_mla: "
                       f"fa3, bf16 q/o, bf16/e4m3fn KV, 512/64; --flashinfer-jit lets FlashInfer compile one)")
    if p.kv_dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise Skip(f"FlashInfer's MLA has no {p.kv_dtype} latent")
    fi = import_flashinfer(allow_jit)
    mla_mod = importlib.import_module("flashinfer.mla")
    lay = flashinfer_layout(p)
    workspace = p.extra.setdefault("flashinfer-mla-workspace",
                                   torch.empty(FI_WORKSPACE, dtype=torch.uint8, device=p.device))
    wrapper = mla_mod.BatchMLAPagedAttentionWrapper(workspace, backend="fa3")
    plan = {"num_heads": s.num_heads, "head_dim_ckv": s.latent, "head_dim_kpe": s.rope, "page_size": s.block_size,
            "causal": s.q_len > 1, "sm_scale": p.scale, "q_data_type": p.query.dtype, "kv_data_type": p.kv_dtype}
    meta_cls = getattr(mla_mod, "MLAPlanMetadata", None)
    if meta_cls is not None:   # 0.7.x: canonical metadata, separate (split) query and cache tensors
        wrapper.plan(metadata=meta_cls.csr(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["kv_len_arr"]),
                     query_layout="split", kv_cache_layout="split", **plan)
    else:                      # older: the flat form
        wrapper.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["kv_len_arr"], **plan)
    out = _out(p)
    scales = {"ckv_scale": p.ckv_scale, "kpe_scale": lay["kpe_scale"]} if p.is_fp8 else {}
    qn, qp, ckv, kpe = p.q_nope, p.q_pe, p.ckv_cache, lay["kpe"]
    if meta_cls is not None:
        def run() -> torch.Tensor:
            return wrapper.run(query=(qn, qp), kv_cache=(ckv, kpe), out=out, **scales)
    else:
        def run() -> torch.Tensor:
            return wrapper.run(qn, qp, ckv, kpe, out=out, **scales)
    note = f"flashinfer {getattr(fi, '__version__', '?')}, backend fa3" + (f"; {lay['note']}" if lay["note"] else "")
    return run, out, note, (FLASHINFER_FP8_TOLERANCE if p.is_fp8 else None)
