"""Host side of the cuda pack: choose the split of the context, allocate the workspace, launch.

Thin on purpose: validation happened in hal (hal/ops/, into the call record), the kernels live in csrc/.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hal import env

from . import _C
from .tuning import mla_split, shape_class, split, tuning_for, warp_rows

KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
INPUTS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# Query heads per CTA (by cache element size): 16, two 8-head MMA tiles sharing each K/V fragment, so
# a GQA group above 8 reads its KV pages once. FP8 caches take 16 only up to head 128, where the
# two-tile kernel loads two steps a round (csrc/decode.cuh, LoopConfig) in 196 registers; at head 256
# that spills and FP8 keeps one 8-head tile a CTA, as it does where 8-head tiles take warp rows
# (_decode_launch). H100, 2026-12-05, FP8 GQA 12-32 at >= 8K context: 1.05-1.19x faster with 16;
# bf16 (H200, 2026-11-29) 1.0-1.15x (docs/cuda.md).
HEAD_TILE = {1: 16, 2: 16}
FP8_WIDE_TILE_MAX_HEAD = 128


def head_tile(element_size: int, head_size: int) -> int:
    """Query heads a decode CTA serves for this cache element size and head size."""
    tile = HEAD_TILE[element_size]
    return min(tile, 8) if element_size == 1 and head_size > FP8_WIDE_TILE_MAX_HEAD else tile


# Multi-token kernel: "auto" (HAL_CUDA_PREFILL, else the tuning entry's "prefill" "cute_head_sizes"
# (16-bit caches), "cute_fp8_head_sizes" (FP8 caches) and "wgmma_head_sizes" take those kernels where the grid is mostly rows, and the rest
# the mma.sync one), "mma" (csrc/prefill.cuh, mma.sync: every arch), "wgmma" (csrc/prefill_sm90.cuh,
# warpgroup MMAs fed by a producer warpgroup: where it can run, an sm_90 GPU with sm_90a code in the
# module and head sizes 64/128/192; elsewhere the mma.sync kernel) or "cute" (csrc/prefill_cute.cuh, on
# CUTLASS's CuTe: 128-key tiles, swizzled operands; head sizes 64 and 128 where the module was built with
# CUTLASS, elsewhere as "wgmma").
# The tests and the bench set this; users set HAL_CUDA_PREFILL.
PREFILL_KERNEL = "auto"
# "auto" takes the wgmma kernel only where at least this fraction of its grid has rows to compute: the
# grid is num_seqs x max_query_len rows (no host read of query_start_loc), and a mixed batch's one-row
# sequences leave most of it as CTAs that exit at once. The wgmma kernel holds a whole SM (~200 KiB of
# shared memory), so those empty CTAs pass one an SM at a time. H200, 2026-12-04, 64x1@4096+2x1024
# (3 % of the grid has rows): wgmma 432 / 311 us (bf16 / e4m3fn cache) against 384 / 263 us for the
# same work as two calls, while mma.sync's cheap empty CTAs cost 422 / 296 us (docs/cuda.md).
WGMMA_MIN_FILL = 0.5
# MLA decode kernels: each row-tile size may have a kernel of its own besides csrc/mla.cuh (mma.sync, every
# arch, every tile): csrc/mla_sm90.cuh for 64-row tiles (more than 32 rows a sequence: 128 heads, or 64 with
# speculative rows; sm_90a code on an sm_90 GPU, elsewhere mla.cuh) and csrc/mla_narrow.cuh for 16-row tiles
# (up to 16 rows a sequence: 16 heads under tensor parallelism; every arch). "auto": the tuning entry's
# "mla" "wgmma" for 64-row tiles, and the narrow kernel for 16-row tiles over an FP8 latent (1.2-1.3x
# mla.cuh there; over a 16-bit latent it is no faster, and slower on ragged batches: H100, 2026-12-05,
# docs/cuda.md); "mma": mla.cuh for every tile; "wgmma" or "narrow": that kernel for its tiles, mla.cuh for
# the others. The tests and the bench set this.
MLA_KERNEL = "auto"
# Where a split context's partitions are merged: "auto" (decode: in the kernel for a plan, whose row
# counters are zeroed once when it is made and left zero by every launch, and by the reduce kernel
# for a one-shot call, which would otherwise need a zeroing launch of its own; MLA decode: always the
# reduce kernel), "kernel" (the last CTA of a row merges; a one-shot call zeroes fresh counters; the
# sm_90a MLA kernel still takes the reduce) or "reduce" (a second launch: reduce.cu, mla_reduce.cu).
# The in-kernel merge saves a plan's run the reduce launch's host time (~5 us on the H200 host), and
# decode's GPU time too (its merges are small: H200, 2026-12-04, 4x8192 e4m3 39.3 -> 37.1 us). MLA's
# are not: one CTA merges 16-64 rows of 512 over every partition, where the reduce spreads a row over
# a CTA per head (1x65536x16 bf16 55.9 -> 112.0 us, 64x4096x16 97.8 -> 101.8 us). The tests and the
# bench set this.
DECODE_MERGE = "auto"
# The largest (query heads a CTA x partitions) a plan's decode merges in the kernel under "auto": the
# merging CTA reads that many partial rows alone. Measured faster up to 4 x 64 (1x131072x32x8 bf16);
# MLA's 16 x 2 rows of 512 were slower, so larger merges keep the reduce launch.
IN_KERNEL_MERGE_MAX = 256
# How MLA decode splits a batch's contexts over the SMs: "device" (the balanced split: a one-CTA launch,
# csrc/mla_schedule.cu, cuts each row tile by its own length from the device's seq_lens and lists the
# partitions longest first; graph-safe) or "uniform" (every row tile cut by the longest sequence,
# planned on the host: tuning.mla_split). "device" is taken where a context may be cut (max_seq_len
# over MLA_MIN_PARTITION tokens), the batch has more than one sequence (one sequence's tiles are all
# as long, so the balanced split would make the uniform cut, and pay its launch: 1x65536x16 52.3 vs
# 44.5 us, H100, 2026-12-06) and at most _C's schedule limit of row tiles. The tests and the bench set
# this.
MLA_SCHEDULE = "device"
MLA_MIN_PARTITION = 256
# The balanced split's workspace, in waves of one CTA an SM: at most sequences x row tiles + waves x SMs
# CTAs, and waves x SMs partial slots (tiles of 16-64 rows x 2 KiB); and the fixed cost of a CTA in
# 64-token blocks, its cost model's c0 (csrc/mla_schedule.cu)
MLA_SCHEDULE_WAVES = 2
MLA_SCHEDULE_OVERHEAD = 2
MLA_SCHEDULE_TILES = 8192  # csrc/launch.h kMlaScheduleTiles


# the prefill launch's kernel code (params.h PrefillParams.wgmma): each where it can run, else the next down
PREFILL_KERNEL_CODES = {"mma": 0, "wgmma": 1, "cute": 2}


def _prefill_kernel(head_size: int, cache_dtype: torch.dtype, device: torch.device, total_q: int, num_seqs: int,
                    max_query_len: int) -> int:
    """The multi-token kernel a launch asks for (PREFILL_KERNEL_CODES): forced by PREFILL_KERNEL or
    HAL_CUDA_PREFILL, else by the tuning entry: "cute_head_sizes" (16-bit caches) or
    "cute_fp8_head_sizes" (FP8 caches) before "wgmma_head_sizes", each only where the grid is mostly
    rows (WGMMA_MIN_FILL)."""
    kernel = PREFILL_KERNEL if PREFILL_KERNEL != "auto" else env.cuda_prefill_kernel()
    if kernel != "auto":
        return PREFILL_KERNEL_CODES[kernel]
    if total_q < WGMMA_MIN_FILL * num_seqs * max_query_len:
        return 0
    _, arch = _device_facts(_device_index(device))
    entry = tuning_for(arch).get("prefill", {})
    if head_size in entry.get("cute_fp8_head_sizes" if cache_dtype.itemsize == 1 else "cute_head_sizes", ()):
        return 2
    return 1 if head_size in entry.get("wgmma_head_sizes", ()) else 0


def _mla_own_kernel(groups: int, device: torch.device, fp8_latent: bool) -> bool:
    """Whether a tile of ``groups`` MMA row groups takes its own kernel (the launch's last argument):
    mla_sm90.cuh for 4 (64 rows), mla_narrow.cuh for 1 (16 rows); 2 (32 rows) has none."""
    name = {4: "wgmma", 1: "narrow"}.get(groups)
    if name is None:
        return False
    if MLA_KERNEL != "auto":
        return MLA_KERNEL == name
    if name == "narrow":
        return fp8_latent
    _, arch = _device_facts(_device_index(device))
    return bool(tuning_for(arch).get("mla", {}).get(name, False))


@functools.cache
def _device_facts(index: int) -> tuple[int, str]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, f"sm_{props.major}{props.minor}"


@functools.cache
def _resident(index: int, kind: int, head_size: int, two_tiles: bool) -> int | None:
    """Resident CTAs per SM of the decode kernel (the CUDA occupancy API, once per kernel and device)."""
    with torch.cuda.device(index):
        n = _C.decode_ctas_per_sm(kind, head_size, two_tiles, False)
    return n if n > 0 else None


def plan(num_seqs: int, num_kv_heads: int, head_tiles: int, max_len: int, device: torch.device,
         cache_dtype: torch.dtype, one_tile: bool = True, head_size: int = 128) -> tuple[int, int, bool]:
    """(partition_size, num_parts, warp_rows) for a call, from this GPU's tuning entry (see
    tuning.split and tuning.warp_rows) and the resident CTAs of the kernel it takes. ``one_tile``: a
    CTA serves one 8-head MMA tile (warp rows need it; else two tiles share each K/V fragment)."""
    index = _device_index(device)
    sms, arch = _device_facts(index)
    params = tuning_for(arch, shape_class(cache_dtype, max_len))
    rows = num_seqs * num_kv_heads * head_tiles
    size, parts = split(rows, max_len, sms, params, _resident(index, KINDS[cache_dtype], head_size, not one_tile))
    return size, parts, one_tile and parts == 1 and warp_rows(rows, sms, params)


def _on(device: torch.device):
    """(device guard, raw current stream) for a launch on ``device``: the guard switches devices only
    when needed, and the stream is read without torch.cuda.current_stream's Python layers (they cost
    ~10 us a call on the H200 host, a tenth of hal's per-call overhead)."""
    cur = torch.cuda.current_device()
    index = device.index if device.index is not None else cur
    guard = contextlib.nullcontext() if index == cur else torch.cuda.device(index)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    stream = raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
    return guard, stream


def _scale(s) -> tuple[float, int, int]:
    """(value, pointer, stride) for the kernels: a float, or a device tensor (0-d: stride 0)."""
    if isinstance(s, torch.Tensor):
        return 1.0, s.data_ptr(), 1 if s.dim() == 1 else 0
    return float(s), 0, 0


def _row_strides(cache: torch.Tensor, name: str, align: int = 16) -> tuple[int, int]:
    """(head stride, token stride) of a [blocks, kv_heads, block_size, D] cache in bytes: HND dense or
    any strided view (an NHD cache's permute(0, 2, 1, 3)); the kernels' vector accesses need rows on
    ``align``-byte boundaries (16: attention's loads; 4: cache_kv's two-element stores)."""
    e = cache.element_size()
    hs, ts = cache.stride(1) * e, cache.stride(2) * e
    if hs % align or ts % align:
        raise ValueError(f"cuda pack: {name} needs its heads and tokens on {align}-byte boundaries (strides "
                         f"{tuple(cache.stride())} x {e} bytes); view it from an aligned allocation or pass pack='emu'")
    return hs, ts


def _paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                          alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, query_start_loc=None,
                          planned=False):
    """``(arguments of _C.paged_attention but the stream, workspace tensors)`` of one decode launch,
    or None for an empty batch. The one-shot call and a plan (``planned``) build their launches here.
    With ``query_start_loc`` (a multi-token call) the kernel serves the sequences of one query row only."""
    _, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    n = seq_lens.shape[0]
    if n == 0 or query.shape[0] == 0:
        return None
    dev = query.device
    max_len = max_seq_len  # a host int: resolved once by validation (hal.ops.paged_attention.check)
    tile = head_tile(key_cache.element_size(), d)
    if tile > 8 and h // hkv > 8 and key_cache.element_size() == 1:
        # FP8 with many short rows: where 8-head tiles would take warp rows, they beat 16-head CTAs
        # (H100, 2026-12-05: 128x2048 and 256x1024 at GQA 16, 0.80 / 0.74 of copy against 0.67 / 0.52)
        if plan(n, hkv, -(-(h // hkv) // 8), max_len, dev, key_cache.dtype, one_tile=True, head_size=d)[2]:
            tile = 8
    head_tiles = -(-(h // hkv) // tile)
    size, parts, wrows = plan(n, hkv, head_tiles, max_len, dev, key_cache.dtype,
                              one_tile=head_tiles * 8 >= h // hkv, head_size=d)
    if parts > 1:
        part_out = torch.empty((n, h, parts, d), dtype=torch.float32, device=dev)
        part_ml = torch.empty((n, h, parts, 2), dtype=torch.float32, device=dev)
        workspace = (part_out, part_ml)
        ws = (part_out.data_ptr(), part_ml.data_ptr(), 0)
        # "auto" merges a plan's rows in the kernel where one CTA's merge stays as small as measured
        # faster (heads a CTA x partitions <= IN_KERNEL_MERGE_MAX; see DECODE_MERGE)
        small = min(h // hkv, tile) * parts <= IN_KERNEL_MERGE_MAX
        merge = DECODE_MERGE if DECODE_MERGE != "auto" else ("kernel" if planned and small else "reduce")
        if merge == "kernel" and not wrows:
            counters = torch.zeros(n * hkv * head_tiles, dtype=torch.int32, device=dev)
            workspace += (counters,)
            ws = (*ws[:2], counters.data_ptr())
    else:
        workspace, ws = (), (0, 0, 0)
    ks, ksp, kss = _scale(k_scale)
    vs, vsp, vss = _scale(v_scale)
    elem = key_cache.element_size()
    args = [
        KINDS[key_cache.dtype], d, out.data_ptr(), query.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        0 if alibi_slopes is None else alibi_slopes.data_ptr(), ksp, vsp, *ws,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0) * elem,
        value_cache.stride(0) * elem, block_tables.stride(0), scale, ks, vs,
        0.0 if logits_soft_cap is None else float(logits_soft_cap), kss, vss, n, h, hkv, head_tiles, bs,
        size, parts, 0 if sliding_window is None else sliding_window, int(query.dtype == torch.bfloat16),
        int(wrows), *_row_strides(key_cache, "key_cache"), *_row_strides(value_cache, "value_cache"),
        0 if query_start_loc is None else query_start_loc.data_ptr()]
    return args, workspace


def _prefill_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, k_scale,
                  v_scale, alibi_slopes, logits_soft_cap, sliding_window, causal, max_query_len) -> list:
    """The arguments of _C.prefill but the stream: the multi-token sequences of a call (the decode
    launch takes the one-row ones), its grid sized from the host int ``max_query_len``."""
    _, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    ks, ksp, kss = _scale(k_scale)
    vs, vsp, vss = _scale(v_scale)
    elem = key_cache.element_size()
    return [KINDS[key_cache.dtype], d, out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
            0 if alibi_slopes is None else alibi_slopes.data_ptr(), ksp, vsp, query.stride(0), query.stride(1),
            out.stride(0), out.stride(1), key_cache.stride(0) * elem, value_cache.stride(0) * elem,
            block_tables.stride(0), scale, ks, vs, 0.0 if logits_soft_cap is None else float(logits_soft_cap), kss, vss,
            seq_lens.shape[0], h, hkv, bs, 0 if sliding_window is None else sliding_window, int(causal),
            int(query.dtype == torch.bfloat16), max_query_len, 2, *_row_strides(key_cache, "key_cache"),
            *_row_strides(value_cache, "value_cache"),
            _prefill_kernel(d, key_cache.dtype, query.device, query.shape[0], seq_lens.shape[0], max_query_len)]


def _multi_token(call) -> bool:
    return call.query_start_loc is not None and call.max_query_len > 1


def _attention_launches(call, out, query, planned: bool = False) -> tuple[list, tuple]:
    """``([(launcher name in _C, args)], workspace)`` of a validated call with these query/output tensors:
    decode alone, or for a multi-token call the prefill kernel (sequences of 2+ rows) and the decode
    kernel with its split-K (sequences of one row), in that order on one stream."""
    launches, workspace = [], ()
    if _multi_token(call):
        launches.append(("prefill", _prefill_args(
            out, query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens, call.query_start_loc,
            call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap, call.sliding_window,
            call.causal, call.max_query_len)))
    built = _paged_attention_args(out, query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens,
                                  call.scale, call.k_scale, call.v_scale, call.alibi_slopes, call.logits_soft_cap,
                                  call.sliding_window, call.max_seq_len, call.query_start_loc, planned)
    if built is not None:
        args, workspace = built
        launches.append(("paged_attention", args))
    return launches, workspace


def _aligned_rows(t: torch.Tensor) -> bool:
    """The prefill and MLA kernels' 16-byte row loads and stores need 16-byte aligned rows (unit last stride)."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where its rows are not 16-byte aligned a fresh copy whose rows are (``.contiguous()``
    would return a contiguous view whose data pointer is off 16 bytes as it is)."""
    return t if _aligned_rows(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _cache_kv_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> list:
    """The arguments of _C.cache_kv but the stream (the one-shot call and a plan build them here)."""
    nb, hkv, bs, d = key_cache.shape
    ks, ksp, kss = _scale(k_scale)
    vs, vsp, vss = _scale(v_scale)
    elem = key_cache.element_size()
    return [KINDS[key_cache.dtype], INPUTS[key.dtype], key.data_ptr(), value.data_ptr(), key_cache.data_ptr(),
            value_cache.data_ptr(), slot_mapping.data_ptr(), ksp, vsp, key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), key_cache.stride(0) * elem, value_cache.stride(0) * elem, ks, vs, kss,
            vss, key.shape[0], hkv, d, bs, nb, *_row_strides(key_cache, "key_cache", 4),
            *_row_strides(value_cache, "value_cache", 4)]


def _cache_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    args = _cache_kv_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    guard, stream = _on(key.device)
    with guard:
        _C.cache_kv(*args, stream)


def paged_attention(call) -> None:
    """Run a validated :class:`hal.call.AttentionCall`: decode, prefill, chunked prefill or a mixed
    batch (the prefill kernel's query/output rows copied to 16-byte aligned ones where they are not)."""
    query, out = call.query, call.out
    if _multi_token(call):
        query = _rows16(query)
        out = out if _aligned_rows(out) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    launches, _workspace = _attention_launches(call, out, query)  # the workspace lives until queued
    guard, stream = _on(query.device)
    with guard:
        for name, args in launches:
            getattr(_C, name)(*args, stream)
    if out is not call.out:
        call.out.copy_(out)


def cache_kv(call) -> None:
    """Run a validated :class:`hal.call.CacheWriteCall`."""
    _cache_kv(call.key, call.value, call.key_cache, call.value_cache, call.slot_mapping, call.k_scale, call.v_scale)


def _cache_strides(c: torch.Tensor, name: str) -> tuple[int, int]:
    """(block stride, token stride) in bytes of an MLA cache; its rows must be 16-byte aligned."""
    e = c.element_size()
    bs, ts = c.stride(0) * e, c.stride(1) * e
    if c.data_ptr() % 16 or bs % 16 or ts % 16:
        raise ValueError(f"hal.mla_decode (cuda pack): {name} needs 16-byte aligned token rows (data pointer, block "
                         f"and token strides multiples of 16 bytes); got pointer %16 = {c.data_ptr() % 16}, strides "
                         f"{c.stride()} x {e} bytes. Pass pack='emu' for such a view.")
    return bs, ts


MLA_ROW_GROUPS = ((16, 1), (32, 2))  # rows a sequence -> MMA row groups a CTA (else 4: 64 rows)


def _mla_decode_args(call, q_nope, q_pe, out, planned: bool = False):
    """``(arguments of _C.mla_decode but the stream, workspace tensors)`` for the record ``call``
    with these (16-byte aligned) query and output tensors, or None when there is nothing to run. A
    plan's (``planned``) balanced split keeps its work list while the lengths it was made for hold."""
    total_q, h, r = call.q_nope.shape
    n = call.seq_lens.shape[0]
    if total_q == 0 or n == 0:
        return None
    dev = call.q_nope.device
    rows = call.max_query_len * h
    groups = next((g for limit, g in MLA_ROW_GROUPS if rows <= limit), 4)
    row_tiles = -(-rows // (16 * groups))
    sms, _ = _device_facts(_device_index(dev))
    own = _mla_own_kernel(groups, dev, call.ckv_cache.element_size() == 1)
    wgmma = own and groups == 4
    units = n * row_tiles
    balanced = (MLA_SCHEDULE == "device" and n > 1 and call.max_seq_len > MLA_MIN_PARTITION
                and units <= MLA_SCHEDULE_TILES)
    if balanced:
        size, parts = 64, 1
        cap, slots = units + MLA_SCHEDULE_WAVES * sms, MLA_SCHEDULE_WAVES * sms
        work = torch.empty((cap, 4), dtype=torch.int32, device=dev)
        tile_parts = torch.empty((units, 4), dtype=torch.int32, device=dev)
        part_out = torch.empty((slots * 16 * groups, r), dtype=torch.float32, device=dev)
        part_ml = torch.empty((slots * 16 * groups, 2), dtype=torch.float32, device=dev)
        workspace = (part_out, part_ml, work, tile_parts)
        sched = (work.data_ptr(), tile_parts.data_ptr(), 0)
        if planned:  # the row tiles' block counts of the last list (none yet)
            seen = torch.full((units,), -2 ** 31, dtype=torch.int32, device=dev)
            workspace += (seen,)
            sched = (*sched[:2], seen.data_ptr())
        tail = (sms, cap, slots, MLA_SCHEDULE_OVERHEAD)
    else:
        size, parts = mla_split(units, call.max_seq_len, sms, MLA_MIN_PARTITION)
        sched, tail = (0, 0, 0), (0, 0, 0, 0)
        workspace = ()
        if parts > 1:
            part_out = torch.empty((total_q, h, parts, r), dtype=torch.float32, device=dev)
            part_ml = torch.empty((total_q, h, parts, 2), dtype=torch.float32, device=dev)
            workspace = (part_out, part_ml)
    if workspace:
        ws = (workspace[0].data_ptr(), workspace[1].data_ptr(), 0)
        if DECODE_MERGE == "kernel" and not wgmma:  # the sm_90a kernel always merges by the reduce launch
            counters = torch.zeros(units, dtype=torch.int32, device=dev)
            workspace += (counters,)
            ws = (*ws[:2], counters.data_ptr())
    else:
        ws = (0, 0, 0)
    cbs, cts = _cache_strides(call.ckv_cache, "ckv_cache")
    pbs, pts = _cache_strides(call.kpe_cache, "kpe_cache")
    cs, csp, _ = _scale(call.ckv_scale)
    ps, psp, _ = _scale(call.kpe_scale)
    qsl = call.query_start_loc
    args = [
        KINDS[call.ckv_cache.dtype], groups, out.data_ptr(), q_nope.data_ptr(), q_pe.data_ptr(),
        call.ckv_cache.data_ptr(), call.kpe_cache.data_ptr(), call.block_tables.data_ptr(),
        call.seq_lens.data_ptr(), 0 if qsl is None else qsl.data_ptr(), csp, psp, *ws, *sched, q_nope.stride(0),
        q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1), cbs, cts, pbs, pts,
        call.block_tables.stride(0), call.scale, cs, ps, n, h, total_q, call.ckv_cache.shape[1], size, parts,
        row_tiles, int(q_nope.dtype == torch.bfloat16), int(own), *tail]
    return args, workspace


def mla_decode(call) -> None:
    """Run a validated :class:`hal.call.MLACall` (R = 512, P = 64: the pack's declaration)."""
    qn, qp = _rows16(call.q_nope), _rows16(call.q_pe)
    out = call.out if _aligned_rows(call.out) else torch.empty_like(call.q_nope)
    built = _mla_decode_args(call, qn, qp, out)
    if built is None:
        return
    args, _workspace = built
    guard, stream = _on(call.q_nope.device)
    with guard:
        _C.mla_decode(*args, stream)
    if out is not call.out:
        call.out.copy_(out)


def cache_mla(call) -> None:
    """Run a validated :class:`hal.call.MLAWriteCall`: the latent and the rotary part, one launch each."""
    nb, bs, _ = call.ckv_cache.shape
    guard, stream = _on(call.kv_c.device)
    with guard:
        for src, cache, s in ((call.kv_c, call.ckv_cache, call.ckv_scale), (call.k_pe, call.kpe_cache, call.kpe_scale)):
            e = cache.element_size()
            value, sp, _ = _scale(s)
            _C.cache_rows(KINDS[cache.dtype], INPUTS[src.dtype], src.data_ptr(), cache.data_ptr(),
                          call.slot_mapping.data_ptr(), sp, src.stride(0), cache.stride(0) * e, cache.stride(1) * e,
                          value, src.shape[0], src.shape[1], bs, nb, stream)


# --- plans (hal.plan): the launches built once (_C.*_prepare), a layer's pointers given per run -----
# The per-layer arguments a prepared launch's run takes, in its order (bindings.cpp, the launches'
# take()): the tensors (as data pointers; up to five), then the two scales (a scale planned as a
# tensor passes its pointer, a float its value).
PER_LAYER = {
    "paged_attention": (("out", "query", "key_cache", "value_cache"), ("k_scale", "v_scale")),
    "cache_kv": (("key", "value", "key_cache", "value_cache"), ("k_scale", "v_scale")),
    "mla_decode": (("out", "q_nope", "q_pe", "ckv_cache", "kpe_cache"), ("ckv_scale", "kpe_scale")),
}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _prepared(op: str, launches: list, call, device: torch.device, keep: tuple):
    """A plan's runner for ``launches`` (``[(name in _C, args but the stream)]``, run in order): one
    ``_C.Prepared`` holding every launch's parameters, made on the planned device, and a runner that
    gives it the layer's pointers and scales and the stream read at run time (a CUDA graph captures on
    its own stream). ``keep`` (the workspace, the geometry tensors) lives as long as the runner."""
    index = _device_index(device)
    guard, _ = _on(device)
    with guard:  # the sm_90a kernels' check reads the current device
        prepared = None
        for name, args in launches:
            step = getattr(_C, f"{name}_prepare")(*args)
            if prepared is None:
                prepared = step
            else:
                prepared.extend(step)
    tensors, scales = PER_LAYER[op]
    tensor_scale = tuple(isinstance(getattr(call, n), torch.Tensor) for n in scales)  # the kind is planned
    raw = _raw_launcher(prepared.run, _launch_context(index), index)

    def run(fields: dict) -> None:  # the runner protocol's dict form; hal.plan's run calls raw
        raw(*(fields[n].data_ptr() for n in tensors), *(0,) * (5 - len(tensors)),
            *(fields[n].data_ptr() if t else 0 for n, t in zip(scales, tensor_scale)),
            *(1.0 if t else fields[n] for n, t in zip(scales, tensor_scale)))
    run.keep, run.prepared = keep, prepared
    run.raw, run.raw_layout = raw, (tensors, 5, scales)
    return run


def _raw_launcher(launch, context, index: int):
    """``raw(p0, .., p4, scale pointer 0, 1, scale value 0, 1)``: the prepared launch with the layer's
    pointers and scales as hal.plan's run reads them (``raw_layout``), on the current stream."""
    def raw(a, b, c, d, e, sp0, sp1, sv0, sv1):
        stream = context()
        if stream is None:
            with torch.cuda.device(index):
                launch(a, b, c, d, e, sp0, sp1, sv0, sv1, context())
        else:
            launch(a, b, c, d, e, sp0, sp1, sv0, sv1, stream)
    return raw


def _launch_context(index: int):
    """``context()``: the current raw stream of device ``index`` when that device is current, else
    None (the runner then switches devices and asks again): the cheap reads of :func:`_on`."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    current = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device

    def context():
        if current() != index:
            return None
        return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
    return context


def _prepare_paged_attention(call):
    """A plan of paged attention: the split of the context, the workspace (allocated once, reused
    by every layer of the plan, in stream order) and the launch arguments, from the planned record.
    A multi-token plan whose query or output rows are not 16-byte aligned (copied by the one-shot
    call) takes the default runner instead (None)."""
    if _multi_token(call) and not (_aligned_rows(call.query) and _aligned_rows(call.out)):
        return None
    launches, workspace = _attention_launches(call, call.out, call.query, planned=True)
    if not launches:
        return lambda fields: None
    return _prepared("paged_attention", launches, call, call.query.device,
                     (workspace, call.block_tables, call.seq_lens, call.alibi_slopes, call.query_start_loc))


def _prepare_cache_kv(call):
    args = _cache_kv_args(call.key, call.value, call.key_cache, call.value_cache, call.slot_mapping, call.k_scale,
                          call.v_scale)
    return _prepared("cache_kv", [("cache_kv", args)], call, call.key.device, (call.slot_mapping,))


def _prepare_mla_decode(call):
    """As :func:`_prepare_paged_attention`; a plan whose query or output rows are not 16-byte aligned
    (copied by the one-shot call) takes the default runner instead (None)."""
    if not all(_aligned_rows(t) for t in (call.q_nope, call.q_pe, call.out)):
        return None
    built = _mla_decode_args(call, call.q_nope, call.q_pe, call.out, planned=True)
    if built is None:
        return lambda fields: None
    args, workspace = built
    return _prepared("mla_decode", [("mla_decode", args)], call, call.q_nope.device,
                     (workspace, call.block_tables, call.seq_lens, call.query_start_loc))


paged_attention.prepare = _prepare_paged_attention
cache_kv.prepare = _prepare_cache_kv
mla_decode.prepare = _prepare_mla_decode
