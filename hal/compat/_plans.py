"""The hal plans of the batches an engine's calls describe, kept across calls.

An engine calls a library's attention once a layer with the same step tensors (block table,
lengths, row offsets) and the same bounds. A one-shot hal call would validate and dispatch every
time; here the first call of a batch makes a ``hal.plan`` and the others run it (:func:`run`).
Values written in place into the batch tensors are the plan's contract (hal.planning): within the
bounds the key holds. A few batches are kept, the most recent first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from hal import planning
from hal.validate import ArgumentError

_KEEP = 4
_cache: OrderedDict = OrderedDict()


def _kind(s):
    return None if s is None else type(s)


def run(q, key_cache, value_cache, tables, seq_lens, qsl, k_scale, v_scale, slopes, out, lse, **options):
    """This layer's call through the plan of its batch: made on the batch's first call (the one-shot
    call's validation, dispatch and errors), then ``plan.run``, which checks this layer's layouts.
    Returns (the output, the plan that made it).

    The key is cheap on purpose (the per-call cost is the point): the batch tensors by identity
    (the entry holds them, so their ids cannot be reused while it is kept), the host bounds and
    options, the kind of each scale. A layer laid out otherwise than the plan (``plan.run`` refuses
    it) gets a plan of its own."""
    key = (id(tables), id(seq_lens), id(qsl), id(slopes), _kind(k_scale), _kind(v_scale), lse is None,
           tuple(options.values()))
    entry = _cache.get(key)
    if entry is not None:
        try:
            return entry[0].run(q, key_cache, value_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse), entry[0]
        except ArgumentError:
            pass  # another layout: plan it (hal.plan raises the one-shot call's error if it is malformed)
    plan = planning.plan("paged_attention", q, key_cache, value_cache, tables, seq_lens, k_scale=k_scale,
                         v_scale=v_scale, alibi_slopes=slopes, query_start_loc=qsl, out=out, lse=lse, **options)
    _cache[key] = (plan, (tables, seq_lens, qsl, slopes))
    _cache.move_to_end(key)
    while len(_cache) > _KEEP:
        _cache.popitem(last=False)
    return plan.run(q, key_cache, value_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse), plan


_lengths: OrderedDict = OrderedDict()


def lengths(cu: torch.Tensor) -> torch.Tensor:
    """int32 per-sequence lengths of cumulative offsets ``cu``, written each call (one small kernel, no
    allocation: CUDA-graph safe) into a buffer kept for ``cu`` (the entry holds it), so that the plan
    made over it sees the values written in place into ``cu`` later too."""
    key = id(cu)
    entry = _lengths.get(key)
    if entry is None:
        entry = (cu, torch.empty(cu.shape[0] - 1, dtype=torch.int32, device=cu.device))
        _lengths[key] = entry
        while len(_lengths) > _KEEP:
            _lengths.popitem(last=False)
    else:
        _lengths.move_to_end(key)
    torch.sub(cu[1:], cu[:-1], out=entry[1])
    return entry[1]


_fast: OrderedDict = OrderedDict()


def remember(key: tuple, held: tuple, value) -> None:
    """Keep ``value`` for the calls with ``key``: a tuple naming tensors (and other objects) by
    ``id`` and plain values (bounds, options) by value. ``held``: the objects whose ids the key
    names, kept with it so that no id is reused while the entry is kept. A key with an unhashable
    value (a list ``window_size``) is not kept: such calls take the full path each time."""
    try:
        _fast[key] = (value, held)
    except TypeError:
        return
    _fast.move_to_end(key)
    while len(_fast) > _KEEP:
        _fast.popitem(last=False)


def recall(key: tuple):
    try:
        hit = _fast.get(key)
    except TypeError:  # an unhashable argument: the full path names what is wrong with it
        return None
    return None if hit is None else hit[0]


def clear() -> None:
    """Drop every kept plan (and the tensors they hold)."""
    _cache.clear()
    _lengths.clear()
    _fast.clear()
