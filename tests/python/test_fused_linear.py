"""rms_norm_linear, linear_add, gated_linear_add (cpp/ops/fused_linear.h): a decode layer's norms and
residual adds folded into its projections.

CPU: each op is its composition, bitwise. Errors name the op and the shapes.
CUDA (skipped, with the reason, without a GPU), for M = 1..8 (fused: one GEMV) and M = 9, 16, 40
(fused adds up to 16; the norm composes), bf16 / f16, bias or none, Gemma's (1 + w):
  * linear_add and gated_linear_add are bitwise the composition on the device (the GEMV rounds the
    product, then adds the residual as add rounds it) and update residual in place;
  * rms_norm_linear is within one dtype rounding of the device composition: the kernel's 1 / rms
    sums x*x in another order (a few f32 ulps), so a normalised element may round the other way;
    bound (relative L2 vs the device composition): bf16 8e-3, f16 1e-3 - the output rounding's scale;
  * all three against float64 references: the output rounding plus the input roundings, bf16 1.2e-2,
    f16 2e-3.
The decoder's in-place residual stream (DecoderLayer.in_place) is checked against transformers in the
model tests (steps of <= 8 tokens take it) and on the GPU in test_engine_cuda*.
"""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc
from tallow import ops

needs_cuda = pytest.mark.skipif(
    not tc.is_available(),
    reason="no CUDA: this build has no CUDA backend" if not tc.built else "no CUDA: no driver or device present",
)
FLOATS = ["bfloat16", "float16"]
DEVICE_TOL = {"bfloat16": 8e-3, "float16": 1e-3}
REF_TOL = {"bfloat16": 1.2e-2, "float16": 2e-3}


def _np(t):
    return t.to("cpu").to("float32").numpy().astype(np.float64)


def _rel(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _t(rng, shape, dtype, scale=1.0, device="cpu"):
    t = tallow.tensor((rng.standard_normal(shape) * scale).astype(np.float32), dtype=dtype)
    return t if device == "cpu" else t.to(device)


def _norm_ref(x, w, eps, gemma):
    x = _np(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (_np(w) + (1.0 if gemma else 0.0))


def _silu_mul(y):
    k = y.shape[-1] // 2
    g, u = y[..., :k], y[..., k:]
    return g / (1.0 + np.exp(-g)) * u


# ---- CPU: the compositions ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gemma", [False, True])
def test_cpu_rms_norm_linear_is_the_composition(rng, dtype, gemma):
    x, nw, w, b = _t(rng, (5, 64), dtype), _t(rng, (64,), dtype), _t(rng, (48, 64), dtype, 0.1), _t(rng, (48,), dtype)
    got = ops.rms_norm_linear(x, nw, 1e-5, gemma, w, b)
    want = ops.linear(ops.rms_norm(x, nw, 1e-5, gemma), w, b)
    np.testing.assert_array_equal(got.numpy(raw=True), want.numpy(raw=True))
    assert _rel(_np(got), _norm_ref(x, nw, 1e-5, gemma) @ _np(w).T + _np(b)) < REF_TOL["bfloat16"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_linear_add_updates_residual_in_place(rng, dtype):
    x, w, r = _t(rng, (3, 2, 32), dtype), _t(rng, (24, 32), dtype, 0.2), _t(rng, (3, 2, 24), dtype)
    want = ops.add(r.clone(), ops.linear(x, w))
    got = ops.linear_add(x, w, None, r)
    assert got.data_ptr == r.data_ptr
    np.testing.assert_array_equal(r.numpy(raw=True), want.numpy(raw=True))


def test_cpu_gated_linear_add_updates_residual_in_place(rng):
    x, w, b, r = _t(rng, (4, 64), "bfloat16"), _t(rng, (16, 32), "bfloat16", 0.2), _t(rng, (16,), "bfloat16"), \
        _t(rng, (4, 16), "bfloat16")
    want = ops.add(r.clone(), ops.gated_linear(x, w, b, "gelu_tanh"))
    ops.gated_linear_add(x, w, b, "gelu_tanh", r)
    np.testing.assert_array_equal(r.numpy(raw=True), want.numpy(raw=True))


def test_errors_name_the_op_and_shapes(rng):
    x, w = _t(rng, (2, 64), "float32"), _t(rng, (8, 64), "float32")
    with pytest.raises(ValueError, match=r"rms_norm_linear: norm_w must have shape \[64\]"):
        ops.rms_norm_linear(x, _t(rng, (63,), "float32"), 1e-6, False, w)
    with pytest.raises(ValueError, match=r"rms_norm_linear: x \[2, 64\] and w \[8, 32\]"):
        ops.rms_norm_linear(x, _t(rng, (64,), "float32"), 1e-6, False, _t(rng, (8, 32), "float32"))
    with pytest.raises(ValueError, match=r"linear_add: residual must have shape \[2, 8\]"):
        ops.linear_add(x, w, None, _t(rng, (2, 9), "float32"))
    with pytest.raises(ValueError, match=r"linear_add: residual must be contiguous"):
        ops.linear_add(x, w, None, _t(rng, (8, 2), "float32").transpose(0, 1))
    with pytest.raises(ValueError, match=r"gated_linear_add: x \[2, 64\] and w \[8, 64\]"):
        ops.gated_linear_add(x, w, None, "silu", _t(rng, (2, 8), "float32"))


# ---- CUDA ---------------------------------------------------------------------------------------

ROWS = [1, 2, 3, 5, 8, 9, 16, 40]


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias,gemma", [(False, False), (True, True)])
def test_cuda_rms_norm_linear(rng, dtype, m, bias, gemma):
    k, n = 1024, 3 * 256 + 8  # n not a multiple of the 16-row tile
    x = _t(rng, (m, k), dtype, 3.0, "cuda")
    nw, w = _t(rng, (k,), dtype, 1.0, "cuda"), _t(rng, (n, k), dtype, k**-0.5, "cuda")
    b = _t(rng, (n,), dtype, 1.0, "cuda") if bias else None
    got = ops.rms_norm_linear(x, nw, 1e-6, gemma, w, b)
    comp = ops.linear(ops.rms_norm(x, nw, 1e-6, gemma), w, b)
    assert got.shape == (m, n) and got.device == x.device
    assert _rel(_np(got), _np(comp)) <= DEVICE_TOL[dtype]
    ref = _norm_ref(x, nw, 1e-6, gemma) @ _np(w).T + (_np(b) if bias else 0.0)
    assert _rel(_np(got), ref) <= REF_TOL[dtype]
    again = ops.rms_norm_linear(x, nw, 1e-6, gemma, w, b)  # deterministic
    np.testing.assert_array_equal(got.to("cpu").numpy(raw=True), again.to("cpu").numpy(raw=True))


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_linear_add_is_the_composition(rng, dtype, m, bias):
    k, n = 2048, 1024
    x, w = _t(rng, (m, k), dtype, 1.0, "cuda"), _t(rng, (n, k), dtype, k**-0.5, "cuda")
    b = _t(rng, (n,), dtype, 1.0, "cuda") if bias else None
    r = _t(rng, (m, n), dtype, 4.0, "cuda")
    r0 = _np(r)
    want = ops.add(r.clone(), ops.linear(x, w, b))
    got = ops.linear_add(x, w, b, r)
    assert got.data_ptr == r.data_ptr
    np.testing.assert_array_equal(r.to("cpu").numpy(raw=True), want.to("cpu").numpy(raw=True))
    ref = r0 + _np(x) @ _np(w).T + (_np(b) if bias else 0.0)
    assert _rel(_np(r), ref) <= REF_TOL[dtype]


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("m", [1, 4, 8, 16, 33])
def test_cuda_gated_linear_add_is_the_composition(rng, dtype, m):
    k, n = 1536, 512
    x, w = _t(rng, (m, 2 * k), dtype, 1.5, "cuda"), _t(rng, (n, k), dtype, k**-0.5, "cuda")
    r = _t(rng, (m, n), dtype, 2.0, "cuda")
    r0 = _np(r)
    want = ops.add(r.clone(), ops.gated_linear(x, w, None, "silu"))
    ops.gated_linear_add(x, w, None, "silu", r)
    np.testing.assert_array_equal(r.to("cpu").numpy(raw=True), want.to("cpu").numpy(raw=True))
    assert _rel(_np(r), r0 + _silu_mul(_np(x)) @ _np(w).T) <= REF_TOL[dtype]


@needs_cuda
def test_cuda_fused_ops_capture_into_a_graph(rng):
    """The decode layer's sequence (norm-folded projection, then residual-folded one) replays from a
    CUDA graph with the same result as eager launches."""
    k, n = 1024, 1024
    h = _t(rng, (2, k), "bfloat16", 2.0, "cuda")
    nw, w1, w2 = _t(rng, (k,), "bfloat16", 1.0, "cuda"), _t(rng, (n, k), "bfloat16", k**-0.5, "cuda"), \
        _t(rng, (k, n), "bfloat16", n**-0.5, "cuda")
    h_eager, h_graph = h.clone(), h.clone()

    def step(hh):
        ops.linear_add(ops.rms_norm_linear(hh, nw, 1e-6, False, w1), w2, None, hh)

    step(h_eager)
    g = tc.CUDAGraph()
    with tc.graph(g):
        step(h_graph)
    h_graph.copy_(h)
    g.replay()
    tc.synchronize()
    np.testing.assert_array_equal(h_graph.to("cpu").numpy(raw=True), h_eager.to("cpu").numpy(raw=True))


# ---- the decoder's opt-in in-place residual stream (TALLOW_IN_PLACE_DECODE=1) ------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_in_place_decode_matches_the_default_path(tmp_path, monkeypatch, arch, where):
    """Greedy decode with the residual stream updated in place (norms and adds folded into the
    projections) against the default (delta, residual) stream: on the CPU in f32 the same tokens
    (the same values: the ops compose the same kernels); on CUDA in bf16, where the fused GEMV's
    1 / rms may round differently, the same first 8 tokens for at least 3 of 4 prompts."""
    if where == "cuda" and not tc.is_available():
        pytest.skip("no CUDA: " + ("no driver or device present" if tc.built else "this build has no CUDA backend"))
    pytest.importorskip("transformers")
    import gc

    from engine_models import make_checkpoint
    from tallow import LLM, SamplingParams
    dtype = "float32" if where == "cpu" else "bfloat16"
    make_checkpoint(tmp_path, arch, dtype=dtype, qk_scale=1.5)
    rng_p = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng_p.integers(2, 200, n).tolist()} for n in (1, 5, 17, 40)]

    def run(flag):
        monkeypatch.setenv("TALLOW_IN_PLACE_DECODE", flag)
        llm = LLM(model=str(tmp_path), device="cpu" if where == "cpu" else "cuda:0", dtype=dtype, max_num_seqs=4,
                  max_model_len=256)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        ids = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        gc.collect()
        return ids

    default, in_place = run("0"), run("1")
    if where == "cpu":
        assert in_place == default
    else:
        agree = sum(a[:8] == b[:8] for a, b in zip(default, in_place))
        assert agree >= 3, f"{agree} of 4 prompts agree on 8 tokens: {default} vs {in_place}"
