"""The emu pack's paged attention against the float64 reference, on grids drawn from its declaration.

Tolerance (element-wise, see cases.tolerance_ok): half an ulp of the output dtype (the final
rounding) plus 1e-5 of the largest output magnitude for the float32 arithmetic (dot products of at
most 256 terms and softmax sums of a few thousand, each adding ~2^-24 relative error per operation).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hal
from cases import (FEATURES, FP8, alibi_slopes, gpu_tolerance_ok, make_case, nan_input_cases, nan_rows_ok,
                   poison_unread, read_slots, tolerance_ok)
from hal.kernelpacks.emu import pack as emu_pack
from hal.kernelpacks.emu import torch_path

pytestmark = pytest.mark.emu


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """cpu runs the PyTorch path; cuda runs whatever emu picks there (Triton when installed)."""
    return request.param

SUPPORT = emu_pack.SUPPORT
HEAD_SIZES = sorted({min(SUPPORT.head_sizes), 40, 64, 72, 128, max(SUPPORT.head_sizes)})
BLOCK_SIZES = sorted({min(SUPPORT.block_sizes), 7, 16, 32, max(SUPPORT.block_sizes)})
CACHE_DTYPES = sorted(SUPPORT.cache_dtypes, key=str)
LENS = [1, 0, 33, 16, 64, 127]  # odd, empty, exactly on block boundaries (for block 16)


def _run(case, **kw):
    out = case.poisoned_out()
    res = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                              case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale, out=out,
                              pack="emu", **case.kwargs, **kw)
    assert res is out
    return out


def _ok(out, ref):
    return (gpu_tolerance_ok if out.is_cuda else tolerance_ok)(out, ref)


def _check(case, **kw):
    out = _run(case, **kw)
    ok, msg = _ok(out, case.reference())
    assert ok, msg


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_every_cache_encoding(cache_dtype, device):
    _check(make_case(device=device, seq_lens=LENS, cache_dtype=cache_dtype))


@pytest.mark.parametrize("query_dtype", sorted(SUPPORT.query_dtypes, key=str), ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2fnuz], ids=str)
def test_query_dtypes(query_dtype, cache_dtype, device):
    _check(make_case(device=device, seq_lens=LENS, query_dtype=query_dtype, cache_dtype=cache_dtype))


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_head_and_block_sizes(head_size, block_size, device):
    lens = [1, 2 * block_size, 3 * block_size + 1, 300]
    _check(make_case(device=device, seq_lens=lens, head_size=head_size, block_size=block_size, seed=head_size + block_size))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1), (16, 2), (16, 1), (32, 2), (12, 3)],
                         ids=lambda x: str(x))
def test_gqa_ratios_and_mqa(heads, kv_heads, device):
    _check(make_case(device=device, seq_lens=[5, 77, 160], num_heads=heads, num_kv_heads=kv_heads,
                     cache_dtype=torch.float8_e4m3fnuz))


@pytest.mark.parametrize("scales", ["float", "tensor0d", "per_head"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_scale_forms(scales, cache_dtype, device):
    _check(make_case(device=device, seq_lens=[40, 3], cache_dtype=cache_dtype, num_kv_heads=4,
                     per_head_scales=scales == "per_head", scale_as_tensor=scales == "tensor0d"))


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
def test_features_alone_and_combined(feature, cache_dtype, device):
    _check(make_case(device=device, seq_lens=[0, 1, 18, 19, 20, 130], cache_dtype=cache_dtype, per_head_scales=True,
                     **FEATURES[feature]))


def test_shared_blocks_between_sequences(device):
    _check(make_case(device=device, seq_lens=[100, 90, 64, 81], share_prefix=True))


def test_softmax_merges_across_chunks(monkeypatch, device):
    # Force one block per chunk so the online-softmax merge runs many times.
    monkeypatch.setattr(torch_path, "_CHUNK_ELEMENTS", {"cpu": 1, "cuda": 1})
    _check(make_case(device=device, seq_lens=[1, 45, 200], block_size=8, alibi_slopes=alibi_slopes(8), sliding_window=70))


def test_max_seq_len_hint_and_long_context(device):
    case = make_case(device=device, seq_lens=[5000, 1, 2049], block_size=64, cache_dtype=torch.float8_e5m2)
    _check(case, max_seq_len=5000)


def test_default_scale_is_head_size_power(device):
    case = make_case(device=device, seq_lens=[30])
    a = _run(case)
    b = _run(case, scale=case.query.shape[-1] ** -0.5)
    assert torch.equal(a, b)
    c = _run(case, scale=0.3)
    assert not torch.equal(a, c)


def test_out_is_allocated_when_absent(device):
    case = make_case(device=device, seq_lens=[3, 9])
    out = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                              case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    ok, msg = _ok(out, case.reference())
    assert ok, msg


def test_strided_blocks_of_a_combined_kv_allocation(device):
    case = make_case(device=device, seq_lens=[20, 7])
    kv = torch.stack([case.key_cache, case.value_cache], dim=1)  # [blocks, 2, hkv, bs, d]
    out = case.poisoned_out()
    hal.paged_attention(case.query, kv[:, 0], kv[:, 1], case.block_tables, case.seq_lens,
                        k_scale=case.k_scale, v_scale=case.v_scale, out=out)
    ok, msg = _ok(out, case.reference())
    assert ok, msg


def test_strided_query_rows(device):
    case = make_case(device=device, seq_lens=[20, 7])
    wide = torch.cat([case.query, torch.randn_like(case.query)], dim=1)  # a fused-qkv style view
    q = wide[:, : case.query.shape[1]]
    assert not q.is_contiguous()
    out = hal.paged_attention(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                              k_scale=case.k_scale, v_scale=case.v_scale)
    ok, msg = _ok(out, case.reference())
    assert ok, msg


def test_no_sequences(device):
    case = make_case(device=device, seq_lens=[4])
    q = case.query[:0]
    out = hal.paged_attention(q, case.key_cache, case.value_cache, case.block_tables[:0],
                              case.seq_lens[:0], k_scale=case.k_scale, v_scale=case.v_scale)
    assert out.shape == (0, *case.query.shape[1:])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["query", "key", "alibi"])
def test_nan_inputs_give_nan_rows_not_zeros(where, cache_dtype, device):
    """A NaN in the query, in a key that is read or in an ALiBi slope gives NaN (the documented
    formula) in exactly the rows it takes part in; only an empty sequence gives zeros."""
    case, rows = nan_input_cases(cache_dtype=cache_dtype, device=device)[where]
    out = _run(case)
    ok, msg = nan_rows_ok(out, case, rows, _ok)
    assert ok, msg


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
                                         torch.float16, torch.float32], ids=str)
def test_unread_cache_bytes_contribute_nothing(cache_dtype, device):
    """NaN/inf bytes everywhere no sequence reads: the unused tail of a last block, a block that only
    another sequence references (the one a short sequence's junk table columns would resolve to),
    blocks no one references, and positions before a sliding window."""
    case = make_case(seq_lens=[3, 40, 17, 1], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     cache_dtype=cache_dtype, sliding_window=9, device=device, seed=5)
    # Make block 0 one that only sequence 1 references, with garbage in its unread slots.
    tables = case.block_tables
    b1 = int(tables[1, 0])
    for t in (case.key_cache, case.value_cache):
        t[[0, b1]] = t[[b1, 0]].clone()
    case.block_tables = torch.where(tables == b1, 0, torch.where(tables == 0, b1, tables)).to(torch.int32)
    assert int(case.block_tables[1, 0]) == 0
    read = read_slots(case.block_tables, case.seq_lens.tolist(), 16, case.key_cache.shape[0], 9)
    poison_unread(case.key_cache, read)
    poison_unread(case.value_cache, read)
    assert not bool(read.all(dim=1)[0]), "block 0 must hold unread (poisoned) slots"
    out = _run(case)
    ok, msg = _ok(out, case.reference())
    assert ok, msg


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_nhd_cache_as_its_hnd_view(cache_dtype, device):
    """An engine's NHD cache [num_blocks, block_size, num_kv_heads, head_size] passed without a copy
    as its permute(0, 2, 1, 3) view: cache_kv writes through the strides, attention reads through
    them, and the result equals the same call on the dense HND copy."""
    case = make_case(seq_lens=[5, 40, 17], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     cache_dtype=cache_dtype, device=device)
    nhd_k = case.key_cache.permute(0, 2, 1, 3).contiguous()  # the engine's allocation
    nhd_v = case.value_cache.permute(0, 2, 1, 3).contiguous()
    view_k, view_v = nhd_k.permute(0, 2, 1, 3), nhd_v.permute(0, 2, 1, 3)
    assert view_k.stride(2) != view_k.shape[3]
    k = torch.randn(2, 2, 64, device=device)
    slots = torch.tensor([int(case.block_tables[0, 0]) * 16 + 5, int(case.block_tables[2, 1]) * 16 + 1],
                         device=device)  # tokens 5 of seq 0 and 17 of seq 2 (their next positions)
    ks = case.k_scale
    hal.cache_kv(k, k, view_k, view_v, slots, k_scale=ks, v_scale=case.v_scale, pack="emu")
    hal.cache_kv(k, k, case.key_cache, case.value_cache, slots, k_scale=ks, v_scale=case.v_scale, pack="emu")
    assert torch.equal(view_k.contiguous().view(torch.uint8), case.key_cache.view(torch.uint8))
    case.seq_lens = case.seq_lens + torch.tensor([1, 0, 1], dtype=torch.int32, device=device)
    want = _run(case)
    ref = case.reference()
    case.key_cache, case.value_cache = view_k, view_v
    got = _run(case)
    if device == "cpu":  # the same path either way: the same bits
        assert torch.equal(got, want)
    else:  # GPU: the dense copy runs the Triton path, the strided view the PyTorch path
        ok, msg = _ok(got, ref)
        assert ok, msg


def test_nhd_view_is_declared_by_the_native_packs(monkeypatch):
    """An NHD cache's HND view (the strided_cache feature) is in the cuda and rocm declarations: their
    kernels read K/V rows through the head and token strides, so dispatch admits it (on this machine
    emu runs only because neither pack can run here)."""
    for target, pack, cache in (("sm_90", "cuda", torch.float8_e4m3fn), ("gfx942", "rocm", torch.float8_e4m3fnuz)):
        monkeypatch.setenv("HAL_TARGET", target)
        case = make_case(seq_lens=[5, 9], head_size=128, cache_dtype=cache)
        view = case.key_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        d = hal.explain(case.query, view, view.clone(memory_format=torch.preserve_format), case.block_tables,
                        case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale)
        assert "strided_cache" in d.key.features
        support = hal.registry.by_name(pack).supports(d.target)["paged_attention"]
        key = dataclasses.replace(d.key, device_type="cuda")   # as on the GPU (these tensors are on the CPU)
        assert support.reasons(key) == [], (pack, support.reasons(key))


def test_a_view_with_misaligned_token_rows_is_a_dispatch_reason(monkeypatch):
    """Token rows 136 bytes apart (a [..., :64] slice of a 68-wide allocation): the native packs' 16-byte
    loads cannot read them, so the call carries misaligned_cache, cuda is passed over naming it, and emu
    computes it right (not a launcher error on a GPU)."""
    monkeypatch.setenv("HAL_TARGET", "sm_90")
    case = make_case(seq_lens=[5, 40, 17], head_size=64, cache_dtype=torch.bfloat16)
    wide = [torch.full((*c.shape[:3], 68), float("nan"), dtype=c.dtype) for c in (case.key_cache, case.value_cache)]
    for w, c in zip(wide, (case.key_cache, case.value_cache)):
        w[..., :64] = c
    kc, vc = (w[..., :64] for w in wide)
    d = hal.explain(case.query, kc, vc, case.block_tables, case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale)
    assert "misaligned_cache" in d.key.features and d.pack.NAME == "emu"
    key = dataclasses.replace(d.key, device_type="cuda")
    reasons = hal.registry.by_name("cuda").supports(d.target)["paged_attention"].reasons(key)
    assert any("misaligned_cache" in r for r in reasons), reasons
    case.key_cache, case.value_cache = kc, vc
    ok, msg = _ok(_run(case), case.reference())
    assert ok, msg
