"""MLA decode's two context splits side by side, kernel by kernel (docs/cuda.md, "The balanced split").

Usage: python3 tools/mla_split_profile.py
For 64x4096 (16 and 128 heads) and a ragged 64x8192 at 16 heads, e4m3fn latent, block 64: a plan (hal.plan)
with the balanced split (the cuda pack's launch.MLA_SCHEDULE = "device") and with the uniform one, each run
replayed from a CUDA graph (time a run), then 20 runs under torch.profiler (each kernel's GPU time: the
schedule launch, the MLA kernel, the reduce). A plan keeps its work list while the lengths hold, so the
schedule launch timed here is the kept-list path. Needs an NVIDIA GPU and the cuda pack; run from the
repository root (it reuses the tests' problem builder).
"""

import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from test_emu_mla import make_mla  # noqa: E402

import hal  # noqa: E402
from hal.kernelpacks.cuda import launch  # noqa: E402


def graph_time_us(run, reps: int = 50) -> float:
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def kernel_times_us(run, reps: int = 20) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if ev.count and t:
            out[ev.key] = t / ev.count
    return out


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    ragged = torch.randint(512, 8193, (64,), generator=gen).tolist()
    ragged[0] = 8192
    for name, lens, heads in (("64x4096x16", [4096] * 64, 16), ("64x4096x128", [4096] * 64, 128),
                              ("64x8192x16 ragged", ragged, 16)):
        c = make_mla(lens, heads=heads, block_size=64, seed=1)
        c = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
        args = (c["q_nope"], c["q_pe"], c["ckv_cache"], c["kpe_cache"], c["block_tables"], c["seq_lens"])
        kw = dict(scale=c["scale"], ckv_scale=c["ckv_scale"], kpe_scale=c["kpe_scale"], max_seq_len=max(lens))
        out = torch.empty_like(c["q_nope"])
        for mode in ("device", "uniform"):
            launch.MLA_SCHEDULE = mode
            plan = hal.plan("mla_decode", *args, pack="cuda", **kw)

            def run():
                plan.run(*args[:4], ckv_scale=c["ckv_scale"], kpe_scale=c["kpe_scale"], out=out)
            t = graph_time_us(run)
            kernels = " | ".join(f"{k.split('(')[0][-40:]} {v:.1f} us" for k, v in kernel_times_us(run).items())
            print(f"{name:18s} {mode:8s} {t:7.1f} us a run | {kernels}")


if __name__ == "__main__":
    main()
