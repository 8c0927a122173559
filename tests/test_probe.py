"""hal-probe: its declarations are the ones dispatch checks for the target, and its default view is a
short report that fits an 80-column terminal; the detail is in ``--verbose`` and ``--json``."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from rich.console import Console

import hal
from hal import registry
from hal.cli import probe
from hal.fp8 import FP8_DTYPES
from hal.pack import CallKey
from hal.targets import parse

pytestmark = pytest.mark.emu

ROCM = registry.by_name("rocm")
HALF = (torch.float16, torch.bfloat16)
CACHES = (*HALF, torch.float32, *sorted(FP8_DTYPES, key=str))
TARGETS = ("cpu", "sm_90", "gfx942", "gfx90a")


def _run(capsys, monkeypatch, target: str, *argv: str, columns: int = 80) -> str:
    monkeypatch.setenv("HAL_TARGET", target)
    monkeypatch.setenv("COLUMNS", str(columns))
    capsys.readouterr()
    assert probe.main(list(argv)) == 0
    return capsys.readouterr().out


def _rocm_declaration(capsys, monkeypatch, arch: str) -> dict:
    report = json.loads(_run(capsys, monkeypatch, arch, "--json", "--no-smoke"))
    return next(p for p in report["packs"] if p["name"] == "rocm")["supports"]


# ---------------------------------------------------------------------------------------------------
# one declaration per pack and target

@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_json_declaration_is_what_dispatch_admits(arch, capsys, monkeypatch):
    shown = _rocm_declaration(capsys, monkeypatch, arch)
    t = parse(arch)
    assert shown == {op: s.as_dict() for op, s in ROCM.supports(t).items()}
    for op, decl in shown.items():
        for cache in CACHES:
            query = cache if cache in HALF else torch.bfloat16  # a 16-bit cache needs the query's dtype
            heads = ROCM.supports(t)[op].head_sizes
            key = CallKey(op, "cuda", query, cache, 128 if 128 in heads else heads[0], 16, 4)  # mla_decode: R = 512
            admitted = ROCM.reasons(key, t) == []
            assert admitted == (str(cache).removeprefix("torch.") in decl["cache_dtypes"]), (op, cache)


def test_json_declaration_follows_the_arch(capsys, monkeypatch):
    d90a = _rocm_declaration(capsys, monkeypatch, "gfx90a")
    d942 = _rocm_declaration(capsys, monkeypatch, "gfx942")
    for op in ("paged_attention", "cache_kv"):
        assert "float8_e4m3fn" in d90a[op]["cache_dtypes"] and "float8_e5m2" in d90a[op]["cache_dtypes"]
        assert "float8_e4m3fn" not in d942[op]["cache_dtypes"]
        assert "float8_e4m3fnuz" in d942[op]["cache_dtypes"]


# ---------------------------------------------------------------------------------------------------
# the default view: 80 columns, short, no word broken

def _tokens(text: str) -> set[str]:
    return set(re.split(r"[\s│┃┏┓┗┛┡┩└┘├┤┼┬┴╇╈━─═]+", text)) - {""}


def _render(report: dict, width: int, verbose: bool = False) -> str:
    out = io.StringIO()
    probe.render(report, Console(file=out, width=width, color_system=None), verbose=verbose)
    return out.getvalue()


@pytest.mark.parametrize("target", TARGETS)
def test_default_view_fits_80_columns(target, capsys, monkeypatch):
    lines = _run(capsys, monkeypatch, target, columns=80).splitlines()  # as a terminal shows it
    assert max(map(len, lines)) <= 80 and len(lines) <= 40, "\n".join(lines)
    assert any(line.startswith("smoke test PASS") for line in lines), "\n".join(lines)
    for name in ("cuda", "rocm", "emu"):
        assert any(line.split()[:1] == [name] for line in lines), "\n".join(lines)
    # a word broken across lines leaves fragments that the same report, unwrapped, does not contain
    report = probe.collect(smoke=False)
    narrow, wide = _render(report, 80), _render(report, 1000)
    assert _tokens(narrow) <= _tokens(wide), _tokens(narrow) - _tokens(wide)


@pytest.mark.parametrize("target", TARGETS)
def test_detail_is_in_verbose_not_in_the_default_view(target, capsys, monkeypatch):
    default = _run(capsys, monkeypatch, target, "--no-smoke")
    verbose = _run(capsys, monkeypatch, target, "--verbose", "--no-smoke")
    flat = " ".join(verbose.split())
    assert "VGPRs+AGPRs" in flat and "occupancy_design" in flat  # rocm build detail
    assert "query_dtypes" in flat and "max_gqa_ratio" in flat    # the declarations
    assert "VGPRs+AGPRs" not in default and "query_dtypes" not in default
    assert len(verbose.splitlines()) > len(default.splitlines())


def test_markup_like_text_is_shown_as_is(capsys, monkeypatch):
    out = _run(capsys, monkeypatch, "gfx942:sramecc+:xnack-", "--no-smoke", columns=200)
    assert "[sramecc+, xnack-]" in out


def test_help_names_the_views(capsys):
    with pytest.raises(SystemExit) as exc:
        probe.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--verbose" in text and "--json" in text and "--no-smoke" in text


def test_smoke_test_runs_every_declared_op_with_an_example_and_a_reference():
    """paged_attention is the timed headline; mla_decode (after hal.cache_mla) is checked too, and a
    failing op fails the whole smoke test."""
    sm = probe.collect()["smoke_test"]
    assert sm["status"] == "PASS", sm
    others = {o["op"]: o for o in sm["ops"]}
    assert set(others) == {name for name, d in hal.ops.OPS.items()
                           if name != "paged_attention" and d.example is not None and d.reference is not None}
    assert others["mla_decode"]["status"] == "PASS" and others["mla_decode"]["rel_l2_vs_float64"] < 5e-3
