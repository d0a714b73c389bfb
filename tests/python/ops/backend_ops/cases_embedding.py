"""Embedding lookup: float tables (a pure gather, exact) and GGUF block tables (dequantized rows).

Tolerances:
- float table, output in the table's dtype or f32: 0 — rows are copied (or widened exactly), and
  the reference reads the same rounded table.
- f32 table read out as bf16: one rounding per element, relative L2 <= 2^-8 / sqrt(3) ~ 2.3e-3 < 4e-3.
- Q8_0 / Q4_K / IQ4_NL / IQ4_XS tables: 0 — dequantize_row_f32 is bit-exact with gguf.quants.dequantize (ggml).
"""
import numpy as np

from backend_ops import Keep, OpCase, register
import tallow

from .cases_dequant import BLOCKS, random_blocks

EXACT = {"float32": 0.0, "float16": 0.0, "bfloat16": 0.0}


def _ids(rng, shape, v, dtype):
    return Keep(rng.integers(0, v, size=shape).astype(dtype))


def _float_case(name, v, d, ids_shape, ids_dtype=np.int32, out_dtype=None, tol=None):
    def make(rng, dtype):
        ids = _ids(rng, ids_shape, v, ids_dtype)
        ids.array.flat[0] = v - 1  # always touch the last row
        return {"ids": ids, "table": rng.standard_normal((v, d))}

    def run(t, dtype, dev):
        return tallow.ops.embedding(t["ids"], t["table"], dtype=out_dtype)

    def ref(r):
        return r["table"][r["ids"]]

    return OpCase(f"embedding[{name}]", make, run, ref, tol=dict(tol or EXACT))


def _strided_table_case():
    v, d = 50, 40

    def make(rng, dtype):
        return {"ids": _ids(rng, (9,), v, np.int64), "table_t": rng.standard_normal((d, v))}

    def run(t, dtype, dev):
        return tallow.ops.embedding(t["ids"], t["table_t"].T)  # table [V, D] with strides (1, V)

    def ref(r):
        return r["table_t"].T[r["ids"]]

    return OpCase("embedding[strided-table]", make, run, ref, tol=dict(EXACT))


def _q8_0_bytes(rng, v, d):
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(rng.standard_normal((v, d)).astype(np.float32), GGMLQuantizationType.Q8_0)


def _q4_k_bytes(rng, v, d):
    # Random blocks (144 bytes per 256 values) with finite, moderate f16 d / dmin fields.
    nb = d // 256
    raw = rng.integers(0, 256, size=(v, nb, 144), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(v, nb, 2)).astype(np.float16)
    raw[:, :, 0:4] = scales.view(np.uint8).reshape(v, nb, 4)
    return raw.reshape(v, nb * 144)


def _random_block_bytes(name):
    # random blocks with valid scale fields, as the dequantize cases make them
    return lambda rng, v, d: random_blocks(rng, name, v, d // BLOCKS[name][0])


def _block_case(name, qtype, make_bytes, v, d, ids_shape, out_dtype=None, tol=0.0):
    def make(rng, dtype):
        ids = _ids(rng, ids_shape, v, np.int64)
        ids.array.flat[0] = v - 1
        return {"ids": ids, "table_bytes": Keep(make_bytes(rng, v, d))}

    def run(t, dtype, dev):
        table = t["table_bytes"].view_as_dtype(qtype, [v, d])
        return tallow.ops.embedding(t["ids"], table, dtype=out_dtype)

    def ref(r):
        import gguf

        rows = gguf.quants.dequantize(r["table_bytes"], getattr(gguf.GGMLQuantizationType, qtype.upper()))
        return rows.astype(np.float64)[r["ids"]]

    # The table's dtype is the block type whatever the case dtype, so one dtype row suffices.
    return OpCase(f"embedding[{name}]", make, run, ref, dtypes=("float32",), tol={"float32": tol})


register(
    _float_case("i32-2d", v=100, d=64, ids_shape=(3, 7)),
    _float_case("i64-1d", v=257, d=96, ids_shape=(11,), ids_dtype=np.int64),
    # 0-D ids -> out [D] (the harness keeps 0-D arrays 0-D and moves them to the backend's device)
    OpCase("embedding[scalar-id]",
           lambda rng, d: {"id": Keep(np.array(rng.integers(0, 10), dtype=np.int64)),
                           "table": rng.standard_normal((10, 33))},
           lambda t, d, dev: tallow.ops.embedding(t["id"], t["table"]),
           lambda r: r["table"][int(r["id"])], tol=dict(EXACT)),
    _float_case("to-f32", v=64, d=48, ids_shape=(2, 5), out_dtype="float32"),
    _strided_table_case(),
    # widening is exact; narrowing f32 -> bf16 is checked as one rounding (inputs f32 only)
    OpCase("embedding[f32-to-bf16]",
           lambda rng, d: {"ids": _ids(rng, (6,), 40, np.int32), "table": rng.standard_normal((40, 128))},
           lambda t, d, dev: tallow.ops.embedding(t["ids"], t["table"], dtype="bfloat16"),
           lambda r: r["table"][r["ids"]], dtypes=("float32",), tol={"float32": 4e-3}),
    # GGUF block tables last: they depend on dequantize_row_f32 (cpp/ops/dequant.cpp)
    _block_case("q8_0", "q8_0", _q8_0_bytes, v=40, d=128, ids_shape=(2, 6)),
    _block_case("q8_0-to-bf16", "q8_0", _q8_0_bytes, v=30, d=64, ids_shape=(5,), out_dtype="bfloat16", tol=4e-3),
    _block_case("q4_k", "q4_k", _q4_k_bytes, v=12, d=512, ids_shape=(7,)),
    _block_case("iq4_nl", "iq4_nl", _random_block_bytes("iq4_nl"), v=20, d=96, ids_shape=(2, 4)),
    _block_case("iq4_xs", "iq4_xs", _random_block_bytes("iq4_xs"), v=12, d=512, ids_shape=(7,)),
)
