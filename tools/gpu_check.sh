#!/usr/bin/env bash
# What we run on the lent H200 (see docs/gpu.md): probe, the emu/gpu test grid, the benchmark.
# Usage on the device machine, from the repo root: bash tools/gpu_check.sh [bench shape set]
# Writes logs and JSON under $OUT (or ./results).
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 tools/probe > "$OUT/probe.txt" 2>&1; tail -4 "$OUT/probe.txt"
timeout 420 python3 -m pytest -q -m "emu or gpu" tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15
if [ -n "${1:-}" ]; then
  timeout 300 python3 tools/bench --device cuda --shapes "$1" --kv-dtype bf16,e4m3fn \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
