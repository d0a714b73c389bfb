"""DeepSeek's MoE MLP: shared experts plus routed experts, as transformers (and DeepSeek's own code) route:

    V2  scores = softmax(x @ gate^T)                    topk_method greedy | group_limited_greedy
    V3  scores = sigmoid(x @ gate^T),  choice = scores + e_score_correction_bias      noaux_tc
    grouped top-k: experts in n_group equal groups; a group's score is its best expert (group_limited_greedy)
      or the sum of its best two by `choice` (noaux_tc); only the topk_group best groups stay eligible
    ids = top-k of choice among eligible experts; w = scores[ids] [/ (sum + 1e-20) when norm_topk_prob]
    y = routed_scaling_factor * sum_k w_k * expert_k(x)  +  shared_experts(x)

(transformers' V2 router ignores norm_topk_prob; DeepSeek's code and vLLM apply it; every released V2
config sets it false.) The routing runs on the host in numpy; the experts run through layers/moe.py's
SparseMoE machinery (one gather in expert order, a GEMM pair per hit expert, weighted gather back).
The shared experts are one GatedMLP of moe_intermediate_size * n_shared_experts."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import numpy as np

import tallow
from tallow.layers.linear import ReplicatedLinear
from tallow.layers.mlp import GatedMLP
from tallow.layers.module import Module
from tallow.layers.moe import SparseMoE

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True)
class DeepseekRouting:
    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring_func not in SCORING:
            raise ValueError(f"unsupported MoE scoring_func {self.scoring_func!r}; supported: {', '.join(SCORING)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported MoE topk_method {self.topk_method!r}; supported: {', '.join(TOPK_METHODS)}")
        if self.grouped and (self.n_group < 1 or self.num_experts % self.n_group
                             or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"MoE groups: {self.num_experts} experts in n_group={self.n_group} groups, "
                             f"topk_group={self.topk_group}: the groups must divide the experts and "
                             "1 <= topk_group <= n_group")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts}]")

    @property
    def grouped(self) -> bool:
        return self.topk_method in ("group_limited_greedy", "noaux_tc")


def deepseek_route(logits: np.ndarray, r: DeepseekRouting, bias: Optional[np.ndarray] = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k] f32, expert ids [T, k]) of router logits [T, E], in f32 as transformers computes."""
    logits = logits.astype(np.float32)
    if r.scoring_func == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = e / e.sum(axis=-1, keepdims=True)
    else:
        scores = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))
    choice = scores + bias.astype(np.float32) if r.topk_method == "noaux_tc" and bias is not None else scores
    if r.grouped and r.n_group > 1:
        t = choice.shape[0]
        grouped = choice.reshape(t, r.n_group, -1)
        if r.topk_method == "noaux_tc":
            group_scores = np.sort(grouped, axis=-1)[:, :, -2:].sum(axis=-1)
        else:
            group_scores = grouped.max(axis=-1)
        keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :r.topk_group]
        mask = np.zeros(group_scores.shape, dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        fill = -np.inf if r.topk_method == "noaux_tc" else 0.0  # transformers' masked_fill values
        choice = np.where(np.repeat(mask, r.num_experts // r.n_group, axis=-1), choice, np.float32(fill))
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :r.top_k]
    w = np.take_along_axis(scores, ids, axis=-1)
    if r.norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return (w * np.float32(r.routed_scaling_factor)).astype(np.float32), ids


class RouterBias(Module):
    """V3's e_score_correction_bias [E] (a checkpoint tensor beside the router weight, not a linear bias)."""

    param_names = ("e_score_correction_bias",)

    def __init__(self, num_experts: int, *, prefix: str, device: str = "cpu"):
        super().__init__(prefix)
        self.e_score_correction_bias = tallow.empty([int(num_experts)], tallow.float32, device)
        self._host: Optional[np.ndarray] = None

    def host(self) -> np.ndarray:
        """The bias on the host (read once: it is fixed after loading)."""
        if self._host is None:
            b = self.e_score_correction_bias
            self._host = np.asarray((b if b.device == "cpu" else b.to("cpu")).numpy(), dtype=np.float32).copy()
        return self._host

    def weight_loader(self, param: str, loaded: tallow.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != tuple(self.e_score_correction_bias.shape):
            raise ValueError(f"{self.prefix}.{param}: shape {list(loaded.shape)}, the config needs "
                             f"{list(self.e_score_correction_bias.shape)}")
        super().weight_loader(param, loaded, shard_id)
        self._host = None

    def dummy_parts(self) -> Iterator[tuple]:
        yield self.e_score_correction_bias, self.prefix + ".e_score_correction_bias", "bias", 0


class DeepseekMoE(SparseMoE):
    """Layers under `prefix` (e.g. "model.layers.3.mlp."): the router gate [E, H] (+ gate.e_score_correction_bias
    for noaux_tc), experts.{e}.* and shared_experts.* GatedMLPs."""

    def __init__(self, routing: DeepseekRouting, hidden_size: int, moe_intermediate_size: int, n_shared_experts: int,
                 hidden_act: str, prefix: str, dtype, device: str = "cpu", quant_config=None, tp_rank: int = 0,
                 tp_size: int = 1):
        # SparseMoE's state, built for DeepSeek's names (its __init__ reads the Qwen-MoE config fields)
        self.routing = routing
        self.num_experts, self.top_k, self.norm_topk_prob = routing.num_experts, routing.top_k, routing.norm_topk_prob
        common = dict(dtype=dtype, device=device, quant_config=quant_config)
        self.has_shared_gate = False
        self.router = ReplicatedLinear(hidden_size, self.num_experts, False, prefix=prefix + "gate", **common)
        self.bias = RouterBias(self.num_experts, prefix=prefix + "gate", device=device) \
            if routing.topk_method == "noaux_tc" else None
        self.tp_size = tp_size
        part = dict(tp_rank=tp_rank, tp_size=tp_size, reduce_results=False, **common)  # reduced once, at the end
        self.experts = [GatedMLP(hidden_size, moe_intermediate_size, hidden_act, prefix=f"{prefix}experts.{e}.", **part)
                        for e in range(self.num_experts)]
        self.shared = None
        if n_shared_experts:
            self.shared = GatedMLP(hidden_size, moe_intermediate_size * n_shared_experts, hidden_act,
                                   prefix=prefix + "shared_experts.", **part)
        self.last_counts: Optional[np.ndarray] = None

    def route(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return deepseek_route(logits, self.routing, None if self.bias is None else self.bias.host())
