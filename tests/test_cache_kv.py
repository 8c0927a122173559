"""hal.cache_kv on the emu pack: the bytes written equal the reference quantiser (ml_dtypes, with the
saturation hal promises) bit for bit; slots land where slot = block * block_size + offset says;
negative slots skip their token; nothing else in the cache changes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hal
import reference
from cases import FP8

pytestmark = pytest.mark.emu


def _caches(dtype, nb=6, hkv=3, bs=5, d=40):
    # A recognisable fill (byte 0x11 / value 0.5) shows any write outside the intended slots.
    if dtype in FP8:
        kc = torch.full((nb, hkv, bs, d), 0x11, dtype=torch.uint8).view(dtype)
    else:
        kc = torch.full((nb, hkv, bs, d), 0.5, dtype=dtype)
    return kc, kc.clone()


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_bytes_match_reference(dtype, per_head):
    g = torch.Generator().manual_seed(3)
    kc, vc = _caches(dtype)
    nb, hkv, bs, d = kc.shape
    t = 11
    fmax = torch.finfo(dtype).max
    k = torch.randn(t, hkv, d, generator=g) * 3
    v = torch.randn(t, hkv, d, generator=g) * 3
    k[0, 0, :6] = torch.tensor([1e9, -1e9, math.inf, -math.inf, math.nan, -0.0])  # saturation, NaN, -0
    ks = (torch.rand(hkv, generator=g) + 0.5) * 4 / fmax if per_head else 3.0 / fmax
    vs = torch.tensor(2.0 / fmax) if not per_head else (torch.rand(hkv, generator=g) + 0.5) * 4 / fmax
    slots = torch.tensor([0, 29, 7, -1, 12, 3, -5, 14, 20, 25, 9])  # two negative: skipped
    hal.cache_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    kref = reference.quantize(k, dtype, ks)
    vref = reference.quantize(v, dtype, vs)
    kbytes, vbytes = kc.view(torch.uint8).numpy(), vc.view(torch.uint8).numpy()
    written = np.zeros((nb, bs), dtype=bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, bs)
        written[b, o] = True
        assert (kbytes[b, :, o] == kref[i]).all(), f"token {i} K bytes differ"
        assert (vbytes[b, :, o] == vref[i]).all(), f"token {i} V bytes differ"
    untouched = ~written[:, None, :, None].repeat(hkv, 1).repeat(d, 3)
    assert (kbytes[untouched] == 0x11).all() and (vbytes[untouched] == 0x11).all()
    # the saturation edge and NaN, read back
    back = hal.fp8.decode(kc[0, 0, 0, :6]).tolist()
    s0 = ks[0].item() if per_head else ks
    m = torch.finfo(dtype).max
    assert back[:4] == [m, -m, m, -m] and math.isnan(back[4]) and back[5] == 0.0
    assert s0 > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_float_caches(dtype):
    kc, vc = _caches(dtype)
    k = torch.randn(4, 3, 40)
    v = torch.randn(4, 3, 40)
    slots = torch.tensor([5, 6, -1, 29])
    hal.cache_kv(k, v, kc, vc, slots)
    assert torch.equal(kc[1, :, 0], k[0].to(dtype)) and torch.equal(vc[5, :, 4], v[3].to(dtype))
    hal.cache_kv(k, v, kc, vc, slots, k_scale=2.0, v_scale=0.5)   # stored = x / scale
    assert torch.equal(kc[1, :, 0], (k[0] / 2.0).to(dtype)) and torch.equal(vc[1, :, 1], (v[1] / 0.5).to(dtype))


def test_round_trip_through_attention():
    """Write with cache_kv, read with paged_attention. Exactly (float32 arithmetic) the attention over
    the reference-quantised K/V; and within FP8 rounding of the attention over the real K/V: e4m3
    keeps 3 mantissa bits, so each stored value is off by at most 2^-4 relative, which bounds the
    output's relative L2 error at about that much (seen: ~3.5e-2)."""
    g = torch.Generator().manual_seed(5)
    hkv, h, d, bs, L = 2, 8, 64, 16, 64
    k = torch.randn(L, hkv, d, generator=g)
    v = torch.randn(L, hkv, d, generator=g)
    q = torch.randn(1, h, d, generator=g)
    kc = torch.empty(8, hkv, bs, d, dtype=torch.float8_e4m3fn)
    vc = torch.empty_like(kc)
    scale = k.abs().max().item() / 448
    hal.cache_kv(k, v, kc, vc, torch.arange(L) + 2 * bs, k_scale=scale, v_scale=scale)
    tables = torch.tensor([[2, 3, 4, 5]], dtype=torch.int32)
    out = hal.paged_attention(q, kc, vc, tables, torch.tensor([L], dtype=torch.int32), k_scale=scale,
                              v_scale=scale)
    qh = q.view(1, hkv, h // hkv, d)
    att = torch.softmax(qh @ k.permute(1, 2, 0) / d ** 0.5, -1) @ v.permute(1, 0, 2)
    ref = att.reshape(1, h, d)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2 ** -4, rel
    kq = torch.from_numpy(reference.quantize(k, torch.float8_e4m3fn, scale)).view(torch.float8_e4m3fn)
    vq = torch.from_numpy(reference.quantize(v, torch.float8_e4m3fn, scale)).view(torch.float8_e4m3fn)
    kd, vd = hal.fp8.decode(kq, scale), hal.fp8.decode(vq, scale)
    att_q = torch.softmax(qh @ kd.permute(1, 2, 0) / d ** 0.5, -1) @ vd.permute(1, 0, 2)
    assert torch.allclose(out, att_q.reshape(1, h, d), rtol=1e-5, atol=1e-6)


def test_slot_past_the_cache_is_an_error():
    kc, vc = _caches(torch.float8_e4m3fn)
    with pytest.raises(hal.ArgumentError, match=r"slot_mapping must be < num_blocks\*block_size = 30"):
        hal.cache_kv(torch.zeros(1, 3, 40), torch.zeros(1, 3, 40), kc, vc, torch.tensor([30]), k_scale=1.0,
                     v_scale=1.0)
