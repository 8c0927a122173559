"""Choosing a pack for a call: one algorithm for every vendor, driven by the packs' declarations.

Order: the packs native to the target (in registry order), then ``emu``. The first pack that is
available and whose declaration admits the call runs. Every rejection keeps its reasons. Running
``emu`` on a GPU target is a fallback: a :class:`hal.FallbackWarning` once per call shape
(``HAL_STRICT=1``: an error on every such call).
A forced pack (``pack=`` or ``HAL_PACK``) never falls back: if it cannot serve the call, the call
raises with its reasons. Decisions are cached on the call's static key.
"""

from __future__ import annotations

import dataclasses
import functools

from hal import diagnostics, env, registry
from hal.pack import CallKey, Pack
from hal.targets import Target, target as current_target


class NotSupportedError(ValueError):
    """No pack can serve the call (or the forced pack cannot); the message lists every reason."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    pack: str
    kind: str                 # "selected" | "not native" | "unavailable" | "rejected"
    reasons: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Decision:
    key: CallKey
    target: Target
    forced: str | None
    pack: Pack | None
    verdicts: tuple[Verdict, ...]
    fallback: bool = False

    def text(self) -> str:
        lines = [f"hal.{self.key.op}: {self.key.describe()}; target {self.target.vendor}:{self.target.arch}"
                 + (f"; forced pack {self.forced!r}" if self.forced else "")]
        for v in self.verdicts:
            head = {"selected": f"  `{v.pack}` selected" + (" (fallback)" if self.fallback else ""),
                    "not native": f"  `{v.pack}` is not native for this target",
                    "unavailable": f"  `{v.pack}` is not available here",
                    "rejected": f"  `{v.pack}` cannot serve this call"}[v.kind]
            lines.append(head + (":" if v.reasons else ""))
            lines.extend(f"      - {r}" for r in v.reasons)
        if self.pack is None:
            lines.append("  no pack can serve this call")
        return "\n".join(lines)

    def fallback_reasons(self) -> list[str]:
        out = []
        for v in self.verdicts:
            if v.kind in ("unavailable", "rejected"):
                out.extend(f"{v.pack}: {r}" for r in v.reasons)
        return out or [f"no pack in this build serves {self.target.vendor}:{self.target.arch} natively"]


def _verdict(p: Pack, key: CallKey, target: Target) -> Verdict:
    avail = p.availability
    if not avail.ok:
        return Verdict(p.NAME, "unavailable", tuple(avail.reasons))
    reasons = p.reasons(key, target)
    if reasons:
        return Verdict(p.NAME, "rejected", tuple(dict.fromkeys(reasons)))
    return Verdict(p.NAME, "selected")


@functools.lru_cache(maxsize=1024)
def decide(key: CallKey, target: Target, forced: str | None = None) -> Decision:
    """The dispatch decision for ``key`` on ``target``; never raises for unsupported calls."""
    if forced is not None:
        p = registry.by_name(forced)
        v = _verdict(p, key, target)
        return Decision(key, target, forced, p if v.kind == "selected" else None, (v,))
    verdicts: list[Verdict] = []
    chosen = None
    for p in registry.packs():
        if p.NAME != registry.FLOOR:
            why_not = p.native_for(target)
            if why_not is not None:
                verdicts.append(Verdict(p.NAME, "not native", (why_not,)))
                continue
        v = _verdict(p, key, target)
        verdicts.append(v)
        if v.kind == "selected":
            chosen = p
            break
    fallback = chosen is not None and chosen.NAME == registry.FLOOR and target.vendor != "cpu"
    return Decision(key, target, None, chosen, tuple(verdicts), fallback)


def _fallback_message(decision: Decision) -> str:
    reasons = "; ".join(decision.fallback_reasons())
    return (f"hal.{decision.key.op} falls back to the emu pack on {decision.target.vendor}:"
            f"{decision.target.arch} ({decision.key.describe()}): {reasons}")


@functools.lru_cache(maxsize=1024)
def _announce(decision: Decision) -> None:
    """Warn once per decision (the cache is what makes it once)."""
    diagnostics.warn(_fallback_message(decision), diagnostics.FallbackWarning, stacklevel=6)


def select(key: CallKey, pack: str | None = None) -> Pack:
    """The pack that runs ``key`` now: reads the target and HAL_* variables, raises when none fits."""
    forced = pack if pack is not None else env.forced_pack()
    decision = decide(key, current_target(), forced)
    if decision.pack is None:
        raise NotSupportedError(decision.text())
    strict = env.strict()  # read on every call (never cached), so a bad value raises even without a fallback
    if decision.fallback:
        if strict:
            raise NotSupportedError(_fallback_message(decision) + "\n(HAL_STRICT=1 makes this fallback an error)")
        _announce(decision)
    return decision.pack
