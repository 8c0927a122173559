"""A paged KV cache for a whole model, served by hal: blocks, block tables and per-step plans.

Why a cache object of its own rather than a ``transformers.Cache``: a transformers cache hands dense
K/V back to the attention function (``cache.update`` returns the keys to attend to), which is exactly
what a paged FP8 cache must not do. Here K/V go into hal's pages with :func:`hal.cache_kv` and never
come back out; attention reads them through :func:`hal.paged_attention`. The object is independent
of transformers (an engine can drive it directly); :mod:`hal.integrations.transformers` plugs it into
a model's attention layers.

One forward pass is one *step*: :meth:`PagedKVCache.begin_step` says which sequences get how many new
tokens, allocates their blocks, and builds the step's plan (slots, per-query block tables and
lengths) once; every layer then calls :meth:`PagedKVCache.attend`, which writes the layer's new K/V
and runs attention. Until hal has a prefill op, a step with several new tokens per sequence runs
every one of them as its own decode query (its length is its position + 1 and it shares its
sequence's block table), which is causal attention computed by the decode kernel: the cache holds
the step's tokens before any query reads them, as in token-by-token decoding.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

import hal
from hal.fp8 import is_fp8

__all__ = ["BlockAllocator", "CacheFullError", "PagedKVCache", "StepPlan"]

log = logging.getLogger("hal")


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


@dataclasses.dataclass
class StepPlan:
    """What every layer needs for one forward step (built once per step).

    Rows are the step's query tokens, ``[batch, new_tokens]`` flattened row-major; a row past a
    sequence's new-token count is padding (slot -1, length 0: hal writes nothing and returns zeros).
    """

    seq_ids: list[int]
    counts: list[int]                 # new tokens per sequence
    slot_mapping: torch.Tensor        # [rows] int64
    block_tables: torch.Tensor        # [rows, max_blocks] int32 (a row per query token)
    seq_lens: torch.Tensor            # [rows] int32: the query's position + 1 (0 for padding)
    position_ids: torch.Tensor        # [batch, new_tokens] int64
    groups: list[tuple[int, int, int]]  # (row0, row1, max_seq_len) per paged_attention call
    valid: torch.Tensor | None        # [rows] bool, None when no row is padding


class PagedKVCache:
    """K/V pages for every layer of a model, a block allocator and the sequences living in it.

    ``dtype`` is the cache encoding (bf16/fp16/fp32 or a torch float8 dtype). ``scales``: a
    :class:`hal.KVScales` (from :func:`hal.load_kv_scales` or a calibration); for an FP8 cache
    without scales hal uses 1.0 and logs one warning (an error under ``HAL_STRICT=1``).
    ``observer``: a :class:`hal.KVScaleObserver` fed every layer's new K/V before it is written.
    ``max_query_rows`` bounds the queries of one :func:`hal.paged_attention` call (long prefills are
    split so the kernel's per-call work stays near the causal minimum).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, *, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 scales: "hal.KVScales | None" = None, observer: "hal.KVScaleObserver | None" = None,
                 query_dtype: torch.dtype | None = None, max_query_rows: int = 128, pack: str | None = None):
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros_like(k) for k in self.key_caches]
        self.allocator = BlockAllocator(num_blocks)
        self.observer, self.max_query_rows, self.pack = observer, max_query_rows, pack
        self.query_dtype = query_dtype
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0
        self.plan: StepPlan | None = None
        self.num_heads: int | None = None  # query heads, known after the first attend()
        self._scales = self._layer_scales(scales)

    @classmethod
    def for_model(cls, config, *, max_tokens: int, block_size: int = 16, max_seqs: int = 1, **kw):
        """Sized for ``max_tokens`` tokens in all, spread over up to ``max_seqs`` sequences (each
        may waste part of its last block). ``config``: a transformers config (text part used)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        num_blocks = math.ceil(max_tokens / block_size) + max_seqs
        return cls(text.num_hidden_layers, kv_heads, head_size, num_blocks=num_blocks,
                   block_size=block_size, **kw)

    def _layer_scales(self, scales):
        if not is_fp8(self.dtype):
            if scales is not None:
                log.info("hal: KV scales ignored: the cache is %s, not FP8", str(self.dtype).removeprefix("torch."))
            return [(None, None)] * self.num_layers
        if scales is None:
            log.warning("hal: FP8 KV cache (%s) without scales: hal uses 1.0 for every layer; pass scales "
                        "from hal.load_kv_scales or a KVScaleObserver calibration",
                        str(self.dtype).removeprefix("torch."))
            return [(None, None)] * self.num_layers
        if len(scales) != self.num_layers:
            raise hal.KVScaleError(f"{scales.source}: {len(scales)} layers of scales for a model with "
                                   f"{self.num_layers} layers")
        return [scales.for_cache(i, self.key_caches[i]) for i in range(self.num_layers)]

    def served_by(self, layer: int = 0) -> str:
        """The pack :func:`hal.paged_attention` runs for this cache (a one-token decode call)."""
        qdt = self.query_dtype or torch.float32
        q = torch.zeros((1, self.num_heads or self.num_kv_heads, self.head_size), dtype=qdt, device=self.device)
        one = torch.ones((1, 1), dtype=torch.int32, device=self.device)
        ks, vs = self._scales[layer]
        d = hal.explain(q, self.key_caches[layer], self.value_caches[layer], one * 0, one[0], k_scale=ks,
                        v_scale=vs, pack=self.pack)
        return d.pack.NAME if d.pack is not None else "none"

    # -- sequences -------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        sid, self._next_id = self._next_id, self._next_id + 1
        self._blocks[sid], self._lens[sid] = [], 0
        return sid

    def free_sequence(self, sid: int) -> None:
        self.allocator.free(self._blocks.pop(sid))
        del self._lens[sid]

    def seq_len(self, sid: int) -> int:
        return self._lens[sid]

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    # -- one step --------------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], counts: list[int]) -> StepPlan:
        """Reserve blocks for ``counts[i]`` new tokens of sequence ``seq_ids[i]`` and plan the step."""
        if len(seq_ids) != len(counts) or not seq_ids:
            raise ValueError("begin_step: one count per sequence, at least one sequence")
        bs, q = self.block_size, max(counts)
        for sid, c in zip(seq_ids, counts):
            need = math.ceil((self._lens[sid] + c) / bs) - len(self._blocks[sid])
            if need > 0:
                self._blocks[sid] += self.allocator.allocate(need)
        past = torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int64)
        cnt = torch.tensor(counts, dtype=torch.int64)
        width = max(len(self._blocks[s]) for s in seq_ids)
        table = torch.zeros((len(seq_ids), width), dtype=torch.int32)  # entries past a sequence's end unused
        for i, s in enumerate(seq_ids):
            table[i, :len(self._blocks[s])] = torch.tensor(self._blocks[s], dtype=torch.int32)
        offs = torch.arange(q, dtype=torch.int64)
        pos = past[:, None] + offs[None, :]                                  # [b, q]
        valid = offs[None, :] < cnt[:, None]
        blk = torch.gather(table.to(torch.int64), 1, (pos // bs).clamp_max(width - 1))
        slots = torch.where(valid, blk * bs + pos % bs, -1).reshape(-1)
        lens = torch.where(valid, pos + 1, 0).reshape(-1).to(torch.int32)
        rows = table.repeat_interleave(q, dim=0)
        groups = []
        for r0 in range(0, rows.shape[0], self.max_query_rows):
            r1 = min(r0 + self.max_query_rows, rows.shape[0])
            groups.append((r0, r1, max(1, int(lens[r0:r1].max()))))
        dev = self.device
        self.plan = StepPlan(list(seq_ids), list(counts), slots.to(dev), rows.to(dev), lens.to(dev),
                             torch.where(valid, pos, past[:, None] + cnt[:, None] - 1).clamp_min(0).to(dev),
                             groups, None if bool(valid.all()) else valid.reshape(-1).to(dev))
        for s, c in zip(seq_ids, counts):
            self._lens[s] += c
        return self.plan

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
               scale: float | None = None, sliding_window: int | None = None,
               logits_soft_cap: float | None = None) -> torch.Tensor:
        """One layer of the current step: write ``key``/``value`` ``[batch, kv_heads, new, d]`` into
        the pages, then decode attention for every query row. ``query`` ``[batch, heads, new, d]``;
        returns ``[batch, new, heads, d]`` in the query's dtype (transformers' attention layout)."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("PagedKVCache.attend: no step planned (call begin_step first)")
        b, h, q, d = query.shape
        rows = b * q
        self.num_heads = h
        k = key.transpose(1, 2).reshape(rows, self.num_kv_heads, d)
        v = value.transpose(1, 2).reshape(rows, self.num_kv_heads, d)
        kc, vc = self.key_caches[layer], self.value_caches[layer]
        ks, vs = self._scales[layer]
        if self.observer is not None:
            sel = plan.valid
            self.observer.observe(layer, k if sel is None else k[sel], v if sel is None else v[sel])
        hal.cache_kv(k, v, kc, vc, plan.slot_mapping, k_scale=ks, v_scale=vs, pack=self.pack)
        qdt = self.query_dtype or query.dtype
        qr = query.transpose(1, 2).reshape(rows, h, d).to(qdt).contiguous()
        out = torch.empty_like(qr)
        for r0, r1, max_len in plan.groups:
            hal.paged_attention(qr[r0:r1], kc, vc, plan.block_tables[r0:r1], plan.seq_lens[r0:r1],
                                scale=scale, k_scale=ks, v_scale=vs, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap, max_seq_len=max_len, out=out[r0:r1],
                                pack=self.pack)
        return out.view(b, q, h, d).to(query.dtype)
