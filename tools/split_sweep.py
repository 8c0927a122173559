"""Time the cuda decode kernel on bench shapes under forced splits of the context (for tuning work).

Usage: python3 tools/split_sweep.py [--shapes S,...] [--kv bfloat16,float8_e4m3fn] [--parts 1,2,4,...]
       [--merge reduce,kernel] [--fp8-tiles 8,16] [--budget 0.2]
For every shape and cache dtype: the tuning table's own choice, then each forced partition count
(rounded to 64-token partitions) with each merge (launch.DECODE_MERGE) and, for FP8 caches, each
query-head tile of a CTA (launch.HEAD_TILE: 8 or 16; FP8 above head 128, and where 8-head tiles
get warp rows, the launcher takes 8 whatever it says), as µs and fraction of the copy bandwidth
measured first. Outputs are compared with the first variant's (a split only reorders sums).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import hal  # noqa: E402
from hal.bench import data, shapes, timing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4x8192x32x8x128,1x131072x32x8x128,32x8192x128x8x128")
    ap.add_argument("--kv", default="float8_e4m3fn,bfloat16")
    ap.add_argument("--parts", default="")
    ap.add_argument("--merge", default="reduce,kernel")
    ap.add_argument("--fp8-tiles", default="8")
    ap.add_argument("--budget", type=float, default=0.2)
    a = ap.parse_args()
    from hal.kernelpacks.cuda import launch
    dev = torch.device("cuda")
    copy = timing.copy_bandwidth(dev)
    print(f"copy {copy.gbps:.0f} GB/s")
    timer = timing.Timer(dev)
    real_plan = launch.plan
    for spec in a.shapes.split(","):
        shape = shapes.parse(spec)
        for kv, tile in [(kv, t) for kv in a.kv.split(",") for t in (a.fp8_tiles.split(",") if "float8" in kv else [0])]:
            if tile:
                launch.HEAD_TILE[1] = int(tile)
            prob = data.build(shape, getattr(torch, kv), dev)
            kw = {"k_scale": prob.k_scale, "v_scale": prob.v_scale} if prob.k_scale is not None else {}
            out = torch.empty_like(prob.query)
            nbytes = 2 * int(prob.seq_lens.sum()) * shape.num_kv_heads * shape.head_size * prob.key_cache.element_size()

            def call():
                hal.paged_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_tables, prob.seq_lens,
                                    scale=prob.scale, out=out, pack="cuda", max_seq_len=prob.max_seq_len, **kw)

            wide = launch.head_tile(prob.key_cache.element_size(), shape.head_size)
            two = shape.num_heads // shape.num_kv_heads > 8 and wide > 8
            kv = f"{kv}/{tile}" if tile else kv
            occ = launch._C.decode_ctas_per_sm(launch.KINDS[prob.key_cache.dtype], shape.head_size, two, False)
            print(f"{spec} {kv}: {'two head tiles' if two else 'one head tile'} a CTA, {occ} CTAs/SM resident")
            variants = [("table", None, "auto")]
            for p in [int(x) for x in a.parts.split(",") if x]:
                variants += [(f"{p} parts", p, m) for m in a.merge.split(",")]
            first = None
            for name, parts, merge in variants:
                launch.DECODE_MERGE = merge
                if parts is None:
                    launch.plan = real_plan
                else:
                    size = -(-(-(-prob.max_seq_len // parts)) // 64) * 64
                    launch.plan = lambda *args, size=size, **kws: (size, -(-prob.max_seq_len // size), False)
                try:
                    tiles = -(-(shape.num_heads // shape.num_kv_heads) // wide)
                    used = launch.plan(shape.batch, shape.num_kv_heads, tiles, prob.max_seq_len, dev, prob.key_cache.dtype)
                    call()
                    got = out.float().clone()
                    if first is None:
                        first = got
                    diff = (got - first).abs().max().item()
                    t = timer.run(call, reps=20, warmup=3, budget_s=a.budget).median_s
                finally:
                    launch.plan, launch.DECODE_MERGE = real_plan, "auto"
                print(f"{spec} {kv:16s} {name:10s} {merge:6s} size {used[0]:6d} parts {used[1]:3d} "
                      f"{t * 1e6:8.1f} us  {nbytes / t / 1e9 / copy.gbps:.3f} of copy  maxdiff {diff:.2g}")


if __name__ == "__main__":
    main()
