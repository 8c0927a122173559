"""The emu pack's Triton MLA decode path (packs/emu/triton_mla.py, triton_mla_kernels.py) against
float64 from the same cache bytes (tests/reference.py::mla_decode via test_emu_mla.ref; on GPUs,
for the long cases, hal.reference.mla_decode on the device) and against the emu PyTorch path
(torch_mla) within the same tolerance. ``out`` is NaN-poisoned before every call; every cache slot no
row reads holds NaN bytes (test_emu_mla.make_mla), block-table columns past a sequence's blocks are
junk where ``table_pad`` says so.

Tolerance, from the arithmetic:
* 16-bit path (fp16/bf16 query, each cache FP8 or of the query's dtype): the query and the decoded
  latent / rotary values are exact in the query's 16-bit type (FP8 values have <= 4 significant bits
  and exponents inside fp16's and bf16's range; a cache of the query's dtype is itself), so every
  product is exact in float32 and the <= R-term sums round at ~sqrt(R) * 2^-24 relative:
  negligible. Two roundings of size u (the 16-bit unit roundoff) remain: the probabilities rounded
  to 16 bits for p @ c (independent relative errors uniform in +-u: rms u/sqrt(3) of the output) and
  the output's own rounding (rms u/sqrt(12)); together a relative L2 error of ~0.65 u. Asserted:
  1.5 u (fp16 7.3e-4, bf16 5.9e-3). The PyTorch path rounds only its output, so the two paths
  differ by ~0.7 u: the same bound holds between them.
* float32 path (a float32 query, or a float32 / other-16-bit cache the query's dtype would round;
  the kernel does not round it): IEEE float32 products, so cases.tolerance_ok's element-wise bound,
  half an ulp of the output dtype plus 1e-5 of the largest magnitude; against the PyTorch path,
  whose output is rounded too, one ulp plus 2e-5.
Block 0 is made a block no sequence reads (all NaN), so a dead token whose block-table entry the
kernel masks to 0 would bring NaN in if its latent load were not masked.
Rows of empty sequences must be exactly 0, and NaN must reach exactly the rows that read it.

CPU: small cases under the Triton interpreter in ONE subprocess (TRITON_INTERPRET must be set before
triton is imported), split-K forced through ``num_splits``; 16-bit queries are float16 there (the
interpreter's bfloat16 ``tl.dot`` multiplies raw bits, as test_emu_triton_prefill.py notes). Offline
compiles for sm_80, sm_90 and gfx942 of the launches the host code makes, checking shared memory,
register spills and MFMA use.
GPU (markers emu + gpu): the same checks through ``hal.mla_decode(..., pack="emu")`` (asserting the
call ran triton_mla) and with forced splits, a grid over encodings, widths, block sizes and head
counts, CUDA-graph capture/replay equal to eager, and DeepSeek's 128 heads x R 512 x P 64, block 64,
at a 4096-token context.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import types

import interpreter
import numpy as np
import pytest
import reference
import torch
from cases import FP8, tolerance_ok
from test_emu_mla import make_mla, ref

import hal

try:
    import triton
except ImportError:  # the CPU tests skip; GPU tests skip without a GPU anyway
    triton = None

pytestmark = pytest.mark.emu
NO_TRITON = "triton is not installed"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
E4, E5, E4Z, E5Z = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
UNIT_ROUNDOFF = {F16: 2.0 ** -11, BF16: 2.0 ** -8}
_TENSORS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "query_start_loc")


def _modules():  # imported late: the interpreter subprocess sets TRITON_INTERPRET first
    from hal.kernelpacks.emu import torch_mla, triton_mla
    return torch_mla, triton_mla


def _qd(cache_dtype, device):
    """The query dtype a check pairs with a latent encoding: float16 under the interpreter, on GPUs
    the 16-bit type the cache is exact in (float16 for a float16 cache, else bfloat16)."""
    if device == "cpu" or cache_dtype == F16:
        return F16
    return BF16


def _rope_for(ckv_dtype):
    """A rotary cache dtype to pair with a latent: FP8 with FP8 (fp8_rope), 16-bit with the same."""
    return E4 if ckv_dtype in FP8 else ckv_dtype if ckv_dtype in UNIT_ROUNDOFF else BF16


def _dot16(case) -> bool:
    qd = case["q_nope"].dtype
    return qd in UNIT_ROUNDOFF and all(case[c].dtype in FP8 or case[c].dtype == qd for c in ("ckv_cache", "kpe_cache"))


def close(out: torch.Tensor, want: np.ndarray, dot16: bool, *, rounded: bool = False) -> tuple[bool, str]:
    """The module docstring's tolerance: relative L2 <= 1.5 u on the 16-bit path, else tolerance_ok.
    ``rounded``: ``want`` is another path's output, itself rounded to the output dtype, so the
    element-wise bound allows both roundings (one ulp) and both paths' float32 error."""
    if not dot16:
        if rounded and out.dtype != F32:
            return _within_one_ulp(out, want)
        return tolerance_ok(out, want, compute_rel=2e-5 if rounded else 1e-5)
    o = out.detach().cpu().to(torch.float64).numpy()
    if not np.all(np.isfinite(o)):
        return False, f"{int((~np.isfinite(o)).sum())} non-finite outputs (unwritten or NaN)"
    rel, bound = reference.relative_l2(o, want), 1.5 * UNIT_ROUNDOFF[out.dtype]
    return rel <= bound, f"relative L2 error {rel:.3g} (bound {bound:.3g})"


def _within_one_ulp(out: torch.Tensor, want: np.ndarray) -> tuple[bool, str]:
    o = out.detach().cpu().to(torch.float64).numpy()
    if not np.all(np.isfinite(o)):
        return False, f"{int((~np.isfinite(o)).sum())} non-finite outputs (unwritten or NaN)"
    bound = 2 * UNIT_ROUNDOFF[out.dtype] * np.abs(want) + 2e-5 * max(1e-30, float(np.abs(want).max(initial=0.0)))
    worst = float((np.abs(o - want) / np.maximum(bound, 1e-300)).max(initial=0.0))
    return worst <= 1.0, f"worst error/bound = {worst:.3g}"


def _on(case: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def _kw(case: dict, multi: bool) -> dict:
    kw = {k: case[k] for k in (*_TENSORS[:6], "scale", "ckv_scale", "kpe_scale")}
    if multi:
        kw["query_start_loc"] = case["query_start_loc"]
    return kw


def _bounds(case: dict, multi: bool) -> dict:
    """Host bounds read from the CPU copies (so the GPU call needs no device read)."""
    lens = case["seq_lens"].cpu()
    qsl = case["query_start_loc"].cpu()
    b = {"max_seq_len": int(lens.max()) if len(lens) else 0}
    if multi:
        b["max_query_len"] = int((qsl[1:] - qsl[:-1]).max()) if len(lens) else 0
    return b


@contextlib.contextmanager
def counting_triton_calls():
    """Counts calls of triton_mla.mla_decode (routing looks it up on the module at each call)."""
    _, triton_mla = _modules()
    real, calls = triton_mla.mla_decode, []

    def counted(call, **kw):
        calls.append(call)
        return real(call, **kw)

    triton_mla.mla_decode = counted
    try:
        yield calls
    finally:
        triton_mla.mla_decode = real


def run_triton(case: dict, device, *, multi: bool, splits=None) -> torch.Tensor:
    """triton_mla on ``case`` moved to ``device``, a NaN-poisoned ``out``. ``splits``: forced split
    count (called directly); None on a GPU: through hal.mla_decode(pack="emu"), asserted to route
    to triton_mla."""
    _, triton_mla = _modules()
    dev = _on(case, device)
    out = torch.full(dev["q_nope"].shape, math.nan, dtype=dev["q_nope"].dtype, device=device)
    kw = dict(_kw(dev, multi), **_bounds(case, multi), out=out)
    if splits is None and device != "cpu":
        with counting_triton_calls() as calls:
            hal.mla_decode(**kw, pack="emu")
        assert len(calls) == 1, f"hal.mla_decode(pack='emu') on {device} tensors did not run triton_mla"
    else:
        triton_mla.mla_decode(hal.ops.prepare("mla_decode", **kw), num_splits=splits)
    return out


def run_torch(case: dict, device, *, multi: bool) -> torch.Tensor:
    torch_mla, _ = _modules()
    dev = _on(case, device)
    out = torch.full(dev["q_nope"].shape, math.nan, dtype=dev["q_nope"].dtype, device=device)
    c = hal.ops.prepare("mla_decode", **_kw(dev, multi), **_bounds(case, multi), out=out)
    torch_mla.mla_decode(c.out, c.q_nope, c.q_pe, c.ckv_cache, c.kpe_cache, c.block_tables, c.seq_lens, c.scale,
                         c.ckv_scale, c.kpe_scale, c.max_seq_len, c.query_start_loc)
    return out


def check(device, lens, q_lens=None, *, splits=None, table_pad=0, scales=None, **kw) -> None:
    """triton_mla (forced ``splits`` and, on a GPU, also through hal.mla_decode) against float64
    from the same bytes and against torch_mla; empty contexts give exact zeros. ``scales``:
    "tensor" passes ckv_scale as a 0-d and kpe_scale as a [1] float32 tensor."""
    multi = q_lens is not None
    kw.setdefault("query_dtype", _qd(kw.get("ckv_dtype", E4), device))
    kw.setdefault("kpe_dtype", kw["query_dtype"] if kw["query_dtype"] in UNIT_ROUNDOFF else BF16)
    case = make_mla(lens, q_lens, **kw)
    _unread_block_first(case)
    if table_pad:  # junk columns past every sequence's blocks: never dereferenced
        junk = torch.full((len(lens), table_pad), 10**6, dtype=torch.int32)
        case["block_tables"] = torch.cat([case["block_tables"], junk], dim=1)
    if scales == "tensor":
        for name, shape in (("ckv_scale", ()), ("kpe_scale", (1,))):
            case[name] = torch.full(shape, 1.0 if case[name] is None else case[name], dtype=F32)
    want, dot16 = ref(case, multi=multi), _dot16(case)
    rows_len = _row_lengths(case, multi)
    runs = [run_triton(case, device, multi=multi, splits=splits)]
    if device != "cpu" and splits is not None:
        runs.append(run_triton(case, device, multi=multi))
    for got in runs:
        ok, msg = close(got, want, dot16)
        assert ok, f"vs float64: {msg}"
        assert torch.all(got[torch.from_numpy(rows_len == 0).to(got.device)] == 0), "empty contexts must give zeros"
    ok, msg = close(runs[0], run_torch(case, device, multi=multi).cpu().double().numpy(), dot16, rounded=True)
    assert ok, f"vs torch_mla: {msg}"


def _unread_block_first(case: dict) -> None:
    """Swaps block 0 with a block no sequence reads (all NaN bytes): a dead token's block-table
    entry, masked to 0 in the kernel, then points at NaN, which must stay out of the output."""
    bs, lens, tables = case["ckv_cache"].shape[1], case["seq_lens"].tolist(), case["block_tables"]
    used = {int(tables[i, j]) for i, length in enumerate(lens) for j in range((length + bs - 1) // bs)}
    spare = next(b for b in range(case["ckv_cache"].shape[0]) if b not in used)
    for name in ("ckv_cache", "kpe_cache"):
        raw = case[name].view(torch.uint8) if case[name].dtype in FP8 else case[name]
        raw[[0, spare]] = raw[[spare, 0]].clone()
    case["block_tables"] = torch.where(tables == 0, spare, torch.where(tables == spare, 0, tables)).to(torch.int32)


def _row_lengths(case: dict, multi: bool) -> np.ndarray:
    lens = case["seq_lens"].numpy().astype(np.int64)
    if not multi:
        return lens
    qsl = case["query_start_loc"].numpy()
    out = []
    for i, length in enumerate(lens):
        q = qsl[i + 1] - qsl[i]
        out += [length - q + t + 1 for t in range(q)]
    return np.array(out, dtype=np.int64)


def check_splits_agree(device) -> None:
    """Every split count (1: direct; more splits than tiles) gives the reference, and the direct
    result equals the default plan's on the CPU (one split there) bit for bit."""
    case = make_mla([1, 70, 300, 33], [1, 3, 4, 2], heads=16, r=64, p=16, ckv_dtype=E4,
                    query_dtype=_qd(E4, device), seed=31)
    want = ref(case, multi=True)
    outs = {s: run_triton(case, device, multi=True, splits=s) for s in (1, 2, 5, 64)}
    for s, got in outs.items():
        ok, msg = close(got, want, True)
        assert ok, f"{s} splits: {msg}"


def check_speculative_last_row_is_decode(device) -> None:
    """The last of a sequence's q_len rows sees the whole context: the same bits as a decode call
    over the same caches (same split count), for every sequence."""
    case = make_mla([20, 64, 5, 130, 0], [4, 1, 3, 2, 0], heads=20, r=48, p=16, block_size=16, ckv_dtype=E5Z,
                    kpe_dtype=E4, query_dtype=_qd(E5Z, device), seed=32)
    spec = run_triton(case, device, multi=True, splits=3)
    last = (case["query_start_loc"][1:] - 1)[[0, 1, 2, 3]]
    dec = dict(case, q_nope=case["q_nope"][last].contiguous(), q_pe=case["q_pe"][last].contiguous(),
               seq_lens=case["seq_lens"][:4].contiguous(), block_tables=case["block_tables"][:4].contiguous())
    assert torch.equal(run_triton(dec, device, multi=False, splits=3), spec[last.to(spec.device)])


def check_nan_reaches_exactly_its_rows(device) -> None:
    """A NaN in one query element: that (row, head) only. A NaN in the latent at position j of a
    sequence: every head of that sequence's rows at positions >= j, no other row (causal: rows
    before j mask it). Split-K forced, so NaN crosses the merge too."""
    for splits in (1, 4):
        case = make_mla([40, 70, 9], [3, 2, 1], heads=20, r=64, p=16, ckv_dtype=E4, query_dtype=_qd(E4, device),
                        seed=33)
        case["q_nope"][4, 17, 5] = math.nan                  # sequence 1's second row, head 17
        j = 38                                               # sequence 0 (L = 40): rows at 37, 38, 39
        blk = int(case["block_tables"][0, j // 16])
        case["ckv_cache"].view(torch.uint8)[blk, j % 16, 11] = 0x7F  # e4m3fn NaN, read by rows at >= 38
        expect = np.zeros(case["q_nope"].shape, dtype=bool)
        expect[4, 17, :] = True
        expect[1:3] = True
        got = run_triton(case, device, multi=True, splits=splits).cpu().double().numpy()
        assert np.array_equal(np.isnan(got), expect), \
            f"{splits} splits: {int((np.isnan(got) & ~expect).sum())} unexpected NaNs, " \
            f"{int((expect & ~np.isnan(got)).sum())} missing"
        want = ref(case, multi=True)
        assert np.array_equal(np.isnan(want), expect), "the reference disagrees with the expected NaN set"
        ok, msg = close(torch.from_numpy(got[~expect]).to(case["q_nope"].dtype), want[~expect], True)
        assert ok, msg


def check_strided_query_and_out(device) -> None:
    """q_nope / q_pe / out as views with strided rows and heads (last dim dense)."""
    _, triton_mla = _modules()
    case = make_mla([33, 90], heads=4, r=64, p=16, ckv_dtype=E4, query_dtype=_qd(E4, device), seed=34)
    want = ref(case, multi=False)
    dev = _on(case, device)
    wide = lambda x: torch.cat([x, torch.randn_like(x.float()).to(x.dtype)], dim=1)[:, ::2]
    qn, qp = wide(dev["q_nope"]), wide(dev["q_pe"])
    qn.copy_(dev["q_nope"]), qp.copy_(dev["q_pe"])
    out = torch.full((2, 8, 64), math.nan, dtype=qn.dtype, device=device)[:, 1::2]
    kw = dict(_kw(dev, False), q_nope=qn, q_pe=qp, out=out, max_seq_len=90)
    triton_mla.mla_decode(hal.ops.prepare("mla_decode", **kw), num_splits=2)
    ok, msg = close(out, want, True)
    assert ok, msg


E4_R512 = {"r": 512, "p": 64, "ckv_dtype": E4}
# Small cases: under the interpreter on the CPU (a few seconds each there), and on GPUs.
CHECKS = {
    **{f"latent_{str(dt).removeprefix('torch.')}": (lambda dev, dt=dt: check(
        dev, [1, 37, 100, 16, 0], heads=16, r=64, p=16, ckv_dtype=dt, splits=2, seed=1)) for dt in (E4, E5, E4Z, E5Z)},
    "latent_16_bit_of_the_query": lambda dev: check(dev, [1, 37, 100, 0], heads=16, r=64, p=16, ckv_dtype=F16,
                                                    kpe_dtype=F16, seed=2),
    "latent_float32_and_bf16_rounded_never": lambda dev: [  # the query's type would round them: float32 path
        check(dev, [5, 80], [2, 1], heads=16, r=64, p=16, ckv_dtype=dt, kpe_dtype=BF16, query_dtype=F16, splits=2,
              seed=3) for dt in (F32, BF16)],
    "r512_heads1_block64_split": lambda dev: check(dev, [3, 130, 64], heads=1, block_size=64, splits=3, seed=4,
                                                   **E4_R512),
    "r512_heads20_block1_speculative": lambda dev: check(
        dev, [5, 40, 0, 21, 3], [2, 4, 0, 1, 3], heads=20, block_size=1, splits=2, seed=5, **dict(E4_R512, ckv_dtype=E5)),
    "r512_heads16_combined_fp8_view": lambda dev: check(dev, [33, 90], heads=16, ckv_dtype=E4, kpe_dtype=E4, r=512,
                                                        p=64, combined=True, seed=6),
    "r48_p16_heads20_fp8_rope_speculative": lambda dev: check(
        dev, [20, 64, 5, 130, 0], [4, 1, 3, 2, 0], heads=20, r=48, p=16, ckv_dtype=E4Z, kpe_dtype=E5, splits=4,
        table_pad=3, seed=7),
    "r48_combined_16_bit_view_tensor_scales": lambda dev: check(
        dev, [17, 64, 1], [1, 3, 1], heads=20, r=48, p=16, ckv_dtype=F16, kpe_dtype=F16, combined=True,
        scales="tensor", seed=8),
    "tensor_scales_fp8_rope_split": lambda dev: check(dev, [50, 129], heads=16, r=64, p=16, ckv_dtype=E5,
                                                      kpe_dtype=E4, scales="tensor", splits=3, seed=9),
    "float32_query_split_speculative": lambda dev: check(
        dev, [40, 3, 77], [3, 1, 4], heads=16, r=64, p=16, ckv_dtype=E4, kpe_dtype=BF16, query_dtype=F32, splits=3,
        block_size=16, seed=10),
    "splits_agree": check_splits_agree,
    "speculative_last_row_is_decode": check_speculative_last_row_is_decode,
    "nan_reaches_exactly_its_rows": check_nan_reaches_exactly_its_rows,
    "strided_query_and_out": check_strided_query_and_out,
}


def _interpreter_main(result_path: str) -> None:
    """Entry point of the subprocess (tests/interpreter.py)."""
    interpreter.run_checks(CHECKS, result_path, "cpu")


# ---------------------------------------------------------------------------------------------
# CPU: the Triton interpreter, the host plan, routing, offline compiles.

def _cpu_only():
    if triton is None:
        pytest.skip(NO_TRITON)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu tests compile and run the kernels")


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    _cpu_only()
    return interpreter.results_in_subprocess("test_emu_triton_mla", tmp_path_factory.mktemp("triton_mla_interp"), 400)


@pytest.mark.parametrize("name", list(CHECKS))
@pytest.mark.slow
def test_interpreter(interpreter_results, name):
    assert interpreter_results[name] == "ok", interpreter_results[name]


@pytest.mark.skipif(triton is None, reason=NO_TRITON)
def test_plan_splits_from_host_ints():
    """Split-K when rows x head tiles leave SMs idle, none when they fill them; power-of-two split
    lengths (the merge kernel compiles per value) of whole tiles; the workspace bounded."""
    _, triton_mla = _modules()
    plan = triton_mla.plan
    big = plan(64, 128, 512, 64, 4096, dot16=True, sm_count=132)          # 512 programs >= 132 SMs
    assert big.direct and big.split_len == 4096 and big.head_tiles == 8
    one = plan(1, 128, 512, 64, 4096, dot16=True, sm_count=132)           # 8 programs: split
    assert one.num_splits == 16 and one.split_len == 256
    assert one.split_len % one.block_n == 0 and one.split_len & (one.split_len - 1) == 0
    short = plan(1, 16, 512, 64, 100, dot16=True, sm_count=132)           # below MIN_SPLIT tokens: one split
    assert short.direct
    forced = plan(3, 20, 48, 16, 300, dot16=True, sm_count=1, num_splits=4)
    assert (forced.num_splits, forced.split_len, forced.head_tiles) == (3, 128, 2)
    huge = plan(4096, 128, 512, 64, 1 << 17, dot16=True, sm_count=10**6)  # workspace capped at 2^28 floats
    assert huge.direct or 4096 * 128 * huge.num_splits * 512 <= triton_mla._MAX_WORKSPACE
    assert plan(1, 16, 64, 16, 4096, dot16=True, sm_count=132).block_n == 32
    assert plan(1, 16, 512, 64, 4096, dot16=False, sm_count=132).block_n == 16


def test_routing_sends_cuda_tensors_to_triton_mla(monkeypatch):
    """routing.mla_decode picks triton_mla for CUDA tensors when Triton is usable, torch_mla
    otherwise (a stand-in call record: no GPU needed)."""
    if triton is None:
        pytest.skip(NO_TRITON)
    from hal.kernelpacks.emu import routing, torch_mla, triton_mla
    ran = []
    monkeypatch.setattr(triton_mla, "mla_decode", lambda call: ran.append("triton"))
    monkeypatch.setattr(torch_mla, "mla_decode", lambda *a: ran.append("torch"))
    fake = types.SimpleNamespace(q_nope=types.SimpleNamespace(device=torch.device("cuda")), **dict.fromkeys(
        ("out", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "scale", "ckv_scale", "kpe_scale",
         "max_seq_len", "query_start_loc", "lse")))
    monkeypatch.setattr(routing, "triton_usable", lambda: None)
    routing.mla_decode(fake)
    monkeypatch.setattr(routing, "triton_usable", lambda: "no GPU visible to torch")
    routing.mla_decode(fake)
    fake.q_nope.device = torch.device("cpu")
    monkeypatch.setattr(routing, "triton_usable", lambda: None)
    routing.mla_decode(fake)
    assert ran == ["triton", "torch", "torch"]


def test_mla_decode_runs_without_triton(tmp_path):
    """A CPU install has no triton: hal.mla_decode must not import it (routing imports triton_mla
    only for GPU tensors)."""
    code = """
import sys
sys.modules["triton"] = None          # import triton raises ImportError
import torch, hal
ckv = torch.randn(3, 16, 64).to(torch.bfloat16); kpe = torch.randn(3, 16, 16).to(torch.bfloat16)
qn = torch.randn(3, 4, 64).to(torch.bfloat16); qp = torch.randn(3, 4, 16).to(torch.bfloat16)
bt = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32); lens = torch.tensor([20, 16], dtype=torch.int32)
out = hal.mla_decode(qn, qp, ckv, kpe, bt, lens, scale=0.1, query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32))
assert torch.isfinite(out).all()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=300, check=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _record_launches(case: dict, multi: bool, splits, hip: bool = False) -> list:
    """The (kernel, args, kwargs) the host code launches for ``case`` on the CPU, as for a GPU
    (``hip``: an AMD one)."""
    from hal.kernelpacks.emu import triton_kernels as TK
    from hal.kernelpacks.emu import triton_mla_kernels as TMK
    from test_emu_triton import _Recorder
    _, triton_mla = _modules()
    recs = [_Recorder(TMK.mla_partition_kernel), _Recorder(TK.attn_merge_kernel)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TMK, "mla_partition_kernel", recs[0])
        mp.setattr(TK, "attn_merge_kernel", recs[1])
        mp.setattr(torch.version, "hip", "6.0" if hip else None)
        kw = dict(_kw(case, multi), **_bounds(case, multi))
        triton_mla.mla_decode(hal.ops.prepare("mla_decode", **kw), num_splits=splits)
    return [(r.fn, a, k) for r in recs for a, k in r.calls]


def _ptxas_spills(ptx: str, capability: int, tmp_path) -> int:
    """Spill-store bytes ptxas reports for ``ptx``, with the flags Triton compiles with."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    src = tmp_path / f"k{capability}.ptx"
    src.write_text(ptx)
    log = subprocess.run([get_ptxas(capability).path, "-v", "-lineinfo", "--regAllocOptLevel=2",
                          f"--gpu-name={sm_arch_from_capability(capability)}", str(src), "-o", str(src) + ".o"],
                         capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


COMPILE_CASES = {  # make_mla arguments, varlen, forced splits; R = 512 first: the DeepSeek shape
    "bf16q_e4m3fn_r512_split": (dict(seq_lens=[300, 40], heads=16, **E4_R512), False, 3),
    "bf16q_bf16_combined_r512_direct": ({"seq_lens": [300, 40], "heads": 128, "r": 512, "p": 64, "ckv_dtype": BF16,
                                         "kpe_dtype": BF16, "combined": True}, False, 1),
    "bf16q_e5m2fnuz_fp8_rope_r512_varlen": ({"seq_lens": [300, 40], "q_lens": [3, 1], "heads": 20, "r": 512,
                                             "p": 64, "ckv_dtype": E5Z, "kpe_dtype": E4}, True, 2),
    "f32q_e4m3fn_r512": (dict(seq_lens=[300, 40], heads=16, query_dtype=F32, **E4_R512), False, 2),
    "f16q_e4m3fnuz_r48_varlen": ({"seq_lens": [300, 40], "q_lens": [2, 2], "heads": 20, "r": 48, "p": 16,
                                  "ckv_dtype": E4Z, "query_dtype": F16}, True, 2),
}


@pytest.mark.parametrize("name", list(COMPILE_CASES))
@pytest.mark.slow
def test_kernels_compile_offline(name, monkeypatch, tmp_path):
    """The host code's launches compiled (not run) for sm_80, sm_90 and gfx942: within 64 KiB of
    shared memory / LDS (sm_75's and gfx942's limit), tensor-core / MFMA products on the 16-bit
    path, and no register spills at R = 512 on the 16-bit path (triton_mla._tile_config's choice)."""
    _cpu_only()
    from test_emu_triton import _compile
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; set to silence its warning
    args, multi, splits = COMPILE_CASES[name]
    args = dict(args, query_dtype=args.get("query_dtype", BF16))
    case = make_mla(args.pop("seq_lens"), args.pop("q_lens", None), **args)
    dot16, r512 = _dot16(case), case["ckv_cache"].shape[-1] == 512
    launches = _record_launches(case, multi, splits)
    assert len(launches) == (1 if splits == 1 else 2)
    for cc in (80, 90):
        for fn, a, k in launches:
            compiled = _compile(fn, a, k, GPUTarget("cuda", cc, 32))
            assert compiled.metadata.shared <= 64 * 1024, f"sm_{cc}: {compiled.metadata.shared} B of shared memory"
            if fn.__name__ == "mla_partition_kernel":
                assert ("mma.sync" in compiled.asm["ptx"]) == dot16, "16-bit products on tensor cores, float32 not"
                if dot16 and r512:
                    assert _ptxas_spills(compiled.asm["ptx"], cc, tmp_path) == 0, f"sm_{cc}: register spills"
    if "amd" not in backends:
        pytest.skip(f"this triton has no AMD backend (backends: {sorted(backends)})")
    for fn, a, k in _record_launches(case, multi, splits, hip=True):
        compiled = _compile(fn, a, k, GPUTarget("hip", "gfx942", 64))
        asm = compiled.asm["amdgcn"]
        assert compiled.metadata.shared <= 64 * 1024, f"gfx942: {compiled.metadata.shared} B of LDS"
        spills = re.search(r"\.vgpr_spill_count:\s+(\d+)", asm)
        assert spills is None or int(spills.group(1)) == 0, f"gfx942: {spills.group(1)} VGPRs spilled"
        if fn.__name__ == "mla_partition_kernel" and dot16:
            assert "v_mfma" in asm, "the tile products should use MFMA on gfx942"


# ---------------------------------------------------------------------------------------------
# GPU.

def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(triton is None, reason=NO_TRITON)(fn))  # conftest skips without a GPU


@gpu_test
@pytest.mark.parametrize("name", list(CHECKS))
def test_gpu_small_checks(name):
    CHECKS[name]("cuda")


@gpu_test
@pytest.mark.parametrize("heads", [1, 16, 20, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("widths", [(512, 64), (48, 16), (128, 32)], ids=lambda w: f"r{w[0]}p{w[1]}")
@pytest.mark.parametrize("ckv_dtype", [*FP8, BF16, F16, F32], ids=str)
def test_gpu_grid(ckv_dtype, widths, block_size, heads):
    """Through hal.mla_decode(pack="emu") (asserted to run triton_mla): decode rows, and
    speculative rows with an empty sequence; the split count the SM count gives."""
    r, p = widths
    lens = [1, 2 * block_size + 5, 300, 0]
    check("cuda", lens, heads=heads, r=r, p=p, block_size=block_size, ckv_dtype=ckv_dtype,
          kpe_dtype=F16 if ckv_dtype == F16 else BF16, seed=heads + block_size)
    check("cuda", lens, [1, 4, 2, 0], heads=heads, r=r, p=p, block_size=block_size, ckv_dtype=ckv_dtype,
          kpe_dtype=_rope_for(ckv_dtype), seed=heads + block_size + 1)


@gpu_test
@pytest.mark.parametrize("ckv_dtype", [E4, BF16], ids=str)
@pytest.mark.parametrize("q_lens", [None, [1, 2, 3, 4]], ids=["decode", "speculative"])
def test_gpu_deepseek_128_heads_4096_context(ckv_dtype, q_lens):
    """DeepSeek-V3's shape: 128 heads, R 512, P 64, block 64, 4096-token contexts (and shorter),
    a combined cache for bf16; float64 from hal.reference on the GPU (the test reference is slow
    there). Batches of 1, 4 and 32 sequences: as decode rows, 16, 8 and no splits of the context on a
    132-SM H200."""
    for lens in ([4096], [4096, 4096, 1000, 7], [4096] * 8 + [1000] * 24):
        qls = None if q_lens is None else (q_lens * 8)[:len(lens)]
        case = make_mla(lens, qls, heads=128, r=512, p=64, block_size=64, ckv_dtype=ckv_dtype,
                        kpe_dtype=BF16 if ckv_dtype == E4 else ckv_dtype, query_dtype=BF16,
                        combined=ckv_dtype == BF16, seed=len(lens))
        multi = qls is not None
        got = run_triton(case, "cuda", multi=multi)
        dev = _on(case, "cuda")
        want = hal.reference.mla_decode(dev["q_nope"], dev["q_pe"], dev["ckv_cache"], dev["kpe_cache"],
                                        dev["block_tables"], dev["seq_lens"], dev["query_start_loc"] if multi else None,
                                        scale=case["scale"], ckv_scale=case["ckv_scale"],
                                        kpe_scale=case["kpe_scale"]).cpu().numpy()
        ok, msg = close(got, want, True)
        assert ok, f"{lens}: {msg}"


@gpu_test
def test_gpu_cuda_graph_replay_equals_eager():
    """With the host bounds given, hal.mla_decode(pack="emu") runs triton_mla without a device->host
    sync and replays from a CUDA graph (split-K: 3 rows of 16 heads leave SMs idle); the replay with
    new query values equals an eager call on them, bit for bit."""
    case = make_mla([700, 5, 0, 1300], [2, 1, 0, 3], heads=16, ckv_dtype=E4, kpe_dtype=BF16, query_dtype=BF16,
                    seed=40)
    dev = _on(case, "cuda")
    out = torch.full(dev["q_nope"].shape, math.nan, dtype=BF16, device="cuda")
    kw = dict(_kw(dev, True), **_bounds(case, True), out=out, pack="emu")
    with counting_triton_calls() as calls:
        hal.mla_decode(**kw)  # compile and warm up outside the capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hal.mla_decode(**kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hal.mla_decode(**kw)
    assert len(calls) == 3, "hal.mla_decode(pack='emu') did not run triton_mla"
    gen = torch.Generator().manual_seed(99)
    dev["q_nope"].copy_(torch.randn(dev["q_nope"].shape, generator=gen).to(BF16))
    dev["q_pe"].copy_(torch.randn(dev["q_pe"].shape, generator=gen).to(BF16))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    out.fill_(math.nan)
    hal.mla_decode(**kw)
    assert torch.equal(replayed, out)
    case["q_nope"], case["q_pe"] = dev["q_nope"].cpu(), dev["q_pe"].cpu()
    ok, msg = close(replayed, ref(case, multi=True), True)
    assert ok, msg
