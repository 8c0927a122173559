"""Reading pages of a paged KV cache as float32, for the emu pack's PyTorch paths (decode and
multi-token): the one place they gather blocks and decode FP8 bytes.

``gather(cache, blocks)`` gives the pages ``blocks`` [..., nblk] of ``cache`` [num_blocks, hkv, bs, d]
as float32 [..., hkv, nblk * bs, d]. The steps, each one pass:

1. the blocks' bytes, whole blocks at a time: ``index_select`` over the cache viewed as one row per
   block (a row copy, ~10x faster on a CPU than advanced indexing of the 4-d cache, which walks
   it element by element); a cache whose blocks are not dense (an NHD view) takes advanced indexing;
2. the head-major reorder, fused with the widening: on a CPU, FP8 bytes are copied, reordered, into
   int32 indices, two bytes each (``hal.fp8.decode_pair_table``: 65536 float32 pairs, 512 KiB,
   in L2; one byte each from the 256-entry ``decode_table`` when d is odd) and looked up with
   ``index_select`` (~0.5 ns a byte on a core, 1.6x the one-byte table, 3-6x torch's FP8 casts); elsewhere (GPUs) the reorder copies into
   ``hal.fp8.decode_values``'s cast, and 16-bit caches widen in the same copy;
3. ``drop`` [..., nblk * bs] (optional): positions that must read as 0 (slots no row may read,
   whatever bytes they hold: p = 0 there, and 0 * NaN would be NaN). For FP8 on a CPU their indices
   become byte 0 (0.0 in every encoding) before the lookup.

``workspace(device)`` gives a caller buffers to reuse over its chunks: on a CPU one per thread that
lives on between calls (its size is bounded by the caller's chunk, a few MiB), since fresh
temporaries of that size are page-faulted anew on every call by glibc's allocator; elsewhere a
fresh one per call.
"""

from __future__ import annotations

import sys
import threading

import torch

from hal import fp8

_LITTLE_ENDIAN = sys.byteorder == "little"


class Workspace:
    """Buffers reused across ``gather`` calls of one attention call (grown when too small)."""

    def __init__(self):
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < numel or buf.device != torch.device(device):
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[(name, dtype)] = buf
        return buf[:numel]


_THREAD = threading.local()


def workspace(device) -> Workspace:
    """A :class:`Workspace` for one attention call on ``device`` (see the module docstring)."""
    if torch.device(device).type != "cpu":
        return Workspace()
    work = getattr(_THREAD, "work", None)
    if work is None:
        work = _THREAD.work = Workspace()
    return work


def _block_bytes(raw: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' elements as [..., nblk, hkv, bs, d] in raw's dtype (a fresh tensor)."""
    nb, hkv, bs, d = raw.shape
    lead = blocks.shape
    s0, s1, s2, s3 = raw.stride()
    if (s1, s2, s3) == (bs * d, d, 1):  # each block dense: one row per block
        rows = raw.as_strided((nb, hkv * bs * d), (s0, 1))
        return torch.index_select(rows, 0, blocks.reshape(-1)).view(*lead, hkv, bs, d)
    return raw[blocks]


def gather(cache: torch.Tensor, blocks: torch.Tensor, drop: torch.Tensor | None = None,
           work: Workspace | None = None, name: str = "out", indexed: bool | None = None) -> torch.Tensor:
    """Pages ``blocks`` [..., nblk] (valid block ids) of ``cache`` as float32 [..., hkv, nblk * bs, d];
    positions where ``drop`` [..., nblk * bs] is True read as 0. With ``work``, the result is a
    view of its buffer ``name`` (valid until the next gather into that name). ``indexed``: FP8
    through the table lookup (default: on a CPU) or through ``hal.fp8.decode_values``."""
    _, hkv, bs, d = cache.shape
    lead, nblk = blocks.shape[:-1], blocks.shape[-1]
    is_fp8 = fp8.is_fp8(cache.dtype)
    raw = cache.view(torch.uint8) if is_fp8 else cache
    pages = _block_bytes(raw, blocks).movedim(-3, -4)            # [..., hkv, nblk, bs, d], a view
    shape = (*lead, hkv, nblk * bs, d)
    numel = pages.numel()
    if work is not None:
        out = work.take(name, numel, torch.float32, cache.device).view(shape)
    else:
        out = torch.empty(shape, dtype=torch.float32, device=cache.device)
    if indexed is None:
        indexed = cache.device.type == "cpu"
    if is_fp8 and indexed:
        # Two bytes per lookup where a row holds whole pairs (even d, a little-endian host).
        pairs = d % 2 == 0 and _LITTLE_ENDIAN
        src = pages.view(torch.uint16) if pairs else pages
        n_idx = src.numel()
        idx = (work.take("index", n_idx, torch.int32, cache.device) if work is not None
               else torch.empty(n_idx, dtype=torch.int32, device=cache.device)).view(src.shape)
        idx.copy_(src)
        if drop is not None:  # byte 0 (a pair of them) is 0.0 in every encoding
            _zero_positions(idx.view(*shape[:-1], src.shape[-1]), drop)
        if pairs:
            _lookup(fp8.decode_pair_table(cache.dtype, cache.device), idx.view(-1), out.view(torch.int64).view(-1))
        else:
            _lookup(fp8.decode_table(cache.dtype, torch.float32, cache.device), idx.view(-1), out.view(-1))
        return out
    if is_fp8:
        fp8.decode_values(pages.view(cache.dtype), out.view(pages.shape))
    else:
        out.view(pages.shape).copy_(pages)
    if drop is not None:
        _zero_positions(out, drop)
    return out


def _lookup(table: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out = table[idx] (1-d). (torch's CPU index_select of a 1-d table runs on one core; splitting
    it over a thread pool measured faster alone, 0.85 -> 0.60 ms for 2^19 lookups, but slower in
    the attention loop, where the pool's thread competes with torch's OpenMP threads.)"""
    torch.index_select(table, 0, idx, out=out)


def _zero_positions(x: torch.Tensor, drop: torch.Tensor) -> None:
    """x [..., hkv, T, d]: every (lead, position) where drop [..., T] is True set to 0, in place."""
    if x.device.type == "cpu":  # only the dropped rows are written (usually a few per sequence)
        if drop.any():
            x.movedim(-3, -2)[drop] = 0
    else:  # no host sync
        x.masked_fill_(drop[..., None, :, None], 0)
