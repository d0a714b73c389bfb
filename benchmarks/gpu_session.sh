#!/usr/bin/env bash
# One GPU session on a CUDA machine: build tallow for sm_90 (TALLOW_CUDA_ARCHS overrides), run the
# CUDA tests and the kernel benchmarks, logs under $OUT (default /tmp/tallow-gpu). Stages can be
# picked: bash benchmarks/gpu_session.sh [build] [test] [backend] [bench] (default: all four).
# Wheels in .whl/ (e.g. gguf, the dequantization reference) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tallow-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${*:-build test backend bench}
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
rc=0
# This image's default CXX (/opt/gcc/bin/g++) links libstdc++ statically into shared objects, and
# iostreams in such an extension crash (uninitialised locale); build with the system compiler.
if [ -x /usr/bin/g++ ] && [ "${CXX:-}" != /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  if has build && grep -qs "/opt/gcc" build/*/CMakeCache.txt; then rm -rf build/cp3*; fi
fi
if has build; then
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
  start=$(date +%s)
  if ! python3 -m pip install --no-build-isolation --no-deps -v -Ccmake.define.TALLOW_CUDA=ON \
      -Ccmake.define.TALLOW_CUDA_ARCHS="${TALLOW_CUDA_ARCHS:-90}" . >"$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -40
    tail -30 "$OUT/build.log"
    exit 1
  fi
  echo "build: $(( $(date +%s) - start )) s"
fi
python3 -c "import tallow, tallow.cuda as tc; print('tallow', tallow.__file__, 'cuda', tc.is_available(), tc.get_device_name())"
cd tests/python
if has test; then
  python3 -m pytest -q -rs -p no:cacheprovider test_cuda_runtime.py 2>&1 | tee "$OUT/test_runtime.log" | tail -25 || rc=1
fi
if has backend; then
  python3 -m pytest -q -rf -p no:cacheprovider test_backend_ops.py -k cuda 2>&1 | tee "$OUT/test_backend.log" | \
    grep -E "FAILED|passed|failed|Error" | tail -60 || rc=1
fi
cd ../..
if has bench; then
  TALLOW_BENCH_JSON="$OUT/bench.json" python3 benchmarks/bench_cuda.py 2>&1 | tee "$OUT/bench.log" | tail -45 || rc=1
fi
exit $rc
