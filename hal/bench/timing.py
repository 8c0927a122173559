"""Timing: CUDA events on a GPU (L2 flushed before every timed call), ``time.perf_counter`` on the CPU
(the last-level cache flushed the same way); and the device's copy bandwidth, measured the same way.
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


class Timer:
    """Times a callable on one device. ``flush`` writes a buffer bigger than the last-level cache
    between calls (outside the timed interval) so each call reads its data from memory."""

    def __init__(self, device: torch.device, flush: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._flush_buf = None
        if flush:
            if self.cuda:
                l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or (64 << 20)
                size = max(4 * l2, 256 << 20)
            else:
                size = CPU_FLUSH_BYTES
            self._flush_buf = torch.empty(size, dtype=torch.uint8, device=self.device)

    @property
    def flush_bytes(self) -> int:
        return 0 if self._flush_buf is None else self._flush_buf.numel()

    def _flush(self) -> None:
        if self._flush_buf is not None:
            self._flush_buf.fill_(1)  # a write of the whole buffer evicts what the op read

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], object], reps: int, warmup: int = 0, budget_s: float | None = None) -> Timing:
        """``warmup`` untimed-for-the-result calls (their times decide how many reps fit ``budget_s``,
        at least 3), then the reps; median and min of the reps."""
        est = None
        for _ in range(max(1, warmup)):
            t = self._one(fn)
            est = t if est is None else min(est, t)
        if budget_s is not None and est and est > 0:
            reps = max(3, min(reps, int(budget_s / est)))
        samples = self._many(fn, reps)
        return Timing(statistics.median(samples), min(samples), len(samples), samples)

    def _one(self, fn) -> float:
        return self._many(fn, 1)[0]

    def _many(self, fn, reps: int) -> list[float]:
        if self.cuda:
            pairs = []
            for _ in range(reps):
                self._flush()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) / 1e3 for s, e in pairs]
        out = []
        for _ in range(reps):
            self._flush()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out


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
