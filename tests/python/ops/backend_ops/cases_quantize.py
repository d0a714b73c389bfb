"""quantize rows: every GGUF block type the op writes, on every backend, byte for byte (tolerance 0).

The reference: gguf-py's numpy quantizer for q4_0 ... q8_0 (bit-exact by contract); for the k-quants, iq4
and q8_1 / q8_k, llama.cpp's own quantizer when it can be loaded (llama-cpp-python installed, or
TALLOW_GGML_LIB=<path to a libggml-base.so>; q8_1 / q8_k have none), else tallow's CPU op on a
contiguous f32 copy of the input (so on a CUDA run the row checks CUDA == CPU; on the CPU it checks the
strided, threaded path against the contiguous one - the algorithm itself is checked by
tests/python/ops/test_quantize.py). The op's input is a strided view (every other row of a larger array).
The helpers here (inputs, the gguf and llama.cpp references) are shared with test_quantize.py."""
import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from backend_ops import Keep, OpCase, register
import tallow

# name -> (block size, bytes per block, ggml type id)
QUANT_TYPES = {
    "q4_0": (32, 18, 2),
    "q4_1": (32, 20, 3),
    "q5_0": (32, 22, 6),
    "q5_1": (32, 24, 7),
    "q8_0": (32, 34, 8),
    "q8_1": (32, 36, 9),
    "q2_k": (256, 84, 10),
    "q3_k": (256, 110, 11),
    "q4_k": (256, 144, 12),
    "q5_k": (256, 176, 13),
    "q6_k": (256, 210, 14),
    "q8_k": (256, 292, 15),
    "iq4_nl": (32, 18, 20),
    "iq4_xs": (256, 136, 23),
}
GGUF_PY_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
# What llama.cpp's ggml_quantize_chunk accepts (q8_1 / q8_k are activation formats it does not write).
LLAMA_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")


def random_rows(rng, rows, k, kind="normal"):
    """float32 (rows, k) test inputs of several shapes of difficulty."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if kind == "outliers":  # a few values 10-100x the rest, as in real weight rows
        mask = rng.random((rows, k)) < 0.01
        x[mask] *= rng.uniform(10, 100, size=mask.sum()).astype(np.float32)
    elif kind == "scaled":  # per-row magnitudes from 2^-20 to 2^12, offsets too (asymmetric blocks)
        x = x * np.exp2(rng.integers(-20, 13, size=(rows, 1))).astype(np.float32)
        x = x + (rng.standard_normal((rows, 1)) * np.abs(x).mean(axis=1, keepdims=True)).astype(np.float32)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, size=(rows, k)).astype(np.float32)
    return x


def special_rows(rng, k, dtype="float32"):
    """Rows that stress the edge cases: all-equal values (both signs), an all-zero row, a row with
    one non-zero value, tiny (1e-25; 2e-6 for float16, whose range ends there: a whole block of signed
    zeros would make gguf-py's min/max pick an unspecified zero sign) and huge (1e4) magnitudes, a
    constant positive offset, values already on a 4-bit grid."""
    tiny = 2e-6 if dtype == "float16" else 1e-25
    return np.stack([
        np.full(k, 0.75, np.float32),
        np.full(k, -3.5, np.float32),
        np.zeros(k, np.float32),
        np.where(np.arange(k) == k // 3, np.float32(2.0), np.float32(0.0)).astype(np.float32),
        (rng.standard_normal(k) * tiny).astype(np.float32),
        (rng.standard_normal(k) * 1e4).astype(np.float32),
        (rng.standard_normal(k) + 10).astype(np.float32),
        rng.integers(-8, 8, size=k).astype(np.float32),  # values already on a 4-bit grid
    ])


def gguf_reference(x, name):
    """gguf-py's numpy quantizer: (rows, K) float32 -> (rows, K / block * type_size) uint8."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), getattr(GGMLQuantizationType, name.upper()))


def _bind_quantize_chunk(path):
    lib = ctypes.CDLL(str(path))
    if not hasattr(lib, "ggml_quantize_chunk"):
        return None
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    return fn


@functools.lru_cache(maxsize=1)
def llama_quantize_chunk():
    """llama.cpp's ggml_quantize_chunk: from the libggml-base named by TALLOW_GGML_LIB, else from
    llama-cpp-python's bundled libraries; None (the reason in llama_unavailable_reason) when neither."""
    global llama_unavailable_reason
    env = os.environ.get("TALLOW_GGML_LIB")
    if env:
        fn = _bind_quantize_chunk(env)
        if fn is not None:
            return fn
        llama_unavailable_reason = f"TALLOW_GGML_LIB={env} exports no ggml_quantize_chunk"
        return None
    try:
        import llama_cpp
    except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
        llama_unavailable_reason = (f"llama_cpp (llama-cpp-python) is not importable ({e}) and TALLOW_GGML_LIB "
                                    "(a libggml-base.so) is not set")
        return None
    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml.so", "libllama.so", "libggml-base.dylib", "libllama.dylib"):
        if (libdir / name).exists():
            fn = _bind_quantize_chunk(libdir / name)
            if fn is not None:
                return fn
    llama_unavailable_reason = f"no library exporting ggml_quantize_chunk in {libdir}"
    return None


llama_unavailable_reason = ""


def llama_reference(x, name):
    """llama.cpp's quantizer (no importance matrix) on (rows, K) float32, or None when unavailable."""
    fn = llama_quantize_chunk()
    if fn is None or name not in LLAMA_TYPES:
        return None
    bs, ts, ggml_type = QUANT_TYPES[name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    out = np.zeros((rows, k // bs * ts), np.uint8)
    written = fn(ggml_type, x.ctypes.data, out.ctypes.data, 0, rows, k, None)
    assert written == out.nbytes, f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}"
    return out


def quantize_bytes(x, name, device="cpu"):
    """tallow's quantize of a tallow tensor x -> its bytes as a numpy uint8 array (on the host)."""
    q = tallow.ops.quantize(x, name)
    assert q.dtype.is_block and list(q.shape) == list(x.shape), (q.dtype, q.shape, x.shape)
    q = q if device == "cpu" else q.to("cpu")
    return np.array(q.numpy(raw=True), copy=True)


def _quantize_case(name):
    bs, ts, _ = QUANT_TYPES[name]

    def make(rng, dtype):
        k = bs * int(rng.integers(1, 5))
        kind = ("normal", "outliers", "scaled", "uniform")[int(rng.integers(0, 4))]
        x = np.concatenate([random_rows(rng, int(rng.integers(4, 12)), k, kind), special_rows(rng, k, dtype)])
        x = x[rng.permutation(len(x))]
        # Every other row of a wider array: the op sees a leading stride (the float rows become `dtype`).
        wide = np.repeat(x, 2, axis=0)
        wide[1::2] = np.nan
        return {"x": wide}

    def run(t, dtype, device):
        x = t["x"][0::2]  # a strided view (rows 0, 2, 4, ...)
        raw = quantize_bytes(x, name, device)
        return tallow.from_numpy(raw)

    def ref(r):
        x = np.ascontiguousarray(r["x"][0::2]).astype(np.float32)  # exact: r holds the dtype-rounded inputs
        if name in GGUF_PY_TYPES:
            return gguf_reference(x, name)
        out = llama_reference(x, name)
        if out is not None:
            return out
        return quantize_bytes(tallow.from_numpy(x), name)

    return OpCase(f"quantize[{name}]", make, run, ref, exact=True)


register(*[_quantize_case(n) for n in QUANT_TYPES])
