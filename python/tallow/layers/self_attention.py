"""The self-attention block of a decoder layer: fused qkv projection (+ bias), optional per-head q/k norm,
RoPE (full or partial, NeoX or interleaved pairs) in place, optional per-position query scaling
(Ministral 3 / Llama 4), paged attention (sliding window, logit soft-capping) and the output projection."""
from __future__ import annotations

import dataclasses
from typing import Optional

import tallow
from tallow import ops
from tallow.config import ModelConfig
from tallow.layers.attention import AttentionMetadata, PagedAttention
from tallow.layers.linear import QKVParallelLinear, RowParallelLinear
from tallow.layers.norm import LayerNorm, RMSNorm
from tallow.layers.weights import heads_view, split_last


@dataclasses.dataclass
class StepContext:
    """What every layer of one forward step shares besides the hidden states."""
    positions: tallow.Tensor  # i64 [T]: token positions
    meta: AttentionMetadata
    rope: list  # per RoPE cache index: (cos/sin cache, row of each token in it (usually `positions`))
    q_scale: Optional[tallow.Tensor] = None  # [T, 1, 1] per-token query multiplier (llama4 scaling)


class SelfAttention:
    """Layers under `prefix` (e.g. "model.layers.3.self_attn."): qkv_proj (a QKVParallelLinear loading
    q_proj/k_proj/v_proj, or a fused qkv_proj as Phi-3 stores it; biases when cfg.qkv_bias), o_proj
    (+ bias when cfg.o_bias).

    qk_norm: None, "rms_norm" (q_norm/k_norm [head_dim], Qwen3), "gemma_rms_norm" (the same with (1 + w),
    Gemma 3) or "layer_norm" (StableLM's per-head LayerNorms q_layernorm.norms.{h} without bias)."""

    def __init__(self, cfg: ModelConfig, prefix: str, layer: int, dtype, device: str = "cpu", quant_config=None,
                 rope_index: int = 0, qk_norm: Optional[str] = None, tp_rank: int = 0, tp_size: int = 1):
        self.cfg = cfg
        self.rope_index = rope_index  # which of the step's RoPE caches (StepContext.rope) this layer uses
        d = cfg.head_dim
        common = dict(dtype=dtype, device=device, quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.qkv_bias, prefix=prefix + "qkv_proj",
                                          part_names=[prefix + f"{n}_proj" for n in "qkv"], **common)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.sizes = list(self.qkv_proj.output_partition_sizes)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, cfg.o_bias,
                                        prefix=prefix + "o_proj", **common)

        self.q_norm = self.k_norm = None
        norm_args = dict(dtype=dtype, device=device)
        if qk_norm in ("rms_norm", "gemma_rms_norm"):
            gemma = qk_norm == "gemma_rms_norm"
            self.q_norm = RMSNorm(d, cfg.norm_eps, gemma, prefix=prefix + "q_norm", **norm_args)
            self.k_norm = RMSNorm(d, cfg.norm_eps, gemma, prefix=prefix + "k_norm", **norm_args)
        elif qk_norm == "layer_norm":
            if tp_size > 1:
                raise ValueError("per-head q/k LayerNorms (StableLM) are not sharded for tensor parallelism yet; "
                                 "run this model with tensor_parallel_size 1")
            self.q_norm = LayerNorm(d, cfg.norm_eps, False, num_heads=cfg.num_attention_heads,
                                    prefix=prefix + "q_layernorm", **norm_args)
            self.k_norm = LayerNorm(d, cfg.norm_eps, False, num_heads=cfg.num_key_value_heads,
                                    prefix=prefix + "k_layernorm", **norm_args)
        elif qk_norm is not None:
            raise ValueError(f"unknown qk_norm {qk_norm!r}")

        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, cfg.attention_scale,
                                   cfg.sliding_window_for_layer(layer), cfg.attn_logit_softcapping)

    def __call__(self, x: tallow.Tensor, kv_cache, ctx: StepContext) -> tallow.Tensor:
        """attention(x) through o_proj."""
        qkv = self.qkv_proj(x)
        d = self.head_dim
        q, k, v = (heads_view(t, n // d, d) for t, n in zip(split_last(qkv, self.sizes), self.sizes))
        cos_sin, rows = ctx.rope[self.rope_index]
        if ctx.q_scale is None and (self.q_norm is None or isinstance(self.q_norm, RMSNorm)):
            # Per-head RMSNorm (Qwen3, Gemma 3), RoPE and the cache write: one op (one kernel on CUDA),
            # q and k normed and rotated in place inside qkv.
            qn, kn = self.q_norm, self.k_norm
            a = self.attn.rope_and_attend(rows, q, k, v, cos_sin, self.cfg.rope_neox, kv_cache, ctx.meta,
                                          qn.weight if qn else None, kn.weight if kn else None,
                                          qn.eps if qn else 1e-6, bool(qn and qn.gemma_offset))
        else:  # StableLM's per-head LayerNorm, Llama 4 / Ministral 3 query scaling: the separate ops
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            ops.rotary_embedding(rows, q, k, cos_sin, self.cfg.rope_neox)
            if ctx.q_scale is not None:
                q = ops.mul(q, ctx.q_scale)
            a = self.attn(q, k, v, kv_cache, ctx.meta)
        return self.o_proj(a.view(a.shape[0], -1))
