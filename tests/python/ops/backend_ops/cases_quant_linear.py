"""dequant_linear rows: x [M, K] @ dequantize(w [N, K])^T + bias with w a GGUF block tensor, one row per
block type, against float64 x @ (gguf's dequantization of w)^T + bias. The CPU runs the op itself
(cpp/ops/quant_linear.h); on CUDA, where the op is CPU-only, the row checks the composition its callers
use there, linear(x, dequantize(w)). M = 5 (decode path) or 37 (prefill path), N not a multiple of 8."""
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
        if device == "cpu":
            return tallow.ops.dequant_linear(t["x"], q, t["bias"])
        return tallow.ops.linear(t["x"], tallow.ops.dequantize(q.to(device), dtype), t["bias"])

    def ref(r):
        w = _reference(np.ascontiguousarray(r["raw"], dtype=np.uint8), name).astype(np.float64)
        return r["x"] @ w.T + r["bias"]

    return OpCase(f"dequant_linear[{name},M={M}]", make, run, ref)


register(*[_quant_linear_case(n, m) for n in BLOCKS for m in (5, 37)])
