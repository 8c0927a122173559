"""FP8 encodings: the one place where FP8 bytes become numbers and numbers become FP8 bytes.

Semantics (design.md, "FP8 semantics"):
  real   = decode(byte) * scale
  stored = encode(saturate(real / scale))

* The quotient ``real / scale`` is formed in float32 with IEEE division, then rounded to the encoding
  with round-to-nearest-even. Every pack uses this order, so all packs write the same bytes.
* Writing saturates to the largest finite value of the encoding, for every encoding (infinities too).
  NaN stays NaN. Torch's own casts disagree across encodings (e4m3fn saturates, e4m3fnuz gives NaN,
  e5m2 gives inf), so nothing here uses them: decode is a 256-entry table built from the bit layout,
  encode is exact arithmetic on float64.
* A scale is finite and > 0 in float32 (a per-head one has one entry per head); :func:`encode` and
  :func:`decode` refuse anything else with :class:`hal.ArgumentError` (a zero scale would saturate every
  value, silently).
* A cache's torch dtype *is* its encoding. The same byte means different numbers in e4m3fn and
  e4m3fnuz (fnuz values are half, and 0x80 is NaN there), so bytes only move between the two through
  :func:`fn_to_fnuz`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hal.targets import Target

__all__ = [
    "Encoding",
    "ENCODINGS",
    "FP8_DTYPES",
    "encoding_of",
    "is_fp8",
    "decode_table",
    "decode_values",
    "encode",
    "decode",
    "encode_bytes",
    "native_e4m3",
    "native_e5m2",
    "fn_to_fnuz",
    "kv_cache_dtype",
]


@dataclasses.dataclass(frozen=True)
class Encoding:
    """Bit layout of one FP8 encoding.

    ``fnuz`` encodings have no negative zero and no infinities: byte 0x80 is their only NaN.
    OCP e4m3fn has no infinities and NaN at S.1111.111; OCP e5m2 is IEEE-like (inf and NaNs at
    exponent 31).
    """

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    fnuz: bool

    @property
    def max_finite(self) -> float:
        return float(_positive_finite_values(self)[-1])

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def has_inf(self) -> bool:
        return self.name == "e5m2"

    def is_nan_byte(self, byte: int) -> bool:
        if self.fnuz:
            return byte == 0x80
        magnitude = byte & 0x7F
        if self.name == "e4m3fn":
            return magnitude == 0x7F
        return (magnitude >> self.mantissa_bits) == 0x1F and (magnitude & 0x3) != 0  # e5m2

    def decode_byte(self, byte: int) -> float:
        """Exact value of one byte (float64), from the bit layout alone."""
        if self.is_nan_byte(byte):
            return math.nan
        sign = -1.0 if byte & 0x80 else 1.0
        exponent = (byte >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        mantissa = byte & ((1 << self.mantissa_bits) - 1)
        if self.has_inf and exponent == (1 << self.exponent_bits) - 1:
            return sign * math.inf
        if exponent == 0:
            return sign * mantissa * 2.0 ** (1 - self.bias - self.mantissa_bits)
        return sign * (1.0 + mantissa / (1 << self.mantissa_bits)) * 2.0 ** (exponent - self.bias)

    def __str__(self) -> str:
        return self.name


ENCODINGS: dict[torch.dtype, Encoding] = {
    e.dtype: e
    for e in (
        Encoding("e4m3fn", torch.float8_e4m3fn, 4, 3, 7, fnuz=False),
        Encoding("e4m3fnuz", torch.float8_e4m3fnuz, 4, 3, 8, fnuz=True),
        Encoding("e5m2", torch.float8_e5m2, 5, 2, 15, fnuz=False),
        Encoding("e5m2fnuz", torch.float8_e5m2fnuz, 5, 2, 16, fnuz=True),
    )
}
FP8_DTYPES: frozenset[torch.dtype] = frozenset(ENCODINGS)
_BY_NAME = {e.name: e for e in ENCODINGS.values()}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in ENCODINGS


def encoding_of(dtype_or_name: torch.dtype | str | Encoding) -> Encoding:
    """The :class:`Encoding` for a torch float8 dtype, an encoding name, or an Encoding."""
    if isinstance(dtype_or_name, Encoding):
        return dtype_or_name
    if isinstance(dtype_or_name, str):
        name = dtype_or_name.removeprefix("torch.").removeprefix("float8_")
        if name in _BY_NAME:
            return _BY_NAME[name]
        raise ValueError(
            f"unknown FP8 encoding {dtype_or_name!r}: expected one of {sorted(_BY_NAME)}"
        )
    if dtype_or_name in ENCODINGS:
        return ENCODINGS[dtype_or_name]
    if dtype_or_name == torch.uint8:
        raise TypeError(
            "a uint8 tensor carries no FP8 encoding: view it as the float8 dtype its bytes were "
            "written in, e.g. cache.view(torch.float8_e4m3fn) (NVIDIA, gfx950) or "
            "cache.view(torch.float8_e4m3fnuz) (gfx942 / MI300)"
        )
    raise TypeError(f"{dtype_or_name} is not an FP8 dtype: expected one of {sorted(str(d) for d in ENCODINGS)}")


@functools.cache
def _table_f64(encoding: Encoding) -> tuple[float, ...]:
    return tuple(encoding.decode_byte(b) for b in range(256))


@functools.cache
def _positive_finite_values(encoding: Encoding) -> torch.Tensor:
    """Sorted non-negative finite values of the encoding (float64), one per magnitude byte."""
    vals = [v for v in _table_f64(encoding)[:128] if math.isfinite(v)]
    return torch.tensor(vals, dtype=torch.float64)


@functools.cache
def _table_cache(encoding: Encoding, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(_table_f64(encoding), dtype=torch.float64).to(dtype=dtype, device=device)


def decode_table(encoding: Encoding | torch.dtype, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 values of an encoding (index = byte) as a tensor; exact in float32/float64."""
    return _table_cache(encoding_of(encoding), dtype, torch.device(device))


def decode_pair_table(encoding: Encoding | torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The values of every pair of bytes as float32 pairs: an int64 tensor of 65536 entries, entry
    ``lo | hi << 8`` holding the float32 bits of byte ``lo`` in its low half and of byte ``hi`` in
    its high half. On a little-endian host, two adjacent bytes read as one uint16 index this table,
    and the int64 results viewed as float32 are the two values in order (half the lookups of
    :func:`decode_table`). Built from :func:`decode_table`, so exact likewise."""
    return _pair_table_cache(encoding_of(encoding), torch.device(device))


@functools.cache
def _pair_table_cache(enc: Encoding, device: torch.device) -> torch.Tensor:
    bits = _table_cache(enc, torch.float32, torch.device("cpu")).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    pair = torch.arange(1 << 16)
    return ((bits[pair >> 8] << 32) | bits[pair & 0xFF]).to(device)


@functools.cache
def _torch_cast_is_exact(dtype: torch.dtype, device: str) -> bool:
    """Whether torch's own float8 -> float32 cast equals the decode table on every byte (NaN as NaN)
    on this device; checked once per encoding and device."""
    try:
        got = torch.arange(256, dtype=torch.uint8, device=device).view(dtype).to(torch.float32).cpu()
        ref = _table_cache(ENCODINGS[dtype], torch.float32, torch.device("cpu"))
        return bool(((got == ref) | (torch.isnan(got) & torch.isnan(ref))).all())
    except Exception:  # a torch without this cast on this device
        return False


def decode_values(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The numbers float8 bytes hold (no scale), exactly, as float32 (into ``out`` if given).

    Uses torch's cast where it was verified to equal the bit-layout table for all 256 bytes on this
    device (one fused pass, several times faster on CPUs); otherwise the table.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if _torch_cast_is_exact(q.dtype, str(q.device)):
        return out.copy_(q)
    table = decode_table(q.dtype, torch.float32, q.device)
    return out.copy_(table[q.view(torch.uint8).to(torch.int32)])


def encode_bytes(x: torch.Tensor, encoding: Encoding | torch.dtype) -> torch.Tensor:
    """Round ``x`` (any float dtype) to the encoding's nearest value, ties to even, saturating.

    Returns the uint8 bytes. Computed in float64, where scaling by powers of two is exact, so the
    result is the correctly rounded one for any float32/float16/bfloat16 input.
    """
    enc = encoding_of(encoding)
    a = x.to(torch.float64).contiguous()  # searchsorted copies (and warns) on strided input
    mag = a.abs()
    # Quantum of the binade of each value; one common quantum below the smallest normal binade.
    min_normal_exp = 1 - enc.bias
    _, frexp_exp = torch.frexp(mag.clamp_min(2.0 ** min_normal_exp))  # exact, unlike floor(log2)
    quantum = torch.exp2((frexp_exp - 1 - enc.mantissa_bits).to(torch.float64))
    rounded = torch.round(mag / quantum) * quantum  # torch.round is round-half-to-even
    positives = _positive_finite_values(enc).to(a.device)
    rounded = torch.minimum(rounded.nan_to_num(posinf=math.inf), positives[-1])  # saturate (and inf)
    magnitude_byte = torch.searchsorted(positives, rounded).to(torch.uint8)  # exact match by construction
    negative = torch.signbit(a)
    if enc.fnuz:
        negative = negative & (magnitude_byte != 0)  # fnuz has no -0: 0x80 is NaN
    out = magnitude_byte | (negative.to(torch.uint8) << 7)
    nan_byte = 0x80 if enc.fnuz else 0x7F  # the NaN NVIDIA's saturating cvt writes (S.1111.111 / S.11111.11)
    return torch.where(torch.isnan(a), torch.tensor(nan_byte, dtype=torch.uint8, device=a.device), out)


def _scale_error(op: str, expected: str, given: str) -> Exception:
    """``hal.ArgumentError`` (a ValueError), imported here: hal.validate imports this module."""
    from hal.validate import ArgumentError
    return ArgumentError(f"hal.fp8.{op}: scale must be {expected}; got {given}")


def _as_scale_tensor(scale, like: torch.Tensor, head_dim: int | None, op: str) -> torch.Tensor | float:
    """``scale`` checked and shaped for ``like`` (x in encode, the values in decode): a float, or
    a float32 tensor on ``like``'s device, a per-head one viewed along ``head_dim``.

    Refuses zero, negative, NaN and infinite scales, and floats float32 cannot hold (the division is
    done in float32): a zero scale would saturate every value. Tensor values are read on the CPU
    always, on a device only under HAL_DEBUG=1 (reading them there is a sync); shapes always.
    """
    if not isinstance(scale, torch.Tensor):
        return _float_scale(scale, op)
    if scale.dim() > 1:
        raise _scale_error(op, "a float, a 0-d tensor or a 1-d per-head tensor",
                           f"a tensor of shape {tuple(scale.shape)}")
    shape = None
    if scale.dim() == 1 and (head_dim is not None or scale.numel() != 1):
        shape = _per_head_shape(scale, like, head_dim, op)
    s = scale.to(dtype=torch.float32)
    if s.device.type == "cpu" or _debug():  # checked where it lives: no copy, no sync on the CPU
        _check_values(s, op)
    s = s.to(like.device)
    return s.view(shape) if shape is not None else s


def _debug() -> bool:
    from hal import env  # imported here: this module imports nothing of hal's at load time
    return env.debug()


def _float_scale(scale, op: str) -> float:
    try:
        if isinstance(scale, (str, bytes)):
            raise TypeError(scale)
        f = float(scale)
    except (TypeError, ValueError):
        raise _scale_error(op, "a float or a tensor", type(scale).__name__) from None
    f32 = float(torch.tensor(f, dtype=torch.float32))  # what x / scale is computed in
    if not (math.isfinite(f) and f > 0):
        raise _scale_error(op, "finite and > 0", repr(f))
    if not (math.isfinite(f32) and f32 > 0):
        raise _scale_error(op, "finite and > 0 in float32, which the arithmetic is done in",
                           f"{f!r}, which becomes {f32!r} in float32")
    return f


def _per_head_shape(s: torch.Tensor, like: torch.Tensor, head_dim: int | None, op: str) -> list[int]:
    """The shape that lays a per-head scale along ``like``'s ``head_dim`` axis, one entry per head."""
    if head_dim is None:
        raise _scale_error(op, "a float or a 0-d tensor when head_dim is None (pass head_dim=, the "
                           "axis a per-head scale's entries apply to)",
                           f"a 1-d tensor of {s.numel()} entries")
    if not (isinstance(head_dim, int) and -like.dim() <= head_dim < like.dim()):
        from hal.validate import ArgumentError
        raise ArgumentError(f"hal.fp8.{op}: head_dim must be an axis of {'x' if op == 'encode' else 'q'} (-{like.dim()} .. "
                            f"{like.dim() - 1} for a {like.dim()}-d tensor); got {head_dim!r}")
    heads, x = like.shape[head_dim], "x" if op == "encode" else "q"
    if s.numel() != heads:
        raise _scale_error(op, f"a per-head tensor of {x}.shape[{head_dim}] = {heads} entries (one per "
                           f"head along head_dim={head_dim}, for {x} of shape {tuple(like.shape)})",
                           f"{s.numel()} entr{'y' if s.numel() == 1 else 'ies'}")
    shape = [1] * like.dim()
    shape[head_dim] = -1
    return shape


def _check_values(s: torch.Tensor, op: str) -> None:
    bad = ~(torch.isfinite(s) & (s > 0))
    if not bool(bad.any()):
        return
    if s.numel() == 1:
        raise _scale_error(op, "finite and > 0", f"{float(s)!r} (in float32)")
    head = int(bad.flatten().nonzero()[0])
    raise _scale_error(op, "finite and > 0 for every head", f"{s.flatten().tolist()} (head {head} is "
                       f"{float(s.flatten()[head])!r} in float32)")


def encode(x: torch.Tensor, dtype: torch.dtype | Encoding, scale=1.0, *, head_dim: int | None = None) -> torch.Tensor:
    """``encode(saturate(x / scale))`` as a tensor of ``dtype`` (a torch float8 dtype).

    ``scale`` is a float, a 0-d tensor, or a 1-d per-head tensor with one entry per index of x's
    ``head_dim`` axis (``x.shape[head_dim]`` entries), broadcast along it. ``x / scale`` is computed
    in float32 (IEEE division), as the kernels do. A scale that is not finite and > 0 in float32,
    or a per-head scale of another length, is a :class:`hal.ArgumentError` naming ``scale``
    (tensor values are checked on the CPU always, on a device only under HAL_DEBUG=1: a sync).
    """
    enc = encoding_of(dtype)
    s = _as_scale_tensor(scale, x, head_dim, "encode")
    # A tensor divisor: with a Python float, CUDA torch multiplies by the reciprocal instead of dividing.
    q = x.to(torch.float32) / torch.as_tensor(s, dtype=torch.float32, device=x.device)
    return encode_bytes(q, enc).view(enc.dtype)


def decode(q: torch.Tensor, scale=1.0, out_dtype: torch.dtype = torch.float32, *,
           head_dim: int | None = None) -> torch.Tensor:
    """``decode(byte) * scale`` for a float8 tensor, in float32, then cast to ``out_dtype``;
    ``scale`` and ``head_dim`` as in :func:`encode`, checked the same way."""
    encoding_of(q.dtype)  # a clear error for non-FP8 input
    values = decode_values(q)
    s = _as_scale_tensor(scale, values, head_dim, "decode")
    return (values * s).to(out_dtype)


def native_e4m3(target: "Target | None" = None) -> torch.dtype:
    """The e4m3 dtype to allocate an FP8 cache in on ``target`` (default: :func:`hal.target`).

    gfx942 (MI300) converts in e4m3fnuz; NVIDIA sm89+, gfx950 and the CPU use OCP e4m3fn.
    """
    return _native(target, "e4m3")


def native_e5m2(target: "Target | None" = None) -> torch.dtype:
    return _native(target, "e5m2")


def _native(target, family: str) -> torch.dtype:
    if target is None:
        from hal.targets import target as detect
        target = detect()
    for dtype in target.fp8_encodings:
        if encoding_of(dtype).name.startswith(family):
            return dtype
    return _BY_NAME[family if family == "e5m2" else "e4m3fn"].dtype


def fn_to_fnuz(data: torch.Tensor, scale=None):
    """Move e4m3fn data (and its scale) to e4m3fnuz without changing the values it represents.

    The same byte decodes to half the value in fnuz, so the scale doubles; byte 0x80 (-0 in fn, NaN
    in fnuz) becomes 0x00. NaN bytes (0x7f/0xff in fn) become the fnuz NaN 0x80. Returns
    ``(fnuz_data, scale * 2)``, or only the data when ``scale`` is None.
    """
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fn_to_fnuz: data must be torch.float8_e4m3fn, got {data.dtype}")
    raw = data.view(torch.uint8)
    out = torch.where(raw == 0x80, torch.zeros_like(raw), raw)
    out = torch.where((raw & 0x7F) == 0x7F, torch.full_like(raw, 0x80), out)
    out = out.view(torch.float8_e4m3fnuz)
    if scale is None:
        return out
    return out, scale * 2


# vLLM's kv_cache_dtype strings. "fp8"/"fp8_e4m3" follow the target's native e4m3 (fnuz on gfx942),
# as vLLM does; "auto" means the model dtype (no FP8).
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2fnuz",
                    "bfloat16", "float16", "half", "float32")


def kv_cache_dtype(name: str, model_dtype: torch.dtype = torch.bfloat16, target: "Target | None" = None) -> torch.dtype:
    """Map a vLLM ``kv_cache_dtype`` string onto the torch dtype to allocate the cache in."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return native_e4m3(target)
    if name == "fp8_e5m2":
        return native_e5m2(target)
    if name.startswith("fp8_"):
        return encoding_of(name[4:]).dtype
    plain = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
             "float32": torch.float32}
    if name in plain:
        return plain[name]
    raise ValueError(f"unknown kv_cache_dtype {name!r}: expected one of {list(_KV_CACHE_DTYPES)}")
