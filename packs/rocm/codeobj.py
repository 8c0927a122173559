"""Reading AMDGPU code objects (HSA ELF) without LLVM tools: the ``NT_AMDGPU_METADATA`` note (msgpack,
code object v3+) with each kernel's arguments and resource use, and the occupancy that follows.

Stdlib only: ``build.py`` runs under CMake with the build's own Python. The msgpack subset decoder
below is checked against the ``msgpack`` package in the tests.
"""

from __future__ import annotations

import dataclasses
import struct

# Per SIMD on gfx90a / gfx942 (CDNA2 / CDNA3): 512 unified VGPRs+AGPRs per lane allocated in granules
# of 8, 800 SGPRs in granules of 16, at most 8 waves; 64 KiB of LDS per CU shared by its 4 SIMDs.
# (AMD CDNA3 ISA reference, "Wave execution" / LLVM AMDGPUUsage "Register allocation".)
VGPRS_PER_SIMD = 512
VGPR_GRANULE = 8
SGPRS_PER_SIMD = 800
SGPR_GRANULE = 16
MAX_WAVES_PER_SIMD = 8
LDS_PER_CU = 65536
SIMDS_PER_CU = 4


class _Unpacker:
    """The msgpack subset AMDGPU metadata uses (maps, arrays, strings, ints, floats, bools, nil)."""

    def __init__(self, data: bytes):
        self.d, self.p = data, 0

    def _take(self, n: int) -> bytes:
        b = self.d[self.p:self.p + n]
        if len(b) != n:
            raise ValueError("truncated msgpack data")
        self.p += n
        return b

    def _u(self, fmt: str):
        return struct.unpack(">" + fmt, self._take(struct.calcsize(fmt)))[0]

    def value(self):
        t = self._take(1)[0]
        if t <= 0x7F:
            return t
        if t >= 0xE0:
            return t - 0x100
        if 0x80 <= t <= 0x8F:
            return self._map(t & 0x0F)
        if 0x90 <= t <= 0x9F:
            return [self.value() for _ in range(t & 0x0F)]
        if 0xA0 <= t <= 0xBF:
            return self._take(t & 0x1F).decode()
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if t in simple:
            return simple[t]
        sized = {0xC4: "B", 0xC5: "H", 0xC6: "I"}  # bin 8/16/32
        if t in sized:
            return bytes(self._take(self._u(sized[t])))
        nums = {0xCA: "f", 0xCB: "d", 0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q",
                0xD0: "b", 0xD1: "h", 0xD2: "i", 0xD3: "q"}
        if t in nums:
            return self._u(nums[t])
        strs = {0xD9: "B", 0xDA: "H", 0xDB: "I"}
        if t in strs:
            return self._take(self._u(strs[t])).decode()
        if t in (0xDC, 0xDD):
            return [self.value() for _ in range(self._u("H" if t == 0xDC else "I"))]
        if t in (0xDE, 0xDF):
            return self._map(self._u("H" if t == 0xDE else "I"))
        raise ValueError(f"msgpack type byte {t:#x} is not used by AMDGPU metadata")

    def _map(self, n: int) -> dict:
        out = {}
        for _ in range(n):
            k = self.value()
            out[k] = self.value()
        return out


def unpackb(data: bytes):
    return _Unpacker(data).value()


def metadata_note(image: bytes) -> bytes:
    """The raw msgpack of the ``AMDGPU`` note of type 32 (NT_AMDGPU_METADATA) in an ELF64 image."""
    if image[:4] != b"\x7fELF" or image[4] != 2:
        raise ValueError("not an ELF64 file")
    e_machine = struct.unpack_from("<H", image, 0x12)[0]
    if e_machine != 224:  # EM_AMDGPU
        raise ValueError(f"ELF machine {e_machine} is not AMDGPU (224)")
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    for i in range(shnum):
        sh = shoff + i * shentsize
        if struct.unpack_from("<I", image, sh + 4)[0] != 7:  # SHT_NOTE
            continue
        off, size = struct.unpack_from("<QQ", image, sh + 0x18)
        p = off
        while p < off + size:
            namesz, descsz, ntype = struct.unpack_from("<III", image, p)
            name = image[p + 12:p + 12 + namesz].rstrip(b"\0")
            desc = p + 12 + ((namesz + 3) & ~3)
            if name == b"AMDGPU" and ntype == 32:
                return image[desc:desc + descsz]
            p = desc + ((descsz + 3) & ~3)
    raise ValueError("no NT_AMDGPU_METADATA note (not a code object v3+?)")


@dataclasses.dataclass(frozen=True)
class KernelArg:
    name: str
    offset: int
    size: int
    value_kind: str


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    args: tuple[KernelArg, ...]
    kernarg_segment_size: int   # explicit arguments plus the hidden ones the runtime fills in
    vgpr: int                   # .vgpr_count: unified VGPRs + AGPRs on gfx90a / gfx942
    agpr: int
    sgpr: int
    lds: int                    # .group_segment_fixed_size: static LDS per workgroup
    scratch: int                # .private_segment_fixed_size: bytes per work-item
    vgpr_spill: int
    sgpr_spill: int
    wavefront_size: int
    max_flat_workgroup_size: int

    def occupancy(self, threads: int = 256) -> dict:
        """Waves per SIMD this kernel can keep resident, and what limits it."""
        waves_per_group = -(-threads // self.wavefront_size)
        vgpr_alloc = -(-max(self.vgpr, 1) // VGPR_GRANULE) * VGPR_GRANULE
        sgpr_alloc = -(-max(self.sgpr, 1) // SGPR_GRANULE) * SGPR_GRANULE
        limits = {
            "max": MAX_WAVES_PER_SIMD,
            "vgpr": VGPRS_PER_SIMD // vgpr_alloc,
            "sgpr": SGPRS_PER_SIMD // sgpr_alloc,
        }
        if self.lds:
            groups = LDS_PER_CU // self.lds
            limits["lds"] = groups * waves_per_group // SIMDS_PER_CU
        waves = min(limits.values())
        return {"waves_per_simd": waves, "limited_by": sorted(k for k, v in limits.items() if v == waves)}

    def resources(self) -> dict:
        occ = self.occupancy()
        return {"vgpr": self.vgpr, "agpr": self.agpr, "sgpr": self.sgpr, "lds": self.lds,
                "scratch": self.scratch, "occupancy": occ["waves_per_simd"], "limited_by": occ["limited_by"]}


@dataclasses.dataclass(frozen=True)
class CodeObject:
    target: str                 # e.g. "amdgcn-amd-amdhsa--gfx942"
    version: tuple[int, ...]
    kernels: dict[str, Kernel]

    @property
    def arch(self) -> str:
        return self.target.rsplit("--", 1)[-1].split(":")[0]


def _kernel(md: dict) -> Kernel:
    args = tuple(KernelArg(a.get(".name", ""), a[".offset"], a[".size"], a[".value_kind"])
                 for a in md.get(".args", []))
    return Kernel(md[".name"], args, md[".kernarg_segment_size"], md[".vgpr_count"], md.get(".agpr_count", 0),
                  md[".sgpr_count"], md[".group_segment_fixed_size"], md[".private_segment_fixed_size"],
                  md.get(".vgpr_spill_count", 0), md.get(".sgpr_spill_count", 0), md[".wavefront_size"],
                  md[".max_flat_workgroup_size"])


def parse(image: bytes, unpack=unpackb) -> CodeObject:
    md = unpack(metadata_note(image))
    kernels = {k[".name"]: _kernel(k) for k in md["amdhsa.kernels"]}
    return CodeObject(md["amdhsa.target"], tuple(md.get("amdhsa.version", ())), kernels)


def read(path) -> CodeObject:
    with open(path, "rb") as f:
        return parse(f.read())
