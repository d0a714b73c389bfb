#!/usr/bin/env bash
# Issue 26's GPU measurement in one call (logs and JSON under $OUT): build, then benchmarks/serve.py on
# the Qwen3-0.6B shape (random weights, a config.json-only folder: the placeholder tokenizer covers the
# whole vocabulary), prompts of 100-1024 tokens, 256 output tokens each, at 64 and 256 concurrent
# streams, each beside the offline engine on the same workload; then 256 streams with two API server
# processes; and offline generation in-process against the engine-core process (offline_paths.py).
# Usage: bash benchmarks/gpu_serve.sh [build]   (build: also run gpu_session.sh's build first)
# SERVE_CPU=1: instead, the CPU target on the host's cores (SmolLM2-135M shape, 16 streams).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tallow-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
rc=0
if [ "${1:-}" = build ]; then bash benchmarks/gpu_session.sh build || exit 1; fi
export PYTHONPATH=/tmp/site
python3 - <<'PY'
import json, os, sys
sys.path.insert(0, "benchmarks")
from make_quant_gguf import SHAPES
os.makedirs("/tmp/qwen3-0.6b-shape", exist_ok=True)
json.dump(SHAPES["qwen3-0.6b"], open("/tmp/qwen3-0.6b-shape/config.json", "w"))
PY
if [ "${SERVE_CPU:-0}" = 1 ]; then
  # The CPU target (16 streams, overhead <= 5%) on this machine's host CPU: a random-weight Llama shaped like
  # the demo model SmolLM2-135M (f32), 8 engine threads of the 16 cores, no GPU.
  python3 - <<'PY'
import json, os
os.makedirs("/tmp/smol-shape", exist_ok=True)
json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               torch_dtype="float32", bos_token_id=1, eos_token_id=2), open("/tmp/smol-shape/config.json", "w"))
PY
  for out in 64 192; do
    echo "== CPU, 16 clients, $out output tokens"
    timeout 280 python3 benchmarks/serve.py --w /tmp/smol-shape --load-format dummy --num-threads 8 --clients 16 \
      --client-procs 2 --num-prompts 64 --input-len-min 32 --input-len-max 256 --output-len $out --max-token-id 49000 \
      --out "$OUT/serve_cpu16_$out.json" >"$OUT/serve_cpu16_$out.log" 2>&1 || { echo "exit $?"; rc=1; }
    grep -E "Output token throughput|Server overhead|Mean TPOT|Step time|P99 ITL|step gap" "$OUT/serve_cpu16_$out.log"
  done
  exit $rc
fi
W="--w /tmp/qwen3-0.6b-shape --load-format dummy --d 0 --max-model-len 2048 --input-len-min 100 --input-len-max 1024"
W="$W --output-len 256 --max-token-id 150000 --client-procs 4"
bench() {  # name, timeout, flags...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/serve.py $W "$@" --out "$OUT/$name.json" >"$OUT/$name.log" 2>&1 \
    || { echo "$name: exit $?"; rc=1; }
  grep -E "Output token throughput|Server overhead|Median ITL|P99 ITL|P99 TTFT|Step time|step gap|Failed" "$OUT/$name.log"
}
echo "== 64 clients"; bench serve_64 240 --clients 64 --num-prompts 1024
echo "== 256 clients"; bench serve_256 300 --clients 256 --num-prompts 1024
if [ "${SERVE_PATHS:-1}" = 1 ]; then
  echo "== offline: in-process LLM vs the engine-core process"
  timeout 240 python3 benchmarks/offline_paths.py --w /tmp/qwen3-0.6b-shape --load-format dummy --d 0 \
    --num-prompts 512 --input-len-min 100 --input-len-max 1024 --output-len 256 --max-token-id 150000 \
    --out "$OUT/offline_paths.json" 2>&1 | tail -3 || rc=1
fi
if [ "${SERVE_API2:-1}" = 1 ]; then
  echo "== 256 clients, 2 API servers"; bench serve_256_api2 300 --clients 256 --num-prompts 1024 --skip-offline \
    --server-args "--api-server-count 2"
fi
exit $rc
