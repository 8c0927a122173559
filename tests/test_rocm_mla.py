"""The rocm pack's MLA decode and cache_mla (packs/rocm/csrc/mla_decode.h, mla_reduce.h, cache_rows.h: the
code object hal_rocm_mla.hsaco), proven without AMD hardware as the paged decode kernels are:

* **Code objects** (gfx90a and gfx942, compiled by the pack's own build; skipped with the reason where no
  clang has the AMDGPU target): MFMA 16x16x16 of exactly the expected types in every decode kernel; the
  fnuz FP8 conversions (v_cvt_pk_f32_fp8/_bf8 in decode, v_cvt_pk_fp8/bf8_f32 in the writer) in gfx942's
  fnuz kernels and no FP8 instruction anywhere else, none at all on gfx90a; zero scratch; registers and
  LDS within the budget of the occupancy chosen (decode: 2 waves per SIMD, LDS-bound; merge and writer:
  >= 4) and that occupancy equal to the compiler's; the argument layout in the metadata equal to what the
  launcher packs.
* **Emulation**: the same sources under the wave64 CPU emulation (both flavours), through the pack's own
  ops code and argument packing, against the emu pack on the same bytes and against the float64 reference
  (tests/reference.py, FP8 via ml_dtypes). Data as in test_emu_mla: fresh random values, every slot no row
  reads poisoned with NaN bytes, outputs poisoned with NaN.
* **Dispatch**: HAL_TARGET=gfx942 on a CPU machine names the rocm pack's MLA kernels and falls back to emu
  only because no AMD GPU is present.

Tolerance: relative L2 <= 5e-3 (cases.GPU_REL_L2) against both. The arithmetic: the kernel rounds each
probability to the MFMA's 16-bit type before P V (bf16 for a bf16 latent: <= 2^-9 relative a weight,
uniform, so ~2^-9/sqrt(3) = 1.1e-3 relative L2 in the output; f16 for f16 and FP8 latents: 1.4e-4); the
output is rounded to the query's type (bf16: another 1.1e-3; f16: 1.4e-4); fp32 accumulation of 36 MFMAs
of 16 products and the online softmax's rescales add ~1e-6; a bf16 query against an FP8 latent is moved
into f16 by a power of two, exact for every element above the row's absmax times 2^-32. In quadrature the
worst case (bf16 P and bf16 output) is ~1.6e-3 (measured 1.7e-3 to 2.0e-3): 5e-3 leaves 2.5x.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
import reference
import torch
from cases import FP8, GPU_REL_L2, arch_params, gpu_tolerance_ok
from hal.kernelpacks.rocm import build, codeobj, emulator, kernels, ops, pack, testing
from test_emu_mla import make_mla

import hal
from hal import dispatch, fp8, registry
from hal import ops as hal_ops
from hal.pack import Availability, CallKey
from hal.targets import parse

CSRC = str(pathlib.Path(__file__).resolve().parents[1] / "packs" / "rocm" / "csrc")
ARCHS = kernels.DEFAULT_ARCHS
DECODE_MAX_VGPRS = 256    # 512 per SIMD lane / 2 waves
DECODE_MAX_LDS = 32768    # 64 KiB per CU / 2 workgroups
MLA_LDS = 16 * (512 + 64 + 8) * 2 + 4 * 64 * 16   # MlaLds: a 16-token [rope | latent | pad] tile + partial S^T
OTHER_MAX_VGPRS = 128     # merge and writer: 4 waves per SIMD, as hal_rocm.hsaco's kernels
OTHER_MAX_LDS = 16384


# ---------------------------------------------------------------------------------------------------
# code objects

@pytest.fixture(scope="module")
def built() -> pathlib.Path:
    return testing.built_or_skip(CSRC)


@pytest.fixture(scope="module")
def objects(built) -> dict[str, codeobj.CodeObject]:
    return {arch: codeobj.read(built / arch / build.MLA_CODE_OBJECT) for arch in ARCHS}


@pytest.fixture(scope="module")
def disasm(built) -> dict[str, dict[str, str]]:
    """arch -> MLA kernel -> its disassembly."""
    return testing.disassembly_or_skip(built, ARCHS, build.MLA_CODE_OBJECT)


def _decode_parts(name: str) -> tuple[str, str, int]:
    m = re.fullmatch(r"hal_mla_decode_(f16|bf16)_(\w+)_r(\d+)", name)
    return m.group(1), m.group(2), int(m.group(3))


@pytest.mark.parametrize("arch", ARCHS)
def test_code_object_holds_the_contracted_kernels(objects, arch):
    co = objects[arch]
    assert co.arch == arch
    assert sorted(co.kernels) == kernels.mla_kernel_names(arch)
    assert all(kernels.code_object(n) == build.MLA_CODE_OBJECT for n in co.kernels)
    for k in co.kernels.values():
        assert k.wavefront_size == 64 and k.max_flat_workgroup_size == kernels.THREADS, k.name


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_mfma_types_and_one_step_loop(disasm, arch):
    """Latent chunks and P V in the latent's MFMA type (its own for 16-bit, f16 for FP8), the rope chunks in
    the query's; the step loop compiled once: 9 S + 8 PV MFMAs a wave for 16 rows, 18 + 16 for 32, plus
    the rope chunks' four again in wave 0's branch."""
    for name, text in disasm[arch].items():
        mfma = re.findall(r"v_mfma_f32_(\w+)", text)
        if not name.startswith("hal_mla_decode_"):
            assert not mfma, f"{arch} {name}: {mfma}"
            continue
        q, latent, rows = _decode_parts(name)
        types = {re.sub(r"^16x16x16_?", "", m).removesuffix("_1k") for m in mfma}
        t = latent if latent in ("f16", "bf16") else "f16"
        assert types == {q, t}, f"{arch} {name}: MFMA types {types}"
        assert all(m.startswith("16x16x16") for m in mfma), f"{arch} {name}: {set(mfma)}"
        want = {16: 9 + 8, 32: 18 + 16}[rows] + 4
        assert len(mfma) == want, f"{arch} {name}: {len(mfma)} MFMAs"
        assert text.count("s_barrier") == 3, f"{arch} {name}: three barriers a step"


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_conversions_only_in_hardware_on_gfx942(disasm, arch):
    hw = arch in kernels.HW_FP8
    for name, text in disasm[arch].items():
        cvts = set(re.findall(r"v_cvt_(?:pk_)?(?:f32_fp8|f32_bf8|fp8_f32|bf8_f32|sr_fp8_f32|sr_bf8_f32)", text))
        enc = None
        if name.startswith("hal_mla_decode_"):
            enc = _decode_parts(name)[1]
        elif name.startswith("hal_cache_rows_"):
            enc = name.rsplit("_", 1)[-1]
        if not hw or enc not in kernels.FNUZ:
            assert not cvts, f"{arch} {name} has FP8 conversion instructions {cvts}"
            continue
        want = {"e4m3fnuz": "fp8", "e5m2fnuz": "bf8"}[enc]
        expect = f"v_cvt_pk_f32_{want}" if name.startswith("hal_mla_decode_") else f"v_cvt_pk_{want}_f32"
        assert cvts == {expect}, f"{name}: {cvts}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_scratch_and_occupancy_budget(objects, built, arch):
    """Decode: 2 waves per SIMD chosen (it holds 16 rows x C columns of O and the rows' Q chunks in
    registers, a 16-token tile in LDS): <= 256 VGPRs+AGPRs, <= 32 KiB LDS; its 22784 B of LDS bound it at
    exactly 2 (the 32-row kernels' 200-odd VGPRs would too). The merge and the writer keep >= 4, as the
    paged decode kernels. The occupancy from the metadata must equal the compiler's own (its
    kernel-resource-usage remark)."""
    info = json.loads((built / build.BUILD_INFO).read_text())["archs"][arch]
    assert build.MLA_CODE_OBJECT in info["code_objects"]
    for name, k in objects[arch].kernels.items():
        assert k.scratch == 0 and k.vgpr_spill == 0 and k.sgpr_spill == 0, f"{name} spills: {k}"
        occ = k.occupancy()
        assert info["kernels"][name]["compiler_occupancy"] == occ["waves_per_simd"], name
        if name.startswith("hal_mla_decode_"):
            assert k.vgpr <= DECODE_MAX_VGPRS and k.lds == MLA_LDS <= DECODE_MAX_LDS, f"{name}: {k}"
            assert occ["waves_per_simd"] == 2 and "lds" in occ["limited_by"], f"{name}: {occ}"
        else:
            assert k.vgpr <= OTHER_MAX_VGPRS and k.lds <= OTHER_MAX_LDS, f"{name}: {k}"
            assert occ["waves_per_simd"] >= 4, f"{name}: {occ}"


@pytest.mark.parametrize("arch", ARCHS)
def test_kernarg_layout_matches_the_launcher(objects, arch):
    assert testing.kernarg_mismatches(objects[arch]) == []


# ---------------------------------------------------------------------------------------------------
# emulation

def _emulation(arch: str) -> emulator.Emulator:
    try:
        return testing.mla_emulation(CSRC, arch)
    except build.BuildError:
        if testing.compiler_missing():
            pytest.skip(testing.compiler_missing())
        raise


@pytest.fixture(scope="module", params=arch_params(ARCHS))
def sim(request) -> emulator.Emulator:
    return _emulation(request.param)


_CALL_KEYS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "scale", "ckv_scale",
              "kpe_scale")


def rocm_mla(em, case, *, multi=True, out=None, schedule=0, seed=0, **kw):
    """The rocm pack's mla_decode on the emulation, through hal's validation and the pack's ops code."""
    out = torch.full(case["q_nope"].shape, float("nan"), dtype=case["q_nope"].dtype) if out is None else out
    call = hal_ops.prepare("mla_decode", **{k: case[k] for k in _CALL_KEYS}, out=out,
                           query_start_loc=case["query_start_loc"] if multi else None, **kw)
    be = emulator.EmulatorBackend(em, schedule, seed)
    ops.mla_decode(be, call)
    return out, be


def _ref(case, multi=True):
    return reference.mla_decode(case["q_nope"], case["q_pe"], case["ckv_cache"], case["kpe_cache"],
                                case["block_tables"], case["seq_lens"], case["query_start_loc"] if multi else None,
                                scale=case["scale"], ckv_scale=case["ckv_scale"], kpe_scale=case["kpe_scale"])


def check(em, case, multi=True, **kw):
    """rocm (emulated) vs the float64 reference and vs the emu pack on the same bytes."""
    out, be = rocm_mla(em, case, multi=multi, **kw)
    ok, msg = gpu_tolerance_ok(out, _ref(case, multi))
    assert ok, f"{em.arch} vs float64: {msg} (launches {be.launches})"
    emu = hal.mla_decode(*(case[k] for k in _CALL_KEYS[:6]), scale=case["scale"], ckv_scale=case["ckv_scale"],
                         kpe_scale=case["kpe_scale"], query_start_loc=case["query_start_loc"] if multi else None,
                         pack="emu", **kw)
    rel = reference.relative_l2(out.double().numpy(), emu.double().numpy())
    assert rel <= GPU_REL_L2, f"{em.arch} vs emu pack: relative L2 {rel:.3g} (launches {be.launches})"
    return out, be


def _query_for(cache):
    return cache if cache in pack.HALF else torch.bfloat16


def _latents(arch):
    return sorted(pack.supports_for(arch)["mla_decode"].cache_dtypes, key=str)


@pytest.mark.parametrize("arch", arch_params(ARCHS))
def test_every_declared_latent_and_query(arch):
    """Each (query, latent) kernel of the arch: 16-bit latents with their own query dtype, every FP8
    encoding with both (a bf16 query runs the f16 rescale path); an empty sequence, one token, odd lengths."""
    em = _emulation(arch)
    for i, latent in enumerate(_latents(arch)):
        for q in ([latent] if latent in pack.HALF else sorted(pack.HALF, key=str)):
            case = make_mla([1, 0, 37, 130], heads=16, ckv_dtype=latent, kpe_dtype=q, query_dtype=q, seed=i)
            out, be = check(em, case, multi=False)
            assert be.launches == [(kernels.mla_decode_name(ops.TYPE_NAMES[q], ops.TYPE_NAMES[latent], 16),
                                    (4, 1, 1))]
            assert bool((out[1] == 0).all())


@pytest.mark.parametrize("heads,tiles", [(1, 1), (16, 1), (20, 1), (128, 4)])
def test_head_counts(sim, heads, tiles):
    """<= 16 rows a sequence: one 16-row workgroup; more: 32-row workgroups (128 heads: four)."""
    cache = torch.float8_e4m3fnuz if sim.arch == "gfx942" else torch.float8_e4m3fn
    _, be = check(sim, make_mla([33, 5], heads=heads, ckv_dtype=cache, seed=heads), multi=False)
    rows = 16 if heads <= 16 else 32
    assert be.launches[0] == (kernels.mla_decode_name("bf16", ops.TYPE_NAMES[cache], rows), (2, tiles, 1))


@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 256])
def test_block_sizes(block_size):
    """The block is looked up per token: blocks smaller than a step, equal, and larger."""
    em = _emulation("gfx942")
    check(em, make_mla([3, 2 * block_size + 5, 300], heads=16, ckv_dtype=torch.float8_e5m2fnuz,
                       kpe_dtype=torch.float16, query_dtype=torch.float16, block_size=block_size, seed=block_size),
          multi=False)


@pytest.mark.parametrize("heads,q_lens", [(16, [1, 2, 3, 4]), (16, [4, 4, 1]), (128, [4, 1])], ids=str)
def test_speculative_rows_are_causal(sim, heads, q_lens):
    """1-4 query tokens a sequence (query_start_loc): rows = tokens x heads, each causal at L - q + t."""
    lens = [50, 200, 7, 64][:len(q_lens)] if heads == 16 else [40, 9]
    cache = torch.bfloat16 if sim.arch == "gfx942" else torch.float8_e5m2
    _, be = check(sim, make_mla(lens, q_lens, heads=heads, ckv_dtype=cache, block_size=64, seed=len(q_lens)))
    assert be.launches[0][1][1] == -(-max(q_lens) * heads // 32)


def test_empty_sequences_give_zeros():
    em = _emulation("gfx942")
    case = make_mla([0, 40, 0], [0, 2, 0], heads=16, ckv_dtype=torch.float8_e4m3fnuz, seed=5)
    out, _ = check(em, case)
    assert out.shape[0] == 2
    out, _ = check(em, make_mla([0, 0], heads=16, ckv_dtype=torch.float8_e4m3fnuz, seed=6), multi=False)
    assert bool((out == 0).all())


def _few_cus(monkeypatch, min_partition=16, compute_units=304):
    """A split plan with short partitions, so the merge runs on small cases."""
    real = ops.tuning.mla_decode
    monkeypatch.setattr(ops.tuning, "mla_decode", lambda arch: {**real(arch), "min_partition": min_partition,
                                                                "compute_units": compute_units})


@pytest.mark.parametrize("q_lens", [None, [3, 1, 0, 2]], ids=("decode", "speculative"))
def test_split_context_and_merge(sim, monkeypatch, q_lens):
    """Forced split-K (partitions of 32 tokens: 22 of them), an empty sequence, partitions past a short
    sequence, and (speculative) a row whose causal limit ends where a partition starts: sequence 3's first
    row sees positions < 32, so partition 1 ([32, 33)) has no key for it (max = -inf, no partial)."""
    _few_cus(monkeypatch)
    cache = torch.float8_e4m3fnuz if sim.arch == "gfx942" else torch.float8_e4m3fn
    case = make_mla([700, 3, 0, 33], q_lens, heads=20, ckv_dtype=cache, seed=11)
    out, be = check(sim, case, multi=q_lens is not None)
    (_, grid), (red, rgrid) = be.launches
    assert grid[2] == 22 and red == kernels.mla_reduce_name("bf16") and rgrid == (20, out.shape[0], 1)


def test_natural_split_over_a_long_context():
    """Few rows over a long context split by the plan itself (3000 tokens, 1 head: 11 partitions of 288)."""
    em = _emulation("gfx90a")
    _, be = check(em, make_mla([3000], heads=1, ckv_dtype=torch.float8_e5m2, block_size=128, seed=12),
                  multi=False)
    assert be.launches[0][1] == (1, 1, 11) and len(be.launches) == 2


def test_combined_cache_views():
    """vLLM's layout: one [blocks, page, 576] bf16 allocation, ckv and kpe views of it (strided tokens)."""
    em = _emulation("gfx942")
    case = make_mla([100, 37], heads=20, ckv_dtype=torch.bfloat16, kpe_dtype=torch.bfloat16, combined=True,
                    block_size=64, seed=4)
    assert not case["ckv_cache"].is_contiguous()
    check(em, case, multi=False)


def test_fp8_latent_beside_bf16_rope_in_one_byte_buffer(sim):
    """One byte allocation a token: 512 FP8 latent bytes + 64 bf16 rotary values (640 B rows)."""
    cache = torch.float8_e4m3fnuz if sim.arch == "gfx942" else torch.float8_e4m3fn
    case = make_mla([90, 31], heads=16, ckv_dtype=cache, kpe_dtype=torch.bfloat16, block_size=16, seed=6)
    nb, bs = case["ckv_cache"].shape[:2]
    buf = torch.empty(nb, bs, 512 + 128, dtype=torch.uint8)
    buf[..., :512] = case["ckv_cache"].view(torch.uint8)
    buf[..., 512:] = case["kpe_cache"].view(torch.uint8)
    case["ckv_cache"] = buf[..., :512].view(cache)
    case["kpe_cache"] = buf[..., 512:].view(torch.bfloat16)
    check(sim, case, multi=False)


def test_nan_in_a_read_latent_reaches_only_its_rows():
    em = _emulation("gfx942")
    case = make_mla([40, 40], heads=16, ckv_dtype=torch.float8_e4m3fnuz, seed=8)
    blk = int(case["block_tables"][1, 1])                      # position 16..31 of sequence 1
    case["ckv_cache"].view(torch.uint8)[blk, 3, 100] = 0x80    # fnuz NaN in a latent that is read
    out, _ = rocm_mla(em, case, multi=False)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_interleavings_do_not_change_a_bit():
    """Work-items in order, reversed and shuffled between synchronisation points: a missing barrier would
    show as a difference (or as the NaN the LDS is poisoned with)."""
    em = _emulation("gfx942")
    case = make_mla([70, 17], [2, 1], heads=20, ckv_dtype=torch.float8_e4m3fnuz, seed=9)
    outs = [rocm_mla(em, case, schedule=s, seed=7)[0] for s in (0, 1, 2)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_scale_tensors_strided_query_and_output_slice():
    """Device-scale tensors, queries sliced from a wider projection, and an output slice of a larger buffer."""
    em = _emulation("gfx90a")
    case = make_mla([60, 12], heads=16, ckv_dtype=torch.float8_e5m2fnuz, seed=10)
    case["ckv_scale"] = torch.tensor(case["ckv_scale"], dtype=torch.float32)
    proj = torch.randn(2, 16, 512 + 64 + 128).to(torch.bfloat16)
    proj[..., :512], proj[..., 512:576] = case["q_nope"], case["q_pe"]
    case["q_nope"], case["q_pe"] = proj[..., :512], proj[..., 512:576]
    buf = torch.full((2, 32, 512), float("nan"), dtype=torch.bfloat16)
    out, _ = check(em, case, multi=False, out=buf[:, ::2])
    assert out.data_ptr() == buf.data_ptr() and bool(torch.isnan(buf[:, 1::2]).all())


def test_misaligned_latent_rows_are_refused():
    em = _emulation("gfx942")
    case = make_mla([20], heads=16, ckv_dtype=torch.float8_e4m3fnuz, seed=1)
    nb, bs, _ = case["ckv_cache"].shape
    buf = torch.empty(nb, bs, 520, dtype=torch.uint8)
    buf[..., 8:] = case["ckv_cache"].view(torch.uint8)
    case["ckv_cache"] = buf[..., 8:].view(torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="ckv_cache needs 16-byte aligned token rows"):
        rocm_mla(em, case, multi=False)


def test_emulated_lds_and_kernels_match_the_code_objects(objects):
    em = _emulation("gfx942")
    assert em.kernel_names() == kernels.mla_kernel_names("gfx942")
    assert all(em.kernarg_size(n) == kernels.kernarg_size(kernels.family(n)) for n in em.kernel_names())
    rocm_mla(em, make_mla([30], heads=16, ckv_dtype=torch.float8_e4m3fnuz, seed=2), multi=False)
    assert em.lds_bytes() == objects["gfx942"].kernels["hal_mla_decode_bf16_e4m3fnuz_r16"].lds == MLA_LDS


# ---------------------------------------------------------------------------------------------------
# cache_mla

def _write_both(em, kv_c, k_pe, caches, slots, cs, ps):
    """The rocm pack's cache_mla (emulated) and the emu pack's, each into fresh caches from ``caches()``."""
    got = {}
    for who in ("rocm", "emu"):
        c, p = caches()
        if who == "rocm":
            call = hal_ops.prepare("cache_mla", kv_c=kv_c, k_pe=k_pe, ckv_cache=c, kpe_cache=p, slot_mapping=slots,
                                   ckv_scale=cs, kpe_scale=ps)
            ops.cache_mla(emulator.EmulatorBackend(em), call)
        else:
            hal.cache_mla(kv_c, k_pe, c, p, slots, ckv_scale=cs, kpe_scale=ps, pack="emu")
        got[who] = (c, p)
    return got


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """FP8: the same bytes; 16-bit: the same values and NaNs (a NaN's payload is not specified)."""
    if a.dtype in FP8:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


@pytest.mark.parametrize("source", (torch.float16, torch.bfloat16, torch.float32), ids=str)
def test_cache_mla_bytes_equal_emu(sim, source):
    """Every declared cache encoding from every input type, into views of one combined cache and into
    separate caches (a bf16 rope beside the latent); skipped slots keep their bytes."""
    gen = torch.Generator().manual_seed(3)
    nb, bs, t = 4, 8, 9
    kv_c = (torch.randn(t, 512, generator=gen) * 3).to(source)
    k_pe = (torch.randn(t, 64, generator=gen) * 3).to(source)
    kv_c[0, :4] = torch.tensor([1e6, -1e6, float("nan"), 0.0]).to(source)
    slots = torch.tensor([3, 9, -1, 20, 31, 0, 12, 13, 30])
    for cache in sorted(pack.supports_for(sim.arch)["cache_mla"].cache_dtypes, key=str):
        is8 = cache in FP8
        cs, ps = (0.05, 0.02) if is8 else (None, None)

        def combined(cache=cache, is8=is8):
            kv = torch.full((nb, bs, 576), 7, dtype=torch.uint8).view(cache) if is8 else \
                torch.zeros(nb, bs, 576, dtype=cache)
            return kv[..., :512], kv[..., 512:]

        def separate(combined=combined):
            return combined()[0].contiguous(), torch.zeros(nb, bs, 64, dtype=torch.bfloat16)

        for caches, pscale in ((combined, ps), (separate, None)):
            got = _write_both(sim, kv_c, k_pe, caches, slots, cs, pscale)
            for a, b in zip(got["rocm"], got["emu"]):
                assert _same(a, b), f"{sim.arch} {source} -> {cache} ({a.dtype})"
        if is8:  # against the definition, and the skipped slots
            c = got["rocm"][0].reshape(nb * bs, 512)
            for i, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    assert torch.equal(c[slot].view(torch.uint8), fp8.encode_bytes(kv_c[i].float() / cs, cache))
            untouched = [s for s in range(nb * bs) if s not in set(slots.tolist())]
            assert bool((c[untouched].view(torch.uint8) == 7).all())


def test_cache_mla_fp8_edges_bit_exact(sim):
    """Saturation, ties, subnormals, signed zeros, inf and NaN against hal.fp8.encode_bytes, latent and
    rope rows; on gfx942 the hardware-instruction path under the emulation's least favourable reading of
    the ISA (no saturation, -0 kept), which the writer repairs."""
    from test_rocm_emulation import _edge_values
    for cache in sorted(pack.supports_for(sim.arch)["cache_mla"].cache_dtypes & set(FP8), key=str):
        vals = _edge_values(cache)
        t = -(-vals.numel() // 512)
        flat = vals.repeat(-(-t * 512 // vals.numel()))
        kv_c, k_pe = flat[:t * 512].view(t, 512), (-flat)[:t * 64].view(t, 64)
        ckv = torch.zeros(t, 1, 512, dtype=torch.uint8).view(cache)
        kpe = torch.zeros(t, 1, 64, dtype=torch.uint8).view(cache)
        call = hal_ops.prepare("cache_mla", kv_c=kv_c, k_pe=k_pe, ckv_cache=ckv, kpe_cache=kpe,
                               slot_mapping=torch.arange(t), ckv_scale=1.0, kpe_scale=1.0)
        ops.cache_mla(emulator.EmulatorBackend(sim), call)
        assert torch.equal(ckv.view(torch.uint8).reshape(-1), fp8.encode_bytes(kv_c.reshape(-1), cache)), cache
        assert torch.equal(kpe.view(torch.uint8).reshape(-1), fp8.encode_bytes(k_pe.reshape(-1), cache)), cache


# ---------------------------------------------------------------------------------------------------
# declaration and dispatch

def _mla_key(latent=torch.float8_e4m3fnuz, query=torch.bfloat16, rope=None, **kw):
    return CallKey("mla_decode", "cuda", query, latent, kw.pop("r", 512), kw.pop("block_size", 64), 128,
                   frozenset(kw.pop("features", ())), kw.pop("p", 64), rope or query)


def test_declaration_and_reasons():
    rocm = registry.by_name("rocm")
    for arch in ARCHS:
        s = pack.supports_for(arch)["mla_decode"]
        assert s.head_sizes == (512,) and s.rope_dims == (64,) and s.features == {"varlen", "strided_cache"}
        assert s.cache_dtypes == pack.supports_for(arch)["paged_attention"].cache_dtypes
        assert set(s.block_sizes) == {2 ** i for i in range(9)}
        w = pack.supports_for(arch)["cache_mla"]
        assert w.features == {"strided_cache", "fp8_rope"} and w.cache_dtypes == s.cache_dtypes
    t = parse("gfx942")
    assert rocm.reasons(_mla_key(features=("varlen", "strided_cache")), t) == []
    assert rocm.reasons(_mla_key(torch.float16, torch.float16, block_size=1), t) == []
    assert "fn_to_fnuz" in " ".join(rocm.reasons(_mla_key(torch.float8_e4m3fn), t))
    assert rocm.reasons(_mla_key(torch.float8_e4m3fn), parse("gfx90a")) == []
    assert any("same dtype" in r for r in rocm.reasons(_mla_key(torch.float16, torch.bfloat16), t))
    assert any("kpe_cache" in r for r in rocm.reasons(_mla_key(rope=torch.float16), t))
    assert any("fp8_rope" in r for r in rocm.reasons(_mla_key(rope=torch.float8_e4m3fnuz, features=("fp8_rope",)), t))
    assert any("rope_dim 32" in r for r in rocm.reasons(_mla_key(p=32), t))
    assert any("block_size 48" in r for r in rocm.reasons(_mla_key(block_size=48), t))
    w = CallKey("cache_mla", "cuda", torch.float32, torch.float8_e4m3fnuz, 512, 48, 1, frozenset({"strided_cache"}),
                64, torch.float8_e4m3fn)
    assert any(r.startswith("kpe_cache: ") and "fn_to_fnuz" in r for r in rocm.reasons(w, t))


class _AvailableRocm(pack.RocmPack):
    def _probe(self):
        return Availability(True, (), {})


def _mla_args(latent=torch.float8_e4m3fnuz):
    case = make_mla([40, 17], heads=16, ckv_dtype=latent, seed=3)
    return {k: case[k] for k in _CALL_KEYS}


def test_hal_target_gfx942_names_the_mla_kernels_and_falls_back_only_for_the_gpu(monkeypatch, built):
    """HAL_TARGET=gfx942 on this machine: the pack (with its code objects built) is unavailable only
    because torch sees no AMD GPU (not a ROCm build, or no device), so emu runs with that reason alone; on
    an MI300 the declaration admits the call and the plan names the code object's kernels."""
    monkeypatch.setenv("HAL_TARGET", "gfx942")
    rocm = pack.RocmPack(built)
    emu = registry.by_name("emu")
    monkeypatch.setattr(registry, "packs", lambda: (rocm, emu))
    why = rocm.availability.reasons
    assert len(why) == 1 and ("not a ROCm build" in why[0] or "sees no AMD GPU" in why[0]), why
    for op, args in (("mla_decode", _mla_args()),
                     ("cache_mla", {"kv_c": torch.zeros(3, 512), "k_pe": torch.zeros(3, 64),
                                    "ckv_cache": torch.zeros(2, 16, 576, dtype=torch.bfloat16)[..., :512],
                                    "kpe_cache": torch.zeros(2, 16, 576, dtype=torch.bfloat16)[..., 512:],
                                    "slot_mapping": torch.tensor([0, 1, 2])})):
        d = hal.explain(op=op, **args)
        text = d.text()
        assert "`rocm` is not available here" in text and "`emu` selected (fallback)" in text, text
        assert [v.reasons for v in d.verdicts if v.pack == "rocm"] == [why]
        with pytest.warns(hal.FallbackWarning, match=r"falls back .*rocm:"):
            getattr(hal, op)(**args)
    # the same call where the pack can run (an MI300): rocm serves it, with these kernels
    monkeypatch.setattr(registry, "packs", lambda: (_AvailableRocm(built), emu))
    for latent, q in ((torch.float8_e4m3fnuz, "bf16"), (torch.bfloat16, "bf16")):
        call = hal_ops.prepare("mla_decode", **_mla_args(latent))
        key = dataclasses.replace(call.call_key, device_type="cuda")
        d = dispatch.decide(key, parse("gfx942"))
        assert d.pack.NAME == "rocm" and not d.fallback, d.text()
        plan = ops.mla_plan("gfx942", None, 2, 16, 1, call.max_seq_len, q, ops.TYPE_NAMES[latent])
        co = codeobj.read(built / "gfx942" / build.MLA_CODE_OBJECT)
        assert plan.decode == f"hal_mla_decode_{q}_{ops.TYPE_NAMES[latent]}_r16" and plan.decode in co.kernels
    key = CallKey("cache_mla", "cuda", torch.float32, torch.bfloat16, 512, 16, 1, frozenset({"strided_cache"}), 64,
                  torch.bfloat16)
    assert dispatch.decide(key, parse("gfx942")).pack.NAME == "rocm"
    assert kernels.cache_rows_name("f32", "bf16") in codeobj.read(built / "gfx942" / build.MLA_CODE_OBJECT).kernels
