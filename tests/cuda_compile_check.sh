#!/usr/bin/env bash
# CI compile check for the CUDA backend (no GPU needed): when nvcc is present, configure with
# TALLOW_CUDA=ON for sm_90 only, taking cuBLAS headers/libraries from the nvidia-cublas wheel
# (installed into the active Python environment if missing), and build the core library and the
# extension, so every cuda/*.cu, cuda/*.cpp (the op table in backend.cpp) and cuda/python compile. Prints a
# skip line and exits 0 when nvcc is absent. Usage: bash tests/cuda_compile_check.sh [build dir]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${1:-build/cuda-compile-check}
NVCC=$(command -v nvcc || true)
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
  echo "cuda_compile_check: SKIPPED (nvcc not found; the CUDA backend is not compiled on this machine)"
  exit 0
fi
CUDA_VER=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
# cuBLAS for CUDA 13 ships as the nvidia-cublas wheel (nvidia/cu13/{include,lib}); CUDA 12 as nvidia-cublas-cu12.
if [ "${CUDA_VER:-13}" -ge 13 ]; then PKG="nvidia-cublas>=13,<14"; else PKG="nvidia-cublas-cu12"; fi
if ! "$PY" -c "import importlib.util as u, os, sys; s = u.find_spec('nvidia'); sys.exit(0 if s and any(os.path.exists(os.path.join(p, d, 'include', 'cublasLt.h')) for p in s.submodule_search_locations for d in ('cu13', 'cublas')) else 1)" 2>/dev/null; then
  echo "cuda_compile_check: installing $PKG for the cuBLAS headers"
  "$PY" -m pip install -q --no-deps "$PKG"
fi
echo "cuda_compile_check: nvcc $("$NVCC" --version | tail -1), building the CUDA backend for sm_90 in $BUILD"
mkdir -p "$(dirname "$BUILD")"
start=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DTALLOW_CUDA=ON -DTALLOW_CUDA_ARCHS=90 -DTALLOW_BUILD_TESTS=OFF \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DPython_EXECUTABLE="$(command -v "$PY")" >"$BUILD.configure.log" 2>&1 || {
  cat "$BUILD.configure.log"
  exit 1
}
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target tallow_core _core
echo "cuda_compile_check: OK, CUDA backend compiled and linked in $(( $(date +%s) - start )) s"
