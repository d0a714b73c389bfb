"""Llama-family decoder (Llama 2/3.x, Yi, Mistral, SmolLM, DeepSeek-R1-Distill-Llama; Qwen2's
qkv bias too): embedding -> N x [rms_norm, attention with RoPE, rms_norm, SwiGLU MLP] -> norm -> lm_head.
q/k/v and gate/up projections are fused into one GEMM each at load time."""
from __future__ import annotations

import numpy as np

import tallow
from tallow import ops
from tallow.layers.attention import AttentionMetadata, PagedAttention
from tallow.layers.rotary import build_cos_sin_cache
from tallow.layers.weights import as_dtype, concat_rows, heads_view, split_last
from tallow.loader.config import ModelConfig


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, w: dict, i: int, dtype):
        p = f"model.layers.{i}."
        self.cfg = cfg
        self.input_norm = as_dtype(w[p + "input_layernorm.weight"], dtype)
        self.post_norm = as_dtype(w[p + "post_attention_layernorm.weight"], dtype)
        q, k, v = (as_dtype(w[p + f"self_attn.{n}_proj.weight"], dtype) for n in "qkv")
        self.qkv = concat_rows([q, k, v])
        self.qkv_bias = None
        if p + "self_attn.q_proj.bias" in w:
            self.qkv_bias = concat_rows([as_dtype(w[p + f"self_attn.{n}_proj.bias"], dtype) for n in "qkv"])
        self.o = as_dtype(w[p + "self_attn.o_proj.weight"], dtype)
        self.o_bias = as_dtype(w[p + "self_attn.o_proj.bias"], dtype) if p + "self_attn.o_proj.bias" in w else None
        self.gate_up = concat_rows([as_dtype(w[p + "mlp.gate_proj.weight"], dtype),
                                    as_dtype(w[p + "mlp.up_proj.weight"], dtype)])
        self.down = as_dtype(w[p + "mlp.down_proj.weight"], dtype)
        d = cfg.head_dim
        self.sizes = [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]
        self.attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.attention_scale,
                                   cfg.sliding_window_for_layer(i), cfg.attn_logit_softcapping)

    def __call__(self, h, residual, positions, cos_sin, kv_cache, meta: AttentionMetadata):
        cfg = self.cfg
        if residual is None:
            residual = h.clone()
            x = ops.rms_norm(h, self.input_norm, cfg.norm_eps)
        else:
            x = ops.fused_add_rms_norm(h, residual, self.input_norm, cfg.norm_eps)
        qkv = ops.linear(x, self.qkv, self.qkv_bias)
        q, k, v = (heads_view(t, n // cfg.head_dim, cfg.head_dim) for t, n in zip(split_last(qkv, self.sizes), self.sizes))
        ops.rotary_embedding(positions, q, k, cos_sin, cfg.rope_neox)
        a = self.attn(q, k, v, kv_cache, meta)
        h = ops.linear(a.view(a.shape[0], -1), self.o, self.o_bias)
        x = ops.fused_add_rms_norm(h, residual, self.post_norm, cfg.norm_eps)
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up)), self.down), residual


class LlamaForCausalLM:
    def __init__(self, cfg: ModelConfig, weights: dict, dtype=tallow.float32, max_positions: int | None = None):
        self.cfg = cfg
        self.dtype = dtype
        embed = weights["model.embed_tokens.weight"]
        # Quantized token tables stay quantized: the embedding op dequantizes the rows it reads.
        self.embed = embed if embed.dtype.is_block else as_dtype(embed, dtype)
        self.layers = [LlamaLayer(cfg, weights, i, dtype) for i in range(cfg.num_hidden_layers)]
        self.norm = as_dtype(weights["model.norm.weight"], dtype)
        head = weights.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = embed
        self.lm_head = as_dtype(head, dtype)
        max_positions = max_positions or cfg.max_position_embeddings
        self.cos_sin = tallow.from_numpy(np.ascontiguousarray(
            build_cos_sin_cache(cfg.rope, cfg.rotary_dim, max_positions)))

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        h = ops.embedding(input_ids, self.embed, self.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, self.cos_sin, cache, meta)
        return ops.fused_add_rms_norm(h, residual, self.norm, self.cfg.norm_eps)

    def compute_logits(self, hidden):
        return ops.linear(hidden, self.lm_head)
