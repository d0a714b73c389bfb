"""rope_and_cache against the composition of the ops it replaces (rms_norm per head written back
into q/k, rotary_embedding, reshape_and_cache), on fresh random inputs, on the CPU and (skipped with
the reason without a device) on CUDA.

Inputs are what the engine passes: q, k, v are strided views of one fused qkv buffer, slot maps
hold padding tokens (-1), caches are random everywhere. Scenarios: Llama (no norm, NeoX, GQA),
Qwen3 (q/k RMSNorm), Gemma-style (1 + w, head_dim 256), interleaved pairs, partial rotary (also
with rot_dim / 2 odd), MQA, fp8 caches with scales, f32 caches, i32 indices, Dv != D, head dims the
kernel does not vectorise (36) and long rows (512).

Bounds:
- CPU: bit for bit (the CPU op IS the composition).
- CUDA, rows of <= 32 16-byte packs (f16/bf16 D <= 256, f32 D <= 128) and the layouts that run the
  composition: bit for bit (test_cuda_bit_exact; see cuda/rope_cache.cu for why).
- CUDA, any layout: every element within one rounding of the composition's: |fused - composed| <=
  ulp_dtype(composed) + 2^-22 max|composed| (a rotation contracted into an FMA the other way), one
  e4m3 step in fp8 caches; with q/k norms on rows of > 32 packs (the norm's sum reduced in another
  order: a few f32 ulps in 1/rms, so a normed element may round the other way) also two ulps at the
  row's largest magnitude.
"""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc
from tallow import ops
from backend_ops.cases_rope import make_cache

needs_cuda = pytest.mark.skipif(
    not tc.is_available(),
    reason="no CUDA: this build has no CUDA backend" if not tc.built else "no CUDA: no driver or device present")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = ["float32", "float16", "bfloat16"]
FP8 = "float8_e4m3"
EPS = 1e-6

# hq, hk, d, rot, neox; norm: None / "rms" / "gemma"; cache: dtype of the caches (None: q's)
SCENARIOS = {
    "llama-gqa": dict(hq=32, hk=8, d=128, rot=128, neox=True),
    "qwen3-qk-norm": dict(hq=16, hk=8, d=128, rot=128, neox=True, norm="rms"),
    "gemma-1+w-d256": dict(hq=8, hk=4, d=256, rot=256, neox=True, norm="gemma"),
    "interleaved": dict(hq=8, hk=2, d=64, rot=64, neox=False),
    "interleaved-norm": dict(hq=4, hk=4, d=128, rot=128, neox=False, norm="rms"),
    "partial-neox-norm": dict(hq=4, hk=2, d=128, rot=32, neox=True, norm="rms"),
    "partial-interleaved-odd-half": dict(hq=4, hk=2, d=64, rot=10, neox=False, norm="rms"),
    "mqa-d64": dict(hq=8, hk=1, d=64, rot=64, neox=True),
    "fp8-cache": dict(hq=8, hk=2, d=128, rot=128, neox=True, norm="rms", cache=FP8, k_scale=0.37, v_scale=1.9),
    "fp8-cache-no-norm": dict(hq=8, hk=4, d=64, rot=64, neox=False, cache=FP8, k_scale=2.5, v_scale=0.5),
    "f32-cache": dict(hq=8, hk=2, d=64, rot=64, neox=True, norm="gemma", cache="float32"),
    "i32-indices": dict(hq=6, hk=3, d=128, rot=128, neox=True, norm="rms", idx="int32"),
    "dv-ne-d": dict(hq=4, hk=2, d=64, rot=64, neox=True, norm="rms", dv=32),  # composition on CUDA
    "d36-unvectorised": dict(hq=4, hk=2, d=36, rot=36, neox=True, norm="rms"),  # composition on CUDA (f16/bf16)
    "d512-long-rows": dict(hq=2, hk=1, d=512, rot=512, neox=True, norm="rms"),  # norm sum order may differ
}


def packs(sc, dtype):
    return sc["d"] * (4 if dtype == "float32" else 2) // 16


def make_inputs(rng, sc, dtype, T, device, block_size=16):
    hq, hk, d, rot = sc["hq"], sc["hk"], sc["d"], sc["rot"]
    dv = sc.get("dv", d)
    max_pos = 2048
    nb = -(-T // block_size) + 3
    idx = sc.get("idx", "int64")
    pos = rng.integers(0, max_pos, size=T)
    pos[0] = max_pos - 1
    slots = rng.permutation(nb * block_size)[:T]
    if T > 2:
        slots[rng.permutation(T)[:2]] = -1  # padding tokens
    cdt = sc.get("cache") or dtype

    def t(a, dt):
        x = tallow.tensor(np.asarray(a, np.float32), dtype=dt)
        return x if device == "cpu" else x.to(device)

    def ints(a):
        x = tallow.from_numpy(np.ascontiguousarray(a.astype(idx)))
        return x if device == "cpu" else x.to(device)

    inp = {
        "qkv": t(2.0 * rng.standard_normal((T, hq + 2 * hk, d)), dtype),
        "pos": ints(pos),
        "cs": t(make_cache(max_pos, rot), "float32"),
        "k_cache": t(rng.standard_normal((nb, block_size, hk, d)), cdt),
        "v_cache": t(rng.standard_normal((nb, block_size, hk, dv)), cdt),
        "slots": ints(slots),
    }
    if dv != d:
        inp["v"] = t(rng.standard_normal((T, hk, dv)), dtype)
    if sc.get("norm"):
        base = 1.0 if sc["norm"] == "rms" else 0.0
        inp["qw"] = t(base + 0.3 * rng.standard_normal(d), dtype)
        inp["kw"] = t(base + 0.3 * rng.standard_normal(d), dtype)
    return inp


def fresh(inp):
    """Copies of everything the op writes (qkv, caches); read-only inputs shared."""
    out = dict(inp)
    for key in ("qkv", "k_cache", "v_cache"):
        out[key] = inp[key].clone()
    return out


def views(sc, inp):
    hq, hk = sc["hq"], sc["hk"]
    qkv = inp["qkv"]
    v = inp["v"] if "v" in inp else qkv[:, hq + hk:, :]
    return qkv[:, :hq, :], qkv[:, hq:hq + hk, :], v


def fused(sc, inp):
    q, k, v = views(sc, inp)
    ops.rope_and_cache(inp["pos"], q, k, v, inp["cs"], sc["neox"], inp["k_cache"], inp["v_cache"], inp["slots"],
                       inp.get("qw"), inp.get("kw"), EPS, sc.get("norm") == "gemma", sc.get("k_scale", 1.0),
                       sc.get("v_scale", 1.0))


def composed(sc, inp):
    q, k, v = views(sc, inp)
    if sc.get("norm"):
        gemma = sc["norm"] == "gemma"
        q.copy_(ops.rms_norm(q, inp["qw"], EPS, gemma))
        k.copy_(ops.rms_norm(k, inp["kw"], EPS, gemma))
    ops.rotary_embedding(inp["pos"], q, k, inp["cs"], sc["neox"])
    ops.reshape_and_cache(k, v, inp["k_cache"], inp["v_cache"], inp["slots"], k_scale=sc.get("k_scale", 1.0),
                          v_scale=sc.get("v_scale", 1.0))


def outputs(inp):
    return {key: inp[key].to("cpu").to("float32").numpy() for key in ("qkv", "k_cache", "v_cache")}


def both(rng, sc, dtype, T, device):
    inp = make_inputs(rng, sc, dtype, T, device)
    a, b = fresh(inp), fresh(inp)
    fused(sc, a)
    composed(sc, b)
    return outputs(a), outputs(b), outputs(inp)


def ulp(x, dtype):
    """Spacing of `dtype` at |x| (x float32 values representable in dtype)."""
    ax = np.abs(x.astype(np.float64))
    if dtype == FP8:  # e4m3: 3 mantissa bits, subnormal step 2^-9
        e = np.floor(np.log2(np.maximum(ax, 2.0**-6)))
        return 2.0 ** (e - 3)
    bits = {"float32": 23, "float16": 10, "bfloat16": 7}[dtype]
    tiny = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}[dtype]
    e = np.floor(np.log2(np.maximum(ax, tiny)))
    return np.maximum(2.0 ** (e - bits), tiny)


def assert_within_one_rounding(got, want, dtype, what, inputs_may_round=False):
    """inputs_may_round: the norm summed in another order (rows of > 32 packs), so a normed element
    may round the other way (one ulp of the row); the rotation a*c - b*s carries that into its output
    with |c|, |s| <= 1: at most two ulps at the row's largest magnitude, also where a*c - b*s cancels."""
    d = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = ulp(want, dtype) + 2.0**-22 * np.max(np.abs(want))
    if inputs_may_round:
        bound = bound + 2 * ulp(np.max(np.abs(want), axis=-1, keepdims=True), dtype)
    bad = ~(d <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {d.size} elements differ by more than one rounding "
                           f"(max diff {d.max():.3g})")


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("device", DEVICES)
def test_matches_composition(device, name, dtype, T, rng):
    sc = SCENARIOS[name]
    got, want, before = both(rng, sc, dtype, T, device)
    # Sanity: the op did something (rotated q, wrote the cache) and v is untouched.
    assert not np.array_equal(got["qkv"], before["qkv"])
    assert not np.array_equal(got["k_cache"], before["k_cache"])
    hq, hk = sc["hq"], sc["hk"]
    np.testing.assert_array_equal(got["qkv"][:, hq + hk:], before["qkv"][:, hq + hk:])
    if device == "cpu":
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
        return
    bits = {FP8: 3, "bfloat16": 7, "float16": 10, "float32": 23}
    cdt = min(sc.get("cache") or dtype, dtype, key=bits.get)  # k's rounding, then the cache's
    long_rows = bool(sc.get("norm")) and packs(sc, dtype) > 32
    assert_within_one_rounding(got["qkv"], want["qkv"], dtype, f"{name} q/k", long_rows)
    assert_within_one_rounding(got["k_cache"], want["k_cache"], cdt, f"{name} k_cache", long_rows)
    np.testing.assert_array_equal(got["v_cache"], want["v_cache"], err_msg=f"{name} v_cache")  # a plain copy


def exact_cases():
    """(scenario, dtype) pairs the kernel claims bit-exact: rows of <= 32 packs, or layouts it hands
    to the composition (Dv != D; f16/bf16 D % 8 != 0)."""
    out = []
    for name, sc in SCENARIOS.items():
        for dtype in DTYPES:
            fallback = "dv" in sc or (dtype != "float32" and sc["d"] % 8)
            if packs(sc, dtype) <= 32 or fallback:
                out.append(pytest.param(name, dtype, id=f"{name}-{dtype}"))
    return out


@needs_cuda
@pytest.mark.parametrize("kernel", ["warp", "warp-rows2", "warp-rows4", "block"])
@pytest.mark.parametrize("name,dtype", exact_cases())
def test_cuda_bit_exact(name, dtype, kernel, rng):
    """The fused kernels' claim (cuda/rope_cache.cu): the same f32 operations in the same order as
    the composition, so the same bits. A failure here with test_matches_composition passing means
    the compiler contracted rope.cu's a*c - b*s differently from what the kernel pins. Every kernel:
    the warp kernel (the default where its layout holds) with one, two and four rows a lane
    (the rope_rows tuning field; a token's last warp then has row slots past its rows), and the block
    kernel (rope_warp=False, and the layouts the warp kernel does not take)."""
    rows = int(kernel[-1]) if kernel.startswith("warp-rows") else 0
    sc = SCENARIOS[name]
    with ops.kernel_tuning_override(rope_warp=kernel != "block", rope_rows=rows):
        for T in (1, 37, 300):
            got, want, _ = both(rng, sc, dtype, T, "cuda")
            for key in got:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} T={T} {key}")


@needs_cuda
def test_cuda_graph_capture_after_producer(rng):
    """Captured behind the GEMM that writes qkv (the decode graph's order; PDL on sm_90), replays
    read the fresh qkv, positions and slots: same bits as the eager composition."""
    sc = SCENARIOS["qwen3-qk-norm"]
    dtype, T, hidden = "bfloat16", 4, 256
    hq, hk, d = sc["hq"], sc["hk"], sc["d"]
    inp = make_inputs(rng, sc, dtype, T, "cuda")
    w = tallow.tensor(0.05 * rng.standard_normal(((hq + 2 * hk) * d, hidden)), dtype=dtype).to("cuda")
    x = tallow.tensor(rng.standard_normal((T, hidden)), dtype=dtype).to("cuda")
    flat = inp["qkv"].view(T, (hq + 2 * hk) * d)

    def step():
        ops.linear(x, w, out=flat)
        fused(sc, inp)

    step()  # warm-up outside the capture
    tc.synchronize()
    g = tc.CUDAGraph()
    with tc.graph(g):
        step()
    nb = inp["k_cache"].shape[0]
    for _ in range(3):
        x.copy_(tallow.tensor(rng.standard_normal((T, hidden)), dtype=dtype).to("cuda"))
        inp["pos"].copy_(tallow.from_numpy(rng.integers(0, 2048, size=T).astype(np.int64)).to("cuda"))
        slots = rng.permutation(nb * 16)[:T].astype(np.int64)
        slots[1] = -1
        inp["slots"].copy_(tallow.from_numpy(slots).to("cuda"))
        ref = fresh(inp)
        g.replay()
        tc.synchronize()
        ops.linear(x, w, out=ref["qkv"].view(T, (hq + 2 * hk) * d))
        composed(sc, ref)
        got, want = outputs(inp), outputs(ref)
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"replay {key}")
    g.reset()


# ---- errors: named after the op, raised before anything is written -----------------------------

@pytest.fixture
def index_checks_on():
    """The CUDA index checks on for the test (an engine built earlier in the process turns them off)."""
    if not tc.is_available():
        yield
        return
    was = tc.index_checks()
    tc.set_index_checks(True)
    yield
    tc.set_index_checks(was)


def _err_inputs(rng, device="cpu"):
    sc = SCENARIOS["qwen3-qk-norm"]
    return sc, make_inputs(rng, sc, "float32", 5, device)


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_position_raises_and_writes_nothing(device, rng, index_checks_on):
    sc, inp = _err_inputs(rng, device)
    pos = inp["pos"].to("cpu").numpy().copy()
    pos[3] = 2048  # == max_pos
    inp["pos"] = tallow.from_numpy(pos)
    if device != "cpu":
        inp["pos"] = inp["pos"].to(device)
    before = outputs(inp)
    with pytest.raises(IndexError, match="rope_and_cache.*out of range of cos_sin_cache"):
        fused(sc, inp)
    for key, val in outputs(inp).items():
        np.testing.assert_array_equal(val, before[key], err_msg=key)


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_slot_raises_and_writes_nothing(device, rng, index_checks_on):
    sc, inp = _err_inputs(rng, device)
    slots = inp["slots"].to("cpu").numpy().copy()
    slots[2] = inp["k_cache"].shape[0] * inp["k_cache"].shape[1]
    inp["slots"] = tallow.from_numpy(slots)
    if device != "cpu":
        inp["slots"] = inp["slots"].to(device)
    before = outputs(inp)
    with pytest.raises(ValueError, match="rope_and_cache.*slot_mapping.*out of range"):
        fused(sc, inp)
    for key, val in outputs(inp).items():
        np.testing.assert_array_equal(val, before[key], err_msg=key)


def test_bad_arguments_name_the_op_and_shapes(rng):
    sc, inp = _err_inputs(rng)
    q, k, v = views(sc, inp)
    args = dict(positions=inp["pos"], q=q, k=k, v=v, cos_sin_cache=inp["cs"], neox=True, k_cache=inp["k_cache"],
                v_cache=inp["v_cache"], slot_mapping=inp["slots"])

    def call(**over):
        ops.rope_and_cache(**{**args, **over})

    with pytest.raises(ValueError, match=r"rope_and_cache: q_norm_weight and k_norm_weight must be given together"):
        call(q_norm_weight=inp["qw"])
    with pytest.raises(ValueError, match=r"rope_and_cache: q_norm_weight must have shape \[128\]"):
        call(q_norm_weight=inp["qw"][:64], k_norm_weight=inp["kw"])
    with pytest.raises(TypeError, match=r"rope_and_cache: .*q_norm_weight.*same dtype"):
        call(q_norm_weight=inp["qw"].to("bfloat16"), k_norm_weight=inp["kw"])
    with pytest.raises(ValueError, match=r"rope_and_cache: k must be \[T, heads, head_dim\] with T = 5 .*got shape \[3, 8, 128\]"):
        call(k=k[:3])
    with pytest.raises(ValueError, match=r"rope_and_cache: q\[5, 16, 128\] and k\[5, 8, 64\] must have the same head_dim"):
        call(k=k[:, :, :64])
    with pytest.raises(ValueError, match=r"rope_and_cache: rot_dim .*must be even"):
        call(cos_sin_cache=tallow.tensor(make_cache(16, 130)))
    with pytest.raises(ValueError, match=r"rope_and_cache: v must be \[T, num_kv_heads"):
        call(v=v[:, :3])
    with pytest.raises(ValueError, match=r"rope_and_cache: slot_mapping\[4\] must be \[T\]"):
        call(slot_mapping=inp["slots"][:4])
    with pytest.raises(ValueError, match=r"rope_and_cache: k_scale must be finite and > 0"):
        call(k_scale=0.0)
    with pytest.raises(ValueError, match=r"rope_and_cache: q of shape .* needs a contiguous last dim"):
        call(q=inp["qkv"].as_strided([5, 16, 64], [inp["qkv"].stride(0), 128, 2], 0))
    with pytest.raises(TypeError, match=r"rope_and_cache: positions must be one of \{int32, int64\}"):
        call(positions=inp["cs"][:5, 0])
    with pytest.raises(ValueError, match=r"rope_and_cache: k\[5, 8, 128\] does not match k_cache"):
        call(k_cache=inp["k_cache"][:, :, :4], v_cache=inp["v_cache"][:, :, :4])
