"""hal's MLA ops inside a transformers DeepSeek-V3 model: every step writes the layer's latent with
:func:`hal.cache_mla` into a paged latent cache and attends with :func:`hal.mla_decode` in DeepSeek's
absorbed form; no per-head K/V is ever built.

Why the attention module's forward is replaced rather than an ``AttentionInterface`` function
registered (as :mod:`hal.integrations.transformers` does for Llama-style models): transformers'
``DeepseekV3Attention`` expands the latent into per-head keys and values (``kv_b_proj``) *before* it
calls the attention function, so that function only ever sees what an MLA cache exists not to store.
Inside :func:`using_mla` each attention module runs :func:`mla_attention` instead, which stops at the
latent. Per layer and step, with ``H`` heads, ``R = kv_lora_rank``, ``P = qk_rope_head_dim``:

- latent ``c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:R])`` [tokens, R] and rotary key ``k_pe``
  [tokens, P] (RoPE'd as the model does it, interleaved or not) -> one :func:`hal.cache_mla`;
- ``kv_b_proj.weight`` viewed ``[H, qk_nope + v_head, R]`` is ``W_UK`` (first ``qk_nope`` rows per
  head) and ``W_UV`` (the rest): ``k_nope_j = W_UK c_j`` and ``v_j = W_UV c_j``, so the query is
  absorbed, ``q_abs = q_nope W_UK`` [tokens, H, R] (``q_abs . c_j == q_nope . k_nope_j``);
- :func:`hal.mla_decode` with the module's ``scaling`` (``qk_head_dim ** -0.5`` times yarn's
  ``mscale ** 2``, as the model computes it) returns ``softmax(s) @ c`` [tokens, H, R]; per head
  ``@ W_UV^T`` gives the values' mix [tokens, H, v_head], then ``o_proj``.

Each layer owns one allocation ``[num_blocks, block_size, R*e + P*e']`` bytes, viewed as the latent
cache (the cache dtype, e.g. bf16 or e4m3fn) and the rotary cache (bf16 by default, never scaled):
both views are strided, vLLM's combined layout. Steps are planned as in
:class:`~hal.integrations.paged_cache.PagedKVCache` (``[batch, q]`` right-padded tokens, slot -1 for
padding, bottom-right causal rows): a step of one token per sequence is a decode call; a prompt chunk
(or a mixed step) is one call with ``query_start_loc``, causal. The emu pack serves each such row as a
decode row over its prefix, which is right for prompts of tens to hundreds of tokens, not for long
prompts (there a real server runs the unabsorbed form).

FP8 latent scales are chosen as hal chooses KV scales: :func:`calibrate_mla` runs the model over a
bf16 cache with a :class:`hal.KVScaleObserver` (one "KV head") fed each layer's latent as its "key"
and rotary part as its "value"; ``observer.scales(torch.float8_e4m3fn)`` gives ``absmax * margin /
fmt_max`` per layer, the latent's scale as ``k``, the rotary part's as ``v`` (used only for an FP8
rotary cache). Scope: ``DeepseekV3Attention`` (with or without q_lora, yarn or plain RoPE); models
whose attention is a copy under another class name are refused rather than guessed at.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math

import torch

import hal
from hal.fp8 import is_fp8
from hal.integrations.sequences import SequenceTable

__all__ = ["MLARunner", "MLAStepPlan", "PagedMLACache", "calibrate_mla", "mla_attention", "mla_modules",
           "using_mla"]

log = logging.getLogger("hal")


@dataclasses.dataclass
class MLAStepPlan:
    """One forward step of ``[batch, q]`` tokens (row ``i`` has ``counts[i]`` real ones), for every layer."""
    seq_ids: list[int]
    counts: list[int]
    slot_mapping: torch.Tensor     # int64 [batch * q]; -1 for padding
    position_ids: torch.Tensor     # [batch, q]
    block_tables: torch.Tensor     # int32 [batch, width]
    seq_lens: torch.Tensor         # int32 [batch], the context including this step's tokens
    query_start_loc: torch.Tensor  # int32 [batch + 1], the real rows' offsets
    max_query_len: int
    max_seq_len: int
    rows: torch.Tensor | None      # indices of the real rows among batch * q (None: all are real)
    decode: bool                   # one token per sequence: the decode form of hal.mla_decode


class PagedMLACache:
    """Per layer a paged latent cache ``ckv_caches[l]`` [num_blocks, block_size, R] (``dtype``) and
    rotary cache ``kpe_caches[l]`` [num_blocks, block_size, P] (``rope_dtype``), views into one
    allocation; blocks and sequences in a :class:`~hal.integrations.sequences.SequenceTable`, as in ``PagedKVCache``.

    ``scales``: :class:`hal.KVScales` (``k``: the latent's scale per layer, ``v``: the rotary
    part's), e.g. ``calibrate_mla(...).scales(dtype)``; used for FP8 parts only. ``observer``: a
    :class:`hal.KVScaleObserver` fed every layer's latent and rotary part (real rows only)."""

    def __init__(self, num_layers: int, kv_lora_rank: int, rope_dim: int, *, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.bfloat16, rope_dtype: torch.dtype = torch.bfloat16, device="cpu",
                 scales: hal.KVScales | None = None, observer: hal.KVScaleObserver | None = None,
                 query_dtype: torch.dtype | None = None, pack: str | None = None):
        self.num_layers, self.kv_lora_rank, self.rope_dim = num_layers, kv_lora_rank, rope_dim
        self.block_size, self.dtype, self.rope_dtype = block_size, dtype, rope_dtype
        self.device, self.observer, self.query_dtype, self.pack = torch.device(device), observer, query_dtype, pack
        split = kv_lora_rank * dtype.itemsize
        width = split + rope_dim * rope_dtype.itemsize
        self.buffers = [torch.zeros((num_blocks, block_size, width), dtype=torch.uint8, device=self.device)
                        for _ in range(num_layers)]
        self.ckv_caches = [b[..., :split].view(dtype) for b in self.buffers]
        self.kpe_caches = [b[..., split:].view(rope_dtype) for b in self.buffers]
        self.sequences = SequenceTable(num_blocks, block_size)
        self.plan: MLAStepPlan | None = None
        self.attended: list[int] = []
        self._scales = [(self._scale(scales, dtype, layer, 0), self._scale(scales, rope_dtype, layer, 1))
                        for layer in range(num_layers)]

    @classmethod
    def for_model(cls, config, *, max_tokens: int, max_seqs: int = 1, block_size: int = 16, **kw):
        """Sized for ``max_tokens`` tokens in all over up to ``max_seqs`` sequences."""
        num_blocks = math.ceil(max_tokens / block_size) + max_seqs
        return cls(config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim, num_blocks=num_blocks,
                   block_size=block_size, **kw)

    def _scale(self, scales, dtype, layer: int, role: int):
        if not is_fp8(dtype):
            return None
        if scales is None:
            if layer == 0 and role == 0:
                log.warning("hal: FP8 MLA cache (%s) without scales: hal uses 1.0 for every layer; pass "
                            "calibrate_mla(...).scales(dtype)", str(dtype).removeprefix("torch."))
            return None
        if len(scales) != self.num_layers:
            raise hal.KVScaleError(f"{scales.source}: {len(scales)} layers of scales for a model with "
                                   f"{self.num_layers} layers")
        return scales.for_encoding(dtype)[layer][role]

    def scales(self, layer: int) -> tuple:
        """``(ckv_scale, kpe_scale)`` of a layer as passed to hal (None: 1.0 / a 16-bit part)."""
        return self._scales[layer]

    # -- sequences ---------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        return self.sequences.add()

    def free_sequence(self, sid: int) -> None:
        self.sequences.free(sid)

    def seq_len(self, sid: int) -> int:
        return self.sequences.seq_len(sid)

    def block_ids(self, sid: int) -> list[int]:
        """The blocks holding sequence ``sid``'s tokens, in order."""
        return self.sequences.block_ids(sid)

    # -- one step ----------------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], counts: list[int]) -> MLAStepPlan:
        """Reserve blocks for ``counts[i]`` new tokens of sequence ``seq_ids[i]`` and plan the step."""
        past = self.sequences.reserve(seq_ids, counts)
        g = self.sequences.geometry(seq_ids, counts, past)
        dev = self.device
        self.plan = MLAStepPlan(
            list(seq_ids), list(counts), g.slots.to(dev), g.positions.to(dev), g.block_tables.to(dev),
            g.seq_lens.to(torch.int32).to(dev), g.query_start_loc.to(dev), g.max_new, max(1, int(g.seq_lens.max())),
            g.valid.reshape(-1).nonzero().reshape(-1).to(dev) if g.padded else None, g.max_new == 1 and not g.padded)
        self.attended = []
        self.sequences.advance(seq_ids, counts)
        return self.plan

    def attend(self, layer: int, q_abs: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               *, scale: float) -> torch.Tensor:
        """One layer of the current step: write ``kv_c`` [b, q, R] and ``k_pe`` [b, q, P] (post-RoPE)
        with :func:`hal.cache_mla`, then one :func:`hal.mla_decode` for the absorbed query ``q_abs``
        [b, q, H, R] and ``q_pe`` [b, q, H, P]. Returns ``softmax(s) @ c`` [b, q, H, R] in the query's
        dtype; padding rows hold zeros."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("PagedMLACache.attend: no step planned (call begin_step first)")
        b, q, h, r = q_abs.shape
        if r != self.kv_lora_rank or k_pe.shape[-1] != self.rope_dim or (b, q) != tuple(plan.position_ids.shape):
            raise ValueError(f"PagedMLACache.attend: layer {layer} got a latent of {r}, a rotary part of "
                             f"{k_pe.shape[-1]} and [batch, new] = {[b, q]}; the cache holds {self.kv_lora_rank} + "
                             f"{self.rope_dim} and the step planned {list(plan.position_ids.shape)}")
        self.attended.append(layer)
        rows = b * q
        ckv, kpe = self.ckv_caches[layer], self.kpe_caches[layer]
        cs, ps = self._scales[layer]
        latent, rope = kv_c.reshape(rows, r), k_pe.reshape(rows, self.rope_dim).to(kv_c.dtype)
        if self.observer is not None:
            sel = slice(None) if plan.rows is None else plan.rows
            self.observer.observe(layer, latent[sel, None], rope[sel, None])
        hal.cache_mla(latent, rope, ckv, kpe, plan.slot_mapping, ckv_scale=cs, kpe_scale=ps, pack=self.pack)
        qdt = self.query_dtype or q_abs.dtype
        qn, qp = q_abs.reshape(rows, h, r).to(qdt), q_pe.reshape(rows, h, self.rope_dim).to(qdt)
        kw = {"scale": scale, "ckv_scale": cs, "kpe_scale": ps, "max_seq_len": plan.max_seq_len, "pack": self.pack}
        if plan.decode:
            out = hal.mla_decode(qn.contiguous(), qp.contiguous(), ckv, kpe, plan.block_tables, plan.seq_lens, **kw)
        else:
            sel = slice(None) if plan.rows is None else plan.rows
            got = hal.mla_decode(qn[sel].contiguous(), qp[sel].contiguous(), ckv, kpe, plan.block_tables,
                                 plan.seq_lens, query_start_loc=plan.query_start_loc,
                                 max_query_len=plan.max_query_len, **kw)
            out = got if plan.rows is None else torch.zeros_like(qn).index_copy_(0, plan.rows, got)
        return out.view(b, q, h, r).to(q_abs.dtype)

    def end_step(self) -> None:
        """Every layer must have run :meth:`attend` exactly once in the step."""
        if sorted(self.attended) != list(range(self.num_layers)):
            raise ValueError(f"PagedMLACache: a step over {self.num_layers} layers ran hal MLA for layers "
                             f"{sorted(self.attended)}")


# --- the attention module's replacement -----------------------------------------------------------
def mla_modules(model) -> list:
    """The model's ``DeepseekV3Attention`` modules (ValueError naming what is found instead)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    found = [m for m in model.modules() if isinstance(m, DeepseekV3Attention)]
    if not found:
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        raise ValueError(f"hal MLA: {type(model).__name__} has no DeepseekV3Attention modules "
                         f"(attention modules: {', '.join(kinds) or 'none'})")
    return found


def mla_attention(module, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                  hal_mla_cache: PagedMLACache | None = None, **kwargs):
    """``DeepseekV3Attention.forward`` in absorbed form over ``hal_mla_cache`` (see the module's
    docstring); ``attention_mask`` is not needed (causality and padding are in the step's plan)."""
    if hal_mla_cache is None:
        raise ValueError("hal MLA attention needs the cache as a keyword of the model call "
                         "(model(..., hal_mla_cache=cache, use_cache=False)); MLARunner does this")
    if cache is not None:
        raise ValueError("hal MLA attention keeps the latent in hal's cache: call the model with use_cache=False")
    b, q, _ = hidden_states.shape
    h, r, p = module.num_heads, module.kv_lora_rank, module.qk_rope_head_dim
    dn, dv = module.qk_nope_head_dim, module.v_head_dim
    if module.q_lora_rank is None:
        qs = module.q_proj(hidden_states)
    else:
        qs = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q_nope, q_rot = qs.view(b, q, h, dn + p).transpose(1, 2).split([dn, p], dim=-1)   # [b, h, q, .]
    kv_c, k_rot = module.kv_a_proj_with_mqa(hidden_states).split([r, p], dim=-1)
    kv_c = module.kv_a_layernorm(kv_c)                                                  # [b, q, R]
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as code

    rope = code.apply_rotary_pos_emb_interleave if module.config.rope_interleave else code.apply_rotary_pos_emb
    cos, sin = position_embeddings                                                     # the model's own RoPE
    q_rot, k_rot = rope(q_rot, k_rot.view(b, 1, q, p), cos, sin)
    w = module.kv_b_proj.weight.view(h, dn + dv, r)                                    # W_UK | W_UV per head
    q_abs = torch.einsum("bhqd,hdr->bqhr", q_nope, w[:, :dn])
    mixed = hal_mla_cache.attend(module.layer_idx, q_abs, q_rot.transpose(1, 2), kv_c, k_rot[:, 0],
                                 scale=module.scaling)                                # [b, q, h, R]
    out = torch.einsum("bqhr,hdr->bqhd", mixed, w[:, dn:]).reshape(b, q, h * dv)
    return module.o_proj(out), None


@contextlib.contextmanager
def using_mla(model):
    """Inside the block, every ``DeepseekV3Attention`` of ``model`` runs :func:`mla_attention`."""
    mods = mla_modules(model)
    for m in mods:
        m.forward = functools.partial(mla_attention, m)
    try:
        yield model
    finally:
        for m in mods:
            del m.forward


# --- driving a model ------------------------------------------------------------------------------
class MLARunner:
    """Drives a DeepSeek-V3 causal LM over a :class:`PagedMLACache`: prompts of different lengths in
    one batch, greedy decoding, logits. ``cache_dtype``: the latent's encoding (bf16, or an FP8 dtype
    with ``scales`` from :func:`calibrate_mla`); ``rope_dtype``: the rotary part's (bf16)."""

    def __init__(self, model, *, cache_dtype: torch.dtype = torch.bfloat16, rope_dtype: torch.dtype = torch.bfloat16,
                 scales=None, block_size: int = 16, prefill_chunk: int = 256, query_dtype: torch.dtype | None = None,
                 pack: str | None = None):
        mla_modules(model)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.cache_dtype, self.rope_dtype, self.scales = cache_dtype, rope_dtype, scales
        self.block_size, self.prefill_chunk, self.query_dtype, self.pack = block_size, prefill_chunk, query_dtype, pack

    def new_cache(self, max_tokens: int, max_seqs: int = 1, observer=None) -> PagedMLACache:
        return PagedMLACache.for_model(self.model.config, max_tokens=max_tokens, max_seqs=max_seqs,
                                       block_size=self.block_size, dtype=self.cache_dtype, rope_dtype=self.rope_dtype,
                                       device=self.device, scales=self.scales, observer=observer,
                                       query_dtype=self.query_dtype, pack=self.pack)

    @torch.no_grad()
    def step(self, cache: PagedMLACache, seq_ids: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Append ``tokens[i]`` to sequence ``seq_ids[i]``; last hidden states ``[batch, q, hidden]``
        (right-padded: rows past a sequence's count hold junk)."""
        q = max(len(t) for t in tokens)
        ids = torch.tensor([list(t) + [0] * (q - len(t)) for t in tokens], dtype=torch.long, device=self.device)
        plan = cache.begin_step(seq_ids, [len(t) for t in tokens])
        with using_mla(self.model):
            out = self.model.model(input_ids=ids, position_ids=plan.position_ids, use_cache=False, hal_mla_cache=cache)
        cache.end_step()
        return out.last_hidden_state

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    @torch.no_grad()
    def prefill(self, cache: PagedMLACache, seq_ids: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Whole prompts in chunks of ``prefill_chunk`` tokens; logits ``[batch, vocab]`` of each last token."""
        last = [None] * len(prompts)
        for start in range(0, max(len(p) for p in prompts), self.prefill_chunk):
            rows = [i for i, p in enumerate(prompts) if len(p) > start]
            chunk = [prompts[i][start:start + self.prefill_chunk] for i in rows]
            hidden = self.step(cache, [seq_ids[i] for i in rows], chunk)
            for j, i in enumerate(rows):
                if len(prompts[i]) <= start + self.prefill_chunk:
                    last[i] = hidden[j, len(chunk[j]) - 1]
        return self.logits(torch.stack(last))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 32) -> list[list[int]]:
        """Greedy new tokens for each prompt (every decode step one hal.mla_decode per layer)."""
        cache = self.new_cache(sum(map(len, prompts)) + len(prompts) * max_new_tokens, len(prompts))
        sids = [cache.add_sequence() for _ in prompts]
        logits = self.prefill(cache, sids, prompts)
        out: list[list[int]] = [[] for _ in prompts]
        for n in range(max_new_tokens):
            for o, t in zip(out, logits.argmax(-1).tolist()):
                o.append(t)
            if n + 1 < max_new_tokens:
                logits = self.logits(self.step(cache, sids, [[o[-1]] for o in out])[:, -1])
        return out


@torch.no_grad()
def calibrate_mla(model, batches, *, block_size: int = 16) -> hal.KVScaleObserver:
    """Run ``batches`` (``[batch, tokens]`` id tensors) over a bf16 MLA cache with a
    :class:`hal.KVScaleObserver` fed every layer's latent (as "k") and rotary part (as "v"); returns
    the observer: ``.scales(torch.float8_e4m3fn, margin=...)`` -> scales for :class:`PagedMLACache`."""
    device = next(model.parameters()).device
    observer = hal.KVScaleObserver(model.config.num_hidden_layers, 1, device=device)
    runner = MLARunner(model, block_size=block_size)
    for ids in batches:
        cache = runner.new_cache(ids.numel(), ids.shape[0], observer=observer)
        sids = [cache.add_sequence() for _ in range(ids.shape[0])]
        for s in range(0, ids.shape[1], runner.prefill_chunk):
            runner.step(cache, sids, ids[:, s:s + runner.prefill_chunk].tolist())
    return observer
