"""Timing: CUDA events on a GPU (L2 flushed before every timed call), ``time.perf_counter`` on the CPU
(the last-level cache flushed the same way); the device's copy bandwidth (decode's ceiling) and a
bf16 matrix product's TFLOP/s (prefill's ceiling), measured the same way.

The flush *reads* a buffer several times the cache: that evicts what the op read and leaves the
cache holding clean lines. A flush that writes leaves the cache full of dirty lines, which the timed
op then pays to write back to memory as it reads (on the H200, 2026-11-29: ~27 MB of write-back and
3-9 us more per call, for every contender alike, at 150-500 us per call): time that belongs to the
flush, not to the op.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

CPU_FLUSH_BYTES = 64 << 20


@dataclasses.dataclass
class Timing:
    median_s: float
    min_s: float
    reps: int
    samples_s: list[float]
    host_median_s: float = 0.0   # time the call takes on the host (launch overhead), not waited for


_SLEEP_CYCLES = 2_000_000  # ~1 ms at H200 clocks: longer than any call's host overhead


class Timer:
    """Times a callable on one device. ``flush`` reads a buffer bigger than the last-level cache
    between calls (outside the timed interval) so each call reads its data from memory."""

    def __init__(self, device: torch.device, flush: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._last_host_s = 0.0
        self._flush_buf = None
        if flush:
            if self.cuda:
                l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or (64 << 20)
                size = max(4 * l2, 256 << 20)
            else:
                size = CPU_FLUSH_BYTES
            self._flush_buf = torch.ones(size // 4, dtype=torch.float32, device=self.device)

    @property
    def flush_bytes(self) -> int:
        return 0 if self._flush_buf is None else self._flush_buf.numel() * 4

    def _flush(self) -> None:
        if self._flush_buf is not None:
            self._flush_buf.sum()  # a read of the whole buffer: evicts what the op read, leaves clean lines

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], object], reps: int, warmup: int = 0, budget_s: float | None = None) -> Timing:
        """One callable: see :meth:`interleaved`."""
        result = self.interleaved({"fn": fn}, reps, warmup, budget_s)["fn"]
        if isinstance(result, BaseException):
            raise result
        return result

    def interleaved(self, fns: dict[str, Callable[[], object]], reps: int, warmup: int = 0,
                    budget_s: float | None = None) -> dict[str, Timing | BaseException]:
        """Time several callables in turns (rep 1 of each, then rep 2 of each, ...), so a change in
        the machine's load during the run hits every contender alike.

        Each callable first gets ``warmup`` calls (at least one); the fastest of them estimates its
        time, and its reps are cut to fit ``budget_s`` (at least 3). A callable that raises is
        dropped and its exception returned in its place. Median and min of the reps."""
        results: dict[str, Timing | BaseException] = {}
        todo: dict[str, int] = {}
        for name, fn in fns.items():
            try:
                est = min(self._calls([fn]) for _ in range(max(1, warmup)))
            except Exception as exc:  # noqa: BLE001
                results[name] = exc
                continue
            n = reps
            if budget_s is not None and est > 0:
                n = max(3, min(reps, int(budget_s / est)))
            todo[name] = n
        samples: dict[str, list[float]] = {name: [] for name in todo}
        host: dict[str, list[float]] = {name: [] for name in todo}
        for r in range(max(todo.values(), default=0)):
            turn = [name for name in todo if r < todo[name] and name not in results]
            for name in turn:
                try:
                    samples[name].append(self._calls([fns[name]]))
                    host[name].append(self._last_host_s)
                except Exception as exc:  # noqa: BLE001
                    results[name] = exc
        for name, xs in samples.items():
            if name not in results:
                results[name] = Timing(statistics.median(xs), min(xs), len(xs), xs, statistics.median(host[name]))
        return {name: results[name] for name in fns}

    def _calls(self, fns) -> float:
        """Time of one call (the cache flushed first); on a GPU, waits for it."""
        fn = fns[0]
        self._flush()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            # Keep the GPU busy while the host launches the call, so the events time the GPU work
            # and not the host's launch overhead (which is reported apart, as host time).
            torch.cuda._sleep(_SLEEP_CYCLES)
            start.record()
            h0 = time.perf_counter()
            fn()
            self._last_host_s = time.perf_counter() - h0
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        self._last_host_s = time.perf_counter() - t0
        return self._last_host_s


@dataclasses.dataclass
class CopyBandwidth:
    gbps: float            # (bytes read + bytes written) / median time, 1e9 bytes per second
    buffer_bytes: int
    median_s: float
    method: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def copy_bandwidth(device: torch.device, buffer_bytes: int | None = None, reps: int | None = None) -> CopyBandwidth:
    """Device-to-device copy of a large buffer into a preallocated one, counting read + write bytes.
    GPU: 1 GiB, CUDA events. CPU: 256 MiB (well past the last-level cache), perf_counter. A clone
    would also time the allocator's fresh pages; ``dst.copy_(src)`` times the copy alone."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    size = buffer_bytes or ((1 << 30) if cuda else (256 << 20))
    reps = reps or (20 if cuda else 7)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty_like(src)
    timer = Timer(device, flush=False)
    t = timer.run(lambda: dst.copy_(src), reps=reps, warmup=2)
    del src, dst
    return CopyBandwidth(2 * size / t.median_s / 1e9, size, t.median_s,
                         f"{'device-to-device' if cuda else 'host'} dst.copy_(src) of {size >> 20} MiB, "
                         f"median of {t.reps}, read+write bytes")


@dataclasses.dataclass
class Matmul:
    tflops: float          # 2 n^3 / median time, 1e12 FLOP per second
    n: int
    dtype: str
    median_s: float
    method: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def matmul_tflops(device: torch.device, n: int | None = None, reps: int | None = None) -> Matmul:
    """The ceiling prefill is compared with: ``torch.matmul(a, b, out=c)`` of two n x n bf16 matrices
    of N(0, 1) values (random data: zeros run faster), 2 n^3 FLOP over the median time. GPU: n = 8192,
    CUDA events (the H200 gives ~790 TFLOP/s); CPU: n = 1024, perf_counter."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 1024)
    reps = reps or (10 if cuda else 5)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), generator=gen, device=device).to(torch.bfloat16)
    b = torch.randn((n, n), generator=gen, device=device).to(torch.bfloat16)
    c = torch.empty((n, n), dtype=torch.bfloat16, device=device)
    timer = Timer(device, flush=False)
    t = timer.run(lambda: torch.matmul(a, b, out=c), reps=reps, warmup=3)
    del a, b, c
    return Matmul(2 * n ** 3 / t.median_s / 1e12, n, "bf16", t.median_s,
                  f"torch.matmul of two {n}x{n} bf16 matrices (random values), median of {t.reps}")
