"""Every dense family against transformers, token for token (issue 5).

For each family a tiny random-weight model is built with transformers (CPU torch), its norm weights
and biases randomised too (HF initialises them to constants, which would hide a missing bias or a
wrong (1 + w)), and saved with save_pretrained plus a WordLevel tokenizer. tallow (f32, CPU, through
`LLM`) must produce transformers' greedy continuation of N_NEW tokens for a batch of prompts of
different lengths, longer than the sliding window where the family has one, and first-step logits
within 1e-4 (max-norm relative).

Where llama.cpp defines the architecture, the same checkpoint is written to GGUF the way
convert_hf_to_gguf does (names from the gguf package's TensorNameMap, llama's q/k row permutation,
Gemma's norms stored as 1 + w, StableLM's per-head norms stacked, Phi-3's LongRoPE factor tensors,
llama3 rope_freqs) in F32, which must give the same tokens; and with every matrix in Q8_0, which must
give the tokens of transformers run on the dequantized weights.

FAMILY_CASES also feeds docs/supported_models.md (tests/python/gen_support_table.py); a test checks
that the committed table is current. TALLOW_TEST_DEVICE=cuda runs the same checks with tallow on a GPU.
"""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers (with CPU torch) is the reference model")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers", reason="transformers is the reference model")
gguf = pytest.importorskip("gguf", reason="the gguf package writes the GGUF checkpoints")

from engine_models import write_word_tokenizer  # noqa: E402
import quant_models  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB, N_NEW = 320, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.08,
              eos_token_id=1, bos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
WINDOW = 24
# TALLOW_TEST_DEVICE=cuda runs tallow's side on a GPU (still f32; the references stay on the CPU).
DEVICE = os.environ.get("TALLOW_TEST_DEVICE", "cpu")
ENGINE_ARGS = dict(num_kv_blocks=64, block_size=16, max_model_len=256, device=DEVICE, dtype="float32")


@dataclasses.dataclass
class Case:
    id: str
    family: str  # tallow family
    hf_class: str  # transformers model class
    config: dict  # config kwargs (over COMMON) or a callable returning the config object
    prompt_lens: tuple = (5, 17, 40, 70)
    gguf_arch: str | None = None
    features: str = ""  # for the support table
    examples: str = ""  # real checkpoints of this shape, for the support table


def _mistral3_config():
    cfg = dict(COMMON, max_position_embeddings=1024, rms_norm_eps=1e-5, sliding_window=None,
               rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                                "llama_4_scaling_beta": 0.1, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "rope_theta": 1e6})
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=16, head_dim=16)
    return transformers.Mistral3Config(vision_config=vision, text_config=transformers.Ministral3Config(**cfg),
                                       image_token_index=5, spatial_merge_size=2, tie_word_embeddings=False)


GEMMA3 = dict(num_hidden_layers=6, tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=WINDOW,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def _gemma3_mm_config():
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=16)
    return transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**{**COMMON, **GEMMA3}),
                                     vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 3,
                                     boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 1)


FAMILY_CASES = [
    Case("llama3", "llama", "LlamaForCausalLM",
         dict(tie_word_embeddings=True, rope_parameters={
             "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
         gguf_arch="llama", features="llama3 RoPE scaling, tied embeddings, GQA",
         examples="Llama 2, 3, 3.1, 3.2; Yi; SmolLM2; DeepSeek-R1-Distill-Llama"),
    Case("mistral", "mistral", "MistralForCausalLM", dict(sliding_window=WINDOW),
         features="sliding-window attention on every layer (prompts longer than the window)",
         examples="Mistral 7B v0.1-v0.3, Mistral Nemo"),
    Case("ministral", "mistral", "MinistralForCausalLM",
         dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
         features="per-layer layer_types (sliding and full layers)", examples="Ministral 8B"),
    Case("ministral3", "mistral", "Mistral3ForConditionalGeneration", _mistral3_config,
         features="nested text_config of a multimodal checkpoint (text only), yarn RoPE, Llama-4 query scaling",
         examples="Ministral 3 (Mistral Small 3.1 / 3.2 share the nesting)"),
    Case("qwen2", "qwen2", "Qwen2ForCausalLM", dict(tie_word_embeddings=True),
         gguf_arch="qwen2", features="qkv bias, tied embeddings",
         examples="Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen, QwQ"),
    Case("qwen3", "qwen3", "Qwen3ForCausalLM", dict(),
         gguf_arch="qwen3", features="q/k RMSNorm", examples="Qwen3 dense"),
    Case("phi3", "phi3", "Phi3ForCausalLM",
         dict(original_max_position_embeddings=64, sliding_window=48,
              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                               "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                               "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
         prompt_lens=(5, 17, 28, 70), gguf_arch="phi3",
         features="fused qkv_proj and gate_up_proj, LongRoPE (short and long factors), partial rotary, "
                  "sliding window",
         examples="Phi-3, Phi-3.5, Phi-4-mini"),
    Case("gemma", "gemma", "GemmaForCausalLM",
         dict(tie_word_embeddings=True, hidden_act="gelu"), gguf_arch="gemma",
         features="(1 + w) RMSNorms, sqrt(hidden) embedding scale, GeGLU (tanh; legacy hidden_act \"gelu\"), "
                  "tied embeddings",
         examples="Gemma 2B, 7B; CodeGemma"),
    Case("gemma2", "gemma2", "Gemma2ForCausalLM",
         dict(tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=WINDOW,
              attn_logit_softcapping=1.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh"),
         gguf_arch="gemma2",
         features="attention and final logit soft-capping, alternating sliding-window layers, pre/post "
                  "norms, sqrt(hidden) embedding scale, (1 + w) norms, GeGLU (tanh)",
         examples="Gemma 2"),
    Case("gemma3", "gemma3", "Gemma3ForCausalLM", GEMMA3, gguf_arch="gemma3",
         features="q/k (1 + w) RMSNorm, 5 local : 1 global layers with their own RoPE (linear-scaled global), "
                  "sliding window",
         examples="Gemma 3 1B"),
    Case("gemma3_mm", "gemma3", "Gemma3ForConditionalGeneration", _gemma3_mm_config,
         features="the language model of a multimodal checkpoint (text only; the vision tower is skipped)",
         examples="Gemma 3 4B, 12B, 27B"),
    Case("stablelm", "stablelm", "StableLmForCausalLM",
         dict(use_qkv_bias=True, layer_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
         gguf_arch="stablelm", features="LayerNorm with bias, partial rotary (25%), qkv bias",
         examples="StableLM 2 1.6B, StableLM-3B-4E1T, StableCode-3B"),
    Case("stablelm_parallel", "stablelm", "StableLmForCausalLM",
         dict(use_parallel_residual=True, qk_layernorm=True, layer_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
         gguf_arch="stablelm", features="parallel residual, per-head q/k LayerNorm", examples="StableLM 2 12B"),
    Case("glm4", "glm4", "Glm4ForCausalLM",
         dict(attention_bias=True, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
         gguf_arch="glm4",
         features="partial rotary with interleaved pairs, post-attention and post-MLP norms, fused gate_up_proj, "
                  "qkv bias",
         examples="GLM-4-0414, GLM-Z1-0414"),
]
CASES = {c.id: c for c in FAMILY_CASES}



# -- the reference ---------------------------------------------------------------------------------
def _config(case: Case):
    if callable(case.config):
        return case.config()
    cfg_cls = getattr(transformers, case.hf_class.replace("ForCausalLM", "Config").replace("Gemma3Config",
                                                                                        "Gemma3TextConfig"))
    return cfg_cls(**{**COMMON, **case.config})


def _randomise(model, seed: int):
    """Norm weights and biases away from HF's constant init (values on a 1/256 grid, so Gemma's
    GGUF 1 + w round-trips exactly)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.round(torch.empty(p.shape).uniform_(-0.4, 0.4, generator=g) * 256) / 256)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


def hf_greedy(model, prompt, n_new=N_NEW):
    return quant_models.hf_greedy(model, prompt, n_new)


def hf_first_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].double().numpy()


@dataclasses.dataclass
class Ref:
    case: Case
    path: pathlib.Path
    model: object
    prompts: list
    tokens: list
    logits: list


_REFS: dict[str, Ref] = {}


def reference(case, model, tmp_path_factory) -> Ref:
    """Save a random-weight transformers model with a word tokenizer and record, for the case's prompts
    (random ids, seed 1234), its greedy tokens and first-step logits: what tallow is held to."""
    path = tmp_path_factory.mktemp(case.id)
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB, eos_id=1)
    rng = np.random.default_rng(1234)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in case.prompt_lens]
    return Ref(case, path, model, prompts, [hf_greedy(model, p) for p in prompts],
               [hf_first_logits(model, p) for p in prompts])


def add_word_vocab(w) -> None:
    """The test checkpoints' WordLevel vocabulary (t0 t1 ...) as SentencePiece-style GGUF pieces (prompts
    are token ids)."""
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)


@pytest.fixture
def ref(request, tmp_path_factory):
    case = CASES[request.param]
    if case.id not in _REFS:
        torch.manual_seed(0)
        model = getattr(transformers, case.hf_class)(_config(case)).float().eval()
        _randomise(model, 0)
        _REFS[case.id] = reference(case, model, tmp_path_factory)
    return _REFS[case.id]


# -- running tallow ----------------------------------------------------------------------------------
def run_tallow(model_path: str, prompts, n_new: int = N_NEW, **engine_args):
    """(greedy tokens, first-step logits) per prompt, all prompts in one batch."""
    return quant_models.run(model_path, prompts, n_new, **{**ENGINE_ARGS, **engine_args})


def check(tokens, logits, ref_tokens, ref_logits, what):
    for i, (got, exp) in enumerate(zip(tokens, ref_tokens)):
        at = next((j for j, (a, b) in enumerate(zip(got, exp)) if a != b), min(len(got), len(exp)))
        assert got == exp, f"{what}: prompt {i} diverges from transformers at generated token {at}"
    for got, exp in zip(logits, ref_logits):
        err = np.max(np.abs(got - exp)) / np.max(np.abs(exp))
        assert err < 1e-4, f"{what}: first-step logits differ by {err:.2e} (max-norm relative)"


def check_q8_activations(tokens, logits, ref_tokens, ref_logits, what):
    """A GGUF model against transformers on its dequantized weights: tallow's decode products quantize
    the activations to 8 bits per 32-value block (as llama.cpp does), so logits move by ~1e-3 relative and a
    greedy path may leave the reference at a near-tie. A loader fault (a wrong name, layout or permutation)
    moves the logits by O(1): the bound is 1e-2; every greedy path must start as the reference's and at
    least one prompt's path must equal it throughout."""
    agree = []
    for i, (got, exp) in enumerate(zip(tokens, ref_tokens)):
        at = next((j for j, (a, b) in enumerate(zip(got, exp)) if a != b), min(len(got), len(exp)))
        agree.append(at)
    print(f"{what}: greedy tokens equal to transformers' for the first {agree} of {[len(t) for t in ref_tokens]}")
    for got, exp in zip(logits, ref_logits):
        err = np.max(np.abs(got - exp)) / np.max(np.abs(exp))
        assert err < 1e-2, f"{what}: first-step logits differ by {err:.2e} (max-norm relative)"
    assert min(agree) >= 1 and any(a == len(t) for a, t in zip(agree, ref_tokens)), \
        f"{what}: greedy paths leave transformers' too early: {agree}"


@pytest.mark.parametrize("ref", list(CASES), indirect=True)
def test_safetensors_matches_transformers(ref):
    tokens, logits, llm = run_tallow(str(ref.path), ref.prompts)
    assert llm.engine.config.family == ref.case.family
    check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} (safetensors)")
    if any(t == "sliding_attention" for t in llm.engine.config.layer_types):
        assert max(len(p) for p in ref.prompts) > llm.engine.config.sliding_window


@pytest.mark.parametrize("ref", ["mistral", "gemma2", "gemma3"], indirect=True)
def test_chunked_prefill_with_sliding_window(ref):
    """Prompts longer than the window prefilled 8 tokens at a time beside other sequences' decodes."""
    tokens, logits, _ = run_tallow(str(ref.path), ref.prompts, prefill_chunk_size=8, max_num_batched_tokens=16)
    check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} (chunked prefill)")


@pytest.mark.parametrize("ref", list(CASES), indirect=True)
def test_bfloat16_runs(ref):
    """Half precision is not held to transformers' tokens; it must run and stay close to f32."""
    tokens, logits, _ = run_tallow(str(ref.path), ref.prompts, n_new=4, dtype="bfloat16")
    assert all(len(t) == 4 for t in tokens)
    for got, exp in zip(logits, ref.logits):
        assert np.max(np.abs(got - exp)) / np.max(np.abs(exp)) < 0.1


# -- GGUF ----------------------------------------------------------------------------------------------
def _state_dict(path: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(path / "model.safetensors")).items()}


def _permute(w, n_head):  # convert_hf_to_gguf's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rp: dict, dim: int) -> np.ndarray:  # convert_hf_to_gguf's LlamaModel.generate_extra_tensors
    base, factor = rp["rope_theta"], rp["factor"]
    low, high, old = rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def q8_weight(name: str, arr: np.ndarray) -> bool:
    return arr.ndim == 2 and arr.shape[-1] % 32 == 0 and "norm" not in name


def write_gguf(case: Case, hf_cfg, sd: dict[str, np.ndarray], path, quantize: bool = False) -> None:
    """Write `sd` (HF names and layout) as convert_hf_to_gguf would, F32 or (quantize) Q8_0 matrices."""
    arch = case.gguf_arch
    c = hf_cfg
    n_layer, n_head, n_kv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_head
    rp = dict(getattr(c, "rope_parameters", None) or {})
    rp_full = rp.get("full_attention", rp)
    rot = int(head_dim * rp_full.get("partial_rotary_factor", 1.0))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    tmap = gguf.get_tensor_name_map(arch_id, n_layer)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(rp_full.get("rope_theta", 10000.0))
    if arch == "stablelm":
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_parallel_residual(c.use_parallel_residual)
    else:
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(7 if quantize else 0)  # MOSTLY_Q8_0 / ALL_F32
    extra: dict[str, np.ndarray] = {}
    if arch == "llama" and rp.get("rope_type") == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_freqs(rp, rot)
    if arch == "phi3":
        orig = c.original_max_position_embeddings
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_sliding_window(c.sliding_window or 0)
        extra["rope_factors_long.weight"] = np.asarray(rp["long_factor"], np.float32)
        extra["rope_factors_short.weight"] = np.asarray(rp["short_factor"], np.float32)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
        if rp_full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rp_full["factor"])
    add_word_vocab(w)

    sd = dict(sd)
    for i in range(n_layer):  # stablelm: per-head norms are stacked
        p = f"model.layers.{i}.self_attn."
        for ln, n in (("q_layernorm", n_head), ("k_layernorm", n_kv)):
            if p + f"{ln}.norms.0.weight" in sd:
                sd[p + f"{ln}.weight"] = np.stack([sd.pop(p + f"{ln}.norms.{h}.weight") for h in range(n)])
    if arch in ("gemma", "gemma2", "gemma3"):
        sd.pop("lm_head.weight", None)
    for name, data in sd.items():
        if arch == "llama" and (name.endswith("q_proj.weight") or name.endswith("q_proj.bias")):
            data = _permute(data, n_head)
        if arch == "llama" and (name.endswith("k_proj.weight") or name.endswith("k_proj.bias")):
            data = _permute(data, n_kv)
        if arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + np.float32(1)
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"gguf has no name for {name}"
        if quantize and q8_weight(name, data):
            w.add_tensor(new, gguf.quants.quantize(np.ascontiguousarray(data), Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32))
    for name, data in extra.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CASES = [c.id for c in FAMILY_CASES if c.gguf_arch]


@pytest.mark.parametrize("ref", GGUF_CASES, indirect=True)
def test_gguf_f32_matches_transformers(ref, tmp_path):
    path = tmp_path / f"{ref.case.id}.gguf"
    write_gguf(ref.case, ref.model.config, _state_dict(ref.path), path)
    tokens, logits, llm = run_tallow(str(path), ref.prompts)
    assert llm.engine.source.kind == "gguf" and llm.engine.config.family == ref.case.family
    check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} (GGUF F32)")


@pytest.mark.parametrize("ref", GGUF_CASES, indirect=True)
def test_gguf_q8_0_matches_dequantized_reference(ref, tmp_path):
    sd = _state_dict(ref.path)
    path = tmp_path / f"{ref.case.id}-q8_0.gguf"
    write_gguf(ref.case, ref.model.config, sd, path, quantize=True)
    # the reference: transformers on the dequantized weights (quantization is per row, so it commutes
    # with llama's q/k row permutation)
    deq = {k: gguf.quants.dequantize(gguf.quants.quantize(v, Q.Q8_0), Q.Q8_0) if q8_weight(k, v) else v
           for k, v in sd.items()}
    model = getattr(transformers, ref.case.hf_class)(ref.model.config).float().eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in deq.items()},
                                                strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    if model.config.tie_word_embeddings or getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    assert any(not np.array_equal(deq[k], sd[k]) for k in sd), "nothing was quantized"
    ref_tokens = [hf_greedy(model, p) for p in ref.prompts]
    ref_logits = [hf_first_logits(model, p) for p in ref.prompts]
    tokens, logits, llm = run_tallow(str(path), ref.prompts)
    assert llm.engine.config.family == ref.case.family
    check_q8_activations(tokens, logits, ref_tokens, ref_logits, f"{ref.case.id} (GGUF Q8_0)")


# -- registry and support table ------------------------------------------------------------------------
def test_every_dense_family_is_registered_and_tested():
    from tallow.models import supported_families

    tested = {c.family for c in FAMILY_CASES}
    assert tested <= set(supported_families())
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "stablelm", "glm4"} <= tested


def test_unsupported_family_lists_supported_ones():
    import tallow.models as models
    from tallow.config import ModelConfig
    from tallow.models import registry

    cfg = ModelConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8,
                                        hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=1))
    llama = registry.model_class("llama")
    registry.unregister("llama")  # a config parsed while its family was served, built after it is gone
    try:
        with pytest.raises(models.UnsupportedModelError, match=r"'llama'.*not supported.*supported: .*gemma2.*qwen3"):
            models.build_model(cfg, {}, None)
        with pytest.raises(ValueError, match="unsupported architecture 'LlamaForCausalLM'"):
            ModelConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama"))
    finally:
        registry.register(llama)


def test_support_table_is_current():
    import gen_support_table

    doc = pathlib.Path(__file__).resolve().parents[3] / "docs" / "supported_models.md"
    assert doc.read_text() == gen_support_table.render(), \
        "docs/supported_models.md is stale: run python tests/python/gen_support_table.py"
