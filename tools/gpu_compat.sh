#!/usr/bin/env bash
# hal.compat on the lent GPU (docs/engines.md): the entry points against the real libraries, then the
# bench rows of each entry point beside the library it replaces, and their host time per call. Run from
# the repo root on the device machine with `.whl` (FlashInfer's trimmed copy and tvm-ffi from
# ../shared/tools/flashinfer/prep_flashinfer_carry.sh, the fa3-fwd 0.0.3 wheel) and the module
# (build/C312.so.xz, as tools/gpu_prefill.sh) carried along.
#   STEPS="tests bench host" (default)
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests bench host"}
if [ -f build/C312.so.xz ]; then xz -dc build/C312.so.xz > packs/cuda/_C.cpython-312-x86_64-linux-gnu.so; fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && { [ ! -f .whl/fi_trim.tar.xz ] || tar -xJf .whl/fi_trim.tar.xz -C /tmp/site; } || echo "baselines could not be installed" >&2
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_compat_gpu.py tests/test_compat.py \
             2>&1 | tail -30 | tee "$OUT/pytest_compat.log" ;;
    bench) timeout 300 python3 tools/bench --shapes ${BENCH:-64x4096x32x8x128 16x1024x32x8x128 8x2048/32x8x128} \
             --kv-dtype ${KV:-bf16,e4m3fn} --contenders hal hal-plan compat-fa2 compat-fa3 compat-flashinfer \
             flashinfer-tc flashinfer-prefill fa3 --budget ${BUDGET:-0.5} --json "$OUT/bench-compat.json" \
             2>"$OUT/bench-progress.log" | tee "$OUT/bench-compat.txt" | tail -3 ;;
    host) timeout 200 python3 tools/host_time --shapes 64x1024x32x8x128 --kv-dtype bf16,e4m3fn \
             --json "$OUT/host-compat.json" 2>&1 | tee "$OUT/host-compat.txt" | tail -20 ;;
  esac
done
