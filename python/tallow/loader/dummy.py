"""Random ("dummy") weights, filled in place into a model built empty on its device (load_format="dummy").

Benchmarks of real shapes need no checkpoint: only config.json. Every parameter is filled where it lies
by ``tallow.ops.fill_uniform_`` (a counter-based hash of (seed, element index), so the values are the
same on every device and depend only on the seed and the checkpoint name the parameter (or its rows)
stands for). The layers say what each parameter is (layers/module.py: Module.dummy_parts): this module
knows no model family and no tensor name.

- linear weights [out, in]: U(-a, a), a = 1 / sqrt(in), so activations stay O(1) through the layers;
- norm weights: U(0.9, 1.1) (U(-0.1, 0.1) for Gemma's (1 + w) norms); biases: U(-0.02, 0.02);
- token embeddings (and an untied lm_head): U(-0.5, 0.5).

Fused layers are seeded under their fused names (qkv_proj, gate_up_proj): the numbers are those of a
checkpoint storing them fused.
"""
from __future__ import annotations

import hashlib
import math

import tallow
from tallow.config import ModelConfig

EMBED_RANGE = 0.5
NORM_RANGE = (0.9, 1.1)
GEMMA_NORM_RANGE = (-0.1, 0.1)  # Gemma RMSNorms multiply by (1 + w)
BIAS_RANGE = 0.02


def tensor_seed(seed: int, name: str) -> int:
    """A 64-bit seed per tensor: stable across runs and Python versions (not hash())."""
    h = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def value_range(kind: str, fan_in: int) -> tuple[float, float]:
    if kind == "linear":
        a = 1.0 / math.sqrt(fan_in)
        return -a, a
    if kind == "norm":
        return NORM_RANGE
    if kind == "gemma_norm":
        return GEMMA_NORM_RANGE
    if kind == "bias":
        return -BIAS_RANGE, BIAS_RANGE
    return -EMBED_RANGE, EMBED_RANGE  # embed


def fill_dummy(model, seed: int = 0) -> dict[str, tuple]:
    """Fill every parameter of `model` (built empty) in place; returns {seed name: (shape, kind)} of what
    was filled."""
    from tallow.layers.module import modules

    filled = {}
    for m in modules(model):
        for view, name, kind, fan_in in m.dummy_parts():
            lo, hi = value_range(kind, fan_in)
            if view.dtype.is_block:  # in-situ quantized (--isq): the float values, quantized in place
                from tallow.layers.quantization.isq import quantize_tensor

                f = tallow.empty(list(view.shape), tallow.float32, str(view.device))
                tallow.ops.fill_uniform_(f, lo, hi, tensor_seed(seed, name))
                view.copy_(quantize_tensor(f, view.dtype, view.device))
            else:
                tallow.ops.fill_uniform_(view, lo, hi, tensor_seed(seed, name))
            filled[name] = (tuple(view.shape), kind)
    return filled


def placeholder_tokenizer(cfg: ModelConfig):
    """A stand-in tokenizer for a config-only model folder (load_format="dummy" without tokenizer files):
    token i is the word "t<i>" (words split on whitespace, joined with spaces on decode), so the engine can
    detokenize and token-id prompts work; the config's eos ids are its eos tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from tallow.tokenizer import Tokenizer

    tk = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    return Tokenizer(tk, bos_token_id=cfg.bos_token_id, eos_token_ids=cfg.eos_token_ids, name="placeholder")

