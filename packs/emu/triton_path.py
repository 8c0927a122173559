"""The emu pack's Triton path: GPUs without FP8 hardware (NVIDIA before sm89, AMD before gfx942) or
any GPU forced to ``emu``. Same semantics and signature as :mod:`torch_path`; kernels live in
:mod:`triton_kernels`.

Attention is split-K over the context: partitions of ``PARTITION_SIZE`` tokens run as separate
programs, each serving every query head of one KV group (padded to >= 16 rows for ``tl.dot``) from
one read of each K/V tile, and a second kernel merges partitions by log-sum-exp. When one partition
covers ``max_seq_len`` the first kernel writes ``out`` itself. With ``max_seq_len`` given nothing
here reads device memory from the host, so a call can be captured in a CUDA graph.

Precision: a 16-bit query with an FP8 cache or a cache of its own dtype multiplies in that dtype on
tensor cores (FP8 values and the cache's own values are exact there), with float32 accumulation and
probabilities rounded to the 16-bit type for PV. Every other combination (float32 query, a cache
dtype that would round) uses float32 operands with IEEE products.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton

from hal import fp8

from . import triton_kernels as K

PARTITION_SIZE = 512  # tokens per split-K partition (vLLM's v2 value)
_MERGE_TILE = 16  # partitions per merge-loop step
_MAX_WORKSPACE = 1 << 28  # float32 elements of partial accumulators before partitions grow
_NUM_WARPS = 4  # the tile sizes in paged_attention were chosen (shared memory measured) for 4 warps
_HALF = (torch.float16, torch.bfloat16)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _device(t: torch.Tensor):
    # Triton launches on the current device: make it the tensors' one (multi-GPU processes).
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _fp8_constants(dtype: torch.dtype) -> dict:
    """Bit-layout constexprs of a cache dtype's encoding (hal.fp8 is where they are defined)."""
    if not fp8.is_fp8(dtype):
        return dict(FP8=False, MAN=0, BIAS=0, FNUZ=False)
    enc = fp8.encoding_of(dtype)
    return dict(FP8=True, MAN=enc.mantissa_bits, BIAS=enc.bias, FNUZ=enc.fnuz)


@functools.cache
def _special_bytes(dtype: torch.dtype) -> tuple[int, int]:
    """(saturation byte, NaN byte), asked of hal.fp8.encode_bytes itself: the kernel writes what the
    definition writes."""
    if not fp8.is_fp8(dtype):
        return 0, 0
    probe = fp8.encode_bytes(torch.tensor([math.inf, math.nan], dtype=torch.float32), dtype)
    return int(probe[0]), int(probe[1])


def _decode_constants(dtype: torch.dtype) -> tuple[dict, float]:
    """Decode constexprs of a cache dtype, and the factor its decoded values must be multiplied by
    (2^(15-bias) when FP8 is placed straight into float16 bits, see triton_kernels.decode_fp8_fp16)."""
    c = _fp8_constants(dtype)
    if not c["FP8"]:
        return dict(c, FAST16=False, EXP=0, SUBNORMAL=0.0), 1.0
    enc = fp8.encoding_of(dtype)
    fast16 = not (enc.fnuz and enc.exponent_bits == 5)
    factor = 2.0 ** (15 - enc.bias) if fast16 else 1.0
    return dict(c, FAST16=fast16, EXP=enc.exponent_bits, SUBNORMAL=enc.min_subnormal), factor


def _scale_args(s, placeholder: torch.Tensor):
    """(pointer, host value, stride constexpr): a host float passes by value (stride -1), a 0-d
    tensor is read at index 0 (stride 0), a per-head tensor at the KV head (stride 1)."""
    if isinstance(s, torch.Tensor):
        return s, 1.0, (1 if s.dim() == 1 else 0)
    return placeholder, float(s), -1


def _raw(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if fp8.is_fp8(cache.dtype) else cache


def _paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len) -> None:
    n, h, d = query.shape
    if n == 0:
        return
    _, hkv, bs, _ = key_cache.shape
    g = h // hkv
    max_len = max_seq_len  # a host int: resolved once by validation (hal.ops.paged_attention.check)

    d_pad = max(16, _pow2(d))
    g_tile = min(max(16, _pow2(g)), 64 if d_pad <= 128 else 32)  # large groups: several head tiles
    num_tiles = triton.cdiv(g, g_tile)
    part = PARTITION_SIZE
    while triton.cdiv(max_len, part) > 1 and n * h * triton.cdiv(max_len, part) * d > _MAX_WORKSPACE:
        part *= 2  # bound the workspace (1 GiB of float32) for huge batches of long contexts
    num_parts = max(1, triton.cdiv(max_len, part))
    direct = num_parts == 1
    dot16 = query.dtype in _HALF and (fp8.is_fp8(key_cache.dtype) or key_cache.dtype == query.dtype)
    # Tokens per tile: float32 operands stage twice the bytes through shared memory; these sizes keep
    # every configuration within 64 KiB (sm_75's limit), measured on compiled kernels.
    block_n = (64 if d_pad <= 128 else 32) if dot16 else (32 if d_pad <= 128 else 16)

    decode, factor = _decode_constants(key_cache.dtype)
    ks_ptr, ks_val, ks_stride = _scale_args(k_scale, seq_lens)
    vs_ptr, vs_val, vs_stride = _scale_args(v_scale, seq_lens)
    qk_scale = float(scale) * ks_val * factor  # one multiply of the logits (tensor k_scale: in-kernel)
    vs_val *= factor
    dev = query.device
    if direct:  # unused workspace pointers
        ws_m = ws_l = ws_acc = out
    else:
        ws_m = torch.empty((n, h, num_parts), dtype=torch.float32, device=dev)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((n, h, num_parts, d), dtype=torch.float32, device=dev)
    window = 0 if sliding_window is None else int(sliding_window)
    seq_lens = seq_lens.contiguous()  # 1-d inputs are indexed densely (no-ops when already dense)
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    with _device(query):
        K.attn_partition_kernel[(n, hkv * num_tiles, num_parts)](
            out, query, _raw(key_cache), _raw(value_cache), block_tables, seq_lens, ks_ptr, vs_ptr,
            seq_lens if alibi_slopes is None else alibi_slopes, ws_m, ws_l, ws_acc,
            qk_scale, vs_val, 1.0 if logits_soft_cap is None else float(logits_soft_cap),
            window, h, num_parts,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), value_cache.stride(0), block_tables.stride(0), block_tables.stride(1),
            G=g, G_TILE=g_tile, NUM_TILES=num_tiles, D=d, D_PAD=d_pad, BS=bs, PART=part, BLOCK_N=block_n,
            **decode, DOT16=dot16,
            K_SCALE_STRIDE=ks_stride, V_SCALE_STRIDE=vs_stride, HAS_ALIBI=alibi_slopes is not None,
            HAS_SOFTCAP=logits_soft_cap is not None, HAS_WINDOW=sliding_window is not None,
            DIRECT=direct, num_warps=_NUM_WARPS,
        )
        if not direct:
            K.attn_merge_kernel[(n, h)](
                out, ws_m, ws_l, ws_acc, seq_lens, vs_ptr, vs_val, window, h, num_parts,
                out.stride(0), out.stride(1),
                G=g, D=d, D_PAD=d_pad, PART=part, P_TILE=_MERGE_TILE, V_SCALE_STRIDE=vs_stride,
                HAS_WINDOW=sliding_window is not None, num_warps=4,
            )


def _cache_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    t = key.shape[0]
    if t == 0:
        return
    nb, hkv, bs, d = key_cache.shape
    d_pad = _pow2(d)
    h_tile = min(_pow2(hkv), max(1, 4096 // d_pad))
    ks_ptr, ks_val, ks_stride = _scale_args(k_scale, key)
    vs_ptr, vs_val, vs_stride = _scale_args(v_scale, key)
    max_byte, nan_byte = _special_bytes(key_cache.dtype)
    slot_mapping = slot_mapping.contiguous()
    with _device(key):
        K.cache_kv_kernel[(t, triton.cdiv(hkv, h_tile))](
            key, value, _raw(key_cache), _raw(value_cache), slot_mapping, ks_ptr, vs_ptr, ks_val, vs_val,
            nb * bs, hkv, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), value_cache.stride(0),
            D=d, D_PAD=d_pad, H_TILE=h_tile, BS=bs, K_SCALE_STRIDE=ks_stride, V_SCALE_STRIDE=vs_stride,
            **_fp8_constants(key_cache.dtype), MAX_BYTE=max_byte, NAN_BYTE=nan_byte, num_warps=4,
        )


def paged_attention(call) -> None:
    """Run a validated :class:`hal.call.AttentionCall`."""
    _paged_attention(call.out, call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens, call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap, call.sliding_window, call.max_seq_len)


def cache_kv(call) -> None:
    """Run a validated :class:`hal.call.CacheWriteCall`."""
    _cache_kv(call.key, call.value, call.key_cache, call.value_cache, call.slot_mapping, call.k_scale, call.v_scale)
