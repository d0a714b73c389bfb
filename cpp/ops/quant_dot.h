// Quantized dot products for quant_linear's decode path (few rows of x): the rows of x are quantized once
// per call to 8-bit blocks, and each W block is multiplied by them in integers, straight from its GGUF bytes.
//
// Activation formats (the one a weight type pairs with, as in llama.cpp):
//  * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: per 32 elements {f32 d, f32 s = d * sum(q), i8 q[32]} (Act32);
//    s carries the min term of Q4_1 / Q5_1.
//  * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: per 256 elements {f32 d, i16 bsums[16], i8 q[256]} (Act256, q8_K);
//    the 16-element sums carry the K-quants' min terms.
// q = round(x / d), d = max|x| / 127 over the block (0 for an all-zero block): |x - d q| <= d / 2.
//
// The dot of one W block with one activation block is exact in int32 (every W type's integer quant times
// its integer sub-scale times q stays far below 2^31 over 256 elements), scaled once to f32 per block.
// Kernel sets (chosen like the GEMM's, gemm::isa_name()): "avx512" = AVX2 code plus 256-bit VNNI
// (vpdpbusd, AVX512-VNNI + VL) where the CPU has it, "avx2" = maddubs/madd, "portable" = scalar C++
// (also the aarch64 build; see quant_dot.cpp for NEON).
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace tallow::ops::qdot {

// True when dtype has a decode kernel here (the others keep the dequantized-tile path).
bool supported(DType w);
// Elements per activation block for weight dtype w (32 or 256) and bytes per quantized row of K elements.
int64_t act_block(DType w);
int64_t act_row_bytes(DType w, int64_t K);
// Quantizes M rows of x (f32, row stride rsx, K elements each, K a multiple of act_block(w)) into dst,
// one act_row_bytes(w, K) row after another.
void quantize_rows(DType w, const float* x, int64_t rsx, int64_t M, int64_t K, uint8_t* dst);
// out[m * rso + n] = dot(x_m, w_n) (+ bias[n * bstride]) for m < M (any; quant_linear uses <= 4) and n in
// [n0, n1). Row n of W starts at wbase + n * wrs bytes (K elements in whole blocks). act: quantize_rows' output.
void dot_rows(DType w, const uint8_t* wbase, int64_t wrs, int64_t n0, int64_t n1, const uint8_t* act, int64_t M,
              int64_t K, float* out, int64_t rso, const float* bias, int64_t bstride);
// The kernel set dot_rows uses ("avx512-vnni", "avx2", "portable").
const char* kernel_name();

}  // namespace tallow::ops::qdot
