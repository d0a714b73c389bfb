"""Multi-head latent attention (DeepSeek-V2 / V3), with the compressed latent as the paged KV cache.

    q = q_proj(x)  or  q_b_proj(rms_norm(q_a_proj(x)))            [T, H, nope + rope]
    [c_kv | k_pe] = kv_a_proj_with_mqa(x);  c_kv = rms_norm(c_kv)   [T, L + rope]   (L = kv_lora_rank)
    RoPE on q's and k_pe's rope dims only (interleaved pairs for V2 and V3's rope_interleave, else NeoX)
    k = [W_UK c_kv | k_pe],  v = W_UV c_kv  per head   (kv_b_proj rows: per head [nope rows of W_UK; v rows])

The cache holds one row per token, [c_kv | k_pe] (normed, rotated): k_cache [blocks, block, 1, L + rope],
and v_cache is a strided view of its first L dims. That is (L + rope) values per token and layer against
H * (nope + rope + v) for ordinary per-head K and V (576 against 5120 at DeepSeek-V2-Lite's widths).

Decode runs in the absorbed form (one paged-attention call, MQA with one latent kv head): q_nope . k_nope =
(q_nope W_UK) . c_kv, so each head's query becomes [q_nope @ W_UK[h] | q_pe] of width L + rope, it attends
over the latent rows, and its output (a mix of c_kv rows, width L) becomes out @ W_UV[h]^T before o_proj.
Prefill runs in the expanded form: each prefill sequence's whole context (cached prefix and this chunk) is
gathered from the latent cache, kv_b_proj makes per-head k = [k_nope | k_pe] and v, and paged attention runs
over those as a block-size-1 cache (the rows' order is the sequence's). The expanded form costs
(nope + rope) per score where the absorbed one costs (L + rope): 3x fewer at DeepSeek's 512 / 128 / 64, which
matters for the many queries of a prefill; one query (a decode) is cheaper absorbed, as it never expands
the context. A mixed step runs its decodes absorbed and its prefill chunks expanded. The gather needs the
prefill sequences' block tables on the host: one device-to-host copy per prefill step (PrefillPlans),
shared by the layers; decode-only steps (CUDA graphs) need none.

The softmax scale is transformers': qk_head_dim^-0.5, times mscale^2 of yarn's mscale_all_dim."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

import tallow
from tallow import ops
from tallow.config import RopeConfig
from tallow.layers.attention import AttentionMetadata
from tallow.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tallow.layers.norm import RMSNorm


@dataclasses.dataclass(frozen=True)
class MlaDims:
    num_heads: int
    q_lora_rank: Optional[int]  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values one token stores per layer: the latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(dims: MlaDims, rope: RopeConfig) -> float:
    """transformers' yarn_apply_mscale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a
    scaled RoPE that names mscale_all_dim."""
    scale = dims.qk_head_dim ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(float(rope.factor), float(rope.mscale_all_dim))
        scale *= m * m
    return scale


def _host(t: tallow.Tensor) -> np.ndarray:
    return np.asarray((t if t.device == "cpu" else t.to("cpu")).numpy())


@dataclasses.dataclass
class PrefillPlan:
    """The prefill sequences of one step (those after its leading decodes) as a block-size-1 cache: their
    contexts' cache slots one after another, and the index tensors paged attention reads that by."""
    first_token: int  # the first prefill sequence's first query row
    slots: tallow.Tensor  # i64 [N]: cache slot of every context token of every prefill sequence
    block_tables: tallow.Tensor  # i32 [P, max context]: row p = the context's rows in `slots` order
    seq_lens: tallow.Tensor  # i32 [P]
    query_start_loc: tallow.Tensor  # i32 [P + 1], from 0


class PrefillPlans:
    """One PrefillPlan per step, built by the first layer that asks and reused by the others (the model
    owns one of these and hands it to every layer)."""

    def __init__(self):
        self._last: Optional[tuple] = None  # (meta, block size, plan)

    def get(self, meta: AttentionMetadata, block_size: int) -> PrefillPlan:
        if self._last is not None and self._last[0] is meta and self._last[1] == block_size:
            return self._last[2]
        nd = meta.num_decode_seqs
        seq_lens = _host(meta.seq_lens).astype(np.int64)[nd:]
        qsl = _host(meta.query_start_loc).astype(np.int64)
        tables = _host(meta.block_tables)[nd:]
        pos = [np.arange(n, dtype=np.int64) for n in seq_lens]
        slots = np.concatenate([tables[b][p // block_size].astype(np.int64) * block_size + p % block_size
                                for b, p in enumerate(pos)])
        starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]])
        rows = np.zeros((len(seq_lens), int(seq_lens.max())), np.int32)
        for b, (s, n) in enumerate(zip(starts, seq_lens)):
            rows[b, :n] = np.arange(s, s + n, dtype=np.int32)
        dev = meta.seq_lens.device

        def on_device(a: np.ndarray) -> tallow.Tensor:
            t = tallow.from_numpy(np.ascontiguousarray(a))
            return t if dev == "cpu" else t.to(dev)

        plan = PrefillPlan(int(qsl[nd]), on_device(slots), on_device(rows), on_device(seq_lens.astype(np.int32)),
                           on_device((qsl[nd:] - qsl[nd]).astype(np.int32)))
        self._last = (meta, block_size, plan)
        return plan


class MultiHeadLatentAttention:
    """Layers under `prefix` (e.g. "model.layers.3.self_attn."): q_proj or q_a_proj / q_a_layernorm /
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (biases on q_a, kv_a and o with
    attention_bias, as transformers)."""

    def __init__(self, dims: MlaDims, hidden_size: int, scale: float, rope_neox: bool,
                 prefix: str, dtype, device: str = "cpu", quant_config=None, rope_index: int = 0,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1, plans: Optional[PrefillPlans] = None):
        # Tensor parallelism: the query heads (q / q_b, kv_b and o rows or columns) split over the ranks; the
        # latent (kv_a and its cache row) is every head's, so each rank computes and caches all of it.
        if dims.num_heads % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the {dims.num_heads} attention heads")
        h, n = hidden_size, dims.num_heads
        dims = dataclasses.replace(dims, num_heads=n // tp_size)  # this rank's heads
        self.dims, self.rope_index, self.rope_neox = dims, rope_index, rope_neox
        common = dict(dtype=dtype, device=device, quant_config=quant_config)
        split = dict(common, tp_rank=tp_rank, tp_size=tp_size)
        norm = dict(dtype=dtype, device=device)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, n * dims.qk_head_dim, False, prefix=prefix + "q_proj", **split)
        else:
            self.q_a_proj = ReplicatedLinear(h, dims.q_lora_rank, bias, prefix=prefix + "q_a_proj", **common)
            # transformers' q_a_layernorm and kv_a_layernorm keep their default eps whatever rms_norm_eps says
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, 1e-6, prefix=prefix + "q_a_layernorm", **norm)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, n * dims.qk_head_dim, False,
                                                 prefix=prefix + "q_b_proj", **split)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, dims.cache_dim, bias, prefix=prefix + "kv_a_proj_with_mqa",
                                                   **common)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, 1e-6, prefix=prefix + "kv_a_layernorm", **norm)
        self.kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, n * (dims.qk_nope_head_dim + dims.v_head_dim), False,
                                              prefix=prefix + "kv_b_proj", **split)
        self.o_proj = RowParallelLinear(n * dims.v_head_dim, h, bias, prefix=prefix + "o_proj", **split)
        self.scale = scale
        self.plans = plans if plans is not None else PrefillPlans()
        self._absorbed: Optional[tuple] = None  # (W_UK [H, nope, L], W_UV^T [H, L, v]), built on first use

    def absorbed_weights(self) -> tuple[tallow.Tensor, tallow.Tensor]:
        """(W_UK [H, nope, L], W_UV^T [H, L, v]): strided views of kv_b_proj's weight (dequantized once when
        it is block-typed). Built on the first forward pass, after loading (or the dummy fill)."""
        if self._absorbed is None:
            d = self.dims
            w = self.kv_b_proj.weight
            if w.dtype.is_block:
                w = ops.dequantize(w, self.o_proj.dtype)
            w = w.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
            self._absorbed = (w.narrow(1, 0, d.qk_nope_head_dim),
                              w.narrow(1, d.qk_nope_head_dim, d.v_head_dim).transpose(1, 2))
        return self._absorbed

    def __call__(self, x: tallow.Tensor, kv_cache, ctx) -> tallow.Tensor:
        d = self.dims
        t, n, lat, rope, nope = x.shape[0], d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, n, d.qk_head_dim)
        kv = self.kv_a_proj_with_mqa(x)  # [T, L + rope]
        latent = tallow.empty([t, 1, d.cache_dim], x.dtype, x.device)  # the cache row: [c_kv | k_pe]
        rows = latent.view(t, d.cache_dim)
        rows.narrow(1, 0, lat).copy_(self.kv_a_layernorm(kv.narrow(1, 0, lat)))
        rows.narrow(1, lat, rope).copy_(kv.narrow(1, lat, rope))
        q_pe = q.narrow(2, nope, rope)
        cos_sin, positions = ctx.rope[self.rope_index]
        ops.rotary_embedding(positions, q_pe, latent.narrow(2, lat, rope), cos_sin, self.rope_neox)
        k_cache, v_cache = kv_cache
        ops.reshape_and_cache(latent, latent.narrow(2, 0, lat), k_cache, v_cache, ctx.meta.slot_mapping)

        meta = ctx.meta
        o = tallow.empty([t, n, d.v_head_dim], x.dtype, x.device)
        num_seqs = meta.seq_lens.shape[0]
        nd = num_seqs if t == num_seqs else meta.num_decode_seqs  # one query per sequence: all decodes
        if nd:
            self._absorbed_attention(q, q_pe, kv_cache, meta, nd, o)
        if nd < num_seqs:
            self._expanded_attention(q, k_cache, self.plans.get(meta, k_cache.shape[1]), o)
        return self.o_proj(o.view(t, n * d.v_head_dim))

    def _absorbed_attention(self, q, q_pe, kv_cache, meta: AttentionMetadata, nd: int, o: tallow.Tensor) -> None:
        """The first nd sequences (one query each) into o's first rows: q through W_UK into the latent space,
        attention over the latent rows, the output through W_UV."""
        d = self.dims
        t, n, lat, rope, nope = nd, d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim
        k_cache, v_cache = kv_cache
        w_uk, w_uv_t = self.absorbed_weights()
        q_abs = tallow.empty([t, n, d.cache_dim], q.dtype, q.device)
        q_abs.narrow(2, 0, lat).transpose(0, 1).copy_(ops.matmul(q.narrow(0, 0, t).narrow(2, 0, nope).transpose(0, 1),
                                                                 w_uk))
        q_abs.narrow(2, lat, rope).copy_(q_pe.narrow(0, 0, t))
        bt, sl, qsl = meta.block_tables, meta.seq_lens, meta.query_start_loc
        if t < sl.shape[0]:  # a mixed step: its leading decodes
            bt, sl, qsl = bt.narrow(0, 0, t), sl.narrow(0, 0, t), qsl.narrow(0, 0, t + 1)
        o_lat = ops.paged_attention(q_abs, k_cache, v_cache, bt, sl, qsl, self.scale, settled_cache=True)  # [t, H, L]
        o.narrow(0, 0, t).transpose(0, 1).copy_(ops.matmul(o_lat.transpose(0, 1), w_uv_t))

    def _expanded_attention(self, q, k_cache, plan: PrefillPlan, o: tallow.Tensor) -> None:
        """The prefill sequences into o's rows from plan.first_token: their contexts' latent rows gathered,
        expanded by kv_b_proj into per-head k = [k_nope | k_pe] and v, attended as a block-size-1 cache."""
        d = self.dims
        n, lat, rope, nope, vd = d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim
        nb, bs = k_cache.shape[0], k_cache.shape[1]
        if k_cache.stride(0) != bs * k_cache.stride(1) or k_cache.stride(3) != 1:
            raise ValueError(f"the latent cache must hold its rows one after another (strides {k_cache.strides})")
        rows = k_cache.as_strided([nb * bs, d.cache_dim], [k_cache.stride(1), 1], k_cache.offset)
        ctx = ops.embedding(plan.slots, rows)  # [N, L + rope] in context order
        if ctx.dtype != q.dtype:  # a cache stored in another dtype (fp8, ...)
            ctx = ctx.to(q.dtype)
        m = ctx.shape[0]
        kv = self.kv_b_proj(ctx.narrow(1, 0, lat)).view(m, 1, n, nope + vd)
        k = tallow.empty([m, 1, n, d.qk_head_dim], q.dtype, q.device)
        k.narrow(3, 0, nope).copy_(kv.narrow(3, 0, nope))
        k.narrow(3, nope, rope).copy_(ctx.narrow(1, lat, rope).unsqueeze(1).unsqueeze(1).expand(m, 1, n, rope))
        t0 = plan.first_token
        tp = q.shape[0] - t0
        ops.paged_attention(q.narrow(0, t0, tp), k, kv.narrow(3, nope, vd), plan.block_tables, plan.seq_lens,
                            plan.query_start_loc, self.scale, out=o.narrow(0, t0, tp))
