"""The table of ops every backend must pass (in the spirit of llama.cpp's test-backend-ops).

Each family registers OpCase rows in a cases_*.py module here. test_backend_ops.py runs every
row for every dtype on every built backend and compares with a float64 numpy reference computed
from the same (already rounded) inputs, so the bound measures the kernel alone.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable

import numpy as np

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# Default relative L2 error bounds, ‖out − ref‖ / ‖ref‖, by output dtype: f32 arithmetic with
# f32 accumulation, and one final rounding to f16 (2^-11) or bf16 (2^-8) of each output.
DEFAULT_TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}


class Keep:
    """Marks an input array that must reach the op as given (not cast to the case's dtype)."""

    def __init__(self, array: np.ndarray, dtype: str | None = None):
        self.array = array
        self.dtype = dtype


@dataclasses.dataclass
class OpCase:
    name: str
    # (rng, dtype) -> dict of inputs: float ndarrays become tensors of the case's dtype,
    # Keep(...) arrays keep their dtype (or Keep.dtype), anything else is passed as is.
    make: Callable[[np.random.Generator, str], dict[str, Any]]
    # (inputs as tallow tensors/values, dtype, device) -> Tensor or tuple of Tensors.
    run: Callable[[dict[str, Any], str, str], Any]
    # (inputs as float64 ndarrays / values) -> ndarray or tuple of ndarrays.
    ref: Callable[[dict[str, Any]], Any]
    dtypes: tuple[str, ...] = FLOAT_DTYPES
    tol: dict[str, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_TOL))
    # Integer outputs (indices) must match exactly; set exact=True.
    exact: bool = False


CASES: list[OpCase] = []


def register(*cases: OpCase) -> None:
    CASES.extend(cases)


def load_all() -> list[OpCase]:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("cases_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    return CASES


def poisoned(shape, dtype, device="cpu"):
    """An output buffer full of NaN, so elements a kernel forgets to write fail the check."""
    import tallow

    t = tallow.tensor(np.full(shape, np.nan, dtype=np.float32), dtype=dtype)
    return t if device == "cpu" else t.to(device)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {out.shape} != reference shape {ref.shape}")
    if np.isnan(out).any() and not np.array_equal(np.isnan(out), np.isnan(ref)):
        return float("inf")  # NaN never passes
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))
