"""Every op × dtype × built backend against its float64 reference (see backend_ops/__init__.py)."""
import numpy as np
import pytest

import tallow
from backend_ops import Keep, load_all, relative_error


def backends():
    names = ["cpu"]
    if tallow._core.build_info.get("cuda"):
        from tallow import cuda  # noqa: F401  (present in CUDA builds)

        if cuda.is_available():
            names.append("cuda")
    return names


def params():
    out = []
    for case in load_all():
        for dtype in case.dtypes:
            for backend in backends():
                out.append(pytest.param(case, dtype, backend, id=f"{case.name}-{dtype}-{backend}"))
    return out


def to_inputs(raw, dtype, device):
    """Round float inputs to the case's dtype; returns (tallow inputs, float64 reference inputs)."""
    tl_in, ref_in = {}, {}
    for key, val in raw.items():
        if isinstance(val, Keep):
            t = tallow.tensor(val.array, dtype=val.dtype) if val.dtype else tallow.from_numpy(np.require(val.array, requirements="C"))
        elif isinstance(val, np.ndarray) and val.dtype.kind == "f":
            t = tallow.tensor(val.astype(np.float32), dtype=dtype)
        elif isinstance(val, np.ndarray):
            t = tallow.from_numpy(np.require(val, requirements="C"))
        else:
            tl_in[key] = ref_in[key] = val
            continue
        ref_in[key] = t.to("float32").numpy().astype(np.float64) if t.dtype.is_float else t.numpy().copy()
        tl_in[key] = t if device == "cpu" else t.to(device)
    return tl_in, ref_in


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("case,dtype,backend", params())
def test_backend_op(case, dtype, backend, rng):
    raw = case.make(rng, dtype)
    tl_in, ref_in = to_inputs(raw, dtype, backend)
    outs = as_tuple(case.run(tl_in, dtype, backend))
    refs = as_tuple(case.ref(ref_in))
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        o = o.to("cpu") if backend != "cpu" else o
        o_np = o.to("float32").numpy() if o.dtype.is_float else o.numpy()
        if case.exact:
            np.testing.assert_array_equal(o_np, r, err_msg=f"{case.name} output {i}")
        else:
            err = relative_error(o_np, r)
            assert err <= case.tol[dtype], f"{case.name} output {i} [{dtype}/{backend}]: rel err {err:.3g} > {case.tol[dtype]:.3g}"
