"""hal-probe: what hal sees on this machine and what it would run.

Sections: the target; the HAL_* variables; every pack with availability, reasons, build info and
declaration; which pack serves a typical decode shape for each cache encoding; a smoke test of
``hal.cache_kv`` + ``hal.paged_attention`` on the selected pack against a float64 reference.
It reports problems and never crashes: every section catches its own failure.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback

DECODE_SHAPE = dict(num_seqs=4, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, context=1000)
# Smoke-test bound on relative L2 error vs float64: bf16 output rounding (2^-8 relative per element)
# plus 16-bit probabilities in the native kernels (~2^-9); 5e-3 is the bound the native packs promise.
SMOKE_TOLERANCE = 5e-3


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


def _packs():
    import hal
    t = hal.target()
    rows = []
    for p in hal.packs():
        a = p.availability
        rows.append({"name": p.NAME, "description": p.DESCRIPTION, "available": a.ok,
                     "reasons": list(a.reasons), "build_info": dict(a.build_info),
                     "native_for_target": p.native_for(t) or "yes",
                     "supports": {op: s.as_dict() for op, s in p.SUPPORTS.items()}})
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
    s = DECODE_SHAPE
    rows = []
    for cache in [torch.bfloat16, torch.float16, *sorted(FP8_DTYPES, key=str)]:
        key = CallKey("paged_attention", _device_type(t), torch.bfloat16, cache, s["head_size"],
                      s["block_size"], s["num_heads"] // s["num_kv_heads"])
        try:
            d = dispatch.decide(key, t, env.forced_pack())
            why = "; ".join(d.fallback_reasons()) if d.fallback else ""
            rows.append({"cache_dtype": str(cache).removeprefix("torch."),
                         "pack": d.pack.NAME if d.pack else None, "fallback": d.fallback,
                         "why": why if d.pack else d.text(), "explain": d.text()})
        except Exception as exc:
            rows.append({"cache_dtype": str(cache).removeprefix("torch."), "pack": None, "fallback": False,
                         "why": f"{type(exc).__name__}: {exc}", "explain": ""})
    return {"shape": s, "rows": rows}


def _smoke():
    import torch

    import hal
    from hal import reference
    t = hal.target()
    dev = _device_type(t)
    s = DECODE_SHAPE
    cache_dtype = hal.fp8.native_e4m3(t)
    g = torch.Generator().manual_seed(0)
    nb = s["num_seqs"] * ((s["context"] + s["block_size"] - 1) // s["block_size"]) + 1
    shape = (nb, s["num_kv_heads"], s["block_size"], s["head_size"])
    kc = torch.empty(shape, dtype=cache_dtype, device=dev)
    vc = torch.empty_like(kc)
    tokens = (nb - 1) * s["block_size"]
    k = torch.randn(tokens, s["num_kv_heads"], s["head_size"], generator=g).to(dev)
    v = torch.randn(tokens, s["num_kv_heads"], s["head_size"], generator=g).to(dev)
    fmax = torch.finfo(cache_dtype).max
    ks, vs = k.abs().max().item() / fmax, v.abs().max().item() / fmax
    perm = torch.randperm(nb - 1, generator=g)
    slots = (perm[:, None] * s["block_size"] + torch.arange(s["block_size"])).reshape(-1).to(dev)
    hal.cache_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    per_seq = (s["context"] + s["block_size"] - 1) // s["block_size"]
    tables = perm[: s["num_seqs"] * per_seq].reshape(s["num_seqs"], per_seq).to(torch.int32).to(dev)
    lens = torch.tensor([s["context"] - 3 * i for i in range(s["num_seqs"])], dtype=torch.int32, device=dev)
    q = torch.randn(s["num_seqs"], s["num_heads"], s["head_size"], generator=g).to(torch.bfloat16).to(dev)
    decision = hal.explain(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs)
    out = torch.full_like(q, float("nan"))
    hal.paged_attention(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs, out=out, max_seq_len=s["context"])
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    hal.paged_attention(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs, out=out, max_seq_len=s["context"])
    if dev == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    ref = reference.paged_attention(q, kc, vc, tables, lens, k_scale=ks, v_scale=vs)
    err = reference.relative_l2(out, ref)
    finite = bool(torch.isfinite(out.float()).all())
    return {"pack": decision.pack.NAME if decision.pack else None, "device": dev,
            "cache_dtype": str(cache_dtype).removeprefix("torch."),
            "shape": f"{s['num_seqs']} seqs x {s['context']} tokens, {s['num_heads']}/{s['num_kv_heads']} heads, "
                     f"head_size {s['head_size']}, block_size {s['block_size']}",
            "rel_l2_vs_float64": err, "tolerance": SMOKE_TOLERANCE, "all_outputs_written": finite,
            "seconds": elapsed, "status": "PASS" if finite and err <= SMOKE_TOLERANCE else "FAIL"}


def collect(smoke: bool = True) -> dict:
    import hal
    report = {"hal_version": hal.__version__, "target": _section(_target), "environment": _section(_environment),
              "packs": _section(_packs), "dispatch": _section(_dispatch)}
    if smoke:
        report["smoke_test"] = _section(_smoke)
    return report


def render(report: dict, console) -> None:
    from rich.table import Table

    t = report["target"]
    if "error" in t:
        console.print(f"[red]target detection failed:[/] {t['error']}")
    else:
        console.print(f"[bold]hal {report['hal_version']}[/] target: [cyan]{t['describe']}[/]")
    e = report["environment"]
    if "error" not in e:
        console.print(f"python {e['python']}, torch {e['torch']} (cuda {e['torch_cuda']}, hip {e['torch_hip']}), "
                      f"GPU visible: {e['gpu_visible']}; HAL_* set: {e['hal_variables'] or 'none'}")
    packs = report["packs"]
    if isinstance(packs, dict):
        console.print(f"[red]listing packs failed:[/] {packs['error']}")
    else:
        table = Table(title="packs (dispatch order)")
        for col in ("pack", "available", "native here", "reasons / build info", "supports (paged_attention)"):
            table.add_column(col, overflow="fold")
        for p in packs:
            sup = p["supports"].get("paged_attention", {})
            sup_text = "\n".join(f"{k}: {v if not isinstance(v, list) else ', '.join(map(str, v))}"
                                 for k, v in sup.items())
            info = "\n".join(p["reasons"] + [f"{k}: {v}" for k, v in p["build_info"].items()
                                              if isinstance(v, (str, list, int, float))])
            table.add_row(p["name"], "[green]yes[/]" if p["available"] else "[red]no[/]",
                          p["native_for_target"], info, sup_text)
        console.print(table)
    d = report["dispatch"]
    if "error" in d:
        console.print(f"[red]dispatch table failed:[/] {d['error']}")
    else:
        s = d["shape"]
        table = Table(title=f"who serves a decode call (bf16 query, {s['num_heads']}/{s['num_kv_heads']} heads, "
                            f"head_size {s['head_size']}, block_size {s['block_size']})")
        table.add_column("cache")
        table.add_column("pack")
        table.add_column("why (fallbacks and refusals)", overflow="fold")
        for r in d["rows"]:
            pack = (r["pack"] or "[red]none[/]") + (" [yellow](fallback)[/]" if r["fallback"] else "")
            table.add_row(r["cache_dtype"], pack, r["why"])
        console.print(table)
    sm = report.get("smoke_test")
    if sm is not None:
        if "error" in sm:
            console.print(f"[red]smoke test FAILED to run:[/] {sm['error']}")
        else:
            color = "green" if sm["status"] == "PASS" else "red"
            console.print(f"smoke test [{color}]{sm['status']}[/]: hal.cache_kv + hal.paged_attention on pack "
                          f"[bold]{sm['pack']}[/] ({sm['device']}, {sm['cache_dtype']} cache, {sm['shape']}): "
                          f"relative L2 error vs float64 {sm['rel_l2_vs_float64']:.2e} (bound {sm['tolerance']:.0e}), "
                          f"{sm['seconds'] * 1e3:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hal-probe",
        description="Report the target, every kernel pack with its availability and reasons, which pack "
                    "serves a typical decode call for each cache encoding, and a smoke test of "
                    "hal.cache_kv + hal.paged_attention on the selected pack against a float64 reference. "
                    "Always exits 0: problems are reported, not raised. Honours HAL_TARGET, HAL_PACK, "
                    "HAL_STRICT and HAL_DEBUG.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    args = parser.parse_args(argv)
    try:
        report = collect(smoke=not args.no_smoke)
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
            render(report, console)
    except Exception as exc:
        sys.stdout.write(f"hal-probe: rendering failed ({type(exc).__name__}: {exc}); JSON follows\n")
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
