#!/usr/bin/env bash
# Before/after on one GPU machine: builds a baseline source tree (default .baseline/, e.g.
# `git archive <commit> | tar -x -C .baseline`) and this tree for sm_90 into .ab/base and .ab/new, then
# runs benchmarks/gpu_e2e.py targets alternately (baseline, this tree, baseline, ...) so both see the
# same machine. Stages: build, test (this tree's CUDA tests), bench. Builds go to $AB, logs and JSON to $OUT.
#   bash benchmarks/gpu_ab.sh build test        # one call
#   bash benchmarks/gpu_ab.sh bench             # the next, on the same warm machine
# BASE overrides the baseline folder, TARGETS the gpu_e2e targets (default: nanovllm decode8b prefill8b),
# ROUNDS the alternations (default 2), REPEATS gpu_e2e's --repeats (default 1), E2E_FLAGS extra gpu_e2e flags.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tallow-ab}
BASE=${BASE:-.baseline}
AB=${AB:-/tmp/tallow-ab-builds}  # outside the tree: the device tool prunes files it does not carry
mkdir -p "$OUT" "$AB"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
STAGES=${*:-build test bench}
has() { [[ " $STAGES " == *" $1 "* ]]; }
# This image's default g++ links libstdc++ statically into shared objects (iostreams then crash).
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then  # test-only wheels carried along (e.g. gguf)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=:/tmp/site
fi
rc=0
build() {  # build SRC DEST
  local start=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps --upgrade -q \
    -Ccmake.define.TALLOW_CUDA=ON -Ccmake.define.TALLOW_CUDA_ARCHS="${TALLOW_CUDA_ARCHS:-90}" \
    --target "$2" "$1" >"$OUT/build_$(basename "$2").log" 2>&1 || { tail -30 "$OUT/build_$(basename "$2").log"; return 1; }
  echo "build $1 -> $2: $(( $(date +%s) - start )) s"
}
if has build; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  for side in ${SIDES:-base new}; do  # SIDES=new builds only this tree
    build "$([ $side = base ] && echo "$BASE" || echo .)" "$AB/$side" || exit 1
  done
fi
if has test; then
  (cd tests/python && PYTHONPATH="$AB/new$SITE" timeout 500 python3 -m pytest -q -rfs -p no:cacheprovider \
    ${GPU_TESTS:-cuda ops worker layers loader/test_dummy_weights.py engine/test_engine_cuda.py \
    engine/test_engine_cuda_bf16.py engine/test_engine_cuda_graphs.py engine/test_engine_overlap.py \
    engine/test_decode_overlap.py}) >"$OUT/tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
  echo "tests: $(tail -1 "$OUT/tests.log")"
fi
if has bench; then
  for round in $(seq "${ROUNDS:-2}"); do
    for target in ${TARGETS:-nanovllm decode8b prefill8b}; do
      for side in base new; do
        src=$([ $side = base ] && echo "$BASE" || echo .)
        (cd "$src" && PYTHONPATH="$AB/$side$SITE" python3 benchmarks/gpu_e2e.py --target "$target" --repeats "${REPEATS:-1}" \
          --json "$OUT/e2e_${side}.json" ${E2E_FLAGS:-}) >>"$OUT/e2e_${side}.log" 2>&1 || rc=1
        line=$(grep -E "_(output_tok_s|decode_b1_p128_g256_tok_s|prefill_4096_TFLOP_s) " "$OUT/e2e_${side}.log" | tail -1)
        echo "round $round $target $side: $line" | tee -a "$OUT/ab_summary.txt"
      done
    done
  done
fi
exit $rc
