"""The rocm pack's launch parameters per arch (``tuning.json``), with where each value comes from."""

from __future__ import annotations

import functools
import json
import pathlib

from . import kernels

_PATH = pathlib.Path(__file__).with_name("tuning.json")


@functools.cache
def table() -> dict:
    data = json.loads(_PATH.read_text())
    for arch, entry in data["partition_size"].items():
        v = entry["value"]
        if not (isinstance(v, int) and v > 0 and v % kernels.CHUNK == 0):
            raise ValueError(f"{_PATH}: partition_size for {arch} is {v!r}; it must be a positive multiple of "
                             f"{kernels.CHUNK}")
    return data


def partition_size(arch: str) -> int:
    entries = table()["partition_size"]
    if arch not in entries:
        raise KeyError(f"{_PATH} has no partition_size for {arch} (it has {', '.join(sorted(entries))})")
    return entries[arch]["value"]


def mla_decode(arch: str) -> dict:
    """MLA decode's split-K parameters for ``arch``: compute_units, workgroups_per_cu, min_partition."""
    entries = table().get("mla_decode", {})
    if arch not in entries:
        raise KeyError(f"{_PATH} has no mla_decode entry for {arch} (it has {', '.join(sorted(entries))})")
    e = entries[arch]
    for k in ("compute_units", "workgroups_per_cu", "min_partition"):
        if not (isinstance(e.get(k), int) and e[k] > 0):
            raise ValueError(f"{_PATH}: mla_decode.{arch}.{k} is {e.get(k)!r}; it must be a positive int")
    if e["min_partition"] % kernels.MLA_STEP:
        raise ValueError(f"{_PATH}: mla_decode.{arch}.min_partition must be a multiple of {kernels.MLA_STEP}")
    return e
