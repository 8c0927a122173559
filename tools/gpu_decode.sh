#!/usr/bin/env bash
# The cuda pack's decode kernel on the lent H200 (docs/cuda.md, docs/plans.md): its GPU tests, the
# sanitizers on the split-K merge, forced-split timings, host time and the decode bench with
# FlashInfer. Run from the repo root on the device machine, with the module (built here for Python
# 3.12 and xz'd to build/C312.so.xz, or packs/cuda/_C*.so) and `.whl` carried along: FlashInfer's trimmed
# copy fi_decode.tar.xz and the tvm-ffi wheel from tools/flashinfer_decode/prep.sh (head_dim 64/128/256,
# pages 16 and 64; preferred), else fi_trim.tar.xz from ../shared/tools/flashinfer/prep_flashinfer_carry.sh
# (head_dim 128 only: the other head sizes are skip rows).
#   STEPS="tests bench" (default), also "all-cuda" (every cuda test), "sanitizer", "sweep" (tools/split_sweep.py; SWEEP="--parts ...")
#   and "host" (tools/host_time, tools/host_breakdown.py)
#   BENCH="decode-gaps", KV="bf16,e4m3fn", BUDGET=1 (seconds a row), CONTENDERS (default below),
#   SANITIZERS="memcheck racecheck synccheck"
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests bench"}
if [ -f build/C312.so.xz ]; then xz -dc build/C312.so.xz > packs/cuda/_C.cpython-312-x86_64-linux-gnu.so; fi
FI_TAR=""
for f in .whl/fi_decode.tar.xz .whl/fi_trim.tar.xz; do [ -f "$f" ] && { FI_TAR=$f; break; }; done
if [ -n "$FI_TAR" ]; then
  echo "FlashInfer from $FI_TAR"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/apache_tvm_ffi*.whl \
    && tar -xJf "$FI_TAR" -C /tmp/site || echo "FlashInfer could not be installed" >&2
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_cuda_split.py tests/test_cuda_pack.py \
             tests/test_plan.py -m "cuda and not slow" 2>&1 | tail -30 | tee "$OUT/pytest.log" ;;
    all-cuda)  # every cuda-marked test of the suite (the MLA and multi-token grids too)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -n 12 tests -m "cuda and not slow" 2>&1 | tail -30 \
        | tee "$OUT/pytest_all.log" ;;
    sanitizer)  # the in-kernel merge's handshake and the reduce launch, FP8 and bf16
      for tool in ${SANITIZERS:-memcheck racecheck synccheck}; do
        timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
          tests/test_cuda_split.py -k "equals_the_reduce and (gqa16 or features or 16-heads or 64-rows) and (e4m3 or bfloat16)" \
          2>&1 | tail -6 | tee "$OUT/sanitizer_$tool.log"
      done ;;
    sweep) timeout 400 python3 tools/split_sweep.py ${SWEEP:-} 2>&1 | tee "$OUT/sweep.txt" | tail -80 ;;
    host) timeout 300 python3 tools/host_time --device cuda --json "$OUT/host_time.json" 2>&1 | tail -30 \
            | tee "$OUT/host_time.txt"
          timeout 120 python3 tools/host_breakdown.py 2>&1 | tee "$OUT/host_breakdown.txt" ;;
    bench) timeout 480 python3 tools/bench --shapes ${BENCH:-decode-gaps} --kv-dtype ${KV:-bf16,e4m3fn} \
             --contenders ${CONTENDERS:-hal hal-plan flashinfer-tc} --budget ${BUDGET:-1} \
             --json "$OUT/bench-decode.json" 2>"$OUT/bench-progress.log" | tee "$OUT/bench-decode.txt" | tail -40
           tail -3 "$OUT/bench-progress.log" ;;
  esac
done
