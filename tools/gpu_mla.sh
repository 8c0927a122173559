#!/usr/bin/env bash
# The cuda pack's MLA decode kernels on the lent H200 (docs/cuda.md, "MLA decode"): the GPU tests, then
# the MLA bench with its baselines. Run from the repo root on the device machine, with the module (built
# here for Python 3.12 and xz'd to build/C312.so.xz, or packs/cuda/_C*.so) and, for the baselines, what
# tools/flashinfer_mla/prep.sh wrote into .whl (fi_mla.tar.xz, the tvm-ffi and sgl-flash-mla wheels)
# carried along.
#   STEPS="tests bench" (default), also "sanitizer" (memcheck and racecheck on the sm_90a kernel)
#   BENCH="mla mla-b16", KV="bf16,e4m3fn", BUDGET=1 (seconds a row), CONTENDERS (default below), BENCH_T=480
#   (the bench step's time limit, seconds). The bench writes bench-mla.json and bench-mla.md (the docs' table;
#   `tools/bench --render bench-mla.json --markdown F` remakes it from a run cut short)
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests bench"}
if [ -f build/C312.so.xz ]; then xz -dc build/C312.so.xz > packs/cuda/_C.cpython-312-x86_64-linux-gnu.so; fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    || echo "baseline wheels could not be installed" >&2
  [ -f .whl/fi_mla.tar.xz ] && tar -xJf .whl/fi_mla.tar.xz -C /tmp/site
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_cuda_mla.py 2>&1 | tail -30 \
             | tee "$OUT/pytest_mla.log" ;;
    sanitizer)
      for tool in memcheck racecheck; do
        timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
          tests/test_cuda_mla.py -k "forced_wgmma and (128-heads or speculative-16x4 or split-long) and (bfloat16 or e4m3)" \
          2>&1 | tail -6 | tee "$OUT/sanitizer_$tool.log"
      done ;;
    bench) timeout ${BENCH_T:-480} python3 tools/bench --shapes ${BENCH:-mla mla-b16} --kv-dtype ${KV:-bf16,e4m3fn} \
             --contenders ${CONTENDERS:-hal hal:cuda-mma hal:cuda-wgmma flashmla flashmla-fp8 flashinfer-mla torch} \
             --budget ${BUDGET:-1} --json "$OUT/bench-mla.json" --markdown "$OUT/bench-mla.md" 2>"$OUT/bench-progress.log" \
             | tee "$OUT/bench-mla.txt" | tail -3
           tail -3 "$OUT/bench-progress.log" ;;
  esac
done
