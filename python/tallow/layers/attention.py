"""Paged attention for one layer: write this step's K/V into the cache, then attend."""
from __future__ import annotations

import dataclasses
from typing import Optional

import tallow
from tallow import ops


@dataclasses.dataclass
class AttentionMetadata:
    """The batch layout every attention layer of a step shares (tensors on the model's device)."""
    slot_mapping: tallow.Tensor  # i64 [T]: cache slot of each new token
    block_tables: tallow.Tensor  # i32 [B, max_blocks]
    seq_lens: tallow.Tensor  # i32 [B]: tokens of each sequence after this step
    query_start_loc: tallow.Tensor  # i32 [B + 1]
    num_tokens: int
    # Mixed steps: the leading num_decode_seqs sequences have one query each (decodes) and the rest
    # are prefill chunks, whose query starts rebased to 0 are prefill_query_start_loc (i32 [B - nd + 1]).
    # attend() then runs the decode kernel on the first part and the prefill kernel on the rest.
    num_decode_seqs: int = 0
    prefill_query_start_loc: Optional[tallow.Tensor] = None


class PagedAttention:
    """k_scale / v_scale: the per-tensor scales of a float8_e4m3 KV cache (it stores k / k_scale and
    v / v_scale); 16/32-bit caches ignore them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                 k_scale: float = 1.0, v_scale: float = 1.0):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window or 0
        self.softcap = softcap or 0.0
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)

    def __call__(self, q: tallow.Tensor, k: tallow.Tensor, v: tallow.Tensor, kv_cache: tuple[tallow.Tensor, tallow.Tensor],
                 meta: AttentionMetadata) -> tallow.Tensor:
        k_cache, v_cache = kv_cache
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        return self.attend(q, kv_cache, meta, settled_cache=True)

    def rope_and_attend(self, positions: tallow.Tensor, q: tallow.Tensor, k: tallow.Tensor, v: tallow.Tensor,
                        cos_sin_cache: tallow.Tensor, neox: bool, kv_cache: tuple[tallow.Tensor, tallow.Tensor],
                        meta: AttentionMetadata, q_norm_weight: Optional[tallow.Tensor] = None,
                        k_norm_weight: Optional[tallow.Tensor] = None, norm_eps: float = 1e-6,
                        gemma_norm: bool = False) -> tallow.Tensor:
        """Optional per-head q/k RMSNorm, RoPE in place and the cache write in one op (one kernel on
        CUDA: ops.rope_and_cache), then attention; the same result as norm + rotary_embedding + __call__."""
        k_cache, v_cache = kv_cache
        ops.rope_and_cache(positions, q, k, v, cos_sin_cache, neox, k_cache, v_cache, meta.slot_mapping,
                           q_norm_weight, k_norm_weight, norm_eps, gemma_norm, self.k_scale, self.v_scale)
        return self.attend(q, kv_cache, meta, settled_cache=True)

    def attend(self, q: tallow.Tensor, kv_cache: tuple[tallow.Tensor, tallow.Tensor],
               meta: AttentionMetadata, settled_cache: bool = False) -> tallow.Tensor:
        """Attention over the cache (this step's K/V written already). settled_cache: the promise of
        ops.paged_attention that no kernel still running writes older rows (true right after this
        step's cache write; the CUDA decode kernel then reads them early). A mixed step (decodes, then
        prefill chunks) runs as two calls: the decode sequences on CUDA go to the split-KV decode kernel,
        which reads each K/V row once per kv head, instead of taking a 64-128-row query tile of the
        prefill kernel per query head for their one row (H100, Qwen3-0.6B, nano-vllm workload: see
        cuda/README.md). Each sequence's result does not depend on the batch it runs in."""
        k_cache, v_cache = kv_cache
        nd, B = meta.num_decode_seqs, meta.seq_lens.shape[0]
        if 0 < nd < B and meta.prefill_query_start_loc is not None:
            T = q.shape[0]
            out = tallow.empty([T, q.shape[1], v_cache.shape[3]], q.dtype, q.device)
            self._attend(q.narrow(0, 0, nd), k_cache, v_cache, meta.block_tables.narrow(0, 0, nd),
                         meta.seq_lens.narrow(0, 0, nd), meta.query_start_loc.narrow(0, 0, nd + 1),
                         out.narrow(0, 0, nd), settled_cache)
            self._attend(q.narrow(0, nd, T - nd), k_cache, v_cache, meta.block_tables.narrow(0, nd, B - nd),
                         meta.seq_lens.narrow(0, nd, B - nd), meta.prefill_query_start_loc, out.narrow(0, nd, T - nd))
            return out
        return self._attend(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            settled_cache=settled_cache)

    def _attend(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out=None, settled_cache=False):
        return ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, self.scale,
                                   self.sliding_window, self.softcap, out=out, k_scale=self.k_scale,
                                   v_scale=self.v_scale, settled_cache=settled_cache)
