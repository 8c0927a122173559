"""hal.fp8 against ml_dtypes, bit for bit: all 256 bytes of every encoding, dense float sweeps
(round-to-nearest-even, subnormals, the saturation edge), and the fn -> fnuz move."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import hal
from hal import fp8
from hal.targets import parse

pytestmark = pytest.mark.emu

ML = {
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
}
ALL = list(ML)
MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0, torch.float8_e5m2: 57344.0,
       torch.float8_e5m2fnuz: 57344.0}


def _same(a, b) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_decode_all_256_bytes_match_ml_dtypes(dtype):
    ref = np.arange(256, dtype=np.uint8).view(ML[dtype]).astype(np.float64)
    table = fp8.decode_table(dtype, torch.float64).numpy()
    assert _same(table, ref).all()
    # decode() goes through the same table, in float32 (every FP8 value is exact there)
    q = torch.arange(256, dtype=torch.uint8).view(dtype)
    assert _same(fp8.decode(q).numpy().astype(np.float64), ref).all()


@pytest.mark.parametrize("fast", [True, False], ids=["verified-torch-cast", "table"])
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_decode_values_both_paths_match_ml_dtypes(dtype, fast, monkeypatch):
    if not fast:
        monkeypatch.setattr(fp8, "_torch_cast_is_exact", lambda *a: False)
    elif not fp8._torch_cast_is_exact(dtype, "cpu"):
        pytest.skip(f"this torch's {dtype} cast differs from the table on some byte; the table is used")
    ref = np.arange(256, dtype=np.uint8).view(ML[dtype]).astype(np.float64)
    q = torch.arange(256, dtype=torch.uint8).view(dtype).repeat(3).view(3, 256).t()  # strided input
    got = fp8.decode_values(q).t().numpy().astype(np.float64)
    assert all(_same(row, ref).all() for row in got)


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_max_finite_and_bytes(dtype):
    enc = fp8.encoding_of(dtype)
    assert enc.max_finite == MAX[dtype] == float(ml_dtypes.finfo(ML[dtype]).max)
    assert enc.min_subnormal == float(ml_dtypes.finfo(ML[dtype]).smallest_subnormal)


def _sweep(dtype) -> torch.Tensor:
    enc = fp8.encoding_of(dtype)
    g = torch.Generator().manual_seed(1)
    # every representable value and every midpoint between neighbours (the ties), +-1 float32 ulp
    vals = fp8.decode_table(dtype, torch.float64)
    finite = torch.sort(vals[torch.isfinite(vals)]).values.unique()
    mids = (finite[1:] + finite[:-1]) / 2
    pts = torch.cat([finite, mids]).to(torch.float32)
    around = torch.cat([pts, torch.nextafter(pts, torch.tensor(math.inf)), torch.nextafter(pts, torch.tensor(-math.inf))])
    dense = torch.linspace(-1.5 * enc.max_finite, 1.5 * enc.max_finite, 100_001)
    tiny = torch.randn(50_000, generator=g) * enc.min_subnormal * 6      # subnormal range
    wide = torch.randn(50_000, generator=g) * enc.max_finite / 3
    return torch.cat([around, dense, tiny, wide])


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_encode_is_round_to_nearest_even_with_saturation(dtype):
    x = _sweep(dtype)
    ours = fp8.encode_bytes(x, dtype).numpy()
    fmax = MAX[dtype]
    with np.errstate(invalid="ignore"):  # NaN inputs: ml_dtypes warns while casting them
        ref = np.clip(x.numpy(), -fmax, fmax).astype(ML[dtype]).view(np.uint8)  # ml_dtypes itself overflows
    mismatch = ours != ref
    assert not mismatch.any(), f"{mismatch.sum()} mismatches, e.g. x={x.numpy()[mismatch][:5]}"


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_saturation_nan_and_zero(dtype):
    enc = fp8.encoding_of(dtype)
    x = torch.tensor([1e30, -1e30, math.inf, -math.inf, math.nan, 0.0, -0.0, enc.max_finite * 1.06])
    got = fp8.decode(fp8.encode(x, dtype)).tolist()
    m = enc.max_finite
    assert got[:4] == [m, -m, m, -m]
    assert math.isnan(got[4])
    assert got[5] == 0.0 and got[7] == m
    raw = fp8.encode_bytes(x, dtype)
    if enc.fnuz:
        assert raw[6].item() == 0x00, "fnuz has no negative zero: 0x80 is its NaN"
    else:
        assert raw[6].item() == 0x80


def test_encode_divides_by_scale_in_float32_and_broadcasts_per_head():
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(11))
    s = torch.tensor([0.5, 0.01, 2.0])
    q = fp8.encode(x, torch.float8_e4m3fn, s, head_dim=1)
    expect = fp8.encode_bytes(x.float() / s.view(1, 3, 1), torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expect)
    back = fp8.decode(q, s, torch.float32, head_dim=1)
    # e4m3 keeps 3 mantissa bits (half an ulp: 2^-4 relative); below its smallest normal the step is
    # the subnormal quantum 2^-9, so the absolute error there is at most scale * 2^-10.
    err = (back - x).abs()
    bound = 2 ** -4 * x.abs() + s.view(1, 3, 1) * 2 ** -10
    assert bool((err <= bound).all()), float((err / bound).max())


def test_fn_to_fnuz_bit_for_bit_over_all_bytes():
    fn = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    fnuz, s = fp8.fn_to_fnuz(fn, 0.25)
    assert s == 0.5
    before = fp8.decode(fn, 0.25).numpy()
    after = fp8.decode(fnuz, s).numpy()
    raw = fnuz.view(torch.uint8).numpy()
    for b in range(256):
        if b == 0x80:                           # -0 in fn -> +0 (0x80 is NaN in fnuz)
            assert raw[b] == 0 and after[b] == 0.0
        elif b & 0x7F == 0x7F:                  # NaN stays NaN
            assert raw[b] == 0x80 and math.isnan(after[b])
        else:                                   # same byte, same value once the scale doubles
            assert raw[b] == b and after[b] == before[b]
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8.fn_to_fnuz(fnuz)


def test_uint8_is_refused_with_a_hint():
    with pytest.raises(TypeError, match=r"view\(torch.float8_e4m3fn\)"):
        fp8.encoding_of(torch.uint8)


@pytest.mark.parametrize("arch,e4m3,e5m2", [
    ("gfx942", torch.float8_e4m3fnuz, torch.float8_e5m2fnuz),
    ("gfx950", torch.float8_e4m3fn, torch.float8_e5m2),
    ("sm_90", torch.float8_e4m3fn, torch.float8_e5m2),
    ("sm_80", torch.float8_e4m3fn, torch.float8_e5m2),   # no FP8 hardware: emu, OCP default
    ("cpu", torch.float8_e4m3fn, torch.float8_e5m2),
])
def test_native_encodings(arch, e4m3, e5m2):
    t = parse(arch)
    assert fp8.native_e4m3(t) == e4m3
    assert fp8.native_e5m2(t) == e5m2
    assert fp8.kv_cache_dtype("fp8", target=t) == e4m3
    assert fp8.kv_cache_dtype("fp8_e4m3", target=t) == e4m3
    assert fp8.kv_cache_dtype("fp8_e5m2", target=t) == e5m2


def test_kv_cache_dtype_strings():
    assert fp8.kv_cache_dtype("auto", torch.float16) == torch.float16
    assert fp8.kv_cache_dtype("fp8_e4m3fnuz") == torch.float8_e4m3fnuz
    assert fp8.kv_cache_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp9'"):
        fp8.kv_cache_dtype("fp9")


# -- scale arguments ------------------------------------------------------------------------------
X = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(3))  # [tokens, heads, head_size]


@pytest.mark.parametrize("scale,problem", [
    (0.0, "got 0.0"), (-0.5, "got -0.5"), (math.nan, "got nan"), (math.inf, "got inf"), (-math.inf, "got -inf"),
    (1e39, "1e+39, which becomes inf in float32"), (1e-50, "1e-50, which becomes 0.0 in float32"),
    (torch.tensor(0.0), "got 0.0"), (torch.tensor(-2.0), "got -2.0"), (torch.tensor(math.nan), "got nan"),
    (torch.tensor(1e39, dtype=torch.float64), "got inf (in float32)"),
], ids=repr)
@pytest.mark.parametrize("fn", ["encode", "decode"])
def test_bad_scale_is_refused_naming_scale(fn, scale, problem):
    """A zero scale used to saturate every value silently (x / 0 = inf); NaN, inf and negative ones
    are as wrong, and so is a float that float32 (what the division is done in) cannot hold."""
    q = fp8.encode(X, torch.float8_e4m3fn)
    with pytest.raises(hal.ArgumentError) as e:
        fp8.encode(X, torch.float8_e4m3fn, scale) if fn == "encode" else fp8.decode(q, scale)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert f"hal.fp8.{fn}: scale must be finite and > 0" in msg and problem in msg, msg


@pytest.mark.parametrize("fn", ["encode", "decode"])
def test_bad_per_head_scale_is_refused_naming_the_head(fn):
    s = torch.tensor([0.5, 0.0, 2.0])
    q = fp8.encode(X, torch.float8_e4m3fn)
    with pytest.raises(hal.ArgumentError) as e:
        fp8.encode(X, torch.float8_e4m3fn, s, head_dim=1) if fn == "encode" else fp8.decode(q, s, head_dim=1)
    assert "scale must be finite and > 0" in str(e.value) and "head 1" in str(e.value)
    assert "[0.5, 0.0, 2.0]" in str(e.value)


@pytest.mark.parametrize("length", [1, 2, 4, 8])
def test_per_head_scale_of_the_wrong_length(length):
    """A per-head scale has one entry per index of x's head_dim axis; any other length (even one
    that torch would broadcast, like 1, or one that matches another axis) is named, not broadcast."""
    with pytest.raises(hal.ArgumentError) as e:
        fp8.encode(X, torch.float8_e4m3fn, torch.full((length,), 0.5), head_dim=1)
    msg = str(e.value)
    assert "hal.fp8.encode: scale" in msg and "3 entries" in msg and "x.shape[1]" in msg, msg
    assert f"got {length} entr" in msg, msg


def test_per_head_scale_needs_head_dim():
    with pytest.raises(hal.ArgumentError) as e:
        fp8.encode(X, torch.float8_e4m3fn, torch.full((3,), 0.5))
    assert "head_dim" in str(e.value) and "3 entries" in str(e.value)
    with pytest.raises(hal.ArgumentError, match="head_dim must be"):
        fp8.encode(X, torch.float8_e4m3fn, torch.full((3,), 0.5), head_dim=3)
    with pytest.raises(hal.ArgumentError, match=r"a 1-d per-head tensor; got a tensor of shape \(5, 3, 1\)"):
        fp8.encode(X, torch.float8_e4m3fn, torch.full((5, 3, 1), 0.5))


def test_good_scales_still_work():
    for s in (0.5, torch.tensor(0.5), torch.tensor([0.5]), torch.tensor(0.5, dtype=torch.float64)):
        assert torch.equal(fp8.encode(X, torch.float8_e4m3fn, s).view(torch.uint8),
                           fp8.encode_bytes(X / 0.5, torch.float8_e4m3fn))
    s = torch.tensor([0.5, 0.25, 2.0])
    assert torch.equal(fp8.encode(X, torch.float8_e4m3fn, s, head_dim=-2).view(torch.uint8),
                       fp8.encode_bytes(X / s.view(1, 3, 1), torch.float8_e4m3fn))


def test_scale_values_on_a_device_are_checked_only_under_hal_debug(monkeypatch):
    """Reading a device tensor's values is a sync: without HAL_DEBUG only shapes are checked there.
    A meta tensor stands in for a GPU one: it has a shape but no values, so reading any fails."""
    monkeypatch.delenv("HAL_DEBUG", raising=False)
    like = torch.empty(5, 3, 8, device="meta")
    assert fp8._as_scale_tensor(torch.empty(3, device="meta"), like, 1, "encode").shape == (1, 3, 1)
    with pytest.raises(hal.ArgumentError, match="3 entries"):  # shapes are still checked
        fp8._as_scale_tensor(torch.empty(4, device="meta"), like, 1, "encode")
    monkeypatch.setenv("HAL_DEBUG", "1")
    with pytest.raises((NotImplementedError, RuntimeError)):  # now it does read the values
        fp8._as_scale_tensor(torch.empty(3, device="meta"), like, 1, "encode")


@pytest.mark.gpu
def test_scale_checks_do_not_sync_on_a_gpu(monkeypatch):
    monkeypatch.delenv("HAL_DEBUG", raising=False)
    x = X.cuda()
    s, s0, bad = (torch.tensor(v, device="cuda") for v in ([0.5, 0.25, 2.0], 0.5, [0.5, 0.0, 2.0]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # made before: copying a host value to the GPU syncs
    try:
        fp8._as_scale_tensor(s, x, 1, "encode")
        fp8._as_scale_tensor(s0, x, None, "encode")
        fp8._as_scale_tensor(bad, x, 1, "encode")  # values unread without HAL_DEBUG
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setenv("HAL_DEBUG", "1")
    with pytest.raises(hal.ArgumentError, match="head 1"):
        fp8.encode(x, torch.float8_e4m3fn, bad, head_dim=1)
