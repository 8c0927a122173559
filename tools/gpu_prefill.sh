#!/usr/bin/env bash
# The cuda pack's multi-token kernels on the lent H200 (docs/cuda.md, "Multi-token attention"): the GPU
# tests, then the prefill bench with its baselines. Run from the repo root on the device machine, with
# `.whl` (FlashInfer's trimmed copy and tvm-ffi from ../shared/tools/flashinfer/prep_flashinfer_carry.sh,
# the fa3-fwd 0.0.3 wheel) and the module (built here for Python 3.12 and xz'd to build/C312.so.xz, or
# packs/cuda/_C*.so) carried along.
#   STEPS="tests bench" (default), also "slow" (128K prefill, 4 GiB cache), "wgmma-grid" (the whole grid
#   with HAL_CUDA_PREFILL=wgmma), "tune" (tools/tune --prefill; TUNE_WRITE=1 writes and returns
#   tuning.json), "sanitizer", "profile" (ncu)
#   "cute" (the CuTe kernel's forced tests and CUDA-graph replay), "cute-grid" (the whole cuda grid with
#   HAL_CUDA_PREFILL=cute), "cute-sanitizer" (memcheck + racecheck on CuTe cases)
#   BENCH="prefill prefill-extra" (sets or specs), BUDGET=1 (seconds a row), KV=bf16,e4m3fn,
#   CONTENDERS="hal hal-split hal:cuda-wgmma flashinfer-prefill fa3 fa3-fp8"
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests bench"}
if [ -f build/C312.so.xz ]; then xz -dc build/C312.so.xz > packs/cuda/_C.cpython-312-x86_64-linux-gnu.so; fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && tar -xJf .whl/fi_trim.tar.xz -C /tmp/site || echo "baselines could not be installed" >&2
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_cuda_prefill.py tests/test_cuda_pack.py \
             -m "cuda and not slow" 2>&1 | tail -30 | tee "$OUT/pytest.log" ;;
    slow) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_prefill.py -m "cuda and slow" 2>&1 \
             | tail -15 | tee "$OUT/pytest_slow.log" ;;
    wgmma-grid)  # the whole multi-token grid (slow tests too) on the sm_90a kernel: what turning it on needs
      HAL_CUDA_PREFILL=wgmma timeout 400 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_cuda_prefill.py \
        -m cuda 2>&1 | tail -15 | tee "$OUT/pytest_wgmma.log" ;;
    cute) timeout 240 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_cuda_prefill.py \
             -k "forced_cute or replay" 2>&1 | tail -15 | tee "$OUT/pytest_cute.log" ;;
    cute-grid) HAL_CUDA_PREFILL=cute timeout 300 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_cuda_prefill.py \
             tests/test_cuda_pack.py -m "cuda and not slow" 2>&1 | tail -15 | tee "$OUT/pytest_cute_grid.log" ;;
    cute-sanitizer)
      for tool in memcheck racecheck; do
        timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
          tests/test_cuda_prefill.py -k "forced_cute and (mixed or ragged or block-8) and 128" \
          2>&1 | tail -6 | tee "$OUT/sanitizer_cute_$tool.log"
      done ;;
    tune) timeout 400 python3 tools/tune --prefill --json "$OUT/tune-prefill.json" ${TUNE_WRITE:+--write} 2>&1 \
            | tail -30 | tee "$OUT/tune-prefill.txt"
          [ -n "${TUNE_WRITE:-}" ] && cp packs/cuda/tuning.json "$OUT/" ;;
    sanitizer)  # both kernels, a mixed batch (prefill + decode + split-K merge) over an e4m3 cache
      for tool in memcheck racecheck; do
        timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
          tests/test_cuda_prefill.py -k "test_geometries and mixed and e4m3 or forced_wgmma and mixed and 128 and e4m3" \
          2>&1 | tail -6 | tee "$OUT/sanitizer_$tool.log"
      done ;;
    profile)  # Nsight Compute on one 8x2048/32x8x128 prefill: each of PROFILE_KERNELS (default "mma wgmma"),
              # bf16 and e4m3fn caches; also the SASS lines with their stall samples (source page, csv)
      for kernel in ${PROFILE_KERNELS:-mma wgmma}; do for cache in bfloat16 float8_e4m3fn; do
        timeout 150 ncu --kernel-name regex:prefill --launch-skip 2 --launch-count 1 --section SpeedOfLight \
          --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
          --section SchedulerStats --section SourceCounters --section LaunchStats --import-source no \
          -f -o "/tmp/ncu_${kernel}_$cache" python3 tools/prefill_once.py $kernel $cache > "$OUT/ncu_${kernel}_$cache.log" 2>&1
        ncu -i "/tmp/ncu_${kernel}_$cache.ncu-rep" > "$OUT/ncu_${kernel}_$cache.txt" 2>&1
        ncu -i "/tmp/ncu_${kernel}_$cache.ncu-rep" --page source --csv --print-source sass 2>&1 | xz > "$OUT/ncu_${kernel}_${cache}_sass.csv.xz"
        tail -3 "$OUT/ncu_${kernel}_$cache.txt"
      done; done ;;
    bench) timeout ${BENCH_T:-420} python3 tools/bench --shapes ${BENCH:-prefill prefill-extra} --kv-dtype ${KV:-bf16,e4m3fn} \
             --contenders ${CONTENDERS:-hal hal-split hal:cuda-wgmma flashinfer-prefill fa3 fa3-fp8} --budget ${BUDGET:-1} \
             --json "$OUT/bench-prefill.json" 2>"$OUT/bench-progress.log" | tee "$OUT/bench-prefill.txt" | tail -3
           tail -3 "$OUT/bench-progress.log" ;;
  esac
done
