"""Random paged decode problems: a KV cache whose pages are shuffled over the pool, one query token
per sequence, and the bytes the op must move.

Values are N(0, 1) in real units. An FP8 cache stores ``clamp(real / scale, ±max)`` rounded by torch's
cast (the bytes are the data: every contender reads the same bytes); the scale maps absmax ~4.5 onto
the format's range (``k_scale`` 1.1x, ``v_scale`` 0.9x that, so a swapped scale shows). Block-table
entries past a sequence's last page are 0, as vLLM pads them (the padded PyTorch baseline gathers
them; the kernels must not read them).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hal import dtypes, fp8
from hal.bench.shapes import Shape

# The names hal.dtypes knows (short and torch's), as the bench's options take them.
DTYPES = {**{v: d for d, v in dtypes.SHORT.items()}, **{dtypes.name(d): d for d in dtypes.SHORT}, "half": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return dtypes.short(dtype)


def parse_dtypes(text: str) -> list[torch.dtype]:
    """``bf16,e4m3fn`` -> dtypes. ``fp8`` is this machine's native e4m3 (hal.fp8.native_e4m3)."""
    out = []
    for name in filter(None, (t.strip().lower().removeprefix("float8_") for t in text.split(","))):
        if name in ("fp8", "fp8_e4m3"):
            d = fp8.native_e4m3()
        elif name.removeprefix("fp8_") in DTYPES:
            d = DTYPES[name.removeprefix("fp8_")]
        else:
            raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(sorted(DTYPES))} or fp8")
        if d not in out:
            out.append(d)
    return out


@dataclasses.dataclass
class Problem:
    shape: Shape
    query: torch.Tensor          # [n, h, d]
    key_cache: torch.Tensor      # [blocks, hkv, bs, d]
    value_cache: torch.Tensor
    block_tables: torch.Tensor   # [n, max_blocks] int32
    seq_lens: torch.Tensor       # [n] int32
    lens: list[int]              # seq_lens on the host
    scale: float                 # softmax scale
    k_scale: float | None        # None for a non-FP8 cache
    v_scale: float | None
    extra: dict = dataclasses.field(default_factory=dict)  # per-problem caches of contenders (layouts)

    op = "decode"   # PrefillProblem (hal.bench.prefill) says "prefill"

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.key_cache.dtype

    @property
    def max_seq_len(self) -> int:
        return max(self.lens, default=0)

    @property
    def is_fp8(self) -> bool:
        return fp8.is_fp8(self.kv_dtype)

    def pages(self, i: int) -> int:
        return (self.lens[i] + self.shape.block_size - 1) // self.shape.block_size

    def bytes_moved(self) -> dict[str, int]:
        """What the op must move: the KV bytes the sequences reference (tokens, not whole pages), the
        query and the output, the used block-table entries and seq_lens."""
        n, h, d = self.query.shape
        hkv = self.shape.num_kv_heads
        kv = 2 * sum(self.lens) * hkv * d * self.key_cache.element_size()
        q = n * h * d * self.query.element_size()
        tables = sum(self.pages(i) for i in range(n)) * 4 + n * 4
        parts = {"kv": kv, "query": q, "output": q, "block_table_and_lens": tables}
        parts["total"] = sum(parts.values())
        return parts


def seq_lengths(shape: Shape, gen: torch.Generator) -> list[int]:
    if not shape.ragged:
        return [shape.context] * shape.batch
    lo = max(1, shape.context // 16)
    lens = torch.randint(lo, shape.context + 1, (shape.batch,), generator=gen).tolist()
    lens[0] = shape.context
    return lens


def fp8_scale(dtype: torch.dtype) -> float:
    return 4.5 / fp8.encoding_of(dtype).max_finite


def _fill(cache: torch.Tensor, scale: float | None, gen: torch.Generator) -> None:
    """cache <- N(0,1) reals, stored in the cache's encoding; in chunks to bound the float32 temp."""
    flat = cache.view(cache.shape[0], -1)
    per_block = flat.shape[1]
    step = max(1, (1 << 26) // max(1, per_block))
    fmax = fp8.encoding_of(cache.dtype).max_finite if fp8.is_fp8(cache.dtype) else None
    for b0 in range(0, flat.shape[0], step):
        real = torch.randn((min(step, flat.shape[0] - b0), per_block), generator=gen, device=cache.device)
        if fmax is not None:
            real = (real / scale).clamp_(-fmax, fmax)
        flat[b0:b0 + real.shape[0]] = real.to(cache.dtype)


def build(shape: Shape, kv_dtype: torch.dtype, device: torch.device | str, *,
          query_dtype: torch.dtype = torch.bfloat16, seed: int = 0, spare_blocks: int = 7) -> Problem:
    device = torch.device(device)
    host_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    lens = seq_lengths(shape, host_gen)
    bs = shape.block_size
    used = [(L + bs - 1) // bs for L in lens]
    max_blocks = max(1, max(used, default=1))
    num_blocks = sum(used) + spare_blocks
    perm = torch.randperm(num_blocks, generator=host_gen).to(torch.int32)
    tables = torch.zeros((shape.batch, max_blocks), dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        tables[i, :u] = perm[at:at + u]
        at += u
    is_fp8 = fp8.is_fp8(kv_dtype)
    k_scale = 1.1 * fp8_scale(kv_dtype) if is_fp8 else None
    v_scale = 0.9 * fp8_scale(kv_dtype) if is_fp8 else None
    cache_shape = (num_blocks, shape.num_kv_heads, bs, shape.head_size)
    kc = torch.empty(cache_shape, dtype=kv_dtype, device=device)
    vc = torch.empty(cache_shape, dtype=kv_dtype, device=device)
    _fill(kc, k_scale, dev_gen)
    _fill(vc, v_scale, dev_gen)
    q = torch.randn((shape.batch, shape.num_heads, shape.head_size), generator=dev_gen, device=device)
    return Problem(shape, q.to(query_dtype), kc, vc, tables.to(device), torch.tensor(lens, dtype=torch.int32,
                   device=device), lens, shape.head_size ** -0.5, k_scale, v_scale)


def kv_gib(shape: Shape, kv_dtype: torch.dtype) -> float:
    """Size of both caches, for a quick memory estimate."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    blocks = shape.batch * math.ceil(shape.context / shape.block_size)
    return 2 * blocks * shape.num_kv_heads * shape.block_size * shape.head_size * elem / 2 ** 30
