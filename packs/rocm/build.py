"""Building the rocm pack's kernels: device code objects (one per arch) and the CPU emulation library.

One place for the compiler search and the flags, used by CMake at install time
(``python build.py --out DIR``) and by the tests (``build_code_objects(tmp_dir)``), so both compile the
same way. Stdlib only: CMake runs this with the build's own Python, which has neither torch nor hal.

Device recipe (docs/rocm.md, "Build"): clang's HIP language mode, device-only, ``-nogpuinc -nogpulib``
with the pack's own ``csrc/mini_hip.h``; no ROCm headers or device libraries are needed. The compiler
is ROCm's clang when present, otherwise a clang with the AMDGPU target (Debian's clang-19 + lld-19).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

try:
    from . import codeobj, kernels
except ImportError:  # run as a script by CMake
    import codeobj
    import kernels

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
SOURCE = "kernels.hip"
CODE_OBJECT = kernels.CODE_OBJECT
MLA_SOURCE = "mla_kernels.hip"
MLA_CODE_OBJECT = kernels.MLA_CODE_OBJECT
PREFILL_SOURCE = "prefill_kernels.hip"
PREFILL_CODE_OBJECT = kernels.PREFILL_CODE_OBJECT
# Each code object of an arch: its source and the kernels it must define. Apart because their occupancy
# designs differ (4 waves per SIMD for paged decode, 2 for MLA decode and multi-token: docs/rocm.md).
UNITS = ((SOURCE, CODE_OBJECT, kernels.kernel_names), (MLA_SOURCE, MLA_CODE_OBJECT, kernels.mla_kernel_names),
         (PREFILL_SOURCE, PREFILL_CODE_OBJECT, kernels.prefill_kernel_names))
INSTALL_DIR = "codeobjects"  # next to this file in the installed package: codeobjects/<arch>/hal_rocm.hsaco
BUILD_INFO = "build_info.json"
# clang++ names searched in order after ROCm's; the first one whose AMDGPU target works is used.
CANDIDATES = ("/opt/rocm/llvm/bin/clang++", "clang++-19", "clang++-20", "clang++-21", "clang++-22", "clang++")
DEVICE_FLAGS = ("-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output", "-nogpuinc", "-nogpulib", "-O3",
                "-std=c++17", "-Rpass-analysis=kernel-resource-usage")
HOST_FLAGS = ("-x", "c++", "-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-DHAL_WAVE64_SIM")


class BuildError(RuntimeError):
    pass


def sources(csrc=CSRC) -> list[pathlib.Path]:
    return sorted(p for p in pathlib.Path(csrc).iterdir() if p.suffix in (".h", ".hip", ".cpp"))


def source_hash(csrc=CSRC) -> str:
    """Identifies the kernel sources (and the parameter lists) a build came from."""
    h = hashlib.sha256()
    for p in sources(csrc):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(json.dumps(kernels.PARAMS, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _version(clang: str) -> str:
    first = _run([clang, "--version"]).stdout.splitlines()
    return first[0].strip() if first else "unknown"


def _has_amdgpu(clang: str) -> bool:
    try:
        out = _run([clang, "-print-targets"], timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "amdgcn" in out


def find_clang(explicit: str | None = None) -> tuple[str | None, str]:
    """A clang++ with the AMDGPU target, or (None, why none was found)."""
    tried = []
    for cand in [explicit] if explicit else CANDIDATES:  # an explicit choice is the only one tried
        path = cand if os.path.isabs(cand) else shutil.which(cand)
        if not path or not os.path.exists(path):
            tried.append(f"{cand}: not found")
            continue
        if _has_amdgpu(path):
            return path, f"{path} ({_version(path)})"
        tried.append(f"{cand}: no AMDGPU target")
    return None, ("no clang++ with the AMDGPU target (install ROCm, or Debian's clang-19 lld-19 llvm-19); tried "
                  + "; ".join(tried))


def arch_support(clang: str, arch: str) -> str | None:
    """None when ``clang`` can compile for ``arch``, else the compiler's reason."""
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "probe.hip"
        src.write_text('extern "C" __attribute__((global)) void probe() {}\n')
        res = _run([clang, *DEVICE_FLAGS[:-1], f"--offload-arch={arch}", "-c", str(src), "-o", str(src) + ".o"])
    if res.returncode == 0:
        return None
    lines = [ln for ln in res.stderr.splitlines() if "error" in ln] or res.stderr.splitlines() or ["unknown error"]
    return lines[0].split("error: ", 1)[-1].strip()


def device_command(clang: str, arch: str, out: pathlib.Path, csrc=CSRC, source: str = SOURCE) -> list[str]:
    csrc = pathlib.Path(csrc)
    return [clang, *DEVICE_FLAGS, f"--offload-arch={arch}", f"-I{csrc}", "-c", str(csrc / source), "-o", str(out)]


def parse_remarks(text: str) -> dict[str, dict[str, str]]:
    """``-Rpass-analysis=kernel-resource-usage`` remarks per kernel (the compiler's own occupancy)."""
    rows: dict[str, dict[str, str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            cur = rows.setdefault(m.group(1), {})
            continue
        m = re.search(r"remark:\s+([A-Za-z ]+?)(?: \[[^\]]*\])?: (\S+) \[-Rpass", line)
        if m and cur is not None:
            cur[m.group(1)] = m.group(2)
    return rows


def build_code_objects(out_dir, archs=None, clang: str | None = None, log=print, csrc=CSRC) -> dict:
    """Compile one code object per arch into ``out_dir/<arch>/hal_rocm.hsaco`` and write
    ``out_dir/build_info.json``. ``archs`` defaults to gfx90a and gfx942 plus every optional arch
    (gfx950) the compiler knows; an optional arch it does not know is recorded as not built, with why."""
    out_dir = pathlib.Path(out_dir)
    path, how = find_clang(clang)
    if path is None:
        raise BuildError(how)
    requested = list(archs) if archs else list(kernels.DEFAULT_ARCHS) + list(kernels.OPTIONAL_ARCHS)
    info = {"compiler": how, "source_hash": source_hash(csrc), "flags": list(DEVICE_FLAGS), "archs": {},
            "not_built": {}}
    for arch in requested:
        why = arch_support(path, arch)
        if why is not None:
            if arch in kernels.OPTIONAL_ARCHS and not archs:
                why = why.split(";")[0]
                info["not_built"][arch] = f"{how.split(' (')[0]} cannot target {arch}: {why}"
                log(f"hal rocm: {arch} not built: {why}")
                continue
            raise BuildError(f"{path} cannot compile for {arch}: {why}")
        entry = {"code_object": f"{arch}/{CODE_OBJECT}", "code_objects": {}, "kernels": {}}
        for source, name, names_for in UNITS:
            target = out_dir / arch / name
            target.parent.mkdir(parents=True, exist_ok=True)
            res = _run(device_command(path, arch, target, csrc, source))
            if res.returncode != 0:
                raise BuildError(f"compiling {source} for {arch} failed:\n{res.stderr[-4000:]}")
            co = codeobj.read(target)
            remarks = parse_remarks(res.stderr)
            expected = names_for(arch)
            if sorted(co.kernels) != expected:
                missing, extra = set(expected) - set(co.kernels), set(co.kernels) - set(expected)
                raise BuildError(f"{arch} {name}: code object kernels differ from kernels.py: missing "
                                 f"{sorted(missing)}, unexpected {sorted(extra)}")
            if name == CODE_OBJECT:
                entry.update(target=co.target, bytes=target.stat().st_size)
            entry["code_objects"][name] = {"source": source, "bytes": target.stat().st_size}
            entry["kernels"].update(
                {k: {**kern.resources(), "compiler_occupancy": int(remarks.get(k, {}).get("Occupancy", -1))}
                 for k, kern in sorted(co.kernels.items())})
            log(f"hal rocm: {arch}: {len(co.kernels)} kernels -> {target}")
        info["archs"][arch] = entry
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def emulation_library(out_dir, fnuz_hw: bool, clang: str | None = None, csrc=CSRC,
                      source: str = SOURCE) -> pathlib.Path:
    """Compile the same kernel sources for the host against csrc/wave64_host.h. ``fnuz_hw``: emulate gfx942
    (hardware fnuz FP8 conversions) rather than gfx90a (software FP8). ``source``: the code object's
    source (``SOURCE``, ``MLA_SOURCE`` or ``PREFILL_SOURCE``: one library per code object)."""
    path, how = find_clang(clang)
    host = path or shutil.which("clang++")
    if host is None:
        raise BuildError(how)
    unit = "" if source == SOURCE else "_" + pathlib.Path(source).stem
    out = pathlib.Path(out_dir) / f"libhal_rocm{unit}_emu_{'gfx942' if fnuz_hw else 'gfx90a'}.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    csrc = pathlib.Path(csrc)
    cmd = [host, *HOST_FLAGS, f"-DHAL_WAVE64_FNUZ_HW={int(fnuz_hw)}", f"-I{csrc}", str(csrc / source),
           str(csrc / "wave64_host.cpp"), "-o", str(out)]
    res = _run(cmd)
    if res.returncode != 0:
        raise BuildError(f"compiling the CPU emulation failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Build the rocm pack's code objects")
    ap.add_argument("--out", help="output folder (one subfolder per arch + build_info.json)")
    ap.add_argument("--archs", default="", help="';'- or ','-separated archs (default: gfx90a, gfx942, "
                                                  "and gfx950 when the compiler knows it)")
    ap.add_argument("--clang", default=None, help="clang++ to use (default: search)")
    ap.add_argument("--find-clang", action="store_true", help="print the clang++ that would be used and exit "
                                                               "(status 1 and the reason when there is none)")
    args = ap.parse_args(argv)
    if args.find_clang:
        path, how = find_clang(args.clang)
        print(path or how)
        return 0 if path else 1
    if not args.out:
        ap.error("--out is required")
    archs = [a for a in re.split(r"[;,\s]+", args.archs) if a] or None
    try:
        build_code_objects(args.out, archs, args.clang)
    except BuildError as exc:
        print(f"hal rocm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
