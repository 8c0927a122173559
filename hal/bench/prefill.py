"""Prefill problems for the benchmark: several query tokens per sequence (prefill, chunked prefill,
mixed batches) over a paged (FP8) KV cache, ``hal.paged_attention(..., query_start_loc=...)``.

A prefill SPEC is ``GROUP[+GROUP...]/QHEADSxKVHEADSxHEADSIZE[:bN]`` where a GROUP is
``NxQ[@C]``: N sequences, each with Q new query tokens over C tokens of context already in the
cache before them (default 0), so ``seq_lens = C + Q`` (the new tokens are in the cache too, as
hal's semantics have it) and row t of a sequence sits at position ``C + t`` (causal, bottom-right
aligned). Q and C may be ranges ``A-B``: each sequence's value is drawn at random in [A, B], the
group's first sequence at B and its second at A, so both ends are always in the batch. ``:bN`` sets
the block (page) size, 16 by default. Examples::

    8x2048/32x8x128                 8 fresh prefills of 2048 tokens
    4x1024@8192/32x8x128            chunked prefill: 1024 new tokens over 8192 cached ones
    64x1@4096+2x1024/32x8x128       a mixed batch: 64 decode rows at 4096 context, 2 prefills
    16x100-3000/32x8x128:b64        16 ragged prefills, block size 64

Sequences are laid out in the SPEC's order (decode rows first in a mixed batch, as vLLM orders one).

Prefill is compute-bound: a row at position p attends ``p + 1`` keys, and the op's work is
``4 * num_heads * head_size * sum over rows of the keys it attends`` FLOP (two matrix products,
QK^T and PV, of 2 FLOP per multiply-add), which the bench divides by the time (TFLOP/s) and
compares with a bf16 matrix product timed in the same run.

The check (:class:`PrefillReference`) is the decode bench's (hal/bench/check.py), per query row:
reference A is the emu pack's PyTorch multi-token path in float32 over every row, reference B is
float64 (``hal.reference.paged_attention_varlen``, written independently of every pack) over a
subset of sequences chosen by cost (rows x keys), A is checked against B, and a contender's worst
per-row relative L2 error must be within the tolerance against both.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from hal import fp8
from hal import reference as hal_reference
from hal.bench import check, data
from hal.bench.shapes import DEFAULT_BLOCK


@dataclasses.dataclass(frozen=True)
class Group:
    count: int
    q: tuple[int, int]          # new tokens per sequence: (lo, hi), equal when fixed
    context: tuple[int, int]    # cached tokens before them: (lo, hi)

    @property
    def spec(self) -> str:
        def r(x):
            return str(x[0]) if x[0] == x[1] else f"{x[0]}-{x[1]}"
        return f"{self.count}x{r(self.q)}" + ("" if self.context == (0, 0) else f"@{r(self.context)}")


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    groups: tuple[Group, ...]
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int = DEFAULT_BLOCK

    op = "prefill"

    @property
    def batch(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def gqa(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def ragged(self) -> bool:
        return any(g.q[0] != g.q[1] or g.context[0] != g.context[1] for g in self.groups)

    @property
    def spec(self) -> str:
        s = "+".join(g.spec for g in self.groups) + f"/{self.num_heads}x{self.num_kv_heads}x{self.head_size}"
        return s + (f":b{self.block_size}" if self.block_size != DEFAULT_BLOCK else "")

    @property
    def max_context(self) -> int:
        return max(g.q[1] + g.context[1] for g in self.groups)

    def as_dict(self) -> dict:
        return {"spec": self.spec, "op": self.op, "groups": [dataclasses.asdict(g) | {"spec": g.spec}
                                                             for g in self.groups],
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_size": self.head_size,
                "block_size": self.block_size, "num_seqs": self.batch}


_RANGE = r"(\d+)(?:-(\d+))?"
_GROUP = re.compile(rf"^(\d+)x{_RANGE}(?:@{_RANGE})?$")
_HEADS = re.compile(r"^(\d+)x(\d+)x(\d+)((?::[a-z0-9]+)*)$")


def is_spec(text: str) -> bool:
    return "/" in text


def parse(spec: str) -> PrefillShape:
    """A :class:`PrefillShape` from ``8x2048/32x8x128``, ``64x1@4096+2x1024/32x8x128:b64``, ..."""
    text = spec.strip().lower()
    hint = (f"prefill shape {spec!r} is not understood: expected GROUP[+GROUP...]/QHEADSxKVHEADSxHEADSIZE[:bN] "
            f"with GROUP = NxQ[@C] (N sequences of Q new tokens over C cached ones; Q, C may be ranges A-B), "
            f"e.g. 4x1024@8192/32x8x128 or 64x1@4096+2x1024/32x8x128:b64")
    if text.count("/") != 1:
        raise ValueError(hint)
    left, right = text.split("/")
    m = _HEADS.match(right)
    if not m or not left:
        raise ValueError(hint)
    h, hkv, d = (int(m.group(i)) for i in range(1, 4))
    block = DEFAULT_BLOCK
    for opt in filter(None, m.group(4).split(":")):
        if re.fullmatch(r"b\d+", opt):
            block = int(opt[1:])
        else:
            raise ValueError(f"prefill shape {spec!r}: unknown option {opt!r} (expected bN)")
    groups = []
    for part in left.split("+"):
        g = _GROUP.match(part)
        if not g:
            raise ValueError(hint)
        n = int(g.group(1))
        q = (int(g.group(2)), int(g.group(3) or g.group(2)))
        c = (int(g.group(4) or 0), int(g.group(5) or g.group(4) or 0))
        if n <= 0 or q[0] <= 0:
            raise ValueError(f"prefill shape {spec!r}: group {part!r} needs N >= 1 sequences of Q >= 1 new tokens")
        if q[0] > q[1] or c[0] > c[1]:
            raise ValueError(f"prefill shape {spec!r}: group {part!r} has a range A-B with A > B")
        groups.append(Group(n, q, c))
    if min(h, hkv, d, block) <= 0:
        raise ValueError(f"prefill shape {spec!r}: every number must be positive")
    if h % hkv:
        raise ValueError(f"prefill shape {spec!r}: {h} query heads is not a multiple of {hkv} KV heads")
    return PrefillShape(tuple(groups), h, hkv, d, block)


@dataclasses.dataclass
class PrefillProblem(data.Problem):
    """A :class:`hal.bench.data.Problem` with several query rows per sequence: ``query`` is
    [total_q, h, d], sequence i owns rows ``query_start_loc[i] .. query_start_loc[i+1]-1``."""
    query_start_loc: torch.Tensor | None = None   # [n + 1] int32 on the device
    q_lens: list[int] = dataclasses.field(default_factory=list)
    starts: list[int] = dataclasses.field(default_factory=list)  # query_start_loc on the host

    op = "prefill"

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    def keys_attended(self) -> int:
        """Sum over query rows of the keys each row attends (causal): row t of q rows over c cached
        tokens attends c + t + 1 keys."""
        return sum(q * (L - q) + q * (q + 1) // 2 for q, L in zip(self.q_lens, self.lens))

    def flop(self) -> int:
        return 4 * self.shape.num_heads * self.shape.head_size * self.keys_attended()

    def bytes_moved(self) -> dict[str, int]:
        """The least the op must move: every referenced K and V byte once, the query and the output,
        the used block-table entries, seq_lens and query_start_loc."""
        _, h, d = self.query.shape
        hkv = self.shape.num_kv_heads
        kv = 2 * sum(self.lens) * hkv * d * self.key_cache.element_size()
        q = self.total_q * h * d * self.query.element_size()
        n = len(self.lens)
        tables = sum(self.pages(i) for i in range(n)) * 4 + n * 4 + (n + 1) * 4
        parts = {"kv": kv, "query": q, "output": q, "block_table_and_lens": tables}
        parts["total"] = sum(parts.values())
        return parts


def draw_lengths(shape: PrefillShape, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) of every sequence, in the SPEC's order."""
    def values(rng, count):
        lo, hi = rng
        if lo == hi:
            return [lo] * count
        xs = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
        xs[0] = hi
        if count > 1:
            xs[1] = lo
        return xs
    q_lens, lens = [], []
    for g in shape.groups:
        qs, cs = values(g.q, g.count), values(g.context, g.count)
        q_lens += qs
        lens += [q + c for q, c in zip(qs, cs)]
    return q_lens, lens


def build(shape: PrefillShape, kv_dtype: torch.dtype, device: torch.device | str, *,
          query_dtype: torch.dtype = torch.bfloat16, seed: int = 0, spare_blocks: int = 7) -> PrefillProblem:
    """A fresh problem as :func:`hal.bench.data.build` makes one (pages shuffled over the pool, block
    table padded with 0, N(0, 1) values, FP8 scales), with ``sum(q_lens)`` query rows."""
    device = torch.device(device)
    host_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    q_lens, lens = draw_lengths(shape, host_gen)
    bs = shape.block_size
    used = [(L + bs - 1) // bs for L in lens]
    n = len(lens)
    num_blocks = sum(used) + spare_blocks
    perm = torch.randperm(num_blocks, generator=host_gen).to(torch.int32)
    tables = torch.zeros((n, max(1, max(used))), dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[at:at + u]
        at += u
    is_fp8 = fp8.is_fp8(kv_dtype)
    k_scale = 1.1 * data.fp8_scale(kv_dtype) if is_fp8 else None
    v_scale = 0.9 * data.fp8_scale(kv_dtype) if is_fp8 else None
    cache_shape = (num_blocks, shape.num_kv_heads, bs, shape.head_size)
    kc = torch.empty(cache_shape, dtype=kv_dtype, device=device)
    vc = torch.empty(cache_shape, dtype=kv_dtype, device=device)
    data._fill(kc, k_scale, dev_gen)
    data._fill(vc, v_scale, dev_gen)
    total_q = sum(q_lens)
    q = torch.randn((total_q, shape.num_heads, shape.head_size), generator=dev_gen, device=device)
    starts = [0]
    for x in q_lens:
        starts.append(starts[-1] + x)
    return PrefillProblem(shape, q.to(query_dtype), kc, vc, tables.to(device),
                          torch.tensor(lens, dtype=torch.int32, device=device), lens, shape.head_size ** -0.5,
                          k_scale, v_scale, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                          q_lens=q_lens, starts=starts)


def kv_gib(shape: PrefillShape, kv_dtype: torch.dtype) -> float:
    elem = torch.empty((), dtype=kv_dtype).element_size()
    tokens = sum(g.count * (g.q[1] + g.context[1]) for g in shape.groups)
    return 2 * tokens * shape.num_kv_heads * shape.head_size * elem / 2 ** 30


# ----------------------------------------------------------------------------------------- check

F64_PAIRS = {"cuda": 1 << 28, "cpu": 1 << 21}   # float64 budget: rows x keys (the reference reads every key up to L)


def emu_call_record(p: PrefillProblem, out: torch.Tensor, query: torch.Tensor | None = None):
    """The validated call record of ``p`` (built once, outside what is timed)."""
    from hal import ops
    return ops.prepare("paged_attention", query=p.query if query is None else query, key_cache=p.key_cache,
                       value_cache=p.value_cache, block_tables=p.block_tables, seq_lens=p.seq_lens, scale=p.scale,
                       k_scale=1.0 if p.k_scale is None else p.k_scale,
                       v_scale=1.0 if p.v_scale is None else p.v_scale, max_seq_len=p.max_seq_len,
                       query_start_loc=p.query_start_loc, max_query_len=p.max_query_len, causal=True, out=out)


def emu_torch_module():
    from hal.kernelpacks.emu import torch_prefill
    return torch_prefill


class PrefillReference:
    """Per prefill problem: reference A is the emu pack's multi-token PyTorch path (torch_prefill)
    with a float32 output over every query row; reference B is float64 (hal.reference.
    paged_attention_varlen, independent of every pack) over a subset of sequences, all of them while
    their rows x keys stay within the budget (2^28 on a GPU, 2^21 on a CPU), else the costliest, the
    cheapest and random ones (at least two); A is checked against B (1e-4). A contender passes when
    its output is finite and its worst per-row relative L2 error is within the tolerance (2e-2 for
    bf16/fp16, or the contender's own) against both A (every row) and B (the subset's rows)."""

    def __init__(self, p: PrefillProblem, seed: int = 0):
        self.problem = p
        self.f32 = torch.empty(p.query.shape, dtype=torch.float32, device=p.device)
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # no TF32 in the float32 reference
        try:
            emu_torch_module().paged_attention(emu_call_record(p, self.f32, p.query.float()))
        finally:
            torch.set_float32_matmul_precision(precision)
        costs = [q * L for q, L in zip(p.q_lens, p.lens)]
        self.subset = check.pick_subset(costs, budget=F64_PAIRS.get(p.device.type, F64_PAIRS["cpu"]), seed=seed)
        f64 = hal_reference.paged_attention_varlen(
            p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, p.query_start_loc, causal=True,
            scale=p.scale, k_scale=p.k_scale, v_scale=p.v_scale, sequences=self.subset)
        rows = [r for i in self.subset for r in range(p.starts[i], p.starts[i + 1])]
        self.row_index = torch.tensor(rows, dtype=torch.long, device=p.device)
        self.f64 = f64[self.row_index]
        del f64
        self.ref_err = check.worst_rel_l2(self.f32[self.row_index], self.f64)
        self.ref_ok = math.isfinite(self.ref_err) and self.ref_err <= check.REF_TOLERANCE
        self.tolerance = check.TOLERANCE.get(p.query.dtype, 2e-2)

    def describe(self) -> str:
        p = self.problem
        n = len(p.lens)
        which = "all" if len(self.subset) == n else f"{len(self.subset)} of {n}"
        return (f"reference: emu multi-token torch path in float32 on every row; float64 on {which} sequences "
                f"({self.row_index.numel()} of {p.total_q} rows; emu float32 vs float64: {self.ref_err:.2e}"
                f"{'' if self.ref_ok else ' -- REFERENCE SUSPECT'})")

    def check(self, out: torch.Tensor, tolerance: float | None = None) -> check.Verdict:
        tol = self.tolerance if tolerance is None else tolerance
        return check.judge(out, self.problem.query.shape, self.f32, self.row_index, self.f64, tol, self.ref_ok)
