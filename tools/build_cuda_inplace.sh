#!/usr/bin/env bash
# Build the cuda pack's module into packs/cuda/ for running from a checkout (the device machine,
# development). `pip install .` is the normal way. ARCHS defaults to 90a (H100/H200); it is a CMake
# arch list (ARCHS="89-real;120-real"), or ARCHS=all / ARCHS=auto for packs/cuda/archs.py's rule.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARCHS=${ARCHS:-90a}
case "$ARCHS" in
  all|auto) ARCH_ARG=(-UCMAKE_CUDA_ARCHITECTURES "-DHAL_CUDA_ARCHS=$ARCHS") ;;
  *) ARCH_ARG=(-UHAL_CUDA_ARCHS "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS") ;;
esac
mkdir -p build
cmake -S . -B build/inplace -G Ninja -DCMAKE_BUILD_TYPE=Release -DHAL_CUDA_INPLACE=ON \
  "${ARCH_ARG[@]}" -DPython_EXECUTABLE="$(command -v "$PY")" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" > build/inplace.log 2>&1 || { cat build/inplace.log; exit 1; }
grep "hal: the cuda pack" build/inplace.log || true
cmake --build build/inplace -j "$(nproc)" 2>&1 | grep -E "error|warning|registers|spill|Linking" | grep -v "0 bytes spill" || true
test -f packs/cuda/build_info.json && ls packs/cuda/_C*.so
