"""DeepSeek-V2 / V3 (multi-head latent attention + DeepSeek MoE) against transformers, token for token (issue 29).

Tiny random-weight models built with transformers' own DeepseekV2/V3 classes (norm weights, the V3 router's
e_score_correction_bias and any biases randomised: transformers initialises them to constants), saved as
safetensors; tallow (f32, CPU, through `LLM`) must give transformers' greedy continuation of 32 tokens for a
batch of prompts of mixed lengths and first-step logits within 1e-4. Cases: V2-Lite's plain q_proj with greedy
softmax routing, V2 with q_lora and group_limited_greedy, V3 with sigmoid + noaux_tc + correction bias, yarn
with mscale / mscale_all_dim and interleaved RoPE, and V3 with NeoX RoPE (rope_interleave false) and attention
biases. The V2-Lite and V3 checkpoints are also written to GGUF as llama.cpp's convert_hf_to_gguf writes the
`deepseek2` architecture (stacked experts, exp_probs_b; V3 in the MLA layout with kv_b_proj split into attn_k_b
(transposed) and attn_v_b, V2-Lite in the older attn_kv_b layout) in F32, which must give the same tokens, and
V3 with its matrices in Q8_0, which must stay close to transformers (check_q8_activations). Also: the latent
cache's size (one [c_kv | k_pe] row per token and layer, v a view of it; >= 4x fewer
bytes than ordinary K/V), and prefix-cache hits plus chunked prefill giving the same tokens.
"""
from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers (with CPU torch) is the reference model")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers", reason="transformers is the reference model")
gguf = pytest.importorskip("gguf", reason="the gguf package writes the GGUF checkpoints")

import test_model_zoo as zoo  # noqa: E402
from test_model_zoo import VOCAB, Case, check, hf_first_logits, hf_greedy, run_tallow  # noqa: E402
from test_model_zoo_moe import _stack_experts  # noqa: E402

# tiny: hidden 64, 4 heads, kv_lora_rank 32, rope dims 16, 8 experts (2 per token), first layer dense
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
            max_position_embeddings=256, initializer_range=0.08, eos_token_id=1, bos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
PROMPT_LENS = (5, 17, 40, 70)

DEEPSEEK_CASES = [
    Case("deepseek_v2_lite", "deepseek_v2", "DeepseekV2ForCausalLM",
         dict(TINY, q_lora_rank=None, topk_method="greedy", n_shared_experts=2, routed_scaling_factor=1.0),
         prompt_lens=PROMPT_LENS, gguf_arch="deepseek2",
         features="MLA with a plain q_proj (q_lora_rank null), latent KV cache, softmax greedy top-k, "
                  "2 shared experts, first layer dense",
         examples="DeepSeek-V2-Lite"),
    Case("deepseek_v2_lite_widths", "deepseek_v2", "DeepseekV2ForCausalLM",
         dict(TINY, hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None,
              topk_method="greedy", n_shared_experts=2),
         prompt_lens=(6, 23),
         features="DeepSeek-V2-Lite's attention widths (kv_lora_rank 512, rope 64, nope 128, v 128: "
                  "latent rows of 576)"),
    Case("deepseek_v2_grouped", "deepseek_v2", "DeepseekV2ForCausalLM",
         dict(TINY, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4, topk_group=2,
              n_shared_experts=1, routed_scaling_factor=1.5),
         prompt_lens=PROMPT_LENS,
         features="q_lora (q_a_proj, q_a_layernorm, q_b_proj), group_limited_greedy routing, routed_scaling_factor",
         examples="DeepSeek-V2, DeepSeek-V2.5"),
    Case("deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM",
         dict(TINY, q_lora_rank=48, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True,
              routed_scaling_factor=2.5, rope_parameters=YARN),
         prompt_lens=PROMPT_LENS, gguf_arch="deepseek2",
         features="sigmoid scores, noaux_tc group top-k with e_score_correction_bias, norm_topk_prob, "
                  "yarn with mscale / mscale_all_dim, interleaved RoPE",
         examples="DeepSeek-V3, DeepSeek-R1"),
    Case("deepseek_v3_neox_bias", "deepseek_v3", "DeepseekV3ForCausalLM",
         dict(TINY, q_lora_rank=48, n_group=2, topk_group=1, n_shared_experts=1, norm_topk_prob=False,
              routed_scaling_factor=1.0, rope_interleave=False, attention_bias=True, num_hidden_layers=2),
         prompt_lens=(9, 33),
         features="rope_interleave false (NeoX halves), attention biases, no renormalisation"),
]
CASES = {c.id: c for c in DEEPSEEK_CASES}



_REFS: dict[str, zoo.Ref] = {}


def _build(case: Case, tmp_path_factory) -> zoo.Ref:
    if case.id in _REFS:
        return _REFS[case.id]
    torch.manual_seed(0)
    cfg = getattr(transformers, case.hf_class.replace("ForCausalLM", "Config"))(**case.config)
    model = getattr(transformers, case.hf_class)(cfg).float().eval()
    zoo._randomise(model, 0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:  # a buffer, zeros in transformers' init: make it change the choice
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.2)
    _REFS[case.id] = zoo.reference(case, model, tmp_path_factory)
    return _REFS[case.id]


@pytest.fixture
def ref(request, tmp_path_factory):
    return _build(CASES[request.param], tmp_path_factory)


def _model(llm):
    return llm.engine.runner.model


@pytest.mark.parametrize("ref", list(CASES), indirect=True)
def test_safetensors_matches_transformers(ref):
    from tallow.layers.deepseek_moe import DeepseekMoE
    from tallow.layers.mla import MultiHeadLatentAttention

    tokens, logits, llm = run_tallow(str(ref.path), ref.prompts)
    cfg = llm.engine.config
    assert cfg.family == ref.case.family
    layers = _model(llm).layers
    assert all(isinstance(layer.attn, MultiHeadLatentAttention) for layer in layers)
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, DeepseekMoE)]
    assert sparse == list(range(1, cfg.num_hidden_layers))  # first_k_dense_replace = 1
    check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} (safetensors)")


@pytest.mark.parametrize("ref", ["deepseek_v2_lite", "deepseek_v3"], indirect=True)
def test_tensor_parallel_matches_transformers(ref):
    """TP=2 (worker processes, the shared-memory all-reduce): the query heads split over the ranks (q or
    q_b, kv_b, o), the latent computed and cached whole on each, experts split along their intermediate
    size; greedy tokens and first logits as transformers'."""
    tokens, logits, llm = run_tallow(str(ref.path), ref.prompts, tensor_parallel_size=2)
    try:
        attn = _model(llm).layers[0].attn
        assert attn.dims.num_heads == ref.case.config["num_attention_heads"] // 2
        check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} at TP=2")
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("ref", ["deepseek_v2_grouped", "deepseek_v3"], indirect=True)
def test_bfloat16_runs(ref):
    """Half precision is not held to transformers' tokens; it must run and stay close to f32."""
    tokens, logits, _ = run_tallow(str(ref.path), ref.prompts, n_new=4, dtype="bfloat16")
    assert all(len(t) == 4 for t in tokens)
    for got, exp in zip(logits, ref.logits):
        assert np.max(np.abs(got - exp)) / np.max(np.abs(exp)) < 0.1


def test_v3_routing_uses_the_correction_bias(tmp_path_factory):
    """The V3 router tallow loaded picks experts by sigmoid + bias within the best groups, weights them by
    the sigmoid alone: its choice on random rows equals transformers' router's, and differs from the
    choice without the bias (so the bias really is loaded and used)."""
    from tallow import from_numpy
    from tallow.layers.deepseek_moe import DeepseekMoE, deepseek_route

    r = _build(CASES["deepseek_v3"], tmp_path_factory)
    _, _, llm = run_tallow(str(r.path), r.prompts[:1], n_new=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, TINY["hidden_size"])).astype(np.float32)
    differs = False
    for i, layer in enumerate(_model(llm).layers):
        if not isinstance(layer.mlp, DeepseekMoE):
            continue
        logits = np.asarray(layer.mlp.router(from_numpy(x)).numpy())
        w, ids = layer.mlp.route(logits)
        with torch.no_grad():
            _, hf_w, hf_ids = r.model.model.layers[i].mlp.gate(torch.from_numpy(x))
        order = np.argsort(hf_ids.numpy(), axis=-1)
        assert np.array_equal(np.sort(ids, axis=-1), np.take_along_axis(hf_ids.numpy(), order, axis=-1)), i
        np.testing.assert_allclose(np.take_along_axis(w, np.argsort(ids, axis=-1), axis=-1),
                                   np.take_along_axis(hf_w.numpy(), order, axis=-1), rtol=1e-5, atol=1e-6)
        _, no_bias = deepseek_route(logits, layer.mlp.routing, None)
        differs |= not np.array_equal(np.sort(no_bias, axis=-1), np.sort(ids, axis=-1))
    assert differs


def test_latent_cache_holds_one_row_per_token(tmp_path_factory):
    """Each layer's cache is one [c_kv | k_pe] row per token (k [blocks, block, 1, L + rope]) and v a view of
    its first L values; the bytes per block say so, >= 4x fewer than ordinary per-head K and V."""
    from tallow.worker.model_runner import ModelRunner

    r = _build(CASES["deepseek_v2_lite"], tmp_path_factory)
    _, _, llm = run_tallow(str(r.path), r.prompts[:1], n_new=2)
    cfg, runner = llm.engine.config, llm.engine.runner
    lat, rope = TINY["kv_lora_rank"], TINY["qk_rope_head_dim"]
    for k, v in runner.kv_caches:
        assert k.shape[2:] == (1, lat + rope) and v.shape[2:] == (1, lat)
        assert v.data_ptr == k.data_ptr and v.strides == k.strides  # a view, no second buffer
    bs = runner.block_size
    per_block = ModelRunner.kv_bytes_per_block(cfg, bs, runner.kv_dtype)
    assert per_block == cfg.num_hidden_layers * bs * (lat + rope) * 4
    h = TINY["num_attention_heads"]
    ordinary = cfg.num_hidden_layers * bs * h * (TINY["qk_nope_head_dim"] + rope + TINY["v_head_dim"]) * 4
    assert ordinary / per_block >= 4, ordinary / per_block
    assert llm.engine.executor.num_blocks * per_block <= 64 * 2**20  # the CPU budget holds latent rows


def test_v2_lite_shape_cache_ratio():
    """At the DeepSeek-V2-Lite shape (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128) a token costs
    576 values per layer against 16 * (192 + 128) = 5120 for ordinary K/V: 8.9x more tokens per byte."""
    from tallow.config import ModelConfig
    from tallow.worker.model_runner import ModelRunner
    import tallow

    cfg = ModelConfig.from_hf_dict(dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, topk_method="greedy", max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}))
    assert cfg.head_dim == 192 and cfg.rotary_dim == 64 and not cfg.rope_neox
    assert cfg.mlp_only_layers == [0] and cfg.shared_expert_intermediate_size == 2816
    bf16 = tallow._core.dtype("bfloat16")
    latent = ModelRunner.kv_bytes_per_block(cfg, 16, bf16)
    assert latent == 27 * 16 * 576 * 2
    ordinary = 27 * 16 * 16 * (192 + 128) * 2
    assert ordinary / latent >= 4 and round(ordinary / latent, 1) == 8.9


def test_prefix_cache_and_chunked_prefill(tmp_path_factory):
    """Prompts sharing a 40-token prefix, run after it: the prefix's blocks come from the cache (attention
    over cached latent rows), and a small prefill chunk splits the long prompts over steps that also
    carry decodes; the tokens are transformers' throughout."""
    r = _build(CASES["deepseek_v3"], tmp_path_factory)
    rng = np.random.default_rng(7)
    prefix = r.prompts[2]  # 40 tokens
    prompts = [prefix + rng.integers(3, VOCAB, n).tolist() for n in (3, 21)] + [r.prompts[0]]
    expected = [hf_greedy(r.model, p) for p in prompts]
    from tallow import LLM

    llm = LLM(str(r.path), **{**zoo.ENGINE_ARGS, "prefill_chunk_size": 16, "max_num_batched_tokens": 24})
    first, _, llm = run_tallow(llm, [prefix], n_new=4)
    assert first[0] == r.tokens[2][:4]
    tokens, _, llm = run_tallow(llm, prompts)
    assert llm.engine.kv.prefix_cache_hit_rate > 0
    for i, (got, exp) in enumerate(zip(tokens, expected)):
        assert got == exp, f"prompt {i} diverges from transformers at token " \
                           f"{next(j for j, (a, b) in enumerate(zip(got, exp)) if a != b)}"


# -- GGUF ----------------------------------------------------------------------------------------------
def _write_gguf(ref: zoo.Ref, path, quantize: bool = False) -> None:
    """The checkpoint as convert_hf_to_gguf writes DeepseekV2Model: V3 (and any MLA-layout file) with
    head_count_kv 1, key/value_length_mla and kv_b_proj split into k_b (transposed per head) and v_b; V2-Lite
    here in the older layout (one attn_kv_b, per-head key/value lengths)."""
    c = ref.model.config
    v3 = ref.case.family == "deepseek_v3"
    n_layer, n_head = c.num_hidden_layers, c.num_attention_heads
    lat, rope, nope, vd = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_head)
    if v3:
        w.add_head_count_kv(1)
        w.add_key_length(lat + rope)
        w.add_value_length(lat)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(vd)
    else:
        w.add_head_count_kv(n_head)
        w.add_key_length(nope + rope)
        w.add_value_length(vd)
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(lat)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(bool(c.norm_topk_prob))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    rp = c.rope_parameters
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    w.add_file_type(7 if quantize else 0)
    zoo.add_word_vocab(w)

    sd = {k: v for k, v in zoo._state_dict(ref.path).items()}
    sd = _stack_experts(sd, n_layer, c.n_routed_experts)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, n_layer)
    for name, data in list(sd.items()):
        if name.endswith("e_score_correction_bias"):
            sd[name.replace("e_score_correction_bias", "e_score_correction.bias")] = sd.pop(name)
        elif name.endswith("kv_b_proj.weight") and v3:
            kv_b = sd.pop(name).reshape(n_head, nope + vd, lat)
            sd[name.replace("kv_b_proj", "k_b_proj")] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            sd[name.replace("kv_b_proj", "v_b_proj")] = np.ascontiguousarray(kv_b[:, nope:])
    for name, data in sd.items():
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"gguf has no name for {name}"
        if quantize and data.ndim >= 2 and data.shape[-1] % 32 == 0 and "norm" not in name:
            w.add_tensor(new, gguf.quants.quantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("ref", [c.id for c in DEEPSEEK_CASES if c.gguf_arch], indirect=True)
def test_gguf_f32_matches_transformers(ref, tmp_path):
    path = tmp_path / f"{ref.case.id}.gguf"
    _write_gguf(ref, path)
    tokens, logits, llm = run_tallow(str(path), ref.prompts)
    cfg = llm.engine.config
    assert cfg.family == "deepseek_v2" and cfg.source == "gguf"  # llama.cpp's one deepseek2 architecture
    check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} (GGUF F32)")


def _q8_roundtrip(a: np.ndarray) -> np.ndarray:
    q8 = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(a), q8), q8)


def _dequantized_reference(ref: zoo.Ref) -> object:
    """transformers on the weights _write_gguf(quantize=True) stores in Q8_0, dequantized: every matrix with
    32-multiple rows; for V3 (kv_b_proj written split) its v rows (v_b) but not its k rows (k_b's rows are
    nope = 16 wide)."""
    c = ref.model.config
    nope, vd, lat = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    sd = zoo._state_dict(ref.path)
    deq = {}
    for k, v in sd.items():
        if k.endswith("kv_b_proj.weight") and ref.case.family == "deepseek_v3":  # written split: only v_b is Q8_0
            kv = v.reshape(c.num_attention_heads, nope + vd, lat).copy()
            kv[:, nope:] = _q8_roundtrip(kv[:, nope:])
            deq[k] = kv.reshape(v.shape)
        elif v.ndim >= 2 and v.shape[-1] % 32 == 0 and "norm" not in k:
            deq[k] = _q8_roundtrip(v)
        else:
            deq[k] = v
    assert any(not np.array_equal(deq[k], sd[k]) for k in sd if "experts.0." in k), "experts were not quantized"
    model = getattr(transformers, ref.case.hf_class)(c).float().eval()
    own = model.state_dict()
    for i in range(c.num_hidden_layers):  # transformers 5 holds experts as fused 3-D parameters
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" in own and p + "0.gate_proj.weight" in deq:
            n = c.n_routed_experts
            deq[p + "gate_up_proj"] = np.stack([np.concatenate([deq.pop(f"{p}{e}.gate_proj.weight"),
                                                                deq.pop(f"{p}{e}.up_proj.weight")]) for e in range(n)])
            deq[p + "down_proj"] = np.stack([deq.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in deq.items()},
                                                strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model


@pytest.mark.parametrize("ref", [c.id for c in DEEPSEEK_CASES if c.gguf_arch], indirect=True)
def test_gguf_q8_0_matches_dequantized_reference(ref, tmp_path):
    """Matrices in Q8_0 (V3's v_b among them: dequantized when merged back into kv_b_proj) against
    transformers run on the dequantized weights."""
    path = tmp_path / f"{ref.case.id}-q8_0.gguf"
    _write_gguf(ref, path, quantize=True)
    model = _dequantized_reference(ref)
    ref_tokens = [hf_greedy(model, p) for p in ref.prompts]
    ref_logits = [hf_first_logits(model, p) for p in ref.prompts]
    tokens, logits, llm = run_tallow(str(path), ref.prompts)
    assert any(layer.mlp.experts[0].down_proj.weight.dtype.is_block for layer in _model(llm).layers[1:])
    zoo.check_q8_activations(tokens, logits, ref_tokens, ref_logits, f"{ref.case.id} (GGUF Q8_0)")


@pytest.mark.parametrize("ref", ["deepseek_v2_lite", "deepseek_v3"], indirect=True)
def test_checkpoint_names_and_dummy_weights(ref):
    """The names and shapes the layers declare are exactly what transformers' save_pretrained wrote, and a
    model of the config with dummy (random) weights builds and generates: what benchmarks of real shapes use."""
    import tallow
    from tallow.config import ModelConfig
    from tallow.loader.safetensors_loader import SafetensorsCheckpoint
    from tallow.models import checkpoint_names, load_model, num_params

    ckpt = SafetensorsCheckpoint(str(ref.path))
    cfg = ModelConfig.from_pretrained_dir(ref.path)
    assert checkpoint_names(cfg) == {k: tuple(ckpt[k].shape) for k in ckpt}
    assert num_params(cfg) == sum(p.numel() for p in ref.model.parameters()) + sum(
        b.numel() for n, b in ref.model.named_buffers() if n.endswith("e_score_correction_bias"))
    model = load_model(cfg, None, tallow.float32, load_format="dummy", seed=3)
    assert model.layers[1].mlp.experts[0].down_proj.weight.shape == (64, 32)
    tokens, _, _ = run_tallow(str(ref.path), ref.prompts[:2], n_new=4, load_format="dummy")
    assert all(len(t) == 4 for t in tokens)


@pytest.mark.parametrize("change, message", [
    (dict(n_group=3), "n_group=3"),
    (dict(topk_method="best"), "topk_method 'best'"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
])
def test_bad_routing_config_is_a_config_error(change, message):
    from tallow.config import ConfigError, ModelConfig

    d = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
             **{**TINY, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                **change})
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_deepseek_families_are_registered():
    from tallow.models import supported_families

    assert {"deepseek_v2", "deepseek_v3"} <= set(supported_families())
