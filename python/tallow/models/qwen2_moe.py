"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's layer (qkv bias) with a sparse MoE MLP on the layers
config.is_moe_layer(i) picks (decoder_sparse_step / mlp_only_layers; the others keep a dense MLP of
intermediate_size): softmax router, top-k without renormalisation unless norm_topk_prob, plus a shared
expert scaled by sigmoid(shared_expert_gate(x)). See layers/moe.py."""
from __future__ import annotations

from tallow.layers.decoder import DecoderLayer
from tallow.layers.moe import SparseMoE
from tallow.layers.self_attention import SelfAttention
from tallow.models.llama import LlamaForCausalLM


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, w: dict, i: int) -> DecoderLayer:
        cfg = self.cfg
        if not cfg.is_moe_layer(i):
            return super().make_layer(w, i)
        p = f"model.layers.{i}."
        rope = self.rope_caches.index(cfg.rope_for_layer(i))
        attn = SelfAttention(cfg, w, p + "self_attn.", i, self.dtype, rope, self.qk_norm_kind())
        moe = SparseMoE.from_weights(w, p + "mlp.", self.dtype, cfg.hidden_act, cfg.num_experts,
                                     cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return DecoderLayer(attn, moe, self.make_norm(w, p + self.attn_norm), self.make_norm(w, p + self.mlp_norm))
