// dequant_linear: x [..., K] @ dequantize(w [N, K])^T (+ bias [N]) on the CPU with w kept in its GGUF block
// format (q4_0 ... q8_k; a float w is plain linear), so quantized checkpoints stay quantized in memory.
//
// Design. W is walked in tiles of R rows x K (R a multiple of 8; ~48 KiB of f32 for decode-sized M, 64-128
// rows for prefill-sized M). Each thread of the pool takes whole tiles: it dequantizes the tile's rows with
// the block dtype's row routine (dequant.cpp; AVX2 for the common types, bit-exact with ggml) into a
// thread-local, cache-resident f32 buffer and at once runs the existing GEMM (gemm::run) on that tile
// and the matching output columns: for M <= 16 its GEMV path (dot products over the still-hot rows), above
// it the packed BLIS path. The f32 weight never exists as a whole: extra memory is one tile per thread.
// Every output is one dot product over the full K in the GEMM's order, so results do not depend on the
// tile size or the thread count. x (and bias, out) may be f32, f16 or bf16: f16/bf16 are widened to f32
// once, accumulated in f32 and rounded once to x's dtype, like linear. CPU only: on another device this
// raises, naming the op and the device (the CUDA caller composes dequantize and linear).
#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

Tensor dequant_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias = std::nullopt,
                      const std::optional<Tensor>& out = std::nullopt);

}  // namespace tallow::ops
