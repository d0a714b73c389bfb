"""Random ("dummy") weights of a model's exact checkpoint shapes, made on the device (load_format="dummy").

Benchmarks of real shapes need no checkpoint: only config.json. Every tensor is allocated on `device`
and filled there by ``tallow.ops.fill_uniform_`` (a counter-based hash of (seed, element index), so the
values are the same on every device and depend only on the seed and the tensor's name):

- linear weights [out, in]: U(-a, a), a = 1 / sqrt(in), so activations stay O(1) through the layers;
- norm weights: U(0.9, 1.1) (U(-0.1, 0.1) for Gemma's (1 + w) norms); biases: U(-0.02, 0.02);
- token embeddings (and an untied lm_head): U(-0.5, 0.5).

Names are the Hugging Face ones the model files look up (layers/decoder.py, self_attention.py, mlp.py,
moe.py), for every family in tallow.models. ``fused=True`` gives q/k/v and gate/up as the fused
``qkv_proj`` / ``gate_up_proj`` tensors the model files also accept, which the builder then uses as they
are instead of concatenating copies (no transient second copy of those weights on the device).
"""
from __future__ import annotations

import hashlib
import math
from typing import Union

import tallow
from tallow.loader.config import ModelConfig

EMBED_RANGE = 0.5
NORM_RANGE = (0.9, 1.1)
GEMMA_NORM_RANGE = (-0.1, 0.1)  # Gemma RMSNorms multiply by (1 + w)
BIAS_RANGE = 0.02


def tensor_seed(seed: int, name: str) -> int:
    """A 64-bit seed per tensor: stable across runs and Python versions (not hash())."""
    h = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def checkpoint_shapes(cfg: ModelConfig, fused: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """{Hugging Face name: (shape, kind)} of a checkpoint of `cfg`; kind is one of "embed", "linear",
    "norm", "bias" (it picks the value range)."""
    from tallow.models import model_class

    cls = model_class(cfg.family)  # norm names and conventions of the family's model file
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layer_norm = cfg.norm_type == "layer_norm"
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def norm(name: str, size: int = h) -> None:
        out[name + ".weight"] = ((size,), "norm")
        if layer_norm:
            out[name + ".bias"] = ((size,), "bias")

    def linear(name: str, n_out: int, n_in: int, bias: bool = False) -> None:
        out[name + ".weight"] = ((n_out, n_in), "linear")
        if bias:
            out[name + ".bias"] = ((n_out,), "bias")

    def gated_mlp(p: str, inter: int, bias: bool = False) -> None:
        if fused or cfg.family in ("phi3", "glm4"):  # checkpoints of these families store gate_up fused
            linear(p + "gate_up_proj", 2 * inter, h, bias)
        else:
            linear(p + "gate_proj", inter, h, bias)
            linear(p + "up_proj", inter, h, bias)
        linear(p + "down_proj", h, inter, bias)

    out["model.embed_tokens.weight"] = ((cfg.vocab_size, h), "embed")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for attr in ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"):
            name = getattr(cls, attr, None)
            if name is None or (attr == "mlp_norm" and cfg.use_parallel_residual):
                continue
            norm(p + name)
        a = p + "self_attn."
        if fused or cfg.family == "phi3":
            linear(a + "qkv_proj", (nq + 2 * nkv) * d, h, cfg.qkv_bias)
        else:
            linear(a + "q_proj", nq * d, h, cfg.qkv_bias)
            linear(a + "k_proj", nkv * d, h, cfg.qkv_bias)
            linear(a + "v_proj", nkv * d, h, cfg.qkv_bias)
        linear(a + "o_proj", h, nq * d, cfg.o_bias)
        if cfg.qk_norm:
            if cfg.family == "stablelm":  # per-head LayerNorms without bias
                for which, n in (("q_layernorm", nq), ("k_layernorm", nkv)):
                    for j in range(n):
                        out[f"{a}{which}.norms.{j}.weight"] = ((d,), "norm")
            else:
                out[a + "q_norm.weight"] = ((d,), "norm")
                out[a + "k_norm.weight"] = ((d,), "norm")
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            inter = cfg.moe_intermediate_size or cfg.intermediate_size
            linear(m + "gate", cfg.num_experts, h)
            for e in range(cfg.num_experts):
                gated_mlp(f"{m}experts.{e}.", inter)
            if cfg.shared_expert_intermediate_size:
                gated_mlp(m + "shared_expert.", cfg.shared_expert_intermediate_size)
                linear(m + "shared_expert_gate", 1, h)
        else:
            gated_mlp(m, cfg.intermediate_size, cfg.mlp_bias)
    norm("model.norm")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, h), "embed")
    return out


def dummy_weights(cfg: ModelConfig, dtype: Union[str, "tallow.DType"], device: str = "cpu", seed: int = 0,
                  fused: bool = False) -> dict[str, tallow.Tensor]:
    """Random weights of a checkpoint of `cfg` as {Hugging Face name: Tensor of `dtype` on `device`}.
    Tied embeddings: no lm_head.weight (the model reuses the embedding table)."""
    if isinstance(dtype, str):
        dtype = tallow._core.dtype(dtype)
    from tallow.models import model_class

    norm_lo, norm_hi = GEMMA_NORM_RANGE if getattr(model_class(cfg.family), "gemma_norms", False) else NORM_RANGE
    weights: dict[str, tallow.Tensor] = {}
    for name, (shape, kind) in checkpoint_shapes(cfg, fused).items():
        if kind == "linear":
            a = 1.0 / math.sqrt(shape[1])
            lo, hi = -a, a
        elif kind == "norm":
            lo, hi = norm_lo, norm_hi
        elif kind == "bias":
            lo, hi = -BIAS_RANGE, BIAS_RANGE
        else:
            lo, hi = -EMBED_RANGE, EMBED_RANGE
        # StableLM's per-head q/k norms are stacked with numpy by the model builder: keep them on the host.
        dev = "cpu" if ".norms." in name else device
        t = tallow.empty(list(shape), dtype, dev)
        tallow.ops.fill_uniform_(t, lo, hi, tensor_seed(seed, name))
        weights[name] = t
    return weights


def num_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameters of a checkpoint of `cfg` (benchmarks: the weights a decode step reads are those without
    the token embedding table, of which it reads one row per token)."""
    return sum(math.prod(shape) for name, (shape, _kind) in checkpoint_shapes(cfg).items()
               if include_embedding or name != "model.embed_tokens.weight")


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

