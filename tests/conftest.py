"""Per-pack markers: a test marked with a pack that cannot run here is skipped with the pack's own
reasons (``hal.packs()``); ``gpu`` tests skip without a GPU visible to torch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py, tests/cases.py

import hal  # noqa: E402
from hal import dispatch, targets, validate  # noqa: E402


def _pack_reasons(name: str) -> str | None:
    for p in hal.packs():
        if p.NAME == name:
            return None if p.availability.ok else "; ".join(p.availability.reasons)
    return f"the {name} pack is not in this build"


def pytest_runtest_setup(item):
    for name in ("cuda", "rocm", "emu"):
        if item.get_closest_marker(name):
            why = _pack_reasons(name)
            if why:
                pytest.skip(f"{name} pack unavailable: {why}")
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a GPU visible to torch")


@pytest.fixture(autouse=True)
def _fresh_hal_state(monkeypatch):
    """Every test starts with no HAL_* variables and empty dispatch caches."""
    for k in list(os.environ):
        if k.startswith("HAL_"):
            monkeypatch.delenv(k)
    dispatch.decide.cache_clear()
    dispatch._announce.cache_clear()
    targets._detect.cache_clear()
    validate._warned_unscaled.clear()
    yield
    dispatch.decide.cache_clear()
    dispatch._announce.cache_clear()
    targets._detect.cache_clear()
