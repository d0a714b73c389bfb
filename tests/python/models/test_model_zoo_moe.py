"""The MoE families (Qwen2-MoE, Qwen3-MoE) against transformers, token for token (issue 5).

Same checks as test_model_zoo.py (whose helpers this file reuses): a tiny random-weight model built and
saved with transformers; tallow (f32, through `LLM`) must give transformers' greedy continuation for a
batch of prompts and first-step logits within 1e-4. Cases cover the router with and without
norm_topk_prob, Qwen2-MoE's sigmoid-gated shared expert, decoder_sparse_step / mlp_only_layers (dense
layers between sparse ones), and skewed routing: router rows c_e * u (+ small noise) send every token to
the experts with the largest |c_e|, so the middle experts get no tokens and the outer ones most of them
(checked on the model tallow runs). The all-sparse cases are also written to GGUF (experts stacked into
ffn_{gate,up,down}_exps as convert_hf_to_gguf does) in F32 and with every matrix in Q8_0, the latter
against transformers on the dequantized weights.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers (with CPU torch) is the reference model")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers", reason="transformers is the reference model")
gguf = pytest.importorskip("gguf", reason="the gguf package writes the GGUF checkpoints")

import test_model_zoo as zoo  # noqa: E402
from test_model_zoo import COMMON, Case, check, hf_first_logits, hf_greedy, run_tallow  # noqa: E402

Q = gguf.GGMLQuantizationType
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclasses.dataclass
class MoeCase(Case):
    skew: bool = False


MOE_CASES = [
    MoeCase("qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM",
            dict(MOE, shared_expert_intermediate_size=48, norm_topk_prob=False), gguf_arch="qwen2moe",
            features="softmax top-k router without renormalisation, shared expert with sigmoid gate, qkv bias",
            examples="Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B"),
    MoeCase("qwen2_moe_sparse_step", "qwen2_moe", "Qwen2MoeForCausalLM",
            dict(MOE, shared_expert_intermediate_size=48, norm_topk_prob=True, num_hidden_layers=4,
                 decoder_sparse_step=2, mlp_only_layers=[3]),
            features="decoder_sparse_step = 2 and mlp_only_layers (dense layers between sparse ones), "
                     "norm_topk_prob"),
    MoeCase("qwen2_moe_skewed", "qwen2_moe", "Qwen2MoeForCausalLM",
            dict(MOE, shared_expert_intermediate_size=48, norm_topk_prob=False), gguf_arch="qwen2moe", skew=True,
            features="skewed routing (empty and overloaded experts)"),
    MoeCase("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", dict(MOE, norm_topk_prob=True), gguf_arch="qwen3moe",
            features="softmax top-k router with renormalisation (norm_topk_prob), q/k RMSNorm, no shared expert",
            examples="Qwen3-30B-A3B, Qwen3-235B-A22B"),
    MoeCase("qwen3_moe_mlp_only", "qwen3_moe", "Qwen3MoeForCausalLM",
            dict(MOE, norm_topk_prob=False, num_hidden_layers=3, mlp_only_layers=[0]),
            features="mlp_only_layers, no renormalisation"),
    MoeCase("qwen3_moe_skewed", "qwen3_moe", "Qwen3MoeForCausalLM", dict(MOE, norm_topk_prob=True),
            gguf_arch="qwen3moe", skew=True, features="skewed routing (empty and overloaded experts)"),
]
CASES = {c.id: c for c in MOE_CASES}
SKEW_C = np.array([5.0, 4.0, 0.3, 0.2, -0.2, -0.3, -4.0, -5.0])  # experts 2..5 starve, 0/1 and 6/7 overload



def _skew(model, seed: int):
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "weight") or gate.weight.shape[0] != len(SKEW_C):
                continue
            u = torch.randn(gate.weight.shape[1], generator=g)
            noise = torch.randn(gate.weight.shape, generator=g) * 0.01
            gate.weight.copy_(torch.tensor(SKEW_C, dtype=torch.float32)[:, None] * u[None, :] + noise)


_REFS: dict[str, zoo.Ref] = {}


@pytest.fixture
def ref(request, tmp_path_factory):
    case = CASES[request.param]
    if case.id not in _REFS:
        torch.manual_seed(0)
        cfg = getattr(transformers, case.hf_class.replace("ForCausalLM", "Config"))(**{**COMMON, **case.config})
        model = getattr(transformers, case.hf_class)(cfg).float().eval()
        zoo._randomise(model, 0)
        if case.skew:
            _skew(model, 0)
        _REFS[case.id] = zoo.reference(case, model, tmp_path_factory)
    return _REFS[case.id]


def _moe_blocks(llm):
    from tallow.layers.moe import SparseMoE

    return [(i, layer.mlp) for i, layer in enumerate(llm.engine.runner.model.layers)
            if isinstance(layer.mlp, SparseMoE)]


@pytest.mark.parametrize("ref", list(CASES), indirect=True)
def test_safetensors_matches_transformers(ref):
    tokens, logits, llm = run_tallow(str(ref.path), ref.prompts)
    cfg = llm.engine.config
    assert cfg.family == ref.case.family
    sparse = [i for i, _ in _moe_blocks(llm)]
    assert sparse == [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)] and sparse
    check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} (safetensors)")


@pytest.mark.parametrize("ref", [c.id for c in MOE_CASES if c.skew], indirect=True)
def test_skewed_routing_starves_and_overloads_experts(ref):
    """The skewed cases really are skewed in the router tallow loaded: a batch of random rows through each
    sparse block leaves the middle experts (nearly) empty and puts most assignments on the outer ones."""
    _, _, llm = run_tallow(str(ref.path), ref.prompts[-1:], n_new=1)
    t = len(ref.prompts[-1])
    from tallow import from_numpy
    from tallow.layers.moe import route

    rng = np.random.default_rng(0)
    x = from_numpy(rng.standard_normal((t, COMMON["hidden_size"])).astype(np.float32))
    for i, moe in _moe_blocks(llm):
        moe(x)
        counts = moe.last_counts
        k = moe.top_k
        assert counts.sum() == t * k
        assert (counts[2:6] <= 1).all() and (counts == 0).sum() >= 3, f"layer {i}: {counts.tolist()}"
        assert counts.max() >= t * k // 4, f"layer {i}: {counts.tolist()}"
        logits = np.asarray(moe.router(x).numpy())[:, :moe.num_experts]
        w, ids = route(logits, k, moe.norm_topk_prob)
        assert np.array_equal(np.bincount(ids.reshape(-1), minlength=moe.num_experts), counts)


# -- GGUF ----------------------------------------------------------------------------------------------
def _stack_experts(sd: dict, n_layers: int, n_exp: int) -> dict:
    sd = dict(sd)
    for i in range(n_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(n_exp)]
            if names[0] in sd:
                sd[f"model.layers.{i}.mlp.experts.{proj}.weight"] = np.stack([sd.pop(n) for n in names])
    return sd


def _q8(name: str, arr: np.ndarray) -> bool:  # stacked experts are 3-D
    return arr.ndim in (2, 3) and arr.shape[-1] % 32 == 0 and "norm" not in name


def _write(ref, sd, path, quantize, monkeypatch):
    c = ref.model.config
    base = gguf.GGUFWriter

    class MoeWriter(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.add_expert_count(c.num_experts)
            self.add_expert_used_count(c.num_experts_per_tok)
            self.add_expert_feed_forward_length(c.moe_intermediate_size)
            if getattr(c, "shared_expert_intermediate_size", None):
                self.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
            if ref.case.gguf_arch == "qwen3moe":
                self.add_expert_weights_norm(bool(c.norm_topk_prob))

    monkeypatch.setattr(gguf, "GGUFWriter", MoeWriter)
    monkeypatch.setattr(zoo, "q8_weight", _q8)
    zoo.write_gguf(ref.case, c, _stack_experts(sd, c.num_hidden_layers, c.num_experts), path, quantize=quantize)


GGUF_CASES = [c.id for c in MOE_CASES if c.gguf_arch]
Q8_CASES = [c.id for c in MOE_CASES if c.gguf_arch and not c.skew]  # (time: skew is covered in F32)


def _hf_layout(sd: dict, model) -> dict:
    """Per-expert checkpoint names -> the module's own layout (transformers 5 holds experts as fused 3-D
    gate_up_proj / down_proj parameters; older versions keep per-expert Linear weights)."""
    own = model.state_dict()
    if not any(k.endswith("mlp.experts.gate_up_proj") for k in own):
        return sd
    sd, n_exp = dict(sd), model.config.num_experts
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in sd:
            continue
        sd[p + "gate_up_proj"] = np.stack([np.concatenate([sd.pop(f"{p}{e}.gate_proj.weight"),
                                                           sd.pop(f"{p}{e}.up_proj.weight")]) for e in range(n_exp)])
        sd[p + "down_proj"] = np.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(n_exp)])
    return sd


@pytest.mark.parametrize("ref", GGUF_CASES, indirect=True)
def test_gguf_f32_matches_transformers(ref, tmp_path, monkeypatch):
    path = tmp_path / f"{ref.case.id}.gguf"
    _write(ref, zoo._state_dict(ref.path), path, False, monkeypatch)
    tokens, logits, llm = run_tallow(str(path), ref.prompts)
    assert llm.engine.source.kind == "gguf" and llm.engine.config.family == ref.case.family
    assert llm.engine.config.norm_topk_prob == ref.model.config.norm_topk_prob
    check(tokens, logits, ref.tokens, ref.logits, f"{ref.case.id} (GGUF F32)")


@pytest.mark.parametrize("ref", Q8_CASES, indirect=True)
def test_gguf_q8_0_matches_dequantized_reference(ref, tmp_path, monkeypatch):
    sd = zoo._state_dict(ref.path)
    path = tmp_path / f"{ref.case.id}-q8_0.gguf"
    _write(ref, sd, path, True, monkeypatch)
    deq = {k: gguf.quants.dequantize(gguf.quants.quantize(v, Q.Q8_0), Q.Q8_0) if _q8(k, v) else v
           for k, v in sd.items()}
    model = getattr(transformers, ref.case.hf_class)(ref.model.config).float().eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                                                 for k, v in _hf_layout(deq, model).items()}, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    assert any("experts.0" in k and not np.array_equal(deq[k], sd[k]) for k in sd), "experts were not quantized"
    ref_tokens = [hf_greedy(model, p) for p in ref.prompts]
    ref_logits = [hf_first_logits(model, p) for p in ref.prompts]
    tokens, logits, _ = run_tallow(str(path), ref.prompts)
    zoo.check_q8_activations(tokens, logits, ref_tokens, ref_logits, f"{ref.case.id} (GGUF Q8_0)")


def test_moe_families_are_registered():
    from tallow.models import supported_families

    assert {"qwen2_moe", "qwen3_moe"} <= set(supported_families())
