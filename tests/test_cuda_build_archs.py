"""Which archs `pip install .` compiles the cuda pack for (packs/cuda/archs.py, docs/cuda.md "Build"):
the decision for each input, the reasons hal-probe shows, and a CMake configure (no compile) that says
what it will build. Runs on the CPU; the configure tests skip without cmake, nvcc or pybind11."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from hal.kernelpacks.cuda import archs
from hal.kernelpacks.cuda import pack as cuda_pack

ROOT = pathlib.Path(__file__).resolve().parents[1]
H200 = [("9.0", "NVIDIA H200")]


def decide(env=None, gpus=None, **kw):
    """archs.decide with a given environment and GPU list; fails if nvidia-smi is consulted unasked."""
    def no_query():
        raise AssertionError("nvidia-smi consulted though an earlier rule applies")
    found = (lambda: (gpus, "nvidia-smi" if gpus else "nvidia-smi not found")) if gpus is not None else no_query
    return archs.decide(env or {}, gpus=found, **kw)


@pytest.mark.parametrize("value, expected", [
    ("8.9", ["89-real"]),
    ("9.0", ["90a-real"]),               # sm_90 builds as 90a, the name of the all build
    ("9.0a", ["90a-real"]),
    ("8.9;9.0a", ["89-real", "90a-real"]),
    ("8.9 9.0", ["89-real", "90a-real"]),
    ("9.0+PTX", ["90a-real", "90-virtual"]),  # portable PTX is the plain arch's
    ("10.0", ["100a-real"]),
    ("10.3", ["103-real"]),
    ("12.0", ["120-real"]),
    ("12.0+PTX", ["120-real", "120-virtual"]),
    ("Hopper", ["90a-real", "90-virtual"]),
    ("Ada;Hopper", ["89-real", "89-virtual", "90a-real", "90-virtual"]),
    ("Blackwell", ["100a-real", "103-real", "120-real", "121-real", "121-virtual"]),
    ("9.0;9.0a", ["90a-real"]),
])
def test_torch_cuda_arch_list(value, expected):
    d = decide({"TORCH_CUDA_ARCH_LIST": value})
    assert d["archs"] == expected and d["source"] == "TORCH_CUDA_ARCH_LIST"
    assert value in d["reason"]


def test_torch_cuda_arch_list_leaves_out_archs_below_sm89():
    d = decide({"TORCH_CUDA_ARCH_LIST": "7.5;8.0;8.6;9.0+PTX"})
    assert d["archs"] == ["90a-real", "90-virtual"]
    assert "left out: 7.5, 8.0, 8.6" in d["reason"] and "sm_89" in d["reason"]


def test_torch_cuda_arch_list_with_nothing_usable_builds_nothing_and_says_how():
    d = decide({"TORCH_CUDA_ARCH_LIST": "8.0;8.6+PTX"})
    assert d["archs"] == [] and "names no sm_89+ arch" in d["reason"] and "HAL_CUDA_ARCHS=all" in d["reason"]


def test_torch_cuda_arch_list_native_is_the_visible_gpu():
    d = decide({"TORCH_CUDA_ARCH_LIST": "native"}, gpus=H200)
    assert d["archs"] == ["90a-real"] and "TORCH_CUDA_ARCH_LIST=native" in d["reason"]


@pytest.mark.parametrize("gpus, expected", [
    (H200, ["90a-real"]),
    ([("8.9", "NVIDIA L4")], ["89-real"]),
    ([("12.0", "NVIDIA GeForce RTX 5090")], ["120-real"]),
    ([("9.0", "NVIDIA H100"), ("8.9", "NVIDIA L40S"), ("9.0", "NVIDIA H100")], ["89-real", "90a-real"]),
])
def test_visible_gpu(gpus, expected):
    d = decide(gpus=gpus)
    assert d["archs"] == expected and d["source"] == "nvidia-smi"
    assert gpus[0][1] in d["reason"] and "nvidia-smi" in d["reason"]


def test_visible_gpu_below_sm89_builds_nothing():
    d = decide(gpus=[("8.0", "NVIDIA A100-SXM4-80GB")])
    assert d["archs"] == [] and "sm_80" in d["reason"] and "below sm_89" in d["reason"]
    d = decide(gpus=[("8.0", "NVIDIA A100"), ("9.0", "NVIDIA H100")])
    assert d["archs"] == ["90a-real"] and "left out: NVIDIA A100 sm_80" in d["reason"]


def test_no_gpu_and_no_variable_builds_nothing_and_says_how():
    d = decide(gpus=[])
    assert d["archs"] == []
    for words in ("no GPU is visible", "nvidia-smi not found", "neither HAL_CUDA_ARCHS nor TORCH_CUDA_ARCH_LIST",
                  "HAL_CUDA_ARCHS=all", "TORCH_CUDA_ARCH_LIST=9.0"):
        assert words in d["reason"]
    info = archs.for_cmake(d)
    assert info["cmake"] == "" and info["build_info"]["built"] is False
    assert info["build_info"]["archs_reason"] == d["reason"]


def test_all_switch_builds_every_arch_and_beats_torch_list_and_gpu():
    for value in ("all", "ALL", " all "):
        d = decide({"HAL_CUDA_ARCHS": value, "TORCH_CUDA_ARCH_LIST": "8.9"})
        assert d["archs"] == list(archs.ALL) == ["89-real", "90a-real", "100a-real", "120-real", "120-virtual"]
        assert "HAL_CUDA_ARCHS=all" in d["reason"]


def test_explicit_lists_none_and_auto():
    assert decide({"HAL_CUDA_ARCHS": "90a;120-real"})["archs"] == ["90a", "120-real"]
    assert decide({"HAL_CUDA_ARCHS": "89-real,90a-real"})["archs"] == ["89-real", "90a-real"]
    assert decide({"HAL_CUDA_ARCHS": "none"})["archs"] == []
    assert decide({"HAL_CUDA_ARCHS": "none"})["reason"] == "HAL_CUDA_ARCHS=none: not built on request"
    assert decide({"HAL_CUDA_ARCHS": "auto", "TORCH_CUDA_ARCH_LIST": "8.9"})["archs"] == ["89-real"]
    assert decide({"HAL_CUDA_ARCHS": "auto"}, gpus=H200)["archs"] == ["90a-real"]
    # a CMake define beats the environment
    d = decide({"HAL_CUDA_ARCHS": "all"}, hal_cuda_archs="120-real")
    assert d["archs"] == ["120-real"] and "define" in d["source"]


def test_cmake_cuda_architectures_given_wins():
    d = decide({"HAL_CUDA_ARCHS": "all", "TORCH_CUDA_ARCH_LIST": "8.9"}, cmake_archs="90a")
    assert d["archs"] == ["90a"] and d["reason"] == "CMAKE_CUDA_ARCHITECTURES=90a was given"
    d = decide({"CUDAARCHS": "89-real;90a-real", "HAL_CUDA_ARCHS": "all"})
    assert d["archs"] == ["89-real", "90a-real"] and "CUDAARCHS" in d["reason"]


@pytest.mark.parametrize("env, words", [
    ({"HAL_CUDA_ARCHS": "9.0"}, ["HAL_CUDA_ARCHS", "'9.0'", "TORCH_CUDA_ARCH_LIST's form"]),
    ({"HAL_CUDA_ARCHS": "sm_90"}, ["HAL_CUDA_ARCHS", "'sm_90'", "not a CMake CUDA arch"]),
    ({"HAL_CUDA_ARCHS": "80"}, ["HAL_CUDA_ARCHS", "below sm_89"]),
    ({"HAL_CUDA_ARCHS": ";"}, ["HAL_CUDA_ARCHS", "names no arch"]),
    ({"TORCH_CUDA_ARCH_LIST": "sm_90"}, ["TORCH_CUDA_ARCH_LIST", "'sm_90'", "not an arch"]),
    ({"TORCH_CUDA_ARCH_LIST": "9"}, ["TORCH_CUDA_ARCH_LIST", "'9'"]),
    ({"TORCH_CUDA_ARCH_LIST": "9.0+ptx"}, ["TORCH_CUDA_ARCH_LIST", "'9.0+ptx'"]),
])
def test_bad_values_name_the_variable(env, words):
    with pytest.raises(archs.ArchError) as err:
        decide(env)
    for w in words:
        assert w in str(err.value)


def test_bad_compute_capability_from_nvidia_smi():
    with pytest.raises(archs.ArchError, match="nvidia-smi reported compute capability '\\[N/A\\]'"):
        decide(gpus=[("[N/A]", "Tesla K80")])


def _script(tmp_path, name: str, body: str) -> pathlib.Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_query_gpus_reads_nvidia_smi(tmp_path):
    smi = _script(tmp_path, "nvidia-smi", 'echo "9.0, NVIDIA H200"; echo "8.9, NVIDIA L4"')
    assert archs.query_gpus(str(smi)) == ([("9.0", "NVIDIA H200"), ("8.9", "NVIDIA L4")], "nvidia-smi")
    smi = _script(tmp_path, "nvidia-smi-none", "exit 0")
    assert archs.query_gpus(str(smi)) == ([], "nvidia-smi lists no GPU")
    smi = _script(tmp_path, "nvidia-smi-bad", "echo 'NVIDIA-SMI has failed because it could not talk' >&2\nexit 9")
    gpus, how = archs.query_gpus(str(smi))
    assert gpus == [] and how.startswith("nvidia-smi failed (NVIDIA-SMI has failed")


def test_cli_prints_json_and_fails_naming_the_variable():
    env = {k: v for k, v in os.environ.items() if k not in ("HAL_CUDA_ARCHS", "CUDAARCHS")}
    env["TORCH_CUDA_ARCH_LIST"] = "8.9;9.0"
    run = subprocess.run([sys.executable, str(ROOT / "packs/cuda/archs.py")], env=env, capture_output=True, text=True)
    out = json.loads(run.stdout)
    assert run.returncode == 0 and out["cmake"] == "89-real;90a-real"
    assert out["build_info"] == {"built": True, "archs": "89-real,90a-real", "archs_source": "TORCH_CUDA_ARCH_LIST",
                                 "archs_reason": "TORCH_CUDA_ARCH_LIST=8.9;9.0"}
    run = subprocess.run([sys.executable, str(ROOT / "packs/cuda/archs.py"), "--hal-cuda-archs=bogus"], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "" and "HAL_CUDA_ARCHS='bogus'" in run.stderr


@pytest.mark.parametrize("built, sm, ok", [
    (["89-real"], 89, True), (["89-real"], 90, False), (["90a-real"], 90, True), (["90a-real"], 100, False),
    (["90-virtual"], 120, True), (["90a-virtual"], 100, False), (["120-real"], 121, True), (["121-real"], 120, False),
    (["100a-real"], 103, False), (["89"], 90, True), (list(archs.ALL), 90, True), (list(archs.ALL), 121, True),
    (list(archs.ALL), 103, False),  # sm_103 (B300): 100a code is for sm_100 only, and PTX 120 is newer
    (["89-real", "90a-real"], 120, False), (["native"], 75, True),
])
def test_runs_on(built, sm, ok):
    assert archs.runs_on(built, sm) is ok


def test_pack_and_helper_agree_on_the_minimum():
    assert archs.MIN_SM == cuda_pack.MIN_SM


def test_availability_says_why_nothing_was_built(monkeypatch):
    reason = decide(gpus=[])["reason"]
    monkeypatch.setattr(cuda_pack, "build_info", lambda: archs.for_cmake(decide(gpus=[]))["build_info"])
    monkeypatch.setattr(cuda_pack, "_module", lambda: (_ for _ in ()).throw(ImportError("no _C")))
    a = cuda_pack.PACK._probe()
    assert not a.ok and a.reasons[0] == f"the compiled module was not built when hal was installed: {reason}"
    assert a.build_info["built"] is False and "archs_reason" not in a.build_info  # said once, in the reason


def test_availability_says_when_the_module_has_no_code_for_the_gpu(monkeypatch):
    monkeypatch.setattr(cuda_pack, "_module", lambda: None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cuda_pack, "build_info", lambda: archs.for_cmake(
        decide({"TORCH_CUDA_ARCH_LIST": "8.9"}))["build_info"])
    a = cuda_pack.PACK._probe()
    assert not a.ok and a.reasons == (
        "the compiled module has no code for this GPU (sm_90): it was built for 89-real (TORCH_CUDA_ARCH_LIST=8.9); "
        "reinstall on this machine, or with HAL_CUDA_ARCHS=all",)
    monkeypatch.setattr(cuda_pack, "build_info", lambda: archs.for_cmake(decide(gpus=H200))["build_info"])
    assert cuda_pack.PACK._probe().ok


def _readme_test_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    return blocks[1].strip()


def test_ci_builds_every_arch_before_the_readme_command():
    lines = (ROOT / ".ci/run").read_text().splitlines()
    command = lines.index(_readme_test_command())
    switch = lines.index("export HAL_CUDA_ARCHS=all")
    assert switch < command


# --- CMake configure only (no compile): the log says what will be built ---

def _configure(tmp_path, env_extra: dict, gpu_lines: str | None, *defines: str) -> tuple[subprocess.CompletedProcess,
                                                                                          pathlib.Path]:
    if not shutil.which("cmake"):
        pytest.skip("no cmake")
    if not (shutil.which("nvcc") or os.environ.get("CUDACXX")):
        pytest.skip("no nvcc: CMake skips the cuda pack before choosing archs")
    try:
        pybind11_dir = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True,
                                      text=True, check=True).stdout.strip()
    except subprocess.CalledProcessError:
        pytest.skip("no pybind11 in this Python")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # a fake nvidia-smi first on PATH makes the visible GPU whatever the test says, on any machine
    _script(bindir, "nvidia-smi", f"printf '{gpu_lines}'" if gpu_lines is not None else "exit 0")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HAL_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "CUDAARCHS") and not k.startswith("CMAKE_")}
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env.update(env_extra)
    build = tmp_path / "build"
    run = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
                          f"-Dpybind11_DIR={pybind11_dir}", *defines], env=env, capture_output=True, text=True,
                         timeout=600)
    return run, build / "packs" / "cuda" / "build_info.json"


def test_configure_without_gpu_builds_nothing_and_says_how(tmp_path):
    run, info = _configure(tmp_path, {}, None)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "hal: the cuda pack is not built: no GPU is visible (nvidia-smi lists no GPU)" in run.stdout
    assert "HAL_CUDA_ARCHS=all" in run.stdout
    assert json.loads(info.read_text())["built"] is False


def test_configure_with_a_visible_gpu_builds_its_arch(tmp_path):
    run, info = _configure(tmp_path, {}, "9.0, NVIDIA H200\\n")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "hal: the cuda pack is built for 90a-real: the visible GPU (NVIDIA H200 sm_90, nvidia-smi)" in run.stdout
    data = json.loads(info.read_text())
    assert data["built"] is True and data["archs"] == "90a-real" and data["cuda_compiler"]


def test_configure_fails_on_a_bad_value_naming_the_variable(tmp_path):
    run, _ = _configure(tmp_path, {"TORCH_CUDA_ARCH_LIST": "sm_90"}, None)
    err = " ".join(run.stderr.split())  # CMake wraps the message
    assert run.returncode != 0
    assert "hal: cannot choose the cuda pack's archs: TORCH_CUDA_ARCH_LIST='sm_90'" in err


# --- the CuTe kernels: sm_90a only, CUTLASS's headers from the nvidia-cutlass wheel or a define ---

@pytest.mark.slow   # three CMake configures
def test_configure_builds_the_cute_kernels_only_for_sm90a_with_cutlass(tmp_path):
    """89 alone: not built, because sm_90a is not among the archs; 90a with a folder that holds
    cute/tensor.hpp: built; 90a with a folder that does not: not built, naming the missing headers."""
    inc = tmp_path / "inc"
    (inc / "cute").mkdir(parents=True)
    (inc / "cute" / "tensor.hpp").write_text("// stand-in: configure only reads that it exists\n")
    cases = [("89-real", str(inc), False, "sm_90a is not among the archs built"),
             ("90a-real", str(inc), True, ""),
             ("90a-real", str(tmp_path / "nowhere"), False, "no CUTLASS headers were found")]
    for i, (archs, where, built, why) in enumerate(cases):
        sub = tmp_path / f"c{i}"
        sub.mkdir()
        run, info = _configure(sub, {"HAL_CUDA_ARCHS": archs}, None, f"-DHAL_CUTLASS_INCLUDE={where}")
        assert run.returncode == 0, run.stdout + run.stderr
        data = json.loads(info.read_text())
        assert data["cute"] is built, (archs, where, data)
        if built:
            assert f"hal: the CuTe kernels are built for sm_90a (CUTLASS headers: {where})" in run.stdout
        else:
            assert why in data["cute_reason"] and f"hal: the CuTe kernels are not built: {why}" in run.stdout


def test_build_backend_asks_for_cutlass_only_where_sm90a_is_built(monkeypatch):
    """build_backend/hal_build.py: nvidia-cutlass joins the build requirements only where nvcc is and
    the arch decision (archs.py, what CMake will apply) includes 90a."""
    import importlib.util
    import types

    # scikit-build-core lives only in pip's isolated build environment: a stand-in with its two hooks
    skb, skb_build = types.ModuleType("scikit_build_core"), types.ModuleType("scikit_build_core.build")
    skb_build.get_requires_for_build_wheel = lambda settings=None: ["ninja"]
    skb_build.get_requires_for_build_editable = lambda settings=None: ["ninja"]
    skb.build = skb_build
    monkeypatch.setitem(sys.modules, "scikit_build_core", skb)
    monkeypatch.setitem(sys.modules, "scikit_build_core.build", skb_build)
    spec = importlib.util.spec_from_file_location("hal_build_under_test", ROOT / "build_backend" / "hal_build.py")
    hal_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hal_build)
    monkeypatch.setattr(hal_build, "_cuda_compiler", lambda: True)
    for k in ("HAL_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "CUDAARCHS"):
        monkeypatch.delenv(k, raising=False)
    asks = lambda settings=None: hal_build.CUTLASS in hal_build.get_requires_for_build_wheel(settings)  # noqa: E731
    for value, want in (("all", True), ("90a", True), ("89-real;120-real", False), ("none", False)):
        monkeypatch.setenv("HAL_CUDA_ARCHS", value)
        assert asks() is want, value
    monkeypatch.delenv("HAL_CUDA_ARCHS")
    assert asks({"cmake.define.HAL_CUDA_ARCHS": "all"}) is True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert asks() is True
    monkeypatch.setattr(hal_build, "_cuda_compiler", lambda: False)
    assert asks() is False   # no nvcc: no cuda pack, no headers needed
    assert hal_build.get_requires_for_build_editable() == ["ninja"]
