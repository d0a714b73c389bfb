#!/usr/bin/env bash
# Does a CUDA wheel of tallow install and run on a GPU machine with only the NVIDIA wheels? Needs a CUDA toolkit
# (nvcc) for the build and a GPU. Builds the wheel with the CUDA backend, checks with readelf that the extension's
# RPATH/RUNPATH has no absolute entry (nothing pointing into this build machine), then installs it into fresh
# virtual environments and, in each, imports tallow and runs a product through cuBLASLt on the GPU with
# LD_LIBRARY_PATH unset and the dynamic linker's cache bypassed (ld.so --inhibit-cache): the toolkit's lib
# folders are on no search path, so cuBLAS can only come from an nvidia-cublas wheel. /proc/self/maps tells
# which libcublas was loaded.
#   system: a venv made with --system-site-packages; the nvidia wheels sit in the system site-packages (the
#           image's torch brings them), out of reach of the extension's $ORIGIN RUNPATH: tallow/cuda_libs.py
#           loads them before importing tallow._core.
#   beside: when .whl/ carries the nvidia-cublas wheel, it is installed into the venv next to tallow, as
#           `pip install tallow[cuda]` does: the RUNPATH $ORIGIN/../nvidia/cu13/lib finds it.
# Usage: bash tests/gpu_wheel_check.sh   (OUT=/tmp/tallow-wheel-check, TALLOW_CUDA_ARCHS=90, PYTHON=python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/tallow-wheel-check}
rm -rf "$OUT/wheel" "$OUT/unpacked" "$OUT"/venv-*
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the venvs are compared with sys.prefix
NVCC=$(command -v nvcc || true)
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
[ -n "$NVCC" ] || { echo "gpu_wheel_check: FAILED: no nvcc (the CUDA wheel is built here; a toolkit is needed)"; exit 1; }
CUDA_MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
echo "gpu_wheel_check: nvcc $("$NVCC" --version | tail -1); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

# ---- build -------------------------------------------------------------------------------------------
# As benchmarks/gpu_session.sh: the system compiler (this image's /opt/gcc links libstdc++ statically).
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
export CUDACXX=$NVCC CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
start=$(date +%s)
# pyproject's build-dir (build/<wheel tag>) is the one gpu_session.sh's install uses: an incremental build.
if ! "$PY" -m pip wheel . --no-build-isolation --no-deps -w "$OUT/wheel" \
    -Ccmake.define.TALLOW_CUDA=ON -Ccmake.define.TALLOW_CUDA_ARCHS="${TALLOW_CUDA_ARCHS:-90}" >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -30
  tail -30 "$OUT/build.log"
  exit 1
fi
WHEEL=$(ls "$OUT"/wheel/tallow-*.whl)
echo "gpu_wheel_check: built $(basename "$WHEEL") in $(( $(date +%s) - start )) s"

# ---- the extension in the wheel ----------------------------------------------------------------------
"$PY" -m zipfile -e "$WHEEL" "$OUT/unpacked"
SO=$(ls "$OUT"/unpacked/tallow/_core*.so)
for f in tallow/py.typed tallow/_core.pyi tallow/_version.py; do
  [ -f "$OUT/unpacked/$f" ] || { echo "gpu_wheel_check: FAILED: $f is not in the wheel"; exit 1; }
done
echo "gpu_wheel_check: readelf -d $(basename "$SO"):"
readelf -d "$SO" | grep -E "NEEDED|RPATH|RUNPATH" | sed 's/^/  /'
RPATHS=$(readelf -d "$SO" | sed -n 's/.*(R\(UN\)\?PATH).*\[\(.*\)\]/\2/p' | tr ':' '\n' | sed '/^$/d')
BAD=$(printf '%s\n' "$RPATHS" | grep -v '^\$ORIGIN' || true)
if [ -n "$BAD" ]; then echo "gpu_wheel_check: FAILED: absolute RPATH/RUNPATH entries: $BAD"; exit 1; fi
if readelf -d "$SO" | grep -q "NEEDED.*libcudart"; then
  echo "gpu_wheel_check: note: the extension links libcudart dynamically (expected: cudart_static)"
fi

# ---- run it ------------------------------------------------------------------------------------------
cat >"$OUT/run_on_gpu.py" <<'EOF'
import os
import re
import sys

import numpy as np

venv = os.environ["CHECK_VENV"]
assert sys.prefix == venv, f"not the venv's interpreter: {sys.prefix}"
import tallow  # noqa: E402
import tallow.cuda as tc  # noqa: E402
from tallow import cuda_libs  # noqa: E402

assert tallow.__file__.startswith(venv), f"tallow imported from {tallow.__file__}, not the venv"
print(f"  tallow {tallow.__version__} from {os.path.dirname(tallow.__file__)}")
assert tc.built, "the installed wheel has no CUDA backend"
assert tc.is_available(), "no GPU visible (is libcuda.so.1 outside the default library folders?)"
tallow._core.cuda.set_skinny_max_m(0)  # every product goes to cuBLASLt
rng = np.random.default_rng(0)
x = tallow.tensor(rng.standard_normal((64, 512)), dtype="bfloat16")
w = tallow.tensor(rng.standard_normal((384, 512)), dtype="bfloat16")
y = tallow.ops.linear(x.to("cuda"), w.to("cuda"))
tc.synchronize()
got = y.to("cpu").to(tallow.float32).numpy()
ref = x.to(tallow.float32).numpy().astype(np.float64) @ w.to(tallow.float32).numpy().astype(np.float64).T
err = float(np.abs(got - ref).max() / np.abs(ref).max())
print(f"  linear 64x512x384 bf16 on {tc.get_device_name()}: max error {err:.2e} of max |ref|")
assert err < 1e-2, "wrong product"
libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if re.search(r"/libcublas(Lt)?\.so", line)})
for lib in libs:
    print(f"  loaded {lib}")
assert any("libcublasLt.so" in lib for lib in libs) and any("/libcublas.so" in lib for lib in libs), libs
assert all("/nvidia/" in lib for lib in libs), "cuBLAS came from outside the nvidia wheels"
expect = os.environ.get("CHECK_CUBLAS_UNDER")
assert not expect or all(lib.startswith(expect) for lib in libs), f"expected cuBLAS under {expect}"
print(f"  preloaded by tallow/cuda_libs.py: {cuda_libs.preloaded or 'nothing (the RUNPATH found it)'}")
EOF

# The venv's python through the dynamic linker itself, without its cache and with no LD_LIBRARY_PATH: only
# RUNPATHs, dlopen()s of full paths and the default folders (/lib, /usr/lib and their multiarch ones) remain.
run_clean() {
  local venv=$1
  local real ldso
  real=$(readlink -f "$venv/bin/python")
  ldso=$(readelf -l "$real" | sed -n 's/.*program interpreter: \(.*\)\]/\1/p')
  env -u LD_LIBRARY_PATH -u PYTHONPATH -u CUDA_HOME -u CUDA_PATH CHECK_VENV="$venv" "${@:2}" \
    "$ldso" --inhibit-cache "$venv/bin/python" "$OUT/run_on_gpu.py"
}
new_venv() {
  "$PY" -m venv --system-site-packages "$1"
  # When $PY is itself a venv's (numpy, pytest and the nvidia wheels in its site-packages), the new venv
  # sees only the base interpreter's; a .pth file adds $PY's site-packages after the venv's own.
  local outer inner
  outer=$(env -u PYTHONPATH "$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  inner=$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ "$outer" = "$inner" ] || echo "$outer" >"$inner/outer-site-packages.pth"
  "$1/bin/python" -m pip install -q --no-deps --no-index --ignore-installed "$WHEEL"
}

rc=0
ran=0
SYS_CUBLAS=$(env -u PYTHONPATH "$PY" -c "
import importlib.util as u, os
s = u.find_spec('nvidia')
for p in (s.submodule_search_locations if s else []):
    for sub in ('cu$CUDA_MAJOR', 'cublas'):
        if os.path.exists(os.path.join(p, sub, 'lib', 'libcublas.so.$CUDA_MAJOR')): print(os.path.join(p, sub, 'lib'))" | head -1)
if [ -n "$SYS_CUBLAS" ]; then
  echo "gpu_wheel_check: system: cuBLAS $CUDA_MAJOR of the system site-packages ($SYS_CUBLAS)"
  new_venv "$OUT/venv-system"
  if run_clean "$OUT/venv-system" CHECK_CUBLAS_UNDER="$SYS_CUBLAS"; then
    echo "gpu_wheel_check: system: OK"; ran=$((ran + 1))
  else echo "gpu_wheel_check: system: FAILED"; rc=1; fi
else
  echo "gpu_wheel_check: system: SKIPPED (no libcublas.so.$CUDA_MAJOR in an nvidia wheel of $PY's site-packages)"
fi
CARRIED=$(ls .whl/nvidia_cublas-"$CUDA_MAJOR".*.whl .whl/nvidia_cublas_cu"$CUDA_MAJOR"-*.whl 2>/dev/null | head -1 || true)
if [ -n "$CARRIED" ]; then
  echo "gpu_wheel_check: beside: $(basename "$CARRIED") installed next to tallow (what tallow[cuda] installs)"
  new_venv "$OUT/venv-beside"
  "$OUT/venv-beside/bin/python" -m pip install -q --no-deps --no-index "$CARRIED"
  SITE=$("$OUT/venv-beside/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if run_clean "$OUT/venv-beside" CHECK_CUBLAS_UNDER="$SITE/nvidia/"; then
    echo "gpu_wheel_check: beside: OK"; ran=$((ran + 1))
  else echo "gpu_wheel_check: beside: FAILED"; rc=1; fi
else
  echo "gpu_wheel_check: beside: SKIPPED (no nvidia-cublas $CUDA_MAJOR wheel in .whl/)"
fi
# The committed _core.pyi (from a CPU build) against this CUDA build: names may differ only by the CUDA-only ones.
VENV=$(ls -d "$OUT"/venv-* 2>/dev/null | head -1 || true)
if [ -n "$VENV" ]; then
  if (env -u PYTHONPATH "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/python/test_packaging.py \
      -k "stub or parsers or rpath" >"$OUT/stub.log" 2>&1); then echo "gpu_wheel_check: stub and RPATH tests: $(tail -1 "$OUT/stub.log")"
  else echo "gpu_wheel_check: stub and RPATH tests: FAILED"; tail -20 "$OUT/stub.log"; rc=1; fi
fi
if [ "$ran" -eq 0 ] && [ "$rc" -eq 0 ]; then
  echo "gpu_wheel_check: FAILED: no nvidia-cublas wheel to run against (system site-packages or .whl/)"
  rc=1
fi
exit $rc
