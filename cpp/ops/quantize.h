// quantize: float x [..., K] -> the same shape in a GGUF block dtype, on x's device.
//
// x is float32, float16 or bfloat16 with any strides (a last dim that is not contiguous is copied first);
// K must be a multiple of the block size (ValueError naming the op, the shape and the type). Supported:
// q4_0, q4_1, q5_0, q5_1, q8_0, q8_1, q2_k, q3_k, q4_k, q5_k, q6_k, q8_k, iq4_nl, iq4_xs (another dtype:
// TypeError).
// Every block is quantized by ops/quantize_block.h, the one implementation the CUDA kernel
// (cuda/quantize.cu, BackendOps::quantize) compiles too, so CPU and CUDA give the same bytes:
//   q4_0 .. q8_0: bit for bit gguf-py's gguf.quants.quantize (tested);
//   q8_1, k-quants, iq4_nl, iq4_xs: llama.cpp's quantizers without an importance matrix (quantize_row_*_ref;
//   for iq4: quantize_iq4_nl / _xs as ggml_quantize_chunk runs them), the same float operations in
//   the same order; tests compare the bytes with llama.cpp's ggml_quantize_chunk when llama-cpp-python
//   is installed.
// f16/bf16 inputs are widened to f32 exactly first. The CPU runs blocks in parallel (core/parallel.h).
#pragma once
#include "core/tensor.h"

namespace tallow::ops {

Tensor quantize(const Tensor& x, DType dtype);

}  // namespace tallow::ops
