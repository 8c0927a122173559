"""The baselines hal is measured against.

``torch-sdpa``: what a user writes in plain PyTorch, **batched with padding**: gather every
sequence's pages up to the longest sequence (``key_cache[block_tables]``), lay them out as
``[n, kv_heads, tokens, d]``, cast FP8 to the query dtype and multiply by the scale, then one
``scaled_dot_product_attention`` call with ``enable_gqa=True`` and, for ragged batches, a boolean
mask of each sequence's length (uniform batches get no mask, so SDPA may pick its fastest kernel).
All of it runs inside the timed call, as it would in a decode step.

``flashinfer-tc`` / ``flashinfer-cc``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` with and
without tensor cores, on its own copy of the same bytes in its NHD layout (``[pages, page_size,
kv_heads, d]``, K and V separately), pages listed per sequence (indptr / indices / last_page_len from
the same block table). The tensor-core variant asks for the FA2 backend
(the one prebuilt). ``plan()`` runs once, outside the timed call (an engine plans once per step for
every layer); ``run()`` is timed, with ``k_scale``/``v_scale`` passed to it for an FP8 cache. Only the
modules prebuilt by ``tools/flashinfer_decode/prep.sh`` are used (``.whl/fi_decode.tar.xz``: bf16
queries and outputs, bf16 or e4m3fn KV, head_dim 64, 128 or 256; the tensor-core variant's fa2
batch-prefill modules and the CUDA-core variant's batch-decode modules). The page size is a run-time
argument of those modules, so pages of 16 and 64 both run. ``shared/tools/flashinfer``
(``fi_trim.tar.xz``) is the older, head_dim-128-only build: with it, head sizes 64 and 256 (and
``flashinfer-cc`` when it was built with ``MODULES=prefill``) are skip rows naming the missing module
(FlashInfer's ``MissingJITCacheError`` at ``plan()``). FlashInfer's JIT is disabled unless
``--flashinfer-jit`` so that a missing module fails at once instead of compiling for minutes.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from hal.bench.data import Problem


class Skip(Exception):
    """The contender cannot run this problem here (not a failure); the message says why."""


def torch_sdpa(p: Problem):
    n, h, d = p.query.shape
    hkv, bs = p.shape.num_kv_heads, p.shape.block_size
    nblk = (p.max_seq_len + bs - 1) // bs
    tokens = nblk * bs
    # a mask wherever a gathered slot is past a sequence's end (the last block's tail too)
    ragged = any(L != tokens for L in p.lens)
    q, kc, vc, bt, sl = p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens
    ks, vs, scale = p.k_scale, p.v_scale, p.scale

    def run() -> torch.Tensor:
        blocks = bt[:, :nblk].to(torch.long)
        k = kc[blocks].permute(0, 2, 1, 3, 4).reshape(n, hkv, tokens, d).to(q.dtype)
        v = vc[blocks].permute(0, 2, 1, 3, 4).reshape(n, hkv, tokens, d).to(q.dtype)
        if ks is not None:
            k = k * ks
            v = v * vs
        mask = None
        if ragged:
            mask = (torch.arange(tokens, device=q.device)[None, :] < sl[:, None]).reshape(n, 1, 1, tokens)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)

    return run


# What tools/flashinfer_decode/prep.sh builds (shared/tools/flashinfer: head_size 128 only). The page
# size is a run-time argument of those modules; 16 and 64 are the ones the bench's shapes use.
FI_PREBUILT = {"query": (torch.bfloat16,), "kv": (torch.bfloat16, torch.float8_e4m3fn), "head_size": (64, 128, 256),
               "block_size": (16, 64)}
FI_PREP = "tools/flashinfer_decode/prep.sh"
FI_WORKSPACE = 256 << 20


def import_flashinfer(allow_jit: bool):
    if not allow_jit:
        os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    try:
        return importlib.import_module("flashinfer")
    except Exception as exc:  # ImportError, or a broken install raising anything
        raise Skip(f"import flashinfer failed ({type(exc).__name__}: {exc}); see {FI_PREP} "
                   f"(or shared/tools/flashinfer/README.md)") from None


def _fi_layout(p: Problem):
    """FlashInfer's copy of the problem (built once per problem, shared by both variants)."""
    if "flashinfer" not in p.extra:
        dev = p.device
        n = p.shape.batch
        pages = [p.pages(i) for i in range(n)]
        indptr = torch.zeros(n + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(pages, dtype=torch.int32).cumsum(0)
        bt = p.block_tables.cpu()
        indices = torch.cat([bt[i, :pages[i]] for i in range(n)]) if n else torch.zeros(0, dtype=torch.int32)
        last = torch.tensor([L - (pg - 1) * p.shape.block_size if pg else 0 for L, pg in zip(p.lens, pages)],
                            dtype=torch.int32)
        p.extra["flashinfer"] = {
            "k": p.key_cache.permute(0, 2, 1, 3).contiguous(),   # NHD: [pages, page_size, kv_heads, d]
            "v": p.value_cache.permute(0, 2, 1, 3).contiguous(),
            "indptr": indptr.to(dev), "indices": indices.to(dev), "last_page_len": last.to(dev),
            "workspace": torch.empty(FI_WORKSPACE, dtype=torch.uint8, device=dev),
        }
    return p.extra["flashinfer"]


def flashinfer_decode(p: Problem, tensor_cores: bool, allow_jit: bool = False):
    if p.device.type != "cuda":
        raise Skip("FlashInfer runs on NVIDIA GPUs only")
    fi = import_flashinfer(allow_jit)
    if not allow_jit:
        why = []
        if p.query.dtype not in FI_PREBUILT["query"]:
            why.append(f"query {p.query.dtype}")
        if p.kv_dtype not in FI_PREBUILT["kv"]:
            why.append(f"KV {p.kv_dtype}")
        if p.shape.head_size not in FI_PREBUILT["head_size"]:
            why.append(f"head_size {p.shape.head_size}")
        if p.shape.block_size not in FI_PREBUILT["block_size"]:
            why.append(f"page size {p.shape.block_size}")
        if why:
            raise Skip(f"no prebuilt FlashInfer module for {', '.join(why)} (prebuilt by {FI_PREP}: bf16 q, "
                       f"bf16/e4m3fn KV, head_dim 64/128/256, page 16/64; shared/tools/flashinfer: head_dim 128 "
                       f"only; --flashinfer-jit lets FlashInfer compile one)")
    elif p.kv_dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        raise Skip(f"FlashInfer has no {p.kv_dtype} KV cache")
    lay = _fi_layout(p)
    wrapper, note = None, f"flashinfer {getattr(fi, '__version__', '?')}"
    if tensor_cores:  # the prebuilt tensor-core module is FA2's; "auto" could ask for FA3 with an FP8 cache
        try:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(lay["workspace"], "NHD", use_tensor_cores=True,
                                                            backend="fa2")
            note += ", backend fa2"
        except (TypeError, ValueError):  # a FlashInfer without (or refusing) the backend argument
            wrapper = None
    if wrapper is None:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(lay["workspace"], "NHD", use_tensor_cores=tensor_cores)
    try:
        wrapper.plan(lay["indptr"], lay["indices"], lay["last_page_len"], p.shape.num_heads, p.shape.num_kv_heads,
                     p.shape.head_size, p.shape.block_size, pos_encoding_mode="NONE", q_data_type=p.query.dtype,
                     kv_data_type=p.kv_dtype, sm_scale=p.scale)
    except Exception as exc:
        # FlashInfer's "JIT disabled and the module is not in data/aot" (flashinfer.jit.core.MissingJITCacheError),
        # e.g. head_dim 64/256 with the head-128-only shared/tools/flashinfer copy: this install cannot run
        # the problem, which is a skip, not a FlashInfer failure. A module that is there but did not load
        # (FlashInfer logs why and reports it missing too) stays a failure.
        spec = getattr(exc, "spec", None)
        if allow_jit or type(exc).__name__ != "MissingJITCacheError" or getattr(spec, "is_aot", False):
            raise
        raise Skip(f"this FlashInfer has no prebuilt module {getattr(spec, 'name', '?')} (build it with {FI_PREP}; "
                   f"--flashinfer-jit lets FlashInfer compile it)") from None
    out = torch.empty_like(p.query)
    q, kv = p.query, (lay["k"], lay["v"])
    scales = {"k_scale": p.k_scale, "v_scale": p.v_scale} if p.k_scale is not None else {}

    def run() -> torch.Tensor:
        return wrapper.run(q, kv, out=out, **scales)

    return run, out, note
