"""The emu pack's multi-token ("varlen") PyTorch path (packs/emu/torch_prefill.py) against the
independent float64 reference (tests/reference.py::paged_attention_varlen).

Tolerance (element-wise, cases.tolerance_ok, as for decode): half an ulp of the output dtype plus
1e-5 of the largest output magnitude. The arithmetic is the decode path's: float32 dot products of
at most 256 terms, float32 softmax sums over at most a few thousand keys, an online-softmax rescale
per key tile (a few roundings each, ~2^-24 relative), and on the long path ``scale * k_scale``
folded into the float32 query (one more rounding per logit). The worst cases land near 1.0 of the
bound with 16-bit outputs because the half-ulp output rounding alone reaches ~0.5-1.0 of it.

Geometry: sequence i owns query rows qsl[i]..qsl[i+1]-1; row t of q_len rows sits at position
p = L - q_len + t. Cache slots no row reads hold NaN/inf bytes; for several rows per sequence the read
set is [max(0, L - q_len - w + 1), L) with a window w, [0, L) without, and nothing for q_len == 0
(cases.read_slots, built for decode, would be wrong here).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import reference
from cases import (FEATURES, FP8, GEOMETRIES, VCase, alibi_slopes, make_varlen, read_slots_varlen, row_positions,
                   poison_unread, set_cache_element, tolerance_ok)
from hal import reference as hal_reference
from hal.kernelpacks.emu import torch_path, torch_prefill

pytestmark = pytest.mark.emu

ALL_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8)



def _torch_path_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                       alibi, cap, window) -> None:
    """torch_path's decode on positional arguments (its positional entry point, before or after it
    took a call record), with max_seq_len as a host int."""
    fn = getattr(torch_path, "_paged_attention", torch_path.paged_attention)
    fn(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, alibi, cap, window,
       int(seq_lens.max()))


def _check(case: VCase, **run_kw) -> torch.Tensor:
    out = case.run(**run_kw)
    ok, msg = tolerance_ok(out, case.reference())
    assert ok, msg
    return out


def _check_nan_pattern(out: torch.Tensor, ref: np.ndarray, expect_nan: np.ndarray) -> None:
    """NaN exactly where ``expect_nan`` (which must also be the reference's NaN set), the rest close."""
    o = out.detach().to(torch.float64).numpy()
    assert np.array_equal(np.isnan(ref), expect_nan), "the reference disagrees with the expected NaN set"
    got = np.isnan(o)
    assert np.array_equal(got, expect_nan), \
        f"{int((got & ~expect_nan).sum())} unexpected NaNs, {int((expect_nan & ~got).sum())} missing NaNs"
    keep = ~expect_nan
    ok, msg = tolerance_ok(out[torch.from_numpy(keep)], ref[keep])
    assert ok, msg


# --- geometry -------------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_geometries(geometry):
    """Prefill (q_len == L), chunked prefill (q_len < L), a mixed batch (prefill, chunks, decode rows,
    q_len == 0 with and without context), speculative rows (the batched 2..8-row path), decode only."""
    lens, qls = GEOMETRIES[geometry]
    _check(make_varlen(lens, qls, seed=len(geometry)))


@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES, ids=str)
def test_every_cache_encoding(cache_dtype):
    _check(make_varlen(*GEOMETRIES["mixed"], cache_dtype=cache_dtype, seed=3))


@pytest.mark.parametrize("query_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2fnuz], ids=str)
def test_query_dtypes(query_dtype, cache_dtype):
    _check(make_varlen(*GEOMETRIES["mixed"], query_dtype=query_dtype, cache_dtype=cache_dtype, seed=4))


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (16, 2), (16, 1)], ids=lambda x: str(x))
def test_gqa_ratios(heads, kv_heads):
    """GQA 1, 4, 8 and 16 (MQA): the long path's tiles hold 256 // g tokens of a KV group."""
    _check(make_varlen([90, 300, 7, 40], [90, 280, 3, 1], num_heads=heads, num_kv_heads=kv_heads,
                       cache_dtype=torch.float8_e4m3fnuz, seed=heads + kv_heads))


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
def test_block_sizes(block_size):
    lens = [2 * block_size, 3 * block_size + 1, 150, 5]
    _check(make_varlen(lens, [2 * block_size, min(20, lens[1]), 150, 5], block_size=block_size, seed=block_size))


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
def test_features_alone_and_combined(feature, cache_dtype):
    """ALiBi, soft-cap, windows 19 and 1, all together; per-head scales; unread slots (before every
    row's window, the tails of last blocks, other blocks) poisoned."""
    _check(make_varlen(*GEOMETRIES["mixed"], cache_dtype=cache_dtype, per_head_scales=True, seed=6,
                       **FEATURES[feature]))


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_gpu_decode_route_on_the_cpu(monkeypatch, cache_dtype):
    """The FP8 decode a GPU takes (hal.fp8.decode_values over the gathered pages, not the CPU's
    indexed table) gives the same bits; a shape mismatch there once failed every FP8 problem on the H200."""
    case = make_varlen(*GEOMETRIES["mixed"], cache_dtype=cache_dtype, block_size=8, seed=12)
    table_out = _check(case)
    from hal.kernelpacks.emu import pages
    real = pages.gather
    monkeypatch.setattr(pages, "gather", lambda *a, **kw: real(*a, **kw, indexed=False))
    assert torch.equal(case.run(), table_out)


@pytest.mark.parametrize("feature", ["none", "window", "window_1", "all"])
def test_many_tiles_and_chunks(monkeypatch, feature):
    """Force one block per chunk and tiny tiles so that the online softmax merges across many key
    tiles and chunks, tiles straddle the diagonal and window edges, and rows see no key in a tile."""
    monkeypatch.setattr(torch_prefill, "_CHUNK_ELEMENTS", {"cpu": 1})
    monkeypatch.setattr(torch_prefill, "_TILE_ROWS", 20)   # 5 tokens of a 4-head group
    monkeypatch.setattr(torch_prefill, "_TILE_KEYS", 12)
    kw = {} if feature == "none" else FEATURES[feature]
    _check(make_varlen([110, 61, 45, 33, 8], [80, 61, 1, 30, 6], block_size=8, seed=7, **kw))


@pytest.mark.parametrize("scales", ["float", "tensor0d", "per_head"])
def test_scale_forms(scales):
    _check(make_varlen([40, 70, 3], [40, 30, 2], num_kv_heads=4, cache_dtype=torch.float8_e5m2,
                       per_head_scales=scales == "per_head", scale_as_tensor=scales == "tensor0d", seed=8))


@pytest.mark.parametrize("geometry", ["chunked", "mixed", "speculative"])
def test_not_causal(geometry):
    """causal=False: every row sees every key j < L (an encoder, or a bidirectional prefix)."""
    _check(make_varlen(*GEOMETRIES[geometry], causal=False, seed=9))


def test_default_scale_and_explicit_scale():
    case = make_varlen(*GEOMETRIES["chunked"], seed=10)
    assert torch.equal(case.run(), case.run(scale=case.query.shape[-1] ** -0.5))
    out = case.run(scale=0.3)
    ok, msg = tolerance_ok(out, reference.paged_attention_varlen(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.query_start_loc,
        scale=0.3, k_scale=case.k_scale, v_scale=case.v_scale))
    assert ok, msg


def test_host_bounds_change_nothing():
    """max_seq_len / max_query_len given or None (read from the tensors): the same bits."""
    case = make_varlen(*GEOMETRIES["mixed"], seed=11)
    a = case.run()
    b = case.run(max_seq_len=int(case.seq_lens.max()), max_query_len=130)
    assert torch.equal(a, b)


def test_shared_prefix_blocks():
    _check(make_varlen([100, 90, 64, 81], [100, 20, 1, 81], share_prefix=True, seed=12))


def test_long_context():
    _check(make_varlen([5000, 1, 700], [40, 1, 700], block_size=64, cache_dtype=torch.float8_e5m2, seed=13))


# --- layouts --------------------------------------------------------------------------------------

def test_nhd_cache_as_its_permuted_view():
    """An engine's NHD cache [blocks, block_size, kv_heads, d] passed as permute(0, 2, 1, 3): strided
    blocks (token stride kv_heads * d) read through the strides, no copy."""
    case = make_varlen(*GEOMETRIES["mixed"], cache_dtype=torch.float8_e4m3fn, seed=14)
    views = []
    for c in (case.key_cache, case.value_cache):
        nhd = c.permute(0, 2, 1, 3).contiguous()        # the engine's storage
        views.append(nhd.permute(0, 2, 1, 3))           # what it passes
    assert not views[0].is_contiguous() and views[0].stride(2) == views[0].shape[1] * views[0].shape[3]
    out = case.run(key_cache=views[0], value_cache=views[1])
    ok, msg = tolerance_ok(out, case.reference())
    assert ok, msg


def test_combined_kv_allocation():
    case = make_varlen(*GEOMETRIES["chunked"], seed=15)
    kv = torch.stack([case.key_cache, case.value_cache], dim=1)    # [blocks, 2, hkv, bs, d]
    out = case.run(key_cache=kv[:, 0], value_cache=kv[:, 1])
    ok, msg = tolerance_ok(out, case.reference())
    assert ok, msg


def test_strided_query_rows():
    case = make_varlen(*GEOMETRIES["mixed"], seed=16)
    wide = torch.cat([case.query, torch.randn_like(case.query)], dim=1)    # a fused-qkv style view
    q = wide[:, : case.query.shape[1]]
    assert not q.is_contiguous()
    out = case.run(query=q)
    ok, msg = tolerance_ok(out, case.reference())
    assert ok, msg


def test_no_rows():
    case = make_varlen([5, 0, 9], [0, 0, 0], seed=17)
    out = case.run()
    assert out.shape == (0, *case.query.shape[1:])


# --- decode rows ------------------------------------------------------------------------------------

@pytest.mark.parametrize("feature", ["none", "all"])
@pytest.mark.parametrize("max_query_len", [None, 1])
def test_decode_only_is_bit_identical_to_torch_path(feature, max_query_len):
    """One row per sequence gives torch_path.paged_attention's bits (with or without the host bound)."""
    kw = {} if feature == "none" else FEATURES["all"]
    case = make_varlen(*GEOMETRIES["decode"], cache_dtype=torch.float8_e4m3fn, per_head_scales=True, seed=18, **kw)
    out = _check(case, max_query_len=max_query_len)
    old = torch.full_like(case.query, float("nan"))
    _torch_path_decode(old, case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                       case.query.shape[-1] ** -0.5, case.k_scale, case.v_scale, kw.get("alibi_slopes"),
                       kw.get("logits_soft_cap"), kw.get("sliding_window"))
    assert torch.equal(out, old)


@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES, ids=str)
def test_decode_bit_identity_across_encodings_and_shapes(cache_dtype):
    i = ALL_CACHE_DTYPES.index(cache_dtype)
    heads, kv_heads = [(8, 8), (8, 2), (16, 1), (32, 8)][i % 4]
    block_size = [1, 7, 16, 64][(i + 1) % 4]
    query_dtype = [torch.bfloat16, torch.float16, torch.float32][i % 3]
    kw = dict(FEATURES["all"], alibi_slopes=alibi_slopes(heads)) if i % 2 else {}
    case = make_varlen([1, 33, 16, 64, 127, 300], [1] * 6, num_heads=heads, num_kv_heads=kv_heads,
                       block_size=block_size, cache_dtype=cache_dtype, query_dtype=query_dtype,
                       per_head_scales=True, seed=30 + i, **kw)
    out = _check(case)
    old = torch.full_like(case.query, float("nan"))
    _torch_path_decode(old, case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                       case.query.shape[-1] ** -0.5, case.k_scale, case.v_scale, kw.get("alibi_slopes"),
                       kw.get("logits_soft_cap"), kw.get("sliding_window"))
    assert torch.equal(out, old)


def test_decode_rows_of_a_mixed_batch_are_torch_paths():
    """The decode rows of a mixed batch get torch_path's bits for those sequences run on their own."""
    case = make_varlen(*GEOMETRIES["mixed"], seed=19, **FEATURES["all"])
    out = _check(case)
    qsl = case.query_start_loc
    ones = ((qsl[1:] - qsl[:-1]) == 1).nonzero().reshape(-1)
    rows = qsl[ones].to(torch.int64)
    old = torch.empty((ones.numel(), *case.query.shape[1:]), dtype=case.query.dtype)
    _torch_path_decode(old, case.query[rows], case.key_cache, case.value_cache, case.block_tables[ones],
                       case.seq_lens[ones], case.query.shape[-1] ** -0.5, case.k_scale, case.v_scale,
                       case.kwargs["alibi_slopes"], case.kwargs["logits_soft_cap"],
                       case.kwargs["sliding_window"])
    assert torch.equal(out[rows], old)


# --- garbage and NaN ------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
                                         torch.float16, torch.float32], ids=str)
def test_unread_cache_bytes_contribute_nothing(cache_dtype):
    """NaN/inf in every slot no row reads: last-block tails, blocks of q_len == 0 sequences, a block
    only another sequence references (where a short sequence's junk table columns would point),
    positions before the first row's window. The decode read set (by seq_lens and window only)
    would mark slots of the q_len == 0 sequences as read and miss window slots rows of chunks read."""
    lens, qls = [3, 40, 17, 1, 60, 90], [3, 11, 0, 1, 2, 45]
    case = make_varlen(lens, qls, block_size=16, cache_dtype=cache_dtype, sliding_window=9, seed=20)
    tables = case.block_tables
    b1 = int(tables[1, 0])
    for t in (case.key_cache, case.value_cache):
        t[[0, b1]] = t[[b1, 0]].clone()
    case.block_tables = torch.where(tables == b1, 0, torch.where(tables == 0, b1, tables)).to(torch.int32)
    read = read_slots_varlen(case.block_tables, lens, qls, 16, case.key_cache.shape[0], 9)
    poison_unread(case.key_cache, read)
    poison_unread(case.value_cache, read)
    assert not bool(read.all(dim=1)[0]), "block 0 must hold unread (poisoned) slots"
    _check(case)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["query", "key", "value", "alibi"])
def test_nan_inputs_give_nan_exactly_where_they_take_part(where, cache_dtype, monkeypatch):
    """A NaN in a query element: that (row, head). A NaN in a key at position j of sequence s, KV
    head 1: every head of that group, in the rows of s with p >= j (causal), none before. A NaN in a
    value element there: that element of the same rows only (0 * NaN must not reach rows that mask
    j, the causal band). A NaN slope: that head in every row. Small tiles put j inside tiles that
    cross the diagonal on the long path; sequence 1 takes the batched few-row path; 3 is a decode row."""
    monkeypatch.setattr(torch_prefill, "_TILE_ROWS", 16)
    monkeypatch.setattr(torch_prefill, "_TILE_KEYS", 16)
    lens, qls = [80, 30, 9, 40], [60, 6, 0, 1]
    h, hkv = 8, 2
    g = h // hkv
    kw = dict(alibi_slopes=alibi_slopes(h)) if where == "alibi" else {}
    case = make_varlen(lens, qls, num_heads=h, num_kv_heads=hkv, cache_dtype=cache_dtype, seed=21, **kw)
    pos = row_positions(case)
    expect = np.zeros(case.query.shape, dtype=bool)
    if where == "query":
        for r in (5, 61, 66):                  # long path, few-row path, decode row
            case.query[r, 2, 7] = float("nan")
            expect[r, 2, :] = True
    elif where == "alibi":
        case.kwargs["alibi_slopes"][2] = float("nan")
        expect[:, 2, :] = True
    else:
        cache = case.key_cache if where == "key" else case.value_cache
        for s, j in ((0, 50), (1, 27), (3, 39)):       # inside the new rows of 0 and 1; the decode row's last key
            blk = int(case.block_tables[s, j // 16])
            set_cache_element(cache, blk, 1, j % 16, 5, float("nan"))
            for i, r, p in pos:
                if i == s and p >= j:
                    if where == "key":
                        expect[r, g:2 * g, :] = True
                    else:
                        expect[r, g:2 * g, 5] = True
    out = case.run()
    _check_nan_pattern(out, case.reference(), expect)


def test_infinite_value_in_the_band_stays_out_of_rows_that_mask_it():
    """An inf in V at a new token's position: rows before it are finite and match the reference."""
    case = make_varlen([70, 20], [70, 5], num_heads=8, num_kv_heads=2, cache_dtype=torch.float32, seed=22)
    case.value_cache[int(case.block_tables[0, 40 // 16]), 0, 40 % 16, 3] = float("inf")
    case.value_cache[int(case.block_tables[1, 18 // 16]), 1, 18 % 16, 9] = float("-inf")
    out = case.run()
    ref = case.reference()
    o = out.to(torch.float64).numpy()
    clean = np.ones(o.shape[:1], dtype=bool)
    for i, r, p in row_positions(case):
        clean[r] = p < (40 if i == 0 else 18)
    ok, msg = tolerance_ok(out[torch.from_numpy(clean)], ref[clean])
    assert ok, msg
    assert np.array_equal(np.isfinite(o), np.isfinite(ref))


# --- the references ------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["all_features", "not_causal", "per_head_bf16", "nan_value"])
def test_hal_reference_agrees_with_the_test_reference(variant):
    kw = dict(cache_dtype=torch.float8_e4m3fn, seed=23)
    if variant == "all_features":
        kw.update(FEATURES["all"])
    elif variant == "not_causal":
        kw.update(causal=False)
    elif variant == "per_head_bf16":
        kw.update(cache_dtype=torch.bfloat16, per_head_scales=True, logits_soft_cap=3.0, sliding_window=1)
    case = make_varlen(*GEOMETRIES["mixed"], **kw)
    if variant == "nan_value":
        case.value_cache.view(torch.uint8)[int(case.block_tables[0, 250 // 16]), 1, 250 % 16, 3] = 0x7F
    a = case.reference()
    b = case.hal_reference()
    assert b.dtype == torch.float64 and b.shape == case.query.shape
    b = b.numpy()
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert (variant == "nan_value") == bool(np.isnan(a).any())
    fin = ~np.isnan(a)
    assert np.max(np.abs(a[fin] - b[fin])) <= 1e-12 * np.abs(a[fin]).max()


@pytest.mark.parametrize("feature", ["none", "all"])
def test_references_give_decode_rows_the_decode_numbers(feature):
    kw = {} if feature == "none" else FEATURES["all"]
    case = make_varlen([1, 33, 16, 64, 127, 0], [1, 1, 1, 1, 1, 0], per_head_scales=True, seed=24, **kw)
    dec = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables[:5],
                                    case.seq_lens[:5], k_scale=case.k_scale, v_scale=case.v_scale, **kw)
    assert np.array_equal(case.reference(), dec)
    hal_dec = hal_reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables[:5],
                                            case.seq_lens[:5], k_scale=case.k_scale, v_scale=case.v_scale, **kw)
    assert torch.allclose(case.hal_reference(), hal_dec, rtol=1e-12, atol=1e-14)


def test_call_record_entry_point():
    """``torch_prefill.paged_attention(call)`` reads the call record's fields (hal.call.AttentionCall)."""
    case = make_varlen(*GEOMETRIES["mixed"], seed=25, **FEATURES["all"])
    out = torch.full_like(case.query, float("nan"))
    call = types.SimpleNamespace(
        out=out, query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
        block_tables=case.block_tables, seq_lens=case.seq_lens, scale=case.query.shape[-1] ** -0.5,
        k_scale=case.k_scale, v_scale=case.v_scale, alibi_slopes=case.kwargs["alibi_slopes"],
        logits_soft_cap=case.kwargs["logits_soft_cap"], sliding_window=case.kwargs["sliding_window"],
        max_seq_len=int(case.seq_lens.max()), query_start_loc=case.query_start_loc, max_query_len=130, causal=True,
        lse=None)
    torch_prefill.paged_attention(call)
    assert torch.equal(out, case.run())


@pytest.mark.parametrize("features", ["plain", "all", "window_1"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_lse_matches_the_float64_reference(geometry, features):
    """``lse``: each row's natural-log log-sum-exp of its logits (after the scale, soft-cap, ALiBi and
    masks), -inf for a row with no key, through the op (decode rows included). fp32 logits of
    magnitude < 30 accumulate ~1e-5 of error; 1e-4 absolute holds on any CPU. The output is
    unchanged by asking for it."""
    import hal

    kw = {} if features == "plain" else FEATURES[features]
    case = make_varlen(*GEOMETRIES[geometry], seed=31, **kw)
    total_q, h = case.query.shape[:2]
    lse = torch.full((h, total_q), float("nan")).t()           # poisoned, strided: every row must be written
    args = dict(k_scale=case.k_scale, v_scale=case.v_scale, causal=case.causal, **case.kwargs)
    out = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                              query_start_loc=case.query_start_loc, lse=lse, **args)
    ref = torch.empty(total_q, h, dtype=torch.float64)
    hal_reference.paged_attention_varlen(case.query, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, case.query_start_loc, lse=ref, **args)
    assert torch.isfinite(ref).all()   # every row of these geometries sees at least one key
    assert (lse.double() - ref).abs().max().item() <= 1e-4
    assert torch.equal(out, hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                                case.seq_lens, query_start_loc=case.query_start_loc, **args))
    if geometry == "decode":  # one row a sequence without query_start_loc: the decode call
        lse_d = torch.full((total_q, h), float("nan"))
        hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                            lse=lse_d, k_scale=case.k_scale, v_scale=case.v_scale, **case.kwargs)
        assert (lse_d.double() - ref).abs().max().item() <= 1e-4


def test_lse_of_a_row_without_keys_is_minus_infinity():
    """An empty sequence has no rows; a decode row of length 0 has no key: out 0, lse -inf."""
    import hal

    case = make_varlen([0, 20], [0, 1], seed=3)
    q = torch.randn(2, case.query.shape[1], case.query.shape[2]).to(torch.bfloat16)
    lse = torch.full((2, q.shape[1]), float("nan"))
    out = hal.paged_attention(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, lse=lse,
                              k_scale=case.k_scale, v_scale=case.v_scale)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
    assert torch.isfinite(lse[1]).all()
