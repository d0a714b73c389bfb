// Page-locked host tensors and device-to-host copies that do not wait: the engine copies a step's
// sampled token ids into pinned memory, records an event, and reads them only after the host has
// prepared the next step (overlapping host work with the GPU).
#pragma once
#include "core/tensor.h"

namespace tallow::cuda {

// A CPU tensor backed by page-locked memory (cudaHostAlloc), freed when its last view goes.
Tensor empty_pinned(const Shape& shape, DType dtype);

// Queue a copy of contiguous device tensor `src` into contiguous host tensor `dst` (same dtype and
// element count; dst should be pinned, else the driver makes it synchronous) on the current stream
// of src's device and return at once; record an Event after it to know when dst is valid.
void copy_to_host_async(const Tensor& dst, const Tensor& src);

}  // namespace tallow::cuda
