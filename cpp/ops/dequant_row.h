// Row-level GGUF dequantization shared by dequantize, embedding (quantized token tables) and,
// later, quantized GEMMs: n logical elements (a multiple of the block size) of block dtype
// `dtype` starting at `src` become n floats at `dst`, bit-exact with ggml's dequantize_row_*.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace tallow::ops {

void dequantize_row_f32(DType dtype, const void* src, float* dst, int64_t n);

}  // namespace tallow::ops
