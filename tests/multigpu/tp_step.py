"""A tensor-parallel attention step under torchrun (one process per GPU, NCCL), checked against the
same step on one GPU. tests/test_multi_gpu.py runs it; by hand:

    torchrun --nproc-per-node=N tests/multigpu/tp_step.py [--dir DIR]

Every rank holds its slice of the query heads and KV heads (heads / N each), its own paged cache on
its own GPU and its own scales, loaded from one per-head checkpoint fixture with
``hal.load_kv_scales(path, tp_rank=rank, tp_size=N)``. Per layer of a model-shaped step it writes
the step's K/V (``hal.cache_kv``), runs a decode step (one row a sequence) and a mixed step (a
prefill chunk, a prefill, decode rows: ``query_start_loc``), one-shot and through ``hal.plan``, and
replays the decode step as a CUDA graph on its own device. Rank 0 then gathers every rank's outputs
and cache bytes (``all_gather``) and compares them with the whole problem run on its GPU alone.

While hal runs, every rank's *current* device is cuda:0 (only collectives switch to the rank's own):
an op must launch on the device of its tensors and that device's current stream, not on the current
device, which on rank > 0 is another GPU. Tensors on two devices must be an error naming the argument.
Exit status 0 when every check passes; the failures are printed (by rank) otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import hal  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD, BLOCK = 2, 32, 8, 128, 16
DECODE_LENS = [300, 17, 1024, 65]          # context of the decode rows (the new token included)
MIXED = [(40, 260), (64, 64), (1, 900)]    # (new tokens, context incl. them): chunk, prefill, decode row
REL = 5e-3                                 # relative L2 between the ranks' and one GPU's outputs


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def write_checkpoint(path: pathlib.Path) -> None:
    """Per-head k/v scales of every layer, as an FP8 checkpoint stores them."""
    from safetensors.torch import save_file
    t = {}
    for i in range(LAYERS):
        for name, base in (("k_scale", 0.012), ("v_scale", 0.010)):
            t[f"model.layers.{i}.self_attn.{name}"] = (base * (1 + 0.1 * torch.arange(KV_HEADS))).float()
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    save_file(t, str(path))


class Problem:
    """The whole problem (every head), built on the CPU from fixed seeds: each rank slices it."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        seqs = [(1, L) for L in DECODE_LENS] + MIXED
        self.lens = [L for _, L in seqs]
        self.blocks_per_seq = [-(-L // BLOCK) for L in self.lens]
        self.num_blocks = sum(self.blocks_per_seq) + 3
        perm = torch.randperm(self.num_blocks, generator=g).to(torch.int32)
        width = max(self.blocks_per_seq)
        self.tables = torch.zeros((len(seqs), width), dtype=torch.int32)
        at = 0
        for i, u in enumerate(self.blocks_per_seq):
            self.tables[i, :u] = perm[at:at + u]
            at += u
        tokens = sum(self.lens)
        self.slots = torch.cat([self.tables[i, torch.arange(L) // BLOCK].long() * BLOCK + torch.arange(L) % BLOCK
                                for i, L in enumerate(self.lens)])
        self.k = [torch.randn(tokens, KV_HEADS, HEAD, generator=g) * 1.5 for _ in range(LAYERS)]
        self.v = [torch.randn(tokens, KV_HEADS, HEAD, generator=g) for _ in range(LAYERS)]
        nd = len(DECODE_LENS)
        self.decode_q = [torch.randn(nd, HEADS, HEAD, generator=g).bfloat16() for _ in range(LAYERS)]
        q_lens = [q for q, _ in MIXED]
        self.mixed_q = [torch.randn(sum(q_lens), HEADS, HEAD, generator=g).bfloat16() for _ in range(LAYERS)]
        self.qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        self.nd = nd


def run_slice(p: Problem, dev: torch.device, heads: slice, kv_heads: slice, scales) -> dict:
    """Every op of the step over the given heads, on ``dev``; returns the outputs and cache bytes."""
    cache_dtype = hal.fp8.native_e4m3()
    hkv = kv_heads.stop - kv_heads.start
    tables, nd = p.tables.to(dev), p.nd
    dec_tables, mixed_tables = tables[:nd], tables[nd:]
    lens = torch.tensor(p.lens, dtype=torch.int32, device=dev)
    dec_lens, mixed_lens = lens[:nd], lens[nd:]
    qsl = p.qsl.to(dev)
    slots = p.slots.to(dev)
    out = {"decode": [], "mixed": [], "plan": [], "graph": [], "kc": [], "vc": []}
    caches = []
    for layer in range(LAYERS):
        kc = torch.empty((p.num_blocks, hkv, BLOCK, HEAD), dtype=cache_dtype, device=dev)
        vc = torch.empty_like(kc)
        kc.view(torch.uint8).fill_(0x7F)   # NaN bytes wherever nothing is written
        vc.view(torch.uint8).fill_(0x7F)
        ks, vs = scales.for_cache(layer, kc)
        hal.cache_kv(p.k[layer][:, kv_heads].to(dev), p.v[layer][:, kv_heads].to(dev), kc, vc, slots,
                     k_scale=ks, v_scale=vs)
        caches.append((kc, vc, ks, vs))
        out["kc"].append(kc.view(torch.uint8).cpu())
        out["vc"].append(vc.view(torch.uint8).cpu())
        q = p.decode_q[layer][:, heads].to(dev)
        out["decode"].append(hal.paged_attention(q, kc, vc, dec_tables, dec_lens, k_scale=ks, v_scale=vs,
                                                 max_seq_len=max(DECODE_LENS)).cpu())
        mq = p.mixed_q[layer][:, heads].to(dev)
        out["mixed"].append(hal.paged_attention(mq, kc, vc, mixed_tables, mixed_lens, k_scale=ks, v_scale=vs,
                                                query_start_loc=qsl, max_query_len=max(q for q, _ in MIXED),
                                                max_seq_len=max(L for _, L in MIXED)).cpu())
    # one plan for the decode step, run per layer; then the same runs captured in a graph on ``dev``
    qs = [p.decode_q[layer][:, heads].to(dev) for layer in range(LAYERS)]
    kc0, vc0, ks0, vs0 = caches[0]
    plan = hal.plan("paged_attention", qs[0], kc0, vc0, dec_tables, dec_lens, k_scale=ks0, v_scale=vs0,
                    max_seq_len=max(DECODE_LENS))
    outs = [torch.empty_like(q) for q in qs]
    for layer, (kc, vc, ks, vs) in enumerate(caches):
        plan.run(qs[layer], kc, vc, k_scale=ks, v_scale=vs, out=outs[layer])
    out["plan"] = [o.cpu() for o in outs]
    graph_outs = [torch.full_like(q, float("nan")) for q in qs]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for layer, (kc, vc, ks, vs) in enumerate(caches):
                plan.run(qs[layer], kc, vc, k_scale=ks, v_scale=vs, out=graph_outs[layer])
    graph.replay()
    torch.cuda.synchronize(dev)
    out["graph"] = [o.cpu() for o in graph_outs]
    return out


def check_devices_error(dev: torch.device) -> str | None:
    """A call with tensors on two devices is an error naming the argument."""
    q = torch.randn(2, 4, HEAD, device=dev).bfloat16()
    kc = torch.zeros(4, 1, BLOCK, HEAD, dtype=torch.bfloat16, device=dev)
    try:
        hal.paged_attention(q, kc, kc, torch.zeros(2, 1, dtype=torch.int32),   # block_tables on the CPU
                            torch.ones(2, dtype=torch.int32, device=dev))
    except (ValueError, TypeError, RuntimeError) as exc:
        return None if "block_tables" in str(exc) else f"the error does not name block_tables: {exc}"
    return "tensors on two devices were accepted"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="a folder all ranks see (default: a temporary one under /tmp)")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if HEADS % world or KV_HEADS % world:
        print(f"rank {rank}: {world} ranks do not divide {HEADS} heads / {KV_HEADS} KV heads", flush=True)
        return 2
    folder = pathlib.Path(args.dir or os.path.join(tempfile.gettempdir(), f"hal-tp-{os.environ.get('MASTER_PORT', 0)}"))
    ckpt = folder / "scales.safetensors"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        write_checkpoint(ckpt)
    dist.barrier()
    p = Problem()
    scales = hal.load_kv_scales(ckpt, tp_rank=rank, tp_size=world)
    hs, ks = HEADS // world, KV_HEADS // world
    failures = []

    torch.cuda.set_device(0)  # hal must follow the tensors, not this
    mine = run_slice(p, dev, slice(rank * hs, (rank + 1) * hs), slice(rank * ks, (rank + 1) * ks), scales)
    if torch.cuda.current_device() != 0:
        failures.append(f"rank {rank}: hal changed the current device to {torch.cuda.current_device()}")
    why = check_devices_error(dev)
    if why:
        failures.append(f"rank {rank}: {why}")
    for name in ("plan", "graph"):
        for layer in range(LAYERS):
            if not torch.equal(mine[name][layer], mine["decode"][layer]):
                failures.append(f"rank {rank}: {name} output of layer {layer} differs from the one-shot call")
    torch.cuda.set_device(dev)

    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        whole = run_slice(p, dev, slice(0, HEADS), slice(0, KV_HEADS), hal.load_kv_scales(ckpt))
        for layer in range(LAYERS):
            for key, dim in (("kc", 1), ("vc", 1)):
                got = torch.cat([g[key][layer] for g in gathered], dim=dim)
                if not torch.equal(got, whole[key][layer]):
                    failures.append(f"layer {layer}: the ranks' {key} bytes differ from one GPU's")
            for key in ("decode", "mixed", "graph"):
                got = torch.cat([g[key][layer] for g in gathered], dim=1)
                r = rel_l2(got, whole[key][layer])
                if not r <= REL:
                    failures.append(f"layer {layer}: {key} outputs of {world} ranks vs one GPU: relative L2 {r:.3g}")
        print(f"tp_step: {world} rank(s), {LAYERS} layers, {HEADS}x{KV_HEADS}x{HEAD}: "
              f"{'PASS' if not failures else 'FAIL'}", flush=True)
    flags = [None] * world
    dist.all_gather_object(flags, failures)
    dist.destroy_process_group()
    bad = [f for fs in flags for f in fs]
    if rank == 0:
        for f in bad:
            print("FAIL", f, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
