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

Performance caveats: one device->host copy of [T, E(+1)] router logits per MoE layer per step (a
sync), one small host->device copy of the index/weight tables, and a Python loop over the experts
that received tokens (one pair of GEMMs each, no grouped GEMM). Expert weights are held dequantized
in the model dtype (as the dense MLPs are), so GGUF-quantized experts cost their full-precision size.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

import tallow
from tallow import ops
from tallow.layers.mlp import GatedMLP
from tallow.layers.names import require
from tallow.layers.weights import as_dtype, concat_rows


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
    def __init__(self, router: tallow.Tensor, experts: list[GatedMLP], top_k: int, norm_topk_prob: bool,
                 shared: Optional[GatedMLP] = None, shared_gate: Optional[tallow.Tensor] = None):
        self.num_experts = len(experts)
        self.experts, self.top_k, self.norm_topk_prob = experts, int(top_k), bool(norm_topk_prob)
        self.shared = shared
        # the shared expert's gate rides along as one extra router row
        self.router = concat_rows([router, shared_gate]) if shared_gate is not None else router
        self.has_shared_gate = shared_gate is not None
        self.last_counts: Optional[np.ndarray] = None  # tokens per expert at the last call (tests)

    @classmethod
    def from_weights(cls, w: dict, prefix: str, dtype, act: str, num_experts: int, top_k: int,
                     norm_topk_prob: bool) -> "SparseMoE":
        """From `prefix`gate.weight [E, H], `prefix`experts.{e}.{gate,up,down}_proj.weight and, where present,
        `prefix`shared_expert.* and `prefix`shared_expert_gate.weight [1, H]."""
        router = as_dtype(require(w, prefix + "gate.weight"), dtype)
        if router.shape[0] != num_experts:
            raise ValueError(f"{prefix}gate.weight has {router.shape[0]} rows, config says {num_experts} experts")
        experts = [GatedMLP.from_weights(w, f"{prefix}experts.{e}.", dtype, act) for e in range(num_experts)]
        shared = shared_gate = None
        if prefix + "shared_expert.down_proj.weight" in w:
            shared = GatedMLP.from_weights(w, prefix + "shared_expert.", dtype, act)
            if prefix + "shared_expert_gate.weight" in w:
                shared_gate = as_dtype(w[prefix + "shared_expert_gate.weight"], dtype)
                if len(shared_gate.shape) == 1:
                    shared_gate = shared_gate.view(1, shared_gate.shape[0])
        return cls(router, experts, top_k, norm_topk_prob, shared, shared_gate)

    def __call__(self, x: tallow.Tensor) -> tallow.Tensor:
        t, hidden = x.shape[0], x.shape[1]
        dev, dt = x.device, x.dtype
        logits = _host(ops.linear(x, self.router))  # [T, E (+1)]
        weights, ids = route(logits[:, :self.num_experts], self.top_k, self.norm_topk_prob)
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
            y = ops.linear(xe, mlp.gate_up, mlp.gate_up_bias)
            y = ops.silu_and_mul(y) if mlp.kind == "silu" else ops.gelu_and_mul(y, mlp.approximate)
            ops.linear(y, mlp.down, mlp.down_bias, out=buf.narrow(0, start, n))
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
        return out
