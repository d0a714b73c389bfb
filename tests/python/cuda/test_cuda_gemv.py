"""tallow's decode GEMV (cuda/gemv.cu): linear and matmul with M <= 16 rows on CUDA against float64
numpy on fresh random inputs (bf16 and f16, bias or none, odd N, strided x rows), the same products
through cuBLASLt (skinny_max_m 0), bitwise run-to-run determinism, CUDA graph capture, every launch
configuration (set_gemv_config, TALLOW_GEMV_CONFIG) and its errors, in plain and gated (gated_linear)
mode. The decode path with programmatic dependent launch (PDL): a chain of norms, GEMVs, gated GEMVs
and silu_and_mul captured (the norms with PDL on sm_90; the GEMVs with and without a pinned pdl=1
launch) gives bitwise the eager results; decode-shaped (few-row) norms against float64. Skipped, with the reason, where this build has no
CUDA backend or no GPU is present."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tallow
import tallow.cuda as tc

pytestmark = pytest.mark.skipif(
    not tc.is_available(),
    reason="no CUDA: this build has no CUDA backend" if not tc.built else "no CUDA: no driver or device present",
)

# Relative L2 error bounds against float64 on the same (rounded) inputs: one rounding of the output
# (bf16 u = 2^-8, f16 u = 2^-11) plus f32 accumulation.
TOL = {"bfloat16": 8e-3, "float16": 1e-3}
# (N, K): tiny, odd N, partial last steps (K not a multiple of 32 * unroll), the Qwen3-0.6B and an
# 8B o_proj shape; (5, 20) has K % 8 != 0, so it falls back to cuBLASLt.
SHAPES = [(1, 8), (7, 24), (33, 72), (100, 264), (257, 1000), (384, 1024), (1000, 2056), (4096, 1024),
          (1024, 2048), (1024, 3072), (4096, 4096), (5, 20)]


@pytest.fixture
def skinny16():
    old = tc._c.skinny_max_m()
    tc._c.set_skinny_max_m(16)
    yield
    tc._c.set_skinny_max_m(old)


def _f64(t):
    return t.to("cpu").to("float32").numpy().astype(np.float64)


def _rel(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _nan_out(M, N, dtype):
    """An output filled with NaN, so that any element the kernel fails to write shows."""
    return tallow.tensor(np.full((M, N), np.nan, np.float32), dtype=dtype).to("cuda")


def _linear(x, w, b, M, N, dtype, skinny=16):
    old = tc._c.skinny_max_m()
    tc._c.set_skinny_max_m(skinny)
    try:
        out = _nan_out(M, N, dtype)
        tallow.ops.linear(x, w, b, out=out)
        return _f64(out)
    finally:
        tc._c.set_skinny_max_m(old)


def _weights(rng, N, K, dtype, bias):
    w = tallow.tensor(rng.standard_normal((N, K)) / np.sqrt(K), dtype=dtype)
    b = tallow.tensor(rng.standard_normal(N), dtype=dtype) if bias else None
    return w, b


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("N,K", SHAPES)
def test_linear_matches_reference(rng, dtype, N, K):
    """Every M from 1 to 16, bias on odd M; the gemv result and cuBLASLt's both within the bound."""
    w, b = _weights(rng, N, K, dtype, True)
    wg, bg = w.to("cuda"), b.to("cuda")
    wr, br = _f64(w), _f64(b)
    for M in range(1, 17):
        use_bias = M % 2 == 1
        x = tallow.tensor(rng.standard_normal((M, K)), dtype=dtype)
        ref = _f64(x) @ wr.T + (br if use_bias else 0)
        got = _linear(x.to("cuda"), wg, bg if use_bias else None, M, N, dtype)
        lt = _linear(x.to("cuda"), wg, bg if use_bias else None, M, N, dtype, skinny=0)
        assert not np.isnan(got).any(), f"M={M}: outputs left unwritten"
        assert _rel(got, ref) < TOL[dtype], f"gemv M={M} N={N} K={K}: rel err {_rel(got, ref):.2e}"
        assert _rel(lt, ref) < TOL[dtype], f"cuBLASLt M={M} N={N} K={K}: rel err {_rel(lt, ref):.2e}"
        assert _rel(got, lt) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_strided_and_shaped_inputs(rng, dtype, skinny16):
    """x rows as a view (aligned: gemv; unaligned: the fallback), x 1-D and 3-D, and matmul(x, w.T)."""
    N, K = 129, 512
    w, b = _weights(rng, N, K, dtype, True)
    wg, bg = w.to("cuda"), b.to("cuda")
    wr, br = _f64(w), _f64(b)
    for M in (1, 3, 8, 11, 16):
        big = tallow.tensor(rng.standard_normal((M, K + 24)), dtype=dtype).to("cuda")
        for off in (8, 16, 1):  # 16- and 32-byte aligned views, then an unaligned one
            x = big[:, off:off + K]
            ref = _f64(big)[:, off:off + K] @ wr.T + br
            out = _nan_out(M, N, dtype)
            tallow.ops.linear(x, wg, bg, out=out)
            assert _rel(_f64(out), ref) < TOL[dtype], f"M={M} offset {off}"
        x3 = tallow.tensor(rng.standard_normal((1, M, K)), dtype=dtype)
        y3 = tallow.ops.linear(x3.to("cuda"), wg, bg)
        assert tuple(y3.shape) == (1, M, N)
        assert _rel(_f64(y3)[0], _f64(x3)[0] @ wr.T + br) < TOL[dtype]
        y = tallow.ops.matmul(x3.to("cuda")[0], wg.T)  # the [K, N] view of w: matmul's gemv path
        assert _rel(_f64(y), _f64(x3)[0] @ wr.T) < TOL[dtype]
    x1 = tallow.tensor(rng.standard_normal(K), dtype=dtype)
    y1 = tallow.ops.linear(x1.to("cuda"), wg, bg)
    assert tuple(y1.shape) == (N,)
    assert _rel(_f64(y1), _f64(x1) @ wr.T + br) < TOL[dtype]


@pytest.mark.parametrize("N,K", [(1024, 2048), (1024, 3072), (4096, 4096), (1000, 2056)])
def test_deterministic(rng, skinny16, N, K):
    """No atomics: the same inputs give bitwise the same outputs, cluster-split shapes included."""
    w, b = _weights(rng, N, K, "bfloat16", True)
    wg, bg = w.to("cuda"), b.to("cuda")
    for M in (1, 6, 16):
        x = tallow.tensor(rng.standard_normal((M, K)), dtype="bfloat16").to("cuda")
        first = tallow.ops.linear(x, wg, bg).to("cpu").to("float32").numpy()
        for _ in range(3):
            again = tallow.ops.linear(x, wg, bg).to("cpu").to("float32").numpy()
            np.testing.assert_array_equal(again, first)


def test_graph_capture(rng, skinny16):
    """gemv launches (clusters included) captured into a CUDA graph give fresh results on replay."""
    dtype = "bfloat16"
    shapes = [(1024, 2048, 1), (1024, 3072, 12), (4096, 1024, 16), (257, 1000, 5)]
    ws = [_weights(rng, N, K, dtype, M % 2 == 0) for N, K, M in shapes]
    wgs = [(w.to("cuda"), b.to("cuda") if b is not None else None) for w, b in ws]
    xs = [tallow.tensor(rng.standard_normal((M, K)), dtype=dtype).to("cuda") for N, K, M in shapes]
    outs = [tallow.tensor(np.zeros((M, N), np.float32), dtype=dtype).to("cuda") for N, K, M in shapes]
    for x, (w, b), o in zip(xs, wgs, outs):
        tallow.ops.linear(x, w, b, out=o)  # warm-up outside the capture
    tc.synchronize()
    g = tc.CUDAGraph()
    with tc.graph(g):
        for x, (w, b), o in zip(xs, wgs, outs):
            tallow.ops.linear(x, w, b, out=o)
    for _ in range(2):
        news = []
        for (N, K, M), x in zip(shapes, xs):
            a = tallow.tensor(rng.standard_normal((M, K)), dtype=dtype)
            x.copy_(a.to("cuda"))
            news.append(_f64(a))
        g.replay()
        tc.synchronize()
        for xa, (w, b), o in zip(news, ws, outs):
            ref = xa @ _f64(w).T + (_f64(b) if b is not None else 0)
            assert _rel(_f64(o), ref) < TOL[dtype]
    g.reset()


# Launch configurations covering every kernel instantiation (NT 1/2 by M, rt x unroll, both load
# policies), CTA sizes 1..16 warps, cluster splits 2..8 (sm_90; forced to 1 below), PDL.
CONFIGS = ["warps=1,split=1,unroll=2", "warps=16,split=1,unroll=8", "warps=3,split=2,rt=2,unroll=4",
           "warps=8,split=8,unroll=4,policy=1", "warps=2,split=5,rt=2,unroll=2,pdl=1", "warps=5,split=3,unroll=8",
           "rt=2,policy=1,pdl=1", "target=4", "target=64,unroll=2", "warps=16,split=8,rt=2,unroll=2,policy=1"]


def _silu_mul(x):
    k = x.shape[-1] // 2
    return x[..., :k] / (1.0 + np.exp(-x[..., :k])) * x[..., k:]


def _check_configs(rng, specs):
    for spec in specs:
        tc._c.set_gemv_config(spec)
        for N, K in [(33, 72), (1000, 2056), (1024, 3072)]:
            for dtype in ("bfloat16", "float16"):
                w, b = _weights(rng, N, K, dtype, True)
                wg, bg = w.to("cuda"), b.to("cuda")
                for M in (1, 7, 9, 16):
                    x = tallow.tensor(rng.standard_normal((M, K)), dtype=dtype)
                    got = _linear(x.to("cuda"), wg, bg, M, N, dtype)
                    ref = _f64(x) @ _f64(w).T + _f64(b)
                    assert not np.isnan(got).any(), f"{spec}: M={M} N={N} K={K} outputs left unwritten"
                    assert _rel(got, ref) < TOL[dtype], f"{spec}: M={M} N={N} K={K} {dtype}"
                    # gated mode (gated_linear): the same launch with the activation staged per warp
                    xx = tallow.tensor(rng.standard_normal((M, 2 * K)), dtype=dtype)
                    out = _nan_out(M, N, dtype)
                    old = tc._c.skinny_max_m()
                    tc._c.set_skinny_max_m(16)
                    try:
                        tallow.ops.gated_linear(xx.to("cuda"), wg, bg, out=out)
                    finally:
                        tc._c.set_skinny_max_m(old)
                    got = _f64(out)
                    ref = _silu_mul(_f64(xx)) @ _f64(w).T + _f64(b)
                    assert not np.isnan(got).any(), f"{spec}: gated M={M} N={N} K={K} outputs left unwritten"
                    assert _rel(got, ref) < TOL[dtype], f"{spec}: gated M={M} N={N} K={K} {dtype}"


def test_launch_configs(rng):
    if not hasattr(tc._c, "set_gemv_config"):
        pytest.skip("tallow.cuda._c.set_gemv_config is not bound in this build")
    try:
        _check_configs(rng, CONFIGS)
        tc._c.set_gemv_config("warps=8,split=2")
        assert tc._c.gemv_config(1, 4096, 4096).startswith("warps=8,split=")
        for bad, what in [("warps=0", "warps"), ("split=9", "split"), ("unroll=3", "unroll"), ("foo=1", "foo"),
                          ("warps", "key=value"), ("rt=x", "integer")]:
            with pytest.raises(ValueError, match=what):
                tc._c.set_gemv_config(bad)
    finally:
        tc._c.set_gemv_config("")


_CHILD = textwrap.dedent("""
    import numpy as np, tallow, tallow.cuda as tc
    rng = np.random.default_rng({seed})
    tc._c.set_skinny_max_m(16)
    for M in (1, 9, 16):
        for N, K in ((1024, 3072), (77, 136)):
            x = tallow.tensor(rng.standard_normal((M, K)), dtype="bfloat16")
            w = tallow.tensor(rng.standard_normal((N, K)) / np.sqrt(K), dtype="bfloat16")
            y = tallow.ops.linear(x.to("cuda"), w.to("cuda")).to("cpu").to("float32").numpy().astype(np.float64)
            ref = x.to("float32").numpy().astype(np.float64) @ w.to("float32").numpy().astype(np.float64).T
            err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
            assert err < 8e-3, (M, N, K, err)
    print("ok")
""")


def test_env_config(rng):
    """TALLOW_GEMV_CONFIG is read at the first gemv launch; a bad value names the variable."""
    seed = int(rng.integers(1 << 31))
    env = dict(os.environ, TALLOW_GEMV_CONFIG="warps=3,split=4,unroll=2")
    r = subprocess.run([sys.executable, "-c", _CHILD.format(seed=seed)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    env["TALLOW_GEMV_CONFIG"] = "warps=99"
    r = subprocess.run([sys.executable, "-c", _CHILD.format(seed=seed)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "TALLOW_GEMV_CONFIG" in r.stderr and "ValueError" in r.stderr, r.stderr



_AUTOTUNE_CHILD = textwrap.dedent("""
    import numpy as np, tallow, tallow.cuda as tc
    rng = np.random.default_rng({seed})
    N, K = {N}, {K}
    before = tc._c.gemv_config(1, N, K)
    x = tallow.tensor(rng.standard_normal((1, K)), dtype="bfloat16").to("cuda")
    w = tallow.tensor(rng.standard_normal((N, K)) / np.sqrt(K), dtype="bfloat16").to("cuda")
    tallow.ops.linear(x, w)
    tc.synchronize()
    print(before == tc._c.gemv_config(1, N, K))
""")


def test_autotune(rng):
    """With no launch pinned, the first call of a shape outside graph capture times launch candidates on
    its operands and keeps the fastest: results stay within the bound, gemv_config reports the kept
    launch, plain and captured calls of the shape use it (bitwise the same products), and
    TALLOW_GEMV_AUTOTUNE=0 (the gemv_autotune tuning field at start-up) keeps the heuristic's launch."""
    if not hasattr(tc._c, "set_gemv_config"):
        pytest.skip("tallow.cuda._c.set_gemv_config is not bound in this build")
    tc._c.set_gemv_config("")  # nothing pinned; forgets earlier tuning
    N, K = 1024 + 8 * int(rng.integers(1, 128)), 8 * int(rng.integers(64, 512))
    for M in (1, 4, 16):
        x = tallow.tensor(rng.standard_normal((M, K)), dtype="bfloat16")
        w, _ = _weights(rng, N, K, "bfloat16", False)
        xg, wg = x.to("cuda"), w.to("cuda")
        got = _linear(xg, wg, None, M, N, "bfloat16")  # tunes this shape
        assert _rel(got, _f64(x) @ _f64(w).T) < TOL["bfloat16"], (M, N, K)
        assert tc._c.gemv_config(M, N, K).startswith("warps=")
        again = _linear(xg, wg, None, M, N, "bfloat16")
        assert np.array_equal(got, again), "a tuned shape changed launch between calls"
        # captured: no tuning inside the capture, the recorded launch is the tuned one
        out = _nan_out(M, N, "bfloat16")
        s = tc.Stream()
        g = tc.CUDAGraph()
        with tc.stream(s):
            with tc.graph(g, stream=s):
                tallow.ops.linear(xg, wg, None, out=out)
        g.replay(s)
        s.synchronize()
        assert np.array_equal(_f64(out), got), (M, N, K)
        g.reset()
    seed = int(rng.integers(1 << 31))
    for env_value, same in (("0", "True"), ("1", None)):
        env = dict(os.environ, TALLOW_GEMV_AUTOTUNE=env_value)
        env.pop("TALLOW_GEMV_CONFIG", None)
        r = subprocess.run([sys.executable, "-c", _AUTOTUNE_CHILD.format(seed=seed, N=4096, K=4096)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        if same is not None:  # off: the launch reported after the call is the heuristic's
            assert r.stdout.strip() == same, r.stdout

# ---- the decode path with programmatic dependent launch -------------------------------------------

def _decode_chain(x, res, t, layers=3):
    """A decode step's kernel sequence, `layers` times: fused_add_rms_norm -> gemv -> fused_add_rms_norm ->
    gemv (gate_up) -> gated gemv (down), plus silu_and_mul -> gemv and rms_norm. res is updated in place."""
    outs = []
    h = x
    for _ in range(layers):
        a = tallow.ops.fused_add_rms_norm(h, res, t["n1"], eps=1e-5)
        a = tallow.ops.linear(a, t["wo"])
        a = tallow.ops.fused_add_rms_norm(a, res, t["n2"], eps=1e-5)
        gu = tallow.ops.linear(a, t["wgu"])
        d = tallow.ops.gated_linear(gu, t["wd"])
        e = tallow.ops.linear(tallow.ops.silu_and_mul(gu), t["wd"], t["bd"])
        h = tallow.ops.rms_norm(d, t["n3"], eps=1e-5)
        outs += [d, e, h]
    return outs + [res]


@pytest.mark.parametrize("M", [1, 4])
def test_pdl_graph_matches_eager(rng, skinny16, M):
    """The chain captured as the decode graphs capture it (norms of a few rows with PDL on sm_90), and
    with every GEMV pinned to a PDL launch (gemv_config pdl=1, sweeps only), replayed on fresh inputs:
    bitwise the eager results (PDL changes when kernels start, never what they compute); replays twice
    so stale reads would show."""
    H, I, dtype = 1024, 2816, "bfloat16"
    t = {k: tallow.tensor(v, dtype=dtype).to("cuda") for k, v in {
        "n1": rng.standard_normal(H) * 0.2 + 1, "n2": rng.standard_normal(H) * 0.2 + 1,
        "n3": rng.standard_normal(H) * 0.2 + 1, "wo": rng.standard_normal((H, H)) / np.sqrt(H),
        "wgu": rng.standard_normal((2 * I, H)) / np.sqrt(H), "wd": rng.standard_normal((H, I)) / np.sqrt(I),
        "bd": rng.standard_normal(H)}.items()}
    x = tallow.tensor(rng.standard_normal((M, H)), dtype=dtype).to("cuda")
    res = tallow.tensor(np.zeros((M, H), np.float32), dtype=dtype).to("cuda")

    def fresh():
        x.copy_(tallow.tensor(rng.standard_normal((M, H)), dtype=dtype).to("cuda"))
        r0 = tallow.tensor(rng.standard_normal((M, H)) * 3, dtype=dtype).to("cuda")
        res.copy_(r0)
        return r0

    def host(ts):
        return [o.to("cpu").to("float32").numpy() for o in ts]

    try:
        fresh()
        _decode_chain(x, res, t)  # warm-up outside the captures
        tc.synchronize()
        for pdl in (False, True):
            tc._c.set_gemv_config("pdl=1" if pdl else "")
            _decode_chain(x, res, t)  # tunes / warms up under this config, outside the capture
            tc.synchronize()
            g = tc.CUDAGraph()
            with tc.graph(g):
                outs = _decode_chain(x, res, t)
            for _ in range(2):
                r0 = fresh()
                g.replay()
                tc.synchronize()
                got = host(outs)
                res.copy_(r0)
                want = host(_decode_chain(x, res, t))
                for i, (a, b) in enumerate(zip(got, want)):
                    np.testing.assert_array_equal(a, b, err_msg=f"pdl={pdl} M={M}: output {i}")
            g.reset()
    finally:
        tc._c.set_gemv_config("")


def _rms_ref(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_decode_norms(rng, dtype):
    """rms_norm / fused_add_rms_norm for a few rows (one pack per thread, up to 1024 threads) and many
    rows (the batched launch) against float64: hidden sizes of real models and odd ones."""
    tol = TOL.get(dtype, 1e-5)
    for H in (64, 2048, 4096, 5120, 8192, 16384, 40000):
        w = tallow.tensor(rng.standard_normal(H) * 0.2 + 1, dtype=dtype)
        wg, wr = w.to("cuda"), _f64(w)
        for M in (1, 2, 4, 200):
            x = tallow.tensor(rng.standard_normal((M, H)) * 2, dtype=dtype)
            got = _f64(tallow.ops.rms_norm(x.to("cuda"), wg, eps=1e-5))
            assert _rel(got, _rms_ref(_f64(x), wr)) < tol, f"rms_norm H={H} M={M} {dtype}"
            r = tallow.tensor(rng.standard_normal((M, H)) * 3, dtype=dtype)
            rg = r.to("cuda")
            got = _f64(tallow.ops.fused_add_rms_norm(x.to("cuda"), rg, wg, eps=1e-5))
            # the stored residual: the f32 sum (exact f64 sum rounded once), rounded to the dtype
            s = _f64(tallow.tensor((_f64(x) + _f64(r)).astype(np.float32), dtype=dtype))
            np.testing.assert_array_equal(_f64(rg), s, err_msg=f"residual H={H} M={M} {dtype}")
            assert _rel(got, _rms_ref(s, wr)) < tol, f"fused_add_rms_norm H={H} M={M} {dtype}"
