"""The emu pack's Triton path for several query tokens per sequence (``query_start_loc``: prefill,
chunked prefill, mixed batches), on GPUs; the kernel lives in :mod:`triton_prefill_kernels`.

Semantics (docs/semantics.md, "Several query tokens per sequence"): row ``t`` of a sequence's
``q_len`` rows sits at position ``p = L - q_len + t``; causal keeps keys ``j <= p``, ``causal=False``
every ``j < L``; a window ``w`` keeps ``j > p - w``; ALiBi adds ``slope_h * (j - p)`` after the
soft-cap. ``scale * k_scale`` multiplies the logits once, ``v_scale`` the output once.

One launch serves the whole batch. Its grid is ``(total_q // BLOCK_Q + num_seqs, num_kv_heads *
head_tiles)``, from host ints only (``query.shape[0]``, ``seq_lens.shape[0]``, the geometry and
``max_query_len``, which only picks the tile height): each program finds its sequence in
``query_start_loc`` on the device and exits when its slot is past that sequence's rows. Nothing
here reads device memory from the host, so a call can be captured in a CUDA graph.

Decode rows: a batch of one row per sequence (``max_query_len <= 1`` and ``total_q == num_seqs``,
host ints, so every ``q_len`` is 1) is a decode call and goes to :mod:`triton_path`'s split-K decode
kernel (same bits as without ``query_start_loc``; split-K keeps long contexts parallel). In a mixed
batch, decode rows are served by this kernel like any other: their tile holds one token's heads.

Precision (as :mod:`triton_path`): a 16-bit query with an FP8 cache or a cache of its own dtype
multiplies in that dtype (``tl.dot``, float32 accumulation, probabilities rounded to the 16-bit
type for PV); every other combination uses float32 operands with IEEE products.
"""

from __future__ import annotations

import functools

import torch
import triton

from hal import fp8

from . import triton_path
from . import triton_prefill_kernels as K
from .triton_path import _HALF, _decode_constants, _device, _pow2, _raw, _scale_args

# (dot16, head dim padded <= 128) -> (most rows per tile, keys per tile). float32 operands stage
# twice the bytes through shared memory; these keep every configuration within 64 KiB (sm_75's
# limit), measured on kernels compiled offline: sm_80/sm_90 at most 56 KiB, sm_75 at most 64 KiB
# (16-bit, head size 256); gfx942 16 KiB of LDS, no scratch (tests/test_emu_triton_prefill.py).
TILES = {
    (True, True): (64, 64),
    (True, False): (32, 32),
    (False, True): (32, 32),
    (False, False): (16, 16),
}
NUM_WARPS = 4
NUM_STAGES = None  # Triton's default
# Per GPU architecture (torch's compute capability), entries that replace the above, keyed
# (dot16, small head, FP8 cache) -> (rows, keys, warps, stages). sm_90 (H200, 2026-12-01,
# results of a sweep over rows 64/128 x keys 32/64/128 x warps 4/8 x stages 2/3 on 8x2048 and
# 4x1024@8192, 32x8x128 causal; docs/bench.md "Prefill"): a bf16 cache 2227 -> 1350 us
# at 8x2048 (204 TFLOP/s), e4m3fn 2992 -> 1755 us (157 TFLOP/s).
TUNED: dict[tuple[int, int], dict[tuple[bool, bool, bool], tuple[int, int, int, int]]] = {
    (9, 0): {(True, True, False): (128, 64, 8, 2), (True, True, True): (128, 128, 8, 2)},
}


def _config(dot16: bool, small_d: bool, fp8_cache: bool,
            capability: tuple[int, int] | None) -> tuple[int, int, int, int | None]:
    tuned = TUNED.get(capability, {}).get((dot16, small_d, fp8_cache)) if capability else None
    if tuned is not None:
        return tuned
    return (*TILES[(dot16, small_d)], NUM_WARPS, NUM_STAGES)


def plan(total_q: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, max_query_len: int,
         dot16: bool, capability: tuple[int, int] | None = None, fp8_cache: bool = False) -> dict:
    """Tile geometry and grid from host ints: rows per tile (``BLOCK_M``: ``BLOCK_Q`` tokens x
    ``G_TILE`` heads of a KV group), keys per tile, head tiles per group, warps and stages."""
    g = num_heads // num_kv_heads
    d_pad = max(16, _pow2(head_size))
    rows_max, block_n, warps, stages = _config(dot16, d_pad <= 128, fp8_cache, capability)
    g_tile = min(g, rows_max)
    num_ht = triton.cdiv(g, g_tile)
    # Short rows (decode, speculative) get short tiles; long ones the full height.
    block_m = min(rows_max, max(16, _pow2(max(1, max_query_len) * g_tile)))
    block_q = block_m // g_tile
    grid = (total_q // block_q + num_seqs, num_kv_heads * num_ht)
    launch = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    return dict(G=g, G_TILE=g_tile, NUM_HT=num_ht, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
                D=head_size, D_PAD=d_pad, grid=grid, launch=launch)


@functools.lru_cache(maxsize=None)
def _capability(device) -> tuple[int, int] | None:
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return torch.cuda.get_device_capability(device)


def paged_attention_varlen(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                           alibi_slopes, logits_soft_cap, sliding_window, query_start_loc, max_query_len,
                           causal) -> None:
    """Writes ``out`` [total_q, num_heads, head_size] (see the module docstring). The caches are
    read through their (block, head, token) strides, the head dimension dense."""
    total_q, h, d = query.shape
    n = seq_lens.shape[0]
    if total_q == 0 or n == 0:
        return
    _, hkv, bs, _ = key_cache.shape
    dot16 = query.dtype in _HALF and (fp8.is_fp8(key_cache.dtype) or key_cache.dtype == query.dtype)
    tiles = plan(total_q, n, h, hkv, d, max_query_len, dot16, _capability(query.device),
                 fp8.is_fp8(key_cache.dtype))
    grid, launch = tiles.pop("grid"), tiles.pop("launch")

    decode, factor = _decode_constants(key_cache.dtype)
    ks_ptr, ks_val, ks_stride = _scale_args(k_scale, seq_lens)
    vs_ptr, vs_val, vs_stride = _scale_args(v_scale, seq_lens)
    qk_scale = float(scale) * ks_val * factor  # one multiply of the logits (tensor k_scale: in-kernel)
    vs_val *= factor
    window = 0 if sliding_window is None else int(sliding_window)
    seq_lens = seq_lens.contiguous()  # 1-d inputs are indexed densely (no-ops when already dense)
    qsl = query_start_loc.contiguous()
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    kc, vc = _raw(key_cache), _raw(value_cache)
    with _device(query):
        K.prefill_kernel[grid](
            out, query, kc, vc, block_tables, seq_lens, qsl, ks_ptr, vs_ptr,
            seq_lens if alibi_slopes is None else alibi_slopes,
            qk_scale, vs_val, 1.0 if logits_soft_cap is None else float(logits_soft_cap), window, n,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            block_tables.stride(0), block_tables.stride(1),
            **tiles, BS=bs, **decode, DOT16=dot16, K_SCALE_STRIDE=ks_stride, V_SCALE_STRIDE=vs_stride,
            HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=logits_soft_cap is not None,
            HAS_WINDOW=sliding_window is not None, CAUSAL=bool(causal), EVEN_D=d == tiles["D_PAD"],
            **launch,
        )


def paged_attention(call) -> None:
    """Run a validated multi-token :class:`hal.call.AttentionCall` (``query_start_loc`` set)."""
    n = call.seq_lens.shape[0]
    if call.max_query_len <= 1 and call.query.shape[0] == n:  # one row per sequence: a decode call
        triton_path.paged_attention(call)
        return
    paged_attention_varlen(call.out, call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens,
                           call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap,
                           call.sliding_window, call.query_start_loc, call.max_query_len, call.causal)
