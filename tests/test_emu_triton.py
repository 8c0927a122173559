"""The emu pack's Triton path (packs/emu/triton_path.py) against the float64 reference and hal.fp8.

GPU part (markers emu + gpu): the kernels compiled for the device, on grids of encodings, head
sizes, block sizes, GQA ratios, lengths, features and scale forms; cache_kv bytes; CUDA-graph capture.
CPU part: small cases under the Triton interpreter, in one subprocess because TRITON_INTERPRET must
be set before triton is imported; and an offline compile of the kernels for GPU targets, which
catches what the interpreter lets through (globals, return types, constexpr misuse).

Tolerances, as relative L2 over a call's outputs against float64 computed from the same bytes:
* 16-bit path (fp16/bf16 query, FP8 or same-dtype cache): K and V are exact in the query's dtype, the
  products accumulate in float32, but probabilities are rounded to that dtype for PV (bf16: unit
  roundoff 2^-8, mean relative error ~2^-9) and so is the output; independent errors of that size
  give a rel-L2 near 1e-3. Asserted: 5e-3.
* float32 path (IEEE operands): a few float32 roundings per term over <= 256-term dots and softmax sums
  of thousands of terms: ~1e-6. Asserted: 1e-5 plus the unit roundoff of the output dtype (the final
  rounding of a 16-bit ``out``).
Rows of empty sequences must be exactly 0; ``out`` is NaN-poisoned before every call.
"""

from __future__ import annotations

import math

import interpreter
import numpy as np
import pytest
import reference
import torch
from cases import (
    FP8,
    alibi_slopes,
    attention_call,
    cache_write_call,
    gpu_tolerance_ok,
    make_case,
    nan_input_cases,
    nan_rows_ok,
)

from hal import fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU tests skip; GPU tests skip without a GPU anyway
    triton = None

NO_TRITON = "triton is not installed"
HALF = (torch.float16, torch.bfloat16)
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}

if triton is not None:
    from hal.kernelpacks.emu import triton_kernels as TK

    @triton.jit
    def _decode_kernel(src, dst, FAST16: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr,
                       BIAS: tl.constexpr, FNUZ: tl.constexpr, SUBNORMAL: tl.constexpr):
        r = tl.arange(0, 256)
        raw = tl.load(src + r)
        if FAST16:
            val = TK.decode_fp8_fp16(raw, EXP, FNUZ).to(tl.float32)
        else:
            val = TK.decode_fp8(raw, EXP, MAN, BIAS, FNUZ, SUBNORMAL)
        tl.store(dst + r, val)


def _paths():
    from hal.kernelpacks.emu import torch_path, triton_path
    return triton_path, torch_path


# ---------------------------------------------------------------------------------------------
# Checks shared by the GPU tests and the interpreter subprocess (they raise AssertionError).

def _tolerance(query_dtype, cache_dtype) -> float:
    if query_dtype in HALF and (cache_dtype in FP8 or cache_dtype == query_dtype):
        return 5e-3
    return 1e-5 + UNIT_ROUNDOFF[query_dtype]


def check_attention(device, *, max_seq_len="auto", table_pad=0, vs_torch=True, **case_kwargs) -> float:
    """Run triton_path on a random case; compare with the reference (and torch_path). Returns rel-L2.
    ``table_pad`` appends junk block-table columns (room for a loose ``max_seq_len``)."""
    triton_path, torch_path = _paths()
    case = make_case(device=device, **case_kwargs)
    if table_pad:
        junk = torch.full((case.block_tables.shape[0], table_pad), 10**6, dtype=torch.int32, device=device)
        case.block_tables = torch.cat([case.block_tables, junk], dim=1)
    kw = {k: case.kwargs.get(k) for k in ("alibi_slopes", "logits_soft_cap", "sliding_window")}
    lens = case.seq_lens.cpu()
    msl = (int(lens.max()) if len(lens) else 0) if max_seq_len == "auto" else max_seq_len
    scale = case.query.shape[-1] ** -0.5
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale,
            case.k_scale, case.v_scale, kw["alibi_slopes"], kw["logits_soft_cap"], kw["sliding_window"], msl)
    out = case.poisoned_out()
    triton_path.paged_attention(attention_call(out, *args))
    got = out.cpu().to(torch.float64).numpy()
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} non-finite outputs (unwritten?)"
    assert (got[(lens == 0).numpy()] == 0).all(), "empty sequences must give zeros"
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, scale=scale, k_scale=case.k_scale, v_scale=case.v_scale, **kw)
    tol = _tolerance(case.query.dtype, case.key_cache.dtype)
    err = reference.relative_l2(got, ref)
    assert err <= tol, f"rel-L2 vs float64 reference {err:.3g} > {tol:.3g}"
    if vs_torch:
        other = case.poisoned_out()
        torch_path.paged_attention(attention_call(other, *args))
        err_t = reference.relative_l2(got, other.cpu().to(torch.float64).numpy())
        assert err_t <= tol, f"rel-L2 vs torch_path {err_t:.3g} > {tol:.3g}"
    return err


def check_decode_all_bytes(device) -> None:
    """Both in-kernel decoders on all 256 bytes of every encoding equal hal.fp8's table (NaN = NaN)."""
    triton_path, _ = _paths()
    src = torch.arange(256, dtype=torch.uint8, device=device)
    for dtype in FP8:
        consts, factor = triton_path._decode_constants(dtype)
        table = fp8.decode_table(dtype, torch.float64)
        variants = [(False, 1.0)] + ([(True, factor)] if consts["FAST16"] else [])
        for fast16, f in variants:
            dst = torch.empty(256, dtype=torch.float32, device=device)
            _decode_kernel[(1,)](src, dst, FAST16=fast16, EXP=consts["EXP"], MAN=consts["MAN"],
                                 BIAS=consts["BIAS"], FNUZ=consts["FNUZ"], SUBNORMAL=consts["SUBNORMAL"])
            got = dst.cpu().to(torch.float64) * f
            same = (got == table) | (torch.isnan(got) & torch.isnan(table))
            bad = torch.nonzero(~same).flatten().tolist()
            assert not bad, f"{dtype} fast16={fast16}: bytes {[hex(b) for b in bad[:8]]} decode wrong"


def fp8_sweep(dtype) -> torch.Tensor:
    """float32 values around every rounding decision of an encoding: its values, the ties between
    neighbours and one ulp either side, saturation edges, subnormal edges, inf, NaN, +-0; both signs."""
    enc = fp8.encoding_of(dtype)
    table = fp8.decode_table(dtype, torch.float64)
    pos = torch.unique(table[torch.isfinite(table) & (table >= 0)])
    mids = ((pos[1:] + pos[:-1]) / 2).float()  # exact: FP8 values have <= 4 significant bits
    up = torch.nextafter(mids, torch.tensor(math.inf))
    down = torch.nextafter(mids, torch.tensor(-math.inf))
    mx, ms = enc.max_finite, enc.min_subnormal
    top = pos[-1] - pos[-2]
    edges = torch.tensor([mx + top / 2, mx + top / 2 * 0.99, mx + top, mx * 1.5, mx * 2, 1e30, 3.4e38, math.inf,
                          ms / 2, ms * 0.51, ms * 0.49, ms * 1.5, ms * 2.5, 1e-30, 1e-40, 0.0, math.nan])
    gen = torch.Generator().manual_seed(7)
    spread = torch.exp(torch.empty(1500).uniform_(math.log(ms / 4), math.log(mx * 4), generator=gen))
    v = torch.cat([pos.float(), mids, up, down, edges.float(), spread.float()])
    return torch.cat([v, -v])


def check_cache_kv(device, dtype, scale_kind, input_dtype=torch.float32) -> None:
    """cache_kv bytes (or values) equal the definition, x.float() / scale then hal.fp8.encode_bytes
    (true float32 division, computed on the CPU); skipped and out-of-range slots change nothing."""
    triton_path, _ = _paths()
    hkv, d, bs = 2, 40, 7
    vals = fp8_sweep(dtype) if dtype in FP8 else torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 100
    per_token = hkv * d
    t = (vals.numel() + per_token - 1) // per_token + 3
    flat = torch.ones(t * per_token)
    flat[: vals.numel()] = vals
    key = flat.reshape(t, hkv, d).to(input_dtype)
    wide = torch.randn(t, hkv, d + 8).to(input_dtype)  # value rows strided: a slice of a wider tensor
    wide[..., :d] = key.flip(0)
    value = wide[..., :d]
    nb = t // bs + 2
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[:3] = torch.tensor([-1, nb * bs, nb * bs + 77])  # padding and past-the-end: both skipped
    if scale_kind == "float":
        ks, vs = (1.0, 1.0) if dtype in FP8 else (0.37, 1.9)
    elif scale_kind == "tensor0d":
        ks, vs = torch.tensor(0.37), torch.tensor(2.5)
    else:
        ks, vs = torch.tensor([0.37, 1.9]), torch.tensor([3.0, 0.011])
    sentinel = 0x55
    def fresh():
        raw = torch.full((nb, hkv, bs, d), sentinel, dtype=torch.uint8)
        return raw.view(dtype) if dtype in FP8 else torch.full((nb, hkv, bs, d), -7.0, dtype=dtype)
    kc, vc = fresh().to(device), fresh().to(device)
    dev = lambda s: s.to(device) if isinstance(s, torch.Tensor) else s  # noqa: E731
    triton_path.cache_kv(cache_write_call(key.to(device), value.to(device), kc, vc, slots.to(device), dev(ks), dev(vs)))

    keep = (slots >= 0) & (slots < nb * bs)
    blk, off = slots[keep] // bs, slots[keep] % bs
    for name, x, s, cache in (("key", key, ks, kc), ("value", value, vs, vc)):
        s = s.reshape(1, -1, 1) if isinstance(s, torch.Tensor) and s.dim() == 1 else s
        q = x[keep].float() / s  # the CPU's fp32 division is IEEE (CUDA's by a host scalar is not)
        expect = fresh()
        if dtype in FP8:
            expect.view(torch.uint8)[blk, :, off] = fp8.encode_bytes(q, dtype)
            got, want = cache.cpu().view(torch.uint8), expect.view(torch.uint8)
        else:
            expect[blk, :, off] = q.to(dtype)
            got, want = cache.cpu().view(torch.int16 if dtype in HALF else torch.int32), \
                expect.view(torch.int16 if dtype in HALF else torch.int32)
        bad = torch.nonzero(got != want)
        if len(bad):
            b, h, o, e = bad[0].tolist()
            raise AssertionError(f"{name}: {len(bad)} wrong elements in {dtype}, first at block {b} head {h} "
                                 f"offset {o} dim {e}: got {int(got[b, h, o, e])}, want {int(want[b, h, o, e])}")


def check_nan_inputs(device, **over) -> None:
    """NaN in the query / a read key / an ALiBi slope gives NaN rows; only empty sequences give 0.
    Two partitions for the longest sequence, so the merge kernel is crossed too."""
    triton_path, _ = _paths()
    for where, (case, rows) in nan_input_cases(device=device, **over).items():
        out = case.poisoned_out()
        lens = case.seq_lens.cpu()
        triton_path.paged_attention(attention_call(out, case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, case.query.shape[-1] ** -0.5, case.k_scale, case.v_scale,
                                    case.kwargs.get("alibi_slopes"), None, None, int(lens.max())))
        ok, msg = nan_rows_ok(out, case, rows, gpu_tolerance_ok)
        assert ok, f"{where}: {msg}"


# Small cases for the interpreter: each runs in well under a second per kernel launch there.
INTERPRETER_CHECKS = {
    "attention_e4m3fn_gqa4_two_partitions": lambda: [
        check_attention("cpu", seq_lens=[600, 1, 0, 513, 17], num_heads=8, num_kv_heads=2, head_size=64,
                        block_size=16, cache_dtype=torch.float8_e4m3fn, query_dtype=torch.float16, seed=1),
        check_attention("cpu", max_seq_len=None, seq_lens=[520, 512], num_heads=8, num_kv_heads=2,
                        head_size=64, block_size=16, cache_dtype=torch.float8_e4m3fn,
                        query_dtype=torch.float16, per_head_scales=True, seed=2)],
    "attention_e5m2fnuz_alibi_softcap_window": lambda: check_attention(
        "cpu", seq_lens=[530, 23, 0, 7, 14, 1, 1100], num_heads=4, num_kv_heads=2, head_size=40, block_size=7,
        cache_dtype=torch.float8_e5m2fnuz, query_dtype=torch.float16, alibi_slopes=alibi_slopes(4),
        logits_soft_cap=5.0, sliding_window=20, seed=3),
    "attention_float32_path": lambda: check_attention(
        "cpu", seq_lens=[40, 3, 0], num_heads=6, num_kv_heads=2, head_size=48, block_size=5,
        cache_dtype=torch.float8_e4m3fnuz, query_dtype=torch.float32, scale_as_tensor=True, seed=4),
    "nan_inputs_one_partition": lambda: check_nan_inputs("cpu", query_dtype=torch.float16, head_size=32),
    "nan_inputs_two_partitions": lambda: check_nan_inputs("cpu", seq_lens=[600, 0, 21, 5], query_dtype=torch.float16,
                                                          head_size=32),
    "decode_all_bytes": lambda: check_decode_all_bytes("cpu"),
    **{f"cache_kv_{str(dt).removeprefix('torch.')}": (lambda dt=dt: [
        check_cache_kv("cpu", dt, "float"), check_cache_kv("cpu", dt, "per_head"),
        check_cache_kv("cpu", dt, "tensor0d", torch.float16)]) for dt in FP8},
    "cache_kv_float_caches": lambda: [check_cache_kv("cpu", dt, kind) for dt, kind in
                                      ((torch.float16, "float"), (torch.float32, "per_head"))],
}


def _interpreter_main(result_path: str) -> None:
    """Entry point of the subprocess (tests/interpreter.py)."""
    interpreter.run_checks(INTERPRETER_CHECKS, result_path)


# ---------------------------------------------------------------------------------------------
# CPU: the Triton interpreter and offline compiles.

@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    if triton is None:
        pytest.skip(NO_TRITON)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu tests run the compiled kernels (the interpreter checks stand in "
                    "for them on GPU-less machines, and older Triton interpreters lack features they use)")
    return interpreter.results_in_subprocess("test_emu_triton", tmp_path_factory.mktemp("triton_interp"), 300)


@pytest.mark.emu
@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
@pytest.mark.slow
def test_interpreter(interpreter_results, name):
    assert interpreter_results[name] == "ok", interpreter_results[name]


class _Recorder:
    """Stands in for a jitted kernel: records the launch's arguments instead of launching."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8",
                 torch.int32: "i32", torch.int64: "i64"}


def _compile(fn, args, kw, target):
    from triton.compiler import ASTSource
    names = [n for n in fn.arg_names if n not in kw]
    signature, constexprs = {}, {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    options = {"num_warps": kw.get("num_warps", 4)}
    if "num_stages" in kw:
        options["num_stages"] = kw["num_stages"]
    for name, value in kw.items():
        if name not in ("num_warps", "num_stages"):
            signature[name], constexprs[name] = "constexpr", value
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                          options=options)


COMPILE_CASES = {
    "fp8_bf16_direct": dict(seq_lens=[100, 3], cache_dtype=torch.float8_e4m3fn, query_dtype=torch.bfloat16),
    "e5m2fnuz_split_features": dict(seq_lens=[900, 0], cache_dtype=torch.float8_e5m2fnuz, head_size=80,
                                    block_size=17, per_head_scales=True, alibi_slopes=alibi_slopes(8),
                                    logits_soft_cap=4.0, sliding_window=700),
    "fp32_ieee_d256_mqa": dict(seq_lens=[40], query_dtype=torch.float32, cache_dtype=torch.bfloat16,
                               head_size=256, num_heads=64, num_kv_heads=1, scale_as_tensor=True),
}


@pytest.mark.emu
@pytest.mark.parametrize("case_name", list(COMPILE_CASES))
@pytest.mark.slow
def test_kernels_compile_offline_for_gpu_targets(case_name, monkeypatch, tmp_path):
    """The host code's launch arguments, compiled (not run) for NVIDIA and AMD targets."""
    if triton is None:
        pytest.skip(NO_TRITON)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests compile and run these kernels for it")
    from triton.backends.compiler import GPUTarget
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; set to silence its warning
    triton_path, _ = _paths()
    recs = {n: _Recorder(getattr(TK, n)) for n in ("attn_partition_kernel", "attn_merge_kernel", "cache_kv_kernel")}
    for n, r in recs.items():
        monkeypatch.setattr(TK, n, r)
    case = make_case(**COMPILE_CASES[case_name])
    kw = {k: case.kwargs.get(k) for k in ("alibi_slopes", "logits_soft_cap", "sliding_window")}
    triton_path.paged_attention(attention_call(case.poisoned_out(), case.query, case.key_cache, case.value_cache,
                                case.block_tables, case.seq_lens, 0.1, case.k_scale, case.v_scale,
                                kw["alibi_slopes"], kw["logits_soft_cap"], kw["sliding_window"],
                                int(case.seq_lens.max())))
    x = torch.randn(3, *case.key_cache.shape[1:2], case.key_cache.shape[-1]).to(case.query.dtype)
    triton_path.cache_kv(cache_write_call(x, x, case.key_cache, case.value_cache, torch.tensor([0, -1, 5]),
                         case.k_scale, case.v_scale))
    launches = [(r.fn, a, k) for r in recs.values() for a, k in r.calls]
    assert len(launches) == (3 if case_name == "e5m2fnuz_split_features" else 2)
    for target in (GPUTarget("cuda", 80, 32), GPUTarget("hip", "gfx90a", 64)):
        for fn, a, k in launches:
            _compile(fn, a, k, target)


# ---------------------------------------------------------------------------------------------
# GPU.

def gpu_test(fn):
    """emu + gpu markers; skipped with the reason when no GPU is visible or triton is missing."""
    for mark in (pytest.mark.emu, pytest.mark.gpu,
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU visible to torch"),
                 pytest.mark.skipif(triton is None, reason=NO_TRITON)):
        fn = mark(fn)
    return fn

CACHE_DTYPES = [*FP8, torch.bfloat16, torch.float16]
LENS = [1, 0, 37, 64, 700, 1024, 1025]  # odd, empty, on block and partition boundaries, two partitions


def _query_dtype(cache_dtype):
    return {torch.float16: torch.float16, torch.float8_e5m2: torch.float16}.get(cache_dtype, torch.bfloat16)


@gpu_test
@pytest.mark.parametrize("head_size", [40, 64, 80, 128, 256])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_gpu_encodings_and_head_sizes(cache_dtype, head_size):
    check_attention("cuda", seq_lens=LENS, head_size=head_size, cache_dtype=cache_dtype,
                    query_dtype=_query_dtype(cache_dtype), seed=head_size)


@gpu_test
@pytest.mark.parametrize("block_size", [1, 16, 17, 64, 256])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.bfloat16], ids=str)
def test_gpu_block_sizes(cache_dtype, block_size):
    lens = [1, block_size, 2 * block_size, 3 * block_size + 1, 600, 0]
    check_attention("cuda", seq_lens=lens, block_size=block_size, cache_dtype=cache_dtype, seed=block_size)


@gpu_test
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 4), (32, 4), (64, 4), (32, 1), (80, 1), (128, 2)],
                         ids=str)
@pytest.mark.parametrize("head_size", [64, 256])
def test_gpu_gqa_ratios(heads, kv_heads, head_size):
    check_attention("cuda", seq_lens=[5, 300, 1000], num_heads=heads, num_kv_heads=kv_heads,
                    head_size=head_size, cache_dtype=torch.float8_e4m3fn, seed=heads)


@gpu_test
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.bfloat16], ids=str)
def test_gpu_long_context_shared_blocks(cache_dtype):
    check_attention("cuda", seq_lens=[5000, 4097, 1, 0, 2500], share_prefix=True, per_head_scales=True,
                    cache_dtype=cache_dtype)


FEATURES = {
    "alibi": dict(alibi_slopes=alibi_slopes(8)),
    "soft_cap": dict(logits_soft_cap=2.5),
    "window_1": dict(sliding_window=1),
    "window_100": dict(sliding_window=100),
    "window_700": dict(sliding_window=700),  # the window spans a partition boundary
    "alibi_window": dict(alibi_slopes=alibi_slopes(8), sliding_window=600),
    "soft_cap_window": dict(logits_soft_cap=4.0, sliding_window=50),
    "all": dict(alibi_slopes=alibi_slopes(8), logits_soft_cap=4.0, sliding_window=513),
}


@gpu_test
@pytest.mark.parametrize("scales", ["float", "tensor0d", "per_head"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fnuz, torch.float16], ids=str)
def test_gpu_features_and_scales(cache_dtype, feature, scales):
    check_attention("cuda", seq_lens=[0, 1, 50, 513, 1500], cache_dtype=cache_dtype, num_kv_heads=4,
                    query_dtype=_query_dtype(cache_dtype), per_head_scales=scales == "per_head",
                    scale_as_tensor=scales == "tensor0d", **FEATURES[feature])


@gpu_test
@pytest.mark.parametrize("query_dtype,cache_dtype", [
    (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2fnuz), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float16)], ids=str)
def test_gpu_float32_path(query_dtype, cache_dtype):
    check_attention("cuda", seq_lens=[1, 0, 300, 1100], query_dtype=query_dtype, cache_dtype=cache_dtype,
                    alibi_slopes=alibi_slopes(8), logits_soft_cap=8.0)


@gpu_test
@pytest.mark.parametrize("max_seq_len", [None, 3000])
def test_gpu_max_seq_len_absent_or_loose(max_seq_len):
    # 3000: more partitions than any sequence needs; the extra ones must stay out of the merge.
    check_attention("cuda", seq_lens=[600, 7, 0], max_seq_len=max_seq_len, table_pad=160, sliding_window=100)


@gpu_test
def test_gpu_strided_rows_and_blocks():
    triton_path, _ = _paths()
    case = make_case(device="cuda", seq_lens=[700, 9, 0], head_size=80)
    kv = torch.stack([case.key_cache, case.value_cache], dim=1)  # blocks strided: stride(0) = 2*hkv*bs*d
    q = torch.cat([case.query, torch.randn_like(case.query)], dim=1)[:, : case.query.shape[1]]
    out = torch.full((q.shape[0], q.shape[1] * 2, q.shape[2]), math.nan, dtype=q.dtype, device="cuda")
    out = out[:, ::2]  # rows strided, last dim dense
    scale = q.shape[-1] ** -0.5
    triton_path.paged_attention(attention_call(out, q, kv[:, 0], kv[:, 1], case.block_tables, case.seq_lens, scale,
                                case.k_scale, case.v_scale, None, None, None, 700))
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, scale=scale, k_scale=case.k_scale, v_scale=case.v_scale)
    assert reference.relative_l2(out.cpu().double().numpy(), ref) <= 5e-3


@gpu_test
def test_gpu_public_api_routes_cuda_tensors_to_triton(monkeypatch):
    import hal
    triton_path, _ = _paths()
    calls = []
    real = triton_path.paged_attention
    monkeypatch.setattr(triton_path, "paged_attention", lambda *a: (calls.append(1), real(*a)))
    case = make_case(device="cuda", seq_lens=[33, 600])
    out = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                              k_scale=case.k_scale, v_scale=case.v_scale, max_seq_len=600, pack="emu")
    assert calls, "pack='emu' with CUDA tensors did not run the Triton path"
    assert reference.relative_l2(out.cpu().double().numpy(), case.reference()) <= 5e-3


@gpu_test
def test_gpu_decode_all_bytes():
    check_decode_all_bytes("cuda")


@gpu_test
@pytest.mark.parametrize("scale_kind", ["float", "tensor0d", "per_head"])
@pytest.mark.parametrize("dtype", [*FP8, torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_cache_kv_bytes(dtype, scale_kind):
    check_cache_kv("cuda", dtype, scale_kind)
    check_cache_kv("cuda", dtype, scale_kind, torch.bfloat16)


@gpu_test
def test_gpu_no_sync_and_cuda_graph_capture():
    """With max_seq_len given, both ops run without a device->host sync and replay from a graph."""
    triton_path, _ = _paths()
    case = make_case(device="cuda", seq_lens=[700, 5, 0, 1300], per_head_scales=True,
                     alibi_slopes=alibi_slopes(8), sliding_window=900)
    kw = case.kwargs
    out = case.poisoned_out()
    key = torch.randn(4, *case.key_cache.shape[1:2], case.key_cache.shape[-1], device="cuda").bfloat16()
    slots = torch.tensor([3, -1, 40, 41], device="cuda")
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    scale = case.query.shape[-1] ** -0.5

    def step():
        triton_path.cache_kv(cache_write_call(key, key, kc, vc, slots, case.k_scale, case.v_scale))
        triton_path.paged_attention(attention_call(out, case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, scale, case.k_scale, case.v_scale, kw["alibi_slopes"],
                                    None, kw["sliding_window"], 1300))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    case.query.copy_(torch.randn_like(case.query))
    out.fill_(math.nan)
    kc.view(torch.uint8).fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, scale=scale, k_scale=case.k_scale, v_scale=case.v_scale, **kw)
    assert reference.relative_l2(out.cpu().double().numpy(), ref) <= 5e-3
    written = kc.view(torch.uint8)[0, :, 3]
    expect = fp8.encode_bytes(key[0].cpu().float() / case.k_scale.cpu().reshape(-1, 1), kc.dtype)
    assert torch.equal(written.cpu(), expect), "cache_kv did not replay"


@gpu_test
@pytest.mark.parametrize("lens", ([37, 0, 21, 5], [3000, 0, 2100, 5]), ids=("direct", "partitions"))
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_gpu_nan_inputs_give_nan_rows_not_zeros(cache_dtype, lens):
    check_nan_inputs("cuda", seq_lens=lens, cache_dtype=cache_dtype, query_dtype=_query_dtype(cache_dtype))
