"""A paged KV cache for a whole model, served by hal: blocks, block tables and per-step plans.

Why a cache object of its own rather than a ``transformers.Cache``: a transformers cache hands dense
K/V back to the attention function (``cache.update`` returns the keys to attend to), which is exactly
what a paged FP8 cache must not do. Here K/V go into hal's pages with :func:`hal.cache_kv` and never
come back out; attention reads them through :func:`hal.paged_attention`. The object is independent
of transformers (an engine can drive it directly); :mod:`hal.integrations.transformers` plugs it into
a model's attention layers.

One forward pass is one *step*: :meth:`PagedKVCache.begin_step` says which sequences get how many new
tokens, allocates their blocks, and builds the step's plan (slots, block tables, lengths, row
offsets) once; every layer then calls :meth:`PagedKVCache.attend`, which writes the layer's new K/V
with one :func:`hal.cache_kv` and runs attention with one :func:`hal.paged_attention`:

- a step of one new token per sequence (decoding) is a decode call (one query row per sequence);
- any other step (prompt chunks, or a mix of sequences in their prompt and sequences decoding) is
  one multi-token call: the sequences' real rows packed back to back, ``query_start_loc`` their
  offsets, ``seq_lens`` each context including the step's tokens (already written), so row ``t`` of
  a sequence's ``n`` new tokens sits at position ``seq_len - n + t`` (bottom-right causal).

The multi-token form is used where the pack serving the cache takes it natively. Where it would be a
fallback (on a GPU whose native pack serves the decode form only, the multi-token call would go to
``emu``), each new token runs as its own decode row instead (its length its position + 1, its
sequence's block table), in groups of ``max_query_rows`` rows: the same causal attention, computed by
the decode kernel. ``multi_token=True``/``False`` forces one form.

A *planned* step (``begin_step(..., planned=True)``; :meth:`HalRunner.generate` plans every step)
makes each of those calls a :func:`hal.plan` once per step, on the first layer, and runs it for
every layer (``Plan.run``: no validation, dispatch or planning per layer); layers whose calls differ
(a sliding window on some layers, another scale) get a plan each. A step over a
:class:`StaticStep` (``begin_step(..., static=...)``: one new token per sequence) writes its
geometry into fixed device buffers and keeps its plans across steps (``max_seq_len`` the buffers'
capacity), so a CUDA graph captured over one such step replays any later one of the same batch size.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

import hal
from hal.fp8 import is_fp8
from hal.integrations.sequences import BlockAllocator, CacheFullError, SequenceTable

__all__ = ["BlockAllocator", "CacheFullError", "PagedKVCache", "StaticStep", "StepPlan"]

log = logging.getLogger("hal")


@dataclasses.dataclass
class StepPlan:
    """What every layer needs for one forward step (built once per step).

    The model sees the step's tokens as ``[batch, q]`` (``q`` the largest count, right-padded); its
    rows flattened row-major are the *padded rows*. A padded row past its sequence's count is
    padding: slot -1 (hal writes nothing) and no query row in the attention call.
    """

    seq_ids: list[int]
    counts: list[int]                 # new tokens per sequence
    slot_mapping: torch.Tensor        # [batch * q] int64 (-1 for padding)
    position_ids: torch.Tensor        # [batch, q] int64
    block_tables: torch.Tensor        # [batch, max_blocks] int32
    seq_lens: torch.Tensor            # [batch] int32: each context after the step (past + count)
    query_start_loc: torch.Tensor     # [batch + 1] int32: offsets of each sequence's real rows
    max_query_len: int                # host ints: the largest count and context of the step
    max_seq_len: int
    rows: torch.Tensor | None         # [total_q] int64: the real rows among the padded ones; None: all
    decode: bool                      # one new token per sequence: the decode form
    past: torch.Tensor                # [batch] int64 on the host: context before the step
    _per_token: tuple | None = None   # the per-token decode rows, built on first use
    planned: bool = False             # the layers run hal plans made once per step (hal.plan), not one-shot calls
    plans: dict = dataclasses.field(default_factory=dict)  # those plans, by what defines each

    def per_token(self, max_query_rows: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
        """The step as decode rows, one per padded row: ``(block_tables [rows, max_blocks],
        seq_lens [rows] (position + 1, 0 for padding), groups)``, ``groups`` the ``(row0, row1,
        max_seq_len)`` of each decode call of at most ``max_query_rows`` rows."""
        if self._per_token is None:
            q = self.position_ids.shape[1]
            cnt = torch.tensor(self.counts, dtype=torch.int64)
            offs = torch.arange(q, dtype=torch.int64)
            lens = torch.where(offs[None, :] < cnt[:, None], self.past[:, None] + offs[None, :] + 1, 0)
            lens = lens.reshape(-1).to(torch.int32)
            groups = []
            for r0 in range(0, lens.shape[0], max_query_rows):
                r1 = min(r0 + max_query_rows, lens.shape[0])
                groups.append((r0, r1, max(1, int(lens[r0:r1].max()))))
            dev = self.block_tables.device
            self._per_token = (self.block_tables.repeat_interleave(q, dim=0), lens.to(dev), groups)
        return self._per_token


class StaticStep:
    """Fixed device buffers for decode steps of ``batch`` sequences (one new token each) whose block
    tables fit ``width`` blocks: what a CUDA graph of the step reads. ``begin_step(..., static=this)``
    writes each step's token positions, slots, block tables and lengths into them (two host-to-device
    copies, stream-ordered after the previous replay); the caller writes the token ids into
    :attr:`ids`. The step's hal plans live here, made once with ``max_seq_len = width * block_size``.
    """

    def __init__(self, batch: int, width: int, block_size: int, device):
        self.batch, self.width, self.block_size = batch, width, block_size
        self.device = torch.device(device)
        self._i64 = torch.zeros(3 * batch, dtype=torch.int64, device=self.device)
        self._i32 = torch.zeros(batch * (width + 1) + batch + 1, dtype=torch.int32, device=self.device)
        self.ids = self._i64[:batch].view(batch, 1)                    # [batch, 1] the new tokens
        self.position_ids = self._i64[batch:2 * batch].view(batch, 1)
        self.slot_mapping = self._i64[2 * batch:]
        self.block_tables = self._i32[:batch * width].view(batch, width)
        self.seq_lens = self._i32[batch * width:batch * (width + 1)]
        self.query_start_loc = self._i32[batch * (width + 1):]
        self.query_start_loc.copy_(torch.arange(batch + 1, dtype=torch.int32))
        self.plans: dict = {}

    @property
    def max_seq_len(self) -> int:
        return self.width * self.block_size

    def write(self, past: torch.Tensor, blocks: list[list[int]]) -> None:
        """One step's geometry (host values) into the buffers."""
        bs, w = self.block_size, self.width
        table = torch.zeros((self.batch, w), dtype=torch.int32)
        for i, b in enumerate(blocks):
            if len(b) > w:
                raise ValueError(f"StaticStep: sequence {i} holds {len(b)} blocks; the buffers take {w}")
            table[i, :len(b)] = torch.tensor(b, dtype=torch.int32)
        slots = table.to(torch.int64).gather(1, (past // bs)[:, None])[:, 0] * bs + past % bs
        i32 = torch.cat([table.reshape(-1), (past + 1).to(torch.int32)])
        self._i64[self.batch:].copy_(torch.cat([past, slots]))
        self._i32[:i32.numel()].copy_(i32)


class PagedKVCache:
    """K/V pages for every layer of a model, a block allocator and the sequences living in it.

    ``dtype`` is the cache encoding (bf16/fp16/fp32 or a torch float8 dtype). ``scales``: a
    :class:`hal.KVScales` (from :func:`hal.load_kv_scales` or a calibration); for an FP8 cache
    without scales hal uses 1.0 and logs one warning (an error under ``HAL_STRICT=1``).
    ``observer``: a :class:`hal.KVScaleObserver` fed every layer's new K/V before it is written.
    ``multi_token``: None (default) runs steps with several new tokens per sequence as one
    multi-token :func:`hal.paged_attention` call wherever the pack serving the cache takes it
    natively, else as decode rows; True / False force one form. ``max_query_rows`` bounds the rows
    of one decode call in the per-token form.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, *, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 scales: "hal.KVScales | None" = None, observer: "hal.KVScaleObserver | None" = None,
                 query_dtype: torch.dtype | None = None, max_query_rows: int = 128, pack: str | None = None,
                 multi_token: bool | None = None):
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros_like(k) for k in self.key_caches]
        self.sequences = SequenceTable(num_blocks, block_size)
        self.observer, self.max_query_rows, self.pack = observer, max_query_rows, pack
        self.query_dtype = query_dtype
        self.plan: StepPlan | None = None
        self.num_heads: int | None = None  # query heads, known after the first attend()
        self.multi_token = multi_token
        self._forms: dict[tuple, bool] = {}   # the automatic choice per (query dtype, heads, features)
        self.attended: list[int] = []         # the layers attend() ran for in the current step
        self._scales = self._layer_scales(scales)

    @classmethod
    def for_model(cls, config, *, max_tokens: int, block_size: int = 16, max_seqs: int = 1, **kw):
        """Sized for ``max_tokens`` tokens in all, spread over up to ``max_seqs`` sequences (each
        may waste part of its last block). ``config``: a transformers config (text part used)."""
        layers, _, kv_heads, head_size = cls.geometry(config)
        num_blocks = math.ceil(max_tokens / block_size) + max_seqs
        return cls(layers, kv_heads, head_size, num_blocks=num_blocks, block_size=block_size, **kw)

    @staticmethod
    def geometry(config) -> tuple[int, int, int, int]:
        """``(layers, query heads, KV heads, head size)`` of a transformers config (its text part).
        A config whose layers differ in them (transformers' per-layer configs) raises ValueError."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config

        def get(name):
            try:
                return getattr(text, name, None)
            except RuntimeError:   # a per-layer attribute of a heterogeneous config: one value, or refuse
                values = {getattr(layer, name, None) for layer in text.per_layer_config}
                if len(values) != 1:
                    raise ValueError(f"its layers differ in {name} ({', '.join(map(str, sorted(values, key=str)))}; "
                                     f"the cache has one geometry)") from None
                return values.pop()

        heads = get("num_attention_heads")
        head_size = get("head_dim") or get("hidden_size") // heads
        kv_heads = get("num_key_value_heads") or heads
        return get("num_hidden_layers"), heads, kv_heads, head_size

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

    def _probe_call(self, layer: int, rows: int, heads: int | None = None, dtype: torch.dtype | None = None,
                    **features) -> hal.dispatch.Decision:
        """The dispatch decision for a call of ``rows`` new tokens of one sequence on this cache
        (``rows == 1``: the decode form; more: the multi-token form)."""
        qdt = dtype or self.query_dtype or torch.float32
        h = heads or self.num_heads or self.num_kv_heads
        dev = self.device
        q = torch.zeros((rows, h, self.head_size), dtype=qdt, device=dev)
        table = torch.zeros((1, math.ceil(rows / self.block_size)), dtype=torch.int32, device=dev)
        lens = torch.full((1,), rows, dtype=torch.int32, device=dev)
        multi = {} if rows == 1 else {"query_start_loc": torch.tensor([0, rows], dtype=torch.int32, device=dev),
                                      "max_query_len": rows}
        ks, vs = self._scales[layer]
        return hal.explain(q, self.key_caches[layer], self.value_caches[layer], table, lens, k_scale=ks,
                           v_scale=vs, pack=self.pack, **multi, **features)

    def served_by(self, layer: int = 0, *, prompt: bool = False) -> str:
        """The pack :func:`hal.paged_attention` runs for this cache: for a decode step, or with
        ``prompt`` for a step of several tokens per sequence (the multi-token call, or the decode
        pack where the per-token form is used)."""
        if prompt and self._multi_token_form(layer, self.query_dtype or torch.float32, self.num_heads
                                             or self.num_kv_heads, None, None):
            d = self._probe_call(layer, 2)
        else:
            d = self._probe_call(layer, 1)
        return d.pack.NAME if d.pack is not None else "none"

    def _multi_token_form(self, layer: int, dtype: torch.dtype, heads: int, sliding_window, logits_soft_cap) -> bool:
        """Whether a step with several tokens per sequence is one multi-token call (else decode rows):
        forced by ``multi_token``, else yes unless that call would fall back to ``emu`` on a GPU
        (or find no pack) while the decode form is served natively."""
        if self.multi_token is not None:
            return self.multi_token
        feats = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
        key = (dtype, heads, sliding_window is not None, logits_soft_cap is not None)
        if key not in self._forms:
            multi = self._probe_call(layer, 2, heads, dtype, **feats)
            one = self._probe_call(layer, 1, heads, dtype, **feats)
            native_multi = multi.pack is not None and not multi.fallback
            native_one = one.pack is not None and not one.fallback
            self._forms[key] = native_multi or not native_one
            if not self._forms[key]:
                why = "; ".join(multi.fallback_reasons()) if multi.pack is not None else "no pack serves it"
                log.info("hal: prompt tokens run as decode rows on pack %s: the multi-token call would %s (%s)",
                         one.pack.NAME, "fall back to emu" if multi.pack is not None else "fail", why)
        return self._forms[key]

    # -- sequences -------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        return self.sequences.add()

    def free_sequence(self, sid: int) -> None:
        self.sequences.free(sid)

    def seq_len(self, sid: int) -> int:
        return self.sequences.seq_len(sid)

    def block_ids(self, sid: int) -> list[int]:
        return self.sequences.block_ids(sid)

    @property
    def num_free_blocks(self) -> int:
        return self.sequences.num_free_blocks

    # -- one step --------------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], counts: list[int], *, planned: bool = False,
                   static: StaticStep | None = None) -> StepPlan:
        """Reserve blocks for ``counts[i]`` new tokens of sequence ``seq_ids[i]`` and plan the step.
        ``planned``: every layer runs the step's hal plans (see the module docstring). ``static``:
        a decode step (every count 1, ``static.batch`` sequences) over those fixed buffers (planned)."""
        q = max(counts) if counts else 0
        if static is not None and (q != 1 or min(counts) != 1 or len(seq_ids) != static.batch
                                   or static.block_size != self.block_size or static.device != self.device):
            raise ValueError(f"begin_step: a static step is a decode step of {static.batch} sequences (one new "
                             f"token each, block size {static.block_size} on {static.device}); got counts {counts}")
        past = self.sequences.reserve(seq_ids, counts)
        if static is not None:
            static.write(past, self.sequences.blocks_of(seq_ids))
            self.plan = StepPlan(list(seq_ids), list(counts), static.slot_mapping, static.position_ids,
                                 static.block_tables, static.seq_lens, static.query_start_loc, 1, static.max_seq_len,
                                 None, True, past, planned=True, plans=static.plans)
            self.attended = []
            self.sequences.advance(seq_ids, counts)
            return self.plan
        g = self.sequences.geometry(seq_ids, counts, past)
        dev = self.device
        self.plan = StepPlan(
            list(seq_ids), list(counts), g.slots.to(dev), g.positions.to(dev), g.block_tables.to(dev),
            g.seq_lens.to(torch.int32).to(dev), g.query_start_loc.to(dev), g.max_new, max(1, int(g.seq_lens.max())),
            g.valid.reshape(-1).nonzero().reshape(-1).to(dev) if g.padded else None, g.max_new == 1 and not g.padded,
            past, planned=planned)
        self.attended = []
        self.sequences.advance(seq_ids, counts)
        return self.plan

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
               scale: float | None = None, sliding_window: int | None = None,
               logits_soft_cap: float | None = None) -> torch.Tensor:
        """One layer of the current step: write ``key``/``value`` ``[batch, kv_heads, new, d]`` into
        the pages, then attention for every new token (one :func:`hal.paged_attention` call, see the
        module's docstring). ``query`` ``[batch, heads, new, d]``; returns ``[batch, new, heads, d]``
        in the query's dtype (transformers' attention layout); padding rows hold zeros."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("PagedKVCache.attend: no step planned (call begin_step first)")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"PagedKVCache.attend: layer {layer} of a cache for {self.num_layers} layers")
        b, h, q, d = query.shape
        if key.shape[1] != self.num_kv_heads or key.shape[-1] != self.head_size or d != self.head_size \
                or value.shape != key.shape:
            raise ValueError(f"PagedKVCache.attend: layer {layer} has {key.shape[1]} KV heads of size "
                             f"{key.shape[-1]} (values {tuple(value.shape[1::2])}, queries of size {d}); the cache "
                             f"holds {self.num_kv_heads} of size {self.head_size} in every layer")
        if (b, q) != tuple(plan.position_ids.shape):
            raise ValueError(f"PagedKVCache.attend: layer {layer} got [batch, new] = {[b, q]}; the step "
                             f"planned {list(plan.position_ids.shape)}")
        self.attended.append(layer)
        rows = b * q
        self.num_heads = h
        k = key.transpose(1, 2).reshape(rows, self.num_kv_heads, d)
        v = value.transpose(1, 2).reshape(rows, self.num_kv_heads, d)
        kc, vc = self.key_caches[layer], self.value_caches[layer]
        ks, vs = self._scales[layer]
        if self.observer is not None:
            sel = plan.rows
            self.observer.observe(layer, k if sel is None else k[sel], v if sel is None else v[sel])
        scales = {"k_scale": ks, "v_scale": vs}
        if plan.planned:
            self._run(plan, ("cache_kv", k.dtype, _kind(ks), _kind(vs)), "cache_kv", (k, v, kc, vc),
                      (plan.slot_mapping,), scales, {"pack": self.pack})
        else:
            hal.cache_kv(k, v, kc, vc, plan.slot_mapping, k_scale=ks, v_scale=vs, pack=self.pack)
        qdt = self.query_dtype or query.dtype
        qr = query.transpose(1, 2).reshape(rows, h, d).to(qdt)
        kw = {"scale": scale, "k_scale": ks, "v_scale": vs, "sliding_window": sliding_window,
              "logits_soft_cap": logits_soft_cap, "pack": self.pack}
        what = ("paged_attention", qdt, h, scale, sliding_window, logits_soft_cap, _kind(ks), _kind(vs))
        if plan.decode:
            geometry = (plan.block_tables, plan.seq_lens)
            if plan.planned:
                out = self._run(plan, what, "paged_attention", (qr.contiguous(), kc, vc), geometry, scales,
                                {**kw, "max_seq_len": plan.max_seq_len})
            else:
                out = hal.paged_attention(qr.contiguous(), kc, vc, *geometry, max_seq_len=plan.max_seq_len, **kw)
        elif self._multi_token_form(layer, qdt, h, sliding_window, logits_soft_cap):
            sel = qr if plan.rows is None else qr[plan.rows]
            multi = {"query_start_loc": plan.query_start_loc, "max_query_len": plan.max_query_len,
                     "max_seq_len": plan.max_seq_len}
            if plan.planned:
                got = self._run(plan, what, "paged_attention", (sel.contiguous(), kc, vc),
                                (plan.block_tables, plan.seq_lens), scales, {**kw, **multi})
            else:
                got = hal.paged_attention(sel.contiguous(), kc, vc, plan.block_tables, plan.seq_lens, **multi, **kw)
            if plan.rows is None:
                out = got
            else:
                out = torch.zeros_like(qr)
                out[plan.rows] = got
        else:
            tables, lens, groups = plan.per_token(self.max_query_rows)
            qr = qr.contiguous()
            out = torch.empty_like(qr)
            for g, (r0, r1, max_len) in enumerate(groups):
                if plan.planned:
                    self._run(plan, (*what, "rows", g), "paged_attention", (qr[r0:r1], kc, vc),
                              (tables[r0:r1], lens[r0:r1]), {**scales, "out": out[r0:r1]},
                              {**kw, "max_seq_len": max_len})
                else:
                    hal.paged_attention(qr[r0:r1], kc, vc, tables[r0:r1], lens[r0:r1], max_seq_len=max_len,
                                        out=out[r0:r1], **kw)
        return out.view(b, q, h, d).to(query.dtype)

    @staticmethod
    def _run(plan: StepPlan, what: tuple, op: str, tensors: tuple, geometry: tuple, layer_kw: dict, kw: dict):
        """One layer's call of ``op`` in a planned step: the step's :func:`hal.plan` for ``what`` (made
        from this layer's arguments on first use), run with this layer's ``tensors`` and ``layer_kw``
        (scales, ``out``); ``geometry`` and ``kw`` are the step's, the same for every layer."""
        p = plan.plans.get(what)
        if p is None:
            p = plan.plans[what] = hal.plan(op, *tensors, *geometry, **{**kw, **layer_kw})
        return p.run(*tensors, **layer_kw)

    def end_step(self) -> None:
        """Check that every layer ran attention exactly once in the step (a model whose layers
        bypass :meth:`attend` would leave their pages empty): raises ValueError naming the layers."""
        seen = sorted(self.attended)
        if seen != list(range(self.num_layers)):
            missing = sorted(set(range(self.num_layers)) - set(seen))
            twice = sorted({x for x in seen if seen.count(x) > 1})
            parts = ([f"layers {_span(missing)} did not run hal's attention"] if missing else []) + \
                    ([f"layers {_span(twice)} ran it more than once"] if twice else [])
            raise ValueError(f"PagedKVCache: in a step over a cache of {self.num_layers} layers, " + " and ".join(parts))


def _kind(scale) -> object:
    """What a plan fixes about a scale: None, a float, or a tensor of some dims."""
    if scale is None:
        return None
    return ("tensor", scale.dim()) if isinstance(scale, torch.Tensor) else float


def _span(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:8])) + (f" (and {len(xs) - 8} more)" if len(xs) > 8 else "")
