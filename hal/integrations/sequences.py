"""The sequences living in a paged cache: block ids from a free list, each sequence's blocks and
length, and one step's geometry (block table, slots, positions, lengths, row offsets), built on the
host once per step. :class:`~hal.integrations.paged_cache.PagedKVCache` (K/V pages) and
:class:`~hal.integrations.mla.PagedMLACache` (latent pages) both keep their sequences here."""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["BlockAllocator", "CacheFullError", "SequenceTable", "StepGeometry"]


class CacheFullError(RuntimeError):
    """No free blocks are left for a sequence's new tokens."""


class BlockAllocator:
    """Free list of block ids ``0 .. num_blocks - 1``; lowest ids first (deterministic layouts)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"BlockAllocator: num_blocks must be > 0; got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() from the end gives the lowest id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"KV cache full: {n} blocks wanted, {len(self._free)} of "
                                 f"{self.num_blocks} free (make the cache larger or free finished sequences)")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(sorted(blocks, reverse=True))
        self._free.sort(reverse=True)


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    """One step's geometry on the host: ``b`` sequences getting up to ``q`` new tokens each."""

    past: torch.Tensor               # int64 [b]: tokens before the step
    counts: torch.Tensor             # int64 [b]: new tokens
    block_tables: torch.Tensor       # int32 [b, width]; entries past a sequence's blocks are 0 (unused)
    slots: torch.Tensor              # int64 [b * q]: each new token's slot, -1 for padding
    positions: torch.Tensor          # int64 [b, q]: each new token's position (padding: the last real one)
    seq_lens: torch.Tensor           # int64 [b]: past + counts
    query_start_loc: torch.Tensor    # int32 [b + 1]: the real rows' offsets, back to back
    valid: torch.Tensor              # bool [b, q]: real (not padding) rows
    max_new: int                     # q

    @property
    def padded(self) -> bool:
        return not bool(self.valid.all())


class SequenceTable:
    """Sequences by id: their blocks (from a :class:`BlockAllocator` of ``num_blocks``) and lengths."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    def add(self) -> int:
        sid, self._next_id = self._next_id, self._next_id + 1
        self._blocks[sid], self._lens[sid] = [], 0
        return sid

    def free(self, sid: int) -> None:
        self.allocator.free(self._blocks.pop(sid))
        del self._lens[sid]

    def seq_len(self, sid: int) -> int:
        return self._lens[sid]

    def block_ids(self, sid: int) -> list[int]:
        """The blocks holding sequence ``sid``'s tokens, in order."""
        return list(self._blocks[sid])

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def reserve(self, seq_ids: list[int], counts: list[int]) -> torch.Tensor:
        """Check a step (one count per distinct sequence, counts >= 0 and not all 0), give each sequence
        the blocks its ``counts[i]`` new tokens need; returns the tokens each had before (int64)."""
        if len(seq_ids) != len(counts) or not seq_ids:
            raise ValueError("begin_step: one count per sequence, at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"begin_step: a sequence appears twice in {seq_ids}")
        if any(c < 0 for c in counts) or max(counts) == 0:
            raise ValueError(f"begin_step: counts must be >= 0 and not all 0; got {counts}")
        for sid, c in zip(seq_ids, counts):
            need = math.ceil((self._lens[sid] + c) / self.block_size) - len(self._blocks[sid])
            if need > 0:
                self._blocks[sid] += self.allocator.allocate(need)
        return torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int64)

    def blocks_of(self, seq_ids: list[int]) -> list[list[int]]:
        return [self._blocks[s] for s in seq_ids]

    def geometry(self, seq_ids: list[int], counts: list[int], past: torch.Tensor) -> StepGeometry:
        """The step's geometry after :meth:`reserve` (host tensors)."""
        bs, q = self.block_size, max(counts)
        cnt = torch.tensor(counts, dtype=torch.int64)
        width = max(1, max(len(self._blocks[s]) for s in seq_ids))
        table = torch.zeros((len(seq_ids), width), dtype=torch.int32)
        for i, s in enumerate(seq_ids):
            table[i, :len(self._blocks[s])] = torch.tensor(self._blocks[s], dtype=torch.int32)
        offs = torch.arange(q, dtype=torch.int64)
        pos = past[:, None] + offs[None, :]                                  # [b, q]
        valid = offs[None, :] < cnt[:, None]
        blk = torch.gather(table.to(torch.int64), 1, (pos // bs).clamp_max(width - 1))
        slots = torch.where(valid, blk * bs + pos % bs, -1).reshape(-1)
        lens = past + cnt
        qsl = torch.zeros(len(seq_ids) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(cnt, 0).to(torch.int32)
        positions = torch.where(valid, pos, lens[:, None] - 1).clamp_min(0)
        return StepGeometry(past, cnt, table, slots, positions, lens, qsl, valid, q)

    def advance(self, seq_ids: list[int], counts: list[int]) -> None:
        """The step's tokens are in: the sequences are that much longer."""
        for s, c in zip(seq_ids, counts):
            self._lens[s] += c
