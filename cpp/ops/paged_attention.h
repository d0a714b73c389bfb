// Paged attention over a block-table KV cache, and the KV-cache write that fills it (vLLM's layout).
//
// A layer's cache is two tensors k_cache [num_blocks, block_size, Hk, D] and v_cache
// [num_blocks, block_size, Hk, Dv] (float32, float16, bfloat16 or float8_e4m3; any strides with a
// contiguous last dim). Token position p of a sequence with block table `table` lives in block
// table[p / block_size] at row p % block_size; a flat slot s is block s / block_size, row
// s % block_size.
//
// FP8 E4M3 caches (the "fn" variant: max 448, no infinities) hold values divided by a per-tensor
// scale: k_cache stores k / k_scale and v_cache v / v_scale, and attention reads stored * scale.
// The scales (finite and > 0, default 1) apply to float8_e4m3 caches only; 16/32-bit caches ignore them.
#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// Writes token t's K and V (k [T, Hk, D], v [T, Hk, Dv]) into flat slot slot_mapping[t]
// (i32/i64 [T]) of k_cache / v_cache; a negative slot skips the token (padding). The caches may
// have another float dtype than k/v (values are converted, rounding to nearest even). An fp8 cache
// stores e4m3(x / scale): one f32 division, then round to nearest even, saturating to +-448 (also
// for +-inf); NaN stays NaN. Every slot is checked before anything is written. Two tokens mapped
// to one slot: one of them wins.
void reshape_and_cache(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slot_mapping, float k_scale = 1.0f, float v_scale = 1.0f);

// Causal attention of the new tokens of B sequences over their paged KV (written already,
// e.g. by reshape_and_cache). One code path for decode, prefill, prefill over a cached prefix
// and chunked prefill, mixed in one batch.
//   q               [T, Hq, D] float; Hq % Hk == 0 (GQA/MQA)
//   block_tables    i32/i64 [B, max_blocks]: block ids of each sequence. Entries past a sequence's
//                   blocks, and blocks wholly before its sliding window, are neither read nor checked.
//   seq_lens        i32/i64 [B]: tokens of sequence b including its new ones (<= max_blocks * block_size)
//   query_start_loc i32/i64 [B + 1]: sequence b's queries are rows query_start_loc[b] ..
//                   query_start_loc[b + 1] of q (non-decreasing, from 0 to T). They are its last
//                   n_b tokens: query i sits at position seq_lens[b] - n_b + i (so n_b <= seq_lens[b]).
// Scores are scale * <q, k> in f32, then softcap * tanh(s / softcap) when softcap > 0; a query
// at position p sees keys j <= p, and with sliding_window W > 0 only keys p - W < j <= p
// (the same semantics as ops::attention). Online softmax with f32 accumulation.
// Output [T, Hq, Dv] in q's dtype (written into `out` when given). k_cache and v_cache share a
// dtype, which may differ from q's; with fp8 caches keys are stored * k_scale and values
// stored * v_scale (k_scale is folded into `scale`, v_scale into the normalised output).
//
// Work is split over (sequence, block of queries, kv heads): the query heads of a kv head are
// processed together, so each K/V row is read once per group, and an item reads whole token rows
// (all kv heads) of the cache. When that gives fewer work items than about twice the thread count,
// query blocks shrink, long key ranges are split across threads (flash-decoding) and merged, and
// heads are divided; only with a split key range can the last bits depend on the thread count.
//
// CUDA: one sequence per query row (T == B) with f16/bf16 q, D in {64, 80, 96, 128, 256} and a
// cache of q's dtype or fp8 runs the split-KV decode kernel (cuda/attention/decode.cu); other
// batches the tensor-core prefill kernel (cuda/attention/prefill.cu); anything those two do not
// support a simple warp-per-query kernel. i64 indices are cast to i32 on the device.
// Checks that `t` can be a layer's cache: float32/float16/bfloat16/float8_e4m3, 4-D [num_blocks,
// block_size, num_kv_heads, head_dim] with a contiguous last dim; raises naming `op` and `name`.
// (Shared with the ops that write caches, e.g. rope_and_cache.)
void check_kv_cache(const char* op, const Tensor& t, const char* name);

// settled_cache = true promises that every cache row before each sequence's new tokens is settled:
// no kernel that may still run when this call starts writes it (true right after rope_and_cache or
// reshape_and_cache of this step, which write only the new tokens' rows; the attention layer passes
// it). The CUDA decode kernel then starts reading those rows before the previous kernel on the
// stream has finished (programmatic dependent launch). It never changes the result of a call that
// keeps the promise; the CPU ignores it.
Tensor paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                       const Tensor& seq_lens, const Tensor& query_start_loc, float scale,
                       int64_t sliding_window = 0, float softcap = 0.0f, const std::optional<Tensor>& out = {},
                       float k_scale = 1.0f, float v_scale = 1.0f, bool settled_cache = false);

}  // namespace tallow::ops
