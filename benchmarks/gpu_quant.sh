#!/usr/bin/env bash
# Issue 24's GPU measurements, in two calls on one warm machine (logs under $OUT):
#   bash benchmarks/gpu_quant.sh tallow   build, CUDA quantization tests, kernel checks, gpu_e2e decode8b and
#                                         nanovllm with --isq q4k beside bf16 (same call)
#   bash benchmarks/gpu_quant.sh peer     llama.cpp's CUDA build (benchmarks/build_llamacpp_cuda.sh), the Q4_K_M
#                                         benchmark GGUFs (make_quant_gguf.py), benchmarks/peer.py on both shapes,
#                                         the full kernel benchmark
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tallow-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
rc=0
run() {  # name, timeout, command...: log to $OUT/<name>.log, print its tail
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || { echo "$name: exit $?"; rc=1; }
  tail -${TAIL:-12} "$OUT/$name.log"
}
if [ "${1:-}" = tallow ]; then
  bash benchmarks/gpu_session.sh build quant || rc=1
  export PYTHONPATH=/tmp/site
  TAIL=4 run quant_check 120 python3 benchmarks/bench_quant_linear_cuda.py --check-only
  TAIL=8 run e2e_q4k 240 python3 benchmarks/gpu_e2e.py --target decode8b --isq q4k --repeats 2 --json "$OUT/e2e_q4k_decode.json"
  TAIL=8 run e2e_bf16 150 python3 benchmarks/gpu_e2e.py --target decode8b --repeats 2 --json "$OUT/e2e_bf16_decode.json"
  TAIL=8 run nano_q4k 200 python3 benchmarks/gpu_e2e.py --target nanovllm --isq q4k --repeats 1 --json "$OUT/e2e_q4k_nano.json"
  TAIL=8 run nano_bf16 200 python3 benchmarks/gpu_e2e.py --target nanovllm --repeats 1 --json "$OUT/e2e_bf16_nano.json"
fi
if [ "${1:-}" = peer ]; then
  export PYTHONPATH=/tmp/site
  [ -d /tmp/llamacpp/llama_cpp ] || run llamacpp_build 400 bash benchmarks/build_llamacpp_cuda.sh /tmp/llamacpp
  run gguf_8b 120 python3 benchmarks/make_quant_gguf.py llama3-8b /tmp/llama3-8b --gguf /tmp/llama3-8b-q4_k_m.gguf --type q4_k_m --device cuda
  TAIL=10 run peer_8b 200 python3 benchmarks/peer.py --gguf /tmp/llama3-8b-q4_k_m.gguf --device cuda --repeats 3 \
    --prefill-tokens 4096 --llamacpp-path /tmp/llamacpp --out "$OUT/peer_cuda_llama3-8b-q4_k_m.json"
  run gguf_06b 60 python3 benchmarks/make_quant_gguf.py qwen3-0.6b /tmp/qwen3-0.6b --gguf /tmp/qwen3-0.6b-q4_k_m.gguf --type q4_k_m --device cuda
  TAIL=10 run peer_06b 120 python3 benchmarks/peer.py --gguf /tmp/qwen3-0.6b-q4_k_m.gguf --device cuda --repeats 3 \
    --llamacpp-path /tmp/llamacpp --out "$OUT/peer_cuda_qwen3-0.6b-q4_k_m.json"
  TAIL=70 run quant_bench 150 python3 benchmarks/bench_quant_linear_cuda.py --reps 5
fi
exit $rc
