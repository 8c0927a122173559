"""hal inside a transformers model: attention layers write K/V with :func:`hal.cache_kv` and attend
with :func:`hal.paged_attention` over a :class:`~hal.integrations.paged_cache.PagedKVCache`.

Extension points, and why these: transformers' ``AttentionInterface`` lets a function replace the
attention of every layer of models written against it (Llama, Mistral, Qwen2, ... in transformers
>= 4.48; tested with 5.24), and it receives the post-RoPE query, key and value of the new tokens plus
the keyword arguments of the model call. So the paged cache travels as a keyword (``hal_cache=``),
exactly as transformers' own continuous batching passes its paged cache, and no dense K/V is ever
rebuilt. A custom ``Cache`` class was the other candidate; it was not taken because ``Cache.update``
must return dense keys for the attention function, the opposite of a paged FP8 cache.

The mask. An attention function registered under a new name gets *no* attention mask unless a mask
function is registered under the same name (``AttentionMaskInterface``); a function that relied on
that mask would silently attend to everything (with a sliding-window model that gave perplexity 168
in the issue's experiment). hal's attention needs no mask: causality and padding are in the step's
plan (each sequence's new rows, context length and block table: :meth:`PagedKVCache.begin_step`), and a sliding window comes from the
layer's ``sliding_window`` keyword (Mistral, Qwen2, Gemma pass it to the attention function) or
attribute, and is handed to :func:`hal.paged_attention`. The mask function registered for ``"hal"`` says so by returning None,
which also spares transformers from building a ``[batch, 1, q, kv]`` mask per step. The tests
compare the integration with stock attention, including a sliding-window model.

Scope: decoder-only causal LMs whose attention layers call the ``AttentionInterface``: Llama,
Mistral, Qwen2/3, Gemma 1-3, OLMo 2, Granite, Cohere 1-2, Starcoder2, ... with full or sliding-window layers
(per layer, as each layer passes it), QK-norm (applied by the model before the attention function),
logit soft-caps, GQA and MQA, any head size a pack serves (emu: 32 to 256). What the runner cannot
serve it refuses with the reason (:class:`UnsupportedModel`), before running: from the config
(:func:`config_reasons`: encoder-decoder, layers that are not attention, MLA, layers sharing or
differing in K/V geometry, bidirectional, ALiBi, chunked attention) and from the model
(:func:`model_reasons`: attention that does not go through the interface, attention sinks, a head
that does something to the decoder's output the runner does not know, no pack for the attention's
shape), and while running (every layer must run hal's attention exactly once per step;
``s_aux`` is refused rather than ignored).
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch

import hal
from hal.integrations.paged_cache import PagedKVCache, StaticStep

__all__ = ["ATTENTION_NAME", "ROUNDTRIP_NAME", "HalRunner", "RoundTrip", "UnsupportedModel", "calibrate",
           "check_model", "config_reasons", "hal_attention", "model_reasons", "register", "roundtrip_attention",
           "stock_greedy", "using"]

log = logging.getLogger("hal")
ATTENTION_NAME = "hal"
ROUNDTRIP_NAME = "hal_roundtrip"


def hal_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  hal_cache: PagedKVCache | None = None, sliding_window=None, softcap=None, s_aux=None,
                  **kwargs):
    """transformers attention function: query ``[b, heads, q, d]``, key/value ``[b, kv_heads, q, d]``
    (post-RoPE, new tokens only) -> ``([b, q, heads, d], None)``."""
    if hal_cache is None:
        raise ValueError("attn_implementation 'hal' needs the paged cache as a keyword of the model call "
                         "(model(..., hal_cache=cache, use_cache=False)); HalRunner does this")
    if s_aux is not None:
        raise NotImplementedError("hal attention: attention sinks (s_aux) are not supported")
    if dropout:
        raise NotImplementedError("hal attention is for inference: dropout must be 0 (call model.eval())")
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    out = hal_cache.attend(module.layer_idx, query, key, value, scale=scaling,
                           sliding_window=int(window) if window else None,
                           logits_soft_cap=float(softcap) if softcap else None)
    return out, None


def _no_mask(*args, **kwargs):
    """hal attention takes causality, padding and windows from the paged cache's plan: no mask."""
    return None


class RoundTrip:
    """The plain-PyTorch simulation of a KV cache: each layer's post-RoPE K and V go through the
    cache encoding and back (``decode(encode(x / s)) * s`` with hal's own FP8 rounding, or a cast for
    fp16/bf16), then stock SDPA attends over them. What an FP8 cache costs, measured without any
    kernel: hal's kernels must reproduce it (``hal-eval`` reports both)."""

    def __init__(self, dtype: torch.dtype, scales=None):
        self.dtype, self.scales = dtype, scales

    def __call__(self, layer: int, x: torch.Tensor, role: int) -> torch.Tensor:
        if not hal.fp8.is_fp8(self.dtype):
            return x.to(self.dtype).to(x.dtype)
        s = 1.0 if self.scales is None else self.scales.for_encoding(self.dtype)[layer][role]
        return hal.fp8.decode(hal.fp8.encode(x, self.dtype, s, head_dim=1), s, x.dtype, head_dim=1)


def roundtrip_attention(module, query, key, value, attention_mask, hal_roundtrip: RoundTrip | None = None,
                        **kwargs):
    """Stock SDPA attention over K/V round-tripped through a cache encoding (see :class:`RoundTrip`).
    Registered with SDPA's mask function under the same name, so it gets the causal (and sliding
    window) mask stock attention gets."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if hal_roundtrip is not None:
        key, value = hal_roundtrip(module.layer_idx, key, 0), hal_roundtrip(module.layer_idx, value, 1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Register ``"hal"`` (and the simulation ``"hal_roundtrip"``) with transformers'
    AttentionInterface and AttentionMaskInterface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, hal_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    AttentionInterface.register(ROUNDTRIP_NAME, roundtrip_attention)
    AttentionMaskInterface.register(ROUNDTRIP_NAME, sdpa_mask)


@contextlib.contextmanager
def using(model, name: str = ATTENTION_NAME):
    """Run ``model`` with attention implementation ``name`` inside the block, then restore it."""
    register()
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def _output_embeddings(model):
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModel(f"{type(model).__name__} has no output embeddings: hal's runner needs a causal LM")
    return head


# --- which models the runner serves ------------------------------------------------------------------
class UnsupportedModel(ValueError):
    """A model hal's runner cannot serve; the message says why (one line)."""


_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


def config_reasons(config) -> list[str]:
    """Why a transformers config describes a model the runner cannot serve (empty: nothing found in
    the config; :func:`model_reasons` checks the loaded model further)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    why = []
    if _get(config, "is_encoder_decoder", False) or _get(text, "is_encoder_decoder", False):
        why.append("it is an encoder-decoder model (the runner drives decoder-only causal LMs)")
    missing = [a for a in ("num_hidden_layers", "num_attention_heads", "hidden_size") if not _has(text, a)]
    if missing:
        why.append(f"its config has no {', '.join(missing)} (not a transformer decoder the runner knows)")
        return why
    try:
        _, heads, kv_heads, head_size = PagedKVCache.geometry(text)
    except ValueError as exc:
        return why + [str(exc)]
    types = list(_get(text, "layer_types") or [])
    other = sorted(set(types) - _ATTENTION_LAYERS)
    if other:
        at = [i for i, t in enumerate(types) if t not in _ATTENTION_LAYERS]
        why.append(f"layers {', '.join(map(str, at[:6]))}{' ...' if len(at) > 6 else ''} are {', '.join(other)}, "
                   f"not full or sliding-window attention over a KV cache")
    if _get(text, "kv_lora_rank", None) or _get(text, "q_lora_rank", None) or \
            _get(text, "v_head_dim", head_size) != head_size:
        why.append("it uses multi-head latent attention (MLA: compressed K/V, keys and values of different "
                   "head sizes)")
    if _get(text, "num_kv_shared_layers", 0):
        why.append(f"{_get(text, 'num_kv_shared_layers')} of its layers reuse other layers' K/V (num_kv_shared_layers)")
    for attr, what in (("global_head_dim", "head sizes"), ("num_global_key_value_heads", "KV head counts")):
        other_value = _get(text, attr, None)
        mine = head_size if attr == "global_head_dim" else kv_heads
        if other_value and other_value != mine:
            why.append(f"its layers have different {what} ({mine} and {other_value}; the cache has one geometry)")
    if _get(text, "use_bidirectional_attention", False):
        why.append("its attention is bidirectional (use_bidirectional_attention), not causal")
    if _get(text, "alibi", False) or _get(text, "position_embedding_type", None) == "alibi":
        why.append("it uses ALiBi position biases (the runner does not pass slopes)")
    if _get(text, "attention_chunk_size", None) and "chunked_attention" not in other:
        why.append(f"it uses chunked attention (attention_chunk_size={_get(text, 'attention_chunk_size')})")
    if heads % kv_heads:
        why.append(f"its {heads} query heads are not a multiple of its {kv_heads} KV heads")
    return why


def _get(config, name, default=None):
    """``getattr`` that also reads a per-layer attribute of a heterogeneous config: the layers' one
    value, or a list of their values when they differ."""
    try:
        return getattr(config, name, default)
    except RuntimeError:
        values = [getattr(layer, name, default) for layer in config.per_layer_config]
        return values[0] if all(v == values[0] for v in values) else values


def _has(config, name) -> bool:
    return _get(config, name) is not None


def model_reasons(model) -> list[str]:
    """Why the runner cannot serve ``model`` (empty: it can): :func:`config_reasons`, then what the
    loaded model shows. Runs nothing."""
    why = config_reasons(model.config)
    if model.get_output_embeddings() is None:
        why.append(f"{type(model).__name__} has no output embeddings (the runner needs a causal LM head)")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        why.append("its attention layers do not call transformers' AttentionInterface, so hal cannot take "
                   "their place")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        why.append("its attention has sinks (s_aux), which hal does not implement")
    return why


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_model(model) -> tuple[str, object]:
    """Refuse (:class:`UnsupportedModel`, the reasons in one line) a model the runner cannot serve;
    else return how its causal-LM head turns the output embeddings' result into logits, found by one
    stock forward over 3 tokens (``(name, function)``: ``"none"``, Gemma's final soft-cap, Granite's
    and Cohere's logit scaling). Cached per model."""
    if model in _CHECKED:
        return _CHECKED[model]
    name = type(model).__name__
    why = model_reasons(model)
    if not why:
        found = _logit_transform(model)
        if isinstance(found, str):
            why.append(found)
    if why:
        raise UnsupportedModel(f"hal cannot serve {name}: {'; '.join(why)}")
    _CHECKED[model] = found
    return found


@torch.no_grad()
def _logit_transform(model):
    """``(name, function)`` taking the output embeddings' result to the model's logits, or a
    string saying why none of the known ones does."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = model.get_output_embeddings()
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    seen = {}
    hooks = [head.register_forward_hook(lambda m, i, o: seen.update(hidden=i[0], raw=o)),
             base.register_forward_hook(lambda m, i, o: seen.update(decoder=getattr(o, "last_hidden_state", None)))]
    device = next(model.parameters()).device
    try:
        ids = (torch.arange(3, device=device) * 7 + 1)[None] % text.vocab_size
        logits = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for h in hooks:
            h.remove()
    if "raw" not in seen or seen.get("decoder") is None:
        return "its forward does not run its decoder and then its output embeddings"
    hidden, decoder = seen["hidden"].float(), seen["decoder"].float()
    if hidden.shape != decoder.shape or (hidden - decoder).abs().max() > 1e-6 * (1 + decoder.abs().max()):
        return "its causal-LM head changes the decoder's hidden states before the output embeddings"
    raw = seen["raw"]
    cands = []
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        cands.append((f"final soft-cap {cap}", lambda x, c=float(cap): torch.tanh(x / c) * c))
    for attr in ("logit_scale", "logits_scaling"):
        s = getattr(text, attr, None)
        if isinstance(s, (int, float)) and not isinstance(s, bool) and s not in (0, 1):
            cands += [(f"x {attr} {s}", lambda x, s=float(s): x * s), (f"/ {attr} {s}", lambda x, s=float(s): x / s)]
    cands.append(("none", lambda x: x))
    tol = 1e-3 * (1 + float(logits.abs().max()))
    errs = [(float((f(raw).float() - logits).abs().max()), n, f) for n, f in cands
            if f(raw).shape == logits.shape]
    ok = [e for e in errs if e[0] <= tol]
    if not ok:
        return "its logits are not its output embeddings' result after any post-processing the runner knows " \
               "(none, a final soft-cap, a logit scale)"
    best = min(ok, key=lambda e: e[0])
    return best[1], best[2]


def _default_query_dtype(model, device: torch.device, cache_dtype: torch.dtype) -> torch.dtype:
    """The CPU keeps the model's dtype (emu serves fp32 too). GPU packs want fp16/bf16 queries, and a
    16-bit cache queries of its own dtype (native packs do not mix fp16 with bf16)."""
    dt = model.dtype
    if device.type == "cpu":
        return dt
    if cache_dtype in (torch.float16, torch.bfloat16):
        return cache_dtype
    return dt if dt in (torch.float16, torch.bfloat16) else torch.bfloat16


class HalRunner:
    """Drives a transformers causal LM over hal's paged cache: prompt processing, greedy and sampled
    generation for a batch of prompts of different lengths, and logits for evaluation.

    ``cache_dtype``: the KV-cache encoding (bf16, fp16, or a torch float8 dtype such as
    ``hal.fp8.native_e4m3()``). ``scales``: :class:`hal.KVScales` for an FP8 cache (from
    :func:`hal.load_kv_scales` or :func:`calibrate`); None means 1.0 with a logged warning.
    ``prefill_chunk``: prompt tokens per forward step (bounds activation memory); each step is one
    multi-token :func:`hal.paged_attention` call per layer for all its sequences (``multi_token``:
    see :class:`PagedKVCache`). A model the runner cannot serve raises :class:`UnsupportedModel`
    here, with the reasons (:func:`check_model`).

    :meth:`generate` plans every step once (:func:`hal.plan`, shared by the layers: ``step(...,
    planned=True)``); on a GPU (``cuda_graphs``, the default) it captures the decode step in a CUDA
    graph per batch size and replays it for the later steps of that size (the step's geometry in
    fixed buffers, :class:`~hal.integrations.paged_cache.StaticStep`). A capture that fails is
    logged with its reason (also in :attr:`graph_fallback`) and that generation decodes eagerly.
    :meth:`step` called directly makes one-shot calls unless ``planned=True``.
    """

    def __init__(self, model, *, cache_dtype: torch.dtype = torch.bfloat16, scales=None, block_size: int = 16,
                 prefill_chunk: int = 512, query_dtype: torch.dtype | None = None, pack: str | None = None,
                 max_query_rows: int = 128, multi_token: bool | None = None, cuda_graphs: bool = True):
        register()
        self.cuda_graphs = cuda_graphs
        self.graph_fallback: str | None = None   # why the last generation's decode steps ran without graphs
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.cache_dtype, self.scales, self.block_size = cache_dtype, scales, block_size
        self.prefill_chunk, self.pack, self.max_query_rows = prefill_chunk, pack, max_query_rows
        self.multi_token = multi_token
        self.query_dtype = query_dtype or _default_query_dtype(model, self.device, cache_dtype)
        self.logit_transform, self._post = check_model(self.model)
        self._check_pack()

    def _check_pack(self) -> None:
        """Refuse a model whose attention shape no pack serves with this cache (head size, dtypes)."""
        _, heads, kv_heads, head_size = PagedKVCache.geometry(self.model.config)
        q = torch.zeros((1, heads, head_size), dtype=self.query_dtype, device=self.device)
        kc = torch.zeros((1, kv_heads, self.block_size, head_size), dtype=self.cache_dtype, device=self.device)
        one = torch.ones((1,), dtype=torch.int32, device=self.device)
        d = hal.explain(q, kc, kc, one[None] * 0, one, k_scale=1.0, v_scale=1.0, pack=self.pack)
        if d.pack is None:
            told = [v for v in d.verdicts if v.kind == "rejected"] or [v for v in d.verdicts if v.reasons]
            reasons = "; ".join(f"{v.pack}: {', '.join(v.reasons)}" for v in told)
            raise UnsupportedModel(f"hal cannot serve {type(self.model).__name__}: no pack serves its attention "
                                   f"({heads} heads over {kv_heads} KV heads of size {head_size}, "
                                   f"{str(self.query_dtype).removeprefix('torch.')} queries, a "
                                   f"{str(self.cache_dtype).removeprefix('torch.')} cache): {reasons}")

    def new_cache(self, max_tokens: int, max_seqs: int = 1, observer=None) -> PagedKVCache:
        return PagedKVCache.for_model(self.model.config, max_tokens=max_tokens, max_seqs=max_seqs,
                                      block_size=self.block_size, dtype=self.cache_dtype, device=self.device,
                                      scales=self.scales, observer=observer, query_dtype=self.query_dtype,
                                      max_query_rows=self.max_query_rows, pack=self.pack,
                                      multi_token=self.multi_token)

    @torch.no_grad()
    def step(self, cache: PagedKVCache, seq_ids: list[int], tokens: list[list[int]] | torch.Tensor,
             counts: list[int] | None = None, *, planned: bool = False) -> torch.Tensor:
        """Append ``tokens`` (``[batch, q]`` right-padded, ``counts`` valid per row) to the sequences
        and return the last hidden states ``[batch, q, hidden]`` (padding rows hold junk).
        ``planned``: the layers share the step's hal plans (one validation and dispatch per step)."""
        ids = tokens if isinstance(tokens, torch.Tensor) else _pad(tokens)
        counts = counts if counts is not None else (
            [len(t) for t in tokens] if not isinstance(tokens, torch.Tensor) else [ids.shape[1]] * ids.shape[0])
        plan = cache.begin_step(seq_ids, counts, planned=planned)
        hidden = self._decoder(cache, ids.to(self.device), plan.position_ids)
        self._end_step(cache)
        return hidden

    def _decoder(self, cache: PagedKVCache, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The decoder over the cache's current step: the last hidden states."""
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        with using(self.model):
            if self.model.config._attn_implementation != ATTENTION_NAME:
                raise UnsupportedModel(f"hal cannot serve {type(self.model).__name__}: transformers did not set "
                                       f"its attention implementation to {ATTENTION_NAME!r}")
            out = base(input_ids=ids, position_ids=position_ids, use_cache=False, hal_cache=cache)
        return out.last_hidden_state

    def _end_step(self, cache: PagedKVCache) -> None:
        try:
            cache.end_step()
        except ValueError as exc:
            raise UnsupportedModel(f"hal cannot serve {type(self.model).__name__}: {exc}") from None

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits (float32) for hidden states from :meth:`step`: its output embeddings,
        then what its head does after them (:attr:`logit_transform`: e.g. Gemma's final soft-cap)."""
        return self._post(_output_embeddings(self.model)(hidden)).float()

    @torch.no_grad()
    def prefill(self, cache: PagedKVCache, seq_ids: list[int], prompts: list[list[int]], *,
                planned: bool = False) -> torch.Tensor:
        """Process whole prompts in chunks of ``prefill_chunk`` tokens; logits ``[batch, vocab]`` of
        each prompt's last token (``planned``: as in :meth:`step`)."""
        last = [None] * len(prompts)
        start = 0
        while True:
            rows = [i for i, p in enumerate(prompts) if len(p) > start]
            if not rows:
                break
            chunk = [prompts[i][start:start + self.prefill_chunk] for i in rows]
            hidden = self.step(cache, [seq_ids[i] for i in rows], chunk, planned=planned)
            for j, i in enumerate(rows):
                if len(prompts[i]) <= start + self.prefill_chunk:
                    last[i] = hidden[j, len(chunk[j]) - 1]
            start += self.prefill_chunk
        return self.logits(torch.stack(last))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 32, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id=None,
                 generator: torch.Generator | None = None, planned: bool = True) -> list[list[int]]:
        """New tokens for each prompt (token id lists of any lengths). Greedy unless ``do_sample``.
        A sequence stops at ``eos_token_id`` (int or list) and leaves the batch, freeing its blocks.
        Every step is planned once for all layers (``planned=False``: one-shot calls, no graphs); on a
        GPU the decode steps replay CUDA graphs (see the class docstring)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        cache = self.new_cache(sum(len(p) for p in prompts) + len(prompts) * max_new_tokens, len(prompts))
        sids = [cache.add_sequence() for _ in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        logits = self.prefill(cache, sids, prompts, planned=planned)
        width = -(-(max(len(p) for p in prompts) + max_new_tokens) // cache.block_size)
        graphs = _DecodeGraphs(self, cache, width) if planned and self._graphs_wanted(cache) else None
        self.graph_fallback = None
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            nxt = _choose(logits, do_sample, temperature, top_k, top_p, generator).tolist()
            still = []
            for i, t in zip(active, nxt):
                out[i].append(t)
                if t in eos or len(out[i]) >= max_new_tokens:
                    cache.free_sequence(sids[i])
                else:
                    still.append(i)
            active = still
            if not active:
                break
            tokens = [[out[i][-1]] for i in active]
            if graphs is not None:
                hidden = graphs.step([sids[i] for i in active], tokens)
            else:
                hidden = self.step(cache, [sids[i] for i in active], tokens, planned=planned)
            logits = self.logits(hidden[:, -1])
        return out

    def _graphs_wanted(self, cache: PagedKVCache) -> bool:
        return self.cuda_graphs and cache.observer is None and _graphs_possible(cache.device)


def _graphs_possible(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def _capture(fn, device: torch.device, pool=None):
    """``(replay, output, graph)``: ``fn()`` captured in a CUDA graph on ``device`` (nothing runs;
    ``replay()`` runs it again into the same ``output``). The outer stream context restores the
    caller's stream even when ending a failed capture raises."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.current_stream(device)):
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = fn()
    return graph.replay, output, graph


class _DecodeGraphs:
    """One generation's decode steps as CUDA graphs, one per batch size. A batch size's first step
    runs eagerly through its :class:`StaticStep` (the step itself, and the warm-up that makes the
    step's hal plans), then is captured; its later steps write their geometry and tokens into the
    buffers and replay. A failed capture turns graphs off for the generation, with the reason logged."""

    def __init__(self, runner: HalRunner, cache: PagedKVCache, width: int):
        self.runner, self.cache, self.width = runner, cache, width
        self.graphs: dict[int, tuple] = {}   # batch -> (static, replay, hidden, layers, graph)
        self.pool = None

    def step(self, seq_ids: list[int], tokens: list[list[int]]) -> torch.Tensor:
        runner, cache = self.runner, self.cache
        if runner.graph_fallback is not None:
            return runner.step(cache, seq_ids, tokens, planned=True)
        b = len(seq_ids)
        ids = torch.tensor(tokens, dtype=torch.long)
        found = self.graphs.get(b)
        if found is not None:
            static, replay, hidden, layers, _ = found
            cache.begin_step(seq_ids, [1] * b, static=static)
            static.ids.copy_(ids)
            replay()
            cache.attended = list(layers)
            runner._end_step(cache)
            return hidden.clone()
        static = StaticStep(b, self.width, cache.block_size, cache.device)
        cache.begin_step(seq_ids, [1] * b, static=static)
        static.ids.copy_(ids)
        hidden = runner._decoder(cache, static.ids, static.position_ids)
        runner._end_step(cache)
        try:
            cache.attended = []
            replay, out, graph = _capture(lambda: runner._decoder(cache, static.ids, static.position_ids),
                                          cache.device, self.pool)
            layers = list(cache.attended)
            if sorted(layers) != list(range(cache.num_layers)):
                raise RuntimeError(f"the captured step attended layers {layers}, not each of the "
                                   f"{cache.num_layers} layers once")
        except Exception as exc:  # noqa: BLE001 - any failure: decode eagerly, say why
            runner.graph_fallback = f"{type(exc).__name__}: {exc}".split("\n")[0][:500]
            log.warning("hal: capturing the decode step (batch %d) in a CUDA graph failed, so this generation "
                        "decodes eagerly: %s", b, runner.graph_fallback)
            return hidden
        finally:
            cache.attended = list(range(cache.num_layers))
        if self.pool is None and hasattr(graph, "pool"):
            self.pool = graph.pool()
        self.graphs[b] = (static, replay, out, layers, graph)
        return hidden


@torch.no_grad()
def stock_greedy(model, prompts: list[list[int]], max_new_tokens: int = 32, *, eos_token_id=None) -> list[list[int]]:
    """The reference for :meth:`HalRunner.generate`: greedy new tokens for each prompt from the model's
    own attention and cache (``model.generate``, one prompt at a time, so no padding enters), stopping
    after ``eos_token_id`` like the runner does (the EOS is the last token). Plain greedy: a generation
    config of its own, so none of the model's defaults (sampling, repetition penalty) applies."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None,
                              pad_token_id=eos[0] if eos else 0)
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)], device=device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


def _pad(rows: list[list[int]], pad: int = 0) -> torch.Tensor:
    q = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (q - len(r)) for r in rows], dtype=torch.long)


def _choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
            generator) -> torch.Tensor:
    """Greedy argmax, or a sample after temperature, top-k and top-p (nucleus) filtering."""
    if not do_sample:
        return logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling; got {temperature}")
    x = logits / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(srt, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(srt, dim=-1) > top_p   # keep the smallest set reaching top_p
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def calibrate(model, batches, *, per_head: bool = False, block_size: int = 16) -> "hal.KVScaleObserver":
    """Run ``batches`` (``[batch, tokens]`` id tensors) through the model with a bf16 hal cache and a
    :class:`hal.KVScaleObserver` fed every layer's post-RoPE K/V; returns the observer
    (``.scales(encoding, margin=...)`` gives :class:`hal.KVScales` for any FP8 encoding)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    device = next(model.parameters()).device
    observer = hal.KVScaleObserver(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None)
                                   or cfg.num_attention_heads, per_head=per_head, device=device)
    runner = HalRunner(model, cache_dtype=torch.bfloat16, block_size=block_size)
    for ids in batches:
        cache = runner.new_cache(ids.numel(), ids.shape[0], observer=observer)
        sids = [cache.add_sequence() for _ in range(ids.shape[0])]
        for s in range(0, ids.shape[1], runner.prefill_chunk):
            runner.step(cache, sids, ids[:, s:s + runner.prefill_chunk])
    return observer
