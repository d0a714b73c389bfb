"""RoPE inv_freq / cos / sin / attention factor (tallow.layers.rotary) against transformers on CPU.

Three references:
- transformers' ROPE_INIT_FUNCTIONS (and the models' compute_default_rope_parameters) run in float64:
  they spell every dtype as torch.float / torch.float32, so the tests hand them a torch whose float and
  float32 are float64. Bound: relative error < 1e-9 on inv_freq and the attention factor, and the float32
  cache within 1e-6 of cos/sin computed in float64 from transformers' inv_freq.
- the same functions unpatched (float32): inv_freq relative error <= 1e-6.
- the rotary embedding module of a tiny random config of each family (float32, as the models run it):
  cos/sin at the given positions within 1e-6 + 2.5e-7 * position * attention_factor (float32 rounding of
  inv_freq and of position * inv_freq grows with the position).
"""
import contextlib
import importlib
import math

import numpy as np
import pytest

from tallow.layers.rotary import build_cos_sin_cache, llama4_attn_scale, rope_inv_freq
from tallow.config import ModelConfig, RopeConfig

torch = pytest.importorskip("torch", reason="torch (CPU) is the test-only reference for RoPE")
transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason="transformers >= 5 (rope_parameters, Ministral 3) is the test-only reference")
mru = importlib.import_module("transformers.modeling_rope_utils")


class _Float64Torch:
    """torch, except that torch.float and torch.float32 mean float64."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def float64_transformers(*modules):
    """Run transformers' rope code in float64: torch.float / torch.float32 and Tensor.float() (longrope
    uses it) give float64 while this is active."""
    mods = [mru, *modules]
    saved = [m.torch for m in mods]
    saved_float = torch.Tensor.float
    for m in mods:
        m.torch = _Float64Torch()
    torch.Tensor.float = lambda self, *a, **k: self.double(*a, **k)
    try:
        yield
    finally:
        torch.Tensor.float = saved_float
        for m, t in zip(mods, saved):
            m.torch = t


def hf_inv_freq(hf_config, rope_type, seq_len=None, float64=True, layer_type=None, module=None):
    """transformers' (inv_freq, attention_factor) as numpy float64 / float."""
    kw = {"layer_type": layer_type} if layer_type else {}
    if rope_type == "default":
        mod = module or importlib.import_module("transformers.models.llama.modeling_llama")
        cls = next(v for k, v in vars(mod).items() if k.endswith("RotaryEmbedding"))
        fn = lambda: cls.compute_default_rope_parameters(hf_config, **kw)  # noqa: E731
        ctx = float64_transformers(mod) if float64 else contextlib.nullcontext()
    else:
        fn = lambda: mru.ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len, **kw)  # noqa: E731
        ctx = float64_transformers() if float64 else contextlib.nullcontext()
    with ctx:
        inv, af = fn()
    return inv.to(torch.float64).numpy(), float(af)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


def llama_config(rng, rope_scaling=None, max_pos=None, **kw):
    heads = int(rng.choice([2, 4, 8]))
    head_dim = int(rng.choice([16, 32, 64, 128]))
    base = dict(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=max_pos or int(rng.choice([512, 1024, 2048])),
                rope_theta=float(rng.choice([10000.0, 500000.0, 1e6])) * float(rng.uniform(0.5, 2.0)))
    base.update(kw)
    if rope_scaling is not None:
        base["rope_scaling"] = rope_scaling
    return transformers.LlamaConfig(**base)


def rope_cases(rng):
    """(name, transformers config, rope type) for every rope type, parameters drawn from rng."""
    f = float(rng.uniform(2.0, 16.0))
    mpe = int(rng.choice([1024, 2048, 4096]))
    orig = mpe // int(rng.choice([2, 4, 8]))
    cases = [
        ("default", llama_config(rng), "default"),
        ("linear", llama_config(rng, {"rope_type": "linear", "factor": f}), "linear"),
        ("dynamic", llama_config(rng, {"rope_type": "dynamic", "factor": f}), "dynamic"),
        ("llama3", llama_config(rng, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": orig},
                                max_pos=mpe), "llama3"),
        ("llama3-random", llama_config(rng, {"rope_type": "llama3", "factor": f,
                                             "low_freq_factor": float(rng.uniform(0.5, 2.0)),
                                             "high_freq_factor": float(rng.uniform(3.0, 8.0)),
                                             "original_max_position_embeddings": orig}, max_pos=mpe), "llama3"),
        ("yarn", llama_config(rng, {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": orig},
                              max_pos=mpe), "yarn"),
        ("yarn-mscale", llama_config(rng, {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": orig,
                                           "mscale": float(rng.uniform(0.5, 1.5)), "mscale_all_dim": 1.0,
                                           "beta_fast": float(rng.integers(8, 48)), "beta_slow": 2.0},
                                     max_pos=mpe), "yarn"),
        ("yarn-attn-factor-notrunc", llama_config(rng, {"rope_type": "yarn", "factor": f,
                                                        "original_max_position_embeddings": orig,
                                                        "attention_factor": float(rng.uniform(0.8, 1.3)),
                                                        "truncate": False}, max_pos=mpe), "yarn"),
    ]
    for name, extra in (("longrope", {}), ("longrope-explicit", {"factor": f, "attention_factor": 1.1})):
        heads = 4
        head_dim = int(rng.choice([16, 32, 64]))
        prf = float(rng.choice([1.0, 0.5, 0.75]))
        rot = int(head_dim * prf)
        scaling = {"type": "longrope", "short_factor": rng.uniform(1.0, 2.0, rot // 2).tolist(),
                   "long_factor": rng.uniform(1.0, 40.0, rot // 2).tolist(), **extra}
        cfg = transformers.Phi3Config(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=mpe, original_max_position_embeddings=orig,
                                      partial_rotary_factor=prf, rope_theta=10000.0, rope_scaling=scaling,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cases.append((name, cfg, "longrope"))
    return cases


CASE_NAMES = ["default", "linear", "dynamic", "llama3", "llama3-random", "yarn", "yarn-mscale",
              "yarn-attn-factor-notrunc", "longrope", "longrope-explicit"]


def get_case(rng, name):
    return next(c for c in rope_cases(rng) if c[0] == name)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_inv_freq_and_attention_factor_match_transformers_float64(rng, name):
    _, hf, rtype = get_case(rng, name)
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    assert mc.rope.type == rtype
    orig = mc.rope.original_max_position_embeddings or mc.max_position_embeddings
    for seq_len in (None, orig // 2, orig, orig + 1, 4 * mc.max_position_embeddings):
        want, want_af = hf_inv_freq(hf, rtype, seq_len)
        got, got_af = rope_inv_freq(mc.rope, mc.rotary_dim, seq_len)
        assert got.shape == want.shape == (mc.rotary_dim // 2,)
        assert rel(got, want) < 1e-9, (seq_len, rel(got, want))
        assert abs(got_af - want_af) <= 1e-12 * abs(want_af), (seq_len, got_af, want_af)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_inv_freq_matches_transformers_float32(rng, name):
    _, hf, rtype = get_case(rng, name)
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    want, _ = hf_inv_freq(hf, rtype, None, float64=False)
    got, _ = rope_inv_freq(mc.rope, mc.rotary_dim)
    # transformers computes in float32 (ours is float64, rounded): base ** (i / d) amplifies the
    # exponent's rounding by ln(base), and YaRN's float32 ramp blends frequencies that differ by up to
    # the scaling factor, amplifying its rounding again. Measured over 200 seeds of 8 of the cases: at most
    # 19.6 float32 ulps (2^-24) of relative error (yarn without truncation); the bound is 50.
    assert rel(got.astype(np.float32), want) <= 50 * 2.0**-24


@pytest.mark.parametrize("name", CASE_NAMES)
def test_cos_sin_cache_layout_and_precision(rng, name):
    _, hf, rtype = get_case(rng, name)
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    n = int(rng.integers(64, 3 * mc.max_position_embeddings))
    cache = build_cos_sin_cache(mc.rope, mc.rotary_dim, n)
    assert cache.dtype == np.float32 and cache.shape == (n, mc.rotary_dim) and cache.flags.c_contiguous
    inv, af = hf_inv_freq(hf, rtype, n)
    ang = np.outer(np.arange(n, dtype=np.float64), inv)
    half = mc.rotary_dim // 2
    assert np.max(np.abs(cache[:, :half] - af * np.cos(ang))) <= 1e-6 * max(af, 1.0)
    assert np.max(np.abs(cache[:, half:] - af * np.sin(ang))) <= 1e-6 * max(af, 1.0)


def _module_tol(positions, af):
    return (1e-6 + 2.5e-7 * positions.astype(np.float64)[:, None]) * max(af, 1.0)


def check_module(module, mc_rope, rotary_dim, positions, layer_type=None, x_dtype=torch.float32):
    """Compare module(x, positions) with rows of our cache (the cache evaluated at max(positions)+1)."""
    pos = np.asarray(positions, dtype=np.int64)
    x = torch.zeros(1, dtype=x_dtype)
    args = (x, torch.from_numpy(pos)[None, :]) + ((layer_type,) if layer_type else ())
    with torch.no_grad():
        cos, sin = module(*args)
    cos, sin = cos[0].double().numpy(), sin[0].double().numpy()
    half = rotary_dim // 2
    assert cos.shape == (len(pos), rotary_dim)
    n = int(pos.max()) + 1
    cache = build_cos_sin_cache(mc_rope, rotary_dim, n).astype(np.float64)
    _, af = rope_inv_freq(mc_rope, rotary_dim, n)
    tol = _module_tol(pos, af)
    for a, b in ((cos[:, :half], cache[pos, :half]), (cos[:, half:], cache[pos, :half]),
                 (sin[:, :half], cache[pos, half:]), (sin[:, half:], cache[pos, half:])):
        assert np.all(np.abs(a - b) <= tol), float(np.max(np.abs(a - b) - tol))


def _rotary_module(model_type, hf_config):
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(v for k, v in vars(mod).items() if k.endswith("RotaryEmbedding") and isinstance(v, type))
    return cls(config=hf_config)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_rotary_module_of_tiny_model(rng, name):
    _, hf, rtype = get_case(rng, name)
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    module = _rotary_module(hf.model_type, hf)
    orig = mc.rope.original_max_position_embeddings or mc.max_position_embeddings
    # short sequences, then sequences past the (original) context: dynamic and longrope switch there
    check_module(module, mc.rope, mc.rotary_dim, np.arange(32))
    check_module(module, mc.rope, mc.rotary_dim, np.r_[np.arange(16), orig - 1])
    check_module(module, mc.rope, mc.rotary_dim, np.r_[np.arange(16), orig + 5])
    check_module(module, mc.rope, mc.rotary_dim, np.r_[np.arange(16), 2 * mc.max_position_embeddings + 3])


TINY = dict(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)
FAMILY_CONFIGS = {
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=64)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=48, rope_theta=1e6,
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 256})),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, head_dim=32)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, pad_token_id=0)),
    "gemma2": ("Gemma2Config", dict(head_dim=32, query_pre_attn_scalar=32)),
    "stablelm": ("StableLmConfig", dict(partial_rotary_factor=0.25)),
    "glm4": ("Glm4Config", dict(head_dim=32, partial_rotary_factor=0.5, pad_token_id=0)),
    "ministral3": ("Ministral3Config", dict(
        head_dim=32, max_position_embeddings=2048, pad_token_id=0,
        rope_parameters={"type": "yarn", "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                         "original_max_position_embeddings": 128, "max_position_embeddings": 2048,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "llama_4_scaling_beta": 0.1})),
}


def tiny_family_config(family):
    cls_name, extra = FAMILY_CONFIGS[family]
    return getattr(transformers, cls_name)(**{**TINY, **extra})


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_rotary_module_of_each_family(family):
    hf = tiny_family_config(family)
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    module = _rotary_module(hf.model_type, hf)
    check_module(module, mc.rope, mc.rotary_dim, np.r_[np.arange(24), mc.max_position_embeddings - 1])
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    prf = hf.rope_parameters.get("partial_rotary_factor", 1.0)
    assert mc.rotary_dim == int(head_dim * prf)


def test_gemma3_layer_types_use_their_own_rope():
    hf = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=7,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       max_position_embeddings=1024, sliding_window=16,
                                       rope_scaling={"rope_type": "linear", "factor": 8.0})
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    module = _rotary_module("gemma3", hf)
    pos = np.r_[np.arange(24), 1000]
    for i, lt in enumerate(hf.layer_types):
        rope = mc.rope_for_layer(i)
        check_module(module, rope, mc.rotary_dim, pos, layer_type=lt)
    assert mc.rope.type == "linear" and mc.rope.factor == 8.0 and mc.rope.theta == 1e6
    assert mc.rope_local.type == "default" and mc.rope_local.theta == 10000.0
    for lt in ("full_attention", "sliding_attention"):
        want, _ = hf_inv_freq(hf, "default", layer_type=lt,
                              module=importlib.import_module("transformers.models.gemma3.modeling_gemma3"))
        if lt == "full_attention":
            want, _ = hf_inv_freq(hf, "linear", layer_type=lt)
        got, _ = rope_inv_freq(mc.rope if lt == "full_attention" else mc.rope_local, mc.rotary_dim)
        assert rel(got, want) < 1e-9


def test_yarn_scaling_override_matches_transformers_yarn(rng):
    hf = llama_config(rng, max_pos=2048)
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    factor = float(rng.choice([2.0, 4.0, 3.5]))
    scaled = mc.with_yarn_scaling(factor)
    assert scaled.rope.type == "yarn" and scaled.rope.factor == factor
    assert scaled.rope.original_max_position_embeddings == 2048
    assert scaled.max_position_embeddings == int(2048 * factor)
    assert mc.rope.type == "default" and mc.max_position_embeddings == 2048  # the original is untouched
    ref = llama_config(rng, {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 2048},
                       max_pos=int(2048 * factor), hidden_size=hf.hidden_size,
                       num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
                       rope_theta=hf.rope_parameters["rope_theta"])
    want, want_af = hf_inv_freq(ref, "yarn")
    got, got_af = rope_inv_freq(scaled.rope, scaled.rotary_dim)
    assert rel(got, want) < 1e-9 and abs(got_af - want_af) < 1e-12
    check_module(_rotary_module("llama", ref), scaled.rope, scaled.rotary_dim, np.r_[np.arange(8), 8000])
    with pytest.raises(ValueError, match="> 1"):
        mc.with_yarn_scaling(1.0)


def test_freq_factors_reproduce_llama3():
    """GGUF stores llama3 scaling as per-frequency divisors (rope_freqs); both give the same cache."""
    l3 = RopeConfig(type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, max_position_embeddings=131072)
    base, _ = rope_inv_freq(RopeConfig(theta=500000.0), 128)
    inv, _ = rope_inv_freq(l3, 128)
    ff = RopeConfig(type="llama3", theta=500000.0, freq_factors=tuple(base / inv))
    assert rel(rope_inv_freq(ff, 128)[0], inv) < 1e-12
    assert np.max(np.abs(build_cos_sin_cache(ff, 128, 4096) - build_cos_sin_cache(l3, 128, 4096))) <= 1e-6


def test_cache_feeds_tallow_rotary_embedding_like_transformers(rng):
    """End to end: the cache through tallow.ops.rotary_embedding equals transformers'
    apply_rotary_pos_emb (neox: llama with yarn) and glm4's interleaved, partial variant."""
    tallow = pytest.importorskip("tallow._core", reason="tallow's compiled core is needed for the op")
    import tallow as tl
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.llama import modeling_llama

    T, Hq, Hk = 9, 4, 2
    cases = [
        (llama_config(rng, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
                      max_pos=2048, num_key_value_heads=2, num_attention_heads=4, hidden_size=4 * 64),
         modeling_llama),
        (transformers.Glm4Config(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                 partial_rotary_factor=0.5, max_position_embeddings=2048), modeling_glm4),
    ]
    for hf, mod in cases:
        mc = ModelConfig.from_hf_dict(hf.to_dict())
        D = mc.head_dim
        pos = np.sort(rng.choice(2048, T, replace=False)).astype(np.int64)
        q = rng.standard_normal((T, Hq, D)).astype(np.float32)
        k = rng.standard_normal((T, Hk, D)).astype(np.float32)
        cache = build_cos_sin_cache(mc.rope, mc.rotary_dim, 2048)
        tq, tk = tl.from_numpy(q.copy()), tl.from_numpy(k.copy())
        tl.ops.rotary_embedding(tl.from_numpy(pos), tq, tk, tl.from_numpy(cache), neox=mc.rope_neox)
        # transformers in float64 on the same cos/sin, [B, H, T, D] layout
        inv, af = rope_inv_freq(mc.rope, mc.rotary_dim, 2048)
        ang = np.outer(pos, inv)
        emb = np.concatenate([ang, ang], axis=-1)
        cos = torch.from_numpy(np.cos(emb) * af)[None]
        sin = torch.from_numpy(np.sin(emb) * af)[None]
        qr, kr = mod.apply_rotary_pos_emb(torch.from_numpy(q).double().transpose(0, 1)[None],
                                          torch.from_numpy(k).double().transpose(0, 1)[None], cos, sin)
        want_q = qr[0].transpose(0, 1).numpy()
        want_k = kr[0].transpose(0, 1).numpy()
        assert np.max(np.abs(np.asarray(tq) - want_q)) < 1e-4, mod.__name__
        assert np.max(np.abs(np.asarray(tk) - want_k)) < 1e-4, mod.__name__


def test_llama4_attn_scale_matches_ministral3():
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    pos = np.array([0, 1, 100, 16383, 16384, 40000, 262143])
    want = get_llama_4_attn_scale(torch.from_numpy(pos)[None], 0.1, 16384)[0, 0, :, 0].numpy()
    assert np.allclose(llama4_attn_scale(pos, 0.1, 16384), want, rtol=1e-6, atol=0)


def test_bad_rotary_inputs():
    with pytest.raises(ValueError, match="even"):
        rope_inv_freq(RopeConfig(), 7)
    with pytest.raises(ValueError, match="max_positions"):
        build_cos_sin_cache(RopeConfig(), 8, 0)
    with pytest.raises(ValueError, match="short_factor"):
        rope_inv_freq(RopeConfig(type="longrope", short_factor=(1.0,), long_factor=(1.0,),
                                 original_max_position_embeddings=16, max_position_embeddings=64), 8)
    with pytest.raises(ValueError, match="unsupported RoPE type"):
        RopeConfig(type="mrope")
    with pytest.raises(ValueError, match="factor"):
        RopeConfig(type="linear")
    assert math.isclose(rope_inv_freq(RopeConfig(), 8)[0][1], 10000.0 ** -0.25)
