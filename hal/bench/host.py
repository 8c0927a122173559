"""Host time per call: the one-shot call against a plan's ``run`` (``hal.plan``), for decode
(``hal.paged_attention``) and MLA decode (``hal.mla_decode``) problems of the benchmark's shapes.

What is timed, per problem, as an engine's step does it: ``layers`` calls back to back (one per
layer, the same per-layer tensors, the output given), ``time.perf_counter`` around the whole loop,
divided by ``layers``; the median of ``reps`` such steps. Rows:

- ``one-shot``: ``hal.paged_attention(...)`` / ``hal.mla_decode(...)`` (validation, dispatch, the
  pack's launch planning, the launch);
- ``plan.run``: ``plan.run(...)`` of a plan made once before timing (layout checks, the launch);
- ``pack``: the selected pack's implementation called on a ready call record (no hal layer at all:
  the floor neither path can go under);
- ``hal.plan``: making the plan itself (once per step, not per layer);
- ``compat-fa2`` / ``compat-fa3`` / ``compat-flashinfer`` (decode): the same call through the
  drop-in entry points (:mod:`hal.bench.compat`), each served by one plan kept across its calls.

On a GPU the launches are asynchronous, so host time is what the host spends; it is measured with
the GPU idle (synchronised before every step) and with a queue of work (the GPU held busy by a
sleep kernel while the host launches, as in a running engine), next to the kernel time (CUDA
events over one call). On the CPU the pack computes on the host, so its time is part of every row;
Everything runs under ``torch.no_grad()``, as an engine runs.
``stub`` (on by default on the CPU) swaps the pack's implementation for a no-op while timing, which
leaves hal's own host time per call, the figure the plan is about.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import torch

import hal
from hal import dispatch, ops


@dataclasses.dataclass
class Row:
    shape: str
    kv_dtype: str
    op: str
    pack: str
    mode: str              # "gpu idle" | "gpu queued" | "cpu" | "cpu, pack stubbed"
    what: str              # "one-shot" | "plan.run" | "pack" | "hal.plan" | a compat entry point
    host_us: float
    kernel_us: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Calls:
    """The per-layer callables of one problem."""
    op: str
    pack: str
    one_shot: object
    run: object
    pack_only: object
    make_plan: object


def decode_calls(p, pack: str | None = None) -> Calls:
    """``p``: a :class:`hal.bench.data.Problem`."""
    out = torch.empty_like(p.query)
    q, kc, vc, bt, sl = p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens
    ks, vs = p.k_scale, p.v_scale
    kw = dict(scale=p.scale, k_scale=ks, v_scale=vs, max_seq_len=p.max_seq_len, pack=pack)
    plan = hal.plan("paged_attention", q, kc, vc, bt, sl, out=out, **kw)
    record = ops.prepare("paged_attention", query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl,
                         out=out, **{k: v for k, v in kw.items() if k != "pack"})
    impl = dispatch.select(record.call_key, pack).impl("paged_attention")
    return Calls("paged_attention", plan.pack,
                 lambda: hal.paged_attention(q, kc, vc, bt, sl, out=out, **kw),
                 lambda: plan.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out),
                 lambda: impl(record),
                 lambda: hal.plan("paged_attention", q, kc, vc, bt, sl, out=out, **kw))


def mla_calls(p, pack: str | None = None) -> Calls:
    """``p``: a :class:`hal.bench.mla.MlaProblem`."""
    from hal.bench import mla_baselines
    qn, qp, ckv, kpe, bt, sl = mla_baselines._args(p)
    kw = {**mla_baselines._hal_kwargs(p), "pack": pack}
    out = mla_baselines._out(p)
    cs, ps = kw["ckv_scale"], kw["kpe_scale"]
    plan = hal.plan("mla_decode", qn, qp, ckv, kpe, bt, sl, out=out, **kw)
    record = mla_baselines.call_record(p, out)
    impl = dispatch.select(record.call_key, pack).impl("mla_decode")
    return Calls("mla_decode", plan.pack,
                 lambda: hal.mla_decode(qn, qp, ckv, kpe, bt, sl, out=out, **kw),
                 lambda: plan.run(qn, qp, ckv, kpe, ckv_scale=cs, kpe_scale=ps, out=out),
                 lambda: impl(record),
                 lambda: hal.plan("mla_decode", qn, qp, ckv, kpe, bt, sl, out=out, **kw))


@contextlib.contextmanager
def stubbed(pack_name: str):
    """The pack's implementations replaced by a no-op (its ``impl`` and ``prepare``), so that what is
    timed is hal's own host work. Plans must be made inside the block."""
    from hal import registry
    p = registry.by_name(pack_name)

    def noop(call):
        return None
    p.impl = lambda op: noop
    try:
        yield
    finally:
        del p.impl


_SLEEP = 20_000_000   # cycles: ~12 ms at H200 clocks, longer than a step's launches


def host_per_call(fn, device: torch.device, *, layers: int, reps: int, queued: bool = False) -> float:
    """Median over ``reps`` steps of (host time of ``layers`` calls) / ``layers``, in seconds."""
    cuda = device.type == "cuda"
    fn()  # warm
    samples = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
            if queued:
                torch.cuda._sleep(_SLEEP)
        t0 = time.perf_counter()
        for _ in range(layers):
            fn()
        samples.append((time.perf_counter() - t0) / layers)
        if cuda:
            torch.cuda.synchronize(device)
    return statistics.median(samples)


def kernel_time(fn, device: torch.device, reps: int = 20) -> float | None:
    """Median device time of one call (CUDA events), None on the CPU."""
    if device.type != "cuda":
        return None
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _compat_calls(problem, op: str) -> list:
    """(name, call) of each hal.compat entry point that serves this decode problem (hal.bench.compat)."""
    if op != "paged_attention":
        return []
    from hal.bench import compat
    from hal.bench.baselines import Skip
    got = []
    for name, make in compat.ENTRY_POINTS.items():
        try:
            got.append((name, make(problem)))
        except Skip:
            continue
    return got


@torch.no_grad()
def measure(problem, *, layers: int = 30, reps: int = 30, pack: str | None = None, stub: bool | None = None,
            make=None) -> list[Row]:
    """Every row (see the module docstring) for one problem. ``make``: the problem's calls
    (:func:`decode_calls` / :func:`mla_calls`, picked from ``problem.op``). ``stub``: also time with
    the pack stubbed (default: on the CPU only)."""
    make = make or (mla_calls if getattr(problem, "op", "decode") == "mla" else decode_calls)
    device = problem.device
    cuda = device.type == "cuda"
    stub = (not cuda) if stub is None else stub
    spec = problem.shape.spec
    kv = str(problem.kv_dtype).removeprefix("torch.")
    calls = make(problem, pack)
    kernel = kernel_time(calls.one_shot, device)
    rows = []
    modes = [("gpu idle", False), ("gpu queued", True)] if cuda else [("cpu", False)]
    entry_points = _compat_calls(problem, calls.op)
    for mode, queued in modes:
        for what, fn in (("one-shot", calls.one_shot), ("plan.run", calls.run), ("pack", calls.pack_only),
                         ("hal.plan", calls.make_plan), *entry_points):
            t = host_per_call(fn, device, layers=layers, reps=reps, queued=queued)
            rows.append(Row(spec, kv, calls.op, calls.pack, mode, what, t * 1e6,
                            None if kernel is None else kernel * 1e6))
    if stub:
        with stubbed(calls.pack):
            s = make(problem, pack)
            for what, fn in (("one-shot", s.one_shot), ("plan.run", s.run), ("hal.plan", s.make_plan),
                             *_compat_calls(problem, s.op)):
                t = host_per_call(fn, device, layers=layers, reps=reps)
                rows.append(Row(spec, kv, s.op, s.pack, f"{'gpu' if cuda else 'cpu'}, pack stubbed", what, t * 1e6))
    return rows
