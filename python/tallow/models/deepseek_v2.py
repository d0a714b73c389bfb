"""DeepSeek-V2 / V2-Lite / V2.5 (DeepseekV2ForCausalLM) and DeepSeek-V3 / R1 (DeepseekV3ForCausalLM):
the pre-norm decoder with multi-head latent attention (layers/mla.py: the paged cache holds one latent row
of kv_lora_rank + qk_rope_head_dim values per token and layer) and DeepSeek's MoE (layers/deepseek_moe.py:
shared experts, grouped top-k routing; V3's sigmoid scores with the noaux_tc correction bias). The first
first_k_dense_replace layers (and those off moe_layer_freq) keep a dense SwiGLU MLP of intermediate_size.

RoPE covers the qk_rope_head_dim dims only, in interleaved pairs (V2 always; V3 unless rope_interleave is
false, then NeoX halves); yarn with mscale / mscale_all_dim scales cos/sin (attention factor) and the
softmax scale (mscale_all_dim^2) as transformers does.

The MLA and MoE parameters are read from the config dict (ModelConfig.raw) with transformers' defaults
(DeepseekParams.of); a GGUF file's metadata is translated into the same keys (gguf_config). GGUF: llama.cpp's
`deepseek2` architecture (V2 and V3), its MLA layout (attention.key_length_mla, head_count_kv 1, kv_b_proj
split into attn_k_b [H, L, nope] (transposed) and attn_v_b [H, v, L], merged back into kv_b_proj's rows on
load) or the older one (attn_kv_b); exp_probs_b is V3's e_score_correction_bias. Tensor parallelism is not
supported for MLA yet."""
from __future__ import annotations

import dataclasses
import types
from typing import Iterable, Optional

import numpy as np

import tallow
from tallow.layers.decoder import DecoderForCausalLM
from tallow.layers.deepseek_moe import DeepseekMoE, DeepseekRouting
from tallow.layers.mla import MlaDims, MultiHeadLatentAttention, PrefillPlans, mla_softmax_scale
from tallow.layers.mlp import GatedMLP
from tallow.loader.gguf_weights import COMMON_LAYER, MOE_LAYER

# transformers' DeepseekV2Config / DeepseekV3Config defaults for the keys this family reads
_V2_DEFAULTS = {
    "max_position_embeddings": 2048, "intermediate_size": 11008, "moe_intermediate_size": 1407,
    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": None, "topk_group": None, "num_experts_per_tok": None,
    "first_k_dense_replace": 0, "norm_topk_prob": False,
}
_V3_DEFAULTS = {
    "max_position_embeddings": 4096, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "rope_interleave": True,
}


GGUF_LAYER = {
    **COMMON_LAYER, **MOE_LAYER,
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction",  # .bias: renamed on load (_gguf_names)
}
_GGUF_SIGMOID = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid


def _opt_int(v) -> Optional[int]:
    return None if v is None else int(v)


@dataclasses.dataclass(frozen=True)
class DeepseekParams:
    """What a DeepSeek config adds to ModelConfig: the MLA dimensions and the routing."""
    mla: MlaDims
    routing: Optional[DeepseekRouting]  # None: no routed experts (every layer dense)
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int

    @classmethod
    def of(cls, cfg) -> "DeepseekParams":
        """From cfg.raw (the config.json dict), transformers' defaults filling what it leaves out."""
        fam = DeepseekV3ForCausalLM if cfg.family == DeepseekV3ForCausalLM.family else DeepseekV2ForCausalLM
        defaults = fam.config_defaults[fam.model_types[0]]
        raw = cfg.raw or {}

        def get(key, default=None):
            v = raw[key] if key in raw else defaults.get(key)
            return default if v is None else v

        mla = MlaDims(num_heads=cfg.num_attention_heads, q_lora_rank=_opt_int(get("q_lora_rank")),
                      kv_lora_rank=int(get("kv_lora_rank")), qk_nope_head_dim=int(get("qk_nope_head_dim")),
                      qk_rope_head_dim=int(get("qk_rope_head_dim")), v_head_dim=int(get("v_head_dim")))
        routing = None
        if cfg.num_experts:
            v3 = fam is DeepseekV3ForCausalLM  # transformers' V3 router is always sigmoid + noaux_tc
            method = "noaux_tc" if v3 else str(get("topk_method", "greedy"))
            routing = DeepseekRouting(
                num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                scoring_func="sigmoid" if v3 else str(get("scoring_func", "softmax")), topk_method=method,
                n_group=int(get("n_group") or 1), topk_group=int(get("topk_group") or 1),
                norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=float(get("routed_scaling_factor", 1.0)))
        return cls(mla, routing, int(get("n_shared_experts") or 0), int(get("first_k_dense_replace") or 0),
                   int(get("moe_layer_freq") or 1))


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    family = "deepseek_v2"
    hf_architectures = ("DeepseekV2ForCausalLM",)
    model_types = ("deepseek_v2",)
    gguf_architectures = ("deepseek2",)
    gguf_tensor_names = {"deepseek2": GGUF_LAYER}
    config_defaults = {"deepseek_v2": _V2_DEFAULTS}
    rope_neox = False  # interleaved pairs (2i, 2i+1) on the rope dims
    honours_rope_interleave = False  # transformers' V2 always rotates interleaved pairs

    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def __init__(self, cfg, *args, **kwargs):
        self.params = DeepseekParams.of(cfg)
        self.prefill_plans = PrefillPlans()  # one per step, shared by the layers
        super().__init__(cfg, *args, **kwargs)

    # -- config ----------------------------------------------------------------------------------
    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        nope, rope = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
        n_layers = fields["num_hidden_layers"]
        n_experts = int(get("n_routed_experts", "num_experts") or 0)
        first_dense = int(get("first_k_dense_replace") or 0)
        freq = int(get("moe_layer_freq", default=1) or 1)
        moe_inter = _opt_int(get("moe_intermediate_size"))
        shared = int(get("n_shared_experts") or 0)
        interleave = get("rope_interleave", default=True)
        top_k = int(get("num_experts_per_tok") or 0)
        if n_experts and not 1 <= top_k <= n_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={n_experts}]")
        fields.update(
            # head_dim: the query/key width (nope + rope); only the rope dims rotate
            head_dim=nope + rope, rotary_dim=rope, partial_rotary_factor=rope / (nope + rope),
            rope_neox=cls.honours_rope_interleave and not bool(interleave),
            qkv_bias=bool(get("attention_bias", default=False)), o_bias=bool(get("attention_bias", default=False)),
            mlp_bias=bool(get("mlp_bias", default=False)),
            num_experts=n_experts, num_experts_per_tok=top_k if n_experts else 0,
            moe_intermediate_size=moe_inter,
            shared_expert_intermediate_size=(moe_inter or 0) * shared or None,
            norm_topk_prob=bool(get("norm_topk_prob", default=False)), decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(n_layers) if not (i >= first_dense and i % freq == 0)],
        )
        DeepseekParams.of(types.SimpleNamespace(**fields))  # a bad routing or MLA value is a config error

    @classmethod
    def gguf_config(cls, key, md, has, fields: dict) -> None:
        rope = int(key("rope.dimension_count", required=True))
        if key("attention.key_length_mla") is not None:  # MLA layout: key_length is kv_lora_rank + rope
            nope = int(key("attention.key_length_mla")) - rope
            v_dim = int(key("attention.value_length_mla", required=True))
        else:
            nope = fields["head_dim"] - rope
            v_dim = int(key("attention.value_length", fields["head_dim"]))
        n_layers = fields["num_hidden_layers"]
        n_experts = int(key("expert_count", 0) or 0)
        first_dense = int(key("leading_dense_block_count", 0) or 0)
        moe_inter = _opt_int(key("expert_feed_forward_length"))
        shared = int(key("expert_shared_count", 0) or 0)
        sigmoid = int(key("expert_gating_func", 1) or 1) == _GGUF_SIGMOID
        n_group, topk_group = int(key("expert_group_count", 1) or 1), int(key("expert_group_used_count", 1) or 1)
        rope_cfg = fields["rope"]
        log_mul = key("rope.scaling.yarn_log_multiplier")
        if rope_cfg.type == "yarn" and log_mul:  # 0.1 * mscale_all_dim; DeepSeek's mscale equals it
            m = float(log_mul) / 0.1
            rope_cfg = dataclasses.replace(rope_cfg, mscale=m, mscale_all_dim=m, attention_factor=None)
        q_lora = key("attention.q_lora_rank")
        fields.update(
            head_dim=nope + rope, rotary_dim=rope, partial_rotary_factor=rope / (nope + rope), rope=rope_cfg,
            num_key_value_heads=fields["num_attention_heads"],
            qkv_bias=has("attn_q_a.bias") or has("attn_kv_a_mqa.bias"), o_bias=has("attn_output.bias"),
            num_experts=n_experts, num_experts_per_tok=int(key("expert_used_count", 0) or 0) if n_experts else 0,
            moe_intermediate_size=moe_inter, shared_expert_intermediate_size=(moe_inter or 0) * shared or None,
            norm_topk_prob=bool(key("expert_weights_norm", False)), decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(n_layers) if i < first_dense],
        )
        fields["raw"] = {**fields["raw"], **dict(  # the config.json keys DeepseekParams.of reads
            q_lora_rank=_opt_int(q_lora) or None, kv_lora_rank=int(key("attention.kv_lora_rank", required=True)),
            qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim, n_shared_experts=shared,
            routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0), first_k_dense_replace=first_dense,
            scoring_func="sigmoid" if sigmoid else "softmax", n_group=n_group, topk_group=topk_group,
            topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if n_group > 1 else "greedy"))}
        DeepseekParams.of(types.SimpleNamespace(**fields))

    # -- loading ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable) -> set[str]:
        return super().load_weights(self._gguf_names(weights))

    def _gguf_names(self, weights: Iterable):
        """GGUF's deepseek2 tensors under the names the layers declare: exp_probs_b (arriving as
        gate.e_score_correction.bias) and the split attn_k_b / attn_v_b, merged back into kv_b_proj."""
        split: dict[str, dict] = {}
        for name, t in weights:
            if name.endswith(".mlp.gate.e_score_correction.bias"):
                yield name[:-len("e_score_correction.bias")] + "e_score_correction_bias", t
            elif name.endswith((".self_attn.k_b_proj.weight", ".self_attn.v_b_proj.weight")):
                prefix, part = name[:-len("k_b_proj.weight")], name[-len("k_b_proj.weight")]
                got = split.setdefault(prefix, {})
                got[part] = t
                if len(got) == 2:
                    del split[prefix]
                    yield prefix + "kv_b_proj.weight", self._merged_kv_b(prefix, got["k"], got["v"])
            else:
                yield name, t

    def _merged_kv_b(self, prefix: str, k_b: tallow.Tensor, v_b: tallow.Tensor) -> tallow.Tensor:
        """kv_b_proj's weight [H * (nope + v), L] from k_b [H, L, nope] (transposed per head) and v_b [H, v, L]."""
        d = self.params.mla
        n, lat, nope, vd = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.v_head_dim

        def host(t, shape):
            f = tallow.ops.dequantize(t, "float32") if t.dtype.is_block else t.to(tallow.float32)
            a = np.asarray((f if f.device == "cpu" else f.to("cpu")).numpy(), dtype=np.float32)
            if a.size != int(np.prod(shape)):
                raise ValueError(f"{prefix}k_b_proj / v_b_proj: {list(t.shape)} does not fit the config's {shape}")
            return a.reshape(shape)

        k = host(k_b, (n, lat, nope)).transpose(0, 2, 1)
        v = host(v_b, (n, vd, lat))
        return tallow.from_numpy(np.ascontiguousarray(np.concatenate([k, v], axis=1).reshape(n * (nope + vd), lat)))

    @classmethod
    def kv_cache_spec(cls, cfg, tp_size: int = 1) -> tuple[int, int, int, bool]:
        """(kv heads, k dim, v dim, v is a view of k) of one layer's paged cache: one latent row of
        kv_lora_rank + qk_rope_head_dim values, v its first kv_lora_rank."""
        d = DeepseekParams.of(cfg).mla
        return 1, d.cache_dim, d.kv_lora_rank, True

    # -- building --------------------------------------------------------------------------------
    def make_attention(self, i: int) -> MultiHeadLatentAttention:
        cfg = self.cfg
        rope = self.rope_caches.index(cfg.rope_for_layer(i))
        return MultiHeadLatentAttention(
            self.params.mla, cfg.hidden_size, mla_softmax_scale(self.params.mla, cfg.rope), cfg.rope_neox,
            f"model.layers.{i}.self_attn.", self.dtype, self.device, self.quant_config, rope, cfg.qkv_bias,
            self.tp_rank, self.tp_size, self.prefill_plans)

    def make_mlp(self, i: int):
        cfg = self.cfg
        if not cfg.is_moe_layer(i):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias,
                            prefix=f"model.layers.{i}.mlp.", dtype=self.dtype, device=self.device,
                            quant_config=self.quant_config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        return DeepseekMoE(self.params.routing, cfg.hidden_size, cfg.moe_intermediate_size,
                           self.params.n_shared_experts, cfg.hidden_act, f"model.layers.{i}.mlp.", self.dtype,
                           self.device, self.quant_config, self.tp_rank, self.tp_size)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    family = "deepseek_v3"
    hf_architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
    gguf_architectures = ()  # llama.cpp's deepseek2 covers V3 too: those files load as deepseek_v2
    gguf_tensor_names = {}
    config_defaults = {"deepseek_v3": _V3_DEFAULTS}
    honours_rope_interleave = True  # rope_interleave false: NeoX halves
