"""The correctness check every contender passes before it is timed.

What is checked, per problem:

1. Reference A: the emu pack's PyTorch path run with a float32 output (no rounding to the query
   dtype) over **every** sequence, on the problem's device.
2. Reference B: float64 over a **subset** of sequences (all of them while the subset's tokens stay
   under ``F64_TOKENS``; else the longest, the shortest and random ones up to that budget, at least
   two), by :mod:`hal.reference`, written independently of every pack: pages gathered per sequence,
   FP8 decoded from the bit layout, textbook softmax. Reference A is itself checked against B
   (``ref_err``), so a wrong emu path cannot pass a wrong contender.
3. A contender's output (written into a NaN-poisoned buffer where the contender takes ``out``) must be
   finite, and its worst per-sequence relative L2 error ``||o_i - r_i|| / ||r_i||`` must be within
   the tolerance against both A (all sequences) and B (the subset). The figures are reported.

Tolerance: 2e-2 for bf16/fp16 outputs (their rounding alone is ~2e-3; baselines computing in bf16
reach ~5e-3), 1e-4 for fp32 outputs.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hal import reference
from hal.bench.data import Problem

F64_TOKENS = 1 << 16
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}
REF_TOLERANCE = 1e-4   # emu float32 against float64


def emu_torch():
    """The emu pack's PyTorch path module."""
    from hal.kernelpacks.emu import torch_path
    return torch_path


def emu_runner(module, out, p: Problem):
    """A no-argument function running one emu path's implementation on ``p`` (the validated call
    record is built once, outside what is timed; both paths take the same record)."""
    from hal import ops
    call = ops.prepare("paged_attention", query=p.query, key_cache=p.key_cache, value_cache=p.value_cache,
                       block_tables=p.block_tables, seq_lens=p.seq_lens, scale=p.scale,
                       k_scale=1.0 if p.k_scale is None else p.k_scale,
                       v_scale=1.0 if p.v_scale is None else p.v_scale, max_seq_len=p.max_seq_len, out=out)
    return lambda: module.paged_attention(call)


def emu_call(module, out, p: Problem) -> None:
    emu_runner(module, out, p)()


def pick_subset(lens: list[int], budget: int = F64_TOKENS, seed: int = 0) -> list[int]:
    n = len(lens)
    if sum(lens) <= budget:
        return list(range(n))
    gen = torch.Generator().manual_seed(seed)
    order = list(dict.fromkeys([max(range(n), key=lambda i: lens[i]), min(range(n), key=lambda i: lens[i])]
                               + torch.randperm(n, generator=gen).tolist()))
    chosen, tokens = [], 0
    for i in order:
        if len(chosen) >= 2 and tokens + lens[i] > budget:
            break
        chosen.append(i)
        tokens += lens[i]
    return sorted(set(chosen))


def float64_outputs(p: Problem, seqs: list[int]) -> torch.Tensor:
    """[len(seqs), h, d] float64 on the problem's device (hal.reference: pages gathered per sequence,
    FP8 decoded from the bit layout, textbook softmax; independent of every pack's code path)."""
    out = reference.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                                    scale=p.scale, k_scale=p.k_scale, v_scale=p.v_scale, sequences=seqs)
    return out[torch.tensor(seqs, dtype=torch.long, device=out.device)]


def worst_rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over sequences of ||out_i - ref_i|| / ||ref_i|| (absolute where ||ref_i|| is 0)."""
    a = out.to(torch.float64).reshape(out.shape[0], -1)
    b = ref.to(torch.float64).reshape(ref.shape[0], -1)
    err = (a - b).norm(dim=1)
    den = b.norm(dim=1)
    rel = torch.where(den > 0, err / den.clamp_min(1e-300), err)
    return float(rel.max()) if rel.numel() else 0.0


@dataclasses.dataclass
class Verdict:
    ok: bool
    err_all: float | None = None      # worst per-sequence rel L2 vs emu float32, every sequence
    err_f64: float | None = None      # worst per-sequence rel L2 vs float64, the subset
    max_abs: float | None = None
    reason: str = ""


def judge(out: torch.Tensor, want_shape: tuple, f32: torch.Tensor, index: torch.Tensor, f64: torch.Tensor,
          tol: float, ref_ok: bool) -> Verdict:
    """The verdict on a contender's ``out`` (decode, prefill and MLA rows alike): the shape, every
    value finite, the worst per-row relative L2 error vs float64 on the ``index`` rows (``f64``) and,
    where the float32 reference is trusted (``ref_ok``), vs float32 on every row, each <= ``tol``."""
    if tuple(out.shape) != tuple(want_shape):
        return Verdict(False, reason=f"output shape {tuple(out.shape)} != {tuple(want_shape)}")
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return Verdict(False, reason=f"{bad} non-finite outputs (unwritten or NaN)")
    err_all = worst_rel_l2(out, f32)
    sub = out[index]
    err_f64 = worst_rel_l2(sub, f64)
    max_abs = float((sub.to(torch.float64) - f64).abs().max()) if sub.numel() else 0.0
    fails = []
    if not err_f64 <= tol:
        fails.append(f"error vs float64 {err_f64:.2e} > {tol:.2g}")
    if ref_ok and not err_all <= tol:
        fails.append(f"error vs emu float32 {err_all:.2e} > {tol:.2g}")
    return Verdict(not fails, err_all, err_f64, max_abs, "wrong: " + "; ".join(fails) if fails else "")


class Reference:
    def __init__(self, p: Problem, seed: int = 0):
        self.problem = p
        self.f32 = torch.empty(p.query.shape, dtype=torch.float32, device=p.device)
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # no TF32 in the float32 reference
        try:
            # the path widens the query to float32 first: a float32 copy gives the same numbers
            emu_call(emu_torch(), self.f32, dataclasses.replace(p, query=p.query.float()))
        finally:
            torch.set_float32_matmul_precision(precision)
        self.subset = pick_subset(p.lens, seed=seed)
        self.f64 = float64_outputs(p, self.subset)
        self.subset_index = torch.tensor(self.subset, dtype=torch.long, device=p.device)
        self.ref_err = worst_rel_l2(self.f32[self.subset_index], self.f64)
        self.ref_ok = math.isfinite(self.ref_err) and self.ref_err <= REF_TOLERANCE
        self.tolerance = TOLERANCE.get(p.query.dtype, 2e-2)

    def describe(self) -> str:
        n = len(self.problem.lens)
        which = "all" if len(self.subset) == n else f"{len(self.subset)} of {n}"
        return (f"reference: emu torch path in float32 on every sequence; float64 on {which} sequences "
                f"(emu float32 vs float64: {self.ref_err:.2e}{'' if self.ref_ok else ' -- REFERENCE SUSPECT'})")

    def check(self, out: torch.Tensor, tolerance: float | None = None) -> Verdict:
        """``tolerance`` overrides the dtype's (a contender that rounds to FP8 on purpose)."""
        tol = self.tolerance if tolerance is None else tolerance
        return judge(out, self.problem.query.shape, self.f32, self.subset_index, self.f64, tol, self.ref_ok)
