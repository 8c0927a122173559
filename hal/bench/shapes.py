"""Problem shapes for the benchmark.

Decode: ``BATCHxCONTEXTxQHEADSxKVHEADSxHEADSIZE[:bN][:ragged]``. ``CONTEXT`` is every sequence's
length (the longest one with ``:ragged``, where the lengths are drawn at random between CONTEXT/16
and CONTEXT, the first sequence at CONTEXT). ``:bN`` sets the block (page) size, 16 by default.

Prefill (several query tokens per sequence; a SPEC with a ``/``):
``GROUP[+GROUP...]/QHEADSxKVHEADSxHEADSIZE[:bN]``, GROUP = ``NxQ[@C]``; see :mod:`hal.bench.prefill`.

MLA decode (``hal.mla_decode``; a SPEC starting ``mla:``):
``mla:BATCHxCONTEXTxHEADS[:bN][:qT][:ragged][:rR][:pP]``, page 64, one query row, latent R 512 and
rotary part P 64 unless given; see :mod:`hal.bench.mla`.
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

    op = "decode"

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
        return {"spec": self.spec, "op": self.op, **dataclasses.asdict(self)}


_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)x(\d+)x(\d+)((?::[a-z0-9]+)*)$")


def parse(spec: str):
    """A :class:`Shape` from ``64x4096x32x8x128``, ``64x4096x32x8x128:b64``, ``...:ragged``; a
    :class:`hal.bench.prefill.PrefillShape` from a prefill SPEC (one with a ``/``); a
    :class:`hal.bench.mla.MlaShape` from an MLA SPEC (``mla:64x4096x128``)."""
    if spec.strip().lower().startswith("mla:"):
        from hal.bench import mla
        return mla.parse(spec)
    if "/" in spec:
        from hal.bench import prefill
        return prefill.parse(spec)
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(f"shape {spec!r} is not understood: expected BATCHxCONTEXTxQHEADSxKVHEADSxHEADSIZE"
                         f"[:bBLOCK][:ragged], e.g. 64x4096x32x8x128:b16, a prefill SPEC (GROUP[+GROUP]/QHEADSxKVHEADSxHEADSIZE, "
                         f"e.g. 4x1024@8192/32x8x128), an MLA SPEC (mla:BATCHxCONTEXTxHEADS[:bPAGE][:qROWS][:ragged], "
                         f"e.g. mla:64x4096x128), or a set name ({', '.join(SETS)})")
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

# The prefill issue's shapes: 8 fresh prefills of 2048 tokens; chunked prefill (1024 new tokens over
# 8192 cached); a mixed batch (64 decode rows at 4096 context + 2 prefills of 1024); 16 ragged prefills.
PREFILL = ("8x2048/32x8x128", "4x1024@8192/32x8x128", "64x1@4096+2x1024/32x8x128", "16x100-3000/32x8x128")
PREFILL_EXTRA = ("8x2048/32x8x64", "8x2048/32x8x256", "8x2048/32x32x128", "8x2048/64x8x128",
                 "4x1024@8192/32x8x128:b64", "64x1@4096+2x1024/32x8x128:b64")

# The MLA issue's shapes (hal.mla_decode, R 512 + P 64, page 64, one query row): batch x context 64x4096,
# 128x2048, 32x8192, 16x32768, 1x65536 and a ragged batch, each with 128 heads (DeepSeek-V3 on one GPU)
# and 16 (tensor parallel over 8).
MLA = tuple(f"mla:{bc}x{h}{opt}" for bc, opt in (("64x4096", ""), ("128x2048", ""), ("32x8192", ""),
                                                  ("16x32768", ""), ("1x65536", ""), ("64x8192", ":ragged"))
            for h in (128, 16))
# Page-16 twins of some of them (same lengths: the draw does not depend on the page size), for the
# target "page 16 within 5% of page 64".
MLA_B16 = ("mla:64x4096x128:b16", "mla:64x4096x16:b16", "mla:16x32768x128:b16", "mla:16x32768x16:b16",
           "mla:64x8192x128:b16:ragged", "mla:64x8192x16:b16:ragged")

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
    # the plan/run issue's decode gaps: GQA 16, one sequence at 128K and a small batch at 8K (split-K
    # decides), heads 64 and 256 at page 64 (add --contenders hal hal-nhd for strided caches)
    "decode-gaps": ("32x8192x128x8x128", "1x131072x32x8x128", "4x8192x32x8x128", "32x8192x32x8x64:b64",
                    "32x8192x32x8x256:b64", "64x4096x32x8x128:b64"),
    # small enough to finish in seconds on a 2-core CPU (emu torch path vs the PyTorch baseline)
    "cpu": ("4x1024x32x8x128", "8x512x16x4x64", "8x1024x32x8x128:ragged", "2x4096x32x4x128:b64"),
    # seconds on a CPU: every decode code path (uniform, ragged, block 32)
    "tiny": ("2x64x4x2x64", "3x100x8x2x64:b32:ragged"),
    # prefill (hal/bench/prefill.py): head 128, 32 query heads over 8 KV heads, block 16
    "prefill": PREFILL,
    # the cuda issue's further prefill shapes: head 64 / 256, GQA 1 / 8, block 64
    "prefill-extra": PREFILL_EXTRA,
    "prefill-sweep": PREFILL + PREFILL_EXTRA,
    # seconds on a CPU: fresh, chunked, mixed (decode + short + long rows), ragged, block 8/32, head 128
    "prefill-tiny": ("2x40/4x2x64", "2x12@50/8x2x64:b8", "3x1@40+1x5@20+1x33/4x2x64", "4x3-30@0-20/4x1x64:b32",
                     "1x24@8/4x2x128"),
    # MLA decode (hal/bench/mla.py): the MLA issue's shapes at page 64, and page-16 twins
    "mla": MLA,
    "mla-b16": MLA_B16,
    "mla-sweep": MLA + MLA_B16,
    # seconds on a 2-core CPU: 16 and 128 heads, ragged, two query rows
    "mla-cpu": ("mla:4x1024x16", "mla:2x2048x128", "mla:8x512x16:ragged", "mla:4x512x16:q2"),
    # seconds on a CPU: every MLA code path (page 16 and 64, ragged, two query rows per sequence)
    "mla-tiny": ("mla:2x40x4:b16", "mla:3x600x8:b16:q2:ragged", "mla:2x70x16"),  # 600: the balanced split
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
