"""hal-probe: what hal sees on this machine and what it would run.

Sections: the target; the HAL_* variables; every pack with availability, reasons, build info and
its declaration for this target (the one dispatch checks); which pack serves a typical decode shape
for each cache encoding; a smoke test of ``hal.cache_kv`` + ``hal.paged_attention`` on the selected
pack against a float64 reference (and of every other declared op with an example: ``hal.cache_mla``
+ ``hal.mla_decode``). It reports problems and never crashes: every section catches its
own failure.

Three views of one report: the default fits an 80-column terminal (one line per pack, per cache
encoding, and for the smoke test with a line per further op); ``--verbose`` adds every reason, the build details and the
declarations; ``--json`` is the whole report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import textwrap
import time
import traceback
import warnings

# Smoke-test bound on relative L2 error vs float64: bf16 output rounding (2^-8 relative per element)
# plus 16-bit probabilities in the native kernels (~2^-9); 5e-3 is the bound the native packs promise.
SMOKE_TOLERANCE = 5e-3
WIDTH = 80  # the default view is written for this width (or the terminal's, when narrower)


def _section(fn):
    try:
        return fn()
    except Exception as exc:  # the probe reports, it does not crash
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)}


def _target():
    import hal
    t = hal.target()
    return {"vendor": t.vendor, "arch": t.arch, "name": t.name, "warp_size": t.warp_size,
            "features": sorted(t.features), "fp8_encodings": [str(d).removeprefix("torch.") for d in t.fp8_encodings],
            "matrix_units": list(t.matrix_units), "source": t.source, "describe": t.describe()}


def _environment():
    import torch

    from hal import env
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": getattr(torch.version, "cuda", None), "torch_hip": getattr(torch.version, "hip", None),
            "gpu_visible": torch.cuda.is_available(), "hal_variables": env.snapshot(),
            "known_variables": env.VARIABLES}


def _declaration(p, t) -> dict:
    """The declaration ``p``'s dispatch check reads for ``t``: per target where the pack has one
    (``supports(target)``, e.g. rocm's gfx90a vs gfx942), else the pack's ``SUPPORTS``."""
    return p.supports(t)


def _packs():
    import hal
    t = hal.target()
    rows = []
    for p in hal.packs():
        a = p.availability
        rows.append({"name": p.NAME, "description": p.DESCRIPTION, "available": a.ok,
                     "reasons": list(a.reasons), "build_info": dict(a.build_info),
                     "native_for_target": p.native_for(t) or "yes",
                     "supports": {op: s.as_dict() for op, s in _declaration(p, t).items()}})
    return rows


def _device_type(t) -> str:
    import torch
    return "cuda" if t.vendor in ("cuda", "rocm") and torch.cuda.is_available() else "cpu"


def _dispatch():
    import torch

    import hal
    from hal import dispatch, env
    from hal.fp8 import FP8_DTYPES
    from hal.pack import CallKey
    t = hal.target()
    from hal.ops.paged_attention import EXAMPLE_SHAPE as s  # the op's declared example
    rows = []
    for cache in [torch.bfloat16, torch.float16, *sorted(FP8_DTYPES, key=str)]:
        key = CallKey("paged_attention", _device_type(t), torch.bfloat16, cache, s["head_size"],
                      s["block_size"], s["num_heads"] // s["num_kv_heads"])
        try:
            d = dispatch.decide(key, t, env.forced_pack())
            why = "; ".join(d.fallback_reasons()) if d.fallback else ""
            passed_over = [{"pack": v.pack, "kind": v.kind, "reasons": list(v.reasons)}
                           for v in d.verdicts if v.kind in ("unavailable", "rejected")]
            rows.append({"cache_dtype": str(cache).removeprefix("torch."),
                         "pack": d.pack.NAME if d.pack else None, "fallback": d.fallback,
                         "passed_over": passed_over, "why": why if d.pack else d.text(), "explain": d.text()})
        except Exception as exc:
            rows.append({"cache_dtype": str(cache).removeprefix("torch."), "pack": None, "fallback": False,
                         "passed_over": [], "why": f"{type(exc).__name__}: {exc}", "explain": ""})
    return {"shape": s, "rows": rows}


def _smoke():
    # a fallback warning from the calls goes into the report (the dispatch section says it already)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _smoke_run()
    result["warnings"] = list(dict.fromkeys(str(w.message) for w in caught))
    return result


def _smoke_op(name: str, dev: str, cache_dtype) -> dict:
    """One declared op's example call on this machine's best pack against its float64 reference."""
    import torch

    import hal
    from hal import ops, reference
    decl = ops.OPS[name]
    kwargs = decl.example(dev, cache_dtype)
    call = ops.prepare(name, **kwargs)
    decision = hal.explain(op=name, **{k: kw for k, kw in kwargs.items() if k != "out"})
    out = ops.call(name, **kwargs)
    if dev == "cuda":
        torch.cuda.synchronize()
    err = reference.relative_l2(out, decl.reference(call))
    finite = bool(torch.isfinite(out.float()).all())
    return {"op": name, "pack": decision.pack.NAME if decision.pack else None, "rel_l2_vs_float64": err,
            "all_outputs_written": finite, "status": "PASS" if finite and err <= SMOKE_TOLERANCE else "FAIL"}


def _smoke_run():
    """Every declared op with an example and a reference: the example call on this machine's best
    pack, its output against the float64 reference. paged_attention (after hal.cache_kv wrote its
    pages) is the headline, timed; the others (``ops``: mla_decode after hal.cache_mla) are checked."""
    import torch

    import hal
    from hal import ops, reference
    t = hal.target()
    dev = _device_type(t)
    cache_dtype = hal.fp8.native_e4m3(t)
    from hal.ops.paged_attention import EXAMPLE_SHAPE as s  # the op's declared example
    decl = ops.OPS["paged_attention"]
    kwargs = decl.example(dev, cache_dtype)
    call = ops.prepare(decl.name, **kwargs)
    decision = hal.explain(**{k: kw for k, kw in kwargs.items() if k != "out"})
    out = ops.call(decl.name, **kwargs)
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ops.call(decl.name, **kwargs)
    if dev == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    err = reference.relative_l2(out, decl.reference(call))
    finite = bool(torch.isfinite(out.float()).all())
    others = [_smoke_op(name, dev, cache_dtype) for name, d in ops.OPS.items()
              if name != decl.name and d.example is not None and d.reference is not None]
    ok = finite and err <= SMOKE_TOLERANCE and all(o["status"] == "PASS" for o in others)
    return {"pack": decision.pack.NAME if decision.pack else None, "device": dev,
            "cache_dtype": str(cache_dtype).removeprefix("torch."),
            "shape": f"{s['num_seqs']} seqs x {s['context']} tokens, {s['num_heads']}/{s['num_kv_heads']} heads, "
                     f"head_size {s['head_size']}, block_size {s['block_size']}",
            "rel_l2_vs_float64": err, "tolerance": SMOKE_TOLERANCE, "all_outputs_written": finite,
            "seconds": elapsed, "ops": others, "status": "PASS" if ok else "FAIL"}


def _ignore_refused_env(already: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every HAL_* value hal refuses: ``already`` (those hal_launch dropped before hal could be
    imported), then those refused now, each dropped from this process's environment so the rest of
    the report is what hal does without it. Messages, one per variable."""
    from hal import env

    found = list(already)
    for exc in env.problems():
        found.append(str(exc))
        os.environ.pop(exc.variable, None)
    return found


def collect(smoke: bool = True, ignored_env: list[str] | tuple[str, ...] = ()) -> dict:
    import hal
    ignored = _ignore_refused_env(ignored_env)
    report = {"hal_version": hal.__version__, "ignored_env": ignored, "target": _section(_target),
              "environment": _section(_environment), "packs": _section(_packs), "dispatch": _section(_dispatch)}
    if smoke:
        report["smoke_test"] = _section(_smoke)
    return report


def _fit(text: str, width: int) -> str:
    """``text`` on one line of at most ``width`` columns, cut between words (marked with an ellipsis)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text.rfind(" ", 0, width - 1)
    return (text[:cut].rstrip(",;:") + " …") if cut > 0 else "…"


def _clause(text: str) -> str:
    """The first clause of a sentence (up to its first ': ' or '; ')."""
    return re.split(r"[:;] ", text, maxsplit=1)[0]


def _gist(reason: str) -> str:
    """A reason's first clause without its asides: what is wrong, not the how-to that follows it."""
    return re.sub(r" \([^()]*\)", "", _clause(reason))


def _dtype(name: str) -> str:
    return name.removeprefix("float8_")


def render(report: dict, console, verbose: bool = False) -> None:
    (_render_verbose if verbose else _render_short)(report, console)


# ---------------------------------------------------------------------------------------------------
# default view: one screen, 80 columns

def _render_short(report: dict, console) -> None:
    from rich.text import Text
    width = min(console.width, WIDTH)
    lines = [*_short_head(report), "", *_short_packs(report["packs"], width), "",
             *_short_dispatch(report["dispatch"], width), "", *_short_smoke(report.get("smoke_test"), width),
             Text("details: hal-probe --verbose (reasons, build, declarations), --json (all)", style="dim")]
    for line in lines:
        console.print(line)


def _short_head(report: dict) -> list:
    from rich.text import Text
    t, e = report["target"], report["environment"]
    if "error" in t:
        out = [Text.assemble(("target detection failed: ", "red"), t["error"])]
    else:
        feats = f" [{', '.join(t['features'])}]" if t["features"] else ""
        fp8 = ", ".join(map(_dtype, t["fp8_encodings"])) or "none"
        name = f" {t['name']}" if t["name"] else ""
        out = [Text.assemble((f"hal {report['hal_version']}", "bold"), "  target ",
                             (f"{t['vendor']}:{t['arch']}{feats}{name}", "cyan"),
                             f" ({t['source']}), FP8 in hardware: {fp8}")]
    if "error" not in e:
        build = "CUDA" if e["torch_cuda"] else "ROCm" if e["torch_hip"] else "CPU-only"
        hal_vars = " ".join(f"{k}={v}" for k, v in e["hal_variables"].items()) or "none"
        out.append(Text(f"torch {e['torch']} ({build} build), GPU visible: {'yes' if e['gpu_visible'] else 'no'}; "
                        f"HAL_* set: {hal_vars}"))
    return [*out, *(Text.assemble(("ignored: ", "red"), msg) for msg in _ignored_lines(report))]


def _ignored_lines(report: dict) -> list[str]:
    """One line per HAL_* value hal refused (the report below is without it)."""
    return [f"{msg}; the report below ignores it" for msg in report.get("ignored_env", ())]


def _pack_state(p: dict) -> tuple[str, str, str]:
    """(state, style, one-line detail) of one pack, as dispatch sees it on this target."""
    if p["native_for_target"] != "yes":
        return "not native", "yellow", _gist(p["native_for_target"])
    if not p["available"]:
        return "unavailable", "red", "; ".join(map(_gist, p["reasons"]))
    return "available", "green", _clause(p["description"])


def _short_packs(packs, width: int) -> list:
    from rich.text import Text
    if isinstance(packs, dict):
        return [Text.assemble(("listing packs failed: ", "red"), _fit(packs["error"], width - 22))]
    name_w = max(len(p["name"]) for p in packs)
    out = [Text("packs, in dispatch order:")]
    for p in packs:
        state, style, detail = _pack_state(p)
        prefix = f"  {p['name']:<{name_w}}  {state:<11}  "
        out.append(Text.assemble(f"  {p['name']:<{name_w}}  ", (f"{state:<11}", style), "  ",
                                 _fit(detail, width - len(prefix))))
    return out


def _passed_over(row: dict) -> str:
    """Why the packs tried before the chosen one did not serve the call, in a few words each."""
    return "; ".join(f"{v['pack']} unavailable" if v["kind"] == "unavailable" else
                     f"{v['pack']}: {_gist(v['reasons'][0]) if v['reasons'] else 'rejected'}"
                     for v in row["passed_over"])


def _short_dispatch(d: dict, width: int) -> list:
    from rich.text import Text
    if "error" in d:
        return [Text.assemble(("dispatch table failed: ", "red"), _fit(d["error"], width - 23))]
    s = d["shape"]
    out = [Text(f"a decode call (bf16 query, {s['num_heads']}/{s['num_kv_heads']} heads, head_size "
                f"{s['head_size']}, block_size {s['block_size']}) runs on:")]
    cache_w = max(len(r["cache_dtype"]) for r in d["rows"])
    for r in d["rows"]:
        pack = r["pack"] or "none"
        note = _passed_over(r) if r.get("passed_over") else (_gist(r["why"]) if r["pack"] is None else "")
        note = ("fallback: " if r["fallback"] else "") + note
        prefix = f"  {r['cache_dtype']:<{cache_w}}  {pack}  "
        out.append(Text.assemble(f"  {r['cache_dtype']:<{cache_w}}  ", (pack, "bold" if r["pack"] else "red"),
                                 ("  " + _fit(note, width - len(prefix)) if note else "", "yellow")))
    return out


def _short_smoke(sm: dict | None, width: int) -> list:
    from rich.text import Text
    if sm is None:
        return [Text("smoke test skipped (--no-smoke)")]
    if "error" in sm:
        return [Text.assemble(("smoke test FAILED to run: ", "red"), _fit(sm["error"], width - 26))]
    color = "green" if sm["status"] == "PASS" else "red"
    written = "" if sm["all_outputs_written"] else "; some outputs not written"
    lines = [Text.assemble("smoke test ", (sm["status"], color),
                           f": {sm['pack']} on {sm['device']}, {sm['cache_dtype']}, error "
                           f"{sm['rel_l2_vs_float64']:.1e} (max {sm['tolerance']:.0e}), "
                           f"{sm['seconds'] * 1e3:.0f} ms{written}")]
    for o in sm.get("ops", []):
        lines.append(Text.assemble(f"  {o['op']}: ", (o["status"], "green" if o["status"] == "PASS" else "red"),
                                   f" on {o['pack']}, error {o['rel_l2_vs_float64']:.1e}"
                                   + ("" if o["all_outputs_written"] else "; some outputs not written")))
    return lines


# ---------------------------------------------------------------------------------------------------
# --verbose: every reason, the build details and the declarations

def _render_verbose(report: dict, console) -> None:
    for block in (_verbose_head(report), _verbose_packs(report["packs"]), _verbose_dispatch(report["dispatch"]),
                  _verbose_smoke(report.get("smoke_test"))):
        for indent, text, style in block:
            _line(console, indent, text, style)
        console.print()


def _line(console, indent: int, text: str, style: str = "") -> None:
    """``text`` wrapped between words with a hanging indent; a word wider than the terminal (a path)
    overflows its line rather than being cut."""
    from rich.text import Text
    hang = " " * (indent + 2)
    for line in textwrap.wrap(text, max(console.width, 20), initial_indent=" " * indent, subsequent_indent=hang,
                              break_long_words=False, break_on_hyphens=False) or [""]:
        console.print(Text(line, style=style), no_wrap=True, overflow="ignore", crop=False)


def _verbose_head(report: dict) -> list[tuple[int, str, str]]:
    t, e = report["target"], report["environment"]
    out = [(0, f"target detection failed: {t['error']}", "red") if "error" in t else
           (0, f"hal {report['hal_version']}  target: {t['describe']}", "bold")]
    out += [(0, f"ignored: {msg}", "red") for msg in _ignored_lines(report)]
    if "error" in e:
        return out + [(0, f"environment: {e['error']}", "red")]
    out.append((0, f"python {e['python']}, torch {e['torch']} (cuda {e['torch_cuda']}, hip {e['torch_hip']}), "
                   f"GPU visible: {e['gpu_visible']}", ""))
    out.append((0, "HAL_* variables (set: " + (", ".join(f"{k}={v}" for k, v in e["hal_variables"].items())
                                               or "none") + "):", ""))
    out += [(2, f"{k}: {v}", "") for k, v in e["known_variables"].items()]
    return out


def _value(v) -> str:
    if isinstance(v, (list, tuple, dict)) and not v:
        return "none"
    return ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def _info_lines(info: dict, indent: int) -> list[tuple[int, str, str]]:
    """Build info as key: value lines; tables of tables (per-kernel figures) are in --json only."""
    out = []
    for k, v in info.items():
        if isinstance(v, dict) and v:
            flat = all(not isinstance(x, (dict, list)) for x in v.values())
            out.append((indent, f"{k}:" + ("" if flat else " per kernel, in --json"), ""))
            if flat:
                out += [(indent + 2, f"{a}: {b}", "") for a, b in v.items()]
        else:
            out.append((indent, f"{k}: {_value(v)}", ""))
    return out


def _verbose_packs(packs) -> list[tuple[int, str, str]]:
    if isinstance(packs, dict):
        return [(0, f"listing packs failed: {packs['error']}", "red")]
    out = []
    for p in packs:
        out.append((0, f"pack {p['name']}: {p['description']}", "bold"))
        out.append((2, f"native here: {p['native_for_target']}", ""))
        out.append((2, f"available: {'yes' if p['available'] else 'no'}", "green" if p["available"] else "red"))
        out += [(4, f"- {r}", "") for r in p["reasons"]]
        if p["build_info"]:
            out += [(2, "build info:", "")] + _info_lines(p["build_info"], 4)
        for op, decl in p["supports"].items():
            out.append((2, f"declares for {op} (this target):", ""))
            out += [(4, f"{k}: {_value(v)}", "") for k, v in decl.items()]
    return out


def _verbose_dispatch(d: dict) -> list[tuple[int, str, str]]:
    if "error" in d:
        return [(0, f"dispatch table failed: {d['error']}", "red")]
    s = d["shape"]
    out = [(0, f"a decode call (bf16 query, {s['num_heads']}/{s['num_kv_heads']} heads, head_size "
               f"{s['head_size']}, block_size {s['block_size']}) runs on:", "bold")]
    groups: dict[tuple, list[str]] = {}
    for r in d["rows"]:
        why = tuple(f"{v['pack']}: {x}" for v in r.get("passed_over", []) for x in v["reasons"]) or \
            ((r["why"],) if r["pack"] is None and r["why"] else ())
        groups.setdefault((r["pack"] or "none", r["fallback"], why), []).append(r["cache_dtype"])
    for (pack, fallback, why), caches in groups.items():
        out.append((2, f"{', '.join(caches)}: {pack}" + (" (fallback)" if fallback else ""), ""))
        out += [(4, f"- {w}", "") for w in why]
    return out


def _verbose_smoke(sm: dict | None) -> list[tuple[int, str, str]]:
    if sm is None:
        return [(0, "smoke test skipped (--no-smoke)", "")]
    if "error" in sm:
        return [(0, f"smoke test FAILED to run: {sm['error']}", "red")]
    out = [(0, f"smoke test {sm['status']}: hal.cache_kv + hal.paged_attention on pack {sm['pack']} ({sm['device']}, "
               f"{sm['cache_dtype']} cache, {sm['shape']}): relative L2 error vs float64 "
               f"{sm['rel_l2_vs_float64']:.2e} (bound {sm['tolerance']:.0e}), {sm['seconds'] * 1e3:.2f} ms",
            "green" if sm["status"] == "PASS" else "red")]
    for o in sm.get("ops", []):
        out.append((2, f"{o['op']} (its declared example, after its cache write) on pack {o['pack']}: "
                       f"{o['status']}, relative L2 error vs float64 {o['rel_l2_vs_float64']:.2e}"
                       + ("" if o["all_outputs_written"] else ", some outputs not written"),
                    "green" if o["status"] == "PASS" else "red"))
    if sm.get("warnings"):
        out.append((2, f"{len(sm['warnings'])} fallback warning(s) raised, as the dispatch table above says "
                       f"(their text is in --json)", "yellow"))
    return out


def main(argv: list[str] | None = None, ignored_env: list[str] | tuple[str, ...] = ()) -> int:
    """``ignored_env``: the HAL_* values hal_launch had to drop before hal would import (their messages)."""
    parser = argparse.ArgumentParser(
        prog="hal-probe",
        description="Report the target, every kernel pack with its availability, which pack serves a "
                    "typical decode call for each cache encoding, and a smoke test of hal.cache_kv + "
                    "hal.paged_attention on the selected pack against a float64 reference (hal.cache_mla + "
                    "hal.mla_decode checked the same way). The default "
                    "view is one line each and fits 80 columns; --verbose adds every reason, the build "
                    "details and each pack's declaration for this target; --json prints all of it. "
                    "Always exits 0: problems are reported, not raised. Honours HAL_TARGET, HAL_PACK, "
                    "HAL_STRICT and HAL_DEBUG; a value hal does not understand is reported first and the "
                    "rest of the report is without it.")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="every reason, build details and the declarations, not one line each")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    args = parser.parse_args(argv)
    try:
        report = collect(smoke=not args.no_smoke, ignored_env=ignored_env)
    except Exception as exc:  # e.g. torch itself fails to import
        report = {"error": f"{type(exc).__name__}: {exc}"}
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
        return 0
    try:
        from rich.console import Console
        console = Console()
        if "error" in report:
            console.print(f"[red]hal could not be loaded:[/] {report['error']}")
        else:
            render(report, console, verbose=args.verbose)
    except Exception as exc:
        sys.stdout.write(f"hal-probe: rendering failed ({type(exc).__name__}: {exc}); JSON follows\n")
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
