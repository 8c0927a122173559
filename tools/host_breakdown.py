"""Where a plan's run spends its host time on the cuda pack (for host-overhead work; tools/host_time has
the table the docs quote). Layers of a step as tools/host_time times them (30 calls, median of 30
steps, the GPU idle), for one decode problem per cache dtype:

  plan.run       the public per-layer call (layout checks, then the runner)
  runner         the pack's prepared runner on the layer's fields (pointer fills, device check, launch)
  binding        _C.paged_attention with the runner's last argument list (pybind11 + cudaLaunchKernel)
  binding, empty the same list with num_seqs = 0 (the binding returns before launching: pybind11 alone)
  torch zero_    out.zero_(), one torch kernel launch, for scale

Usage: python3 tools/host_breakdown.py [SHAPE ...]   (default 64x1024x32x8x128; needs an NVIDIA GPU)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import hal  # noqa: E402
from hal.bench import data, shapes  # noqa: E402

NUM_SEQS = 27  # index of num_seqs in _C.paged_attention's argument list (launch.py)


def per_call(fn, layers=30, reps=30) -> float:
    fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(layers):
            fn()
        samples.append((time.perf_counter() - t0) / layers)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


@torch.no_grad()
def main(specs: list[str]) -> None:
    from hal.kernelpacks.cuda import launch
    for spec in specs or ["64x1024x32x8x128"]:
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            p = data.build(shapes.parse(spec), kv, "cuda")
            out = torch.empty_like(p.query)
            ks, vs = p.k_scale, p.v_scale
            captured, module = [], launch._C

            class Spy:  # the plan's runner keeps the launcher it was made with: spy from the start
                def __getattr__(self, name):
                    return getattr(module, name)

                def paged_attention(self, *a):
                    captured.append(a)
                    return module.paged_attention(*a)

            def make():
                return hal.plan("paged_attention", p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                                out=out, scale=p.scale, k_scale=ks, v_scale=vs, max_seq_len=p.max_seq_len,
                                pack="cuda")

            fields = {"query": p.query, "key_cache": p.key_cache, "value_cache": p.value_cache, "out": out,
                      "k_scale": 1.0 if ks is None else ks, "v_scale": 1.0 if vs is None else vs}
            launch._C = Spy()
            try:
                spied = make()  # kept alive: its workspace is in the captured arguments
                spied._runner(fields)
            finally:
                launch._C = module
            plan = make()
            real = module.paged_attention
            assert spied is not plan
            args = list(captured[-1])
            empty = list(args)
            empty[NUM_SEQS] = 0
            rows = {
                "plan.run": lambda: plan.run(p.query, p.key_cache, p.value_cache, k_scale=ks, v_scale=vs, out=out),
                "runner": lambda: plan._runner(fields),
                "binding": lambda: real(*args),
                "binding, empty": lambda: real(*empty),
                "torch zero_": out.zero_,
            }
            parts = args[33]  # num_parts
            print(f"{spec} {str(kv).removeprefix('torch.'):14s} ({parts} partition{'s' if parts > 1 else ''}): "
                  + "  ".join(f"{k} {per_call(fn):.1f}" for k, fn in rows.items()) + "  (us host per call)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", metavar="SHAPE", help="decode shapes (hal-bench specs)")
    main(ap.parse_args().shapes)
