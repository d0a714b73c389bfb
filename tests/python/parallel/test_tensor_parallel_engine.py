"""Tensor parallelism on the CPU, end to end through `LLM`: TP=2 (worker processes, the shared-memory
all-reduce) greedy tokens equal TP=1's in f32, 32 tokens per prompt, for random-weight checkpoints of
several families (each exercises a different piece of the sharding: GQA and replicated KV heads, q/k
norms, qkv biases, fused qkv / gate_up tensors, tied and untied heads, final soft-capping, MoE experts
split along their intermediate size with a shared expert); the flags and the start-up errors."""
from __future__ import annotations

import glob

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers (with CPU torch) writes the checkpoints")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers", reason="transformers writes the checkpoints")

from engine_models import write_word_tokenizer  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402

VOCAB, N_NEW = 320, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.08,
              eos_token_id=1, bos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# id: (transformers class, config over COMMON)
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_mqa": ("LlamaForCausalLM", dict(num_key_value_heads=1)),  # one KV head: replicated on both ranks
    "qwen3": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "phi3": ("Phi3ForCausalLM", {}),  # fused qkv_proj and gate_up_proj in the checkpoint
    "gemma2": ("Gemma2ForCausalLM", dict(tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=24,
                                         final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")),
    "glm4": ("Glm4ForCausalLM", dict(attention_bias=True)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=24)),
    "gemma": ("GemmaForCausalLM", dict(hidden_act="gelu")),
    "gemma3": ("Gemma3ForCausalLM", dict(query_pre_attn_scalar=16, sliding_window=24)),
    "stablelm": ("StableLmForCausalLM", dict(use_qkv_bias=True, layer_norm_eps=1e-5)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(MOE, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(MOE, shared_expert_intermediate_size=48, norm_topk_prob=False)),
}
# built only to check that tensor parallelism refuses it clearly
REFUSED = {"stablelm_qk_norm": ("StableLmForCausalLM", dict(qk_layernorm=True, layer_norm_eps=1e-5))}
# one prompt longer than the CPU's prefill chunk (128): a chunked prefill beside decodes
PROMPT_LENS = (5, 17, 40, 150)
ENGINE = dict(dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=256)


def _checkpoint(path, family: str):
    cls, cfg = {**FAMILIES, **REFUSED}[family]
    torch.manual_seed(0)
    config_cls = "Gemma3TextConfig" if cls == "Gemma3ForCausalLM" else cls.replace("ForCausalLM", "Config")
    config = getattr(transformers, config_cls)(**{**COMMON, **cfg})
    model = getattr(transformers, cls)(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and biases away from their constant init, attention sharper
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.empty(p.shape).uniform_(-0.4, 0.4, generator=g))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif "q_proj" in name or "k_proj" in name or "qkv_proj" in name:
                p.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB, eos_id=1)
    return path


def _generate(path, tp: int, prompts, **engine) -> list[list[int]]:
    """Greedy tokens of each prompt (N_NEW, ignore_eos); engine: LLM arguments (default ENGINE)."""
    llm = LLM(weights_dir=str(path), tensor_parallel_size=tp, **(engine or ENGINE))
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()



@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_tokens_equal_tp1(family, tmp_path):
    path = _checkpoint(tmp_path, family)
    rng = np.random.default_rng(1234)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in PROMPT_LENS]
    want = _generate(path, 1, prompts)
    assert sum(len(set(t)) for t in want) > 2 * len(want), f"{family}: a degenerate reference ({want})"
    got = _generate(path, 2, prompts)
    for i, (a, b) in enumerate(zip(got, want)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"{family}: prompt {i} (length {PROMPT_LENS[i]}) diverges from TP=1 at token {at}"
    assert not glob.glob("/dev/shm/tallow_tp_*"), "the shared-memory segment must be unlinked at shutdown"


def test_sizes_the_model_cannot_take_fail_at_start(tmp_path):
    path = _checkpoint(tmp_path, "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        LLM(weights_dir=str(path), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive whole number"):
        LLM(weights_dir=str(path), tensor_parallel_size=0, **ENGINE)
    stablelm = _checkpoint(tmp_path / "stablelm", "stablelm_qk_norm")
    with pytest.raises(ValueError, match=r"per-head q/k LayerNorms \(StableLM\) are not sharded"):
        LLM(weights_dir=str(stablelm), tensor_parallel_size=2, **ENGINE)
    assert not glob.glob("/dev/shm/tallow_tp_*")


def test_logprobs_and_prompt_logprobs_match_tp1(tmp_path):
    """The prompt log-probs pass runs the lm head on every rank (their all-gathers must pair up) and the
    sampled rows' log-probs come from rank 0's gathered logits."""
    path = _checkpoint(tmp_path, "qwen3")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    prompts = [list(range(3, 30)), [7, 8, 9]]
    got = {}
    for tp in (1, 2):
        llm = LLM(weights_dir=str(path), tensor_parallel_size=tp, **ENGINE)
        try:
            got[tp] = llm.generate(prompts, sp, use_tqdm=False)
        finally:
            llm.engine.shutdown()
    for a, b in zip(got[1], got[2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.outputs[0].logprobs) == 8 and len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert all(len(x) >= 2 for x in b.prompt_logprobs[1:])
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)


def test_flags():
    import argparse

    from tallow.engine.arg_parser import FlagError, add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["m", "-tp", "2"])).tensor_parallel_size == 2
    assert engine_args_from(p.parse_args(["m", "--tensor-parallel-size", "4"])).tensor_parallel_size == 4
    assert engine_args_from(p.parse_args(["m"])).tensor_parallel_size == 1
    a = engine_args_from(p.parse_args(["m", "--d", "0,1"]))  # candle-vllm's form: both GPUs, NCCL
    assert (a.device, a.tensor_parallel_size, a.device_ids) == ("cuda:0", 2, (0, 1))
    a = engine_args_from(p.parse_args(["m", "--d", "2,3", "-tp", "2"]))
    assert (a.device, a.tensor_parallel_size, a.device_ids) == ("cuda:2", 2, (2, 3))
    a = engine_args_from(p.parse_args(["m", "--d", "1", "-tp", "2"]))  # two GPUs from 1 on
    assert (a.device, a.tensor_parallel_size, a.device_ids) == ("cuda:1", 2, None)
    from tallow.engine.args import tp_device_ids
    assert tp_device_ids(a) == [1, 2]
    with pytest.raises(FlagError, match="names 2 GPUs but --tensor-parallel-size is 4"):
        engine_args_from(p.parse_args(["m", "--d", "0,1", "-tp", "4"]))
    for bad in ("0,x", "0,0", "-1"):
        with pytest.raises(FlagError, match="GPU indices"):
            engine_args_from(p.parse_args(["m", "--d", bad]))
    with pytest.raises(FlagError, match="--tensor-parallel-size must be at least 1"):
        engine_args_from(p.parse_args(["m", "-tp", "0"]))
