"""GGUF dequantization rows: one per block type, bit-exact (tolerance 0) against the gguf package's
numpy dequantizers on random blocks (random bytes with valid scale fields)."""
import numpy as np

from backend_ops import Keep, OpCase, register
import tallow

# name -> (block size, bytes per block, byte offsets of f16 scale fields, byte offsets of f32 scale fields);
# the dequantize and quant_linear tests share it
BLOCKS = {
    "q4_0": (32, 18, (0,), ()),
    "q4_1": (32, 20, (0, 2), ()),
    "q5_0": (32, 22, (0,), ()),
    "q5_1": (32, 24, (0, 2), ()),
    "q8_0": (32, 34, (0,), ()),
    "q8_1": (32, 36, (0, 2), ()),
    "q2_k": (256, 84, (80, 82), ()),
    "q3_k": (256, 110, (108,), ()),
    "q4_k": (256, 144, (0, 2), ()),
    "q5_k": (256, 176, (0, 2), ()),
    "q6_k": (256, 210, (208,), ()),
    "q8_k": (256, 292, (), (0,)),
    # non-linear 4-bit: f16 d, then (IQ4_XS) 6-bit sub-scales whose every bit pattern is valid, then nibbles
    "iq4_nl": (32, 18, (0,), ()),
    "iq4_xs": (256, 136, (0,), ()),
}


def random_blocks(rng, name, rows, nblocks):
    """(rows, nblocks * type_size) uint8: random bytes with valid scale fields (the dequantize and
    quant_linear tests use it too)."""
    _, ts, f16_at, f32_at = BLOCKS[name]
    raw = rng.integers(0, 256, size=(rows, nblocks, ts), dtype=np.uint8)
    n = rows * nblocks
    for off in f16_at:
        # Magnitudes from 2^-20 (f16 subnormals) to ~2^3, both signs, plus some exact zeros.
        v = rng.standard_normal(n) * np.exp2(rng.integers(-20, 3, size=n))
        v[rng.random(n) < 0.02] = 0.0
        raw[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nblocks, 2)
    for off in f32_at:
        v = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 3, size=n))).astype(np.float32)
        raw[:, :, off:off + 4] = v.view(np.uint8).reshape(rows, nblocks, 4)
    return raw.reshape(rows, nblocks * ts)


def _reference(raw, name):
    _, ts, _, _ = BLOCKS[name]
    rows = raw.shape[0]
    if name in ("q8_1", "q8_k"):
        # gguf has no dequantizer for these two; both are y = d * q with d an f16 (Q8_1: d, s, 32 x i8)
        # or an f32 (Q8_K: d, 256 x i8, 16 x i16 bsums) at the start of the block.
        b = raw.reshape(-1, ts)
        if name == "q8_1":
            d, q = b[:, 0:2].copy().view(np.float16).astype(np.float32), b[:, 4:]
        else:
            d, q = b[:, 0:4].copy().view(np.float32), b[:, 4:260]
        return (q.copy().view(np.int8).astype(np.float32) * d).reshape(rows, -1)
    import gguf.quants
    from gguf import GGMLQuantizationType

    return gguf.quants.dequantize(raw, getattr(GGMLQuantizationType, name.upper()))


def _dequant_case(name):
    bs, ts, _, _ = BLOCKS[name]

    def make(rng, dtype):
        return {"raw": Keep(random_blocks(rng, name, int(rng.integers(3, 9)), int(rng.integers(2, 7))))}

    def run(t, dtype, device):
        raw = np.ascontiguousarray((t["raw"] if device == "cpu" else t["raw"].to("cpu")).numpy())
        q = tallow.from_buffer(raw, dtype=name, shape=[raw.shape[0], raw.shape[1] // ts * bs])
        return tallow.ops.dequantize(q if device == "cpu" else q.to(device), "float32")

    def ref(r):
        return _reference(np.ascontiguousarray(r["raw"], dtype=np.uint8), name).astype(np.float64)

    return OpCase(f"dequantize[{name}]", make, run, ref, dtypes=("float32",), tol={"float32": 0.0})


register(*[_dequant_case(n) for n in BLOCKS])
