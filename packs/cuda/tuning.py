"""The cuda pack's tuning table (``tuning.json``): launch parameters per arch and shape class.

``tools/tune`` measures them on a GPU and writes its arch's entry; archs without one use
``default``. Readable without the compiled module (hal-probe, tests)."""

from __future__ import annotations

import functools
import json
import pathlib

import torch

TUNING_FILE = pathlib.Path(__file__).with_name("tuning.json")
CLASSES = ("fp8-short", "fp8-long", "16bit-short", "16bit-long")
SHORT_CONTEXT = 2048  # longest sequence at or below this: the "short" shape classes
_override: dict | None = None  # tools/tune's candidate, replacing the table's entry while it times


@functools.cache
def tuning_table() -> dict:
    return json.loads(TUNING_FILE.read_text())


def shape_class(cache_dtype: torch.dtype, max_len: int) -> str:
    """The shape class of a call: cache width (fp8 | 16bit) and context (short | long)."""
    width = "fp8" if cache_dtype.itemsize == 1 else "16bit"
    return f"{width}-{'short' if max_len <= SHORT_CONTEXT else 'long'}"


def tuning_for(arch: str, cls: str | None = None) -> dict:
    """Launch parameters for ``arch`` (e.g. ``sm_90``) and a shape class; without a class, the whole
    entry with ``source`` (the arch, or ``default``)."""
    table = tuning_table()
    entry = table.get(arch)
    source = arch if entry is not None else "default"
    entry = entry if entry is not None else table["default"]
    if cls is None:
        return {"source": source, **entry}
    if _override is not None:
        return dict(_override)
    return dict(entry["classes"][cls])


def set_override(params: dict | None) -> None:
    """tools/tune: use ``params`` for every call instead of the table (None restores the table)."""
    global _override
    _override = None if params is None else dict(params)


def split(ctas: int, max_len: int, sms: int, params: dict, resident: int | None = None) -> tuple[int, int]:
    """(partition_size, num_parts): one pass when the ``ctas`` of one pass (sequences x KV heads x
    head tiles) reach the target ``sms * ctas_per_sm * waves``; else the context is cut into
    partitions (multiples of 64 tokens, never below ``min_partition``) until about that many exist,
    but never into more CTAs than one wave of the kernel holds (``resident`` CTAs per SM, when known):
    a split that spills into a second wave was slower on every shape measured (H200, 2026-12-04,
    tools/split_sweep.py: 1x131072 bf16 0.73 -> 0.87 of copy, GQA 16 bf16 0.77 -> 0.93; docs/cuda.md)."""
    max_len = max(max_len, 1)
    base = max(1, ctas)
    target = int(sms * params["ctas_per_sm"] * params["waves"])
    whole = -(-max_len // 64) * 64
    if base >= target or whole <= params["min_partition"]:
        return whole, 1
    parts = min(-(-target // base), -(-max_len // params["min_partition"]))
    if resident:
        parts = max(1, min(parts, sms * resident // base))
    size = -(-(-(-max_len // parts)) // 64) * 64
    return size, -(-max_len // size)


def mla_split(units: int, max_len: int, sms: int, min_partition: int = 256) -> tuple[int, int]:
    """(partition_size, num_parts) for MLA decode, whose CTAs (``units`` = sequences x row tiles of one
    pass) are one per SM (their shared memory): cut the context until the CTAs about fill the SMs
    once, never more than one wave (a second, partial wave would cost as much as the first), and
    never into partitions under ``min_partition`` tokens. Sizes are multiples of 64 tokens."""
    max_len = max(max_len, 1)
    parts = max(1, sms // max(1, units))
    parts = min(parts, max(1, max_len // min_partition))
    size = -(-(-(-max_len // parts)) // 64) * 64
    return size, -(-max_len // size)


def warp_rows(rows: int, sms: int, params: dict) -> bool:
    """Whether a one-pass call of ``rows`` (sequences x KV heads x head tiles) has each warp serve its
    own row: when ``rows >= warp_rows * sms * ctas_per_sm * waves`` (the entry's ``warp_rows``; 0 or
    absent: never). Each warp then streams a whole row with no merge between warps, which pays where
    rows are many and short (a quarter of a 1K row is only 8 FP8 load rounds per warp)."""
    f = params.get("warp_rows", 0)
    return f > 0 and rows >= f * sms * params["ctas_per_sm"] * params["waves"]


def summary(arch: str) -> str:
    """One line per shape class of the entry ``arch`` uses, for hal-probe."""
    t = tuning_for(arch)
    m = t.get("measured")
    head = (f"tuning {arch} (tools/tune on {m['device']}, {m['date']})" if t["source"] == arch and m
            else f"tuning default (no measured entry for {arch})")
    lines = [f"{c}: aims for {v['ctas_per_sm'] * v['waves']:g} CTAs per SM, partitions >= {v['min_partition']} tokens"
             + (f", a warp per row from {v['warp_rows'] * v['ctas_per_sm'] * v['waves']:g} rows per SM"
                if v.get("warp_rows", 0) > 0 else ", warp rows off")
             for c, v in t["classes"].items()]
    pre = t.get("prefill", {})
    wg, cute, cute8 = (pre.get(k, []) for k in ("wgmma_head_sizes", "cute_head_sizes", "cute_fp8_head_sizes"))
    heads = lambda hs: ", ".join(map(str, hs))  # noqa: E731
    lines.append("multi-token kernel: "
                 + (f"CuTe (csrc/prefill_cute.cuh) for head sizes {heads(cute)} over 16-bit caches, " if cute else "")
                 + (f"CuTe for head sizes {heads(cute8)} over FP8 caches, " if cute8 else "")
                 + (f"wgmma (csrc/prefill_sm90.cuh) for head sizes {heads(wg)} " if wg else "")
                 + ("(grids at least half rows), mma.sync for the rest" if wg or cute or cute8
                    else "mma.sync (csrc/prefill.cuh)")
                 + "; HAL_CUDA_PREFILL overrides")
    lines.append("MLA decode, 64-row tiles: " + ("wgmma (csrc/mla_sm90.cuh)" if t.get("mla", {}).get("wgmma")
                                                 else "mma.sync (csrc/mla.cuh)")
                 + "; 16-row tiles: csrc/mla_narrow.cuh over FP8 latents, csrc/mla.cuh over 16-bit ones"
                 + "; contexts split over the SMs on the device (csrc/mla_schedule.cu)")
    return "\n".join([head + ":"] + lines)
