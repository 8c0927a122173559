"""The ``rocm`` pack: native HIP paged attention (decode, prefill, mixed batches) and MLA decode (with their
cache writes) for AMD Instinct gfx90a (MI200) and gfx942 (MI300), on MFMA 16x16x16, loaded at run time
through the HIP runtime a ROCm build of torch ships.

What it serves depends on the arch, as data (:func:`supports_for`): gfx942 converts e4m3fnuz and
e5m2fnuz in hardware and is declared for those; an OCP (e4m3fn / e5m2) cache there is refused with how
to convert it, never reinterpreted. gfx90a has no FP8 instructions and decodes all four encodings
exactly in software. :meth:`RocmPack.supports` picks the declaration for a target
(:func:`declared_arch`); dispatch and hal-probe both read it. Proof without AMD hardware: docs/rocm.md.
"""

from __future__ import annotations

import functools
import json
import pathlib

import torch

from hal import dtypes
from hal.pack import Availability, CallKey, OpSupport, Pack
from hal.targets import Target

from . import kernels, tuning

HERE = pathlib.Path(__file__).resolve().parent
CODE_OBJECTS = HERE / "codeobjects"
NATIVE_ARCHS = ("gfx90a", "gfx942")
DEFAULT_ARCH = "gfx942"                                      # ``SUPPORTS``, and targets with no code here
HALF = frozenset({torch.float16, torch.bfloat16})
BLOCK_SIZES = tuple(2 ** i for i in range(9))               # 1 .. 256: a token-level block lookup
CACHE_KV_HEAD_SIZES = tuple(range(4, 513, 4))                # cache_kv writes groups of 4 elements
MLA_LATENT = (512,)                                          # R: the MLA kernels are built for DeepSeek's shape
MLA_ROPE = (64,)                                             # P
CACHE_MLA_WIDTHS = tuple(range(4, 1025, 4))                  # cache_mla writes rows in groups of 4 elements
CACHE_MLA_BLOCK_SIZES = tuple(range(1, 257))                 # the writer divides slots by any block size
OCCUPANCY_DESIGN = ("hal_rocm.hsaco: every kernel keeps >= 4 waves per SIMD (4 workgroups of 4 wave64s per CU): "
                    "<= 128 VGPRs+AGPRs per lane, <= 16 KiB LDS per workgroup, no scratch; hal_rocm_mla.hsaco: "
                    "the MLA decode kernels keep >= 2 (an O tile in registers and a 16-token K/V tile in LDS: <= "
                    "256 VGPRs+AGPRs, <= 32 KiB LDS), its merge and cache_mla writer >= 4; hal_rocm_prefill.hsaco: "
                    "the multi-token kernels keep >= 2 (a 64-row O tile in registers and an 8 KiB K + V step in "
                    "LDS: <= 256 VGPRs+AGPRs, <= 32 KiB LDS); no scratch")

_FN_ON_GFX942 = (
    "cache dtype float8_e4m3fn is OCP FP8, and gfx942 (MI300) converts e4m3fnuz in hardware: the rocm pack "
    "never reads fn bytes as fnuz (the same byte is half the value there, and 0x80 is fnuz's NaN). Convert the "
    "cache once with hal.fp8.fn_to_fnuz(cache, scale) (bytes kept, 0x80 -> 0x00, scale doubled), allocate "
    "new caches as hal.fp8.native_e4m3() = torch.float8_e4m3fnuz, or run this call on the emu pack")
_E5M2_ON_GFX942 = (
    "cache dtype float8_e5m2 is OCP FP8, and gfx942 (MI300) converts e5m2fnuz in hardware: the rocm pack "
    "never reads OCP bytes as fnuz. Allocate the cache as torch.float8_e5m2fnuz (hal.fp8.native_e5m2()), "
    "or run this call on the emu pack")
_OCP_ON_GFX942 = {torch.float8_e4m3fn: _FN_ON_GFX942, torch.float8_e5m2: _E5M2_ON_GFX942}


def fp8_dtypes(arch: str) -> frozenset[torch.dtype]:
    return frozenset(dtypes.parse(e) for e in kernels.fp8_encodings(arch))


def declared_arch(target: Target | None) -> str:
    """The arch whose declaration applies to ``target``: its own where the pack has code for it
    (gfx90a, gfx942, gfx950), else gfx942's (what ``SUPPORTS`` holds)."""
    arch = target.arch if target is not None else None
    return arch if arch in NATIVE_ARCHS + kernels.OPTIONAL_ARCHS else DEFAULT_ARCH


@functools.cache
def supports_for(arch: str) -> dict[str, OpSupport]:
    """The declaration for one arch: the only place the per-arch rules live (the FP8 encodings come
    from :func:`kernels.fp8_encodings`, which the build uses too)."""
    caches = HALF | fp8_dtypes(arch)
    notes = {d: why for d, why in _OCP_ON_GFX942.items() if d not in caches} if arch == "gfx942" else {}
    common = dict(cache_dtypes=caches, block_sizes=BLOCK_SIZES, devices=frozenset({"cuda"}), cache_dtype_notes=notes)
    return {
        # 16-byte vector loads: a cache must start, and keep its blocks, heads and tokens, on 16-byte
        # boundaries. varlen: multi-token sequences through hal_rocm_prefill.hsaco, one-token ones through
        # the decode kernels, in one call; strided_cache: every kernel reads cache rows through strides
        "paged_attention": OpSupport(query_dtypes=HALF, head_sizes=kernels.HEAD_SIZES,
                                     features=frozenset({"alibi", "soft_cap", "sliding_window", "per_head_scales",
                                                         "varlen", "strided_cache"}),
                                     max_gqa_ratio=None, **common),
        "cache_kv": OpSupport(query_dtypes=HALF | {torch.float32}, head_sizes=CACHE_KV_HEAD_SIZES,
                              features=frozenset({"per_head_scales", "strided_cache"}), **common),
        # R 512, P 64; any head count and query tokens a sequence (rows = tokens x heads, 16 or 32 a
        # workgroup); the rotary part in the query's dtype (reasons() says so), latent rows 16-byte aligned
        "mla_decode": OpSupport(query_dtypes=HALF, head_sizes=MLA_LATENT, rope_dims=MLA_ROPE,
                                features=frozenset({"varlen", "strided_cache"}), **common),
        "cache_mla": OpSupport(query_dtypes=HALF | {torch.float32}, cache_dtypes=caches, head_sizes=CACHE_MLA_WIDTHS,
                               block_sizes=CACHE_MLA_BLOCK_SIZES, devices=frozenset({"cuda"}),
                               features=frozenset({"strided_cache", "fp8_rope"}), rope_dims=CACHE_MLA_WIDTHS,
                               cache_dtype_notes=notes),
    }


@functools.cache
def build_info(folder: pathlib.Path = CODE_OBJECTS) -> dict:
    """``build_info.json`` of the installed code objects, or {} when the pack was not built."""
    path = folder / "build_info.json"
    return json.loads(path.read_text()) if path.exists() else {}


def built_archs(folder: pathlib.Path = CODE_OBJECTS) -> dict[str, pathlib.Path]:
    info = build_info(folder)
    return {arch: folder / a["code_object"] for arch, a in info.get("archs", {}).items()
            if (folder / a["code_object"]).exists()}


def resource_summary(kernel_resources: dict) -> dict[str, str]:
    """Per kernel family: the range of each figure over its kernels."""
    fams: dict[str, list[dict]] = {}
    for name, r in kernel_resources.items():
        fams.setdefault(kernels.family(name), []).append(r)

    def span(rows, key):
        lo, hi = min(r[key] for r in rows), max(r[key] for r in rows)
        return f"{lo}" if lo == hi else f"{lo}-{hi}"
    return {fam: (f"{len(rows)} kernels: VGPRs {span(rows, 'vgpr')}, AGPRs {span(rows, 'agpr')}, SGPRs "
                  f"{span(rows, 'sgpr')}, LDS {span(rows, 'lds')} B, scratch {span(rows, 'scratch')} B, "
                  f"occupancy {span(rows, 'occupancy')} waves/SIMD")
            for fam, rows in sorted(fams.items())}


class RocmPack(Pack):
    NAME = "rocm"
    DESCRIPTION = "native HIP, MFMA 16x16x16 wave64: AMD Instinct gfx90a (software FP8) and gfx942 (e4m3fnuz/e5m2fnuz)"
    VENDORS = frozenset({"rocm"})
    SUPPORTS = supports_for(DEFAULT_ARCH)  # for readers with no target; dispatch and the probe use supports()

    def __init__(self, code_objects: pathlib.Path = CODE_OBJECTS):
        self.code_objects = code_objects

    def native_for(self, target: Target) -> str | None:
        base = super().native_for(target)
        if base is not None:
            return base
        arch = target.arch
        if arch in NATIVE_ARCHS:
            return None
        if arch in kernels.OPTIONAL_ARCHS:
            if arch in built_archs(self.code_objects):
                return None
            why = build_info(self.code_objects).get("not_built", {}).get(arch)
            return (f"{arch} (MI350) code objects are not in this build: " +
                    (why or "it was built by a compiler without that target (clang-19 has none; LLVM 20+ or "
                            "ROCm 6.3+ clang has)") + "; its OCP FP8 runs on the emu pack meanwhile")
        if arch in ("gfx940", "gfx941"):
            return f"the rocm pack is built for gfx942; {arch} (MI300 pre-production) needs its own code objects"
        return (f"the rocm pack serves AMD Instinct gfx90a (MI200) and gfx942 (MI300) (MFMA, wave64); "
                f"{arch} is not one of them")

    def supports(self, target: Target | None = None) -> dict[str, OpSupport]:
        """The declaration for ``target``: what :meth:`reasons` (dispatch) checks and hal-probe shows."""
        return supports_for(declared_arch(target))

    def reasons(self, key: CallKey, target: Target) -> list[str]:
        support = self.supports(target).get(key.op)
        if support is None:
            return [f"op {key.op} is not implemented by the rocm pack"]
        out = support.reasons(key)
        if key.op in ("paged_attention", "mla_decode") and key.cache_dtype in HALF \
                and key.cache_dtype != key.query_dtype:
            cache, query = (dtypes.name(d) for d in (key.cache_dtype, key.query_dtype))
            out.append(f"a {cache} cache needs a query of the same dtype (the MFMA multiplies cache elements as "
                       f"stored); got a {query} query")
        rope = key.rope_dtype
        if key.op == "mla_decode" and rope is not None and rope.itemsize > 1 and rope != key.query_dtype:
            out.append(f"the rotary cache (kpe_cache) must have the query's dtype {dtypes.name(key.query_dtype)} "
                       f"(its elements are MFMA operands as stored); got {dtypes.name(rope)}")
        if key.op == "cache_mla" and rope is not None and rope not in support.cache_dtypes:
            out.append("kpe_cache: " + (support.cache_dtype_notes.get(rope) or
                                        f"cache dtype {dtypes.name(rope)} is not supported (supported: "
                                        f"{', '.join(sorted(dtypes.name(d) for d in support.cache_dtypes))})"))
        return out

    def _probe(self) -> Availability:
        info = build_info(self.code_objects)
        built = built_archs(self.code_objects)
        reasons = []
        if not built:
            reasons.append(
                "no code objects in this build: " + (
                    f"build them with `python {HERE / 'build.py'} --out {self.code_objects}` (needs clang-19 + "
                    f"lld-19, or ROCm)" if (HERE / "csrc").is_dir() else
                    "CMake found no clang with the AMDGPU target when hal was installed (install clang-19 lld-19, "
                    "or ROCm, and reinstall; docs/rocm.md)"))
        if not getattr(torch.version, "hip", None):
            reasons.append(f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None): the rocm pack "
                           f"launches its code objects through the HIP runtime that ROCm builds of torch ship")
        elif not torch.cuda.is_available():
            reasons.append("torch is a ROCm build but sees no AMD GPU")
        else:
            from .launcher import device_arch, find_library
            arch = device_arch(torch.device("cuda", torch.cuda.current_device()))
            if built and arch not in built:
                reasons.append(f"no code object for {arch} (this build has {', '.join(sorted(built))})")
            if find_library()[0] is None:
                reasons.append(f"HIP runtime not found: {find_library()[1]}")
        return Availability(not reasons, tuple(reasons), self._build_info(info, built))

    def _build_info(self, info: dict, built: dict) -> dict:
        out = {"built_archs": sorted(built), "not_built": info.get("not_built", {}),
               "compiler": info.get("compiler", "not built"), "occupancy_design": OCCUPANCY_DESIGN,
               "partition_size": {a: tuning.partition_size(a) for a in sorted(built)}}
        for arch in sorted(built):
            res = info["archs"][arch]["kernels"]
            out[f"resources_{arch}"] = resource_summary(res)
            out[f"kernels_{arch}"] = res
        return out

    @functools.cached_property
    def _backend(self):
        from .launcher import HipBackend, HipRuntime, find_library
        path, how = find_library()
        if path is None:
            raise RuntimeError(f"rocm pack: HIP runtime not found: {how}")
        return HipBackend(HipRuntime(path), built_archs(self.code_objects))

    IMPLEMENTATIONS = {"paged_attention": "ops:paged_attention", "cache_kv": "ops:cache_kv",
                       "mla_decode": "ops:mla_decode", "cache_mla": "ops:cache_mla"}

    def impl(self, op: str):
        """The declared implementation, bound to this machine's HIP backend."""
        return functools.partial(super().impl(op), self._backend)


PACK = RocmPack()
