"""The rocm pack's kernels executed on the CPU: the same HIP sources compiled for the host against an
emulation of the device facilities they use (csrc/wave64_host.h: wave64 lanes as fibers, LDS, barriers,
ds_bpermute, MFMA 16x16x16 with the CDNA3 operand layouts, fnuz FP8 conversions), launched through
the pack's own ops code and argument packing, and compared with the emu pack on the same bytes (and
with the float64 reference). Both flavours run: gfx942 (hardware fnuz conversions, emulated) and
gfx90a (software FP8). This is what catches indexing, layout and reduction bugs that compiling cannot.

Tolerance: the project's bound for native GPU kernels (relative L2 <= 5e-3, cases.GPU_REL_L2): the
kernels round probabilities to 16 bits before the PV product, as vLLM's do.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch

import hal
import reference
from cases import (FP8, alibi_slopes, arch_params, attention_call, cache_write_call, gpu_tolerance_ok, make_case, nan_input_cases, nan_rows_ok, poison_unread,
                   read_slots)
from hal.kernelpacks.rocm import build, emulator, kernels, ops, pack, testing

CSRC = str(pathlib.Path(__file__).resolve().parents[1] / "packs" / "rocm" / "csrc")
ARCHS = ("gfx942", "gfx90a")


@pytest.fixture(scope="module", params=arch_params(ARCHS))
def sim(request) -> emulator.Emulator:
    """The CPU wave64 emulation of one arch ("sim": "emu" is the emu pack; module-scoped: each flavour is
    compiled once)."""
    return _emulation(request.param)


def _emulation(arch: str) -> emulator.Emulator:
    try:
        return testing.emulation(CSRC, arch)
    except build.BuildError as exc:
        if testing.compiler_missing():
            pytest.skip(testing.compiler_missing())
        raise exc


def _enc(dtype) -> str:
    return ops.TYPE_NAMES[dtype]


def declared_caches(arch: str) -> list[torch.dtype]:
    return sorted(pack.supports_for(arch)["paged_attention"].cache_dtypes, key=str)


def rocm_attention(em, case, *, schedule=0, seed=0, out=None, max_seq_len=None, **kw):
    out = case.poisoned_out() if out is None else out
    d = case.query.shape[-1]
    be = emulator.EmulatorBackend(em, schedule, seed)
    ops.paged_attention(be, attention_call(out, case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                        kw.get("scale", d ** -0.5), case.k_scale, case.v_scale, kw.get("alibi_slopes"),
                        kw.get("logits_soft_cap"), kw.get("sliding_window"), max_seq_len))
    return out, be


def check(em, case, **kw):
    """rocm (emulated) vs the emu pack on the same bytes, and vs the float64 reference."""
    out, be = rocm_attention(em, case, **{**case.kwargs, **kw})
    ref = case.reference()
    ok, msg = gpu_tolerance_ok(out, ref)
    assert ok, f"{em.arch} vs float64: {msg} (launches {be.launches})"
    emu_out = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                  k_scale=case.k_scale, v_scale=case.v_scale, pack="emu", **case.kwargs)
    rel = reference.relative_l2(out.double().numpy(), emu_out.double().numpy())
    assert rel <= 5e-3, f"{em.arch} vs emu pack: relative L2 {rel:.3g}"
    return out, be


LENS = [1, 0, 33, 16, 300, 127]  # single token, empty, odd, one block, two partitions


# ---------------------------------------------------------------------------------------------------
# paged attention

@pytest.mark.parametrize("arch", arch_params(ARCHS))
def test_every_declared_cache_and_query_dtype(arch):
    em = _emulation(arch)
    for cache in declared_caches(arch):
        queries = [cache] if cache in pack.HALF else sorted(pack.HALF, key=str)
        for q in queries:
            check(em, make_case(seq_lens=LENS, cache_dtype=cache, query_dtype=q, seed=hash(str(cache)) % 1000))


@pytest.mark.parametrize("head_size", kernels.HEAD_SIZES)
def test_head_sizes(sim, head_size):
    cache = torch.float8_e4m3fnuz if sim.arch == "gfx942" else torch.float8_e4m3fn
    check(sim, make_case(seq_lens=[5, 260, 64], head_size=head_size, cache_dtype=cache, query_dtype=torch.float16))
    check(sim, make_case(seq_lens=[77], head_size=head_size, cache_dtype=torch.bfloat16, query_dtype=torch.bfloat16))


@pytest.mark.parametrize("block_size", pack.BLOCK_SIZES)
def test_block_sizes(block_size):
    em = _emulation("gfx942")
    check(em, make_case(seq_lens=[1, 70, 513], block_size=block_size, cache_dtype=torch.float8_e5m2fnuz,
                        query_dtype=torch.float16, share_prefix=True))


@pytest.mark.parametrize("gqa", [1, 5, 16, 17, 40])
def test_gqa_ratios_and_tiles(gqa):
    """Up to 16 query heads share a KV head's MFMA tile; larger groups take several tiles."""
    em = _emulation("gfx942")
    out, be = check(em, make_case(seq_lens=[3, 200], num_heads=2 * gqa, num_kv_heads=2, head_size=64,
                                  cache_dtype=torch.float8_e4m3fnuz))
    assert be.launches[0][1][2] == 2 * math.ceil(gqa / 16)


def test_mqa_single_kv_head():
    check(_emulation("gfx90a"), make_case(seq_lens=[40, 9], num_heads=12, num_kv_heads=1,
                                          cache_dtype=torch.float8_e5m2))


def test_alibi(sim):
    cache = declared_caches(sim.arch)[-1]
    check(sim, make_case(seq_lens=LENS, cache_dtype=cache, alibi_slopes=alibi_slopes(8)))


def test_soft_cap(sim):
    # unit-variance logits times 8 (scale) so that a cap of 2.0 bends most of them
    check(sim, make_case(seq_lens=LENS, cache_dtype=torch.float8_e4m3fnuz, logits_soft_cap=2.0, scale=8.0))


@pytest.mark.parametrize("window", [1, 37, 256, 300, 600])
def test_sliding_window(sim, window):
    check(sim, make_case(seq_lens=[1, 40, 299, 700, 1000], cache_dtype=torch.bfloat16, sliding_window=window))


def test_per_head_and_tensor_scales(sim):
    cache = torch.float8_e5m2fnuz
    check(sim, make_case(seq_lens=LENS, cache_dtype=cache, per_head_scales=True))
    check(sim, make_case(seq_lens=LENS, cache_dtype=cache, scale_as_tensor=True))


def test_everything_at_once(sim):
    check(sim, make_case(seq_lens=[1, 0, 700, 263], num_heads=36, num_kv_heads=2, head_size=128, block_size=32,
                         cache_dtype=torch.float8_e4m3fnuz, query_dtype=torch.bfloat16, per_head_scales=True,
                         alibi_slopes=alibi_slopes(36), logits_soft_cap=30.0, sliding_window=500))


def test_all_empty_and_max_seq_len():
    em = _emulation("gfx942")
    case = make_case(seq_lens=[0, 0], cache_dtype=torch.float8_e4m3fnuz)
    out, _ = rocm_attention(em, case)
    assert bool((out == 0).all())
    case = make_case(seq_lens=[10, 600], cache_dtype=torch.float8_e4m3fnuz)
    out, be = rocm_attention(em, case, max_seq_len=1024)  # host bound above the real lengths: 4 partitions
    assert be.launches[0][1][1] == 4
    assert gpu_tolerance_ok(out, case.reference())[0]


@pytest.mark.parametrize("lens", ([37, 0, 21, 5], [600, 0, 300, 5]), ids=("one_partition", "partitions"))
def test_nan_inputs_give_nan_rows_not_zeros(sim, lens):
    """A NaN in the query, a read key or an ALiBi slope gives NaN rows, through one partition and
    through the reduce kernel; only an empty sequence gives zeros. Unread cache bytes are NaN/inf."""
    for where, (case, rows) in nan_input_cases(seq_lens=lens, cache_dtype=torch.float8_e4m3fnuz,
                                               query_dtype=torch.bfloat16).items():
        out, _ = rocm_attention(sim, case, **case.kwargs)
        ok, msg = nan_rows_ok(out, case, rows, gpu_tolerance_ok)
        assert ok, f"{sim.arch} {where}: {msg}"


def test_interleavings_do_not_change_a_bit():
    """Work-items run in order, reversed and shuffled between synchronisation points: a missing
    barrier would show as a difference (or as the NaN the LDS is poisoned with)."""
    em = _emulation("gfx942")
    case = make_case(seq_lens=[300, 17], num_heads=20, num_kv_heads=1, cache_dtype=torch.float8_e4m3fnuz)
    outs = [rocm_attention(em, case, schedule=s, seed=7)[0] for s in (0, 1, 2)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert gpu_tolerance_ok(outs[0], case.reference())[0]


def test_strided_query_output_and_combined_cache():
    """A query sliced from a fused QKV projection, an output slice, and K/V as views of one allocation."""
    em = _emulation("gfx90a")
    base = make_case(seq_lens=[50, 300], num_heads=4, num_kv_heads=2, cache_dtype=torch.float8_e4m3fn)
    nb, hkv, bs, d = base.key_cache.shape
    kv = torch.empty((nb, 2, hkv, bs, d), dtype=base.key_cache.dtype)
    kv[:, 0], kv[:, 1] = base.key_cache, base.value_cache
    qkv = torch.randn(2, 4 + 2 * hkv, d).to(torch.bfloat16)
    qkv[:, :4] = base.query
    out_buf = torch.full((2, 8, d), float("nan"), dtype=torch.bfloat16)
    case = make_case(seq_lens=[50, 300], num_heads=4, num_kv_heads=2, cache_dtype=torch.float8_e4m3fn)
    case.query, case.key_cache, case.value_cache = qkv[:, :4], kv[:, 0], kv[:, 1]
    out, _ = rocm_attention(em, case, out=out_buf[:, ::2])
    assert out.data_ptr() == out_buf.data_ptr()
    assert gpu_tolerance_ok(out, case.reference())[0]
    assert bool(torch.isnan(out_buf[:, 1::2]).all())  # the other rows are untouched


@pytest.mark.parametrize("partition_size", [512, 1024])
def test_longer_partitions_walk_chunks_with_online_softmax(monkeypatch, partition_size):
    """tuning.json may set any multiple of 256: a workgroup then walks several 256-token chunks,
    rescaling its running max, sum and output (with a window starting inside a partition, too)."""
    monkeypatch.setattr(ops.tuning, "partition_size", lambda arch: partition_size)
    em = _emulation("gfx942")
    out, be = check(em, make_case(seq_lens=[1, 700, 1500, 2100], cache_dtype=torch.float8_e4m3fnuz))
    assert be.launches[0][1][1] == math.ceil(2100 / partition_size)
    check(em, make_case(seq_lens=[1, 700, 1500, 2100], cache_dtype=torch.bfloat16, sliding_window=900))


def test_context_beyond_256_partitions():
    """70,000 tokens: 274 partitions, more than the reduce kernel reads in one step (vLLM's stops at
    8 x 64 partitions, 128K tokens)."""
    em = _emulation("gfx942")
    check(em, make_case(seq_lens=[70_000], num_heads=2, num_kv_heads=1, head_size=64, block_size=256,
                        cache_dtype=torch.float8_e4m3fnuz, extra_blocks=0))


def test_million_token_sequence_with_window():
    """A 1M-token sequence: block-table entries outside the window are junk and must never be read."""
    em = _emulation("gfx90a")
    L, bs, window = 1_000_000, 256, 700
    case = make_case(seq_lens=[12], num_heads=4, num_kv_heads=1, block_size=bs, cache_dtype=torch.float8_e5m2,
                     sliding_window=window)
    nb = case.key_cache.shape[0]
    used = (L + bs - 1) // bs
    tables = torch.full((1, used), 10 ** 6, dtype=torch.int32)
    first = (L - window) // bs
    tables[0, first:] = torch.arange(used - first, dtype=torch.int32) % nb
    case.block_tables, case.seq_lens = tables, torch.tensor([L], dtype=torch.int32)
    read = read_slots(tables, [L], bs, nb, window)  # the new geometry reads other slots: poison again
    case.key_cache, case.value_cache = _fresh(case.key_cache), _fresh(case.value_cache)
    poison_unread(case.key_cache, read)
    poison_unread(case.value_cache, read)
    out, be = rocm_attention(em, case, sliding_window=window)
    assert be.launches[0][1][1] == 4  # partitions of the window, not of the context
    assert gpu_tolerance_ok(out, case.reference())[0]


def _fresh(cache: torch.Tensor) -> torch.Tensor:
    """Random finite values of ``cache``'s dtype in every slot (before re-poisoning for a new geometry)."""
    return make_case(seq_lens=[1], num_heads=cache.shape[1], num_kv_heads=cache.shape[1], head_size=cache.shape[3],
                     block_size=cache.shape[2], cache_dtype=cache.dtype, extra_blocks=cache.shape[0] - 2,
                     garbage=False, seed=3).key_cache


def test_reduce_combines_thousands_of_partitions():
    em = _emulation("gfx942")
    gen = torch.Generator().manual_seed(1)
    parts, heads, d = 5000, 2, 64
    L = parts * 256
    tmp = torch.randn(1, heads, parts, d, generator=gen)
    maxes = torch.randn(1, heads, parts, generator=gen) * 3
    sums = torch.rand(1, heads, parts, generator=gen) * 10 + 1
    lens = torch.tensor([L], dtype=torch.int32)
    out = torch.full((1, heads, d), float("nan"), dtype=torch.bfloat16)
    values = {"out": out.data_ptr(), "tmp_out": tmp.data_ptr(), "exp_sums": sums.data_ptr(),
              "max_logits": maxes.data_ptr(), "seq_lens": lens.data_ptr(), "query_start_loc": 0, "o_stride_seq": out.stride(0),
              "o_stride_head": out.stride(1), "num_heads": heads, "head_size": d, "sliding_window": 0,
              "partition_size": 256, "max_parts": parts}
    emulator.EmulatorBackend(em).launch("hal_pa_reduce_bf16", (heads, 1, 1), values, [out, tmp, sums, maxes, lens])
    m, t, s = maxes.double().numpy()[0], tmp.double().numpy()[0], sums.double().numpy()[0]
    w = np.exp(m - m.max(axis=1, keepdims=True))
    want = (w[..., None] * t).sum(axis=1) / (w * s).sum(axis=1)[:, None]
    assert gpu_tolerance_ok(out, want[None])[0]


def test_out_of_bounds_block_is_caught():
    em = _emulation("gfx942")
    case = make_case(seq_lens=[40], cache_dtype=torch.float8_e4m3fnuz)
    case.block_tables[0, 1] = case.key_cache.shape[0] + 5  # a used block outside the cache
    with pytest.raises(emulator.EmulationError, match="out-of-bounds global load"):
        rocm_attention(em, case)


def test_misaligned_cache_is_refused():
    em = _emulation("gfx942")
    case = make_case(seq_lens=[40], cache_dtype=torch.float8_e4m3fnuz)
    flat = torch.empty(case.key_cache.numel() + 1, dtype=torch.uint8)
    case.key_cache = flat[1:].view(case.key_cache.shape).view(torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="16-byte"):
        rocm_attention(em, case)


# ---------------------------------------------------------------------------------------------------
# cache_kv

def _cache_kv_both(em, cache_dtype, key, value, slots, nb, bs, ks, vs):
    hkv, d = key.shape[1:]
    poison = 0x55
    caches = {}
    for who in ("rocm", "emu"):
        kc = torch.full((nb, hkv, bs, d), poison, dtype=torch.uint8).view(cache_dtype) if cache_dtype in FP8 else \
            torch.full((nb, hkv, bs, d), 3.0, dtype=cache_dtype)
        vc = kc.clone()
        if who == "rocm":
            ops.cache_kv(emulator.EmulatorBackend(em), cache_write_call(key, value, kc, vc, slots, ks, vs))
        else:
            hal.cache_kv(key, value, kc, vc, slots, k_scale=ks, v_scale=vs, pack="emu")
        caches[who] = (kc, vc)
    return caches


def _same_bytes(a, b):
    if a.dtype in FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


@pytest.mark.parametrize("input_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cache_kv_bytes_equal_emu(sim, input_dtype):
    gen = torch.Generator().manual_seed(3)
    nb, hkv, bs, d, t = 6, 2, 16, 64, 40
    for cache_dtype in sorted(pack.supports_for(sim.arch)["cache_kv"].cache_dtypes, key=str):
        key = (torch.randn(t, hkv, d, generator=gen) * 3).to(input_dtype)
        value = (torch.randn(t, hkv, d, generator=gen) * 3).to(input_dtype)
        slots = torch.randperm(nb * bs, generator=gen)[:t].to(torch.int64)
        slots[::7] = -1  # padding tokens are skipped
        for ks, vs in ((0.02, 0.03), (torch.tensor([0.01, 0.05]), torch.tensor(0.04))):
            got = _cache_kv_both(sim, cache_dtype, key, value, slots, nb, bs, ks, vs)
            for a, b in zip(got["rocm"], got["emu"]):
                assert _same_bytes(a, b), f"{sim.arch} {input_dtype} -> {cache_dtype}"


def _edge_values(dtype) -> torch.Tensor:
    """Zeros, tiny values, exact ties between neighbours, the largest finite value and beyond, inf, NaN."""
    table = hal.fp8.decode_table(dtype, torch.float64)
    finite = table[torch.isfinite(table)]
    pos = torch.unique(finite[finite >= 0])
    mids = (pos[1:] + pos[:-1]) / 2  # ties: round to the even neighbour
    fmax = float(pos[-1])
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, float(pos[1]) / 2, -float(pos[1]) / 2, float(pos[1]) * 0.49,
                            -float(pos[1]) * 0.51, fmax, fmax * 1.01, fmax * 1.0625, 1e30, math.inf, -math.inf,
                            math.nan, -math.nan], dtype=torch.float64)
    vals = torch.cat([special, mids, -mids, pos, -pos, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])
    n = -(-vals.numel() // 64) * 64
    vals = torch.cat([vals, torch.zeros(n - vals.numel(), dtype=torch.float64)])
    return vals.to(torch.float32)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_cache_kv_fp8_edges_bit_exact(sim, cache_dtype):
    """Saturation, round-to-nearest-even ties, subnormals, signed zeros (fnuz has no -0), inf and NaN,
    against hal.fp8.encode_bytes. On gfx942 this runs the hardware-instruction path under the
    emulation's least favourable reading of the ISA (no saturation, -0 kept), which the kernel repairs."""
    if cache_dtype not in pack.supports_for(sim.arch)["cache_kv"].cache_dtypes:
        pytest.skip(f"{cache_dtype} is not declared for {sim.arch}")
    vals = _edge_values(cache_dtype)
    t = vals.numel() // 64
    key = vals.view(t, 1, 64)
    slots = torch.arange(t, dtype=torch.int64)
    got = _cache_kv_both(sim, cache_dtype, key, -key, slots, t, 1, 1.0, 1.0)
    want = hal.fp8.encode_bytes(vals, cache_dtype)
    assert torch.equal(got["rocm"][0].view(torch.uint8).reshape(-1), want)
    assert torch.equal(got["rocm"][1].view(torch.uint8), got["emu"][1].view(torch.uint8))


# ---------------------------------------------------------------------------------------------------
# the emulation itself

_TEST_KERNELS = r"""
#include "formats.h"
// D = A * B for row-major 16x16 A, B (f16 bits), each lane loading its operands in the documented layout
HAL_KERNEL(t_mfma)(const u16* a, const u16* b, float* d) {
  const int l = (int)hal_lane(), i = l % 16, r = l / 16;
  u16x4 av, bv;
  for (int e = 0; e < 4; ++e) {
    av[e] = hal_ld(a + i * 16 + 4 * r + e);   // A[i][k], k = 4r + e: lane i + 16 (k / 4)
    bv[e] = hal_ld(b + (4 * r + e) * 16 + i); // B[k][j], j = l % 16: lane j + 16 (k / 4)
  }
  f32x4 c = hal_mfma_f16(av, bv, f32x4{0.0f, 0.0f, 0.0f, 0.0f});
  for (int e = 0; e < 4; ++e) hal_st(d + (4 * r + e) * 16 + i, c[e]);  // D[i][j]: lane j + 16 (i / 4)
}
HAL_REGISTER(t_mfma)
HAL_KERNEL(t_divergent)(float* d) {
  if (hal_lane() < 32) {
    f32x4 c = hal_mfma_f16(u16x4{0, 0, 0, 0}, u16x4{0, 0, 0, 0}, f32x4{0.0f, 0.0f, 0.0f, 0.0f});
    hal_st(d + hal_tid(), c[0]);
  }
}
HAL_REGISTER(t_divergent)
HAL_KERNEL(t_barrier_skipped)(float* d) {
  if (hal_wave() == 0) return;
  hal_syncthreads();   // waves that ended do not count (as on the hardware)
  hal_st(d + hal_tid(), 1.0f);
}
HAL_REGISTER(t_barrier_skipped)
"""


@pytest.fixture(scope="module")
def test_kernels(tmp_path_factory):
    src = tmp_path_factory.mktemp("wave64") / "t.hip"
    src.write_text(_TEST_KERNELS)
    import shutil
    import subprocess
    clang = build.find_clang()[0] or shutil.which("clang++")
    if clang is None:
        pytest.skip(testing.compiler_missing())
    lib = src.with_suffix(".so")
    subprocess.run([clang, *build.HOST_FLAGS, "-DHAL_WAVE64_FNUZ_HW=1", f"-I{CSRC}", str(src),
                    f"{CSRC}/wave64_host.cpp", "-o", str(lib)], check=True, capture_output=True)
    return emulator.Emulator(lib)


def _launch(em, name, args, tensors):
    kinds = "".join("Q" for _ in args)
    import struct
    buf = struct.pack("<" + kinds, *args)
    em.launch(name, (1, 1, 1), buf, [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors])


def test_emulated_mfma_layout(test_kernels):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen).to(torch.float16)
    b = torch.randn(16, 16, generator=gen).to(torch.float16)
    d = torch.full((16, 16), float("nan"))
    _launch(test_kernels, "t_mfma", [a.data_ptr(), b.data_ptr(), d.data_ptr()], [a, b, d])
    want = a.double() @ b.double()
    assert torch.allclose(d.double(), want, rtol=1e-6, atol=1e-5)


def test_emulation_rejects_wave_divergent_mfma(test_kernels):
    d = torch.zeros(256)
    with pytest.raises(emulator.EmulationError, match="lanes have returned|divergent"):
        _launch(test_kernels, "t_divergent", [d.data_ptr()], [d])


def test_emulated_barrier_ignores_finished_waves(test_kernels):
    d = torch.zeros(256)
    _launch(test_kernels, "t_barrier_skipped", [d.data_ptr()], [d])
    assert bool((d[64:] == 1).all()) and bool((d[:64] == 0).all())


def test_emulated_lds_matches_the_code_objects():
    """The emulation lays out __shared__ data as the device compiler does (same bytes per workgroup)."""
    if testing.compiler_missing():
        pytest.skip(testing.compiler_missing())
    from hal.kernelpacks.rocm import codeobj
    co = codeobj.read(testing.code_objects(CSRC) / "gfx942" / build.CODE_OBJECT)
    em = _emulation("gfx942")
    case = make_case(seq_lens=[300], cache_dtype=torch.float8_e4m3fnuz)
    be = emulator.EmulatorBackend(em)
    d = case.query.shape[-1]
    # decode only (one partition: no reduce launch follows)
    case1 = make_case(seq_lens=[100], cache_dtype=torch.float8_e4m3fnuz)
    ops.paged_attention(be, attention_call(case1.poisoned_out(), case1.query, case1.key_cache, case1.value_cache,
                        case1.block_tables, case1.seq_lens, d ** -0.5, case1.k_scale, case1.v_scale,
                        None, None, None, None))
    assert em.lds_bytes() == co.kernels["hal_pa_decode_bf16_e4m3fnuz_d64"].lds
    ops.paged_attention(be, attention_call(case.poisoned_out(), case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.seq_lens, d ** -0.5, case.k_scale, case.v_scale, None, None, None, None))
    assert em.lds_bytes() == co.kernels["hal_pa_reduce_bf16"].lds


def test_emulation_library_has_the_contracted_kernels():
    for arch in ARCHS:
        em = _emulation(arch)
        assert em.kernel_names() == kernels.kernel_names(arch)
        for name in em.kernel_names():
            assert em.kernarg_size(name) == kernels.kernarg_size(kernels.family(name))
