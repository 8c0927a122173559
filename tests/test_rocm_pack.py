"""The rocm pack's declaration, dispatch and launcher, on any machine; and (marker ``rocm``) the real
thing on an AMD Instinct GPU, which skips elsewhere with the pack's own reasons.

* ``HAL_TARGET=gfx942`` on a CPU machine: dispatch tries rocm first for the calls it declares and
  says why it cannot run here; fnuz is gfx942's encoding and an e4m3fn cache is refused with how to
  convert it (and the converted cache gives the same attention).
* The launcher's HIP calls go through a stand-in libamdhip64 compiled here: arguments arrive at the
  metadata offsets, every HIP error becomes a HipError with HIP's name and description.
"""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import pytest
import torch

import hal
from cases import attention_call, gpu_tolerance_ok, make_case
from hal import dispatch, registry
from hal.kernelpacks.rocm import build, emulator, kernels, launcher, ops, pack, testing, tuning
from hal.pack import Availability, CallKey
from hal.targets import parse

CSRC = str(pathlib.Path(__file__).resolve().parents[1] / "packs" / "rocm" / "csrc")
ROCM = registry.by_name("rocm")


def _key(cache=torch.float8_e4m3fnuz, query=torch.bfloat16, device="cuda", **kw):
    return CallKey("paged_attention", device, query, cache, kw.pop("head_size", 128), kw.pop("block_size", 16),
                   kw.pop("gqa", 8), frozenset(kw.pop("features", ())))


# ---------------------------------------------------------------------------------------------------
# declaration

def test_declaration_per_arch():
    s942 = pack.supports_for("gfx942")["paged_attention"]
    s90a = pack.supports_for("gfx90a")["paged_attention"]
    assert s942.cache_dtypes == {torch.float16, torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
    assert s90a.cache_dtypes == s942.cache_dtypes | {torch.float8_e4m3fn, torch.float8_e5m2}
    assert s942.head_sizes == (64, 128, 256) and {16, 32, 64} <= set(s942.block_sizes)
    assert s942.max_gqa_ratio is None and s942.devices == {"cuda"}
    assert s942.features == {"alibi", "soft_cap", "sliding_window", "per_head_scales", "varlen",
                             "strided_cache"}  # not misaligned caches
    assert ROCM.VENDORS == {"rocm"} and ROCM.SUPPORTS["paged_attention"] == s942


@pytest.mark.parametrize("arch,declared", [("gfx90a", "gfx90a"), ("gfx942", "gfx942"), ("gfx950", "gfx950"),
                                           ("gfx1100", "gfx942"), ("sm_90", "gfx942"), ("cpu", "gfx942")])
def test_one_declaration_per_target(arch, declared):
    """supports(target) is the declaration dispatch checks (and hal-probe shows) for that target."""
    t = parse(arch)
    assert pack.declared_arch(t) == declared and ROCM.supports(t) is pack.supports_for(declared)
    for cache in (*pack.HALF, *sorted(hal.fp8.FP8_DTYPES, key=str)):
        query = cache if cache in pack.HALF else torch.bfloat16
        for op, support in ROCM.supports(t).items():
            head = 128 if 128 in support.head_sizes else support.head_sizes[0]  # mla_decode: R = 512
            key = CallKey(op, "cuda", query, cache, head, 16, 8)
            assert (ROCM.reasons(key, t) == []) == (cache in support.cache_dtypes), (op, cache)


def test_e4m3fn_refused_on_gfx942_with_how_to_convert():
    t = parse("gfx942")
    why = ROCM.reasons(_key(torch.float8_e4m3fn), t)
    assert len(why) == 1 and "fn_to_fnuz" in why[0] and "never" in why[0]
    assert "float8_e5m2fnuz" in ROCM.reasons(_key(torch.float8_e5m2), t)[0]
    assert ROCM.reasons(_key(torch.float8_e4m3fnuz), t) == []
    assert ROCM.reasons(_key(torch.float8_e4m3fn), parse("gfx90a")) == []  # software decode there


def test_limits_lifted_and_mismatched_16bit_cache_refused():
    t = parse("gfx942")
    assert ROCM.reasons(_key(head_size=256, block_size=64, gqa=40,
                             features=("alibi", "soft_cap", "sliding_window", "per_head_scales")), t) == []
    assert ROCM.reasons(_key(block_size=256), t) == []
    assert any("block_size 48" in r for r in ROCM.reasons(_key(block_size=48), t))
    assert any("head_size 96" in r for r in ROCM.reasons(_key(head_size=96), t))
    assert any("same dtype" in r for r in ROCM.reasons(_key(torch.float16, torch.bfloat16), t))


@pytest.mark.parametrize("arch,native", [("gfx942", True), ("gfx90a", True), ("gfx950", None), ("gfx1100", False),
                                         ("sm_90", False), ("cpu", False)])
def test_native_for(arch, native):
    why = ROCM.native_for(parse(arch))
    if native is True:
        assert why is None
    elif native is None:  # gfx950: native only when a compiler that knows it built the code objects
        assert why is None if "gfx950" in pack.built_archs() else ("gfx950" in why and "clang" in why)
    else:
        assert why


def test_tuning_table():
    for arch in ("gfx942", "gfx90a"):
        assert tuning.partition_size(arch) == 256
        assert tuning.table()["partition_size"][arch]["source"]
    with pytest.raises(KeyError, match="gfx1100"):
        tuning.partition_size("gfx1100")


# ---------------------------------------------------------------------------------------------------
# dispatch with HAL_TARGET=gfx942 on this machine

def test_hal_target_gfx942_tries_rocm_and_says_why_not(monkeypatch):
    monkeypatch.setenv("HAL_TARGET", "gfx942")
    case = make_case(seq_lens=[5, 9], head_size=128, cache_dtype=torch.float8_e4m3fnuz)
    text = hal.explain(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                       k_scale=case.k_scale, v_scale=case.v_scale).text()
    assert "`rocm` is not available here" in text
    if not torch.version.hip:
        assert "not a ROCm build" in text
    assert "`emu` selected (fallback)" in text
    with pytest.warns(hal.FallbackWarning, match=r"falls back .*rocm:"):
        hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                            k_scale=case.k_scale, v_scale=case.v_scale)
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(hal.NotSupportedError, match="rocm"):
        hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                            k_scale=case.k_scale, v_scale=case.v_scale)


def test_forced_rocm_raises_with_reasons():
    case = make_case(seq_lens=[5], head_size=64, cache_dtype=torch.float8_e4m3fnuz)
    with pytest.raises(hal.NotSupportedError, match="rocm"):
        hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                            k_scale=case.k_scale, v_scale=case.v_scale, pack="rocm")


class _AvailableRocm(pack.RocmPack):
    def _probe(self):
        return Availability(True, (), {})


def test_dispatch_on_gfx942_when_rocm_can_run(monkeypatch):
    """With the pack available (as on an MI300), fnuz goes to rocm and e4m3fn to emu with the reason."""
    emu = registry.by_name("emu")
    monkeypatch.setattr(registry, "packs", lambda: (_AvailableRocm(), emu))
    t = parse("gfx942")
    d = dispatch.decide(_key(torch.float8_e4m3fnuz), t)
    assert d.pack.NAME == "rocm" and not d.fallback
    d = dispatch.decide(_key(torch.float8_e4m3fn), t)
    assert d.pack.NAME == "emu" and d.fallback and "fn_to_fnuz" in d.text()
    d = dispatch.decide(_key(torch.float8_e4m3fn), parse("gfx90a"))
    assert d.pack.NAME == "rocm"


def test_converted_fn_cache_gives_the_same_attention():
    """An e4m3fn cache moved with hal.fp8.fn_to_fnuz runs on gfx942's kernels with the same result."""
    try:
        em = testing.emulation(CSRC, "gfx942")
    except build.BuildError:
        pytest.skip(testing.compiler_missing() or "emulation build failed")
    case = make_case(seq_lens=[7, 300], cache_dtype=torch.float8_e4m3fn, per_head_scales=True)
    ref = case.reference()
    kc, ks = hal.fp8.fn_to_fnuz(case.key_cache, case.k_scale)
    vc, vs = hal.fp8.fn_to_fnuz(case.value_cache, case.v_scale)
    out = case.poisoned_out()
    ops.paged_attention(emulator.EmulatorBackend(em), attention_call(out, case.query, kc, vc, case.block_tables, case.seq_lens,
                        64 ** -0.5, ks, vs, None, None, None, None))
    assert gpu_tolerance_ok(out, ref)[0]


# ---------------------------------------------------------------------------------------------------
# launcher

def test_no_hip_runtime_here_is_explained():
    path, how = launcher.find_library()
    if torch.version.hip:
        pytest.skip("a ROCm build of torch: the HIP runtime is there")
    assert path is None or "libamdhip64" in path
    if path is None:
        assert "libamdhip64" in how


_FAKE_HIP = r"""
#include <string.h>
static int next_error;
static unsigned last[7];
static void* last_stream;
static unsigned char args[1024];
static int n_args, sizes[64], offsets[64];
void fake_set_error(int e) { next_error = e; }
void fake_set_layout(int n, const int* s, const int* o) {
  n_args = n; memcpy(sizes, s, n * 4); memcpy(offsets, o, n * 4);
}
const unsigned char* fake_args(void) { return args; }
const unsigned* fake_dims(void) { return last; }
void* fake_stream(void) { return last_stream; }
const char* hipGetErrorName(int e) {
  return e == 0 ? "hipSuccess" : e == 200 ? "hipErrorInvalidImage" : e == 500 ? "hipErrorNotFound"
       : e == 719 ? "hipErrorLaunchFailure" : "hipErrorUnknown";
}
const char* hipGetErrorString(int e) {
  return e == 0 ? "no error" : e == 200 ? "device kernel image is invalid" : e == 500 ? "named symbol not found"
       : e == 719 ? "unspecified launch failure" : "unknown error";
}
int hipModuleLoadData(void** m, const void* image) {
  if (memcmp(image, "\x7f" "ELF", 4) != 0) return 200;
  *m = (void*)0x1000; return 0;
}
int hipModuleGetFunction(void** f, void* m, const char* name) {
  if (m != (void*)0x1000 || strncmp(name, "hal_", 4) != 0) return 500;
  *f = (void*)0x2000; return 0;
}
int hipModuleLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shmem, void* stream, void** params, void** extra) {
  if (f != (void*)0x2000 || extra != 0 || shmem != 0) return 1;
  unsigned d[7] = {gx, gy, gz, bx, by, bz, 1};
  memcpy(last, d, sizeof d);
  last_stream = stream;
  for (int i = 0; i < n_args; ++i) memcpy(args + offsets[i], params[i], sizes[i]);
  return next_error;
}
"""


@pytest.fixture(scope="module")
def fake_hip(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang-19")
    if cc is None:
        pytest.skip("no C compiler for the stand-in HIP runtime")
    d = tmp_path_factory.mktemp("fakehip")
    (d / "fake.c").write_text(_FAKE_HIP)
    lib = d / "libamdhip64.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", str(d / "fake.c"), "-o", str(lib)], check=True, capture_output=True)
    return str(lib)


def test_launcher_packs_arguments_at_the_metadata_offsets(fake_hip):
    rt = launcher.HipRuntime(fake_hip)
    fake = ctypes.CDLL(fake_hip)
    fake.fake_args.restype = ctypes.POINTER(ctypes.c_ubyte)
    fake.fake_dims.restype = ctypes.POINTER(ctypes.c_uint)
    fake.fake_stream.restype = ctypes.c_void_p
    image = b"\x7fELF" + bytes(60)
    mod = rt.load_module(image)
    fn = rt.get_function(mod, "hal_pa_decode_bf16_e4m3fnuz_d128")
    for fam in kernels.PARAMS:
        lay = kernels.layout(fam)
        sizes = (ctypes.c_int * len(lay))(*[a.size for a in lay])
        offs = (ctypes.c_int * len(lay))(*[a.offset for a in lay])
        fake.fake_set_layout(len(lay), sizes, offs)
        values = {n: {"ptr": 0x7F00_0000_0000 + i, "i64": -3 - i, "i32": 7 + i, "f32": 0.25 * i}[k]
                  for i, (n, k) in enumerate(kernels.PARAMS[fam])}
        params, keep = kernels.kernel_params(fam, values)
        rt.launch(fn, (5, 6, 7), (256, 1, 1), params, 0xABC0, fam)
        got = bytes(fake.fake_args()[:kernels.kernarg_size(fam)])
        assert got == kernels.pack(fam, values), fam
        assert list(fake.fake_dims()[:6]) == [5, 6, 7, 256, 1, 1] and fake.fake_stream() == 0xABC0


def test_every_hip_error_becomes_an_exception_with_hip_s_words(fake_hip):
    rt = launcher.HipRuntime(fake_hip)
    with pytest.raises(launcher.HipError, match=r"hipModuleLoadData failed: hipErrorInvalidImage \(200\): device "
                                                r"kernel image is invalid"):
        rt.load_module(b"not an ELF image")
    mod = rt.load_module(b"\x7fELF" + bytes(60))
    with pytest.raises(launcher.HipError, match=r"hipErrorNotFound \(500\): named symbol not found"):
        rt.get_function(mod, "no_such_kernel")
    fn = rt.get_function(mod, "hal_pa_reduce_f16")
    fake = ctypes.CDLL(fake_hip)
    lay = kernels.layout("pa_reduce")
    fake.fake_set_layout(len(lay), (ctypes.c_int * len(lay))(*[a.size for a in lay]),
                         (ctypes.c_int * len(lay))(*[a.offset for a in lay]))
    fake.fake_set_error(719)
    params, keep = kernels.kernel_params("pa_reduce", {n: 0 for n, _ in kernels.PARAMS["pa_reduce"]})
    with pytest.raises(launcher.HipError, match=r"hipModuleLaunchKernel\(hal_pa_reduce_f16\) failed: "
                                                r"hipErrorLaunchFailure \(719\): unspecified launch failure"):
        rt.launch(fn, (1, 1, 1), (256, 1, 1), params, 0, "hal_pa_reduce_f16")
    fake.fake_set_error(0)


# ---------------------------------------------------------------------------------------------------
# on an AMD Instinct GPU (skips elsewhere with the pack's reasons)

@pytest.mark.rocm
@pytest.mark.parametrize("head_size", kernels.HEAD_SIZES)
def test_on_device_against_emu(head_size):
    cache = hal.fp8.native_e4m3()
    if cache not in ROCM.supports(hal.target())["paged_attention"].cache_dtypes:
        cache = torch.float8_e4m3fnuz
    case = make_case(seq_lens=[1, 0, 33, 300, 2000], head_size=head_size, cache_dtype=cache, device="cuda",
                     alibi_slopes=None)
    out = hal.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                              k_scale=case.k_scale, v_scale=case.v_scale, pack="rocm")
    torch.cuda.synchronize()
    assert gpu_tolerance_ok(out, case.reference())[0]
    k = torch.randn(64, case.key_cache.shape[1], head_size, device="cuda")
    slots = torch.randperm(case.key_cache.shape[0] * case.key_cache.shape[2], device="cuda")[:64]
    a, b = case.key_cache.clone(), case.key_cache.clone()
    hal.cache_kv(k, k, a, a.clone(), slots, k_scale=0.05, v_scale=0.05, pack="rocm")
    hal.cache_kv(k, k, b, b.clone(), slots, k_scale=0.05, v_scale=0.05, pack="emu")
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
