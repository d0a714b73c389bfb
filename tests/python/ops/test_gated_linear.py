"""gated_linear: linear(act(x[..., :K]) * x[..., K:], w, bias) in one op.

CPU: the op is the composition (bitwise). Errors name the op and the shapes. GatedMLP calls it.
CUDA (skipped, with the reason, without a GPU): for M = 1..16 and 64, silu / gelu_tanh / gelu, bias or
none, bf16 / f16 / f32, the result is bitwise the composition's on the device (the gated GEMV stages
exactly silu_and_mul's rounded product and reduces in gemv's order; other shapes run the composition)
and within the float64 bound; repeated runs are bitwise equal; it captures into a CUDA graph.
Reference bounds (L2 of the error vs float64 of the unrounded product, relative to the same sum over
magnitudes, |act| @ |w|^T + |b|): the output rounding plus the rounding of the activated product,
~u*sqrt(2/3): bf16 8e-3, f16 1e-3, f32 1e-5 (see cases_gated_linear). Over 4,800 random CPU cases
(400 seeds) the bf16 worst was 4.3e-3; relative to the result itself it reached 2.2e-2 where a few
outputs cancel, which made the earlier form of this check fail now and then.
"""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc
from tallow.layers.mlp import GatedMLP

ACTS = ["silu", "gelu_tanh", "gelu"]
TOL = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-5}

needs_cuda = pytest.mark.skipif(
    not tc.is_available(),
    reason="no CUDA: this build has no CUDA backend" if not tc.built else "no CUDA: no driver or device present",
)


def _np(t):
    return t.to("cpu").to("float32").numpy().astype(np.float64)


def _act_ref(x, act):
    k = x.shape[-1] // 2
    g, u = x[..., :k], x[..., k:]
    if act == "silu":
        a = g / (1.0 + np.exp(-g))
    elif act == "gelu_tanh":
        a = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))
    else:
        from math import erf
        a = 0.5 * g * (1.0 + np.vectorize(erf)(g / np.sqrt(2.0)))
    return a * u


def _composition(x, w, b, act):
    y = tallow.ops.silu_and_mul(x) if act == "silu" else tallow.ops.gelu_and_mul(
        x, approximate="tanh" if act == "gelu_tanh" else "none")
    return tallow.ops.linear(y, w, b)


def _inputs(rng, shape_x, n, dtype, bias):
    k = shape_x[-1] // 2
    x = tallow.tensor(rng.standard_normal(shape_x) * 2.0, dtype=dtype)
    w = tallow.tensor(rng.standard_normal((n, k)) / np.sqrt(k), dtype=dtype)
    b = tallow.tensor(rng.standard_normal(n), dtype=dtype) if bias else None
    return x, w, b


def _ref_err(y, x, w, b, act):
    """Normwise error of y against the float64 act(gate) * up @ w^T + b, relative to the same sum
    taken over magnitudes (|act| @ |w|^T + |b|): the rounding bound's own scale. (Relative to the
    result itself, a few outputs that cancel - these tests use as few as 3 - exceed any fixed bound.)"""
    a = _act_ref(x, act)
    ref = a @ w.T + (b if b is not None else 0.0)
    mag = np.abs(a) @ np.abs(w).T + (np.abs(b) if b is not None else 0.0)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(mag))


# ---- CPU ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("act", ACTS)
def test_cpu_is_the_composition(rng, dtype, act):
    for shape_x, n, bias in [((1, 64), 9, True), ((5, 2 * 40), 17, False), ((2, 3, 2 * 24), 8, True), ((2 * 16,), 3, True)]:
        x, w, b = _inputs(rng, shape_x, n, dtype, bias)
        got = tallow.ops.gated_linear(x, w, b, activation=act)
        want = _composition(x, w, b, act)
        assert tuple(got.shape) == tuple(shape_x[:-1]) + (n,)
        np.testing.assert_array_equal(_np(got), _np(want))
        out = tallow.tensor(np.full(tuple(shape_x[:-1]) + (n,), np.nan, np.float32), dtype=dtype)
        tallow.ops.gated_linear(x, w, b, activation=act, out=out)
        np.testing.assert_array_equal(_np(out), _np(want))
        assert _ref_err(_np(got), _np(x), _np(w), _np(b) if bias else None, act) < TOL[dtype]


def test_errors_name_op_and_shapes():
    x = tallow.tensor(np.ones((3, 16), np.float32))
    w = tallow.tensor(np.ones((5, 8), np.float32))
    with pytest.raises(ValueError, match=r"gated_linear: activation must be .*got \"relu\""):
        tallow.ops.gated_linear(x, w, activation="relu")
    with pytest.raises(ValueError, match=r"gated_linear: x \[3, 15\] and w \[5, 8\]"):
        tallow.ops.gated_linear(tallow.tensor(np.ones((3, 15), np.float32)), w)
    with pytest.raises(ValueError, match=r"gated_linear: x \[3, 16\] and w \[5, 7\]"):
        tallow.ops.gated_linear(x, tallow.tensor(np.ones((5, 7), np.float32)))
    with pytest.raises(ValueError, match=r"gated_linear: w must be 2-D"):
        tallow.ops.gated_linear(x, tallow.tensor(np.ones((5, 8, 1), np.float32)))
    with pytest.raises(ValueError, match=r"gated_linear: bias must have shape \[5\]"):
        tallow.ops.gated_linear(x, w, tallow.tensor(np.ones(4, np.float32)))
    with pytest.raises(TypeError, match=r"gated_linear: x .* and w .* must have the same dtype"):
        tallow.ops.gated_linear(x, w.to("bfloat16"))
    with pytest.raises(TypeError, match=r"gated_linear: x must be float32, float16 or bfloat16"):
        tallow.ops.gated_linear(tallow.tensor(np.ones((3, 16), np.int32)), w)
    with pytest.raises(ValueError, match=r"gated_linear: out has shape"):
        tallow.ops.gated_linear(x, w, out=tallow.tensor(np.ones((3, 4), np.float32)))


@pytest.mark.parametrize("hidden_act,act", [("silu", "silu"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu", "gelu")])
def test_gated_mlp_uses_gated_linear(rng, hidden_act, act):
    h, inter = 32, 48
    gate_up = tallow.tensor(rng.standard_normal((2 * inter, h)) / np.sqrt(h), dtype="bfloat16")
    down = tallow.tensor(rng.standard_normal((h, inter)) / np.sqrt(inter), dtype="bfloat16")
    mlp = GatedMLP(gate_up, down, hidden_act)
    assert mlp.gated_activation == act
    x = tallow.tensor(rng.standard_normal((3, h)), dtype="bfloat16")
    want = _composition(tallow.ops.linear(x, gate_up), down, None, act)
    np.testing.assert_array_equal(_np(mlp(x)), _np(want))


# ---- CUDA -----------------------------------------------------------------------------------------

@pytest.fixture
def skinny16():
    old = tc._c.skinny_max_m()
    tc._c.set_skinny_max_m(16)
    yield
    tc._c.set_skinny_max_m(old)


@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("act", ACTS)
def test_cuda_matches_composition(rng, skinny16, dtype, act):
    """M = 1..16 (the gated GEMV for f16/bf16) and 64 (the composition): bitwise the composition's
    result on the device, and within the float64 bound."""
    # (K, N): the 8B down projection shape's K / 4, a partial last GEMV step, odd N
    for k, n in [(3584, 256), (1000, 77)]:
        w = tallow.tensor(rng.standard_normal((n, k)) / np.sqrt(k), dtype=dtype)
        b = tallow.tensor(rng.standard_normal(n), dtype=dtype)
        wg, bg = w.to("cuda"), b.to("cuda")
        for m in list(range(1, 17)) + [64]:
            use_bias = m % 2 == 1
            x = tallow.tensor(rng.standard_normal((m, 2 * k)) * 2.0, dtype=dtype)
            xg = x.to("cuda")
            out = tallow.tensor(np.full((m, n), np.nan, np.float32), dtype=dtype).to("cuda")
            tallow.ops.gated_linear(xg, wg, bg if use_bias else None, activation=act, out=out)
            got = _np(out)
            want = _np(_composition(xg, wg, bg if use_bias else None, act))
            assert not np.isnan(got).any(), f"M={m} K={k}: outputs left unwritten"
            np.testing.assert_array_equal(got, want, err_msg=f"{act} {dtype} M={m} N={n} K={k}")
            err = _ref_err(got, _np(x), _np(w), _np(b) if use_bias else None, act)
            assert err < TOL[dtype], f"{act} {dtype} M={m} K={k}: error {err:.2e}"


@needs_cuda
def test_cuda_shapes_and_strides(rng, skinny16):
    """1-D and 3-D x, a row-strided view (the GEMV with ldx > 2K), an unaligned view (the fallback)."""
    k, n = 512, 129
    x, _, b = _inputs(rng, (6, 2 * k + 16), n, "bfloat16", True)
    _, w, _ = _inputs(rng, (1, 2 * k), n, "bfloat16", False)  # w [n, k]: the views below are 2k wide
    xg, wg, bg = x.to("cuda"), w.to("cuda"), b.to("cuda")
    for view in (lambda t: t[:, :2 * k], lambda t: t[::2, 8:8 + 2 * k], lambda t: t[1:4, 1:1 + 2 * k]):
        got = _np(tallow.ops.gated_linear(view(xg), wg, bg))
        want = _np(_composition(view(xg), wg, bg, "silu"))
        np.testing.assert_array_equal(got, want)
        assert _ref_err(got, view(_np(x)), _np(w), _np(b), "silu") < TOL["bfloat16"]
    x1 = xg[0, :2 * k]
    y1 = tallow.ops.gated_linear(x1, wg, bg)
    assert tuple(y1.shape) == (n,)
    np.testing.assert_array_equal(_np(y1), _np(_composition(x1, wg, bg, "silu")))
    x3 = xg[:4, :2 * k].reshape([2, 2, 2 * k])
    y3 = tallow.ops.gated_linear(x3, wg, None, activation="gelu")
    assert tuple(y3.shape) == (2, 2, n)
    np.testing.assert_array_equal(_np(y3), _np(_composition(x3, wg, None, "gelu")))


@needs_cuda
def test_cuda_deterministic(rng, skinny16):
    k, n = 14336 // 4, 1024
    x, w, b = _inputs(rng, (16, 2 * k), n, "bfloat16", True)
    wg, bg = w.to("cuda"), b.to("cuda")
    for m in (1, 5, 16):
        xg = x.to("cuda")[:m]
        first = _np(tallow.ops.gated_linear(xg, wg, bg))
        for _ in range(3):
            np.testing.assert_array_equal(_np(tallow.ops.gated_linear(xg, wg, bg)), first)


@needs_cuda
def test_cuda_graph_capture(rng, skinny16):
    """Captured (with PDL where the device has it), replayed with fresh x: the eager results."""
    k, n, m = 1024, 512, 3
    x, w, b = _inputs(rng, (m, 2 * k), n, "bfloat16", True)
    xg, wg, bg = x.to("cuda"), w.to("cuda"), b.to("cuda")
    out = tallow.tensor(np.zeros((m, n), np.float32), dtype="bfloat16").to("cuda")
    tallow.ops.gated_linear(xg, wg, bg, out=out)
    tc.synchronize()
    g = tc.CUDAGraph()
    with tc.graph(g):
        tallow.ops.gated_linear(xg, wg, bg, out=out)
    for _ in range(2):
        xg.copy_(tallow.tensor(rng.standard_normal((m, 2 * k)) * 2.0, dtype="bfloat16").to("cuda"))
        g.replay()
        tc.synchronize()
        np.testing.assert_array_equal(_np(out), _np(tallow.ops.gated_linear(xg, wg, bg)))
    g.reset()
