"""Host side of the cuda pack: choose the split of the context, allocate the workspace, launch.

Thin on purpose: validation happened in hal (hal/validate.py), the kernels live in csrc/.
"""

from __future__ import annotations

import functools
import json
import pathlib

import torch

from hal.kernelpacks.cuda import _C

KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
INPUTS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
HEAD_TILE = 16  # query heads per MMA tile


@functools.cache
def tuning_table() -> dict:
    return json.loads((pathlib.Path(__file__).with_name("tuning.json")).read_text())


def tuning_for(arch: str) -> dict:
    table = tuning_table()
    return {**table["default"], **table.get(arch, {})}


@functools.cache
def _device_facts(index: int) -> tuple[int, str]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, f"sm_{props.major}{props.minor}"


def plan(num_seqs: int, num_kv_heads: int, head_tiles: int, max_len: int, device: torch.device) -> tuple[int, int]:
    """(partition_size, num_parts): one pass when the grid already fills the GPU, else split the
    context until about ``waves`` full waves of CTAs exist, never below ``min_partition`` tokens."""
    sms, arch = _device_facts(device.index if device.index is not None else torch.cuda.current_device())
    t = tuning_for(arch)
    max_len = max(max_len, 1)
    base = max(1, num_seqs * num_kv_heads * head_tiles)
    target = sms * t["ctas_per_sm"] * t["waves"]
    whole = -(-max_len // 64) * 64
    if base >= target or whole <= t["min_partition"]:
        return whole, 1
    parts = min(-(-target // base), -(-max_len // t["min_partition"]))
    size = -(-(-(-max_len // parts)) // 64) * 64
    return size, -(-max_len // size)


def _scale(s) -> tuple[float, int, int]:
    """(value, pointer, stride) for the kernels: a float, or a device tensor (0-d: stride 0)."""
    if isinstance(s, torch.Tensor):
        return 1.0, s.data_ptr(), 1 if s.dim() == 1 else 0
    return float(s), 0, 0


def paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                    alibi_slopes, logits_soft_cap, sliding_window, max_seq_len) -> None:
    n, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    if n == 0:
        return
    dev = query.device
    head_tiles = -(-(h // hkv) // HEAD_TILE)
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    size, parts = plan(n, hkv, head_tiles, max_len, dev)
    if parts > 1:
        part_out = torch.empty((n, h, parts, d), dtype=torch.float32, device=dev)
        part_ml = torch.empty((n, h, parts, 2), dtype=torch.float32, device=dev)
        ws = (part_out.data_ptr(), part_ml.data_ptr())
    else:
        ws = (0, 0)
    ks, ksp, kss = _scale(k_scale)
    vs, vsp, vss = _scale(v_scale)
    elem = key_cache.element_size()
    with torch.cuda.device(dev):
        _C.paged_attention(
            KINDS[key_cache.dtype], d, out.data_ptr(), query.data_ptr(), key_cache.data_ptr(),
            value_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
            0 if alibi_slopes is None else alibi_slopes.data_ptr(), ksp, vsp, *ws,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0) * elem,
            value_cache.stride(0) * elem, block_tables.stride(0), scale, ks, vs,
            0.0 if logits_soft_cap is None else float(logits_soft_cap), kss, vss, n, h, hkv, head_tiles, bs,
            size, parts, 0 if sliding_window is None else sliding_window, int(query.dtype == torch.bfloat16),
            torch.cuda.current_stream(dev).cuda_stream)


def cache_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    nb, hkv, bs, d = key_cache.shape
    ks, ksp, kss = _scale(k_scale)
    vs, vsp, vss = _scale(v_scale)
    elem = key_cache.element_size()
    dev = key.device
    with torch.cuda.device(dev):
        _C.cache_kv(KINDS[key_cache.dtype], INPUTS[key.dtype], key.data_ptr(), value.data_ptr(),
                    key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), ksp, vsp,
                    key.stride(0), key.stride(1), value.stride(0), value.stride(1), key_cache.stride(0) * elem,
                    value_cache.stride(0) * elem, ks, vs, kss, vss, key.shape[0], hkv, d, bs, nb,
                    torch.cuda.current_stream(dev).cuda_stream)
