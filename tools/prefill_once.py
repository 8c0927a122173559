"""One multi-token hal.paged_attention shape, called a few times (for profilers: ncu, nsys).

Usage: python3 tools/prefill_once.py KERNEL CACHE [N L HEADS KV_HEADS HEAD_SIZE BLOCK]
KERNEL: mma | wgmma | cute (the cuda pack's launch.PREFILL_KERNEL); CACHE: a torch dtype name (bfloat16,
float8_e4m3fn, ...). Defaults: 8 fresh prefills of 2048 tokens, 32 query heads over 8, head 128, block 16.
"""

import sys

import torch

import hal
from hal.kernelpacks.cuda import launch


def main(argv: list[str]) -> None:
    kernel, cache = argv[0], getattr(torch, argv[1])
    n, length, h, hkv, d, bs = (int(x) for x in (argv[2:] or [8, 2048, 32, 8, 128, 16]))
    launch.PREFILL_KERNEL = kernel
    g = torch.Generator(device="cuda").manual_seed(0)
    nb = n * length // bs
    kc = torch.randn(nb, hkv, bs, d, device="cuda", generator=g).to(cache)
    vc = torch.randn(nb, hkv, bs, d, device="cuda", generator=g).to(cache)
    tables = torch.randperm(nb, device="cuda", generator=g).to(torch.int32).view(n, -1)
    lens = torch.full((n,), length, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device="cuda")
    q = torch.randn(n * length, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(4):
        hal.paged_attention(q, kc, vc, tables, lens, k_scale=1.0, v_scale=1.0, query_start_loc=qsl,
                            max_query_len=length, max_seq_len=length)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
