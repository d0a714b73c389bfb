// quant_linear: x [..., K] @ dequantize(w [N, K])^T (+ bias [N]) with w kept in its GGUF block format
// (q4_0 ... q8_k, iq4_nl, iq4_xs; a float w is plain linear), so quantized checkpoints stay quantized in
// memory. Other devices run BackendOps::quant_linear (a ValueError naming the op and device when none).
// (The CPU paths' measured speeds and the choice of kDecodeMaxM: quant_linear.cpp.)
//
// Decode (CPU, M <= 4 rows of x, every block type but Q8_1 / Q8_K): x's rows are quantized once per call to
// 8-bit blocks (q8_0-style per 32, q8_K per 256 for the K-quants and IQ4_XS; quant_dot.h) and each W block
// is multiplied by all of them in integers, straight from its bytes; threads split W's rows. The result
// differs from linear(x, dequantize(w)) by the activation rounding: per output at most
// sum_k |w_k| * d_x(k) * (1/2 + f32 rounding), d_x = the block's max|x| / 127.
//
// Otherwise (more rows, and Q8_1 / Q8_K weights): W is dequantized tile by tile into thread-local f32
// buffers (never as a whole: the extra memory is one tile, <= ~1 MiB, per thread) by the block dtype's row
// routine (dequant.cpp: AVX-512 / AVX2 for every type but Q2_K / Q3_K, bit-exact with ggml, chosen like
// the GEMM's kernel set), and each tile is one gemm::run over the matching output columns:
//  * M <= 16 rows of x (5..16, or any M for Q8_1 / Q8_K weights): tiles of ~48 KiB (8-64 rows of W), the
//    pool's threads taking whole tiles; each thread dequantizes a tile and at once runs the GEMM's
//    dot-product path on it (inline on that thread) while it is in L1/L2. W is read once, at its quantized
//    size. The outputs are summed exactly as linear(x, dequantize(w)) sums them: bit-identical to it, for
//    any tiling or thread count.
//  * M > 16 (prefill): tiles of up to 128 rows (<= ~1 MiB), as many as a multiple of the thread count;
//    each thread runs the GEMM's packed path on its own tiles (one pool region per call, tiles taken
//    dynamically, L2-local). A short last tile joins the previous one (<= 16 rows would switch the GEMM
//    to its dot-product path, another summation order). The packed path sums each output over K in the
//    same order whatever the column range, so here too the result is bit-identical to
//    linear(x, dequantize(w)) and independent of the thread count (tests/python/test_quant_linear.py).
// x (and bias, out) may be f32, f16 or bf16: f16/bf16 are widened to f32 once, accumulated in f32 and
// rounded once to x's dtype, like linear.
#pragma once
#include <optional>
#include <vector>

#include "core/tensor.h"

namespace tallow::ops {

Tensor quant_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias = std::nullopt,
                    const std::optional<Tensor>& out = std::nullopt);

// x [..., K] @ [parts[0]; parts[1]; ...]^T (+ bias [sum N_i]) -> out [..., sum N_i]: the parts of a fused
// layer (qkv, gate_up) kept as separate tensors [N_i, K] (each a zero-copy view of a GGUF file), possibly of
// different block types (Q4_K_M's q/k Q4_K beside v Q6_K). Bit-identical to concatenating quant_linear(x,
// parts[i], bias_i) along the last dim. CPU decode (M <= 4, every part with a quantized dot kernel): x is
// quantized once per activation format the parts need, and one parallel region covers all parts' rows (the
// thread pool wakes once per layer, not once per part); otherwise one quant_linear per part into its columns.
// CPU only: on another device a ValueError (callers use a fused weight or one quant_linear per part there).
Tensor quant_linear_parts(const Tensor& x, const std::vector<Tensor>& parts,
                          const std::optional<Tensor>& bias = std::nullopt,
                          const std::optional<Tensor>& out = std::nullopt);

}  // namespace tallow::ops
