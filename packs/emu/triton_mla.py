"""The emu pack's Triton path for MLA decode (multi-head latent attention, absorbed form), on GPUs;
same semantics and arguments as :mod:`torch_mla` (its docstring states the contract). Kernel:
:mod:`triton_mla_kernels`; splits are combined by :mod:`triton_kernels`' merge kernel.

Grid ``(total_q, cdiv(H, BLOCK_H), num_splits)``: one program per query row, tile of ``BLOCK_H``
heads and KV split. A speculative row (``query_start_loc``) finds its sequence on the device and
reads that sequence's first ``L - q_len + t + 1`` tokens. Split-K over the context when rows x head
tiles would leave most SMs idle (decode batches are small, MLA contexts long). Everything that sizes
the launch is a host int (``max_seq_len``, shapes, the SM count): nothing here reads device memory
from the host, so a call can be captured in a CUDA graph.

Precision (the pack's rule, as :mod:`triton_path`): a 16-bit query whose caches are FP8 or its own
dtype multiplies in that dtype (``tl.dot``, float32 accumulation; FP8 and same-dtype values are
exact there; probabilities rounded to the 16-bit type for PV). Any other combination (a float32
query, a float32 cache or the other 16-bit type, which the query's dtype would round) uses float32
operands with IEEE products. The query and the probabilities are never rounded to FP8; the scales
multiply float32 dot products and the float32 output, never a 16-bit operand.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from hal import fp8

from . import triton_kernels
from . import triton_mla_kernels as K
from .triton_path import _HALF, _decode_constants, _device, _pow2, _raw, _scale_args

# Heads per program: tl.dot's smallest M. A taller tile would read each latent tile for more heads
# (the latent is shared) but its [BLOCK_H, R] float32 accumulator outgrows the registers at R = 512.
BLOCK_H = 16
R_CHUNK = 64  # R per step of the score product (triton_mla_kernels: why it is chunked)
MIN_SPLIT = 256  # tokens a split reads at least: its query reads and partial write stay small beside them
WAVES = 2  # split until rows x head tiles x splits fills the SMs about twice
_MAX_WORKSPACE = 1 << 28  # float32 elements of partial accumulators before splits grow (1 GiB)
_MERGE_TILE = 16  # splits per merge-loop step
_LOG2E = math.log2(math.e)
_NUM_WARPS = 8


@dataclasses.dataclass(frozen=True)
class Plan:
    """Launch geometry, from host ints only."""

    head_tiles: int
    block_n: int  # tokens per tile
    split_len: int  # tokens per split (a power of two >= block_n when split: the merge compiles per value)
    num_splits: int
    num_warps: int
    num_stages: int

    @property
    def direct(self) -> bool:
        return self.num_splits == 1


def _tile_config(r_pad: int, dot16: bool, hip: bool) -> tuple[int, int, int]:
    """(tokens per tile, warps, stages), chosen on kernels compiled offline with Triton's own ptxas
    flags and the AMD backend (tests/test_emu_triton_mla.py compiles them): 16 tokens and 8 warps
    leave R = 512 free of spills on sm_80, sm_90 and gfx942 for every cache dtype (a [16, 512]
    float32 accumulator is 32 registers a thread at 8 warps; 4 warps or 32 tokens spill 40-800 B an
    FP8 kernel at R = 512); narrow latents (R <= 128 16-bit, R <= 64 float32) take 32 tokens, still spill-free,
    halving the loop's trips. (R = 256 over a 16-bit cache spills < 100 B, float32 operands at
    R = 1024 about 1 KiB.) Shared memory: at most 38 KiB up to R = 512, 70 KiB for float32 operands
    at R = 1024. Stages: the tile's addresses come from the block table and Triton does not pipeline
    these loads (1-3 stages compile to the same kernel); 1 on AMD as vLLM's Triton MLA kernel has it."""
    block_n = 32 if r_pad <= (128 if dot16 else 64) else 16
    return block_n, _NUM_WARPS, (1 if hip else 2)


def plan(total_q: int, num_heads: int, r: int, p: int, max_seq_len: int, *, dot16: bool, sm_count: int,
         hip: bool = False, num_splits: int | None = None) -> Plan:
    """Tiles, warps and splits for a call. ``num_splits``: a requested split count (tests), else
    chosen from the SM count; either way rounded so that ``split_len`` is a power of two."""
    block_n, warps, stages = _tile_config(max(16, _pow2(r)), dot16, hip)
    head_tiles = triton.cdiv(num_heads, BLOCK_H)
    ctx = max(1, max_seq_len)
    programs = total_q * head_tiles
    if num_splits is None:
        want = 1 if programs >= sm_count else min(triton.cdiv(WAVES * sm_count, programs), triton.cdiv(ctx, MIN_SPLIT))
    else:
        want = max(1, num_splits)
    split_len = max(block_n, _pow2(triton.cdiv(ctx, want)))
    while triton.cdiv(ctx, split_len) > 1 and total_q * num_heads * triton.cdiv(ctx, split_len) * r > _MAX_WORKSPACE:
        split_len *= 2  # bound the workspace for huge batches of long contexts
    splits = triton.cdiv(ctx, split_len)
    if splits == 1:
        split_len = ctx  # one split covers every row's context
    return Plan(head_tiles, block_n, split_len, splits, warps, stages)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: no SMs to fill (tests ask for splits explicitly)
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _exact_in(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return fp8.is_fp8(cache_dtype) or cache_dtype == query_dtype


def _prefixed(prefix: str, constants: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in constants.items()}


def mla_decode_tensors(out, q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale, ckv_scale, kpe_scale,
                       max_seq_len: int, query_start_loc=None, *, num_splits: int | None = None) -> None:
    """Writes ``out`` [total_q, num_heads, R] (:mod:`torch_mla`'s contract). ``max_seq_len``: a host
    int >= every sequence's length. ``num_splits``: force a split count (tests)."""
    total_q, h, r = q_nope.shape
    if total_q == 0:
        return
    p = q_pe.shape[2]
    r_pad = max(16, _pow2(r))
    bs = ckv_cache.shape[1]
    dev = q_nope.device
    dot16 = q_nope.dtype in _HALF and _exact_in(q_nope.dtype, ckv_cache.dtype) and _exact_in(q_nope.dtype,
                                                                                               kpe_cache.dtype)
    cfg = plan(total_q, h, r, p, max_seq_len, dot16=dot16, sm_count=_sm_count(dev), hip=torch.version.hip is not None,
               num_splits=num_splits)

    c_dec, c_factor = _decode_constants(ckv_cache.dtype)
    k_dec, k_factor = _decode_constants(kpe_cache.dtype)
    cs_ptr, cs_val, cs_stride = _scale_args(ckv_scale, seq_lens)
    ps_ptr, ps_val, ps_stride = _scale_args(kpe_scale, seq_lens)
    # FP8 decoded straight into float16 bits is off by 2^(bias-15): the factors put it back, folded
    # with the scales into the logit and output multipliers (tensor scales: in-kernel, index 0).
    c_logit = float(scale) * cs_val * c_factor * _LOG2E
    p_logit = float(scale) * ps_val * k_factor * _LOG2E
    out_scale = cs_val * c_factor
    if cfg.direct:  # unused workspace pointers
        ws_m = ws_l = ws_acc = out
        ws_len = seq_lens
    else:
        ws_m = torch.empty((total_q, h, cfg.num_splits), dtype=torch.float32, device=dev)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((total_q, h, cfg.num_splits, r), dtype=torch.float32, device=dev)
        ws_len = torch.empty((total_q,), dtype=torch.int32, device=dev)
    seq_lens = seq_lens.contiguous()  # 1-d inputs are indexed densely (no-ops when already dense)
    varlen = query_start_loc is not None
    qsl = query_start_loc.contiguous() if varlen else seq_lens
    ckv, kpe = _raw(ckv_cache), _raw(kpe_cache)
    with _device(q_nope):
        K.mla_partition_kernel[(total_q, cfg.head_tiles, cfg.num_splits)](
            out, q_nope, q_pe, ckv, kpe, block_tables, seq_lens, qsl, cs_ptr, ps_ptr, ws_m, ws_l, ws_acc, ws_len,
            c_logit, p_logit, out_scale, seq_lens.shape[0], h, cfg.num_splits, cfg.split_len,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
            ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1), block_tables.stride(0), block_tables.stride(1),
            R=r, R_PAD=r_pad, R_CHUNK=min(R_CHUNK, r_pad), P=p, P_PAD=max(16, _pow2(p)), BS=bs, BLOCK_H=BLOCK_H,
            BLOCK_N=cfg.block_n,
            VARLEN=varlen, DIRECT=cfg.direct, DOT16=dot16, CS_TENSOR=cs_stride >= 0, PS_TENSOR=ps_stride >= 0,
            **_prefixed("C", c_dec), **_prefixed("K", k_dec), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if not cfg.direct:
            # ws_len holds each row's context length: the merge's "sequence" is the row, its one
            # "KV head" the latent (G = 1, the scale read at index 0).
            triton_kernels.attn_merge_kernel[(total_q, h)](
                out, ws_m, ws_l, ws_acc, ws_len, cs_ptr, out_scale, 0, h, cfg.num_splits,
                out.stride(0), out.stride(1),
                G=1, D=r, D_PAD=r_pad, PART=cfg.split_len, P_TILE=_MERGE_TILE,
                V_SCALE_STRIDE=0 if cs_stride >= 0 else -1, HAS_WINDOW=False, num_warps=4,
            )


def mla_decode(call, *, num_splits: int | None = None) -> None:
    """Run a validated :class:`hal.call.MLACall`."""
    mla_decode_tensors(call.out, call.q_nope, call.q_pe, call.ckv_cache, call.kpe_cache, call.block_tables,
                       call.seq_lens, call.scale, call.ckv_scale, call.kpe_scale, call.max_seq_len,
                       call.query_start_loc, num_splits=num_splits)
