"""FP8 E4M3 KV caches: reshape_and_cache and paged_attention with k_scale / v_scale, on the CPU
and (skipped with the reason without a device) on CUDA.

reshape_and_cache into an fp8 cache stores e4m3(float32(x) / float32(scale)): one f32 division,
then round to nearest even, saturating to +-448 (also +-inf); NaN stays NaN. Checked bit for bit
against a numpy encoder written from the format's definition (the 127 finite magnitudes, nearest,
ties to the even code), on random values, exact ties, subnormals, the saturation edge and NaN.

paged_attention over fp8 caches reads stored * k_scale and stored * v_scale. CPU bound: relative
L2 1e-5 with a float32 q against the float64 reference on the dequantised caches (f32
accumulation), the float16 / bfloat16 output bounds of test_paged_attention.py otherwise. CUDA
bound: against the CPU op on the same fp8 caches and scales (q converted to float32 exactly),
bfloat16 1e-2 and float16 2e-3 relative L2 (the decode and prefill kernels round the softmax
weights to q's type before P V, and the output once). Scales apply to fp8 caches only: 16/32-bit
caches ignore them.
"""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc
from tallow import ops
from tallow.layers.attention import AttentionMetadata, PagedAttention
from backend_ops import relative_error
from backend_ops.cases_paged_attention import make_batch, paged_ref

FP8 = "float8_e4m3"
INDEX_KEYS = ("block_tables", "seq_lens", "query_start_loc")
TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
CUDA_TOL = {"float16": 2e-3, "bfloat16": 1e-2}

needs_cuda = pytest.mark.skipif(
    not tc.is_available(),
    reason="no CUDA: this build has no CUDA backend" if not tc.built else "no CUDA: no driver or device present")


# ---- a numpy e4m3 ("fn") codec from the format's definition ---------------------------------------

def _magnitudes():
    """Value of each non-negative finite code 0x00 .. 0x7e (0x7f is NaN)."""
    c = np.arange(127)
    e, m = c >> 3, c & 7
    return np.where(e == 0, m * 2.0**-9, 2.0 ** (e - 7.0) * (1 + m / 8.0))


MAG = _magnitudes()


def e4m3_encode(x):
    """float32 array -> uint8 codes: nearest, ties to even, saturating at 448; NaN -> 0x7f | sign."""
    x = np.asarray(x, np.float32)
    a = np.abs(x.astype(np.float64)).ravel()
    hi = np.clip(np.searchsorted(MAG, a), 1, 126)  # MAG[hi - 1] <= a <= MAG[hi] inside the range
    lo = hi - 1
    dlo, dhi = a - MAG[lo], MAG[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= 448.0, 126, code)  # 448 < a < 464 rounds to 448 anyway; above it saturates
    code = np.where(np.isnan(a), 127, code).astype(np.uint8)
    return (code | (np.signbit(x.ravel()).astype(np.uint8) << 7)).reshape(x.shape)


def e4m3_decode(codes):
    codes = np.asarray(codes, np.uint8)
    mag = np.concatenate([MAG, [np.nan]])[codes & 0x7f]
    return np.where(codes & 0x80, -mag, mag)


def test_numpy_codec_round_trips_every_code():
    codes = np.arange(256, dtype=np.uint8)
    vals = e4m3_decode(codes).astype(np.float32)
    finite = ~np.isnan(vals)
    np.testing.assert_array_equal(e4m3_encode(vals)[finite], codes[finite])
    # tallow's own conversion agrees on every code
    t = tallow.from_numpy(codes.copy()).view_as_dtype(FP8, [256])
    np.testing.assert_array_equal(t.to("float32").numpy()[finite], vals[finite])


def special_values(rng, n):
    """Random values plus exact ties, subnormals, the saturation edge, infinities and NaN."""
    ties = (MAG[1:] + MAG[:-1]) / 2  # every midpoint between neighbouring magnitudes
    edge = np.array([447.0, 448.0, 455.0, 463.9, 464.0, 465.0, 480.0, 1e6, np.inf, 2.0**-10, 2.0**-11, 0.0, 1e-30])
    v = np.concatenate([ties, edge, rng.standard_normal(n) * 40.0]).astype(np.float32)
    v = np.concatenate([v, -v, [np.nan, -np.nan]])
    return rng.permutation(v).astype(np.float32)


# ---- reshape_and_cache -----------------------------------------------------------------------------

def _write_case(rng, T, hk, d, bs, nb, src_dtype, specials=False):
    n = T * hk * d
    vals = special_values(rng, n) if specials else (rng.standard_normal(n) * 3).astype(np.float32)
    k = np.resize(vals, (T, hk, d)).astype(np.float32)
    v = np.resize(rng.permutation(vals), (T, hk, d)).astype(np.float32)
    k_t, v_t = tallow.tensor(k, dtype=src_dtype), tallow.tensor(v, dtype=src_dtype)
    # the inputs as the op sees them (rounded to the source dtype)
    k_r, v_r = k_t.to("float32").numpy(), v_t.to("float32").numpy()
    before = rng.integers(0, 256, size=(2, nb, bs, hk, d), dtype=np.uint8)
    before[(before & 0x7f) == 0x7f] = 0  # no NaN codes in the untouched rows (assert_array_equal)
    slots = rng.permutation(nb * bs)[:T].astype(np.int64)
    slots[rng.permutation(T)[:3]] = -1
    return k_t, v_t, k_r, v_r, before, slots


def _fp8_cache(codes, device="cpu"):
    return tallow.from_numpy(np.ascontiguousarray(codes)).view_as_dtype(FP8, list(codes.shape)).to(device)


def _expected(codes, x, slots, scale):
    out = codes.copy()
    bs = out.shape[1]
    enc = e4m3_encode(np.float32(x) / np.float32(scale))
    for t, s in enumerate(slots):
        if s >= 0:
            out[s // bs, s % bs] = enc[t]
    return out


@pytest.mark.parametrize("src_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 3.0), (1 / 448, 0.01)])
@pytest.mark.parametrize("specials", [False, True])
def test_reshape_and_cache_fp8_bit_exact(rng, src_dtype, scales, specials):
    T, hk, d, bs, nb = 29, 2, 80, 16, 4
    k_t, v_t, k_r, v_r, before, slots = _write_case(rng, T, hk, d, bs, nb, src_dtype, specials)
    kc, vc = _fp8_cache(before[0]), _fp8_cache(before[1])
    ops.reshape_and_cache(k_t, v_t, kc, vc, tallow.from_numpy(slots), k_scale=scales[0], v_scale=scales[1])
    np.testing.assert_array_equal(kc.numpy(raw=True), _expected(before[0], k_r, slots, scales[0]))
    np.testing.assert_array_equal(vc.numpy(raw=True), _expected(before[1], v_r, slots, scales[1]))


def test_scales_are_ignored_by_16_bit_caches(rng):
    T, hk, d, bs, nb = 9, 2, 64, 16, 2
    k = tallow.tensor(rng.standard_normal((T, hk, d)), dtype="float32")
    slots = tallow.from_numpy(np.arange(T, dtype=np.int32))
    caches = [tallow.empty([nb, bs, hk, d], "bfloat16") for _ in range(4)]
    ops.reshape_and_cache(k, k, caches[0], caches[1], slots)
    ops.reshape_and_cache(k, k, caches[2], caches[3], slots, k_scale=4.0, v_scale=0.5)
    np.testing.assert_array_equal(caches[0].numpy(raw=True)[0, :T], caches[2].numpy(raw=True)[0, :T])
    np.testing.assert_array_equal(caches[1].numpy(raw=True)[0, :T], caches[3].numpy(raw=True)[0, :T])
    inp = make_batch(rng, [(40, 1), (17, 3)], 4, 2, 64, 16)
    q = tallow.tensor(inp["q"], dtype="float32")
    kc, vc = (tallow.tensor(inp[x], dtype="bfloat16") for x in ("k_cache", "v_cache"))
    idx = [tallow.from_numpy(inp[x]) for x in INDEX_KEYS]
    a = ops.paged_attention(q, kc, vc, *idx, 0.125).numpy()
    b = ops.paged_attention(q, kc, vc, *idx, 0.125, k_scale=3.0, v_scale=0.2).numpy()
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_scales_must_be_finite_and_positive(rng, bad):
    k = tallow.from_numpy(np.ones((2, 1, 16), np.float32))
    kc = _fp8_cache(np.zeros((1, 4, 1, 16), np.uint8))
    slots = tallow.from_numpy(np.arange(2, dtype=np.int32))
    with pytest.raises(ValueError, match="reshape_and_cache: k_scale must be finite and > 0"):
        ops.reshape_and_cache(k, k, kc, kc, slots, k_scale=bad)
    with pytest.raises(ValueError, match="reshape_and_cache: v_scale must be finite and > 0"):
        ops.reshape_and_cache(k, k, kc, kc, slots, v_scale=bad)
    inp = make_batch(rng, [(5, 1)], 2, 1, 16, 4)
    q = tallow.tensor(inp["q"], dtype="float32")
    idx = [tallow.from_numpy(inp[x]) for x in INDEX_KEYS]
    c = tallow.tensor(inp["k_cache"], dtype=FP8)
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"paged_attention: {name} must be finite and > 0"):
            ops.paged_attention(q, c, c, *idx, 0.25, **{name: bad})


def test_fp8_cache_with_16_bit_cache_rejected_and_q_not_fp8(rng):
    inp = make_batch(rng, [(5, 1)], 2, 1, 16, 4)
    idx = [tallow.from_numpy(inp[x]) for x in INDEX_KEYS]
    kc, vc = tallow.tensor(inp["k_cache"], dtype=FP8), tallow.tensor(inp["v_cache"], dtype="bfloat16")
    q = tallow.tensor(inp["q"], dtype="float32")
    with pytest.raises(TypeError, match="paged_attention: k_cache .* and v_cache .* same dtype"):
        ops.paged_attention(q, kc, vc, *idx, 0.25)
    with pytest.raises(TypeError, match="paged_attention: q must be float32"):
        ops.paged_attention(tallow.tensor(inp["q"], dtype=FP8), kc, kc, *idx, 0.25)


# ---- paged_attention on the CPU --------------------------------------------------------------------

MIXED = [(45, 1), (64, 64), (77, 20), (1, 1), (130, 33), (300, 1), (2000, 1)]


def fp8_inputs(rng, seqs, hq, hk, d, bs, q_dtype, k_scale, v_scale, qmul=2.0):
    """(tallow inputs with fp8 caches, float64 reference inputs with the dequantised caches)."""
    inp = make_batch(rng, seqs, hq, hk, d, bs, qmul=qmul)
    tl, ref = {}, {}
    for key, scale in (("k_cache", k_scale), ("v_cache", v_scale)):
        codes = e4m3_encode((inp[key] / scale).astype(np.float32))
        tl[key] = _fp8_cache(codes)
        ref[key] = e4m3_decode(codes) * np.float64(np.float32(scale))
    q = tallow.tensor(inp["q"].astype(np.float32), dtype=q_dtype)
    tl["q"], ref["q"] = q, q.to("float32").numpy().astype(np.float64)
    for key in INDEX_KEYS:
        tl[key] = tallow.from_numpy(inp[key])
        ref[key] = inp[key]
    return tl, ref


@pytest.mark.parametrize("q_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("hq,hk,d,bs,window,softcap,scales", [
    (8, 2, 128, 16, 0, 0.0, (1.0, 1.0)),
    (8, 2, 64, 32, 0, 0.0, (0.05, 0.3)),
    (4, 1, 80, 16, 40, 0.0, (2.0, 0.5)),
    (8, 2, 96, 16, 0, 5.0, (0.1, 0.1)),
    (6, 3, 256, 16, 17, 3.0, (0.7, 1.9)),
])
def test_cpu_fp8_matches_reference(rng, q_dtype, hq, hk, d, bs, window, softcap, scales):
    tl, ref = fp8_inputs(rng, MIXED, hq, hk, d, bs, q_dtype, *scales)
    scale = d**-0.5
    out = ops.paged_attention(tl["q"], tl["k_cache"], tl["v_cache"], *(tl[k] for k in INDEX_KEYS), scale,
                              sliding_window=window, softcap=softcap, k_scale=scales[0], v_scale=scales[1])
    expect = paged_ref(ref["q"], ref["k_cache"], ref["v_cache"], *(ref[k] for k in INDEX_KEYS), scale, window, softcap)
    err = relative_error(out.to("float32").numpy().astype(np.float64), expect)
    assert err <= TOL[q_dtype], f"rel err {err:.3g} > {TOL[q_dtype]}"


@pytest.mark.parametrize("nthreads", [1, 3, 16])
def test_cpu_fp8_split_key_ranges(rng, nthreads):
    """Few long decodes: the CPU splits key ranges across threads and merges them (v_scale must
    be applied once, after the merge)."""
    n0 = tallow.get_num_threads()
    try:
        tallow.set_num_threads(nthreads)
        tl, ref = fp8_inputs(rng, [(3000, 1), (1200, 1)], 8, 2, 128, 16, "float32", 0.2, 0.6)
        out = ops.paged_attention(tl["q"], tl["k_cache"], tl["v_cache"], *(tl[k] for k in INDEX_KEYS), 0.09,
                                  k_scale=0.2, v_scale=0.6)
        expect = paged_ref(ref["q"], ref["k_cache"], ref["v_cache"], *(ref[k] for k in INDEX_KEYS), 0.09)
        assert relative_error(out.numpy().astype(np.float64), expect) <= TOL["float32"]
    finally:
        tallow.set_num_threads(n0)


def test_layer_passes_scales(rng):
    """PagedAttention(k_scale, v_scale) writes and reads an fp8 cache with its scales."""
    hq, hk, d, bs, T = 4, 2, 64, 16, 5
    layer = PagedAttention(hq, hk, d, d**-0.5, k_scale=0.25, v_scale=2.0)
    k = rng.standard_normal((T, hk, d)).astype(np.float32) * 10
    v = rng.standard_normal((T, hk, d)).astype(np.float32)
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    kc = _fp8_cache(np.zeros((2, bs, hk, d), np.uint8))
    vc = _fp8_cache(np.zeros((2, bs, hk, d), np.uint8))
    meta = AttentionMetadata(slot_mapping=tallow.from_numpy(np.arange(T, dtype=np.int64)),
                             block_tables=tallow.from_numpy(np.array([[0, 1]], np.int32)),
                             seq_lens=tallow.from_numpy(np.array([T], np.int32)),
                             query_start_loc=tallow.from_numpy(np.array([0, T], np.int32)), num_tokens=T)
    out = layer(tallow.from_numpy(q), tallow.from_numpy(k), tallow.from_numpy(v), (kc, vc), meta).numpy()
    np.testing.assert_array_equal(kc.numpy(raw=True)[0, :T], e4m3_encode(k / np.float32(0.25)))
    kd = e4m3_decode(e4m3_encode(k / np.float32(0.25))) * 0.25
    vd = e4m3_decode(e4m3_encode(v / np.float32(2.0))) * 2.0
    from backend_ops.cases_attention import attention_ref
    expect = attention_ref(q.astype(np.float64), kd, vd, d**-0.5)
    assert relative_error(out.astype(np.float64), expect) <= TOL["float32"]


# ---- CUDA ------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("src_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("d", [80, 36])  # vectorised (8 elements a thread) and scalar kernels
def test_cuda_reshape_and_cache_fp8_bit_exact(rng, src_dtype, d):
    T, hk, bs, nb = 37, 2, 16, 4
    k_t, v_t, k_r, v_r, before, slots = _write_case(rng, T, hk, d, bs, nb, src_dtype, specials=True)
    kc, vc = _fp8_cache(before[0], "cuda"), _fp8_cache(before[1], "cuda")
    ops.reshape_and_cache(k_t.to("cuda"), v_t.to("cuda"), kc, vc, tallow.from_numpy(slots).to("cuda"),
                          k_scale=0.37, v_scale=3.0)
    np.testing.assert_array_equal(kc.to("cpu").numpy(raw=True), _expected(before[0], k_r, slots, 0.37))
    np.testing.assert_array_equal(vc.to("cpu").numpy(raw=True), _expected(before[1], v_r, slots, 3.0))


def _cuda_vs_cpu_fp8(rng, seqs, hq, hk, d, bs, q_dtype, scales, window=0, softcap=0.0):
    tl, _ = fp8_inputs(rng, seqs, hq, hk, d, bs, q_dtype, *scales)
    scale = d**-0.5
    kw = dict(sliding_window=window, softcap=softcap, k_scale=scales[0], v_scale=scales[1])
    dev = {k: t.to("cuda") for k, t in tl.items()}
    got = ops.paged_attention(dev["q"], dev["k_cache"], dev["v_cache"], *(dev[k] for k in INDEX_KEYS), scale, **kw)
    ref = ops.paged_attention(tl["q"].to("float32"), tl["k_cache"], tl["v_cache"], *(tl[k] for k in INDEX_KEYS),
                              scale, **kw)
    got = got.to("cpu").to("float32").numpy().astype(np.float64)
    assert np.isfinite(got).all()
    err = relative_error(got, ref.numpy().astype(np.float64))
    assert err <= CUDA_TOL[q_dtype], f"seqs={seqs[:4]}.. d={d}: rel err {err:.3g} > {CUDA_TOL[q_dtype]}"


@needs_cuda
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_cuda_fp8_decode_every_head_dim(rng, q_dtype, d):
    seqs = [(int(L), 1) for L in rng.integers(1, 3000, size=6)]
    _cuda_vs_cpu_fp8(rng, seqs, 8, 2, d, 16, q_dtype, (0.05, 0.02))


@needs_cuda
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
def test_cuda_fp8_decode_window_softcap(rng, q_dtype):
    seqs = [(int(L), 1) for L in rng.integers(1, 5000, size=9)]
    _cuda_vs_cpu_fp8(rng, seqs, 32, 8, 128, 16, q_dtype, (0.01, 0.03), window=700, softcap=30.0)


@needs_cuda
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
def test_cuda_fp8_mixed_batch(rng, q_dtype):
    """Prefill and mixed batches over fp8 caches (prefill kernel, or the simple one)."""
    _cuda_vs_cpu_fp8(rng, MIXED, 8, 2, 128, 16, q_dtype, (0.3, 0.1))


@needs_cuda
@pytest.mark.parametrize("src_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("d", [80, 36])  # vectorised and scalar writes
def test_cuda_reshape_and_cache_fp8_nan_keeps_sign(rng, src_dtype, d):
    """+NaN -> 0x7f and -NaN -> 0xff in every position (a GPU division would drop the sign), in K
    and V, next to ordinary values; K and V go out in one launch."""
    T, hk, bs, nb = 6, 2, 16, 2
    vals = (rng.standard_normal((T, hk, d)) * 3).astype(np.float32)
    vals[0, 0, :] = np.nan
    vals[1, 1, :] = -np.nan
    vals[2, :, ::3] = -np.nan
    vals[3, :, 1::5] = np.nan
    k_t, v_t = tallow.tensor(vals, dtype=src_dtype), tallow.tensor(-vals, dtype=src_dtype)
    k_r, v_r = k_t.to("float32").numpy(), v_t.to("float32").numpy()
    before = np.zeros((2, nb, bs, hk, d), np.uint8)
    slots = np.array([3, 17, 0, 30, 5, -1], np.int64)
    kc, vc = _fp8_cache(before[0], "cuda"), _fp8_cache(before[1], "cuda")
    ops.reshape_and_cache(k_t.to("cuda"), v_t.to("cuda"), kc, vc, tallow.from_numpy(slots).to("cuda"),
                          k_scale=0.5, v_scale=2.0)
    ek, ev = _expected(before[0], k_r, slots, 0.5), _expected(before[1], v_r, slots, 2.0)
    assert (ek == 0xFF).any() and (ek == 0x7F).any() and (ev == 0xFF).any()
    np.testing.assert_array_equal(kc.to("cpu").numpy(raw=True), ek)
    np.testing.assert_array_equal(vc.to("cpu").numpy(raw=True), ev)
    # the CPU op writes the same bytes
    kc2, vc2 = _fp8_cache(before[0]), _fp8_cache(before[1])
    ops.reshape_and_cache(k_t, v_t, kc2, vc2, tallow.from_numpy(slots), k_scale=0.5, v_scale=2.0)
    np.testing.assert_array_equal(kc2.numpy(raw=True), ek)
    np.testing.assert_array_equal(vc2.numpy(raw=True), ev)


@needs_cuda
def test_cuda_reshape_and_cache_mixed_dtypes(rng):
    """k and v of different dtypes, an fp8 K cache with a bf16 V cache of another head dim: each
    written as the CPU op writes it (the path with one launch per cache)."""
    T, hk, d, dv, bs, nb = 9, 2, 64, 32, 16, 2
    k = tallow.tensor(rng.standard_normal((T, hk, d)).astype(np.float32), dtype="float16")
    v = tallow.tensor(rng.standard_normal((T, hk, dv)).astype(np.float32), dtype="bfloat16")
    slots = tallow.from_numpy(rng.permutation(nb * bs)[:T].astype(np.int32))
    kc = _fp8_cache(np.zeros((nb, bs, hk, d), np.uint8))
    vc = tallow.tensor(np.zeros((nb, bs, hk, dv), np.float32), dtype="bfloat16")
    kc_d, vc_d = kc.to("cuda"), vc.to("cuda")
    ops.reshape_and_cache(k, v, kc, vc, slots, k_scale=0.3, v_scale=0.7)
    ops.reshape_and_cache(k.to("cuda"), v.to("cuda"), kc_d, vc_d, slots.to("cuda"), k_scale=0.3, v_scale=0.7)
    np.testing.assert_array_equal(kc_d.to("cpu").numpy(raw=True), kc.numpy(raw=True))
    np.testing.assert_array_equal(vc_d.to("cpu").numpy(raw=True), vc.numpy(raw=True))


@needs_cuda
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_fp8_decode_bf16_q_rows_of_any_magnitude(rng, d):
    """fp8 caches run the mmas in f16; a bf16 q is rescaled per row by a power of two into f16's range.
    Rows of |q| ~ 1e-6, 1, 1e3 and 1e5 (and an all-zero row) all match the CPU op."""
    hq, hk = 8, 2
    seqs = [(int(L), 1) for L in rng.integers(1, 4000, size=5)]
    tl, _ = fp8_inputs(rng, seqs, hq, hk, d, 16, "float32", 0.05, 0.02, qmul=1.0)
    q = tl["q"].numpy().copy()
    mags = np.array([1e-6, 1.0, 1e3, 1e5, 0.0, 3.0, 0.5, 7e4], np.float32)[None, :, None]
    q = q * mags / np.sqrt(d)  # per-head magnitude; softmax runs from nearly uniform to one-hot
    qb = tallow.tensor(q, dtype="bfloat16")
    kw = dict(k_scale=0.05, v_scale=0.02)
    idx = [tl[k] for k in INDEX_KEYS]
    got = ops.paged_attention(qb.to("cuda"), tl["k_cache"].to("cuda"), tl["v_cache"].to("cuda"),
                              *(t.to("cuda") for t in idx), 1.0, **kw)
    ref = ops.paged_attention(qb.to("float32"), tl["k_cache"], tl["v_cache"], *idx, 1.0, **kw)
    got = got.to("cpu").to("float32").numpy().astype(np.float64)
    assert np.isfinite(got).all()
    ref = ref.numpy().astype(np.float64)
    for h in range(hq):  # each magnitude on its own (a one-hot head would hide a uniform one)
        err = relative_error(got[:, h], ref[:, h])
        assert err <= CUDA_TOL["bfloat16"], f"head {h} (|q| ~ {mags[0, h, 0]:g}): rel err {err:.3g}"


@needs_cuda
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
def test_cuda_fp8_decode_long_and_split(rng, q_dtype):
    """Long fp8 contexts split many ways (the fused merge applies v_scale once) and as few ways as
    the kernel allows (decode_splits=1: 20000 keys still need two splits)."""
    seqs = [(20000, 1), (5000, 1), (300, 1)]
    _cuda_vs_cpu_fp8(rng, seqs, 16, 2, 128, 16, q_dtype, (0.02, 0.05))
    with ops.kernel_tuning_override(decode_splits=1):
        _cuda_vs_cpu_fp8(rng, seqs, 16, 2, 128, 16, q_dtype, (0.02, 0.05))
