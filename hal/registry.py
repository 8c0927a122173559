"""Finding packs: the in-tree ones under ``hal.kernelpacks`` plus out-of-tree ones from the entry-point
group ``hal.packs``. Each pack module exposes ``PACK``, a :class:`hal.pack.Pack` instance. Loading is
lazy and never raises: a pack that fails to import is listed with the reason."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from importlib.metadata import entry_points

from hal import diagnostics
from hal.pack import Availability, Pack

# Native packs first (in the order they are tried), emu last: it serves every target.
IN_TREE = ("cuda", "rocm", "emu")
FLOOR = "emu"


class Broken(Pack):
    """Stands in for a pack whose module failed to import, so the failure is reported, not lost."""

    DESCRIPTION = "failed to load"
    VENDORS = frozenset()
    SUPPORTS = {}

    def __init__(self, name: str, error: str):
        self.NAME = name
        self.error = error

    def _probe(self) -> Availability:
        return Availability(False, (self.error,))

    def native_for(self, target):
        return f"the {self.NAME} pack failed to load"


def _load_module(module_name: str, label: str) -> Pack:
    try:
        module = importlib.import_module(module_name)
        pack = module.PACK
        if not isinstance(pack, Pack):
            raise TypeError(f"{module_name}.PACK is a {type(pack).__name__}, not a hal.pack.Pack")
        return pack
    except Exception as exc:
        diagnostics.warn(f"hal: pack {label} could not be loaded ({type(exc).__name__}: {exc}); it is listed "
                         f"as unavailable", diagnostics.PackLoadWarning)
        return Broken(label, f"importing {module_name} failed: {type(exc).__name__}: {exc}")


@functools.cache
def packs() -> tuple[Pack, ...]:
    """Every known pack, in dispatch order (native packs, then out-of-tree ones, then emu)."""
    found: list[Pack] = []
    for name in IN_TREE:
        if name == FLOOR:
            continue
        if importlib.util.find_spec(f"hal.kernelpacks.{name}") is not None:
            found.append(_load_module(f"hal.kernelpacks.{name}.pack", name))
    for ep in entry_points(group="hal.packs"):
        found.append(_load_module(ep.value, ep.name))
    found.append(_load_module(f"hal.kernelpacks.{FLOOR}.pack", FLOOR))
    return tuple(found)


@functools.cache
def names() -> tuple[str, ...]:
    """The names of every pack :func:`packs` would list, found without importing any pack (HAL_PACK's
    check at import)."""
    found = [n for n in IN_TREE if n != FLOOR and importlib.util.find_spec(f"hal.kernelpacks.{n}") is not None]
    found += [ep.name for ep in entry_points(group="hal.packs")]
    return (*found, FLOOR)


def by_name(name: str) -> Pack:
    for p in packs():
        if p.NAME == name:
            return p
    raise ValueError(f"no pack named {name!r}: known packs are {', '.join(p.NAME for p in packs())} "
                     f"(from pack=... or HAL_PACK)")
