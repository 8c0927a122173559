"""Where a plan's run spends its host time on the cuda pack (for host-overhead work; tools/host_time has
the table the docs quote). Layers of a step as tools/host_time times them (30 calls, median of 30
steps, the GPU idle), for one decode problem per cache dtype:

  plan.run         the public per-layer call (layout checks, then the runner's raw launcher)
  raw              the runner's raw launcher on the layer's pointers and scales (the stream, the
                   prepared launch): what plan.run calls after its checks
  runner           the pack's runner on the layer's fields (reads the pointers from the tensors)
  prepared         _C.Prepared.run with the layer's pointers (pybind11, 10 arguments + cudaLaunchKernel)
  prepared, empty  the same for a launch prepared with num_seqs = 0 (it returns before launching:
                   pybind11 alone)
  one-shot binding _C.paged_attention with the whole argument list (38 arguments), as one-shot calls run
  torch zero_      out.zero_(), one torch kernel launch, for scale

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
    module = launch._C
    raw = torch._C._cuda_getCurrentRawStream
    for spec in specs or ["64x1024x32x8x128"]:
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            p = data.build(shapes.parse(spec), kv, "cuda")
            out = torch.empty_like(p.query)
            ks, vs = p.k_scale, p.v_scale
            captured = []

            class Spy:  # the arguments the plan's launch is prepared from
                def __getattr__(self, name):
                    return getattr(module, name)

                def paged_attention_prepare(self, *a):
                    captured.append(a)
                    return module.paged_attention_prepare(*a)

            launch._C = Spy()
            try:
                plan = hal.plan("paged_attention", p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                                out=out, scale=p.scale, k_scale=ks, v_scale=vs, max_seq_len=p.max_seq_len,
                                pack="cuda")
            finally:
                launch._C = module
            fields = {"query": p.query, "key_cache": p.key_cache, "value_cache": p.value_cache, "out": out,
                      "k_scale": 1.0 if ks is None else ks, "v_scale": 1.0 if vs is None else vs}
            args = list(captured[-1])
            empty = list(args)
            empty[NUM_SEQS] = 0
            prepared, nothing = plan._runner.prepared, module.paged_attention_prepare(*empty)
            index = p.query.device.index or 0
            ptrs = (out.data_ptr(), p.query.data_ptr(), p.key_cache.data_ptr(), p.value_cache.data_ptr(), 0)
            scales = ((ks.data_ptr(), vs.data_ptr(), 1.0, 1.0) if isinstance(ks, torch.Tensor)
                      else (0, 0, fields["k_scale"], fields["v_scale"]))
            rows = {
                "plan.run": lambda: plan.run(p.query, p.key_cache, p.value_cache, k_scale=ks, v_scale=vs, out=out),
                "raw": lambda: plan._raw(*ptrs, *scales),
                "runner": lambda: plan._runner(fields),
                "prepared": lambda: prepared.run(*ptrs, *scales, raw(index)),
                "prepared, empty": lambda: nothing.run(*ptrs, *scales, raw(index)),
                "one-shot binding": lambda: module.paged_attention(*args, raw(index)),
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
