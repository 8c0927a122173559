#!/bin/bash
# Prepare what the H200 needs, beside the working tree, for the MLA decode bench's baselines
# (docs/bench.md, "MLA decode"): FlashInfer's BatchMLAPagedAttentionWrapper (fa3 backend) with its
# two sm_90a modules prebuilt here, and the FlashMLA wheel.
#
# Writes into $CARRY_DIR (default .whl, git-ignored):
#   fi_mla.tar.xz                  flashinfer-python $FI_VER trimmed (as ../shared/tools/flashinfer
#                                  trims it) with flashinfer/data/aot/ holding the fa3 MLA modules for
#                                  bf16 q/o, bf16 and e4m3fn KV, head_dim_ckv 512, head_dim_kpe 64
#   apache_tvm_ffi-*-cp312-*.whl   FlashInfer's one dependency missing from the H200 image
#   sgl_flash_mla-1.0.0-*.whl      FlashMLA (dense bf16 and dense FP8 decode on sm_90, "legacy" ops)
# Run from the repository root on a machine with nvcc 13 and a C++ compiler; no GPU needed. It
# compiles three CUDA files per module: about 3 minutes on 2 cores (2026-12-02, MAX_JOBS=2).
#
#   nice -n 19 env MAX_JOBS=2 tools/flashinfer_mla/prep.sh > /tmp/fi_mla.log 2>&1
#
# Knobs: PYTHON (an interpreter with torch, any build: only its C++ ABI flag is read; default
# .venv/bin/python), FI_VER, TVM_VER, MODULES ("bf16 e4m3fn"; add "fa2" for the fa2 modules),
# MAX_JOBS (default 1), CARRY_DIR, KEEP_WORK=1 (keep the temporary directory, printed).
# On the H200:  pip install --no-deps --target /tmp/site the two wheels; tar -xJf fi_mla.tar.xz -C /tmp/site
set -euo pipefail
FI_VER=${FI_VER:-0.7.4}
TVM_VER=${TVM_VER:-0.1.15.post2}
FLASHMLA=${FLASHMLA:-sgl-flash-mla==1.0.0}
MODULES=${MODULES:-"bf16 e4m3fn"}
CARRY_DIR=${CARRY_DIR:-.whl}
PYTHON=${PYTHON:-.venv/bin/python}
export MAX_JOBS=${MAX_JOBS:-1}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")
WORK=$(mktemp -d /tmp/fi_mla.XXXXXX)
if [ "${KEEP_WORK:-0}" = 1 ]; then echo "work directory: $WORK (kept)"; else trap 'rm -rf "$WORK"' EXIT; fi
mkdir -p "$CARRY_DIR"
CARRY_DIR=$(cd "$CARRY_DIR" && pwd)
say() { echo "[$(date +%H:%M:%S)] $*"; }

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
say "building: $MODULES (MAX_JOBS=$MAX_JOBS)"
LIBRARY_PATH="$WORK/stubs" FLASHINFER_CUDA_ARCH_LIST="9.0a" FLASHINFER_WORKSPACE_BASE="$WORK/ws" \
  AOT_OUT="$WORK/aot" "$PYTHON" "$HERE/prebuild_mla.py" $MODULES
say "built"

# 4. trim the package as ../shared/tools/flashinfer/prep_flashinfer_carry.sh does: all Python, the
#    headers, the top-level kernel sources under 300 kB (FlashInfer reads the MLA ones to name a
#    module even when it is prebuilt), no other sources; then the prebuilt modules in data/aot
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

# 5. check, on this machine, that the trimmed package imports and resolves both modules to data/aot
say "checking the trimmed package"
PYTHONPATH="$WORK/trim:$WORK/site" FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE="$WORK/ws2" FLASHINFER_CUDA_ARCH_LIST="9.0a" \
  "$PYTHON" - $MODULES <<'EOF'
import sys
import torch
import flashinfer
from flashinfer.jit import env as jit_env, gen_batch_mla_module
from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401  (the bench's entry point)
assert "/trim/" in flashinfer.__file__, flashinfer.__file__
kvs = [{"bf16": torch.bfloat16, "e4m3fn": torch.float8_e4m3fn}[w] for w in sys.argv[1:] if w in ("bf16", "e4m3fn")]
for kv in kvs:
    s = gen_batch_mla_module("fa3", torch.bfloat16, kv, torch.bfloat16, torch.int32, 512, 64, False)
    path = jit_env.FLASHINFER_AOT_DIR / s.name / f"{s.name}.so"
    assert path.is_file(), path
    print("ok", s.name, path.stat().st_size, "bytes in data/aot", flush=True)
EOF

# 6. pack
tar -C "$WORK/trim" -cf - flashinfer "flashinfer_python-$FI_VER.dist-info" | xz -T2 -6 > "$CARRY_DIR/fi_mla.tar.xz"

# 7. the two wheels for the H200's Python 3.12 (kept when already there)
ls "$CARRY_DIR"/apache_tvm_ffi-"$TVM_VER"-cp312-*.whl >/dev/null 2>&1 || \
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY_DIR" "apache-tvm-ffi==$TVM_VER"
ls "$CARRY_DIR"/sgl_flash_mla-*.whl >/dev/null 2>&1 || "$PYTHON" -m pip download -q --no-deps -d "$CARRY_DIR" "$FLASHMLA"

# 8. what is carried, against the 64 MiB a device call takes (working tree included)
files=("$CARRY_DIR/fi_mla.tar.xz" "$CARRY_DIR"/apache_tvm_ffi-"$TVM_VER"-cp312-*.whl "$CARRY_DIR"/sgl_flash_mla-*.whl)
ls -la "${files[@]}"
total=$(cat "${files[@]}" | wc -c)
echo "carry total: $total bytes ($(( total * 100 / (64 << 20) ))% of 64 MiB, before the working tree)"
say "done"
