"""One hal.mla_decode shape, called a few times (for profilers: ncu, nsys).

Usage: python3 tools/mla_once.py KERNEL CACHE [BATCH CONTEXT HEADS BLOCK]
KERNEL: auto | mma | wgmma | narrow (the cuda pack's launch.MLA_KERNEL); CACHE: the latent's torch dtype name (bfloat16,
float8_e4m3fn, ...; the rope is bf16). Defaults: 32 sequences of 8192 tokens, 128 heads, block 64.
"""

import sys

import torch

import hal
from hal.kernelpacks.cuda import launch


def main(argv: list[str]) -> None:
    kernel, cache = argv[0], getattr(torch, argv[1])
    n, length, h, bs = (int(x) for x in (argv[2:] or [32, 8192, 128, 64]))
    launch.MLA_KERNEL = kernel
    g = torch.Generator(device="cuda").manual_seed(0)
    nb = n * length // bs
    ckv = torch.randn(nb, bs, 512, device="cuda", generator=g).to(cache)
    kpe = torch.randn(nb, bs, 64, device="cuda", generator=g).to(torch.bfloat16)
    tables = torch.randperm(nb, device="cuda", generator=g).to(torch.int32).view(n, -1)
    lens = torch.full((n,), length, dtype=torch.int32, device="cuda")
    qn = torch.randn(n, h, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    qp = torch.randn(n, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(4):
        hal.mla_decode(qn, qp, ckv, kpe, tables, lens, scale=576 ** -0.5, ckv_scale=1.0, kpe_scale=1.0,
                       max_seq_len=length)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
