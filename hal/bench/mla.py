"""MLA decode problems for the benchmark: ``hal.mla_decode`` (multi-head latent attention, DeepSeek's
absorbed form) over a paged latent cache, its FLOP and byte counts, and the per-row check.

An MLA SPEC is ``mla:BATCHxCONTEXTxHEADS[:bN][:qT][:ragged][:rR][:pP]``: BATCH sequences of CONTEXT
tokens each (with ``:ragged`` CONTEXT is the longest, the others drawn at random between
max(T, CONTEXT/16) and CONTEXT, the first sequence at CONTEXT), HEADS query heads over one shared
latent. ``:bN`` sets the page (block) size, **64** by default (FlashMLA's only one); ``:qT`` gives
every sequence T query rows (speculative decoding: causal, row t of T at position L - T + t), 1 by
default; ``:rR`` / ``:pP`` set the latent width R (default 512) and the rotary width P (default 64).
Examples::

    mla:64x4096x128                 64 sequences of 4096 tokens, 128 heads (DeepSeek-V3, one GPU)
    mla:16x32768x16:b16             16 heads (tensor parallel over 8), page size 16
    mla:64x8192x128:ragged:q2       ragged lengths up to 8192, two query rows per sequence

The data (:func:`build`), as vLLM lays it out: one allocation per cache page holding each token's
latent (R values in the ``--kv-dtype`` encoding) followed by its rotary part (P values: bf16 beside
an FP8 latent, else the latent's own dtype), viewed as ``ckv_cache`` [num_blocks, page, R] and
``kpe_cache`` [num_blocks, page, P]. A 16-bit latent makes it one [num_blocks, page, R + P] tensor
(FlashMLA's ``k_cache`` as it is); an FP8 latent a [num_blocks, page, R + 2P] byte tensor whose
views are e4m3fn and bf16. Every used page is written by ``hal.cache_mla`` from N(0, 1) values
(so the bytes are exactly the op's encode, ``clamp(x / ckv_scale)`` rounded ties-to-even; the scale
maps absmax ~4.5 onto the FP8 range; a 16-bit latent has no scale); pages are shuffled over the pool
as in the decode bench, block-table entries past a sequence's last page are 0 (vLLM's padding; block 0
always holds a used page, so a padded gather reads finite values), and the pool's spare pages hold NaN
bytes (0xFF: NaN in bf16 and in e4m3fn), so a kernel that reads a page no sequence owns shows it. The query is N(0, 1) in bf16, one [total_q, HEADS, R + P] tensor viewed as
``q_nope`` and ``q_pe``; the softmax scale is DeepSeek's ``(128 + 64) ** -0.5``.

Work: a query row attends ``k`` keys (``L`` in decode; ``L - T + t + 1`` for row t of T), and
costs ``2 * H * k * (R + P)`` FLOP for the scores plus ``2 * H * k * R`` for the weighted sum of the
latents; the bench divides the sum over rows by the time (TFLOP/s, against a bf16 matmul timed in
the same run). Bytes: each token's latent and rotary part once (``R * latent_bytes + P * rope_bytes``
for every token of every sequence), the query (``total_q * H * (R + P)``), the output (``total_q *
H * R``, both in the query dtype), the used block-table entries, seq_lens (and query_start_loc);
the bench divides them by the time and by the copy bandwidth measured in the same run. With 128
heads the op is compute-bound on an H200 (about 240 FLOP per byte of a bf16 cache), with 16 heads
bandwidth-bound; both fractions are reported.

The check (:class:`MlaReference`), as the decode and prefill benches do it, per query row (all heads
of the row together): reference A is the emu pack's PyTorch MLA path in float32 over every row,
reference B float64 (``hal.reference.mla_decode``, written independently of every pack) over a
subset of sequences chosen by cost (rows x keys x heads within a budget; else the costliest, the
cheapest and random ones, at least two); A is checked against B (1e-4). A contender passes when its
output is finite and its worst per-row relative L2 error is within **5e-3** against both (16-bit
query and probabilities; bf16's own rounding of the output is ~1e-3). A contender that rounds the
query or the probabilities (or the rotary part) to FP8 is checked against its own looser bound
instead and **flagged** in its row when its error is over 5e-3: shown, with its error, never hidden.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

import hal
from hal import fp8
from hal import reference as hal_reference
from hal.bench import check, data

DEFAULT_PAGE = 64
LATENT, ROPE = 512, 64
SOFTMAX_SCALE = (128 + 64) ** -0.5     # DeepSeek-V2/V3: qk_nope_head_dim 128 + qk_rope_head_dim 64
TOLERANCE = 5e-3                        # contenders that keep the query and the probabilities in 16 bits
TOLERANCE_BY_DTYPE = {torch.bfloat16: TOLERANCE, torch.float16: TOLERANCE, torch.float32: 1e-4}
F64_COST = {"cuda": 1 << 27, "cpu": 1 << 20}   # float64 budget: query rows x keys x heads
WRITE_TOKENS = 1 << 16                  # tokens per hal.cache_mla call while building (bounds the float32 temp)


@dataclasses.dataclass(frozen=True)
class MlaShape:
    batch: int
    context: int
    num_heads: int
    block_size: int = DEFAULT_PAGE
    q_len: int = 1
    ragged: bool = False
    latent: int = LATENT
    rope: int = ROPE

    op = "mla"

    @property
    def spec(self) -> str:
        s = f"mla:{self.batch}x{self.context}x{self.num_heads}"
        if self.block_size != DEFAULT_PAGE:
            s += f":b{self.block_size}"
        if self.q_len != 1:
            s += f":q{self.q_len}"
        if self.ragged:
            s += ":ragged"
        if self.latent != LATENT:
            s += f":r{self.latent}"
        if self.rope != ROPE:
            s += f":p{self.rope}"
        return s

    def as_dict(self) -> dict:
        return {"spec": self.spec, "op": self.op, **dataclasses.asdict(self)}


_SPEC = re.compile(r"^mla:(\d+)x(\d+)x(\d+)((?::[a-z0-9]+)*)$")
SYNTAX = "mla:BATCHxCONTEXTxHEADS[:bPAGE][:qROWS][:ragged][:rLATENT][:pROPE]"


def is_spec(text: str) -> bool:
    return text.strip().lower().startswith("mla:")


def parse(spec: str) -> MlaShape:
    """An :class:`MlaShape` from ``mla:64x4096x128``, ``mla:16x32768x16:b16``, ``mla:8x1024x16:q2:ragged``..."""
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(f"MLA shape {spec!r} is not understood: expected {SYNTAX} (page 64, one row, R 512, "
                         f"P 64 by default), e.g. mla:64x4096x128 or mla:16x32768x16:b16:ragged")
    batch, context, heads = (int(m.group(i)) for i in range(1, 4))
    kw: dict = {}
    for opt in filter(None, m.group(4).split(":")):
        if opt == "ragged":
            kw["ragged"] = True
        elif re.fullmatch(r"[bqrp]\d+", opt):
            kw[{"b": "block_size", "q": "q_len", "r": "latent", "p": "rope"}[opt[0]]] = int(opt[1:])
        else:
            raise ValueError(f"MLA shape {spec!r}: unknown option {opt!r} (expected bN, qN, ragged, rN or pN)")
    shape = MlaShape(batch, context, heads, **kw)
    if min(batch, context, heads, shape.block_size, shape.q_len, shape.latent, shape.rope) <= 0:
        raise ValueError(f"MLA shape {spec!r}: every number must be positive")
    if shape.q_len > context:
        raise ValueError(f"MLA shape {spec!r}: {shape.q_len} query rows over a context of {context} tokens")
    return shape


# ------------------------------------------------------------------------------------------ problem

@dataclasses.dataclass
class MlaProblem:
    shape: MlaShape
    query: torch.Tensor          # [total_q, H, R + P]: q_nope and q_pe are views of it
    q_nope: torch.Tensor         # [total_q, H, R]
    q_pe: torch.Tensor           # [total_q, H, P]
    kv_cache: torch.Tensor       # the combined allocation: [blocks, page, R + P] (16-bit) or bytes [blocks, page, R + 2P]
    ckv_cache: torch.Tensor      # [blocks, page, R] view (the latent, also the value)
    kpe_cache: torch.Tensor      # [blocks, page, P] view (the rotary part)
    block_tables: torch.Tensor   # [n, max_blocks] int32
    seq_lens: torch.Tensor       # [n] int32
    lens: list[int]
    q_lens: list[int]
    starts: list[int]            # query_start_loc on the host
    query_start_loc: torch.Tensor | None   # [n + 1] int32 when a sequence has several rows, else None
    scale: float
    ckv_scale: float | None      # None for a 16-bit latent
    kpe_scale: float | None      # None: the rotary part is 16-bit
    extra: dict = dataclasses.field(default_factory=dict)  # per-problem caches of contenders (layouts)

    op = "mla"

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.ckv_cache.dtype

    @property
    def rope_dtype(self) -> torch.dtype:
        return self.kpe_cache.dtype

    @property
    def is_fp8(self) -> bool:
        return fp8.is_fp8(self.kv_dtype)

    @property
    def max_seq_len(self) -> int:
        return max(self.lens, default=0)

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def num_blocks(self) -> int:
        return self.ckv_cache.shape[0]

    def qo_indptr(self) -> torch.Tensor:
        """query_start_loc on the device, also for one row per sequence."""
        if self.query_start_loc is not None:
            return self.query_start_loc
        return torch.tensor(self.starts, dtype=torch.int32, device=self.device)

    def pages(self, i: int) -> int:
        return (self.lens[i] + self.shape.block_size - 1) // self.shape.block_size

    def keys_attended(self) -> int:
        """Sum over query rows of the keys each attends (causal): row t of q rows over L tokens sees L - q + t + 1."""
        return sum(q * (L - q) + q * (q + 1) // 2 for q, L in zip(self.q_lens, self.lens))

    def flop(self) -> int:
        """``2 H k (R + P)`` (scores) ``+ 2 H k R`` (weighted latents) over every row's k keys."""
        s = self.shape
        return 2 * s.num_heads * (2 * s.latent + s.rope) * self.keys_attended()

    def bytes_moved(self) -> dict[str, int]:
        """The least the op must move: every referenced token's latent and rotary part once, the query,
        the output, the used block-table entries, seq_lens (and query_start_loc)."""
        s = self.shape
        tokens = sum(self.lens)
        q_el = self.query.element_size()
        n = len(self.lens)
        parts = {
            "latent": tokens * s.latent * self.ckv_cache.element_size(),
            "rope": tokens * s.rope * self.kpe_cache.element_size(),
            "query": self.total_q * s.num_heads * (s.latent + s.rope) * q_el,
            "output": self.total_q * s.num_heads * s.latent * q_el,
            "block_table_and_lens": sum(self.pages(i) for i in range(n)) * 4 + n * 4
            + ((n + 1) * 4 if self.query_start_loc is not None else 0),
        }
        parts["total"] = sum(parts.values())
        return parts


def seq_lengths(shape: MlaShape, gen: torch.Generator) -> list[int]:
    if not shape.ragged:
        return [shape.context] * shape.batch
    lo = max(1, shape.q_len, shape.context // 16)
    lens = torch.randint(lo, shape.context + 1, (shape.batch,), generator=gen).tolist()
    lens[0] = shape.context
    return lens


def rope_dtype_for(kv_dtype: torch.dtype) -> torch.dtype:
    """The rotary part's dtype: the latent's when that is 16-bit, else bf16 (hal's recommendation)."""
    return torch.bfloat16 if fp8.is_fp8(kv_dtype) else kv_dtype


def allocate(num_blocks: int, page: int, latent: int, rope: int, kv_dtype: torch.dtype, device) -> tuple:
    """(combined, ckv view, kpe view), every byte 0xFF (NaN in bf16/fp16/fp32 and in e4m3fn/e5m2)."""
    rope_dt = rope_dtype_for(kv_dtype)
    if rope_dt == kv_dtype:
        kv = torch.empty((num_blocks, page, latent + rope), dtype=kv_dtype, device=device)
        kv.view(torch.uint8).fill_(0xFF)
        return kv, kv[..., :latent], kv[..., latent:]
    rope_bytes = rope * torch.empty((), dtype=rope_dt).element_size()
    lat_bytes = latent * torch.empty((), dtype=kv_dtype).element_size()
    if lat_bytes % rope_dt.itemsize:
        raise ValueError(f"latent width {latent} leaves the rotary part misaligned for {rope_dt}")
    raw = torch.full((num_blocks, page, lat_bytes + rope_bytes), 0xFF, dtype=torch.uint8, device=device)
    return raw, raw[..., :lat_bytes].view(kv_dtype), raw[..., lat_bytes:].view(rope_dt)


def build(shape: MlaShape, kv_dtype: torch.dtype, device: torch.device | str, *,
          query_dtype: torch.dtype = torch.bfloat16, seed: int = 0, spare_blocks: int = 7,
          keep_source: bool = False) -> MlaProblem:
    """A fresh problem (see the module docstring). ``keep_source`` keeps the float32 values written
    and their slots in ``extra["source"]`` (tests compare the cache bytes with them)."""
    device = torch.device(device)
    host_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    lens = seq_lengths(shape, host_gen)
    bs, r, p = shape.block_size, shape.latent, shape.rope
    used = [(L + bs - 1) // bs for L in lens]
    num_blocks = sum(used) + spare_blocks
    perm = torch.randperm(num_blocks, generator=host_gen).to(torch.int32)
    at0 = int((perm == 0).nonzero()[0, 0])
    if at0 >= sum(used):   # block 0 (where padded block-table entries point) holds a used page, never NaN
        k = int(torch.randint(sum(used), (1,), generator=host_gen))
        perm[at0], perm[k] = perm[k].clone(), 0
    tables = torch.zeros((shape.batch, max(1, max(used, default=1))), dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[at:at + u]
        at += u
    ckv_scale = data.fp8_scale(kv_dtype) if fp8.is_fp8(kv_dtype) else None
    kv, ckv, kpe = allocate(num_blocks, bs, r, p, kv_dtype, device)
    # every slot of every used page (the tails of last pages too: finite, never attended), in table order
    blocks = perm[:sum(used)].to(torch.int64)
    slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1).to(device)
    sources = []
    for t0 in range(0, slots.numel(), WRITE_TOKENS):
        sl = slots[t0:t0 + WRITE_TOKENS]
        kv_c = torch.randn((sl.numel(), r), generator=dev_gen, device=device)
        k_pe = torch.randn((sl.numel(), p), generator=dev_gen, device=device)
        hal.cache_mla(kv_c, k_pe, ckv, kpe, sl, ckv_scale=ckv_scale)
        if keep_source:
            sources.append((kv_c, k_pe))
    total_q = shape.batch * shape.q_len
    q = torch.randn((total_q, shape.num_heads, r + p), generator=dev_gen, device=device).to(query_dtype)
    q_lens = [shape.q_len] * shape.batch
    starts = [i * shape.q_len for i in range(shape.batch + 1)]
    qsl = torch.tensor(starts, dtype=torch.int32, device=device) if shape.q_len > 1 else None
    prob = MlaProblem(shape, q, q[..., :r], q[..., r:], kv, ckv, kpe, tables.to(device),
                      torch.tensor(lens, dtype=torch.int32, device=device), lens, q_lens, starts, qsl,
                      SOFTMAX_SCALE, ckv_scale, None)
    if keep_source:
        prob.extra["source"] = {"slots": slots, "kv_c": torch.cat([s[0] for s in sources]),
                                "k_pe": torch.cat([s[1] for s in sources])}
    return prob


def kv_gib(shape: MlaShape, kv_dtype: torch.dtype) -> float:
    """Size of the combined cache, for a quick memory estimate."""
    lat = torch.empty((), dtype=kv_dtype).element_size()
    rope = torch.empty((), dtype=rope_dtype_for(kv_dtype)).element_size()
    tokens = shape.batch * math.ceil(shape.context / shape.block_size) * shape.block_size
    return tokens * (shape.latent * lat + shape.rope * rope) / 2 ** 30


def describe_problem(p: MlaProblem, ref: MlaReference) -> dict:
    """The run's ``problems`` entry of an MLA problem."""
    from hal.bench.runner import _lens  # the runner's summary of long length lists
    return {
        "shape": p.shape.as_dict(), "op": p.op, "kv_dtype": data.dtype_name(p.kv_dtype),
        "rope_dtype": data.dtype_name(p.rope_dtype), "query_dtype": data.dtype_name(p.query.dtype),
        "seq_lens": _lens(p.lens), "q_lens": _lens(p.q_lens), "total_q": p.total_q, "num_blocks": p.num_blocks,
        "softmax_scale": p.scale, "ckv_scale": p.ckv_scale, "kpe_scale": p.kpe_scale,
        "cache_layout": f"{tuple(p.kv_cache.shape)} {data.dtype_name(p.kv_cache.dtype) if p.kv_cache.dtype != torch.uint8 else 'bytes'}"
                        f" (ckv {tuple(p.ckv_cache.shape)} {data.dtype_name(p.kv_dtype)}, kpe "
                        f"{tuple(p.kpe_cache.shape)} {data.dtype_name(p.rope_dtype)} views)",
        "bytes": p.bytes_moved(), "keys_attended": p.keys_attended(), "flop": p.flop(),
        "reference": ref.describe(), "reference_error": ref.ref_err, "reference_ok": ref.ref_ok,
        "f64_subset": ref.subset, "tolerance": ref.tolerance,
    }


# -------------------------------------------------------------------------------------------- check

def emu_float32(p: MlaProblem) -> torch.Tensor:
    """The emu pack's PyTorch MLA path with a float32 query copy and a float32 output, every row."""
    from hal.kernelpacks.emu import torch_mla
    out = torch.empty((p.total_q, p.shape.num_heads, p.shape.latent), dtype=torch.float32, device=p.device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 in the float32 reference
    try:
        torch_mla.mla_decode(out, p.q_nope.float(), p.q_pe.float(), p.ckv_cache, p.kpe_cache, p.block_tables,
                             p.seq_lens, p.scale, p.ckv_scale, p.kpe_scale, p.max_seq_len, p.query_start_loc)
    finally:
        torch.set_float32_matmul_precision(precision)
    return out


class MlaReference:
    """Per MLA problem: reference A is the emu pack's PyTorch MLA path (torch_mla) with a float32
    output over every query row; reference B is float64 (hal.reference.mla_decode, independent of
    every pack) over a subset of sequences, all of them while their rows x keys x heads stay within
    the budget (2^27 on a GPU, 2^20 on a CPU), else the costliest, the cheapest and random ones (at
    least two); A is checked against B (1e-4). A contender passes when its output is finite and its
    worst per-row relative L2 error is within the tolerance (5e-3 for bf16/fp16 outputs, or the
    contender's own looser one: it is then flagged where its error is over 5e-3) against both A
    (every row) and B (the subset's rows)."""

    def __init__(self, p: MlaProblem, seed: int = 0):
        self.problem = p
        self.f32 = emu_float32(p)
        h = p.shape.num_heads
        costs = [q * L * h for q, L in zip(p.q_lens, p.lens)]
        self.subset = check.pick_subset(costs, budget=F64_COST.get(p.device.type, F64_COST["cpu"]), seed=seed)
        f64 = hal_reference.mla_decode(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_tables, p.seq_lens,
                                       p.query_start_loc, scale=p.scale, ckv_scale=p.ckv_scale,
                                       kpe_scale=p.kpe_scale, sequences=self.subset)
        rows = [r for i in self.subset for r in range(p.starts[i], p.starts[i + 1])]
        self.row_index = torch.tensor(rows, dtype=torch.long, device=p.device)
        self.f64 = f64[self.row_index]
        del f64
        self.ref_err = check.worst_rel_l2(self.f32[self.row_index], self.f64)
        self.ref_ok = math.isfinite(self.ref_err) and self.ref_err <= check.REF_TOLERANCE
        self.tolerance = TOLERANCE_BY_DTYPE.get(p.query.dtype, TOLERANCE)

    def describe(self) -> str:
        p = self.problem
        n = len(p.lens)
        which = "all" if len(self.subset) == n else f"{len(self.subset)} of {n}"
        return (f"reference: emu torch MLA path in float32 on every row; float64 on {which} sequences "
                f"({self.row_index.numel()} of {p.total_q} rows; emu float32 vs float64: {self.ref_err:.2e}"
                f"{'' if self.ref_ok else ' -- REFERENCE SUSPECT'})")

    def check(self, out: torch.Tensor, tolerance: float | None = None) -> check.Verdict:
        """``tolerance`` replaces the 5e-3 bound (a contender rounding to FP8 on purpose); the row is
        then flagged in ``reason`` where its error is over 5e-3, passed or not."""
        p = self.problem
        want = (p.total_q, p.shape.num_heads, p.shape.latent)
        tol = self.tolerance if tolerance is None else tolerance
        v = check.judge(out, want, self.f32, self.row_index, self.f64, tol, self.ref_ok)
        if v.err_f64 is None:  # shape or non-finite values: nothing to flag
            return v
        err_all, err_f64, reason = v.err_all, v.err_f64, v.reason
        worst = max(err_f64, err_all if self.ref_ok else 0.0)
        if tol > self.tolerance and worst > self.tolerance:
            flag = (f"FLAGGED: error {worst:.2e} is over the {self.tolerance:.0e} bound of 16-bit contenders "
                    f"(checked against its own {tol:.2g})")
            reason = flag + ("; " + reason if reason else "")
        return dataclasses.replace(v, reason=reason)
