#!/usr/bin/env bash
# Issue 28's GPU call (logs under $OUT): build, the token-bitmask kernel and structured-output tests on CUDA,
# benchmarks/structured_output.py on the real stories260K model (TALLOW_TEST_DATA) and on Llama-3-8B's shape
# (random weights), benchmarks/grammar_masks.py's thread sweep, then the wheel check
# (tests/gpu_wheel_check.sh). Wheels in .whl/ (llguidance, jsonschema and its deps, py3.12) go to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tallow-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
rc=0
bash benchmarks/gpu_session.sh build || exit 1
export PYTHONPATH=/tmp/site
DATA=${TALLOW_TEST_DATA:-$PWD/.gpu_data}
(cd tests/python && TALLOW_TEST_DATA=$DATA timeout 300 python3 -m pytest -q -rfs -p no:cacheprovider ops/test_token_bitmask.py \
  engine/test_structured_output.py worker/test_gpu_sampler.py) >"$OUT/tests.log" 2>&1 || rc=1
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head; echo "tests: $(tail -1 "$OUT/tests.log")"
timeout 300 python3 benchmarks/structured_output.py --model "$DATA/stories260K/stories260K.gguf" --device cuda --compact \
  --json "$OUT/structured_stories260k_h100.json" >"$OUT/structured.log" 2>&1 || rc=1
tail -6 "$OUT/structured.log"
timeout 300 python3 benchmarks/structured_output.py --shape llama3-8b --device cuda \
  --json "$OUT/structured_llama3_8b_h100.json" >"$OUT/structured_8b.log" 2>&1 || rc=1
tail -6 "$OUT/structured_8b.log"
for v in 512 128256; do
  TALLOW_TEST_DATA=$DATA timeout 120 python3 benchmarks/grammar_masks.py --vocab $v >>"$OUT/grammar_masks.log" 2>&1 || rc=1
done
cat "$OUT/grammar_masks.log"
if [ "${WHEEL_CHECK:-1}" = 1 ]; then
  OUT="$OUT/wheel" timeout 420 bash tests/gpu_wheel_check.sh >"$OUT/wheel_check.log" 2>&1 || rc=1
  tail -15 "$OUT/wheel_check.log"
fi
exit $rc
