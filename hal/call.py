"""The frozen call records every pack receives: one validated call, with its scales in one form (a
float or a float32 tensor on the caches' device), its geometry derived once, the target it was
dispatched for and the host-side bounds that plan it. Packs read fields; they never re-derive or
re-validate them."""

from __future__ import annotations

import dataclasses

import torch

from hal.pack import CallKey
from hal.targets import Target

Scale = float | torch.Tensor


@dataclasses.dataclass(frozen=True)
class Geometry:
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    total_q: int          # query rows (== num_seqs for decode)

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionCall:
    """``hal.paged_attention`` after validation. ``out`` and ``query`` have a unit stride in their
    last dimension (the op copies other views in and ``out`` back). ``max_seq_len`` is always an
    int: the caller's host bound, else read from ``seq_lens`` once, here (a device sync on GPUs,
    refused during graph capture)."""

    call_key: CallKey
    target: Target
    geometry: Geometry
    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    k_scale: Scale
    v_scale: Scale
    alibi_slopes: torch.Tensor | None
    logits_soft_cap: float | None
    sliding_window: int | None
    max_seq_len: int
    # several query tokens per sequence: rows query_start_loc[i] .. [i+1]-1 belong to sequence i
    # (None: one row per sequence, decode); max_query_len is then a host int like max_seq_len
    query_start_loc: torch.Tensor | None = None
    max_query_len: int = 1
    causal: bool = True
    # float32 [total_q, num_heads] (any strides): each row's natural-log sum of exp of its logits (as
    # scaled, capped and biased, before the softmax), -inf for a row with no key; None: not asked for
    lse: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class CacheWriteCall:
    """``hal.cache_kv`` after validation (``key``/``value`` with a unit last stride)."""

    call_key: CallKey
    target: Target
    geometry: Geometry
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: Scale
    v_scale: Scale


@dataclasses.dataclass(frozen=True, eq=False)
class MLACall:
    """``hal.mla_decode`` after validation. ``geometry``: num_kv_heads 1 (one latent shared by every
    head), head_size R (the latent's width); ``rope_dim`` is P. ``max_seq_len`` and
    ``max_query_len`` are host ints as in :class:`AttentionCall`."""

    call_key: CallKey
    target: Target
    geometry: Geometry
    rope_dim: int
    out: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    ckv_scale: Scale
    kpe_scale: Scale
    max_seq_len: int
    query_start_loc: torch.Tensor | None = None
    max_query_len: int = 1
    lse: torch.Tensor | None = None  # float32 [total_q, num_heads], as AttentionCall.lse


@dataclasses.dataclass(frozen=True, eq=False)
class MLAWriteCall:
    """``hal.cache_mla`` after validation (``kv_c``/``k_pe`` with a unit last stride)."""

    call_key: CallKey
    target: Target
    geometry: Geometry
    rope_dim: int
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    slot_mapping: torch.Tensor
    ckv_scale: Scale
    kpe_scale: Scale
