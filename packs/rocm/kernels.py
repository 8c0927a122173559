"""The contract between the HIP sources and Python: which kernels each arch's code object holds, their
parameters in order, and how the launcher packs them.

Stdlib only (CMake runs ``build.py`` with the build's own Python, which has neither torch nor hal).
The parameter lists mirror the ``HAL_*_PARAMS`` macros in ``csrc/``; the tests compare them with the
kernel-argument layout that each compiled code object's metadata records (offset, size, kind), and the
CPU emulation runs the kernels on buffers packed by :func:`pack` itself.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct

HEAD_SIZES = (64, 128, 256)
QUERY_TYPES = ("f16", "bf16")
INPUT_TYPES = ("f16", "bf16", "f32")              # cache_kv's key/value
FNUZ = ("e4m3fnuz", "e5m2fnuz")
OCP = ("e4m3fn", "e5m2")
THREADS = 256                                     # every kernel: one workgroup of 4 wave64s
CHUNK = 256                                       # tokens per decode step; partition sizes are multiples
CODE_OBJECT = "hal_rocm.hsaco"                    # csrc/kernels.hip: paged decode, reduce, cache_kv
MLA_CODE_OBJECT = "hal_rocm_mla.hsaco"            # csrc/mla_kernels.hip: MLA decode, its merge, cache_mla
PREFILL_CODE_OBJECT = "hal_rocm_prefill.hsaco"    # csrc/prefill_kernels.hip: multi-token paged attention

# Archs whose hardware converts FP8, and the encodings it converts. Only those are built there: an
# OCP cache on gfx942 is refused by the declaration (convert it), never fed to the fnuz instructions.
HW_FP8 = {"gfx942": FNUZ}
DEFAULT_ARCHS = ("gfx90a", "gfx942")
OPTIONAL_ARCHS = ("gfx950",)                      # built only by a compiler that knows it


def fp8_encodings(arch: str) -> tuple[str, ...]:
    """FP8 encodings compiled for ``arch``: the hardware ones on gfx942, all four (software) elsewhere."""
    return HW_FP8.get(arch, FNUZ + OCP)


def decode_name(query: str, cache: str, head_size: int) -> str:
    return f"hal_pa_decode_{query}_{cache}_d{head_size}"


def reduce_name(out: str) -> str:
    return f"hal_pa_reduce_{out}"


def cache_kv_name(inp: str, cache: str) -> str:
    return f"hal_cache_kv_{inp}_{cache}"


def kernel_names(arch: str) -> list[str]:
    """Every kernel the code object for ``arch`` must define (the order of csrc/kernels.hip aside)."""
    caches = [("f16", "f16"), ("bf16", "bf16")] + [(q, e) for e in fp8_encodings(arch) for q in QUERY_TYPES]
    names = [decode_name(q, c, d) for q, c in caches for d in HEAD_SIZES]
    names += [reduce_name(o) for o in QUERY_TYPES]
    names += [cache_kv_name(i, c) for c in ("f16", "bf16", *fp8_encodings(arch)) for i in INPUT_TYPES]
    return sorted(names)


# The MLA code object (csrc/mla_kernels.hip -> hal_rocm_mla.hsaco): its decode kernels are designed for
# 2 waves per SIMD, so they live apart from hal_rocm.hsaco's 4-wave kernels (docs/rocm.md, "MLA decode").
MLA_ROWS = (16, 32)                               # rows (query token x head pairs) per decode workgroup
MLA_STEP = 16                                     # tokens per decode step; MLA partition sizes are multiples
MLA_FAMILIES = ("mla_decode", "mla_reduce", "cache_rows")


def mla_decode_name(query: str, latent: str, rows: int) -> str:
    return f"hal_mla_decode_{query}_{latent}_r{rows}"


def mla_reduce_name(out: str) -> str:
    return f"hal_mla_reduce_{out}"


def cache_rows_name(inp: str, cache: str) -> str:
    return f"hal_cache_rows_{inp}_{cache}"


def mla_kernel_names(arch: str) -> list[str]:
    """Every kernel the MLA code object for ``arch`` must define."""
    latents = [("f16", "f16"), ("bf16", "bf16")] + [(q, e) for e in fp8_encodings(arch) for q in QUERY_TYPES]
    names = [mla_decode_name(q, c, rows) for q, c in latents for rows in MLA_ROWS]
    names += [mla_reduce_name(o) for o in QUERY_TYPES]
    names += [cache_rows_name(i, c) for c in ("f16", "bf16", *fp8_encodings(arch)) for i in INPUT_TYPES]
    return sorted(names)


# The multi-token code object (csrc/prefill_kernels.hip -> hal_rocm_prefill.hsaco): 2 waves per SIMD, as
# the MLA decode kernels (docs/rocm.md, "Prefill"); a mixed batch's decode rows use hal_rocm.hsaco's.
PREFILL_ROWS = 64                                 # rows (query token x GQA head) per workgroup


def prefill_name(query: str, cache: str, head_size: int) -> str:
    return f"hal_pa_prefill_{query}_{cache}_d{head_size}"


def prefill_step(head_size: int) -> int:
    """Tokens a prefill workgroup stages per step (8 KiB of 16-bit K and V each)."""
    return 4096 // head_size


def prefill_kernel_names(arch: str) -> list[str]:
    """Every kernel the multi-token code object for ``arch`` must define."""
    caches = [("f16", "f16"), ("bf16", "bf16")] + [(q, e) for e in fp8_encodings(arch) for q in QUERY_TYPES]
    return sorted(prefill_name(q, c, d) for q, c in caches for d in HEAD_SIZES)


def family(kernel: str) -> str:
    for fam in ("pa_decode", "pa_reduce", "pa_prefill", "cache_kv", *MLA_FAMILIES):
        if kernel.startswith(f"hal_{fam}_"):
            return fam
    raise ValueError(f"{kernel!r} is not a rocm pack kernel")


def code_object(kernel: str) -> str:
    """The file (in an arch's folder) whose code object defines ``kernel``."""
    fam = family(kernel)
    return MLA_CODE_OBJECT if fam in MLA_FAMILIES else PREFILL_CODE_OBJECT if fam == "pa_prefill" else CODE_OBJECT


# (name, kind) in parameter order. ptr: 8-byte global pointer; i64 / i32 / f32: by value.
PARAMS: dict[str, tuple[tuple[str, str], ...]] = {
    "pa_decode": (
        ("out", "ptr"), ("tmp_out", "ptr"), ("exp_sums", "ptr"), ("max_logits", "ptr"), ("query", "ptr"),
        ("key_cache", "ptr"), ("value_cache", "ptr"), ("block_tables", "ptr"), ("seq_lens", "ptr"),
        ("query_start_loc", "ptr"), ("k_scale_ptr", "ptr"), ("v_scale_ptr", "ptr"), ("alibi_slopes", "ptr"),
        ("q_stride_seq", "i64"), ("q_stride_head", "i64"), ("o_stride_seq", "i64"), ("o_stride_head", "i64"),
        ("k_block_stride", "i64"), ("k_head_stride", "i64"), ("k_token_stride", "i64"),
        ("v_block_stride", "i64"), ("v_head_stride", "i64"), ("v_token_stride", "i64"), ("bt_stride", "i64"),
        ("scale", "f32"), ("k_scale_val", "f32"), ("v_scale_val", "f32"), ("soft_cap", "f32"),
        ("num_kv_heads", "i32"), ("gqa_ratio", "i32"), ("num_tiles", "i32"), ("block_size_log2", "i32"),
        ("sliding_window", "i32"), ("partition_size", "i32"), ("max_parts", "i32"),
        ("k_scale_stride", "i32"), ("v_scale_stride", "i32"),
    ),
    "pa_reduce": (
        ("out", "ptr"), ("tmp_out", "ptr"), ("exp_sums", "ptr"), ("max_logits", "ptr"), ("seq_lens", "ptr"),
        ("query_start_loc", "ptr"), ("o_stride_seq", "i64"), ("o_stride_head", "i64"),
        ("num_heads", "i32"), ("head_size", "i32"), ("sliding_window", "i32"), ("partition_size", "i32"),
        ("max_parts", "i32"),
    ),
    "pa_prefill": (
        ("out", "ptr"), ("query", "ptr"), ("key_cache", "ptr"), ("value_cache", "ptr"), ("block_tables", "ptr"),
        ("seq_lens", "ptr"), ("query_start_loc", "ptr"), ("k_scale_ptr", "ptr"), ("v_scale_ptr", "ptr"),
        ("alibi_slopes", "ptr"), ("q_stride_tok", "i64"), ("q_stride_head", "i64"), ("o_stride_tok", "i64"),
        ("o_stride_head", "i64"), ("k_block_stride", "i64"), ("k_head_stride", "i64"), ("k_token_stride", "i64"),
        ("v_block_stride", "i64"), ("v_head_stride", "i64"), ("v_token_stride", "i64"), ("bt_stride", "i64"),
        ("scale", "f32"), ("k_scale_val", "f32"), ("v_scale_val", "f32"), ("soft_cap", "f32"),
        ("gqa_ratio", "i32"), ("block_size_log2", "i32"), ("sliding_window", "i32"), ("causal", "i32"),
        ("k_scale_stride", "i32"), ("v_scale_stride", "i32"),
    ),
    "cache_kv": (
        ("key", "ptr"), ("value", "ptr"), ("key_cache", "ptr"), ("value_cache", "ptr"), ("slot_mapping", "ptr"),
        ("k_scale_ptr", "ptr"), ("v_scale_ptr", "ptr"),
        ("k_stride_tok", "i64"), ("k_stride_head", "i64"), ("v_stride_tok", "i64"), ("v_stride_head", "i64"),
        ("k_block_stride", "i64"), ("k_head_stride", "i64"), ("k_token_stride", "i64"),
        ("v_block_stride", "i64"), ("v_head_stride", "i64"), ("v_token_stride", "i64"), ("num_slots", "i64"),
        ("k_scale_val", "f32"), ("v_scale_val", "f32"),
        ("num_kv_heads", "i32"), ("head_size", "i32"), ("block_size", "i32"),
        ("k_scale_stride", "i32"), ("v_scale_stride", "i32"),
    ),
    "mla_decode": (
        ("out", "ptr"), ("tmp_out", "ptr"), ("part_ml", "ptr"), ("q_nope", "ptr"), ("q_pe", "ptr"),
        ("ckv_cache", "ptr"), ("kpe_cache", "ptr"), ("block_tables", "ptr"), ("seq_lens", "ptr"),
        ("query_start_loc", "ptr"), ("ckv_scale_ptr", "ptr"), ("kpe_scale_ptr", "ptr"),
        ("qn_stride_tok", "i64"), ("qn_stride_head", "i64"), ("qp_stride_tok", "i64"), ("qp_stride_head", "i64"),
        ("o_stride_tok", "i64"), ("o_stride_head", "i64"), ("ckv_block_stride", "i64"), ("ckv_token_stride", "i64"),
        ("kpe_block_stride", "i64"), ("kpe_token_stride", "i64"), ("bt_stride", "i64"),
        ("scale", "f32"), ("ckv_scale_val", "f32"), ("kpe_scale_val", "f32"),
        ("num_heads", "i32"), ("block_size_log2", "i32"), ("partition_size", "i32"), ("num_parts", "i32"),
    ),
    "mla_reduce": (
        ("out", "ptr"), ("tmp_out", "ptr"), ("part_ml", "ptr"), ("ckv_scale_ptr", "ptr"),
        ("o_stride_tok", "i64"), ("o_stride_head", "i64"), ("ckv_scale_val", "f32"),
        ("num_heads", "i32"), ("num_parts", "i32"),
    ),
    "cache_rows": (
        ("src", "ptr"), ("cache", "ptr"), ("slot_mapping", "ptr"), ("scale_ptr", "ptr"),
        ("src_stride", "i64"), ("block_stride", "i64"), ("token_stride", "i64"), ("num_slots", "i64"),
        ("scale_val", "f32"), ("width", "i32"), ("block_size", "i32"),
    ),
}

_KINDS = {"ptr": ("Q", 8, ctypes.c_uint64), "i64": ("q", 8, ctypes.c_int64), "i32": ("i", 4, ctypes.c_int32),
          "f32": ("f", 4, ctypes.c_float)}


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    kind: str
    offset: int
    size: int

    @property
    def value_kind(self) -> str:
        """The AMDGPU metadata's ``.value_kind`` for this argument."""
        return "global_buffer" if self.kind == "ptr" else "by_value"


def layout(fam: str) -> tuple[Arg, ...]:
    """Offsets by the AMDGPU kernarg rule: each argument at the next multiple of its size, in order."""
    out, off = [], 0
    for name, kind in PARAMS[fam]:
        size = _KINDS[kind][1]
        off = (off + size - 1) // size * size
        out.append(Arg(name, kind, off, size))
        off += size
    return tuple(out)


def kernarg_size(fam: str) -> int:
    last = layout(fam)[-1]
    return last.offset + last.size


def _check(fam: str, values: dict) -> None:
    names = [n for n, _ in PARAMS[fam]]
    missing, extra = set(names) - set(values), set(values) - set(names)
    if missing or extra:
        raise ValueError(f"{fam} arguments: missing {sorted(missing)}, unexpected {sorted(extra)}")


def pack(fam: str, values: dict) -> bytes:
    """The explicit kernel arguments as one buffer (what the CPU emulation unpacks)."""
    _check(fam, values)
    buf = bytearray(kernarg_size(fam))
    for a in layout(fam):
        struct.pack_into("<" + _KINDS[a.kind][0], buf, a.offset, values[a.name])
    return bytes(buf)


def kernel_params(fam: str, values: dict):
    """``kernelParams`` for hipModuleLaunchKernel: an array of pointers to each argument's value.

    Returns ``(array, keepalive)``; the array is valid while ``keepalive`` lives. The values are the
    same ctypes scalars :func:`pack` lays out (so both paths agree by construction).
    """
    _check(fam, values)
    boxed = [_KINDS[kind][2](values[name]) for name, kind in PARAMS[fam]]
    array = (ctypes.c_void_p * len(boxed))(*[ctypes.cast(ctypes.pointer(b), ctypes.c_void_p) for b in boxed])
    return array, boxed
