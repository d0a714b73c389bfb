// Casts between float dtypes (f32, f16, bf16, f8e4m3; also from/to i32/i64/u8/i8/bool) and
// dequantization of GGUF block types.
#pragma once
#include "core/tensor.h"

namespace tallow::ops {

// Any strides in; contiguous out. Block dtypes in -> dequantize(x, dtype).
Tensor cast(const Tensor& x, DType dtype);
// Block-typed [..., K] -> float [..., K] (f32, f16 or bf16), bit-exact with ggml's dequantizers in f32.
Tensor dequantize(const Tensor& q, DType dtype = DType::F32);

}  // namespace tallow::ops
