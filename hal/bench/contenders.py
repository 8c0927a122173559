"""What the benchmark compares. Each contender turns a problem into a callable that computes the
decode attention output (``Prepared``) or raises :class:`~hal.bench.baselines.Skip` with the reason
it cannot run it here.

* ``hal``: the public call with automatic dispatch (``hal.paged_attention``; validation included),
  the note says which pack it picked.
* ``hal:NAME``: every other pack hal knows (``hal.packs()``), forced with ``pack=NAME``.
* ``emu-torch`` / ``emu-triton``: the emu pack's two paths called directly (no validation, no
  dispatch): ``hal.kernelpacks.emu.torch_path`` / ``.triton_path``.
* ``torch-sdpa``, ``flashinfer-tc``, ``flashinfer-cc``: the baselines (:mod:`hal.bench.baselines`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
from collections.abc import Callable

import torch

import hal
from hal.bench import baselines
from hal.bench.baselines import Skip
from hal.bench.check import emu_runner
from hal.bench.data import Problem


@dataclasses.dataclass
class Prepared:
    run: Callable[[], object]           # one call; returns the output tensor or writes ``out``
    out: torch.Tensor | None = None     # poisoned with NaN before the checked call
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str                           # "hal" | "emu path" | "baseline"
    what: str
    setup: Callable[[Problem, dict], Prepared]


def _hal(pack: str | None):
    def setup(p: Problem, opts: dict) -> Prepared:
        if pack is not None:
            known = {x.NAME: x for x in hal.packs()}
            if pack not in known:
                raise Skip(f"no pack named {pack!r} in this build")
            if not known[pack].availability.ok:
                raise Skip("unavailable: " + "; ".join(known[pack].availability.reasons))
        decision = hal.explain(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, scale=p.scale,
                               k_scale=p.k_scale, v_scale=p.v_scale, max_seq_len=p.max_seq_len, pack=pack)
        if decision.pack is None:
            reasons = [r for v in decision.verdicts if v.kind in ("rejected", "unavailable") for r in v.reasons]
            raise Skip("cannot serve this call: " + ("; ".join(dict.fromkeys(reasons)) or "no pack fits"))
        note = "" if pack is not None else f"dispatched to {decision.pack.NAME}" + \
            (" (fallback)" if decision.fallback else "")
        out = torch.empty_like(p.query)
        q, kc, vc, bt, sl = p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens
        kw = dict(scale=p.scale, k_scale=p.k_scale, v_scale=p.v_scale, max_seq_len=p.max_seq_len, out=out, pack=pack)

        def run():
            hal.paged_attention(q, kc, vc, bt, sl, **kw)

        return Prepared(run, out, note)
    return setup


def _emu_torch(p: Problem, opts: dict) -> Prepared:
    from hal.kernelpacks.emu import torch_path
    out = torch.empty_like(p.query)
    return Prepared(emu_runner(torch_path, out, p), out)


def _emu_triton(p: Problem, opts: dict) -> Prepared:
    if p.device.type != "cuda":
        raise Skip("the Triton path runs on GPUs only")
    from hal.kernelpacks.emu import pack as emu_pack
    why = emu_pack.triton_usable()
    if why:
        raise Skip(f"Triton path not usable: {why}")
    name = "hal.kernelpacks.emu.triton_path"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in (name, "triton") or (exc.name and name.startswith(exc.name)):
            raise Skip(f"{name} is not in this tree yet ({exc})") from None
        raise
    out = torch.empty_like(p.query)
    return Prepared(emu_runner(module, out, p), out)


def _torch_sdpa(p: Problem, opts: dict) -> Prepared:
    return Prepared(baselines.torch_sdpa(p))


def _flashinfer(tensor_cores: bool):
    def setup(p: Problem, opts: dict) -> Prepared:
        run, out, note = baselines.flashinfer_decode(p, tensor_cores, bool(opts.get("flashinfer_jit")))
        return Prepared(run, out, note)
    return setup


BASELINE = "torch-sdpa"


def all_contenders() -> list[Contender]:
    """Every contender this build knows, in display order (packs found at run time)."""
    out = [Contender("hal", "hal", "hal.paged_attention, automatic dispatch", _hal(None))]
    for p in hal.packs():
        if p.NAME != "emu":
            out.append(Contender(f"hal:{p.NAME}", "hal", f"hal.paged_attention(pack={p.NAME!r})", _hal(p.NAME)))
    out += [
        Contender("emu-torch", "emu path", "emu pack, PyTorch path, called directly", _emu_torch),
        Contender("emu-triton", "emu path", "emu pack, Triton path, called directly", _emu_triton),
        Contender(BASELINE, "baseline", "plain PyTorch: padded gather + cast/scale + SDPA (GQA)", _torch_sdpa),
        Contender("flashinfer-tc", "baseline", "FlashInfer BatchDecodeWithPagedKVCacheWrapper, tensor cores",
                  _flashinfer(True)),
        Contender("flashinfer-cc", "baseline", "FlashInfer BatchDecodeWithPagedKVCacheWrapper, CUDA cores",
                  _flashinfer(False)),
    ]
    return out


def select(patterns: list[str] | None, known: list[Contender] | None = None) -> list[Contender]:
    """Contenders whose names match any pattern (fnmatch, comma-separated allowed), in display
    order; the baseline is always kept, since every speed-up is quoted against it."""
    known = known if known is not None else all_contenders()
    if not patterns:
        return known
    pats = [t.strip() for item in patterns for t in item.split(",") if t.strip()]
    unknown = [x for x in pats if not any(fnmatch.fnmatch(c.name, x) for c in known)]
    if unknown:
        raise ValueError(f"no contender matches {', '.join(unknown)}: known are {', '.join(c.name for c in known)}")
    return [c for c in known if c.name == BASELINE or any(fnmatch.fnmatch(c.name, x) for x in pats)]
