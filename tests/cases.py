"""Random paged-attention problems for the tests, built without any hal code path.

Cache contents come from random floats quantised by the reference (ml_dtypes), so a bug in
hal.cache_kv cannot hide one in paged_attention. Pages are shuffled; block-table entries past a
sequence's last used block are junk on purpose (a kernel must never read through them). Every cache
element no sequence reads (the unused tail of a last block, blocks no table references, positions
before a sliding window) holds NaN or inf bytes: caches are allocated with torch.empty in an engine,
so any byte can be there, and masked positions must contribute exactly nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import reference

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


@dataclasses.dataclass
class Case:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: object
    v_scale: object
    kwargs: dict

    def reference(self) -> np.ndarray:
        return reference.paged_attention(self.query, self.key_cache, self.value_cache, self.block_tables,
                                         self.seq_lens, k_scale=self.k_scale, v_scale=self.v_scale,
                                         **self.kwargs)

    def poisoned_out(self) -> torch.Tensor:
        return torch.full_like(self.query, float("nan"))


def random_cache(shape, dtype, scale, gen: torch.Generator) -> torch.Tensor:
    """Values ~ N(0, 1) in real units, stored as ``dtype`` with ``scale`` (per-head allowed)."""
    real = torch.randn(shape, generator=gen)
    if dtype in FP8:
        s = scale.reshape(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else scale
        flat = (real / s).reshape(shape[0], shape[1], -1)
        q = reference.quantize(flat, dtype, 1.0).reshape(shape)
        return torch.from_numpy(q).view(dtype)
    return real.to(dtype)


# Bytes no sequence reads are set to these (alternating by slot): NaN, and inf where the encoding has one.
_POISON_BYTES = {
    torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e4m3fnuz: (0x80, 0x80),
    torch.float8_e5m2: (0x7F, 0x7C), torch.float8_e5m2fnuz: (0x80, 0x80),
}


def read_slots(block_tables: torch.Tensor, seq_lens, block_size: int, num_blocks: int,
               sliding_window=None) -> torch.Tensor:
    """[num_blocks, block_size] bool: the cache slots some sequence attends to."""
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables = block_tables.cpu().to(torch.int64)
    for i, L in enumerate(int(x) for x in seq_lens):
        lo = 0 if sliding_window is None else max(0, L - int(sliding_window))
        pos = torch.arange(lo, L)
        read[tables[i, pos // block_size], pos % block_size] = True
    return read


def poison_unread(cache: torch.Tensor, read: torch.Tensor) -> None:
    """Fill every slot of ``cache`` (HND) that ``read`` marks unread with NaN / inf, in place."""
    slot_parity = (torch.arange(cache.shape[2]) % 2).expand_as(read)
    for parity in (0, 1):
        where = (~read) & (slot_parity == parity)
        blk, off = where.nonzero(as_tuple=True)
        if cache.dtype in FP8:
            cache.view(torch.uint8)[blk, :, off] = _POISON_BYTES[cache.dtype][parity]
        else:
            cache[blk, :, off] = float("nan") if parity == 0 else float("inf")


def fp8_scale_for(dtype: torch.dtype) -> float:
    """A realistic per-tensor scale: N(0,1) data with absmax ~4.5 maps onto the format's range."""
    return 4.5 / torch.finfo(dtype).max if dtype in FP8 else 1.0


def make_case(*, seq_lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
              cache_dtype=torch.float8_e4m3fn, query_dtype=torch.bfloat16, per_head_scales=False,
              scale_as_tensor=False, extra_blocks=3, share_prefix=False, seed=0, device="cpu",
              garbage=True, **kwargs) -> Case:
    gen = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    max_blocks = max(1, (max(seq_lens, default=0) + block_size - 1) // block_size) + 1
    num_blocks = n * max_blocks + extra_blocks
    base = fp8_scale_for(cache_dtype)
    if per_head_scales:
        k_scale = base * (0.5 + torch.rand(num_kv_heads, generator=gen))
        v_scale = base * (0.5 + torch.rand(num_kv_heads, generator=gen))
    elif scale_as_tensor:
        k_scale, v_scale = torch.tensor(base * 1.1), torch.tensor(base * 0.9)
    else:
        k_scale, v_scale = base * 1.1, base * 0.9
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    kc = random_cache(shape, cache_dtype, k_scale, gen)
    vc = random_cache(shape, cache_dtype, v_scale, gen)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((n, max_blocks), 10**6, dtype=torch.int32)  # junk past the used blocks
    for i, L in enumerate(seq_lens):
        used = (L + block_size - 1) // block_size
        tables[i, :used] = perm[i * max_blocks: i * max_blocks + used]
        if share_prefix and i > 0:  # sequences sharing their first blocks (prefix caching)
            shared = min(used, (tables[0] != 10**6).sum().item()) - 1
            if shared > 0:
                tables[i, :shared] = tables[0, :shared]
    if garbage:
        read = read_slots(tables, seq_lens, block_size, num_blocks, kwargs.get("sliding_window"))
        poison_unread(kc, read)
        poison_unread(vc, read)
    q = torch.randn((n, num_heads, head_size), generator=gen).to(query_dtype)
    t = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    kwargs = {k: t(v) for k, v in kwargs.items()}
    return Case(q.to(device), kc.to(device), vc.to(device), tables.to(device), lens.to(device),
                t(k_scale), t(v_scale), kwargs)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes (for a power-of-two head count; others interpolate)."""
    return torch.tensor([2 ** (-8 * (i + 1) / num_heads) for i in range(num_heads)], dtype=torch.float32)


# Each optional behaviour alone and all together, for 8 query heads (the packs' feature grids).
FEATURES = {
    "alibi": dict(alibi_slopes=alibi_slopes(8)),
    "soft_cap": dict(logits_soft_cap=2.5),
    "window": dict(sliding_window=19),
    "window_1": dict(sliding_window=1),
    "all": dict(alibi_slopes=alibi_slopes(8), logits_soft_cap=4.0, sliding_window=50),
}


def tolerance_ok(out: torch.Tensor, ref: np.ndarray, compute_rel: float = 1e-5) -> tuple[bool, str]:
    """Element-wise bound: rounding to the output dtype (half an ulp, relative) plus the float32
    compute error (``compute_rel`` of the largest magnitude). Reports the worst ratio to the bound."""
    o = out.detach().cpu().to(torch.float64).numpy()
    if not np.all(np.isfinite(o)):
        return False, f"{int((~np.isfinite(o)).sum())} non-finite outputs (unwritten or NaN)"
    half_ulp = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[out.dtype]
    bound = half_ulp * np.abs(ref) + compute_rel * max(1e-30, float(np.abs(ref).max(initial=0.0)))
    err = np.abs(o - ref)
    worst = float((err / np.maximum(bound, 1e-300)).max(initial=0.0))
    return worst <= 1.0, f"worst error/bound = {worst:.3g}, max abs error {float(err.max(initial=0)):.3g}"


# GPU kernels (the emu Triton path, native packs) round probabilities to 16 bits before the PV
# product: each weight carries up to 2^-9 relative error, which averages to ~1e-3 in relative L2;
# 5e-3 is the bound the project sets for them (issue: cuda pack targets). fp32 queries take an
# IEEE fp32 path and keep the tight element-wise bound.
GPU_REL_L2 = 5e-3


def gpu_tolerance_ok(out: torch.Tensor, ref: np.ndarray) -> tuple[bool, str]:
    if out.dtype == torch.float32:
        return tolerance_ok(out, ref)
    o = out.detach().cpu().to(torch.float64).numpy()
    if not np.all(np.isfinite(o)):
        return False, f"{int((~np.isfinite(o)).sum())} non-finite outputs (unwritten or NaN)"
    rel = reference.relative_l2(o, ref)
    return rel <= GPU_REL_L2, f"relative L2 error {rel:.3g} (bound {GPU_REL_L2})"


# ---------------------------------------------------------------------------------------------
# NaN inputs: the documented formula gives NaN where a NaN takes part; only an empty sequence is 0.

def _nan_byte(dtype) -> int:
    return _POISON_BYTES[dtype][0]


def nan_input_cases(**over) -> dict[str, tuple[Case, list[tuple[int, int]]]]:
    """Valid calls with a NaN planted, and the (sequence, head) output rows that must be NaN:
    - "query": one element of head 1 of sequence 0 (that row only), and the whole query of the
      empty sequence 1 (which stays zeros);
    - "key": a key that is read (sequence 2, position 4, KV head 1): every head of that KV group of
      sequence 2, no other sequence;
    - "alibi": the slope of head 2: head 2 of every non-empty sequence (slope * 0 at the last key).
    8 query heads over 2 KV heads; ``over`` changes the cache/query dtypes, sizes or device."""
    base = dict(seq_lens=[37, 0, 21, 5], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    base.update(over)
    device = base.pop("device", "cpu")
    g = base["num_heads"] // base["num_kv_heads"]
    out = {}

    c = make_case(**base, seed=21)
    c.query[0, 1, 3] = float("nan")
    c.query[1] = float("nan")
    out["query"] = (c, [(0, 1)])

    c = make_case(**base, seed=22)
    blk, off = int(c.block_tables[2, 0]), 4
    if c.key_cache.dtype in FP8:
        c.key_cache.view(torch.uint8)[blk, 1, off, 7] = _nan_byte(c.key_cache.dtype)
    else:
        c.key_cache[blk, 1, off, 7] = float("nan")
    out["key"] = (c, [(2, h) for h in range(g, 2 * g)])

    slopes = alibi_slopes(base["num_heads"])
    slopes[2] = float("nan")
    c = make_case(**base, seed=23, alibi_slopes=slopes)
    out["alibi"] = (c, [(i, 2) for i, L in enumerate(base["seq_lens"]) if L > 0])

    for name, (c, rows) in out.items():
        out[name] = (_to(c, device), rows)
    return out


def _to(c: Case, device) -> Case:
    t = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return Case(t(c.query), t(c.key_cache), t(c.value_cache), t(c.block_tables), t(c.seq_lens), t(c.k_scale),
                t(c.v_scale), {k: t(v) for k, v in c.kwargs.items()})


def nan_rows_ok(out: torch.Tensor, case: Case, nan_rows, close=tolerance_ok) -> tuple[bool, str]:
    """Rows in ``nan_rows`` are NaN in every element, rows of empty sequences are exactly 0, and the
    rest match the float64 reference under ``close`` (the pack's usual tolerance)."""
    o = out.detach().cpu().to(torch.float64)
    n, h, _ = o.shape
    want_nan = torch.zeros(n, h, dtype=torch.bool)
    for i, hh in nan_rows:
        want_nan[i, hh] = True
    is_nan = torch.isnan(o)
    if not bool(is_nan[want_nan].all()):
        return False, f"rows {nan_rows} must be NaN (a NaN takes part); {int((~is_nan[want_nan]).sum())} elements are not"
    if bool(is_nan[~want_nan].any()):
        rows = sorted({(int(a), int(b)) for a, b, _ in is_nan.nonzero().tolist() if not want_nan[a, b]})
        return False, f"NaN leaked into rows {rows[:8]} (only {nan_rows} may be NaN)"
    empty = (case.seq_lens.cpu() == 0)
    if bool((o[empty] != 0).any()):
        return False, "rows of empty sequences must be exactly 0"
    ref = case.reference()
    keep = ~want_nan
    # ``close`` sees the rows on the output's device (GPU outputs get the GPU tolerance).
    return close(out.detach()[keep.to(out.device)].unsqueeze(0), ref[keep.numpy()][None])


def attention_call(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                   alibi_slopes=None, logits_soft_cap=None, sliding_window=None, max_seq_len=None):
    """A call record built directly (not validated), for tests that drive one pack's implementation
    with arguments the public call would refuse or plan differently. ``max_seq_len=None`` is read
    from ``seq_lens``, as validation does."""
    from hal.call import AttentionCall, Geometry
    from hal.pack import CallKey
    from hal.targets import target

    n, h, d = query.shape
    nb, hkv, bs, _ = key_cache.shape
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if n else 0
    key = CallKey("paged_attention", query.device.type, query.dtype, key_cache.dtype, d, bs, h // hkv)
    return AttentionCall(key, target(), Geometry(n, h, hkv, d, bs, nb, n), out, query, key_cache, value_cache,
                         block_tables, seq_lens, scale, k_scale, v_scale, alibi_slopes, logits_soft_cap,
                         sliding_window, max_seq_len)


def cache_write_call(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    """A cache_kv call record built directly (not validated), for pack-level tests."""
    from hal.call import CacheWriteCall, Geometry
    from hal.pack import CallKey
    from hal.targets import target

    nb, hkv, bs, d = key_cache.shape
    ck = CallKey("cache_kv", key.device.type, key.dtype, key_cache.dtype, d, bs, 1)
    return CacheWriteCall(ck, target(), Geometry(0, 0, hkv, d, bs, nb, key.shape[0]), key, value, key_cache,
                          value_cache, slot_mapping, k_scale, v_scale)


# --- several query tokens per sequence (query_start_loc) -----------------------------------------

# (seq_lens, q_lens) per geometry
GEOMETRIES = {
    "prefill": ([1, 5, 16, 33, 130], [1, 5, 16, 33, 130]),
    "chunked": ([40, 100, 257, 64], [17, 9, 200, 64]),
    "mixed": ([300, 1, 77, 50, 0, 20, 130, 9, 64], [120, 1, 0, 1, 0, 3, 130, 9, 1]),
    "speculative": ([50, 51, 60, 33, 80, 12], [2, 3, 4, 5, 8, 7]),
    "decode": ([1, 33, 16, 64, 127], [1, 1, 1, 1, 1]),
}


@dataclasses.dataclass
class VCase:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    k_scale: object
    v_scale: object
    kwargs: dict
    causal: bool = True

    def reference(self) -> np.ndarray:
        return reference.paged_attention_varlen(self.query, self.key_cache, self.value_cache, self.block_tables,
                                                self.seq_lens, self.query_start_loc, causal=self.causal,
                                                k_scale=self.k_scale, v_scale=self.v_scale, **self.kwargs)

    def hal_reference(self) -> torch.Tensor:
        from hal import reference as hal_reference

        return hal_reference.paged_attention_varlen(self.query, self.key_cache, self.value_cache, self.block_tables,
                                                    self.seq_lens, self.query_start_loc, causal=self.causal,
                                                    k_scale=self.k_scale, v_scale=self.v_scale, **self.kwargs)

    def run(self, *, query=None, key_cache=None, value_cache=None, scale=None, max_seq_len=None,
            max_query_len=None) -> torch.Tensor:
        """The emu PyTorch multi-token path on this case, into a NaN-poisoned output."""
        from hal.kernelpacks.emu import torch_prefill

        q = self.query if query is None else query
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)         # poisoned: every row must be written
        kw = self.kwargs
        torch_prefill.paged_attention_varlen(
            out, q, self.key_cache if key_cache is None else key_cache,
            self.value_cache if value_cache is None else value_cache, self.block_tables, self.seq_lens,
            q.shape[-1] ** -0.5 if scale is None else scale, self.k_scale, self.v_scale, kw.get("alibi_slopes"),
            kw.get("logits_soft_cap"), kw.get("sliding_window"), max_seq_len, self.query_start_loc,
            max_query_len, self.causal)
        return out


def read_slots_varlen(block_tables, seq_lens, q_lens, block_size, num_blocks, sliding_window=None) -> torch.Tensor:
    """[num_blocks, block_size] bool: the slots some query row attends to."""
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables = block_tables.cpu().to(torch.int64)
    for i, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        if ql == 0:
            continue
        lo = 0 if sliding_window is None else max(0, L - ql - sliding_window + 1)
        pos = torch.arange(lo, L)
        read[tables[i, pos // block_size], pos % block_size] = True
    return read


def make_varlen(seq_lens, q_lens, *, causal=True, garbage=True, seed=0, query_dtype=torch.bfloat16, **kw) -> VCase:
    assert len(seq_lens) == len(q_lens) and all(0 <= q <= L for L, q in zip(seq_lens, q_lens))
    c = make_case(seq_lens=seq_lens, garbage=False, seed=seed, query_dtype=query_dtype, **kw)
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1000)
    h, d = c.query.shape[1:]
    q = torch.randn((int(qsl[-1]), h, d), generator=gen).to(query_dtype)
    if garbage:
        read = read_slots_varlen(c.block_tables, seq_lens, q_lens, c.key_cache.shape[2], c.key_cache.shape[0],
                                 c.kwargs.get("sliding_window"))
        poison_unread(c.key_cache, read)
        poison_unread(c.value_cache, read)
    return VCase(q, c.key_cache, c.value_cache, c.block_tables, c.seq_lens, qsl, c.k_scale, c.v_scale, c.kwargs,
                 causal)


def row_positions(case: VCase) -> list[tuple[int, int, int]]:
    """(sequence, row, position) for every query row."""
    qsl, lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    return [(i, r, lens[i] - (qsl[i + 1] - qsl[i]) + (r - qsl[i]))
            for i in range(len(lens)) for r in range(qsl[i], qsl[i + 1])]


def set_cache_element(cache, block, head, off, col, value: float):
    if cache.dtype in FP8:
        cache.view(torch.uint8)[block, head, off, col] = 0x80 if cache.dtype in (
            torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) else 0x7F
    else:
        cache[block, head, off, col] = value


# The quick loop (``pytest -m "not slow"``, README): the rocm emulation grids run for MI300 (gfx942)
# there, every other arch only in the full suite.
QUICK_ARCH = "gfx942"


def arch_params(archs):
    """``archs`` as pytest params, all but QUICK_ARCH marked ``slow``."""
    import pytest

    return [a if a == QUICK_ARCH else pytest.param(a, marks=pytest.mark.slow) for a in archs]
