"""tallow's cluster split-K GEMM (cuda/splitk_gemm.cu): linear with 17-256 rows and few output
columns on CUDA against float64 numpy on fresh random inputs (bf16 and f16, bias or none, every tile
height 64 / 128 / 256, M not a multiple of 16, N not a multiple of 64, K not a multiple of 64, every
cluster size 1 / 2 / 4 / 8 and the heuristic's), the same products through cuBLASLt, strided x rows,
bitwise run-to-run determinism, CUDA graph capture and PDL. Skipped, with the reason, where this build
has no CUDA backend, no GPU is present or the GPU has no thread-block clusters (compute capability
below 9.0: linear then uses cuBLASLt)."""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc

pytestmark = pytest.mark.skipif(
    not tc.is_available() or tc.get_device_properties()["major"] < 9,
    reason=("no CUDA: this build has no CUDA backend" if not tc.built else "no CUDA: no driver or device present")
    if not tc.is_available() else "the split-K GEMM needs thread-block clusters (compute capability >= 9.0)",
)

# Relative L2 error bounds against float64 on the same (rounded) inputs: one rounding of the output
# (bf16 u = 2^-8, f16 u = 2^-11) plus f32 accumulation.
TOL = {"bfloat16": 8e-3, "float16": 1e-3}
# (N, K): Qwen3-0.6B's o_proj and down_proj, odd N and K (partial column tiles, partial k-blocks),
# few k-blocks (clusters shrink to fit), one column tile.
SHAPES = [(1024, 2048), (1024, 3072), (1000, 1032), (100, 264), (8, 64), (2048, 1024), (513, 4104)]
ROWS = [17, 31, 64, 65, 100, 128, 129, 200, 256]


@pytest.fixture(autouse=True)
def splitk_on():
    """The kernel takes every product above the gemv's rows (whatever the defaults); restored after."""
    c = tc._c
    old = (c.splitk_max_m(), c.splitk_max_n())
    c.set_splitk_max_m(256)
    c.set_splitk_max_n(1 << 30)
    yield
    c.set_splitk_max_m(old[0])
    c.set_splitk_max_n(old[1])
    c.set_splitk_forced_split(0)


def _f64(t):
    return t.to("cpu").to("float32").numpy().astype(np.float64)


def _rel(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _nan_out(M, N, dtype):
    """An output filled with NaN, so that any element the kernel fails to write shows."""
    return tallow.tensor(np.full((M, N), np.nan, np.float32), dtype=dtype).to("cuda")


def _weights(rng, N, K, dtype, bias):
    w = tallow.tensor(rng.standard_normal((N, K)) / np.sqrt(K), dtype=dtype)
    b = tallow.tensor(rng.standard_normal(N), dtype=dtype) if bias else None
    return w, b


def _linear(x, w, b, M, N, dtype, split=0, cublas=False):
    c = tc._c
    c.set_splitk_forced_split(split)
    old = c.splitk_max_m()
    if cublas:
        c.set_splitk_max_m(0)
    try:
        out = _nan_out(M, N, dtype)
        tallow.ops.linear(x, w, b, out=out)
        return _f64(out)
    finally:
        c.set_splitk_max_m(old)
        c.set_splitk_forced_split(0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("N,K", SHAPES)
def test_linear_matches_reference(rng, dtype, N, K):
    """Every tile height and cluster size; bias on odd M; the result and cuBLASLt's within the bound."""
    w, b = _weights(rng, N, K, dtype, True)
    wg, bg = w.to("cuda"), b.to("cuda")
    wr, br = _f64(w), _f64(b)
    for i, M in enumerate(ROWS):
        use_bias = M % 2 == 1
        x = tallow.tensor(rng.standard_normal((M, K)), dtype=dtype)
        xg = x.to("cuda")
        ref = _f64(x) @ wr.T + (br if use_bias else 0)
        lt = _linear(xg, wg, bg if use_bias else None, M, N, dtype, cublas=True)
        assert _rel(lt, ref) < TOL[dtype], f"cuBLASLt M={M} N={N} K={K}: rel err {_rel(lt, ref):.2e}"
        for split in (0, (1, 2, 4, 8)[i % 4]):
            got = _linear(xg, wg, bg if use_bias else None, M, N, dtype, split=split)
            assert not np.isnan(got).any(), f"M={M} split={split}: outputs left unwritten"
            err = _rel(got, ref)
            assert err < TOL[dtype], f"split-K M={M} N={N} K={K} split={split}: rel err {err:.2e}"
            assert _rel(got, lt) < 2 * TOL[dtype]


def test_splits_agree_closely(rng):
    """Cluster sizes only reorder f32 sums: results agree far below the output's rounding."""
    N, K, M = 1024, 3072, 200
    w, _ = _weights(rng, N, K, "float16", False)
    x = tallow.tensor(rng.standard_normal((M, K)), dtype="float16").to("cuda")
    outs = [_linear(x, w.to("cuda"), None, M, N, "float16", split=s) for s in (1, 2, 4, 8)]
    for o in outs[1:]:
        assert _rel(o, outs[0]) < 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_strided_and_shaped_inputs(rng, dtype):
    """x rows as an aligned view (the kernel) and an unaligned one (cuBLASLt), x 3-D."""
    N, K = 300, 512
    w, b = _weights(rng, N, K, dtype, True)
    wg, bg = w.to("cuda"), b.to("cuda")
    wr, br = _f64(w), _f64(b)
    for M in (20, 77, 256):
        big = tallow.tensor(rng.standard_normal((M, K + 24)), dtype=dtype).to("cuda")
        for off in (8, 16, 1):
            x = big[:, off:off + K]
            ref = _f64(big)[:, off:off + K] @ wr.T + br
            out = _nan_out(M, N, dtype)
            tallow.ops.linear(x, wg, bg, out=out)
            assert _rel(_f64(out), ref) < TOL[dtype], f"M={M} offset {off}"
        x3 = tallow.tensor(rng.standard_normal((1, M, K)), dtype=dtype)
        y3 = tallow.ops.linear(x3.to("cuda"), wg, bg)
        assert tuple(y3.shape) == (1, M, N)
        assert _rel(_f64(y3)[0], _f64(x3)[0] @ wr.T + br) < TOL[dtype]


@pytest.mark.parametrize("N,K", [(1024, 2048), (1024, 3072)])
def test_deterministic(rng, N, K):
    """No atomics: the same inputs give bitwise the same outputs."""
    w, b = _weights(rng, N, K, "bfloat16", True)
    wg, bg = w.to("cuda"), b.to("cuda")
    for M in (17, 100, 256):
        x = tallow.tensor(rng.standard_normal((M, K)), dtype="bfloat16").to("cuda")
        first = tallow.ops.linear(x, wg, bg).to("cpu").to("float32").numpy()
        for _ in range(3):
            again = tallow.ops.linear(x, wg, bg).to("cpu").to("float32").numpy()
            np.testing.assert_array_equal(again, first)


@pytest.mark.parametrize("pdl", [False, True])
def test_graph_capture(rng, pdl):
    """Launches (clusters of every size) captured into a CUDA graph, with PDL off and on, give fresh
    results on replay; each product reads the previous one's output, so an early read would show."""
    dtype = "bfloat16"
    old_pdl = tc._c.pdl_enabled() if hasattr(tc._c, "pdl_enabled") else None
    if old_pdl is None and pdl:
        pytest.skip("this build exposes no PDL switch")
    if old_pdl is not None:
        tc._c.set_pdl_enabled(pdl)
    try:
        M, N, K = 96, 1024, 1024
        ws = [_weights(rng, N, K, dtype, i % 2 == 0) for i in range(4)]
        wgs = [(w.to("cuda"), b.to("cuda") if b is not None else None) for w, b in ws]
        x = tallow.tensor(np.zeros((M, K), np.float32), dtype=dtype).to("cuda")
        outs = [tallow.tensor(np.zeros((M, N), np.float32), dtype=dtype).to("cuda") for _ in ws]

        def chain():
            src = x
            for (w, b), o in zip(wgs, outs):
                tallow.ops.linear(src, w, b, out=o)
                src = o

        chain()  # warm-up outside the capture
        tc.synchronize()
        g = tc.CUDAGraph()
        with tc.graph(g):
            chain()
        for _ in range(2):
            a = tallow.tensor(rng.standard_normal((M, K)), dtype=dtype)
            x.copy_(a.to("cuda"))
            g.replay()
            tc.synchronize()
            src = _f64(a)
            for (w, b), o in zip(ws, outs):
                ref = src @ _f64(w).T + (_f64(b) if b is not None else 0)
                got = _f64(o)
                assert _rel(got, ref) < TOL[dtype]
                src = got  # the next product's input as the kernel rounded it
        g.reset()
    finally:
        if old_pdl is not None:
            tc._c.set_pdl_enabled(old_pdl)


def test_routing_limits(rng):
    """Above splitk_max_m / splitk_max_n linear uses cuBLASLt (same results within the bound);
    bad forced cluster sizes raise a clear error."""
    N, K, M = 1024, 1024, 64
    w, _ = _weights(rng, N, K, "bfloat16", False)
    x = tallow.tensor(rng.standard_normal((M, K)), dtype="bfloat16")
    ref = _f64(x) @ _f64(w).T
    c = tc._c
    for max_m, max_n in ((256, 1 << 30), (32, 1 << 30), (256, 512)):
        c.set_splitk_max_m(max_m)
        c.set_splitk_max_n(max_n)
        out = _nan_out(M, N, "bfloat16")
        tallow.ops.linear(x.to("cuda"), w.to("cuda"), None, out=out)
        assert _rel(_f64(out), ref) < TOL["bfloat16"]
    with pytest.raises(Exception, match="split"):
        c.set_splitk_forced_split(3)
