"""Sparse mixture-of-experts MLP (Qwen2-MoE / Qwen3-MoE), as transformers computes it:

    p = softmax(x @ router^T)  (f32)         top-k of p per token  [/ their sum when norm_topk_prob]
    y = sum over the token's k experts of  w_k * down_e(silu(gate_e(x)) * up_e(x))
        [+ sigmoid(x @ shared_gate^T) * shared_mlp(x)]                                 Qwen2-MoE

Routing runs on the host: the router logits (and the shared expert's gate logit, computed by the same
GEMM as one extra router row) are copied to the host, where numpy does softmax, top-k, renormalisation
and the sigmoid, and sorts the T*k (token, slot) assignments by expert. The GEMMs stay on tallow ops:
the routed token rows are gathered once in expert order (embedding as a row gather), each hit expert
runs its fused gate_up / down on its contiguous slice (writing straight into one [T*k, H] buffer),
the rows are scaled by their routing weights, and the result is gathered back per slot (k gathers
and adds, so the combine costs O(T*k*H) and needs no scatter kernel).

Tensor parallelism: the router is replicated (every rank routes the same tokens the same way); each
expert's (and the shared expert's) intermediate size is split over the ranks, and the combined output
is all-reduced once.

Performance caveats: one device->host copy of [T, E(+1)] router logits per MoE layer per step (a
sync), one small host->device copy of the index/weight tables, and a Python loop over the experts
that received tokens (one pair of GEMMs each, no grouped GEMM). Experts are GatedMLPs of linear layers,
so GGUF experts stay in their block type like every other projection.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

import tallow
from tallow import ops
from tallow.layers.linear import ReplicatedLinear
from tallow.layers.mlp import GatedMLP
from tallow.parallel.communicator import get_tp_group


def _host(t: tallow.Tensor) -> np.ndarray:
    if t.dtype != tallow.float32:
        t = t.to(tallow.float32)
    return np.asarray((t if t.device == "cpu" else t.to("cpu")).numpy(), dtype=np.float32)


def route(logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k] f32, expert ids [T, k]) as transformers' TopKRouter: softmax in f32, top-k
    (largest first; ties to the lower expert id, as torch.topk on CPU), optional renormalisation."""
    logits = logits.astype(np.float32)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(np.float32), ids


class SparseMoE:
    """Layers under `prefix` (e.g. "model.layers.3.mlp."): the router gate [E, H] (plus, with a shared
    expert gate, shared_expert_gate [1, H] as one extra router row: one GEMM), experts.{e}.* GatedMLPs
    and, where the config has one, shared_expert.*."""

    def __init__(self, cfg, prefix: str, dtype, device: str = "cpu", quant_config=None, tp_rank: int = 0,
                 tp_size: int = 1):
        h, act = cfg.hidden_size, cfg.hidden_act
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, int(cfg.num_experts_per_tok), \
            bool(cfg.norm_topk_prob)
        common = dict(dtype=dtype, device=device, quant_config=quant_config)
        self.has_shared_gate = bool(cfg.shared_expert_intermediate_size)
        parts = [prefix + "gate"] + ([prefix + "shared_expert_gate"] if self.has_shared_gate else [])
        self.router = ReplicatedLinear(h, [self.num_experts] + [1] * self.has_shared_gate, False, prefix=prefix + "gate",
                                       part_names=parts, dummy_names=parts, **common)
        inter = cfg.moe_intermediate_size or cfg.intermediate_size
        self.tp_size = tp_size
        part = dict(tp_rank=tp_rank, tp_size=tp_size, reduce_results=False, **common)  # reduced once, at the end
        self.experts = [GatedMLP(h, inter, act, prefix=f"{prefix}experts.{e}.", **part)
                        for e in range(self.num_experts)]
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            self.shared = GatedMLP(h, cfg.shared_expert_intermediate_size, act, prefix=prefix + "shared_expert.",
                                   **part)
        self.last_counts: Optional[np.ndarray] = None  # tokens per expert at the last call (tests)

    def route(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(weights [T, k], expert ids [T, k]) from router logits [T, E] (layers/deepseek_moe.py overrides)."""
        return route(logits, self.top_k, self.norm_topk_prob)

    def __call__(self, x: tallow.Tensor) -> tallow.Tensor:
        t, hidden = x.shape[0], x.shape[1]
        dev, dt = x.device, x.dtype
        logits = _host(self.router(x))  # [T, E (+1)]
        weights, ids = self.route(logits[:, :self.num_experts])
        k = self.top_k

        flat = ids.reshape(-1)  # assignment f = token * k + slot
        order = np.argsort(flat, kind="stable")  # buffer row r holds assignment order[r]
        counts = np.bincount(flat, minlength=self.num_experts)
        self.last_counts = counts
        pos = np.empty_like(order)
        pos[order] = np.arange(order.size)

        def dev_tensor(a: np.ndarray) -> tallow.Tensor:
            tt = tallow.from_numpy(np.ascontiguousarray(a))
            if dt != tallow.float32 and a.dtype == np.float32:
                tt = tt.to(dt)
            return tt if dev == "cpu" else tt.to(dev)

        rows_in = ops.embedding(dev_tensor((order // k).astype(np.int64)), x)  # [T*k, H] in expert order
        buf = tallow.empty([t * k, hidden], dt, dev)
        start = 0
        for e in np.nonzero(counts)[0]:
            n = int(counts[e])
            mlp = self.experts[e]
            xe = rows_in.narrow(0, start, n)
            y = mlp.gate_up_proj(xe)
            y = ops.silu_and_mul(y) if mlp.kind == "silu" else ops.gelu_and_mul(y, mlp.approximate)
            mlp.down_proj(y, out=buf.narrow(0, start, n))
            start += n
        buf = ops.mul(buf, dev_tensor(weights.reshape(-1)[order].reshape(-1, 1)))

        out = None
        for j in range(k):
            g = ops.embedding(dev_tensor(pos.reshape(t, k)[:, j].astype(np.int64)), buf)
            out = g if out is None else ops.add(out, g)
        if self.shared is not None:
            s = self.shared(x)
            if self.has_shared_gate:
                z = logits[:, self.num_experts:self.num_experts + 1]
                s = ops.mul(s, dev_tensor((1.0 / (1.0 + np.exp(-z))).astype(np.float32)))
            out = ops.add(out, s)
        return get_tp_group().all_reduce(out) if self.tp_size > 1 else out
