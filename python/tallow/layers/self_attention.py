"""The self-attention block of a decoder layer: fused qkv projection (+ bias), optional per-head q/k norm,
RoPE (full or partial, NeoX or interleaved pairs) in place, optional per-position query scaling
(Ministral 3 / Llama 4), paged attention (sliding window, logit soft-capping) and the output projection."""
from __future__ import annotations

import dataclasses
from typing import Optional

import tallow
from tallow import ops
from tallow.layers.attention import AttentionMetadata, PagedAttention
from tallow.layers.names import require
from tallow.layers.norm import LayerNorm, RMSNorm, stack_rows
from tallow.layers.weights import as_dtype, concat_rows, heads_view, split_last
from tallow.loader.config import ModelConfig


@dataclasses.dataclass
class StepContext:
    """What every layer of one forward step shares besides the hidden states."""
    positions: tallow.Tensor  # i64 [T]: token positions
    meta: AttentionMetadata
    rope: list  # per RoPE cache index: (cos/sin cache, row of each token in it (usually `positions`))
    q_scale: Optional[tallow.Tensor] = None  # [T, 1, 1] per-token query multiplier (llama4 scaling)


class SelfAttention:
    """Weights under `prefix` (e.g. "model.layers.3.self_attn."): q_proj/k_proj/v_proj or a fused qkv_proj
    (Phi-3), with biases where present; o_proj (+ bias).

    qk_norm: None, "rms_norm" (q_norm/k_norm [head_dim], Qwen3), "gemma_rms_norm" (the same with (1 + w),
    Gemma 3) or "layer_norm" (StableLM's per-head LayerNorms q_layernorm.norms.{h} without bias)."""

    def __init__(self, cfg: ModelConfig, w: dict, prefix: str, layer: int, dtype, rope_index: int = 0,
                 qk_norm: Optional[str] = None):
        self.cfg = cfg
        self.rope_index = rope_index  # which of the step's RoPE caches (StepContext.rope) this layer uses
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]

        def get(name):
            t = w.get(prefix + name)
            return None if t is None else as_dtype(t, dtype)

        if prefix + "qkv_proj.weight" in w:
            self.qkv, self.qkv_bias = get("qkv_proj.weight"), get("qkv_proj.bias")
        else:
            self.qkv = concat_rows([as_dtype(require(w, prefix + f"{n}_proj.weight"), dtype) for n in "qkv"])
            biases = [get(f"{n}_proj.bias") for n in "qkv"]
            self.qkv_bias = concat_rows(biases) if all(b is not None for b in biases) else None
        if self.qkv.shape[0] != sum(self.sizes):
            raise ValueError(f"{prefix}: qkv projection has {self.qkv.shape[0]} rows, the config needs "
                             f"{sum(self.sizes)} ({self.num_heads} + 2 x {self.num_kv_heads} heads of {d})")
        self.o = as_dtype(require(w, prefix + "o_proj.weight"), dtype)
        self.o_bias = get("o_proj.bias")

        self.q_norm = self.k_norm = None
        if qk_norm in ("rms_norm", "gemma_rms_norm"):
            gemma = qk_norm == "gemma_rms_norm"
            self.q_norm = RMSNorm(as_dtype(require(w, prefix + "q_norm.weight"), dtype), cfg.norm_eps, gemma)
            self.k_norm = RMSNorm(as_dtype(require(w, prefix + "k_norm.weight"), dtype), cfg.norm_eps, gemma)
        elif qk_norm == "layer_norm":
            def per_head(name, n):
                return LayerNorm(stack_rows([require(w, prefix + f"{name}.norms.{h}.weight") for h in range(n)],
                                            dtype), None, cfg.norm_eps)
            self.q_norm = per_head("q_layernorm", self.num_heads)
            self.k_norm = per_head("k_layernorm", self.num_kv_heads)
        elif qk_norm is not None:
            raise ValueError(f"unknown qk_norm {qk_norm!r}")

        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, cfg.attention_scale,
                                   cfg.sliding_window_for_layer(layer), cfg.attn_logit_softcapping)

    def __call__(self, x: tallow.Tensor, kv_cache, ctx: StepContext, norm: Optional[RMSNorm] = None,
                 residual: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        """attention(x) through o_proj. With `norm`, x is normalised first (folded into the qkv
        projection); with `residual`, the output is added to it in place (folded into o_proj) and
        residual is returned."""
        qkv = norm.linear(x, self.qkv, self.qkv_bias) if norm is not None else ops.linear(x, self.qkv, self.qkv_bias)
        d = self.head_dim
        q, k, v = (heads_view(t, n // d, d) for t, n in zip(split_last(qkv, self.sizes), self.sizes))
        cos_sin, rows = ctx.rope[self.rope_index]
        if ctx.q_scale is None and (self.q_norm is None or isinstance(self.q_norm, RMSNorm)):
            # Per-head RMSNorm (Qwen3, Gemma 3), RoPE and the cache write: one op (one kernel on CUDA),
            # q and k normed and rotated in place inside qkv.
            qn, kn = self.q_norm, self.k_norm
            a = self.attn.rope_and_attend(rows, q, k, v, cos_sin, self.cfg.rope_neox, kv_cache, ctx.meta,
                                          qn.w if qn else None, kn.w if kn else None,
                                          qn.eps if qn else 1e-6, bool(qn and qn.gemma_offset))
        else:  # StableLM's per-head LayerNorm, Llama 4 / Ministral 3 query scaling: the separate ops
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            ops.rotary_embedding(rows, q, k, cos_sin, self.cfg.rope_neox)
            if ctx.q_scale is not None:
                q = ops.mul(q, ctx.q_scale)
            a = self.attn(q, k, v, kv_cache, ctx.meta)
        a = a.view(a.shape[0], -1)
        if residual is not None:
            return ops.linear_add(a, self.o, self.o_bias, residual)
        return ops.linear(a, self.o, self.o_bias)
