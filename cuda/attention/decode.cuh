// Split-KV ("flash-decoding") paged attention for decode steps, on tensor cores, in one kernel
// launch; the contract is ops::paged_attention's (cpp/ops/paged_attention.h), plus FP8 E4M3 caches
// with scales.
#pragma once
#include "common.cuh"

namespace tallow::cuda {

// out [T, Hq, D] (contiguous, q's dtype) = paged attention of q [T, Hq, D] (f16/bf16, last dim
// contiguous) over k_cache / v_cache [num_blocks, block_size, Hk, D] (q's dtype, or float8_e4m3
// read as stored * k_scale / stored * v_scale), with i32 block_tables [B, max_blocks], seq_lens [B]
// and query_start_loc [B + 1].
// Made for one query per sequence (T == B, the decode step): grid (split, kv head, sequence), each
// CTA reads its K/V rows once for all query heads of the kv head's group; a sequence uses
// ceil(visible keys / minimum split) splits (at most the grid's), the last split to finish
// merges them (no second kernel). A sequence with more than one query (possible with T == B when
// another has none) is still right, its queries run one after another. Supported: T == B, D in
// {64, 80, 96, 128, 256} (v's D equal), Hq / Hk <= 16, block_size a power of two, 16-byte aligned
// cache rows and output, an sm_80+ device. Returns false, doing nothing, for any other case.
// Never reads device data on the host and allocates only through the tensor allocator (safe under
// graph capture), except once per device outside capture: the split counters (cudaMalloc, kept).
// Block-table entries at or past ceil(seq_len / block_size) are never read; out-of-range block ids
// are left out. Deterministic: the result does not depend on CTA timing.
// On sm_90 the kernel is a programmatic dependent launch: it may start while the previous kernel
// on the stream runs, reads q (and, unless settled_cache, the caches) and writes only after that
// kernel completes, and rechecks any metadata it read early (see decode.cu). settled_cache: the
// caller's promise of ops::paged_attention (cpp/ops/paged_attention.h) that no kernel still running
// writes cache rows before each sequence's new tokens; those rows are then read before the wait.
// Tuning (core/tuning.h, KernelTuning::decode_*, read per call): the minimum split in keys, the grid's
// split count, cp.async slots per warp (1..4, default 3; 4 for batches of <= SMs / 8 (token, kv head)
// rows over tables of 16k+ keys, 16-bit caches), PDL on / off, the prologue's fill.
bool paged_decode_attention(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                            float scale, int64_t sliding_window, float softcap, float k_scale, float v_scale,
                            bool settled_cache = false);

}  // namespace tallow::cuda
