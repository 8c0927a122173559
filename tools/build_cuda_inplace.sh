#!/usr/bin/env bash
# Build the cuda pack's module into packs/cuda/ for running from a checkout (the device machine,
# development). `pip install .` is the normal way. ARCHS defaults to 90a (H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p build
cmake -S . -B build/inplace -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAL_CUDA_INPLACE=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${ARCHS:-90a}" -DPython_EXECUTABLE="$(command -v "$PY")" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" > build/inplace.log 2>&1 || { cat build/inplace.log; exit 1; }
cmake --build build/inplace -j "$(nproc)" 2>&1 | grep -E "error|warning|registers|spill|Linking" | grep -v "0 bytes spill" || true
test -f packs/cuda/build_info.json && ls packs/cuda/_C*.so
