"""hal.compat's entry points have exactly the real libraries' parameters: names, order, kinds and
defaults, compared with the signatures recorded in hal/compat/signatures.json (each read from the
named release by tools/compat_signatures.py). Where those releases sit in $COMPAT_WHEELS (or
.whl), the record itself is re-read from them, so a stale record fails too."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
from importlib import resources
from pathlib import Path

import pytest

RECORD = json.loads(resources.files("hal.compat").joinpath("signatures.json").read_text())
ROOT = Path(__file__).resolve().parent.parent


def _object(target: str):
    module, qual = target.split(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _ours(obj, want: list[dict]) -> list[dict]:
    """Our parameters in the record's terms. A recorded default that names a constant (vLLM's
    ``fa_version=DEFAULT_FA_VERSION``) matches when our module defines that name with our default."""
    module = importlib.import_module(obj.__module__)
    named = {p["name"]: p["default"] for p in want}
    out = []
    for p in inspect.signature(obj).parameters.values():
        if p.name == "self":
            continue
        default = None if p.default is inspect.Parameter.empty else ast.unparse(ast.parse(repr(p.default), mode="eval").body)
        rec = named.get(p.name)
        if rec is not None and rec.isidentifier() and rec not in ("None", "True", "False") \
                and getattr(module, rec, object()) == p.default:
            default = rec
        out.append({"name": p.name, "kind": p.kind.name, "default": default})
    return out


def test_every_compat_entry_point_is_recorded():
    assert len(RECORD["entries"]) >= 13
    for target in RECORD["entries"]:
        assert callable(_object(target)), target


@pytest.mark.parametrize("target", sorted(RECORD["entries"]))
def test_signature_matches_the_library(target):
    want = RECORD["entries"][target]["params"]
    got = _ours(_object(target), want)
    assert [p["name"] for p in got] == [p["name"] for p in want], target
    assert got == want, target


def test_the_record_matches_the_releases_where_they_are_here():
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import compat_signatures
    finally:
        sys.path.pop(0)
    folder = Path(os.environ.get("COMPAT_WHEELS", ROOT / ".whl"))
    found = compat_signatures.extract(folder) if folder.is_dir() else {}
    if not found:
        pytest.skip(f"none of the recorded releases is in {folder} (set COMPAT_WHEELS)")
    for target, entry in found.items():
        assert RECORD["entries"][target]["params"] == entry["params"], target
