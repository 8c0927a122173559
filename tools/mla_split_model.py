"""A model of MLA decode's two context splits (packs/cuda/csrc/mla_schedule.cu against the uniform split of
packs/cuda/tuning.py's mla_split), on the CPU: the cap rule of the schedule launch, rewritten here line for
line, and each split's partitions dispatched to the SMs the way one-CTA-an-SM kernels are (in list order,
each to the first SM free), with a fixed cost a CTA.

Usage: python3 tools/mla_split_model.py [--sms 132] [--overhead 2] [--seed 7] [--verbose]
Prints, over a set of uniform and random ragged batches (16- and 64-row tiles), the modelled makespan of
the balanced split against the best of its candidates (how good the estimate is that picks one) and
against the uniform split (how much the balance should buy), in 64-token blocks. A model, not a
measurement: docs/cuda.md has the GPU figures.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random

BLOCK, MIN_BLOCKS, WAVES = 64, 4, 2  # launch.MLA_SCHEDULE_WAVES; kMinBlocks of mla_schedule.cu


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cut(b: int, cap: int) -> tuple[int, int]:
    """(partitions, blocks a partition) of a row tile of ``b`` blocks under ``cap``, as cut() in the kernel."""
    if b <= cap:
        return 1, b
    n = cdiv(b, cap)
    return n, cdiv(b, n)


def candidate_caps(bmax: int) -> list[int]:
    """The 32 candidates: the longest tile cut 1..8 times, then 8 x 1.127^i (the kernel's exp2 form)."""
    cuts = [lane + 1 if lane < 8 else int(8.0 * 2 ** (0.1725 * (lane - 7)) + 0.5) for lane in range(32)]
    return [max(MIN_BLOCKS, cdiv(bmax, c)) for c in cuts]


def estimate(cap: int, blocks: list[int], sms: int, c0: float, limit: int) -> float:
    items = sum(cut(b, cap)[0] for b in blocks)
    split = sum(n for n in (cut(b, cap)[0] for b in blocks) if n > 1)
    if items > limit or split > WAVES * sms:
        return math.inf
    mx = min(cap, max(blocks)) + c0
    return mx if items <= sms else max(mx, (sum(blocks) + c0 * items) / sms + 0.5 * mx)


def balanced_cap(blocks: list[int], sms: int, c0: float) -> tuple[int, list[int]]:
    """(the cap the schedule launch picks, every candidate cap), as mla_schedule.cu."""
    bmax, bmin = max(blocks), min(blocks)
    caps = candidate_caps(bmax)
    if bmin == bmax:  # one length: the uniform split's cut, one wave
        return max(MIN_BLOCKS, cdiv(bmax, max(1, sms // len(blocks)))), caps
    limit = len(blocks) + WAVES * sms
    scores = [estimate(c, blocks, sms, c0, limit) for c in caps]
    return caps[min(range(len(caps)), key=lambda i: (scores[i], i))], caps


def balanced_items(blocks: list[int], cap: int) -> list[int]:
    """Partition sizes in list order: longest first."""
    out = []
    for b in blocks:
        n, size = cut(b, cap)
        out += [min(size, b - j * size) for j in range(n)] if b else [0]
    return sorted(out, reverse=True)


def uniform_items(blocks: list[int], sms: int) -> list[int]:
    """tuning.mla_split: every tile cut by the longest into one wave, partitions >= 256 tokens."""
    bmax = max(blocks)
    parts = min(max(1, sms // len(blocks)), max(1, bmax * BLOCK // 256))
    size = cdiv(cdiv(bmax * BLOCK, parts), BLOCK)  # blocks
    return [max(0, min(size, b - p * size)) for p in range(cdiv(bmax, size)) for b in blocks]


def makespan(items: list[int], sms: int, c0: float) -> float:
    free = [0.0] * sms
    for size in items:
        t = heapq.heappop(free)
        heapq.heappush(free, t + size + c0)
    return max(free)


def batches(seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    out = []
    for n in (1, 4, 16, 32, 64, 128, 256):
        for ctx in (2048, 8192, 32768):
            for tiles in (1, 2):  # 16 heads (one 16-row tile), 128 heads (two 64-row tiles)
                out.append((f"{n}x{ctx}x{tiles}", [cdiv(ctx, BLOCK)] * n * tiles))
    for i in range(64):
        n, ctx, tiles = rng.choice((8, 16, 32, 64, 128, 256)), rng.choice((2048, 4096, 8192, 32768)), rng.choice((1, 2))
        lens = [rng.randint(max(1, ctx // 16), ctx) for _ in range(n)]
        lens[0] = ctx
        out.append((f"{n}x{ctx}x{tiles}:ragged#{i}", [cdiv(L, BLOCK) for L in lens for _ in range(tiles)]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=132, help="CTAs a wave, one an SM (default: an H100/H200's 132)")
    ap.add_argument("--overhead", type=float, default=2.0, help="fixed cost of a CTA in blocks (launch.MLA_SCHEDULE_OVERHEAD)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--verbose", action="store_true", help="a line a batch")
    a = ap.parse_args()
    rows = {"uniform": [], "ragged": []}
    for name, blocks in batches(a.seed):
        cap, caps = balanced_cap(blocks, a.sms, a.overhead)
        got = makespan(balanced_items(blocks, cap), a.sms, a.overhead)
        best = min(makespan(balanced_items(blocks, c), a.sms, a.overhead) for c in set(caps) | {cap})
        uni = makespan(uniform_items(blocks, a.sms), a.sms, a.overhead)
        rows["ragged" if "ragged" in name else "uniform"].append((got / best, uni / got))
        if a.verbose:
            print(f"{name:28s} cap {cap:5d}  balanced {got:8.1f}  best candidate {best:8.1f}  uniform {uni:8.1f}")
    for kind, r in rows.items():
        to_best, speedup = [x for x, _ in r], [y for _, y in r]
        print(f"{kind:8s} {len(r):3d} batches: balanced / best candidate mean {sum(to_best) / len(r):.3f}, "
              f"worst {max(to_best):.3f}; uniform / balanced mean {sum(speedup) / len(r):.3f}, "
              f"min {min(speedup):.3f}, max {max(speedup):.3f}")


if __name__ == "__main__":
    main()
