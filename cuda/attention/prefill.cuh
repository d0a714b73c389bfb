// Tensor-core paged prefill attention (FlashAttention-2 tiling over the paged KV cache); the
// contract is ops::paged_attention's (cpp/ops/paged_attention.h), plus FP8 E4M3 caches with scales.
#pragma once
#include "common.cuh"

namespace tallow::cuda {

// out [T, Hq, D] (contiguous, q's dtype) = paged attention of q [T, Hq, D] (f16/bf16, last dim
// contiguous) over k_cache / v_cache [num_blocks, block_size, Hk, D] (q's dtype, or float8_e4m3
// holding value / scale: real = stored * k_scale / v_scale; scales are ignored for 16-bit caches),
// with i32 block_tables [B, max_blocks], seq_lens [B], query_start_loc [B + 1].
// Supported: D in {64, 80, 96, 128, 256} (v's D equal), block_size a power of two >= 8, Hq % Hk == 0,
// 16-byte aligned rows (q and cache strides multiples of 16 bytes), an sm_80+ device.
// Returns false, doing nothing, for any other case (the caller falls back to the simple kernel).
// Never reads device data on the host: safe under CUDA-graph capture. Out-of-range block ids are
// not read; their keys are left out (as the simple kernel does under capture).
bool paged_prefill_attention(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                             const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                             float scale, int64_t sliding_window, float softcap, float k_scale, float v_scale);

}  // namespace tallow::cuda
