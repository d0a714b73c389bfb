#!/usr/bin/env bash
# Build llama.cpp's CUDA backend (through llama-cpp-python) on a GPU machine with no network, as the
# peer of benchmarks/peer.py --device cuda. Input: the trimmed llama-cpp-python sdist in .whl/
# (llama_cpp_python-*.tar.gz: the PyPI sdist without docs, vocab files, tests, examples, tools and the
# non-CUDA GPU backends) and the diskcache wheel it imports. Output: an install under $TARGET
# (default /tmp/llamacpp); use it with PYTHONPATH=$TARGET. About 4 minutes on 16 cores for sm_90.
#   bash benchmarks/build_llamacpp_cuda.sh [TARGET]
# Environment: CUDA_ARCHS (default 90), CMAKE_BUILD_PARALLEL_LEVEL (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-/tmp/llamacpp}
SDIST=$(ls .whl/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)
[ -n "$SDIST" ] || { echo "build_llamacpp_cuda: no .whl/llama_cpp_python-*.tar.gz (see benchmarks/README.md)"; exit 1; }
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
[ -x "$NVCC" ] || { echo "build_llamacpp_cuda: nvcc not found"; exit 1; }
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
# scikit-build-core builds the wheel; pip has no index here, so the build must not be isolated.
python3 -c "import scikit_build_core" || { echo "build_llamacpp_cuda: scikit-build-core missing (carry its wheel)"; exit 1; }
# The image's default CXX (/opt/gcc) links libstdc++ statically into shared objects; use the system compiler
# (as benchmarks/gpu_session.sh does).
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi

EXTRA=""
CUBLAS_LIB=""
# cuBLAS: from the toolkit, or (CUDA 13 images) from the nvidia-cublas wheel. The wheel has only
# libcublas.so.13, so give find_library an unversioned link and nvcc the include folder.
if ! ls "$CUDA_HOME"/lib64/libcublas.so* "$CUDA_HOME"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
  WHEEL=$(python3 -c "
import importlib.util as u, os
s = u.find_spec('nvidia')
for p in (s.submodule_search_locations if s else []):
    for sub in ('cu13', 'cublas', 'cu12'):
        d = os.path.join(p, sub)
        if os.path.exists(os.path.join(d, 'include', 'cublas_v2.h')):
            print(d); raise SystemExit
")
  [ -n "$WHEEL" ] || { echo "build_llamacpp_cuda: no cuBLAS in $CUDA_HOME nor in an nvidia-cublas wheel"; exit 1; }
  LINKS=/tmp/llamacpp-cublas/lib
  mkdir -p "$LINKS"
  for lib in cublas cublasLt; do
    so=$(ls "$WHEEL"/lib/lib$lib.so.* | head -1)
    ln -sf "$so" "$LINKS/lib$lib.so"
  done
  CUBLAS_LIB=$WHEEL/lib
  export CMAKE_LIBRARY_PATH=$LINKS${CMAKE_LIBRARY_PATH:+:$CMAKE_LIBRARY_PATH}
  export LIBRARY_PATH=$LINKS:$CUBLAS_LIB${LIBRARY_PATH:+:$LIBRARY_PATH}
  EXTRA="-DCMAKE_CUDA_FLAGS=-I$WHEEL/include -DCMAKE_CXX_FLAGS=-I$WHEEL/include -DCMAKE_C_FLAGS=-I$WHEEL/include"
  echo "build_llamacpp_cuda: cuBLAS from $WHEEL"
fi

export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90} -DCMAKE_CUDA_COMPILER=$NVCC \
 -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
 -DLLAMA_BUILD_TOOLS=OFF -DCMAKE_BUILD_TYPE=Release $EXTRA"
start=$(date +%s)
LOG=${LOG:-/tmp/llamacpp-build.log}
if ! python3 -m pip install --no-index --no-build-isolation --no-deps --no-cache-dir --upgrade -v --target "$TARGET" \
    "$SDIST" .whl/diskcache-*.whl >"$LOG" 2>&1; then
  grep -E "error|Error" "$LOG" | head -30
  tail -30 "$LOG"
  echo "build_llamacpp_cuda: FAILED (log $LOG)"
  exit 1
fi
# the wheel's libraries find each other through $ORIGIN; put cuBLAS beside them when it came from a wheel
if [ -n "$CUBLAS_LIB" ]; then ln -sf "$CUBLAS_LIB"/libcublas*.so* "$TARGET/llama_cpp/lib/"; fi
echo "build_llamacpp_cuda: built in $(( $(date +%s) - start )) s into $TARGET"
PYTHONPATH=$TARGET python3 -c "
import llama_cpp
print('llama-cpp-python', llama_cpp.__version__, 'gpu offload:', llama_cpp.llama_supports_gpu_offload())"
