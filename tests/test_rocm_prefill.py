"""The rocm pack's multi-token paged attention (packs/rocm/csrc/pa_prefill.h: the code object
hal_rocm_prefill.hsaco) and its mixed batches (one-token sequences through pa_decode.h / pa_reduce.h in
the same call), and strided (NHD-view) caches in both, proven without AMD hardware as decode is:

* **Code objects** (gfx90a and gfx942, the pack's own build; skipped with the reason where no clang has
  the AMDGPU target): per kernel 32 MFMA 16x16x16 in the step loop (16 for S in the query's type, 16 for
  P V in the PV type: the query's for a 16-bit cache, f16 for FP8) and 2 barriers a step; the fnuz FP8
  conversions (v_cvt_pk_f32_fp8 / _bf8) in gfx942's fnuz kernels and no FP8 instruction anywhere else;
  zero scratch; <= 256 VGPRs + AGPRs and the expected LDS (<= 32 KiB): at least 2 waves per SIMD, equal to
  the compiler's own figure; the argument layout in the metadata equal to what the launcher packs.
* **Emulation**: the same sources under the wave64 CPU emulation (both flavours), through the pack's own
  ops code, against the float64 reference (tests/reference.py, FP8 via ml_dtypes) and the emu pack on
  the same bytes. Data as in test_emu_prefill: fresh random values, every cache slot no row reads
  poisoned with NaN / inf bytes, block-table entries past a sequence's blocks junk, outputs poisoned.
* **Dispatch**: HAL_TARGET=gfx942 on a CPU machine names the rocm pack for a multi-token call and falls
  back to emu only because no AMD GPU is present.

Tolerance: relative L2 <= 5e-3 (cases.GPU_REL_L2). The arithmetic, as for decode: P is rounded to the PV
operand type before P V (bf16 for a bf16 cache: <= 2^-9 relative a weight, ~1.1e-3 relative L2; f16 for
f16 and FP8 caches: 1.4e-4), the output to the query's type (bf16: another 1.1e-3); Q, K and V enter
the MFMAs exactly (FP8 values are exact in both 16-bit types), fp32 accumulation and the online softmax's
rescales add ~1e-6. In quadrature ~1.6e-3 at worst (measured 1.7e-3 to 2.0e-3): 5e-3 leaves 2.5x.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
import reference
import torch
from cases import FEATURES, GEOMETRIES, GPU_REL_L2, alibi_slopes, arch_params, gpu_tolerance_ok, make_varlen
from hal.kernelpacks.rocm import build, codeobj, emulator, kernels, ops, pack, testing

import hal
from hal import dispatch, registry
from hal import ops as hal_ops
from hal.pack import Availability
from hal.targets import parse

CSRC = str(pathlib.Path(__file__).resolve().parents[1] / "packs" / "rocm" / "csrc")
ARCHS = kernels.DEFAULT_ARCHS
MAX_VGPRS = 256    # 512 per SIMD lane / 2 waves
MAX_LDS = 32768    # 64 KiB per CU / 2 workgroups


def prefill_lds(d: int) -> int:
    """PrefillLds<D>: a step's K rows (stride D + 4) and V rows (stride D + 8), 16-bit elements."""
    n = kernels.prefill_step(d)
    return n * (d + 4) * 2 + n * (d + 8) * 2


# ---------------------------------------------------------------------------------------------------
# code objects

@pytest.fixture(scope="module")
def built() -> pathlib.Path:
    return testing.built_or_skip(CSRC)


@pytest.fixture(scope="module")
def objects(built) -> dict[str, codeobj.CodeObject]:
    return {arch: codeobj.read(built / arch / build.PREFILL_CODE_OBJECT) for arch in ARCHS}


@pytest.fixture(scope="module")
def disasm(built) -> dict[str, dict[str, str]]:
    return testing.disassembly_or_skip(built, ARCHS, build.PREFILL_CODE_OBJECT)


def _parts(name: str) -> tuple[str, str, int]:
    m = re.fullmatch(r"hal_pa_prefill_(f16|bf16)_(\w+)_d(\d+)", name)
    return m.group(1), m.group(2), int(m.group(3))


@pytest.mark.parametrize("arch", ARCHS)
def test_code_object_holds_the_contracted_kernels(objects, arch):
    co = objects[arch]
    assert co.arch == arch
    assert sorted(co.kernels) == kernels.prefill_kernel_names(arch)
    assert all(kernels.code_object(n) == build.PREFILL_CODE_OBJECT for n in co.kernels)
    for k in co.kernels.values():
        assert k.wavefront_size == 64 and k.max_flat_workgroup_size == kernels.THREADS, k.name


@pytest.mark.parametrize("arch", ARCHS)
def test_mfma_types_and_one_step_loop(disasm, arch):
    """S in the query's type, P V in the PV type; the step loop compiled once: (4096 / D / 16) subtiles x
    D / 16 chunks = 16 MFMAs for S and 16 for P V whatever D, and 2 barriers a step."""
    for name, text in disasm[arch].items():
        q, cache, d = _parts(name)
        mfma = re.findall(r"v_mfma_f32_(\w+)", text)
        types = {re.sub(r"^16x16x16_?", "", m).removesuffix("_1k") for m in mfma}
        pv = cache if cache in ("f16", "bf16") else "f16"
        assert types == {q, pv}, f"{arch} {name}: MFMA types {types}"
        assert all(m.startswith("16x16x16") for m in mfma) and len(mfma) == 32, f"{arch} {name}: {len(mfma)}"
        assert text.count("s_barrier") == 2, f"{arch} {name}: two barriers a step"


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_conversions_only_in_hardware_on_gfx942(disasm, arch):
    hw = arch in kernels.HW_FP8
    for name, text in disasm[arch].items():
        cvts = set(re.findall(r"v_cvt_(?:pk_)?(?:f32_fp8|f32_bf8|fp8_f32|bf8_f32|sr_fp8_f32|sr_bf8_f32)", text))
        enc = _parts(name)[1]
        if not hw or enc not in kernels.FNUZ:
            assert not cvts, f"{arch} {name} has FP8 conversion instructions {cvts}"
            continue
        assert cvts == {f"v_cvt_pk_f32_{ {'e4m3fnuz': 'fp8', 'e5m2fnuz': 'bf8'}[enc]}"}, f"{name}: {cvts}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_scratch_and_occupancy_budget(objects, built, arch):
    """2 waves per SIMD chosen (a 16-row x D O tile, D/4 VGPRs a lane, and Q's D/8 in registers, an 8 KiB
    K + V step in LDS): <= 256 VGPRs + AGPRs and the LDS of PrefillLds; D <= 128 reach 3 (LDS-bound at
    ~17 KiB a workgroup), D = 256 2 (registers). The occupancy from the metadata must equal the compiler's."""
    info = json.loads((built / build.BUILD_INFO).read_text())["archs"][arch]
    assert build.PREFILL_CODE_OBJECT in info["code_objects"]
    for name, k in objects[arch].kernels.items():
        assert k.scratch == 0 and k.vgpr_spill == 0 and k.sgpr_spill == 0, f"{name} spills: {k}"
        d = _parts(name)[2]
        assert k.vgpr <= MAX_VGPRS and k.lds == prefill_lds(d) <= MAX_LDS, f"{name}: {k}"
        occ = k.occupancy()
        assert info["kernels"][name]["compiler_occupancy"] == occ["waves_per_simd"], name
        assert occ["waves_per_simd"] >= 2, f"{name}: {occ}"


@pytest.mark.parametrize("arch", ARCHS)
def test_kernarg_layout_matches_the_launcher(objects, arch):
    assert testing.kernarg_mismatches(objects[arch]) == []


# ---------------------------------------------------------------------------------------------------
# emulation

def _emulations(arch: str) -> tuple[emulator.Emulator, emulator.Emulator]:
    """(prefill, decode) emulation libraries of one arch: a mixed call launches kernels of both."""
    try:
        return testing.prefill_emulation(CSRC, arch), testing.emulation(CSRC, arch)
    except build.BuildError:
        if testing.compiler_missing():
            pytest.skip(testing.compiler_missing())
        raise


@pytest.fixture(scope="module", params=arch_params(ARCHS))
def sims(request):
    return _emulations(request.param)


def rocm_varlen(sims, case, *, key_cache=None, value_cache=None, schedule=0, seed=0):
    """The rocm pack's paged_attention on the emulation, through hal's validation and the pack's ops code."""
    kc = case.key_cache if key_cache is None else key_cache
    vc = case.value_cache if value_cache is None else value_cache
    out = torch.full_like(case.query, float("nan"))
    call = hal_ops.prepare("paged_attention", query=case.query, key_cache=kc, value_cache=vc,
                           block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=case.k_scale,
                           v_scale=case.v_scale, query_start_loc=case.query_start_loc, causal=case.causal, out=out,
                           **case.kwargs)
    be = emulator.EmulatorBackend(sims[0], schedule, seed, more=(sims[1],))
    ops.paged_attention(be, call)
    return out, be


def check(sims, case, **kw):
    """rocm (emulated) vs the float64 reference and vs the emu pack on the same bytes."""
    out, be = rocm_varlen(sims, case, **kw)
    ok, msg = gpu_tolerance_ok(out, case.reference())
    assert ok, f"{sims[0].arch} vs float64: {msg} (launches {be.launches})"
    emu = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                              k_scale=case.k_scale, v_scale=case.v_scale, query_start_loc=case.query_start_loc,
                              causal=case.causal, pack="emu", **case.kwargs)
    rel = reference.relative_l2(out.double().numpy(), emu.double().numpy())
    assert rel <= GPU_REL_L2, f"{sims[0].arch} vs emu pack: relative L2 {rel:.3g} (launches {be.launches})"
    return out, be


def _native_fp8(arch: str) -> torch.dtype:
    return torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn


def _kinds(be) -> list[str]:
    return [kernels.family(k) for k, _ in be.launches]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_geometries(sims, geometry):
    """Prefill, chunked prefill, a mixed batch (empty, one-token and long sequences together),
    speculative rows, decode only: the prefill kernel takes the multi-token sequences, the decode kernel
    (and its merge for split contexts) the one-token ones, in one call."""
    for i, cache in enumerate((torch.bfloat16, _native_fp8(sims[0].arch))):
        case = make_varlen(*GEOMETRIES[geometry], cache_dtype=cache, head_size=128, seed=20 + i)
        _, be = check(sims, case)
        kinds = _kinds(be)
        assert ("pa_prefill" in kinds) == (max(GEOMETRIES[geometry][1]) > 1) and "pa_decode" in kinds, be.launches


@pytest.mark.parametrize("arch", arch_params(ARCHS))
def test_every_declared_cache_and_query_dtype(arch):
    sims = _emulations(arch)
    caches = sorted(pack.supports_for(arch)["paged_attention"].cache_dtypes, key=str)
    for i, cache in enumerate(caches):
        for q in ([cache] if cache in pack.HALF else sorted(pack.HALF, key=str)):
            check(sims, make_varlen([40, 23, 1], [17, 23, 1], cache_dtype=cache, query_dtype=q, seed=30 + i))


@pytest.mark.parametrize("head_size", kernels.HEAD_SIZES)
def test_head_sizes(sims, head_size):
    check(sims, make_varlen([150, 70], [150, 33], head_size=head_size, cache_dtype=_native_fp8(sims[0].arch),
                            seed=head_size))


@pytest.mark.parametrize("block_size", pack.BLOCK_SIZES)
def test_block_sizes(block_size):
    sims = _emulations("gfx942")
    check(sims, make_varlen([70, 3, 129], [70, 3, 40], block_size=block_size, cache_dtype=torch.float8_e5m2fnuz,
                            seed=block_size))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1), (12, 4), (16, 1), (17, 1), (34, 2)],
                         ids=lambda x: str(x))
def test_gqa_ratios(heads, kv_heads):
    """GQA 1 to 17: row tiles of 64 rows straddle tokens (64 is no multiple of 3, 17); a group of 17 is
    more than one decode tile."""
    sims = _emulations("gfx942")
    check(sims, make_varlen([90, 40, 1], [90, 11, 1], num_heads=heads, num_kv_heads=kv_heads,
                            cache_dtype=torch.float8_e4m3fnuz, seed=heads))


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features_with_per_head_scales(sims, feature):
    """ALiBi, soft-cap, windows 19 and 1, all together; per-head scales; every slot before a row's window
    poisoned (the kernel must start a workgroup's keys at its first row's window)."""
    check(sims, make_varlen(*GEOMETRIES["mixed"], cache_dtype=_native_fp8(sims[0].arch), per_head_scales=True,
                            seed=6, **FEATURES[feature]))


def test_not_causal(sims):
    check(sims, make_varlen([60, 33, 1], [20, 33, 1], causal=False, cache_dtype=torch.bfloat16, seed=7))


def _nhd(case):
    views = []
    for c in (case.key_cache, case.value_cache):
        nhd = c.permute(0, 2, 1, 3).contiguous()   # the engine's storage [blocks, block_size, kv_heads, d]
        views.append(nhd.permute(0, 2, 1, 3))      # what it passes: strided, not copied
    assert views[0].stride(2) == views[0].shape[1] * views[0].shape[3]
    return views


@pytest.mark.parametrize("geometry", ["mixed", "decode"])
def test_nhd_cache_views_in_the_prefill_and_decode_kernels(sims, geometry):
    """An NHD cache passed as its permute(0, 2, 1, 3) view: every kernel reads the rows through the
    block, head and token strides; the same bits as the HND cache holding the same values."""
    case = make_varlen(*GEOMETRIES[geometry], num_kv_heads=4, cache_dtype=_native_fp8(sims[0].arch), seed=8)
    kc, vc = _nhd(case)
    hal_call = hal_ops.prepare("paged_attention", query=case.query, key_cache=kc, value_cache=vc,
                               block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=case.k_scale,
                               v_scale=case.v_scale, query_start_loc=case.query_start_loc)
    assert "strided_cache" in hal_call.call_key.features
    dense, _ = check(sims, case)
    strided, be = rocm_varlen(sims, case, key_cache=kc, value_cache=vc)
    assert torch.equal(strided, dense), be.launches


def test_decode_only_calls_read_nhd_views():
    """Plain decode (no query_start_loc) over an NHD view: part 3 of the rocm issue for the decode kernel."""
    sims = _emulations("gfx942")
    case = make_varlen([1, 300, 77], [1, 1, 1], num_kv_heads=2, cache_dtype=torch.float8_e4m3fnuz, seed=9)
    kc, vc = _nhd(case)
    out = torch.full_like(case.query, float("nan"))
    call = hal_ops.prepare("paged_attention", query=case.query, key_cache=kc, value_cache=vc,
                           block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=case.k_scale,
                           v_scale=case.v_scale, out=out)
    be = emulator.EmulatorBackend(sims[1])
    ops.paged_attention(be, call)
    ok, msg = gpu_tolerance_ok(out, case.reference())
    assert ok and "pa_prefill" not in _kinds(be), msg


@pytest.mark.parametrize("schedule", [1, 2])
def test_work_item_order_does_not_change_a_bit(schedule):
    """Reversed and shuffled work-item orders (a missing barrier shows as a difference)."""
    sims = _emulations("gfx942")
    case = make_varlen([130, 9, 64], [130, 9, 1], cache_dtype=torch.float8_e4m3fnuz, seed=10)
    base, _ = rocm_varlen(sims, case)
    other, _ = rocm_varlen(sims, case, schedule=schedule, seed=3)
    assert torch.equal(base, other)


@pytest.mark.slow
def test_64k_token_context():
    """A 40-token chunk at the end of a 65536-token context (1024 steps of the d64 kernel; block offsets
    past 2^24 elements) next to a decode row over the same context."""
    sims = _emulations("gfx942")
    check(sims, make_varlen([65536, 65536], [40, 1], num_heads=1, num_kv_heads=1, head_size=64, block_size=256,
                            cache_dtype=torch.float8_e4m3fnuz, extra_blocks=1, seed=11))


@pytest.mark.slow
def test_64k_token_prefill_with_a_window():
    """A whole 65536-token prompt in one call (65536 query rows, 1024 row tiles), kept to emulation
    size by a 64-token sliding window: every row tile stages only its rows' keys, and row offsets pass
    2^16 tokens."""
    sims = _emulations("gfx942")
    check(sims, make_varlen([65536], [65536], num_heads=1, num_kv_heads=1, head_size=64, block_size=256,
                            cache_dtype=torch.float8_e4m3fnuz, extra_blocks=1, sliding_window=64, seed=16))


def test_alibi_slopes_of_the_query_heads(sims):
    """ALiBi's slope is the query head's (kv head x G + g), not the row's."""
    check(sims, make_varlen([50, 20], [50, 20], num_heads=12, num_kv_heads=3, cache_dtype=torch.bfloat16,
                            alibi_slopes=alibi_slopes(12), seed=12))


# ---------------------------------------------------------------------------------------------------
# dispatch

class _AvailableRocm(pack.RocmPack):
    def _probe(self):
        return Availability(True, (), {})


def test_hal_target_gfx942_names_the_prefill_kernels_and_falls_back_only_for_the_gpu(monkeypatch, built):
    monkeypatch.setenv("HAL_TARGET", "gfx942")
    rocm = pack.RocmPack(built)
    emu = registry.by_name("emu")
    monkeypatch.setattr(registry, "packs", lambda: (rocm, emu))
    why = rocm.availability.reasons
    assert len(why) == 1 and ("not a ROCm build" in why[0] or "sees no AMD GPU" in why[0]), why
    case = make_varlen(*GEOMETRIES["mixed"], cache_dtype=torch.float8_e4m3fnuz, seed=13)
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens, k_scale=case.k_scale, v_scale=case.v_scale,
                query_start_loc=case.query_start_loc)
    d = hal.explain(**args)
    text = d.text()
    assert "`rocm` is not available here" in text and "`emu` selected (fallback)" in text, text
    assert [v.reasons for v in d.verdicts if v.pack == "rocm"] == [why]
    with pytest.warns(hal.FallbackWarning, match=r"falls back .*rocm:"):
        hal.paged_attention(**args)
    # where the pack can run (an MI300) the declaration admits the multi-token call
    monkeypatch.setattr(registry, "packs", lambda: (_AvailableRocm(built), emu))
    key = dataclasses.replace(hal_ops.prepare("paged_attention", **args).call_key, device_type="cuda")
    assert "varlen" in key.features
    dec = dispatch.decide(key, parse("gfx942"))
    assert dec.pack.NAME == "rocm" and not dec.fallback, dec.text()
    co = codeobj.read(built / "gfx942" / build.PREFILL_CODE_OBJECT)
    assert kernels.prefill_name("bf16", "e4m3fnuz", 64) in co.kernels


def test_misaligned_cache_is_an_error_naming_it():
    sims = _emulations("gfx942")
    case = make_varlen([20], [20], cache_dtype=torch.bfloat16, seed=14)
    raw = torch.empty(case.key_cache.numel() + 8, dtype=torch.bfloat16)
    kc = raw[4:4 + case.key_cache.numel()].view(case.key_cache.shape).copy_(case.key_cache)
    with pytest.raises(ValueError, match="key_cache must start on a 16-byte boundary"):
        rocm_varlen(sims, case, key_cache=kc)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_kv_writes_nhd_views_as_emu_does(arch):
    """cache_kv into an NHD cache's HND view: the same bytes as the emu pack writes through the view."""
    from cases import cache_write_call
    sims = _emulations(arch)
    gen = torch.Generator().manual_seed(15)
    nb, hkv, bs, d, t = 5, 3, 8, 64, 30
    cache = _native_fp8(arch)
    key, value = (torch.randn(t, hkv, d, generator=gen) * 3 for _ in range(2))
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(torch.int64)
    got = []
    for who in ("rocm", "emu"):
        nhd = [torch.full((nb, bs, hkv, d), 0x55, dtype=torch.uint8).view(cache) for _ in range(2)]
        kc, vc = (c.permute(0, 2, 1, 3) for c in nhd)
        if who == "rocm":
            ops.cache_kv(emulator.EmulatorBackend(sims[1]), cache_write_call(key, value, kc, vc, slots, 0.02, 0.03))
        else:
            hal.cache_kv(key, value, kc, vc, slots, k_scale=0.02, v_scale=0.03, pack="emu")
        got.append([c.view(torch.uint8).clone() for c in nhd])
    assert all(torch.equal(a, b) for a, b in zip(*got))
    assert not torch.equal(got[0][0], torch.full_like(got[0][0], 0x55))
