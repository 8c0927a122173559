"""MLA decode on the emu pack's PyTorch path (packs/emu/torch_mla.py) and hal's float64 MLA reference
(hal.reference.mla_decode), against the tests' own float64 reference (tests/reference.py, FP8 via
ml_dtypes) computed from the same cache bytes.

Not yet an op: `hal.mla_decode` / `hal.cache_mla` (issue 15) will declare and validate it; these
tests pin down the arithmetic first. Caches are filled with fresh random values (FP8 bytes from
N(0, 1) data over a realistic scale), every slot no row reads is poisoned (NaN / inf bytes), the
output is poisoned with NaN. Tolerance: tolerance_ok's element-wise bound (half an ulp of the output
dtype plus 1e-5 of the largest magnitude for float32 accumulation over R = 512 products, whose
rounding error is ~sqrt(512) * 2^-24 relative, far inside it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
from cases import FP8, fp8_scale_for, tolerance_ok
from hal import fp8
from hal import reference as hal_reference
from hal.kernelpacks.emu import torch_mla

pytestmark = pytest.mark.emu

_NAN = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F, torch.float8_e4m3fnuz: 0x80, torch.float8_e5m2fnuz: 0x80}


def _fill(shape, dtype, scale, gen):
    x = torch.randn(shape, generator=gen)
    if dtype in FP8:
        return fp8.encode_bytes(x / scale, dtype).view(dtype)
    return x.to(dtype)


def make_mla(seq_lens, q_lens=None, *, heads=16, r=512, p=64, block_size=16, ckv_dtype=torch.float8_e4m3fn,
             kpe_dtype=torch.bfloat16, query_dtype=torch.bfloat16, combined=False, seed=0):
    """A random MLA problem: pages shuffled over the pool (+2 spare), unread slots poisoned."""
    gen = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    q_lens = [1] * n if q_lens is None else q_lens
    used = [(L + block_size - 1) // block_size for L in seq_lens]
    nb = sum(used) + 2
    perm = torch.randperm(nb, generator=gen)
    tables = torch.zeros(n, max(1, max(used)), dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[at:at + u]
        at += u
    cs, ps = fp8_scale_for(ckv_dtype), fp8_scale_for(kpe_dtype)
    ckv = _fill((nb, block_size, r), ckv_dtype, cs, gen)
    kpe = _fill((nb, block_size, p), kpe_dtype, ps, gen)
    read = torch.zeros(nb, block_size, dtype=torch.bool)
    for i, L in enumerate(seq_lens):
        pos = torch.arange(L)
        read[tables[i, pos // block_size].long(), pos % block_size] = True
    for cache in (ckv, kpe):
        if cache.dtype in FP8:
            cache.view(torch.uint8)[~read] = _NAN[cache.dtype]
        else:
            cache[~read] = float("nan")
    if combined:  # vLLM's layout: one [nb, bs, R + P] allocation, the two caches views into it
        if ckv_dtype != kpe_dtype:
            raise ValueError("a combined cache has one dtype")
        kv = torch.cat([ckv, kpe], dim=-1)
        ckv, kpe = kv[..., :r], kv[..., r:]
    total = sum(q_lens)
    qn = torch.randn(total, heads, r, generator=gen).to(query_dtype)
    qp = torch.randn(total, heads, p, generator=gen).to(query_dtype)
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    return dict(q_nope=qn, q_pe=qp, ckv_cache=ckv, kpe_cache=kpe, block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl,
                scale=(r + p) ** -0.5, ckv_scale=cs if ckv_dtype in FP8 else None,
                kpe_scale=ps if kpe_dtype in FP8 else None)


def run(case, *, multi=True):
    out = torch.full(case["q_nope"].shape, float("nan"), dtype=case["q_nope"].dtype)
    torch_mla.mla_decode(out, case["q_nope"], case["q_pe"], case["ckv_cache"], case["kpe_cache"],
                         case["block_tables"], case["seq_lens"], case["scale"], case["ckv_scale"], case["kpe_scale"],
                         int(case["seq_lens"].max()), case["query_start_loc"] if multi else None)
    return out


def ref(case, *, multi=True):
    return reference.mla_decode(case["q_nope"], case["q_pe"], case["ckv_cache"], case["kpe_cache"],
                                case["block_tables"], case["seq_lens"], case["query_start_loc"] if multi else None,
                                scale=case["scale"], ckv_scale=case["ckv_scale"], kpe_scale=case["kpe_scale"])


def _check(case, multi=True):
    out = run(case, multi=multi)
    ok, msg = tolerance_ok(out, ref(case, multi=multi))
    assert ok, msg
    return out


CACHE_DTYPES = (*FP8, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("ckv_dtype", CACHE_DTYPES, ids=str)
def test_every_latent_encoding(ckv_dtype):
    _check(make_mla([1, 37, 300, 16], ckv_dtype=ckv_dtype, seed=1), multi=False)


@pytest.mark.parametrize("kpe_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_rotary_part_16_bit_or_fp8(kpe_dtype):
    _check(make_mla([50, 129], kpe_dtype=kpe_dtype, seed=2), multi=False)


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
def test_block_sizes(block_size):
    _check(make_mla([3, 2 * block_size + 5, 300], block_size=block_size, seed=block_size), multi=False)


@pytest.mark.parametrize("heads,r,p", [(1, 512, 64), (128, 512, 64), (16, 32, 16), (4, 128, 32)])
def test_heads_and_widths(heads, r, p):
    _check(make_mla([40, 7], heads=heads, r=r, p=p, seed=heads), multi=False)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_query_dtypes(query_dtype):
    _check(make_mla([70, 200], query_dtype=query_dtype, seed=5), multi=False)


def test_speculative_rows_are_causal():
    """1-4 rows per sequence (query_start_loc): row t of q rows at position L - q + t."""
    case = make_mla([20, 64, 5, 130], [4, 1, 3, 2], seed=6)
    out = _check(case)
    # the last row of each sequence is the decode row over the whole context
    last = case["query_start_loc"][1:] - 1
    dec = make_mla([20, 64, 5, 130], seed=6)
    for k in ("ckv_cache", "kpe_cache", "block_tables", "seq_lens"):
        dec[k] = case[k]
    dec["q_nope"], dec["q_pe"] = case["q_nope"][last], case["q_pe"][last]
    dec["query_start_loc"] = None
    assert torch.equal(run(dec, multi=False), out[last])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_views_into_one_combined_cache(dtype):
    case = make_mla([33, 90], ckv_dtype=dtype, kpe_dtype=dtype, combined=True, seed=7)
    assert not case["ckv_cache"].is_contiguous()
    _check(case, multi=False)


def test_empty_sequence_gives_zeros_and_nan_latent_reaches_its_rows():
    case = make_mla([0, 40, 40], seed=8)
    out = run(case, multi=False)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out[1:]).all()
    blk = int(case["block_tables"][2, 1])                 # position 16..31 of sequence 2
    case["ckv_cache"].view(torch.uint8)[blk, 3, 100] = 0x7F   # a NaN in a latent that is read
    out = run(case, multi=False)
    assert torch.isnan(out[2]).all() and torch.isfinite(out[1]).all()


def test_hal_reference_agrees_with_the_test_reference():
    case = make_mla([5, 70, 33], [2, 4, 1], ckv_dtype=torch.float8_e5m2fnuz, kpe_dtype=torch.float8_e4m3fn, seed=9)
    a = hal_reference.mla_decode(case["q_nope"], case["q_pe"], case["ckv_cache"], case["kpe_cache"],
                                 case["block_tables"], case["seq_lens"], case["query_start_loc"], scale=case["scale"],
                                 ckv_scale=case["ckv_scale"], kpe_scale=case["kpe_scale"]).numpy()
    b = ref(case)
    assert np.allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("ckv_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("combined", [False, True])
def test_cache_mla_bytes_equal_encode_bytes(ckv_dtype, combined):
    """cache_mla stores encode_bytes(x / scale) at each slot, skips negative slots, touches nothing else."""
    gen = torch.Generator().manual_seed(10)
    nb, bs, r, p = 5, 16, 64, 16
    kpe_dtype = ckv_dtype if combined else torch.bfloat16
    if combined:
        kv = torch.zeros(nb, bs, r + p, dtype=ckv_dtype)
        ckv, kpe = kv[..., :r], kv[..., r:]
    else:
        ckv, kpe = torch.zeros(nb, bs, r, dtype=ckv_dtype), torch.zeros(nb, bs, p, dtype=kpe_dtype)
    before_c, before_p = ckv.view(torch.uint8).clone(), kpe.view(torch.uint8).clone()
    kv_c, k_pe = torch.randn(6, r, generator=gen).to(torch.bfloat16), torch.randn(6, p, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([3, 17, -1, 40, 79, 0])
    cs = 0.02 if ckv_dtype in FP8 else None
    ps = 0.03 if kpe_dtype in FP8 else None
    torch_mla.cache_mla(kv_c, k_pe, ckv, kpe, slots, cs, ps)
    for x, cache, s, before in ((kv_c, ckv, cs, before_c), (k_pe, kpe, ps, before_p)):
        want = before.clone()
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            v = x[t].float() / torch.tensor(1.0 if s is None else s)
            enc = fp8.encode_bytes(v, cache.dtype) if cache.dtype in FP8 else v.to(cache.dtype).view(torch.uint8)
            want[slot // bs, slot % bs] = enc
        assert torch.equal(cache.view(torch.uint8), want)


@pytest.mark.parametrize("rows", [1, 3])
def test_mla_lse_matches_the_float64_reference(rows):
    """``lse`` of hal.mla_decode: each row's natural-log log-sum-exp of its logits (emu's PyTorch path,
    also for GPU tensors); fp32 logits of magnitude < 40: 1e-4 absolute. The output is unchanged."""
    import hal
    from hal import reference as hal_reference

    g = torch.Generator().manual_seed(rows)
    r, p, bs, lens, h = 512, 64, 16, [40, 17, 64], 16
    nb = 14
    ckv = torch.randn(nb, bs, r, generator=g).to(torch.float8_e4m3fn)
    kpe = torch.randn(nb, bs, p, generator=g).to(torch.bfloat16)
    tables = torch.randperm(nb, generator=g)[:3 * 4].to(torch.int32).view(3, 4)
    seq = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(0, 3 * rows + 1, rows, dtype=torch.int32)
    qn = torch.randn(3 * rows, h, r, generator=g).to(torch.bfloat16)
    qp = torch.randn(3 * rows, h, p, generator=g).to(torch.bfloat16)
    kw = dict(scale=(r + p) ** -0.5, ckv_scale=0.05, kpe_scale=1.0, query_start_loc=qsl, max_query_len=rows)
    lse = torch.full((h, 3 * rows), float("nan")).t()
    out = hal.mla_decode(qn, qp, ckv, kpe, tables, seq, lse=lse, **kw)
    ref = torch.empty(3 * rows, h, dtype=torch.float64)
    hal_reference.mla_decode(qn, qp, ckv, kpe, tables, seq, qsl, scale=kw["scale"], ckv_scale=0.05, kpe_scale=1.0,
                             lse=ref)
    assert torch.isfinite(ref).all() and (lse.double() - ref).abs().max().item() <= 1e-4
    assert torch.equal(out, hal.mla_decode(qn, qp, ckv, kpe, tables, seq, **kw))
