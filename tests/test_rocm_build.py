"""The rocm pack's code objects, read without AMD hardware: the instructions the design relies on are
there (MFMA 16x16x16 in every decode kernel; gfx942's FP8 conversions exactly where they belong and
nowhere on gfx90a), no scratch, registers and LDS within the occupancy the design assumes, and the
kernel-argument layout in each code object's metadata equal to what the launcher packs, for every
kernel. Code objects are compiled by the pack's own build function (or taken from the installed pack
when built from the same sources); the tests skip, saying why, where no clang has the AMDGPU target.
"""

from __future__ import annotations

import ctypes
import json
import pathlib
import re

import pytest

from hal.kernelpacks.rocm import build, codeobj, kernels, pack, testing

CSRC = str(pathlib.Path(__file__).resolve().parents[1] / "packs" / "rocm" / "csrc")
ARCHS = kernels.DEFAULT_ARCHS
MAX_VGPRS = 128           # 512 per SIMD lane / 4 waves
MAX_LDS = 16 * 1024       # 64 KiB per CU / 4 workgroups


@pytest.fixture(scope="module")
def built() -> pathlib.Path:
    return testing.built_or_skip(CSRC)


@pytest.fixture(scope="module")
def objects(built) -> dict[str, codeobj.CodeObject]:
    return {arch: codeobj.read(built / arch / build.CODE_OBJECT) for arch in ARCHS}


@pytest.fixture(scope="module")
def disasm(built) -> dict[str, dict[str, str]]:
    """arch -> kernel -> its disassembly."""
    return testing.disassembly_or_skip(built, ARCHS, build.CODE_OBJECT)


def _decode_parts(name: str) -> tuple[str, str, int]:
    m = re.fullmatch(r"hal_pa_decode_(f16|bf16)_(\w+)_d(\d+)", name)
    return m.group(1), m.group(2), int(m.group(3))


@pytest.mark.parametrize("arch", ARCHS)
def test_code_object_holds_the_contracted_kernels(objects, arch):
    co = objects[arch]
    assert co.arch == arch and co.target.startswith("amdgcn-amd-amdhsa--")
    assert sorted(co.kernels) == kernels.kernel_names(arch)
    for k in co.kernels.values():
        assert k.wavefront_size == 64 and k.max_flat_workgroup_size == kernels.THREADS, k.name


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_kernels_use_mfma_16x16x16(disasm, arch):
    """QK runs on the query's MFMA type; PV on f16 for FP8 caches, else on the cache's (= query's) type."""
    for name, text in disasm[arch].items():
        if not name.startswith("hal_pa_decode_"):
            continue
        q, cache, _ = _decode_parts(name)
        found = set(re.findall(r"v_mfma_f32_16x16x16_?(f16|bf16)", text))
        pv = q if cache in ("f16", "bf16") else "f16"
        assert found == {q, pv}, f"{arch} {name}: MFMA types {found}"
        assert "v_mfma_f32_32x32" not in text and "v_mfma_f32_4x4" not in text


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_conversions_only_in_hardware_on_gfx942(disasm, arch):
    hw = arch in kernels.HW_FP8
    for name, text in disasm[arch].items():
        cvts = set(re.findall(r"v_cvt_(?:pk_)?(?:f32_fp8|f32_bf8|fp8_f32|bf8_f32|sr_fp8_f32|sr_bf8_f32)", text))
        enc = name.rsplit("_", 1)[-1] if name.startswith("hal_cache_kv_") else None
        if name.startswith("hal_pa_decode_"):
            enc = _decode_parts(name)[1]
        if not hw or enc not in kernels.FNUZ:
            assert not cvts, f"{arch} {name} has FP8 conversion instructions {cvts}"
            continue
        want = {"e4m3fnuz": "fp8", "e5m2fnuz": "bf8"}[enc]
        if name.startswith("hal_pa_decode_"):
            assert cvts == {f"v_cvt_pk_f32_{want}"}, f"{name}: {cvts}"
        else:
            assert cvts == {f"v_cvt_pk_{want}_f32"}, f"{name}: {cvts}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_scratch_and_occupancy_budget(objects, built, arch):
    """The design assumes >= 4 waves per SIMD: <= 128 VGPRs (unified with AGPRs), <= 16 KiB LDS per
    4-wave workgroup, no private segment. The occupancy computed from the metadata must equal the
    compiler's own figure (its kernel-resource-usage remark)."""
    info = json.loads((built / build.BUILD_INFO).read_text())["archs"][arch]["kernels"]
    for name, k in objects[arch].kernels.items():
        assert k.scratch == 0 and k.vgpr_spill == 0 and k.sgpr_spill == 0, f"{name} spills: {k}"
        assert k.vgpr <= MAX_VGPRS, f"{name}: {k.vgpr} VGPRs"
        assert k.lds <= MAX_LDS, f"{name}: {k.lds} B LDS"
        occ = k.occupancy()["waves_per_simd"]
        assert occ >= 4, f"{name}: {occ} waves/SIMD"
        assert info[name]["compiler_occupancy"] == occ, name
    decode = [k for n, k in objects[arch].kernels.items() if n.startswith("hal_pa_decode_")]
    assert {k.lds for k in decode} == {9728}  # DecodeLds: P (8 KiB) + block ids + per-wave max and sum


@pytest.mark.parametrize("arch", ARCHS)
def test_kernarg_layout_matches_the_launcher(objects, arch):
    assert testing.kernarg_mismatches(objects[arch]) == []


@pytest.mark.parametrize("fam", sorted(kernels.PARAMS))
def test_kernel_params_and_packed_buffer_agree(fam):
    """hipModuleLaunchKernel's kernelParams (pointers to each value) hold, at the metadata offsets, the
    very bytes the CPU emulation unpacks."""
    values = {}
    for i, (name, kind) in enumerate(kernels.PARAMS[fam]):
        values[name] = {"ptr": 0x7F0000001000 + 64 * i, "i64": -(10 ** 12) - i, "i32": 1000 + i, "f32": 0.5 + i}[kind]
    params, keep = kernels.kernel_params(fam, values)
    buf = bytearray(kernels.kernarg_size(fam))
    for a, p in zip(kernels.layout(fam), params):
        buf[a.offset:a.offset + a.size] = ctypes.string_at(p, a.size)
    assert bytes(buf) == kernels.pack(fam, values)
    del keep


def test_metadata_reader_matches_msgpack(built):
    msgpack = pytest.importorskip("msgpack")
    for arch in ARCHS:
        image = (built / arch / build.CODE_OBJECT).read_bytes()
        assert codeobj.parse(image) == codeobj.parse(image, unpack=lambda b: msgpack.unpackb(b, raw=False))


def test_build_info_and_report(built):
    info = json.loads((built / build.BUILD_INFO).read_text())
    assert sorted(info["archs"]) == sorted(ARCHS)
    assert info["source_hash"] == build.source_hash(CSRC)
    if "clang version 19" in info["compiler"] or "clang-19" in info["compiler"]:
        assert "gfx950" in info["not_built"] and "gfx950" in info["not_built"]["gfx950"]
    from hal.kernelpacks.rocm.__main__ import render, report
    rep = report(built)
    assert rep["built_archs"] == sorted(ARCHS)
    text = render(rep)
    for arch in ARCHS:
        assert f"{arch} (partition size" in text
        assert "hal_pa_decode_bf16_bf16_d128" in rep[f"kernels_{arch}"]
        assert "pa_decode" in rep[f"resources_{arch}"]
    assert "not a ROCm build" in text or rep["available"]


def test_rocm_pack_sees_the_build(built):
    p = pack.RocmPack(built)
    info = p.availability.build_info
    assert info["built_archs"] == sorted(ARCHS)
    assert all(info["partition_size"][a] == 256 for a in ARCHS)
