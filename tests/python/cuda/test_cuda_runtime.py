"""The CUDA runtime: device queries, the caching allocator's statistics, host<->device and strided
device copies, streams and events, CUDA graphs, the skinny GEMM path against cuBLASLt, and errors.
Skipped, with the reason, where this build has no CUDA backend or no GPU is present."""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc

pytestmark = pytest.mark.skipif(
    not tc.is_available(),
    reason="no CUDA: this build has no CUDA backend" if not tc.built else "no CUDA: no driver or device present",
)

MiB = 1 << 20


def test_build_info():
    assert tc.device_count() >= 1
    assert tallow._core.build_info["cuda"]


def test_device_queries():
    free, total = tc.mem_get_info()
    assert 0 < free <= total
    props = tc.get_device_properties()
    assert props["multi_processor_count"] > 0 and props["total_memory"] >= total
    assert isinstance(tc.get_device_name(), str)
    assert tc.current_device() == 0
    tc.set_device(0)
    tc.synchronize()
    with pytest.raises(ValueError, match="out of range"):
        tc.set_device(tc.device_count())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "uint8", "q4_k"])
def test_round_trip_copies(rng, dtype):
    if dtype == "q4_k":
        raw = rng.integers(0, 256, size=(3, 2 * 144), dtype=np.uint8)
        t = tallow.from_buffer(raw, dtype="q4_k", shape=[3, 512])
        back = t.to("cuda").to("cpu")
        assert back.dtype == t.dtype and back.shape == t.shape
        np.testing.assert_array_equal(back.view_as_dtype("uint8", [3, 288]).numpy(), raw)
        return
    a = rng.standard_normal((37, 129)) * 10
    t = tallow.tensor(a.astype(np.int64) if dtype == "int64" else (np.abs(a).astype(np.uint8) if dtype == "uint8" else a),
                      dtype=dtype)
    g = t.to("cuda")
    assert str(g.device) == "cuda:0" and g.dtype == t.dtype and g.shape == t.shape
    np.testing.assert_array_equal(np.asarray(g.to("cpu").to("float32") if t.dtype.is_float else g.to("cpu")),
                                  np.asarray(t.to("float32") if t.dtype.is_float else t))


def test_strided_copies(rng):
    a = rng.standard_normal((64, 48, 5)).astype(np.float32)
    g = tallow.tensor(a).to("cuda")
    # device strided -> host: transposed, sliced and stepped views
    for view, ref in [(g.transpose(0, 1), a.transpose(1, 0, 2)), (g[3:40:3], a[3:40:3]),
                      (g.permute(2, 0, 1), a.transpose(2, 0, 1)), (g[:, 7], a[:, 7])]:
        np.testing.assert_array_equal(view.to("cpu").numpy(), ref)
        np.testing.assert_array_equal(view.contiguous().to("cpu").numpy(), ref)
    # host strided -> device, and device -> strided device destination
    t = tallow.tensor(a)
    np.testing.assert_array_equal(t.transpose(0, 2).to("cuda").to("cpu").numpy(), a.transpose(2, 1, 0))
    dst = tallow.tensor(np.full((48, 64, 5), np.nan, np.float32)).to("cuda")
    dst.transpose(0, 1).copy_(g)
    np.testing.assert_array_equal(dst.to("cpu").numpy(), a.transpose(1, 0, 2))
    # bf16 (2-byte units) and an odd inner length
    b = rng.standard_normal((33, 17))
    tb = tallow.tensor(b, dtype="bfloat16")
    np.testing.assert_array_equal(tb.to("cuda").T.to("cpu").to("float32").numpy(), tb.T.to("float32").numpy())


def test_large_copy_chunks(rng):
    a = rng.standard_normal(5 * MiB).astype(np.float32)  # 20 MiB: several staging chunks
    np.testing.assert_array_equal(tallow.tensor(a).to("cuda").to("cpu").numpy(), a)


def test_allocator_stats_and_reuse():
    tc.synchronize()
    tc.empty_cache()
    tc.reset_peak_memory_stats()
    s0 = tc.memory_stats()
    x = tallow.empty([3 * MiB], dtype="float32", device="cuda")  # 12 MiB -> one 12 MiB block
    s1 = tc.memory_stats()
    assert s1["allocated_bytes"] - s0["allocated_bytes"] == 12 * MiB
    assert s1["reserved_bytes"] >= s1["allocated_bytes"]
    assert s1["peak_allocated_bytes"] >= s1["allocated_bytes"]
    ptr = x.data_ptr
    del x
    s2 = tc.memory_stats()
    assert s2["allocated_bytes"] == s0["allocated_bytes"]
    assert s2["reserved_bytes"] == s1["reserved_bytes"]  # cached, not freed
    assert s2["cached_bytes"] >= 12 * MiB
    y = tallow.empty([3 * MiB], dtype="float32", device="cuda")  # same stream, same class: reused
    assert y.data_ptr == ptr
    assert tc.memory_stats()["num_cache_hits"] > s1["num_cache_hits"]
    del y
    tc.empty_cache()
    s3 = tc.memory_stats()
    assert s3["cached_bytes"] == 0 and s3["reserved_bytes"] < s2["reserved_bytes"]
    assert s3["peak_allocated_bytes"] >= 12 * MiB
    assert tc.memory_allocated() == s3["allocated_bytes"] and tc.memory_reserved() == s3["reserved_bytes"]


def test_oom_is_a_clear_error():
    free, total = tc.mem_get_info()
    with pytest.raises(RuntimeError, match="out of memory"):
        tallow.empty([2 * total // 4], dtype="float32", device="cuda")
    tallow.empty([1024], dtype="float32", device="cuda")  # still usable


def test_streams_and_events(rng):
    s = tc.Stream()
    assert s != tc.current_stream()
    a = rng.standard_normal((512, 512)).astype(np.float32)
    x = tallow.tensor(a).to("cuda")
    start, end = tc.Event(enable_timing=True), tc.Event(enable_timing=True)
    with tc.stream(s):
        assert tc.current_stream() == s
        s.wait_stream(tc.default_stream())
        start.record()
        y = tallow.ops.scale(x, 2.0)
        end.record()
    assert tc.current_stream() != s
    end.synchronize()
    assert end.query() and s.query()
    assert start.elapsed_time(end) >= 0.0
    tc.current_stream().wait_stream(s)
    np.testing.assert_allclose(y.to("cpu").numpy(), 2 * a, rtol=0)
    e = tc.Event()
    e.record(s)
    e.wait()
    s.synchronize()


def test_graph_capture_and_replay(rng):
    H = 256
    w = tallow.tensor(rng.standard_normal(H) * 0.5 + 1, dtype="float16").to("cuda")
    x = tallow.tensor(rng.standard_normal((8, H)), dtype="float16").to("cuda")  # static input
    # warm up outside the capture
    tallow.ops.rms_norm(x, w, eps=1e-6)
    tc.synchronize()
    g = tc.CUDAGraph()
    s0 = tc.memory_stats()
    with tc.graph(g):
        y = tallow.ops.rms_norm(x, w, eps=1e-6)           # allocated from the graph's pool
        z = tallow.ops.silu_and_mul(tallow.ops.mul(y, y))  # the temporary's block is reused in the pool
    assert g.captured and g.num_nodes >= 3
    assert tc.memory_stats()["graph_pool_bytes"] > s0["graph_pool_bytes"]
    for _ in range(3):
        a = rng.standard_normal((8, H))
        x.copy_(tallow.tensor(a, dtype="float16").to("cuda"))  # update the static input in place
        g.replay()
        tc.synchronize()
        xf = tallow.tensor(a, dtype="float16").to("float32").numpy().astype(np.float64)
        wf = w.to("cpu").to("float32").numpy().astype(np.float64)
        ref_y = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * wf
        got_y = y.to("cpu").to("float32").numpy()
        assert np.linalg.norm(got_y - ref_y) / np.linalg.norm(ref_y) < 2e-3
        yy = got_y.astype(np.float64) ** 2
        h = H // 2
        ref_z = yy[:, :h] / (1 + np.exp(-yy[:, :h])) * yy[:, h:]
        got_z = z.to("cpu").to("float32").numpy()
        assert np.linalg.norm(got_z - ref_z) / np.linalg.norm(ref_z) < 5e-3
    # a second graph sharing the first one's pool
    g2 = tc.CUDAGraph()
    with tc.graph(g2, pool=g.pool()):
        y2 = tallow.ops.scale(x, 3.0)
    g2.replay()
    tc.synchronize()
    np.testing.assert_allclose(y2.to("cpu").to("float32").numpy(), 3 * x.to("cpu").to("float32").numpy(), rtol=1e-3)
    # host copies cannot be captured: a clear error, and the capture is abandoned
    g3 = tc.CUDAGraph()
    with pytest.raises(ValueError, match="cannot be captured"):
        with tc.graph(g3):
            tallow.tensor(np.ones(4, np.float32)).to("cuda")
    assert not g3.captured
    del y, z, y2
    g.reset()
    g2.reset()


def test_graph_capture_across_two_streams(rng):
    """A capture that forks onto a second stream: the graph's pool never hands a block freed on one
    stream to the other (their replayed kernels may run at once), while a stream reuses its own."""
    x = tallow.tensor(rng.standard_normal((64, 256)), dtype="float16").to("cuda")
    tallow.ops.scale(x, 2.0)
    tc.synchronize()
    main, side = tc.Stream(), tc.Stream()
    g = tc.CUDAGraph()
    with tc.graph(g, stream=main):
        side.wait_stream(main)  # the side stream joins the capture
        t = tallow.ops.scale(x, 2.0)
        freed = t.data_ptr
        del t  # back to the pool, as main's
        with tc.stream(side):
            b = tallow.ops.scale(x, 3.0)  # the same size class
        c = tallow.ops.scale(x, 5.0)
        main.wait_stream(side)  # joined again before the capture ends
    assert b.data_ptr != freed, "the side stream took a block the main stream freed in the same capture"
    assert c.data_ptr == freed  # the main stream reuses its own
    xf = x.to("cpu").to("float32").numpy()
    for _ in range(2):
        g.replay()
        tc.synchronize()
        np.testing.assert_allclose(b.to("cpu").to("float32").numpy(), 3 * xf, rtol=1e-3)
        np.testing.assert_allclose(c.to("cpu").to("float32").numpy(), 5 * xf, rtol=1e-3)
    del b, c
    g.reset()


@pytest.mark.parametrize("path", ["skinny", "cublaslt"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_skinny_linear_matches_reference(rng, dtype, M, path):
    """Decode-shaped linear through tallow's skinny kernel and through cuBLASLt, bias included."""
    old = tc._c.skinny_max_m()
    tc._c.set_skinny_max_m(16 if path == "skinny" else 0)
    try:
        _check_linear(rng, dtype, M)
    finally:
        tc._c.set_skinny_max_m(old)


def _check_linear(rng, dtype, M):
    K, N = 1024, 384
    x = tallow.tensor(rng.standard_normal((M, K)), dtype=dtype)
    w = tallow.tensor(rng.standard_normal((N, K)) / 32, dtype=dtype)
    b = tallow.tensor(rng.standard_normal(N), dtype=dtype)
    out = tallow.tensor(np.full((M, N), np.nan, np.float32), dtype=dtype).to("cuda")
    y = tallow.ops.linear(x.to("cuda"), w.to("cuda"), b.to("cuda"), out=out).to("cpu").to("float32").numpy()
    xr, wr, br = (t.to("float32").numpy().astype(np.float64) for t in (x, w, b))
    ref = xr @ wr.T + br
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    assert not np.isnan(y).any()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol


def test_ops_errors_name_the_op():
    x = tallow.tensor(np.ones((2, 4), np.float32)).to("cuda")
    with pytest.raises(IndexError, match="embedding"):
        tallow.ops.embedding(tallow.tensor(np.array([0, 7], np.int64)).to("cuda"), x)
    pos = tallow.tensor(np.array([0, 5], np.int64)).to("cuda")
    q = tallow.tensor(np.ones((2, 1, 4), np.float32)).to("cuda")
    cache = tallow.tensor(np.ones((3, 4), np.float32)).to("cuda")
    with pytest.raises(IndexError, match="rotary_embedding"):
        tallow.ops.rotary_embedding(pos, q, None, cache, True)
    np.testing.assert_array_equal(q.to("cpu").numpy(), 1.0)  # untouched
    assert tc.index_checks()
    tc.set_index_checks(False)  # unchecked: the out-of-range row is skipped, nothing is read out of bounds
    try:
        tallow.ops.rotary_embedding(pos, q, None, cache, True)
        tc.synchronize()
    finally:
        tc.set_index_checks(True)


def test_matmul_layouts(rng):
    """matmul with transposed, batched and broadcast operands (cuBLASLt strided batches)."""
    a = rng.standard_normal((3, 40, 64)).astype(np.float32)
    b = rng.standard_normal((64, 24)).astype(np.float32)
    ga, gb = tallow.tensor(a).to("cuda"), tallow.tensor(b).to("cuda")
    for x, y, ref in [(ga, gb, a @ b), (ga.transpose(1, 2).contiguous().transpose(1, 2), gb, a @ b),
                      (ga[1], gb.T.contiguous().T, a[1] @ b)]:
        out = tallow.ops.matmul(x, y).to("cpu").numpy()
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
