"""The public calls. Thin: each passes its keywords to its op's declaration (:mod:`hal.ops`), which
checks the Python numbers, fills defaults, splits scales into the op's float/tensor slots and calls
the registered torch op (which validates, dispatches and runs). Kept free of logging and caches so
``torch.compile(fullgraph=True)`` traces them without a graph break."""

from __future__ import annotations

import torch

from hal import dispatch
from hal import ops as _ops


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float | None = None,
                    k_scale=None, v_scale=None, alibi_slopes: torch.Tensor | None = None,
                    logits_soft_cap: float | None = None, sliding_window: int | None = None,
                    max_seq_len: int | None = None, query_start_loc: torch.Tensor | None = None,
                    max_query_len: int | None = None, causal: bool = True, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, pack: str | None = None) -> torch.Tensor:
    """Attention over a paged KV cache: decode (one query token per sequence), or with
    ``query_start_loc`` several tokens per sequence (prefill, chunked prefill, mixed batches).

    Shapes: ``query`` [num_seqs, num_heads, head_size] (fp16/bf16; fp32 on emu);
    ``key_cache``/``value_cache`` [num_blocks, num_kv_heads, block_size, head_size] whose dtype is the
    encoding (fp16, bf16, fp32, or a torch float8 dtype); ``block_tables`` int32
    [num_seqs, max_blocks_per_seq]; ``seq_lens`` int32 [num_seqs]. Token ``t`` of sequence ``i`` lives
    at block ``block_tables[i, t // block_size]``, offset ``t % block_size``.

    Per sequence i, query head h (KV head ``h // (num_heads // num_kv_heads)``), key position j:
      ``s_j = q·k_j * scale * k_scale`` (k_j as decoded from the cache, before its scale);
      with ``logits_soft_cap`` c: ``s_j = c * tanh(s_j / c)``;
      with ALiBi: ``s_j += alibi_slopes[h] * (j - (seq_len - 1))``;
      with ``sliding_window`` w: only keys ``j >= seq_len - w`` take part;
      ``out = v_scale * sum_j softmax(s)_j v_j``; a sequence of length 0 gives zeros (NaN inputs
      give NaN where they take part).
    ``scale`` defaults to ``head_size ** -0.5``. ``k_scale``/``v_scale``: float, 0-d or
    [num_kv_heads] float32 tensor; None means 1.0 (a MissingScaleWarning once for an FP8 cache).
    ``max_seq_len``: host-side upper bound on ``seq_lens`` (required during CUDA graph capture).

    Several tokens per sequence: ``query`` [total_q, num_heads, head_size]; sequence i owns rows
    ``query_start_loc[i] .. query_start_loc[i+1]-1`` (int32 [num_seqs + 1], from 0 to total_q);
    ``seq_lens[i]`` counts the whole context INCLUDING those new tokens (already written with
    ``hal.cache_kv``); row t of q_len rows sits at position ``p = seq_lens[i] - q_len + t``, and the
    rules above hold with p in place of ``seq_len - 1`` (causal: keys ``j <= p``; ``causal=False``:
    every ``j < seq_len``, refused with ALiBi or a window). ``max_query_len``: host-side bound on the
    row counts (required during CUDA graph capture).
    ``lse``: a float32 [total_q, num_heads] tensor (any strides) that receives each row's
    log-sum-exp of its logits, ``log(sum_j exp(s_j))`` in natural log (``-inf`` for a row with no
    key): what cascade and context-parallel merges combine partial outputs by. Packs declare it as
    the feature ``lse``; one that lacks it is passed over with the reason.
    ``pack``: force a pack by name (also ``HAL_PACK``).
    """
    return _ops.call("paged_attention", query=query, key_cache=key_cache, value_cache=value_cache,
                     block_tables=block_tables, seq_lens=seq_lens, scale=scale, k_scale=k_scale, v_scale=v_scale,
                     alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                     max_seq_len=max_seq_len, query_start_loc=query_start_loc, max_query_len=max_query_len,
                     causal=causal, out=out, lse=lse, pack=pack)


def cache_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale=None, v_scale=None, pack: str | None = None) -> None:
    """Write new tokens into the paged cache: ``stored = encode(saturate(x / scale))``.

    ``key``/``value`` [num_tokens, num_kv_heads, head_size]; ``slot_mapping`` int64 [num_tokens] with
    ``slot = block * block_size + offset``; a negative slot skips its token (padding). For an FP8
    cache, values beyond the encoding's range saturate to its largest finite value; NaN stays NaN.
    """
    _ops.call("cache_kv", key=key, value=value, key_cache=key_cache, value_cache=value_cache,
              slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale, pack=pack)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, ckv_scale=None, kpe_scale=None,
               query_start_loc: torch.Tensor | None = None, max_query_len: int | None = None,
               max_seq_len: int | None = None, out: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, pack: str | None = None) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek's absorbed form) over a paged latent cache.

    ``q_nope`` [total_q, num_heads, R] (the query times W_UK), ``q_pe`` [total_q, num_heads, P];
    ``ckv_cache`` [num_blocks, block_size, R] (any encoding), ``kpe_cache`` [num_blocks, block_size, P]
    (16-bit recommended, FP8 allowed); either may be a view into one [num_blocks, block_size, R + P]
    allocation. ``s_j = (q_nope . c_j * ckv_scale + q_pe . kpe_j * kpe_scale) * scale``; returns
    ``ckv_scale * softmax(s) @ c`` [total_q, num_heads, R]. ``scale`` is required (the model's softmax
    scale). Several rows per sequence (speculative decoding) through ``query_start_loc`` as in
    :func:`paged_attention`, causal. Scales: float, 0-d or [1] float32 tensor; None is 1.0.
    ``lse``: a float32 [total_q, num_heads] tensor (any strides) for each row's log-sum-exp of its
    logits (natural log), as :func:`paged_attention`'s (the feature ``lse``).
    """
    return _ops.call("mla_decode", q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
                     block_tables=block_tables, seq_lens=seq_lens, scale=scale, ckv_scale=ckv_scale,
                     kpe_scale=kpe_scale, query_start_loc=query_start_loc, max_query_len=max_query_len,
                     max_seq_len=max_seq_len, out=out, lse=lse, pack=pack)


def cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
              slot_mapping: torch.Tensor, *, ckv_scale=None, kpe_scale=None, pack: str | None = None) -> None:
    """Write new tokens' latents ``kv_c`` [num_tokens, R] and rotary parts ``k_pe`` [num_tokens, P]
    into the MLA caches at ``slot_mapping`` (int64; negative skips), stored as
    ``encode(saturate(x / scale))``, each part with its own scale."""
    _ops.call("cache_mla", kv_c=kv_c, k_pe=k_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
              slot_mapping=slot_mapping, ckv_scale=ckv_scale, kpe_scale=kpe_scale, pack=pack)


def explain(*args, op: str = "paged_attention", **kwargs) -> dispatch.Decision:
    """The dispatch decision op ``op`` (default ``paged_attention``) would take for these arguments
    (the public function's, positional or keyword), with every pack's verdict and reasons
    (``print(hal.explain(...).text())``). Validates; runs nothing. Missing scales count as 1.0 here
    without a warning."""
    import inspect

    from hal import env

    decl = _ops.OPS.get(op)
    if decl is None:
        raise ValueError(f"hal.explain: op must be one of {', '.join(_ops.OPS)}; got {op!r}")
    bound = dict(inspect.signature(decl.schema_args).bind(*args, **kwargs).arguments)  # the public keywords
    for name in ("k_scale", "v_scale", "ckv_scale", "kpe_scale"):
        if name in inspect.signature(decl.schema_args).parameters:
            bound[name] = 1.0 if bound.get(name) is None else bound[name]
    forced = bound.pop("pack", None)
    call = _ops.prepare(op, **bound)
    return dispatch.decide(call.call_key, call.target, forced if forced is not None else env.forced_pack())
