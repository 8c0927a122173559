"""Target detection overrides and dispatch: native packs first, emu last, reasons for every
rejection, one logged warning per fallback, HAL_STRICT, forcing, caching."""

from __future__ import annotations

import warnings

import pytest
import torch

import hal
from cases import make_case
from hal import dispatch, registry
from hal.pack import Availability, OpSupport, Pack
from hal.targets import parse

pytestmark = pytest.mark.emu


@pytest.mark.parametrize("text,vendor,arch,warp,feats,fp8", [
    ("cpu", "cpu", None, 1, set(), ()),
    ("sm_90", "cuda", "sm_90", 32, set(), (torch.float8_e4m3fn, torch.float8_e5m2)),
    ("sm_90a", "cuda", "sm_90", 32, {"arch-specific"}, (torch.float8_e4m3fn, torch.float8_e5m2)),
    ("sm_80", "cuda", "sm_80", 32, set(), ()),
    ("gfx942", "rocm", "gfx942", 64, set(), (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)),
    ("gfx942:sramecc+:xnack-", "rocm", "gfx942", 64, {"sramecc+", "xnack-"}, (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)),
    ("gfx90a", "rocm", "gfx90a", 64, set(), ()),
    ("gfx950", "rocm", "gfx950", 64, set(), (torch.float8_e4m3fn, torch.float8_e5m2)),
])
def test_target_strings(text, vendor, arch, warp, feats, fp8, monkeypatch):
    monkeypatch.setenv("HAL_TARGET", text)
    t = hal.target()
    assert (t.vendor, t.warp_size, set(t.features), t.fp8_encodings) == (vendor, warp, feats, fp8)
    if arch:
        assert t.arch == arch
    assert t.source == "HAL_TARGET"
    assert t.vendor in t.describe()


@pytest.mark.parametrize("bad", ["sm90", "gfx", "mi300", "cuda"])
def test_bad_target_strings(bad):
    with pytest.raises(ValueError, match="HAL_TARGET"):
        parse(bad)


def test_detection_here_needs_no_gpu():
    t = hal.target()
    assert t.vendor in ("cpu", "cuda", "rocm") and t.source != "HAL_TARGET"


class FakeNative(Pack):
    """A native pack for sm_90 that serves head size 128 only, for testing the dispatcher."""

    NAME = "fake"
    DESCRIPTION = "test double"
    VENDORS = frozenset({"cuda"})
    SUPPORTS = {"paged_attention": OpSupport(
        query_dtypes=frozenset({torch.bfloat16}), cache_dtypes=frozenset({torch.float8_e4m3fn}),
        head_sizes=(128,), block_sizes=(16,), devices=frozenset({"cpu"}), features=frozenset())}

    def __init__(self, ok=True):
        self.ok = ok
        self.calls = 0

    def _probe(self):
        return Availability(self.ok, () if self.ok else ("no driver in this test",))

    def impl(self, op):
        def run(call):  # packs receive the op's frozen call record
            self.calls += 1
            call.out.fill_(7.0)
        return run


@pytest.fixture
def fake(monkeypatch):
    p = FakeNative()
    emu = registry.by_name("emu")
    monkeypatch.setattr(registry, "packs", lambda: (p, emu))
    monkeypatch.setenv("HAL_TARGET", "sm_90")
    return p


def _call(case, **kw):
    return hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               k_scale=case.k_scale, v_scale=case.v_scale, **kw)


def _fallbacks(fn) -> list[str]:
    """The FallbackWarning messages ``fn()`` issues (warnings are what a user sees by default)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if issubclass(w.category, hal.FallbackWarning)]


def test_native_pack_is_preferred(fake):
    case = make_case(seq_lens=[5, 9], head_size=128)
    outs = []
    assert not _fallbacks(lambda: outs.append(_call(case)))
    assert fake.calls == 1 and bool((outs[0] == 7).all())


def test_fallback_to_emu_warns_once_with_reasons(fake):
    case = make_case(seq_lens=[5, 9], head_size=64, block_size=8)
    msgs = _fallbacks(lambda: (_call(case), _call(case)))
    assert len(msgs) == 1 and "falls back" in msgs[0]
    assert "fake: head_size 64 is not supported (supported: 128)" in msgs[0]
    assert "fake: block_size 8 is not supported (supported: 16)" in msgs[0]
    assert fake.calls == 0


def test_strict_turns_fallback_into_error(fake, monkeypatch):
    monkeypatch.setenv("HAL_STRICT", "1")
    case = make_case(seq_lens=[5], head_size=64)
    with pytest.raises(hal.NotSupportedError, match="HAL_STRICT=1 makes this fallback an error"):
        _call(case)


def test_unavailable_native_pack_is_reported(monkeypatch):
    p = FakeNative(ok=False)
    emu = _emu()
    monkeypatch.setattr(registry, "packs", lambda: (p, emu))
    monkeypatch.setenv("HAL_TARGET", "sm_90")
    case = make_case(seq_lens=[5], head_size=128)
    assert any("fake: no driver in this test" in m for m in _fallbacks(lambda: _call(case)))


def _emu():
    from hal.kernelpacks.emu.pack import PACK
    return PACK


def test_forced_pack_never_falls_back(fake):
    case = make_case(seq_lens=[5], head_size=64)
    with pytest.raises(hal.NotSupportedError) as err:
        _call(case, pack="fake")
    text = str(err.value)
    assert "forced pack 'fake'" in text and "head_size 64 is not supported" in text
    out = _call(case, pack="emu")
    assert torch.isfinite(out.float()).all()


def test_forced_by_environment(fake, monkeypatch):
    monkeypatch.setenv("HAL_PACK", "emu")
    case = make_case(seq_lens=[5], head_size=128)
    _call(case)
    assert fake.calls == 0


def test_not_native_packs_are_skipped_with_reason(fake, monkeypatch):
    monkeypatch.setenv("HAL_TARGET", "gfx942")
    case = make_case(seq_lens=[5], head_size=128)
    d = hal.explain(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert d.pack.NAME == "emu" and d.fallback
    assert "`fake` is not native for this target" in d.text()
    assert "serves cuda targets, not rocm:gfx942" in d.text()


def test_no_native_pack_in_build_is_a_visible_fallback_on_gpu_targets(monkeypatch):
    monkeypatch.setenv("HAL_TARGET", "gfx942")
    case = make_case(seq_lens=[5], cache_dtype=torch.float8_e4m3fnuz)
    text = " ".join(_fallbacks(lambda: _call(case)))
    assert "falls back to the emu pack on rocm:gfx942" in text


def test_cpu_target_uses_emu_silently(monkeypatch):
    monkeypatch.setenv("HAL_TARGET", "cpu")
    case = make_case(seq_lens=[5])
    assert not _fallbacks(lambda: _call(case))


def test_decisions_are_cached(fake):
    case = make_case(seq_lens=[5], head_size=128)
    _call(case)
    before = dispatch.decide.cache_info()
    _call(case)
    after = dispatch.decide.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_every_pack_has_a_declaration_and_availability():
    for p in hal.packs():
        assert p.availability.ok in (True, False)
        if p.availability.ok:
            for op in ("paged_attention", "cache_kv"):
                assert isinstance(p.SUPPORTS[op], OpSupport)
    assert hal.packs()[-1].NAME == "emu"
