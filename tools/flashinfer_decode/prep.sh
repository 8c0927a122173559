#!/bin/bash
# Prepare what the H200 needs, beside the working tree, for the decode bench's FlashInfer baselines
# (docs/bench.md, "On the H200 (with FlashInfer)"): flashinfer-python trimmed, with the sm_90a modules
# that BatchDecodeWithPagedKVCacheWrapper loads prebuilt here, for head_dim 64, 128 and 256 (the page
# size is a run-time argument of these modules: 16 and 64 both run). It supersedes, for the decode
# bench, ../shared/tools/flashinfer/prep_flashinfer_carry.sh (head_dim 128 only, plus XQA).
#
# Writes into $CARRY_DIR (default .whl, git-ignored):
#   fi_decode.tar.xz               flashinfer-python $FI_VER trimmed (as ../shared/tools/flashinfer
#                                  trims it) with flashinfer/data/aot/ holding, for bf16 q/o, bf16 and
#                                  e4m3fn KV, int32 indices, head_dim 64/128/256, no RoPE/window/soft cap:
#                                  tc: the fa2 batch-prefill primary modules (use_tensor_cores=True,
#                                      backend="fa2": the bench's flashinfer-tc)
#                                  cc: the batch-decode modules (use_tensor_cores=False: flashinfer-cc)
#   apache_tvm_ffi-*-cp312-*.whl   FlashInfer's one dependency missing from the H200 image (kept if there)
# Run from the repository root on a machine with nvcc 13 and a C++ compiler; no GPU needed. About 15
# minutes on 2 cores (2026-12-05, MAX_JOBS=2: 797 s compiling the 12 modules, most of it the tc ones;
# fi_decode.tar.xz 26.9 MB, the tvm-ffi wheel 3.3 MB):
#
#   nice -n 10 env MAX_JOBS=2 tools/flashinfer_decode/prep.sh > /tmp/fi_decode.log 2>&1
#
# Knobs: PYTHON (an interpreter with torch, any build: only its C++ ABI flag is read; default
# .venv/bin/python), FI_VER, TVM_VER, MODULES ("tc cc"), HEADS ("64 128 256"), KVS ("bf16 e4m3fn"),
# MAX_JOBS (default 1), CARRY_DIR, KEEP_WORK=1 (keep the temporary directory, printed).
# On the H200:  pip install --no-deps --target /tmp/site the tvm-ffi wheel; tar -xJf fi_decode.tar.xz -C /tmp/site
# (tools/gpu_decode.sh does both).
set -euo pipefail
FI_VER=${FI_VER:-0.7.4}
TVM_VER=${TVM_VER:-0.1.15.post2}
MODULES=${MODULES:-"tc cc"}
HEADS=${HEADS:-"64 128 256"}
KVS=${KVS:-"bf16 e4m3fn"}
CARRY_DIR=${CARRY_DIR:-.whl}
PYTHON=${PYTHON:-.venv/bin/python}
export MAX_JOBS=${MAX_JOBS:-1}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")
WORK=$(mktemp -d /tmp/fi_decode.XXXXXX)
if [ "${KEEP_WORK:-0}" = 1 ]; then echo "work directory: $WORK (kept)"; else trap 'rm -rf "$WORK"' EXIT; fi
if [ "$CARRY_DIR" = ".whl" ] && [ -d .git ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.whl/ >> .git/info/exclude; }
fi
mkdir -p "$CARRY_DIR"
CARRY_DIR=$(cd "$CARRY_DIR" && pwd)
say() { echo "[$(date +%H:%M:%S)] $*"; }
T0=$(date +%s)

"$PYTHON" -c 'import torch' || { echo "PYTHON=$PYTHON cannot import torch" >&2; exit 2; }
command -v nvcc >/dev/null || [ -x "$CUDA_HOME/bin/nvcc" ] || { echo "no nvcc (CUDA_HOME=$CUDA_HOME)" >&2; exit 2; }
export PATH="$CUDA_HOME/bin:$PATH"

# 1. flashinfer and what it imports, into a private site directory (nothing installed elsewhere)
say "installing flashinfer-python $FI_VER into $WORK/site"
extra=()
for m in jinja2 markupsafe click tqdm requests urllib3 idna certifi charset_normalizer packaging numpy; do
  "$PYTHON" -c "import $m" 2>/dev/null || extra+=("$m")
done
"$PYTHON" -m pip install -q --disable-pip-version-check --target "$WORK/site" --no-deps \
  "flashinfer-python==$FI_VER" "apache-tvm-ffi==$TVM_VER" einops tabulate nvidia-ml-py ninja "${extra[@]}"
export PYTHONPATH="$WORK/site" PATH="$WORK/site/bin:$PATH"

# 2. a stub libcuda.so: FlashInfer links every module with -lcuda; linking against a stub records
#    libcuda.so.1 as NEEDED, and the H200's driver library is loaded with the module
mkdir -p "$WORK/stubs"
cat > "$WORK/stubs/cuda_stub.c" <<'EOF'
int cuGetErrorName(int e, const char **s) { return 0; }
int cuGetErrorString(int e, const char **s) { return 0; }
int cuTensorMapEncodeTiled(void) { return 0; }
int cuGetProcAddress(void) { return 0; }
int cuDriverGetVersion(int *v) { return 0; }
EOF
gcc -shared -fPIC "$WORK/stubs/cuda_stub.c" -o "$WORK/stubs/libcuda.so" -Wl,-soname,libcuda.so.1

# 3. build the modules for sm_90a
# shellcheck disable=SC2086
FLASHINFER_CUDA_ARCH_LIST="9.0a" FLASHINFER_WORKSPACE_BASE="$WORK/ws" "$PYTHON" "$HERE/prebuild.py" $MODULES $HEADS $KVS --names
say "building: $MODULES, head_dim $HEADS, KV $KVS (MAX_JOBS=$MAX_JOBS)"
TB=$(date +%s)
# shellcheck disable=SC2086
LIBRARY_PATH="$WORK/stubs" FLASHINFER_CUDA_ARCH_LIST="9.0a" FLASHINFER_WORKSPACE_BASE="$WORK/ws" \
  AOT_OUT="$WORK/aot" "$PYTHON" "$HERE/prebuild.py" $MODULES $HEADS $KVS
say "built in $(( $(date +%s) - TB )) s"

# 4. trim the package as ../shared/tools/flashinfer/prep_flashinfer_carry.sh does: all Python, the
#    headers, the top-level kernel sources under 300 kB (FlashInfer reads the batch_prefill/batch_decode
#    ones to name a module even when it is prebuilt), no other sources; then the prebuilt modules in data/aot
SP="$WORK/site"
mkdir -p "$WORK/trim"
cp -a "$SP/flashinfer" "$SP/flashinfer_python-$FI_VER.dist-info" "$WORK/trim/"
(cd "$WORK/trim/flashinfer"
 find . -name __pycache__ -prune -exec rm -rf {} +
 (cd data/csrc
  for d in */; do case "$d" in xqa/|nv_internal/|generated/|cake_device_helpers/) ;; *) rm -rf "$d";; esac; done
  find . -maxdepth 1 -type f -size +300k -delete)
 find . -path ./data -prune -o -type f \( -name "*.cu" -o -name "*.cuh" -o -name "*.cpp" -o -name "*.cc" \) -print \
   | xargs -r rm -f
 mkdir -p data/aot && cp -a "$WORK/aot/." data/aot/)

# 5. check, on this machine, that the trimmed package imports and that every module the wrapper asks
#    for resolves to its data/aot with JIT disabled; then load each through the wrapper's own entry
#    point (flashinfer.prefill.get_batch_prefill_module / flashinfer.decode.get_batch_decode_module),
#    with the stub standing in for the driver library (a module that fails to load here is reported,
#    not fatal: this machine has no GPU)
say "checking the trimmed package"
ln -sf libcuda.so "$WORK/stubs/libcuda.so.1"
# shellcheck disable=SC2086
PYTHONPATH="$WORK/trim:$WORK/site" FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE="$WORK/ws2" \
  FLASHINFER_CUDA_ARCH_LIST="9.0a" LD_LIBRARY_PATH="$WORK/stubs:$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$PYTHON" - $MODULES $HEADS $KVS <<'EOF'
import sys
import torch
import flashinfer
from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: F401  (the bench's entry point)
from flashinfer.jit import env as jit_env
from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_decode_module
assert "/trim/" in flashinfer.__file__, flashinfer.__file__
words = sys.argv[1:]
kinds = [k for k in ("tc", "cc") if k in words]
heads = [int(w) for w in words if w.isdigit()]
kvs = [{"bf16": torch.bfloat16, "e4m3fn": torch.float8_e4m3fn}[w] for w in words if w in ("bf16", "e4m3fn")]
bf16, i32 = torch.bfloat16, torch.int32
want, loaded, not_loaded = set(), 0, []
for kind in kinds:
    for d in heads:
        for kv in kvs:
            if kind == "tc":  # the arguments decode.py's plan() passes with use_tensor_cores=True, backend="fa2"
                args = (bf16, kv, bf16, i32, d, d, 0, False, False, False, False)
                spec = _gen_batch_prefill_primary_module("fa2", *args)
                from flashinfer.prefill import get_batch_prefill_module as get
                load = lambda: get("fa2", *args)  # noqa: E731
            else:  # use_tensor_cores=False
                args = (bf16, kv, bf16, i32, d, d, 0, False, False)
                spec = gen_batch_decode_module(*args)
                from flashinfer.decode import get_batch_decode_module as get
                load = lambda: get(*args)  # noqa: E731
            path = spec.aot_path
            assert spec.is_aot and path.is_file() and "/trim/flashinfer/data/aot/" in str(path), path
            want.add(spec.name)
            try:
                load()
                loaded += 1
                how = "loaded"
            except Exception as exc:  # no GPU here: a load failure is reported, the resolution is what counts
                not_loaded.append(f"{spec.name}: {type(exc).__name__}: {str(exc)[:200]}")
                how = "not loaded here"
            print(f"ok {kind} head_dim {d} kv {str(kv).removeprefix('torch.')}: {spec.name} "
                  f"({path.stat().st_size} bytes in data/aot, {how})", flush=True)
extra = {p.name for p in jit_env.FLASHINFER_AOT_DIR.iterdir()} - want
assert not extra, f"data/aot holds modules nobody asked for: {sorted(extra)}"
print(f"{len(want)} modules resolve to data/aot with FLASHINFER_DISABLE_JIT=1; {loaded} loaded on this machine")
for line in not_loaded:
    print("  not loaded:", line)
EOF

# 6. pack
say "packing"
tar -C "$WORK/trim" -cf - flashinfer "flashinfer_python-$FI_VER.dist-info" | xz -T2 -6 > "$CARRY_DIR/fi_decode.tar.xz"

# 7. the tvm-ffi wheel for the H200's Python 3.12 (kept when already there)
ls "$CARRY_DIR"/apache_tvm_ffi-"$TVM_VER"-cp312-*.whl >/dev/null 2>&1 || \
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY_DIR" "apache-tvm-ffi==$TVM_VER"

# 8. what is carried, against the 64 MiB a device call takes (working tree included)
files=("$CARRY_DIR/fi_decode.tar.xz" "$CARRY_DIR"/apache_tvm_ffi-"$TVM_VER"-cp312-*.whl)
ls -la "${files[@]}"
echo "fi_decode.tar.xz unpacks to $(xz -dc "$CARRY_DIR/fi_decode.tar.xz" | wc -c) bytes"
total=$(cat "${files[@]}" | wc -c)
echo "carry total: $total bytes ($(( total * 100 / (64 << 20) ))% of 64 MiB, before the working tree)"
if git rev-parse --show-toplevel >/dev/null 2>&1; then
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1) || true
  echo "working tree (tracked + untracked, not ignored): $tree bytes; with the carry: $(( (tree + total) * 100 / (64 << 20) ))% of 64 MiB"
fi
say "done in $(( $(date +%s) - T0 )) s"
