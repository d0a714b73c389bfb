// Device-side strided copies (host-callable; no CUDA headers needed to include this).
#pragma once
#include "core/tensor.h"

namespace tallow::cuda {

// dst[...] = src[...] for two views of the same shape and dtype on the same device, any strides
// (block dtypes: whole blocks). Runs on `stream` (a cudaStream_t).
void strided_copy(const Tensor& dst, const Tensor& src, void* stream);

// A contiguous copy of t on its device (t itself when already contiguous).
Tensor contiguous(const Tensor& t);

}  // namespace tallow::cuda
