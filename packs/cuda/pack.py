"""The ``cuda`` pack: native CUDA paged attention (decode, prefill, mixed batches), MLA decode and cache
writes for NVIDIA sm89+ (hardware FP8 conversion), tensor cores for QK^T and PV, split-K with a
log-sum-exp merge for decode rows.

Declared as data below; the dispatcher, the tests' grids and hal-probe read this declaration.
"""

from __future__ import annotations

import functools
import importlib
import json
import pathlib

import torch

from hal import dtypes
from hal.pack import Availability, CallKey, OpSupport, Pack
from hal.targets import Target

from . import archs

HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)  # csrc/launch.h HAL_CUDA_HEAD_SIZES
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)        # powers of two: the kernels shift, never divide
MIN_SM = 89

_FNUZ = ("{} is AMD's FP8 encoding (MI300); NVIDIA's hardware converts the OCP encodings only, so "
         "these bytes go to the emu pack (same bytes, exact software decode)")
_NOTES = {torch.float8_e4m3fnuz: _FNUZ.format("float8_e4m3fnuz"),
          torch.float8_e5m2fnuz: _FNUZ.format("float8_e5m2fnuz"),
          torch.float32: "float32 caches are served by the emu pack only"}

PAGED_ATTENTION = OpSupport(
    query_dtypes=frozenset({torch.float16, torch.bfloat16}),
    cache_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}),
    head_sizes=HEAD_SIZES,
    block_sizes=BLOCK_SIZES,
    devices=frozenset({"cuda"}),
    # strided_cache: K/V rows read through their head and token strides (an NHD cache's HND view);
    # varlen: several query tokens a sequence (prefill, chunked prefill, mixed batches: csrc/prefill.cuh)
    features=frozenset({"alibi", "soft_cap", "sliding_window", "per_head_scales", "strided_cache", "varlen"}),
    max_gqa_ratio=None,
    cache_dtype_notes=_NOTES,
)
CACHE_KV = OpSupport(
    query_dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    cache_dtypes=PAGED_ATTENTION.cache_dtypes,
    head_sizes=HEAD_SIZES,
    block_sizes=BLOCK_SIZES,
    devices=frozenset({"cuda"}),
    features=frozenset({"per_head_scales", "strided_cache"}),
    cache_dtype_notes=_NOTES,
)

# MLA decode (DeepSeek-V2/V3 shapes): latent R = 512 (also the value), rotary P = 64 in 16 bits
# (the query's dtype); any head count and query tokens a sequence (rows = heads x tokens, tiled).
MLA_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # pages looked up per token row: any power of two
MLA_DECODE = OpSupport(
    query_dtypes=frozenset({torch.float16, torch.bfloat16}),
    cache_dtypes=PAGED_ATTENTION.cache_dtypes,
    head_sizes=(512,),
    block_sizes=MLA_BLOCK_SIZES,
    devices=frozenset({"cuda"}),
    features=frozenset({"varlen", "strided_cache"}),  # no fp8_rope: the rotary part stays 16-bit
    rope_dims=(64,),
    cache_dtype_notes=_NOTES,
)
CACHE_MLA = OpSupport(
    query_dtypes=CACHE_KV.query_dtypes,
    cache_dtypes=PAGED_ATTENTION.cache_dtypes,
    head_sizes=tuple(range(16, 1025, 16)),
    block_sizes=tuple(range(1, 257)),
    devices=frozenset({"cuda"}),
    features=frozenset({"strided_cache", "fp8_rope"}),
    cache_dtype_notes=_NOTES,
)


def _module():
    return importlib.import_module("._C", __package__)


@functools.cache
def build_info() -> dict:
    path = pathlib.Path(__file__).with_name("build_info.json")
    return json.loads(path.read_text()) if path.exists() else {}


class CudaPack(Pack):
    NAME = "cuda"
    DESCRIPTION = "native CUDA for NVIDIA sm89+: mma.sync tensor cores, hardware FP8 conversion, split-K"
    VENDORS = frozenset({"cuda"})
    SUPPORTS = {"paged_attention": PAGED_ATTENTION, "cache_kv": CACHE_KV, "mla_decode": MLA_DECODE,
                "cache_mla": CACHE_MLA}
    IMPLEMENTATIONS = {"paged_attention": "launch:paged_attention", "cache_kv": "launch:cache_kv",
                       "mla_decode": "launch:mla_decode", "cache_mla": "launch:cache_mla"}

    def native_for(self, target: Target) -> str | None:
        why = super().native_for(target)
        if why is None and (target.sm or 0) < MIN_SM:
            why = (f"the cuda pack needs sm_{MIN_SM}+ (hardware FP8 conversion); this is {target.arch}, "
                   f"served by the emu pack")
        return why

    def _probe(self) -> Availability:
        reasons = []
        info = dict(build_info())
        try:
            _module()
        except ImportError as exc:
            if info.get("built") is False:  # build_info.json says why the build compiled nothing
                reasons.append(f"the compiled module was not built when hal was installed: "
                               f"{info.pop('archs_reason', 'no reason recorded')}")
            else:
                reasons.append(f"the compiled module is missing ({exc}); it is built by `pip install .` where nvcc "
                               f"is found")
        if not getattr(torch.version, "cuda", None):
            reasons.append(f"torch {torch.__version__} is not a CUDA build")
        elif not torch.cuda.is_available():
            reasons.append("no NVIDIA GPU is visible to torch")
        else:
            major, minor = torch.cuda.get_device_capability()
            if major * 10 + minor < MIN_SM:
                reasons.append(f"the GPU is sm_{major}{minor}; the cuda pack needs sm_{MIN_SM}+")
            elif info.get("archs") and not archs.runs_on(str(info["archs"]).split(","), major * 10 + minor):
                reasons.append(f"the compiled module has no code for this GPU (sm_{major}{minor}): it was built for "
                               f"{info['archs']} ({info.get('archs_reason', 'no reason recorded')}); reinstall "
                               f"on this machine, or with HAL_CUDA_ARCHS=all")
            if not reasons:
                from .tuning import summary
                info["tuning"] = summary(f"sm_{major}{minor}")
        return Availability(not reasons, tuple(reasons), info)

    def reasons(self, key: CallKey, target: Target) -> list[str]:
        out = super().reasons(key, target)
        if key.op in ("paged_attention", "mla_decode") and key.cache_dtype in (torch.float16, torch.bfloat16) \
                and key.query_dtype != key.cache_dtype:
            out.append(f"a {dtypes.name(key.cache_dtype)} cache needs a query of the same dtype "
                       f"(got {dtypes.name(key.query_dtype)})")
        if key.op == "mla_decode" and key.rope_dtype in (torch.float16, torch.bfloat16, torch.float32) \
                and key.rope_dtype != key.query_dtype:
            out.append(f"the rotary cache (kpe_cache) must have the query's dtype {dtypes.name(key.query_dtype)} "
                       f"(got {dtypes.name(key.rope_dtype)})")
        return out


PACK = CudaPack()
