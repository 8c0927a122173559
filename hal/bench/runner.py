"""One benchmark run: the copy bandwidth first (and, when there are prefill or MLA shapes, a bf16
matrix product's TFLOP/s: their compute ceiling), then for every shape x KV dtype a fresh problem,
its reference, and every contender that serves the problem's op (decode, prefill or mla) checked,
then timed. Nothing here raises for a contender: a contender that cannot run is a ``skip`` row, one that
errors or is wrong a ``FAIL`` row."""

from __future__ import annotations

import dataclasses
import gc
import platform
import time
from collections.abc import Callable

import torch

import hal
from hal.bench import check, data, mla, prefill, timing
from hal.bench.baselines import Skip
from hal.bench.contenders import BASELINE, Contender, baseline_for
from hal.bench.shapes import Shape


@dataclasses.dataclass
class Options:
    device: torch.device
    reps: int
    warmup: int
    budget_s: float | None       # per row: timed reps are cut to fit (at least 3)
    seed: int = 0
    query_dtype: torch.dtype = torch.bfloat16
    flashinfer_jit: bool = False
    flush: bool = True


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "hal": hal.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                    capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2 ** 30, 1),
                    l2_bytes=getattr(props, "L2_cache_size", None))
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        import os
        info.update(name=name, cpus=os.cpu_count())
    try:
        info["hal_target"] = hal.target().describe()
    except Exception as exc:  # noqa: BLE001 - the bench still runs
        info["hal_target"] = f"unknown ({_short(exc)})"
    return info


def _loadavg() -> list[float] | None:
    import os
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _row(shape: Shape, kv: torch.dtype, c: Contender, **kw) -> dict:
    row = {"shape": shape.spec, "op": shape.op, "kv_dtype": data.dtype_name(kv), "contender": c.name, "kind": c.kind,
           "status": "skip", "reason": "", "note": "", "time_us": None, "time_us_min": None, "host_us": None, "reps": 0,
           "bytes": None, "GBps": None, "fraction_of_copy": None, "flop": None, "TFLOPs": None,
           "fraction_of_matmul": None, "speedup_vs_baseline": None,
           "err_all": None, "err_f64": None, "max_abs_err": None, "tolerance": None}
    row.update(kw)
    return row


def _lens(xs: list[int]):
    return xs if len(xs) <= 64 else {"min": min(xs), "max": max(xs), "mean": sum(xs) / len(xs), "count": len(xs)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_contender(c: Contender, p: data.Problem, ref: check.Reference, opts: Options):
    """Set the contender up and run it once into a NaN-poisoned output, then check that output.
    Returns ``(row, prepared)``; ``prepared`` is None unless the row passed (status "ok", untimed)."""
    kv = p.kv_dtype
    phase = "setup"
    prepared = None
    try:
        prepared = c.setup(p, {"flashinfer_jit": opts.flashinfer_jit})
        phase = "run"
        if prepared.out is not None:
            prepared.out.fill_(float("nan"))
        result = prepared.run()
        _sync(p.device)
        out = result if isinstance(result, torch.Tensor) else prepared.out
        if out is None:
            return _row(p.shape, kv, c, status="FAIL", reason="returned no output", note=prepared.note), None
        phase = "check"
        tol = c.tolerance if prepared.tolerance is None else prepared.tolerance
        v = ref.check(out, tolerance=tol)
        del out, result
        row = _row(p.shape, kv, c, status="ok" if v.ok else "FAIL", reason=v.reason, err_all=v.err_all,
                   err_f64=v.err_f64, max_abs_err=v.max_abs,
                   tolerance=ref.tolerance if tol is None else tol, note=prepared.note)
        return row, (prepared if v.ok else None)
    except Skip as why:
        return _row(p.shape, kv, c, status="skip", reason=str(why)), None
    except Exception as exc:  # noqa: BLE001 - a contender never ends the run
        try:
            _sync(p.device)
        except Exception:  # noqa: BLE001, S110 - the FAIL row below says what happened
            pass
        return _row(p.shape, kv, c, status="FAIL", reason=f"{phase}: {_short(exc)}",
                    note=prepared.note if prepared else ""), None


def run_problem(p: data.Problem, ref: check.Reference, contenders: list[Contender], timer: timing.Timer,
                opts: Options, copy_gbps: float, progress: Callable[[str], None], matmul_tflops: float = 0.0) -> list[dict]:
    """Check every contender that serves the problem's op, then time those that passed, in turns."""
    contenders = [c for c in contenders if c.serves(p)]
    label = f"{p.shape.spec} {data.dtype_name(p.kv_dtype)}"
    rows, runs = [], {}
    for c in contenders:
        progress(f"{label}: checking {c.name}")
        row, prepared = check_contender(c, p, ref, opts)
        rows.append(row)
        if prepared is not None:
            runs[c.name] = prepared.run
        _free(p.device)
    progress(f"{label}: timing {', '.join(runs)}")
    timings = timer.interleaved(runs, reps=opts.reps, warmup=opts.warmup, budget_s=opts.budget_s)
    nbytes = p.bytes_moved()["total"]
    flop = p.flop() if p.op in ("prefill", "mla") else None
    for row in rows:
        t = timings.get(row["contender"])
        if t is None:
            continue
        if isinstance(t, BaseException):
            row.update(status="FAIL", reason=f"timing: {_short(t)}")
            continue
        gbps = nbytes / t.median_s / 1e9
        row.update(time_us=t.median_s * 1e6, time_us_min=t.min_s * 1e6, host_us=t.host_median_s * 1e6, reps=t.reps, bytes=nbytes, GBps=gbps,
                   fraction_of_copy=gbps / copy_gbps if copy_gbps else None)
        if flop is not None:
            tflops = flop / t.median_s / 1e12
            row.update(flop=flop, TFLOPs=tflops, fraction_of_matmul=tflops / matmul_tflops if matmul_tflops else None)
    base = next((r for r in rows if r["contender"] == baseline_for(p.op) and r["time_us"]), None)
    for r in rows:
        if base and r["time_us"]:
            r["speedup_vs_baseline"] = base["time_us"] / r["time_us"]
    return rows


def run(opts: Options, shapes: list[Shape], kv_dtypes: list[torch.dtype], contenders: list[Contender],
        progress: Callable[[str], None] = lambda s: None,
        partial: Callable[[dict], None] | None = None) -> dict:
    """The whole run's result. ``partial`` (if given) receives the result so far after every
    problem (the CLI rewrites its JSON file with it, so a run cut short keeps what it measured)."""
    dev = opts.device
    started = time.time()
    load_before = _loadavg()
    progress("measuring copy bandwidth")
    try:
        copy = timing.copy_bandwidth(dev)
    except Exception as exc:  # noqa: BLE001 - the timings still mean something without it
        copy = timing.CopyBandwidth(0.0, 0, 0.0, f"copy measurement failed: {_short(exc)}")
    progress(f"copy bandwidth {copy.gbps:.1f} GB/s ({copy.method})")
    matmul = None
    if any(s.op in ("prefill", "mla") for s in shapes):
        progress("measuring bf16 matrix-product TFLOP/s")
        try:
            matmul = timing.matmul_tflops(dev)
        except Exception as exc:  # noqa: BLE001
            matmul = timing.Matmul(0.0, 0, "", 0.0, f"matmul measurement failed: {_short(exc)}")
        progress(f"matmul {matmul.tflops:.2f} TFLOP/s ({matmul.method})")
    timer = timing.Timer(dev, flush=opts.flush)
    ops = {s.op for s in shapes}
    # the column "vs ..." names each op's reference (torch-sdpa for decode and prefill, torch for MLA)
    baseline_text = " / ".join(dict.fromkeys(
        baseline_for(op) + (" (mla)" if op == "mla" and len(ops) > 1 else "") for op in
        sorted(ops, key=("decode", "prefill", "mla").index))) or BASELINE
    rows: list[dict] = []
    problems: list[dict] = []

    def result(complete: bool = True) -> dict:
        return {
            "tool": "hal-bench",
            "complete": complete,
            "device": device_info(dev),
            "copy_bandwidth": copy.as_dict(),
            "matmul": matmul.as_dict() if matmul else None,
            "settings": {"reps": opts.reps, "warmup": opts.warmup, "budget_s_per_row": opts.budget_s,
                         "seed": opts.seed, "query_dtype": data.dtype_name(opts.query_dtype),
                         "cache_flush_bytes": timer.flush_bytes, "baseline": baseline_text,
                         "timer": "CUDA events" if dev.type == "cuda" else "time.perf_counter",
                         "check": check.__doc__.split("What is checked, per problem:")[1].strip(),
                         "check_prefill": " ".join(prefill.PrefillReference.__doc__.split()) if matmul else None,
                         "check_mla": " ".join(mla.MlaReference.__doc__.split()) if "mla" in ops else None},
            "contenders": [{"name": c.name, "kind": c.kind, "what": c.what, "ops": sorted(c.ops)} for c in contenders],
            "problems": problems,
            "rows": rows,
            "elapsed_s": time.time() - started,
            # CPU timings on a shared machine are only as good as its quiet: the 1-minute load average
            # before and after the run (None where the OS has none)
            "load_average": {"before": load_before, "after": _loadavg()},
        }

    for shape in shapes:
        for kv in kv_dtypes:
            label = f"{shape.spec} {data.dtype_name(kv)}"
            pre, is_mla = shape.op == "prefill", shape.op == "mla"
            gib = prefill.kv_gib(shape, kv) if pre else mla.kv_gib(shape, kv) if is_mla else data.kv_gib(shape, kv)
            progress(f"{label}: building data ({gib:.2f} GiB of KV) and the reference")
            p = ref = None
            try:
                if pre:
                    p = prefill.build(shape, kv, dev, query_dtype=opts.query_dtype, seed=opts.seed)
                    ref = prefill.PrefillReference(p, seed=opts.seed)
                elif is_mla:
                    p = mla.build(shape, kv, dev, query_dtype=opts.query_dtype, seed=opts.seed)
                    ref = mla.MlaReference(p, seed=opts.seed)
                else:
                    p = data.build(shape, kv, dev, query_dtype=opts.query_dtype, seed=opts.seed)
                    ref = check.Reference(p, seed=opts.seed)
            except Exception as exc:  # noqa: BLE001
                why = f"problem setup: {_short(exc)}"
                progress(f"{label}: {why}")
                rows += [_row(shape, kv, c, status="FAIL", reason=why) for c in contenders
                         if shape.op in c.ops]
                problems.append({"shape": shape.as_dict(), "kv_dtype": data.dtype_name(kv), "error": why})
                del p, ref
                _free(dev)
                if partial is not None:
                    partial(result(complete=False))
                continue
            entry = mla.describe_problem(p, ref) if is_mla else {
                "shape": shape.as_dict(), "op": shape.op, "kv_dtype": data.dtype_name(kv),
                "query_dtype": data.dtype_name(p.query.dtype), "seq_lens": _lens(p.lens),
                "num_blocks": p.key_cache.shape[0], "k_scale": p.k_scale, "v_scale": p.v_scale,
                "bytes": p.bytes_moved(), "reference": ref.describe(), "reference_error": ref.ref_err,
                "reference_ok": ref.ref_ok, "f64_subset": ref.subset, "tolerance": ref.tolerance,
            }
            if pre:
                entry.update(q_lens=_lens(p.q_lens), total_q=p.total_q, keys_attended=p.keys_attended(),
                             flop=p.flop())
            problems.append(entry)
            rows += run_problem(p, ref, contenders, timer, opts, copy.gbps, progress,
                                matmul.tflops if matmul else 0.0)
            p.extra.clear()
            del p, ref
            _free(dev)
            if partial is not None:
                partial(result(complete=False))

    return result()
