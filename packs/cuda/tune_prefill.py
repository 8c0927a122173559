"""tools/tune --prefill: which head sizes take the sm_90a multi-token kernel on this GPU.

For each head size the wgmma kernel serves (csrc/prefill_sm90.cuh: 64, 128, 192) it times the cuda
pack's multi-token ``hal.paged_attention`` with ``launch.PREFILL_KERNEL = "mma"`` and ``"wgmma"`` on
the prefill bench's shapes (fresh, chunked, ragged prefill and a mixed batch; bf16 and e4m3fn caches),
after checking that both give the same output to within the rounding of P, and chooses the wgmma
kernel for a head size when it is faster on the geometric mean by ``--margin`` and never slower than
``1 / (1 + margin)`` on a shape (so no shape loses more than the margin). ``--write`` stores the list
as ``prefill.wgmma_head_sizes`` of this GPU's tuning entry, with the command that measured it.
"""

from __future__ import annotations

import json
import math

import torch

WGMMA_HEAD_SIZES = (64, 128, 192)  # csrc/prefill_sm90.cuh wg_head_size
SHAPES = ("8x2048/32x8x{d}", "4x1024@8192/32x8x{d}", "16x100-3000/32x8x{d}", "64x1@4096+2x1024/32x8x{d}")
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
KERNELS = ("mma", "wgmma")


def choose(times: dict[int, dict[str, dict[str, float]]], margin: float) -> tuple[list[int], dict[int, dict]]:
    """``times[head][case][kernel]`` (seconds) -> (head sizes that take the wgmma kernel, per head the
    geometric-mean and the worst speedup of wgmma over mma)."""
    picked, why = [], {}
    for d, cases in sorted(times.items()):
        ratios = [c["mma"] / c["wgmma"] for c in cases.values()]
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        worst = min(ratios)
        why[d] = {"geomean_speedup": geo, "worst_speedup": worst}
        if geo >= 1 + margin and worst >= 1 / (1 + margin):
            picked.append(d)
    return picked, why


def _time_case(spec: str, kv: torch.dtype, timer, device, budget_s: float) -> dict[str, float]:
    import hal
    from hal.bench import prefill

    from . import launch

    p = prefill.build(prefill.parse(spec), kv, device)
    out = torch.empty_like(p.query)
    kw = {"k_scale": p.k_scale, "v_scale": p.v_scale} if p.k_scale is not None else {}

    def call():
        hal.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, scale=p.scale,
                            query_start_loc=p.query_start_loc, max_query_len=p.max_query_len,
                            max_seq_len=p.max_seq_len, out=out, pack="cuda", **kw)

    row, first = {}, None
    saved = launch.PREFILL_KERNEL
    try:
        for kernel in KERNELS:
            launch.PREFILL_KERNEL = kernel
            call()
            got = out.float().clone()
            if first is None:
                first = got
            else:  # P is rounded to 16 bits in both, in different orders: a few ulp of the output
                rel = ((got - first).norm() / first.norm().clamp_min(1e-30)).item()
                if not rel <= 5e-3:
                    raise RuntimeError(f"{spec} {kv}: the wgmma kernel's output differs from mma.sync's "
                                       f"(relative L2 {rel:.3g})")
            row[kernel] = timer.run(call, reps=20, warmup=2, budget_s=budget_s).median_s
    finally:
        launch.PREFILL_KERNEL = saved
    return row


def run(args, console, argv_text: str) -> int:
    """The --prefill mode of tools/tune (packs/cuda/tune.py parses the command line)."""
    import datetime

    from rich.table import Table

    try:
        heads = [int(x) for x in args.head_sizes.split(",") if x.strip()]
    except ValueError:
        heads = []
    if not heads or any(d not in WGMMA_HEAD_SIZES for d in heads):
        console.print(f"[red]tools/tune: --head-sizes expects some of {', '.join(map(str, WGMMA_HEAD_SIZES))} "
                      f"(the wgmma kernel's), got {args.head_sizes!r}[/red]")
        return 2
    if not torch.cuda.is_available():
        console.print("[red]tools/tune needs an NVIDIA GPU (the cuda pack)[/red]")
        return 2
    from hal.bench.timing import Timer

    from . import launch, tuning

    device = torch.device("cuda", torch.cuda.current_device())
    arch = launch._device_facts(device.index)[1]
    if not launch._C.prefill_wgmma():
        console.print(f"[red]tools/tune --prefill: the wgmma kernel cannot run here ({arch}; it needs an sm_90 GPU and "
                      f"a module built with sm_90a code): nothing to choose[/red]")
        return 2
    timer = Timer(device)
    times: dict[int, dict[str, dict[str, float]]] = {}
    table = Table(title=f"multi-token kernels on {torch.cuda.get_device_name(device)} ({arch}), median µs")
    for col in ("shape", "KV", "mma.sync", "wgmma", "wgmma speedup"):
        table.add_column(col, justify="left" if col in ("shape", "KV") else "right")
    for d in heads:
        times[d] = {}
        for spec in SHAPES:
            for kv in KV_DTYPES:
                t = _time_case(spec.format(d=d), kv, timer, device, args.budget)
                times[d][f"{spec.format(d=d)} {kv}"] = t
                table.add_row(spec.format(d=d), str(kv).removeprefix("torch."), f"{t['mma'] * 1e6:.1f}",
                              f"{t['wgmma'] * 1e6:.1f}", f"{t['mma'] / t['wgmma']:.3f}")
    console.print(table)
    picked, why = choose(times, args.margin)
    for d, w in why.items():
        console.print(f"head {d}: wgmma geomean speedup {w['geomean_speedup']:.3f}, worst {w['worst_speedup']:.3f}"
                      f" -> {'wgmma' if d in picked else 'mma.sync'}")
    stamp = {"device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
             "command": "tools/tune " + argv_text, "torch": torch.__version__, "margin": args.margin,
             "speedups": {str(d): w for d, w in why.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": arch, **stamp, "times_s": {str(d): t for d, t in times.items()},
                       "wgmma_head_sizes": picked}, f, indent=1)
    if args.write:
        data = json.loads(tuning.TUNING_FILE.read_text())
        entry = data.setdefault(arch, {"classes": dict(data["default"]["classes"])})
        keep = [d for d in entry.get("prefill", {}).get("wgmma_head_sizes", []) if d not in heads]
        entry["prefill"] = {"wgmma_head_sizes": sorted(keep + picked), "measured": stamp}
        tuning.TUNING_FILE.write_text(json.dumps(data, indent=2) + "\n")
        tuning.tuning_table.cache_clear()
        console.print(f"wrote {arch}'s prefill entry into {tuning.TUNING_FILE}: wgmma for {sorted(keep + picked)}")
    return 0
