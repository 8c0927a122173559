"""The public calls. Thin: they fill defaults, split scales into the op's float/tensor slots and
call the registered torch ops (which validate and dispatch). Kept free of logging and caches so
``torch.compile(fullgraph=True)`` traces them without a graph break."""

from __future__ import annotations

import torch

from hal import dispatch, validate
from hal import ops as _ops  # noqa: F401  (registers torch.ops.hal.*)


def _split_scale(op: str, name: str, s):
    """A scale goes to the op's tensor slot or its float slot (validated there)."""
    if s is None:
        return None, None
    if isinstance(s, torch.Tensor):
        return None, s
    return validate.real(op, name, s, "a float or a float32 tensor"), None


def _host_args(op: str, query, scale, logits_soft_cap, sliding_window, max_seq_len):
    """The Python-number arguments, checked before torch's schema would coerce them (True -> 1)."""
    validate.tensor(op, "query", query)
    if scale is None:  # head_size 0 (or a 0-d query) is reported by validation, not as a ZeroDivisionError
        scale = query.shape[-1] ** -0.5 if query.dim() and query.shape[-1] > 0 else 1.0
    else:
        scale = validate.real(op, "scale", scale, "a finite float > 0 (or None for head_size**-0.5)")
    if logits_soft_cap is not None:
        logits_soft_cap = validate.real(op, "logits_soft_cap", logits_soft_cap, "None or a finite float > 0")
    validate.integer(op, "sliding_window", sliding_window, 1, "no window; else keys at positions >= seq_len - window")
    validate.integer(op, "max_seq_len", max_seq_len, 0, "read from seq_lens")
    return scale, logits_soft_cap


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float | None = None,
                    k_scale=None, v_scale=None, alibi_slopes: torch.Tensor | None = None,
                    logits_soft_cap: float | None = None, sliding_window: int | None = None,
                    max_seq_len: int | None = None, out: torch.Tensor | None = None,
                    pack: str | None = None) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache.

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
    [num_kv_heads] float32 tensor; None means 1.0 (logged once for an FP8 cache).
    ``max_seq_len``: host-side upper bound on ``seq_lens`` (required during CUDA graph capture).
    ``pack``: force a pack by name (also ``HAL_PACK``).
    """
    scale, logits_soft_cap = _host_args("paged_attention", query, scale, logits_soft_cap, sliding_window,
                                        max_seq_len)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ks, kst = _split_scale("paged_attention", "k_scale", k_scale)
    vs, vst = _split_scale("paged_attention", "v_scale", v_scale)
    torch.ops.hal.paged_attention.default(
        out, query, key_cache, value_cache, block_tables, seq_lens, scale, ks, vs, kst, vst,
        alibi_slopes, logits_soft_cap, sliding_window, max_seq_len, pack)
    return out


def cache_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale=None, v_scale=None, pack: str | None = None) -> None:
    """Write new tokens into the paged cache: ``stored = encode(saturate(x / scale))``.

    ``key``/``value`` [num_tokens, num_kv_heads, head_size]; ``slot_mapping`` int64 [num_tokens] with
    ``slot = block * block_size + offset``; a negative slot skips its token (padding). For an FP8
    cache, values beyond the encoding's range saturate to its largest finite value; NaN stays NaN.
    """
    ks, kst = _split_scale("cache_kv", "k_scale", k_scale)
    vs, vst = _split_scale("cache_kv", "v_scale", v_scale)
    torch.ops.hal.cache_kv.default(key, value, key_cache, value_cache, slot_mapping, ks, vs, kst, vst, pack)


def explain(query, key_cache, value_cache, block_tables, seq_lens, *, k_scale=None, v_scale=None,
            alibi_slopes=None, logits_soft_cap=None, sliding_window=None, max_seq_len=None,
            pack: str | None = None, scale: float | None = None) -> dispatch.Decision:
    """The dispatch decision ``hal.paged_attention`` would take for these arguments, with every
    pack's verdict and reasons (``print(hal.explain(...).text())``). Runs nothing."""
    from hal import env
    from hal.targets import target

    op = "paged_attention"
    scale, logits_soft_cap = _host_args(op, query, scale, logits_soft_cap, sliding_window, max_seq_len)
    call, _, _ = validate.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
        k_scale=1.0 if k_scale is None else k_scale, v_scale=1.0 if v_scale is None else v_scale,
        alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
        max_seq_len=max_seq_len, out=None)
    return dispatch.decide(call, target(), pack if pack is not None else env.forced_pack())
