#!/usr/bin/env bash
# One GPU session on a CUDA machine: build tallow for sm_90 (TALLOW_CUDA_ARCHS overrides), run the
# CUDA tests and the benchmarks, logs and JSON results under $OUT (default /tmp/tallow-gpu).
# Stages can be picked: bash benchmarks/gpu_session.sh [build] [test] [backend] [engine] [bench] [attn]
# [sampling] [e2e] (default: all of these) [mix] [nano] [breakdown] [quant] [quantbench] (only when named:
# bench_decode_mix.py, nano_steps.py --gaps, decode_breakdown.py --shape nano, the GGUF-quantization tests on CUDA,
# bench_quant_linear_cuda.py). Wheels in .whl/ (e.g. gguf, the dequantization reference) are
# installed into /tmp/site first; TALLOW_TEST_DATA defaults to .gpu_data when that folder exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tallow-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
STAGES=${*:-build test backend engine bench attn sampling e2e}
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
if [ -z "${TALLOW_TEST_DATA:-}" ] && [ -d .gpu_data ]; then export TALLOW_TEST_DATA=$PWD/.gpu_data; fi
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
pyt() {  # pytest quietly into $OUT/<name>.log; print the summary and any failures
  local name=$1; shift
  (cd tests/python && timeout 900 python3 -m pytest -q -rfs -p no:cacheprovider "$@") >"$OUT/$name.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | head -20
  echo "$name: $(tail -1 "$OUT/$name.log")"
}
if has test; then
  pyt kernels cuda ops/test_paged_attention.py ops/test_paged_attention_fp8.py ops/test_sampling_ops.py \
    worker/test_gpu_sampler.py ops/test_random_fill.py loader/test_dummy_weights.py ops/test_rope_cache.py \
    ops/test_gated_linear.py ops/test_matmul.py layers/test_mixed_step_attention.py
fi
if has backend; then
  pyt backend ops/test_backend_ops.py -k cuda
fi
if has engine; then
  pyt engine engine/test_engine_cuda.py engine/test_engine_cuda_bf16.py engine/test_engine_cuda_graphs.py \
    engine/test_engine_overlap.py engine/test_decode_overlap.py
fi
if has bench; then
  TALLOW_BENCH_JSON="$OUT/bench_cuda.json" python3 benchmarks/bench_cuda.py >"$OUT/bench_cuda.log" 2>&1 || rc=1
  tail -12 "$OUT/bench_cuda.log"
fi
if has attn; then
  python3 benchmarks/bench_attention.py --json "$OUT/attention.json" >"$OUT/attention.log" 2>&1 || rc=1
  tail -40 "$OUT/attention.log"
fi
if has sampling && [ -f benchmarks/bench_sampling.py ]; then
  python3 benchmarks/bench_sampling.py --json "$OUT/sampling.json" >"$OUT/sampling.log" 2>&1 || rc=1
  tail -20 "$OUT/sampling.log"
fi
if has e2e; then
  python3 benchmarks/gpu_e2e.py --target all --check-pool --json "$OUT/e2e.json" ${E2E_FLAGS:-} >"$OUT/e2e.log" 2>&1 || rc=1
  tail -14 "$OUT/e2e.log"
fi
if has mix; then
  python3 benchmarks/bench_decode_mix.py --json "$OUT/decode_mix.json" ${MIX_FLAGS:-} >"$OUT/decode_mix.log" 2>&1 || rc=1
  tail -8 "$OUT/decode_mix.log"
fi
if has nano; then
  python3 benchmarks/nano_steps.py --gaps >"$OUT/nano_steps.log" 2>&1 || rc=1
  grep -E "^(wall|copy|GPU|  decode batch|host)" "$OUT/nano_steps.log"
fi
if has breakdown; then
  python3 benchmarks/decode_breakdown.py --shape nano >"$OUT/breakdown_nano.log" 2>&1 || rc=1
  tail -14 "$OUT/breakdown_nano.log"
fi
if has quant; then
  pyt quant ops/test_backend_ops.py -k "cuda and (quant or dequant or embedding)" ops/test_quantize.py \
    layers/test_isq.py layers/test_gguf_linear.py
fi
if has quantbench; then
  python3 benchmarks/bench_quant_linear_cuda.py ${QUANTBENCH_FLAGS:-} >"$OUT/bench_quant_cuda.log" 2>&1 || rc=1
  tail -60 "$OUT/bench_quant_cuda.log"
fi
exit $rc
