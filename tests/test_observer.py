"""hal.KVScaleObserver: running abs-max per layer and head, no host sync per call, scales for any
encoding, torch.compile(fullgraph=True) on the CPU, and scales that serve hal's ops."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

import hal
import reference
from hal import fp8
from hal.observer import KVScaleObserver
from hal.scales import KVScaleError, load_kv_scales

pytestmark = pytest.mark.emu

E4M3FN, E4M3FNUZ, E5M2 = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2


def _up(x: float) -> float:
    """The smallest float32 >= x: how the observer rounds a scale."""
    y = np.float32(x)
    return float(y if float(y) >= x else np.nextafter(y, np.float32(np.inf)))


def _batches(layers=3, heads=2, calls=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(5 + c, heads, 16, generator=gen) * (layer + 1) * (c + 1),
              torch.randn(5 + c, heads, 16, generator=gen) / (layer + 1)) for layer in range(layers)]
            for c in range(calls)]


def _absmax(batches, layer, role):
    return torch.stack([b[layer][role].abs().amax(dim=(0, 2)) for b in batches]).amax(dim=0)


def test_accumulates_absmax_over_calls_per_layer_and_head():
    batches = _batches()
    obs = KVScaleObserver(3)
    for calls in batches:
        for layer, (k, v) in enumerate(calls):
            obs.observe(layer, k.to(torch.bfloat16).float(), v)
    k_amax, v_amax = obs.absmax()
    assert obs.num_kv_heads == 2 and k_amax.shape == (3, 2)
    for layer in range(3):
        want_k = _absmax([[(c[i][0].to(torch.bfloat16).float(), c[i][1]) for i in range(3)] for c in batches], layer, 0)
        assert torch.equal(k_amax[layer], want_k)
        assert torch.equal(v_amax[layer], _absmax(batches, layer, 1))


@pytest.mark.parametrize("encoding", [E4M3FN, E4M3FNUZ, E5M2], ids=str)
@pytest.mark.parametrize("margin", [1.0, 1.25])
def test_scales_are_absmax_over_fmt_max(encoding, margin):
    batches = _batches()
    obs = KVScaleObserver(3, per_head=True)
    for calls in batches:
        for layer, (k, v) in enumerate(calls):
            obs(layer, k, v)
    fmax = fp8.encoding_of(encoding).max_finite
    per_head = obs.scales(encoding, margin=margin)
    per_tensor = obs.scales(encoding, margin=margin, per_head=False)
    assert per_head.encoding == fp8.encoding_of(encoding) and per_head.num_kv_heads == 2
    assert not per_tensor.per_head
    for layer in range(3):
        amax = _absmax(batches, layer, 0).double()
        s = per_head.k[layer].double()
        assert torch.allclose(s, amax * margin / fmax, rtol=2 ** -23)
        assert bool((amax * margin / s <= fmax).all())  # rounded up: the largest value fits
        assert per_tensor.k[layer] == float(per_head.k[layer].max())


def test_no_host_sync_per_call(monkeypatch):
    """observe() never reads a value back: every way of doing so raises while it runs."""
    obs = KVScaleObserver(2, 2)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)

    def forbidden(*a, **kw):
        raise AssertionError("observe() synchronised with the host")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    obs.observe(0, k, v)
    obs.observe(1, k, v)
    monkeypatch.undo()
    assert torch.equal(obs.absmax()[0][0], k.abs().amax(dim=(0, 2)))


@pytest.mark.slow
def test_under_torch_compile_fullgraph():
    """fullgraph=True fails on any graph break, a host sync included; the maxima match eager."""
    compiled_obs, eager_obs = KVScaleObserver(2, 2), KVScaleObserver(2, 2)

    @torch.compile(fullgraph=True)
    def step(k0, v0, k1, v1):
        compiled_obs.observe(0, k0, v0)
        compiled_obs(1, k1, v1)
        return k0 * 2

    for calls in _batches(layers=2, calls=3):
        (k0, v0), (k1, v1) = calls
        step(k0, v0, k1, v1)
        eager_obs(0, k0, v0)
        eager_obs(1, k1, v1)
    for got, want in zip(compiled_obs.absmax(), eager_obs.absmax()):
        assert torch.equal(got, want)
    assert compiled_obs.scales() == eager_obs.scales()


def test_never_observed_layers():
    obs = KVScaleObserver(4)
    obs.observe(1, torch.ones(2, 1, 8), torch.ones(2, 1, 8))
    with pytest.raises(KVScaleError) as e:
        obs.scales()
    assert "KVScaleObserver" in str(e.value) and "key 'layer 0'" in str(e.value) and "[0, 2, 3]" in str(e.value)
    with pytest.raises(KVScaleError, match="nothing observed"):
        KVScaleObserver(2).absmax()


def test_on_missing_one_fills_and_logs(caplog):
    obs = KVScaleObserver(3)
    obs.observe(1, torch.ones(2, 1, 8), torch.ones(2, 1, 8))
    with caplog.at_level(logging.WARNING, logger="hal"):
        s = obs.scales(on_missing="one")
    assert s.k == (1.0, _up(1.0 / 448), 1.0) and "layers [0, 2] were never observed" in caplog.text
    assert KVScaleObserver(2).scales(on_missing="one").k == (1.0, 1.0)


@pytest.mark.parametrize("bad,what", [(math.nan, "held NaN"), (math.inf, "held an infinity"),
                                      (-math.inf, "held an infinity")])
def test_nan_and_inf_are_reported(bad, what):
    obs = KVScaleObserver(2)
    v = torch.randn(3, 2, 8)
    v[1, 1, 3] = bad
    obs.observe(0, torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    obs.observe(1, torch.randn(3, 2, 8), v)
    obs.observe(1, torch.randn(3, 2, 8), torch.randn(3, 2, 8))  # a later finite call does not hide it
    with pytest.raises(KVScaleError) as e:
        obs.scales()
    assert "key 'layer 1 v_scale'" in str(e.value) and what in str(e.value)


def test_all_zero_layer_is_an_error():
    obs = KVScaleObserver(1)
    obs.observe(0, torch.zeros(3, 2, 8), torch.randn(3, 2, 8))
    with pytest.raises(KVScaleError, match="key 'layer 0 k_scale'.*every observed key was 0"):
        obs.scales()


def test_empty_batches_and_reset():
    obs = KVScaleObserver(1, 2)
    obs.observe(0, torch.empty(0, 2, 8), torch.empty(0, 2, 8))
    with pytest.raises(KVScaleError, match="never observed"):
        obs.scales()
    obs.observe(0, torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    assert obs.scales().k == (_up(1.0 / 448),)
    obs.reset()
    with pytest.raises(KVScaleError, match="never observed"):
        obs.scales()


def test_argument_errors():
    with pytest.raises(ValueError, match="num_layers"):
        KVScaleObserver(0)
    obs = KVScaleObserver(2, 2)
    with pytest.raises(ValueError, match="layer must be an int in"):
        obs.observe(2, torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        obs.observe(0, torch.ones(1, 3, 8), torch.ones(1, 3, 8))
    with pytest.raises(ValueError, match="value must be"):
        obs.observe(0, torch.ones(1, 2, 8), torch.ones(2, 8))
    with pytest.raises(KVScaleError, match="margin"):
        obs.scales(margin=0.0)
    with pytest.raises(KVScaleError, match="on_missing"):
        obs.scales(on_missing="zero")


def test_calibrated_scales_serve_hal_ops(tmp_path):
    """Observe K/V, write the scales as JSON, load them, convert for an e4m3fnuz cache, run hal's
    ops: every cached value is the real one within half an FP8 ulp (no saturation: absmax lands on
    the format's max), and attention matches the float64 reference on the cache's bytes."""
    gen = torch.Generator().manual_seed(3)
    hkv, d, bs, t = 2, 64, 16, 32
    k = torch.randn(t, hkv, d, generator=gen) * torch.tensor([900.0, 3.0]).reshape(1, 2, 1)
    v = torch.randn(t, hkv, d, generator=gen) * 0.01
    obs = KVScaleObserver(1, per_head=True)
    obs.observe(0, k[:20], v[:20])
    obs.observe(0, k[20:], v[20:])
    obs.scales(E4M3FN).to_json(tmp_path / "calibrated.json")
    scales = load_kv_scales(tmp_path / "calibrated.json", num_layers=1)
    key_cache = torch.zeros(2, hkv, bs, d, dtype=E4M3FNUZ)
    value_cache = torch.zeros_like(key_cache)
    ks, vs = scales.for_cache(0, key_cache)
    assert torch.equal(ks, 2 * scales.k[0])
    hal.cache_kv(k, v, key_cache, value_cache, torch.arange(t), k_scale=ks, v_scale=vs)
    enc = fp8.encoding_of(E4M3FNUZ)
    for cache, x, s in ((key_cache, k, ks), (value_cache, v, vs)):
        held = torch.from_numpy(reference.cache_values(cache)).permute(0, 2, 1, 3).reshape(-1, hkv, d)[:t]
        held = held * s.double().reshape(1, -1, 1)
        tol = 2.0 ** -(enc.mantissa_bits + 1) * x.double().abs() + s.double().reshape(1, -1, 1) * enc.min_subnormal / 2
        assert bool(((held - x.double()).abs() <= tol).all())
    q = torch.randn(1, 4, d, generator=gen) / 300
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    out = hal.paged_attention(q, key_cache, value_cache, tables, lens, k_scale=ks, v_scale=vs, pack="emu")
    ref = reference.paged_attention(q, key_cache, value_cache, tables, lens, k_scale=ks, v_scale=vs)
    assert np.allclose(out.double().numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
