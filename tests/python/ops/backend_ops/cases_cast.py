import numpy as np

from backend_ops import Keep, OpCase, register
import tallow

# A cast is one rounding of an exact input: bounded by the target's unit roundoff
# (f16 2^-11, bf16 2^-8, f8e4m3 2^-4), so relative L2 error stays under half that... times sqrt(1).
_TARGET_TOL = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float8_e4m3": 2.0**-4}


def _cast_case(target):
    def make(rng, dtype):
        # f32 input of moderate range (inside f8e4m3's ±448 and f16's normal range)
        return {"x": Keep(rng.uniform(-200, 200, (31, 67)).astype(np.float32))}

    def ref(r):
        return r["x"]

    return OpCase(f"cast[f32->{target}]", make, lambda t, d, dev: tallow.ops.cast(t["x"], target), ref,
                  dtypes=("float32",), tol={"float32": _TARGET_TOL[target]})


register(*[_cast_case(t) for t in ("float32", "float16", "bfloat16", "float8_e4m3")])
register(
    OpCase("cast[to-f32]", lambda rng, d: {"x": rng.standard_normal((13, 100))},
           lambda t, d, dev: tallow.ops.cast(t["x"], "float32"), lambda r: r["x"], tol={k: 0.0 for k in ("float32", "float16", "bfloat16")}),
    OpCase("cast[strided]", lambda rng, d: {"x": rng.standard_normal((20, 30))},
           lambda t, d, dev: tallow.ops.cast(t["x"].T, "float32"), lambda r: r["x"].T, tol={k: 0.0 for k in ("float32", "float16", "bfloat16")}),
)
