"""Problem shapes for the benchmark: ``BATCHxCONTEXTxQHEADSxKVHEADSxHEADSIZE[:bN][:ragged]``.

``CONTEXT`` is every sequence's length (the longest one with ``:ragged``, where the lengths are drawn
at random between CONTEXT/16 and CONTEXT, the first sequence at CONTEXT). ``:bN`` sets the block
(page) size, 16 by default.
"""

from __future__ import annotations

import dataclasses
import re

DEFAULT_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int = DEFAULT_BLOCK
    ragged: bool = False

    @property
    def gqa(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def spec(self) -> str:
        s = f"{self.batch}x{self.context}x{self.num_heads}x{self.num_kv_heads}x{self.head_size}"
        if self.block_size != DEFAULT_BLOCK:
            s += f":b{self.block_size}"
        if self.ragged:
            s += ":ragged"
        return s

    def as_dict(self) -> dict:
        return {"spec": self.spec, **dataclasses.asdict(self)}


_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)x(\d+)x(\d+)((?::[a-z0-9]+)*)$")


def parse(spec: str) -> Shape:
    """A :class:`Shape` from ``64x4096x32x8x128``, ``64x4096x32x8x128:b64``, ``...:ragged``."""
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(f"shape {spec!r} is not understood: expected BATCHxCONTEXTxQHEADSxKVHEADSxHEADSIZE"
                         f"[:bBLOCK][:ragged], e.g. 64x4096x32x8x128:b16, or a set name ({', '.join(SETS)})")
    batch, context, h, hkv, d = (int(m.group(i)) for i in range(1, 6))
    block, ragged = DEFAULT_BLOCK, False
    for opt in filter(None, m.group(6).split(":")):
        if opt in ("ragged", "r"):
            ragged = True
        elif re.fullmatch(r"b\d+", opt):
            block = int(opt[1:])
        else:
            raise ValueError(f"shape {spec!r}: unknown option {opt!r} (expected bN or ragged)")
    if min(batch, context, h, hkv, d, block) <= 0:
        raise ValueError(f"shape {spec!r}: every number must be positive")
    if h % hkv:
        raise ValueError(f"shape {spec!r}: {h} query heads is not a multiple of {hkv} KV heads")
    return Shape(batch, context, h, hkv, d, block, ragged)


# The cuda pack issue's shapes (block 16, shuffled pages).
ISSUE = ("64x4096x32x8x128", "16x32768x32x8x128", "256x1024x32x8x128", "32x8192x64x8x128")

SETS: dict[str, tuple[str, ...]] = {
    "issue": ISSUE,
    "sweep": ISSUE + (
        # ragged lengths
        "64x4096x32x8x128:ragged", "256x2048x32x8x128:ragged",
        # GQA 1 / 4 / 16 at one size (8 is the issue's 32x8192x64x8x128)
        "32x8192x32x32x128", "32x8192x32x8x128", "32x8192x128x8x128",
        # head sizes 64 / 256
        "32x8192x32x8x64", "32x8192x32x8x256",
        # block size 64
        "64x4096x32x8x128:b64", "32x8192x64x8x128:b64:ragged",
    ),
    # small enough to finish in seconds on a 2-core CPU (emu torch path vs the PyTorch baseline)
    "cpu": ("4x1024x32x8x128", "8x512x16x4x64", "8x1024x32x8x128:ragged", "2x4096x32x4x128:b64"),
}


def resolve(items: list[str] | tuple[str, ...]) -> list[Shape]:
    """Set names and SPECs (also comma-separated) to shapes, in order, without duplicates."""
    out: list[Shape] = []
    for item in items:
        for token in filter(None, (t.strip() for t in item.split(","))):
            for spec in SETS.get(token.lower(), (token,)):
                shape = parse(spec)
                if shape not in out:
                    out.append(shape)
    return out
