"""Helpers for the in-situ quantization and `tallow quantize` tests: a random-weight Llama checkpoint whose
rows are whole K-quant blocks, with a byte-level BPE tokenizer (so the written GGUF has a real gpt2
vocabulary), and tallow's first-step logits and greedy tokens for token-id prompts."""
import json
import pathlib

import numpy as np

N_NEW = 16
VOCAB = 384


def write_bpe_tokenizer(path: pathlib.Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE (GPT-2 style) trained on a little text, padded to `vocab_size` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["once upon a time there was a little model that loved to quantize its weights " * 4,
            "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun " * 4]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(text, trainer)
    # the little corpus yields fewer merges than asked: pad with added tokens up to the model's vocabulary
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None,
                                                            "add_bos_token": False}))


def make_llama(path: pathlib.Path, seed: int = 0, arch: str = "llama", **overrides):
    """A random Llama (or Qwen2 with q/k/v biases, Qwen3 with q/k norms and tied embeddings, Mistral) (f32, GQA)
    of K-quant-friendly sizes (hidden 256, MLP 512) saved with a BPE tokenizer; returns the transformers model."""
    import torch
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[arch]
    LlamaConfig, LlamaForCausalLM = getattr(transformers, name + "Config"), getattr(transformers, name + "ForCausalLM")
    if arch == "qwen3":
        overrides = {"tie_word_embeddings": True, **overrides}
    cfg = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
               tie_word_embeddings=False, initializer_range=0.05, eos_token_id=0, bos_token_id=None,
               rope_theta=10000.0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    with torch.no_grad():  # norms away from their constant init, so a missing or misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    write_bpe_tokenizer(path, cfg["vocab_size"])
    return model


def prompts(n: int = 2, length: int = 7, seed: int = 1234) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, length).tolist() for _ in range(n)]


def run(model, prompt_ids, n_new: int = N_NEW, **engine_args):
    """(greedy tokens, first-step logits float64) per prompt for an LLM path (str) or an LLM."""
    import tallow
    from tallow import LLM, SamplingParams

    llm = model if isinstance(model, LLM) else LLM(model, **{**dict(num_kv_blocks=32, block_size=16,
                                                                    max_model_len=128, dtype="float32"),
                                                             **engine_args})
    first = {}
    runner = llm.engine.runner
    forward_step = runner.forward_step

    def spy(step):
        logits, states, plp = forward_step(step)
        if states:
            rows = np.asarray(logits.to(tallow.float32).to("cpu").numpy())
            for st, row in zip(states, rows):
                if st.num_output_tokens == 0:
                    first.setdefault(st.request_id, np.array(row, dtype=np.float64))
        return logits, states, plp

    runner.forward_step = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                            SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True))
    finally:
        runner.forward_step = forward_step
    return [o.outputs[0].token_ids for o in outs], [first[o.request_id] for o in outs], llm


def hf_greedy(model, prompt_ids, n_new: int = N_NEW):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def has_quantize_op() -> bool:
    import tallow

    return hasattr(tallow.ops, "quantize") or hasattr(tallow._core, "quantize")


def numpy_quantize_shim(monkeypatch):
    """Until the build has ops.quantize: gguf-py's reference quantizer (q4_0, q4_1, q5_0, q5_1, q8_0)
    standing in for it, on the CPU (tests only; the package always calls ops.quantize)."""
    import gguf
    import gguf.quants

    import tallow

    def quantize(x, dtype):
        arr = np.asarray(x.to(tallow.float32).numpy(), dtype=np.float32)
        q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType[dtype.name.upper()])
        return tallow.from_buffer(np.ascontiguousarray(q).reshape(-1), dtype, list(arr.shape))

    monkeypatch.setattr(tallow.ops, "quantize", quantize, raising=False)


def forced_agreement(hf_model, prompt_ids, tokens) -> int:
    """Steps at which `tokens` (a greedy continuation of `prompt_ids`) is the float model's own greedy choice
    given the same prefix (teacher forcing: one early near-tie does not count against every later step)."""
    import torch

    seq = list(prompt_ids) + list(tokens)
    with torch.no_grad():
        logits = hf_model(torch.tensor([seq])).logits[0]
    n = len(prompt_ids)
    return sum(int(torch.argmax(logits[n - 1 + i])) == t for i, t in enumerate(tokens))


def prefix_agreement(a, b) -> int:
    """Length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
