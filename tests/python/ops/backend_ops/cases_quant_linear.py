"""quant_linear rows: x [M, K] @ dequantize(w [N, K])^T + bias with w a GGUF block tensor, one row per
block type and M, against float64 x @ (gguf's dequantization of w)^T + bias, on every device (the op itself:
CPU cpp/ops/quant_linear.h, CUDA through BackendOps::quant_linear). On the CPU M in {1, 3} takes the decode
path (x quantized to 8 bits per block of 32 or 256), 16, 17 and 40 the dequantized tiles; a GPU kernel may
switch elsewhere. N odd, K = 512 (2-16 blocks).

Bound: relative L2 error <= 0.02 for every dtype. An 8-bit activation block rounds each x_k by at most
d / 2, d = max|x| / 127 over its block (<= 256 elements: ~2.8 sigma / 127 for normal x), an error uniform
in +-d / 2 and independent of w, so the expected relative error of an output is ~ d / sqrt(12) / sigma
~ 0.0065 (the bias only lowers it); 0.02 leaves 3x for the f16 activation scale some kernels keep and
for the bf16 output rounding (2^-8 / sqrt(3)). A wrong nibble order or scale decoding gives O(1); one
wrong 16-element sub-scale out of 32, ~0.2. Unquantized paths (prefill) land ~1e-6."""
import numpy as np

from backend_ops import Keep, OpCase, register
import tallow

from .cases_dequant import BLOCKS, _reference


def _weight_blocks(rng, name, rows, nblocks):
    """Random quant bytes with scale fields of a trained weight's magnitude (|d| ~ 1e-2), so that
    products stay well inside the f16 range."""
    _, ts, f16_at, f32_at = BLOCKS[name]
    raw = rng.integers(0, 256, size=(rows, nblocks, ts), dtype=np.uint8)
    for off in f16_at:
        v = rng.choice([-1.0, 1.0], size=(rows, nblocks)) * rng.uniform(0.5, 2.0, size=(rows, nblocks)) * 1e-2
        raw[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nblocks, 2)
    for off in f32_at:
        v = (rng.uniform(0.5, 2.0, size=(rows, nblocks)) * 1e-3).astype(np.float32)
        raw[:, :, off:off + 4] = v.view(np.uint8).reshape(rows, nblocks, 4)
    return raw.reshape(rows, nblocks * ts)


def _quant_linear_case(name, M):
    bs, ts, _, _ = BLOCKS[name]

    def make(rng, dtype):
        K, N = 512, 43
        raw = _weight_blocks(rng, name, N, K // bs)
        return {"x": rng.standard_normal((M, K)), "raw": Keep(raw), "bias": rng.standard_normal(N)}

    def run(t, dtype, device):
        raw = np.ascontiguousarray((t["raw"] if device == "cpu" else t["raw"].to("cpu")).numpy())
        q = tallow.from_buffer(raw, dtype=name, shape=[raw.shape[0], raw.shape[1] // ts * bs])
        return tallow.ops.quant_linear(t["x"], q if device == "cpu" else q.to(device), t["bias"])

    def ref(r):
        w = _reference(np.ascontiguousarray(r["raw"], dtype=np.uint8), name).astype(np.float64)
        return r["x"] @ w.T + r["bias"]

    return OpCase(f"quant_linear[{name},M={M}]", make, run, ref, dtypes=("float32", "bfloat16"),
                  tol={"float32": 0.02, "bfloat16": 0.02})


register(*[_quant_linear_case(n, m) for n in BLOCKS for m in (1, 3, 16, 17, 40)])
