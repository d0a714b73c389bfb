"""A generic pre-norm decoder-only transformer; each model file in tallow/models picks its options.

    h = embed(ids) [* sqrt(hidden)]
    for each layer:
        a = attn(attn_norm(h))            [a = attn_post_norm(a)]          Gemma 2/3, GLM-4
        parallel residual (StableLM):  h = h + a + mlp(attn_norm(h))
        else:                          h = h + a;  m = mlp(mlp_norm(h))  [m = mlp_post_norm(m)];  h = h + m
    logits = lm_head(norm(h))             [cap * tanh(logits / cap)]      Gemma 2 (final soft-capping)

The residual stream is carried as (delta, residual) so an RMSNorm adds and normalises in one kernel.
Weights are looked up under Hugging Face names (GGUF files arrive renamed by the loader); a multimodal
checkpoint's language model is found under its prefixes (layers/names.py).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np

import tallow
from tallow import ops
from tallow.layers.attention import AttentionMetadata
from tallow.layers.mlp import GatedMLP
from tallow.layers.names import require, text_weights
from tallow.layers.norm import RMSNorm, make_norm
from tallow.layers.rotary import build_cos_sin_cache, llama4_attn_scale
from tallow.layers.self_attention import SelfAttention, StepContext
from tallow.layers.weights import as_dtype
from tallow.loader.config import ModelConfig, RopeConfig


# With TALLOW_IN_PLACE_DECODE=1, steps of at most this many tokens (decode) carry the residual stream as
# one tensor updated in place (DecoderLayer.in_place): norms folded into the next projection, adds into
# the previous one (ops.rms_norm_linear takes up to 8 rows in one GEMV on CUDA). Opt-in: on an H100 the
# Llama-3-8B batch-1 decode ran at 149 tok/s with it and 162 without (every CTA of a multi-wave GEMV
# pays the norm's reduction before streaming weights).
IN_PLACE_MAX_TOKENS = 8


def _in_place_enabled() -> bool:
    return os.environ.get("TALLOW_IN_PLACE_DECODE", "0") == "1"


class DecoderLayer:
    def __init__(self, attn: SelfAttention, mlp: GatedMLP, attn_norm, mlp_norm=None, attn_post_norm=None,
                 mlp_post_norm=None, parallel_residual: bool = False):
        self.attn, self.mlp = attn, mlp
        self.attn_norm, self.mlp_norm = attn_norm, mlp_norm
        self.attn_post_norm, self.mlp_post_norm = attn_post_norm, mlp_post_norm
        self.parallel_residual = parallel_residual

    @property
    def in_place_ok(self) -> bool:
        """Whether in_place() applies: RMSNorm pre-norms, a dense gated MLP, no post norms or parallel
        residual."""
        return (isinstance(self.attn_norm, RMSNorm) and isinstance(self.mlp_norm, RMSNorm)
                and isinstance(self.mlp, GatedMLP) and self.attn_post_norm is None and self.mlp_post_norm is None
                and not self.parallel_residual)

    def in_place(self, h, kv_cache, ctx: StepContext):
        """h += attn(attn_norm(h)); h += mlp(mlp_norm(h)), updating the stream h in place, with each
        norm folded into the projection after it and each add into the one before it (decode steps
        on CUDA: one GEMV each, no norm or add kernels). The same values as __call__'s stream."""
        self.attn(h, kv_cache, ctx, norm=self.attn_norm, residual=h)
        self.mlp(h, norm=self.mlp_norm, residual=h)
        return h

    def __call__(self, h, residual, kv_cache, ctx: StepContext):
        """(delta, residual) in -> (delta, residual) out; the stream's value is residual + delta.
        Layer 0 gets residual None and h = the embeddings."""
        if residual is None:
            residual = h.clone()
            x = self.attn_norm(h)
        else:
            x, residual = self.attn_norm.add_norm(h, residual)
        a = self.attn(x, kv_cache, ctx)
        if self.parallel_residual:
            return ops.add(a, self.mlp(x)), residual
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        x, residual = self.mlp_norm.add_norm(a, residual)
        m = self.mlp(x)
        if self.mlp_post_norm is not None:
            m = self.mlp_post_norm(m)
        return m, residual


class RopeCaches:
    """One cos/sin cache per distinct RoPE of the model (Gemma 3: local and global), referred to by
    index (layers hold the index, not the tensor, so moving the model to a device moves each cache once).

    LongRoPE (Phi-3) switches from the short to the long factors once a sequence is longer than
    original_max_position_embeddings (transformers picks by the current length). When the context
    allows that, the cache holds both tables, short rows then long rows, and each step indexes the long
    half for the tokens of sequences whose length after the step exceeds the original context. (Keys
    cached before a sequence crosses that length keep their short-factor rotation; transformers
    instead recomputes the whole sequence at the crossing.)"""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        self.max_positions = int(max_positions)
        self.rotary_dim = cfg.rotary_dim
        self.caches: list[tallow.Tensor] = []
        self.long_after: list[Optional[int]] = []  # per cache: LongRoPE's original context, when switching
        self._index: dict[RopeConfig, int] = {}

    def index(self, rope: RopeConfig) -> int:
        """The index of `rope`'s cache (built on first use)."""
        i = self._index.get(rope)
        if i is None:
            n = self.max_positions
            orig = rope.original_max_position_embeddings
            switching = rope.type == "longrope" and n > orig
            if switching:
                table = np.concatenate([build_cos_sin_cache(rope, self.rotary_dim, n, seq_len=orig),
                                        build_cos_sin_cache(rope, self.rotary_dim, n, seq_len=n)])
            else:
                table = build_cos_sin_cache(rope, self.rotary_dim, n)
            i = self._index[rope] = len(self.caches)
            self.caches.append(tallow.from_numpy(np.ascontiguousarray(table)))
            self.long_after.append(orig if switching else None)
        return i

    def for_step(self, positions: tallow.Tensor, meta: AttentionMetadata) -> list[tuple]:
        """(cache, row of each token in it) per cache index, for this step."""
        out = []
        for cache, orig in zip(self.caches, self.long_after):
            rows = positions
            if orig is not None:
                seq_lens = _host(meta.seq_lens).astype(np.int64)
                counts = np.diff(_host(meta.query_start_loc).astype(np.int64))
                long_tok = np.repeat(seq_lens > orig, counts)
                rows = tallow.from_numpy(np.ascontiguousarray(_host(positions).astype(np.int64)
                                                              + long_tok * self.max_positions))
                if positions.device != "cpu":
                    rows = rows.to(positions.device)
            out.append((cache, rows))
        return out


def _host(t: tallow.Tensor) -> np.ndarray:
    return np.asarray((t if t.device == "cpu" else t.to("cpu")).numpy())


class DecoderForCausalLM:
    """Base of the dense model files. Subclasses set the class attributes below (Hugging Face norm names
    under model.layers.N.; None where the family has no such norm) and may override `qk_norm_kind`."""

    attn_norm = "input_layernorm"
    attn_post_norm: Optional[str] = None
    mlp_norm = "post_attention_layernorm"
    mlp_post_norm: Optional[str] = None
    gemma_norms = False  # RMSNorms multiply by (1 + w)
    embed_scale = False  # embeddings * sqrt(hidden_size)

    def __init__(self, cfg: ModelConfig, weights: dict, dtype=tallow.float32, max_positions: Optional[int] = None):
        self.cfg = cfg
        self.dtype = dtype
        w = text_weights(weights)
        embed = require(w, "model.embed_tokens.weight")
        # Quantized token tables stay quantized: the embedding op dequantizes the rows it reads.
        self.embed = embed if embed.dtype.is_block else as_dtype(embed, dtype)
        self.embed_multiplier = None
        if self.embed_scale:  # transformers rounds sqrt(hidden) to the model dtype first
            s = tallow.tensor(np.array([math.sqrt(cfg.hidden_size)], np.float32), dtype=dtype)
            self.embed_multiplier = float(np.asarray(s.to(tallow.float32).numpy())[0])

        max_positions = int(max_positions or cfg.max_position_embeddings)
        self.rope_caches = RopeCaches(cfg, max_positions)
        self.q_scale_table = None
        beta = cfg.rope.llama_4_scaling_beta
        if beta:
            orig = cfg.rope.original_max_position_embeddings or cfg.max_position_embeddings
            table = llama4_attn_scale(np.arange(max_positions), beta, orig).reshape(-1, 1)
            self.q_scale_table = as_dtype(tallow.from_numpy(np.ascontiguousarray(table)), dtype)

        self.layers = [self.make_layer(w, i) for i in range(cfg.num_hidden_layers)]
        self.norm = self.make_norm(w, "model.norm")
        head = w.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = embed
        self.lm_head = as_dtype(head, dtype)
        self.lm_head_bias = as_dtype(w["lm_head.bias"], dtype) if "lm_head.bias" in w else None

    # -- building ---------------------------------------------------------------------------------
    @property
    def norm_kind(self) -> str:
        if self.cfg.norm_type == "layer_norm":
            return "layer_norm"
        return "gemma_rms_norm" if self.gemma_norms else "rms_norm"

    def qk_norm_kind(self) -> Optional[str]:
        return self.norm_kind if self.cfg.qk_norm else None

    def make_norm(self, w: dict, name: str):
        return make_norm(self.norm_kind, require(w, name + ".weight"), self.cfg.norm_eps, self.dtype,
                         w.get(name + ".bias"))

    def make_layer(self, w: dict, i: int) -> DecoderLayer:
        cfg, p = self.cfg, f"model.layers.{i}."
        rope = self.rope_caches.index(cfg.rope_for_layer(i))
        attn = SelfAttention(cfg, w, p + "self_attn.", i, self.dtype, rope, self.qk_norm_kind())
        mlp = GatedMLP.from_weights(w, p + "mlp.", self.dtype, cfg.hidden_act)
        parallel = cfg.use_parallel_residual

        def norm(name):
            return None if name is None else self.make_norm(w, p + name)

        return DecoderLayer(attn, mlp, norm(self.attn_norm), None if parallel else norm(self.mlp_norm),
                            norm(self.attn_post_norm), norm(self.mlp_post_norm), parallel)

    # -- running ----------------------------------------------------------------------------------
    def forward(self, input_ids: tallow.Tensor, positions: tallow.Tensor, kv_caches, meta: AttentionMetadata):
        h = ops.embedding(input_ids, self.embed, self.dtype)
        if self.embed_multiplier is not None:
            h = ops.scale(h, self.embed_multiplier)
        q_scale = None
        if self.q_scale_table is not None:
            q_scale = ops.embedding(positions, self.q_scale_table)
            q_scale = q_scale.view(q_scale.shape[0], 1, 1)
        ctx = StepContext(positions, meta, self.rope_caches.for_step(positions, meta), q_scale)
        if h.shape[0] <= IN_PLACE_MAX_TOKENS and self.layers and all(layer.in_place_ok for layer in self.layers) \
                and _in_place_enabled():
            for layer, cache in zip(self.layers, kv_caches):
                layer.in_place(h, cache, ctx)
            return self.norm(h)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, cache, ctx)
        if residual is None:  # no layers
            return self.norm(h)
        return self.norm.add_norm(h, residual)[0]

    def compute_logits(self, hidden: tallow.Tensor) -> tallow.Tensor:
        logits = ops.linear(hidden, self.lm_head, self.lm_head_bias)
        cap = self.cfg.final_logit_softcapping
        if cap:
            # No tanh kernel yet: soft-cap on the host (the runner copies logits there anyway), and hand the
            # result back on the logits' device.
            arr = _host(logits if logits.dtype == tallow.float32 else logits.to(tallow.float32))
            capped = tallow.from_numpy(np.ascontiguousarray(np.tanh(arr / np.float32(cap)) * np.float32(cap)))
            logits = capped if logits.device == "cpu" else capped.to(logits.device)
        return logits
