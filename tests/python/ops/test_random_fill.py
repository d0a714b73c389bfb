"""tallow.ops.fill_uniform_: values against a numpy reference of the counter-based hash (bit-exact), moments,
range, seeds, CPU == CUDA bit for bit, and argument errors."""
import numpy as np
import pytest

import tallow
from tallow import ops

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
DTYPES = ["float32", "float16", "bfloat16"]


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def reference(n: int, low: float, high: float, seed: int, dtype: str) -> np.ndarray:
    """cpp/ops/random.h in numpy (uint64 arithmetic wraps), as float32 values of the dtype."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([seed], np.uint64) ^ np.uint64(0x6A09E667F3BCC909))[0]
        i = np.arange(n, dtype=np.uint64)
        k = (_mix64(key + (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)).astype(np.float64)
    span = np.float64(np.float32(high) - np.float32(low))
    v = (np.float64(np.float32(low)) + span * (k / 16777216.0)).astype(np.float32)
    if dtype == "float16":
        return v.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # round to nearest even on the upper 16 bits (finite values only here)
        b = v.view(np.uint32).astype(np.uint64)
        b = ((b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)) << np.uint64(16)
        return b.astype(np.uint32).view(np.float32)
    return v


def host(t) -> np.ndarray:
    if t.device != "cpu":
        t = t.to("cpu")
    return np.asarray(t.to(tallow.float32).numpy(), dtype=np.float32).reshape(-1)


def filled(shape, dtype, low, high, seed, device="cpu"):
    t = tallow.empty(list(shape), dtype, device)
    out = ops.fill_uniform_(t, low, high, seed)
    assert out.shape == t.shape
    return t


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_bit_exact(dtype, rng):
    seed = int(rng.integers(2**63))
    low = float(rng.uniform(-3, 0))
    high = low + float(rng.uniform(0.01, 4))
    n = 1000 + int(rng.integers(1000))
    got = host(filled([n], dtype, low, high, seed))
    np.testing.assert_array_equal(got, reference(n, low, high, seed, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moments_and_range(dtype, rng):
    low, high = -0.75, 1.25
    n = 1 << 20
    x = host(filled([1024, 1024], dtype, low, high, int(rng.integers(2**32))))
    assert x.min() >= low and x.max() <= high
    # U(a, b): mean (a+b)/2, std (b-a)/sqrt(12); 1M samples: standard error of the mean ~6e-4.
    assert abs(x.mean() - 0.25) < 5e-3
    assert abs(x.std() - 2.0 / np.sqrt(12)) < 5e-3
    # spread over the whole range: every tenth of it holds ~10% of the values
    hist = np.histogram(x, bins=10, range=(low, high))[0] / n
    assert np.all(np.abs(hist - 0.1) < 0.01), hist
    # no large runs of equal neighbours (f32: values are distinct almost surely)
    if dtype == "float32":
        assert np.mean(x[1:] == x[:-1]) < 1e-3


def test_seeds_differ_and_repeat():
    a = host(filled([4096], "float32", -1, 1, 0))
    b = host(filled([4096], "float32", -1, 1, 1))
    c = host(filled([4096], "float32", -1, 1, 0))
    np.testing.assert_array_equal(a, c)
    assert np.mean(a == b) < 1e-3
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.1
    # seed s + 1 is not seed s's stream shifted by one element
    assert np.mean(a[1:] == b[:-1]) < 1e-3


def test_threads_do_not_change_values():
    n = tallow.get_num_threads()
    try:
        tallow.set_num_threads(1)
        a = host(filled([300001], "bfloat16", -0.1, 0.1, 7))
        tallow.set_num_threads(max(2, n))
        b = host(filled([300001], "bfloat16", -0.1, 0.1, 7))
    finally:
        tallow.set_num_threads(n)
    np.testing.assert_array_equal(a, b)


def test_view_with_offset_and_empty():
    base = tallow.empty([10, 8], "float32", "cpu")
    ops.fill_uniform_(base, 5.0, 5.0, 0)  # low == high: a constant
    np.testing.assert_array_equal(host(base), np.full(80, 5.0, np.float32))
    row = base.narrow(0, 3, 2)  # contiguous view: element indices count from the view's start
    ops.fill_uniform_(row, -1, 1, 3)
    np.testing.assert_array_equal(host(row), reference(16, -1, 1, 3, "float32"))
    assert np.all(host(base.narrow(0, 0, 3)) == 5.0) and np.all(host(base.narrow(0, 5, 5)) == 5.0)
    ops.fill_uniform_(tallow.empty([0, 4], "float16", "cpu"), 0, 1, 0)


def test_errors():
    with pytest.raises(TypeError, match=r"fill_uniform_: t must be float32.*int32"):
        ops.fill_uniform_(tallow.empty([4], "int32", "cpu"), 0, 1, 0)
    t = tallow.empty([4, 6], "float32", "cpu")
    with pytest.raises(ValueError, match=r"fill_uniform_: t of shape \[6, 4\].*contiguous"):
        ops.fill_uniform_(t.transpose(0, 1), 0, 1, 0)
    with pytest.raises(ValueError, match=r"fill_uniform_: need finite low <= high"):
        ops.fill_uniform_(t, 1, 0, 0)
    with pytest.raises(ValueError, match=r"fill_uniform_: need finite low <= high"):
        ops.fill_uniform_(t, 0, float("inf"), 0)
    with pytest.raises(ValueError, match=r"overflows"):
        ops.fill_uniform_(t, -3e38, 3e38, 0)


# ---- CUDA ---------------------------------------------------------------------------------------

def _cuda_available() -> bool:
    if not tallow._core.build_info.get("cuda"):
        return False
    from tallow import cuda
    return cuda.is_available()


cuda_only = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA build of tallow and a CUDA device")


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_equals_cpu_bit_exact(dtype, rng):
    seed = int(rng.integers(2**63))
    low, high = float(rng.uniform(-2, 0)), float(rng.uniform(0, 2))
    # odd sizes and offset views: unaligned heads and tails around the 16-byte vector body
    for n, off in [(1, 0), (7, 1), (8, 0), (1000003, 3), (1 << 22, 0)]:
        base = tallow.empty([n + off], dtype, "cuda:0")
        view = base.narrow(0, off, n)
        ops.fill_uniform_(view, low, high, seed)
        cpu = filled([n], dtype, low, high, seed)
        np.testing.assert_array_equal(host(view), host(cpu), err_msg=f"n={n} offset={off}")
    np.testing.assert_array_equal(host(view)[:4096], reference(4096, low, high, seed, dtype))


@cuda_only
def test_cuda_fill_is_fast():
    """16 GiB of bf16 takes well under a second (bandwidth bound); here 2 GiB, timed with events."""
    from tallow import cuda
    t = tallow.empty([1 << 30], "bfloat16", "cuda:0")
    ops.fill_uniform_(t, -1, 1, 0)  # warm-up
    s, e = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    s.record()
    ops.fill_uniform_(t, -1, 1, 1)
    e.record()
    e.synchronize()
    ms = s.elapsed_time(e)
    print(f"fill_uniform_ 2 GiB bf16: {ms:.2f} ms = {2 * 2**30 / ms / 1e6:.0f} GB/s")
    assert ms < 100, ms  # 16 GiB would take < 0.8 s
