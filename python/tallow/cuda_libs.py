"""Imports tallow._core, first loading the NVIDIA wheels' libraries a CUDA build links when the dynamic
linker cannot find them by itself.

A CUDA build of ``_core`` needs cuBLAS (libcublas.so.N, libcublasLt.so.N; the CUDA runtime is linked
statically). Installed next to the ``nvidia-cublas`` wheel (``pip install tallow[cuda]``) the extension's
RUNPATH ``$ORIGIN/../nvidia/cu13/lib`` finds it. When the wheel lives in another site-packages (a venv
made with --system-site-packages, a user site, PYTHONPATH), that RUNPATH misses: the import fails naming
the library, so the copies in the ``nvidia`` namespace package are loaded with RTLD_GLOBAL (cuBLASLt
before cuBLAS, so that cuBLAS binds the wheel's Lt, not another on the system) and the import is
retried; the loaded SONAMEs satisfy the extension's DT_NEEDED entries. A CPU build imports at the first
try and never reaches this code.
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType

# Library stem -> folders under site-packages/nvidia/ holding it: CUDA 13 wheels share nvidia/cu13,
# CUDA 12 wheels have one folder per library (nvidia/cublas). _LOAD_FIRST: what must be loaded before it.
_WHEEL_DIRS: dict[str, tuple[str, ...]] = {
    "libcublasLt": ("cu13", "cublas", "cu12"),
    "libcublas": ("cu13", "cublas", "cu12"),
}
_LOAD_FIRST: dict[str, tuple[str, ...]] = {"libcublas": ("libcublasLt",)}

# What import_core loaded from the wheels in this process (empty when the extension found its libraries
# itself): for diagnostics (tests/gpu_wheel_check.sh prints it).
preloaded: list[str] = []

_MISSING = re.compile(r"(lib[A-Za-z0-9_+-]+)\.so((?:\.\d+)*)\s*:\s*cannot open shared object file")


def missing_library(err: BaseException) -> tuple[str, str] | None:
    """(stem, version suffix) of the shared library an ImportError says it could not open, e.g.
    ('libcublas', '.13'); None for any other error."""
    m = _MISSING.search(str(err))
    return (m.group(1), m.group(2)) if m else None


def nvidia_lib_dirs(stem: str) -> list[str]:
    """The lib/ folders of the installed nvidia wheels that may hold `stem`, in sys.path order."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec else []
    return [os.path.join(root, sub, "lib") for root in roots for sub in _WHEEL_DIRS.get(stem, ())
            if os.path.isdir(os.path.join(root, sub, "lib"))]


def find_library(stem: str, version: str) -> str | None:
    """Path of `stem`.so`version` (the SONAME the extension needs, e.g. libcublas.so.13) in the nvidia
    wheels; with no version, any `stem`.so.N. Another major version would not satisfy the extension."""
    for d in nvidia_lib_dirs(stem):
        if version:
            if os.path.isfile(os.path.join(d, f"{stem}.so{version}")):
                return os.path.join(d, f"{stem}.so{version}")
        elif found := sorted(glob.glob(os.path.join(d, f"{stem}.so.*[0-9]"))):
            return found[0]
    return None


def preload(stem: str, version: str, load=None) -> list[str]:
    """Loads `stem` (and what must come before it) from the nvidia wheels with RTLD_GLOBAL; returns the
    paths loaded, [] when the wheels do not have it."""
    load = load or (lambda path: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
    paths = [find_library(s, version) for s in (*_LOAD_FIRST.get(stem, ()), stem)]
    if paths[-1] is None:
        return []
    loaded = []
    for path in paths:
        if path is not None:
            load(path)
            loaded.append(path)
    return loaded


def import_core(load=None, import_module=importlib.import_module) -> ModuleType:
    """``tallow._core``, retried after loading each library the nvidia wheels provide that it lacked."""
    tried: set[str] = set()
    while True:
        try:
            return import_module("tallow._core")
        except ImportError as err:
            missing = missing_library(err)
            if sys.platform != "linux" or missing is None or missing[0] in tried or missing[0] not in _WHEEL_DIRS:
                raise
            tried.add(missing[0])
            loaded = preload(*missing, load=load)
            if not loaded:
                raise ImportError(f"{err}; the CUDA build of tallow needs it: pip install 'tallow[cuda]' "
                                  "(the nvidia-cublas wheel) or put the CUDA toolkit's lib folder on "
                                  "LD_LIBRARY_PATH") from err
            preloaded.extend(loaded)
