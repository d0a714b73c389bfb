// Conversions shared by the binding files: Python dtype/device/shape arguments.
#pragma once
#include <pybind11/pybind11.h>

#include "core/tensor.h"

namespace tallow::py_convert {

// A DType, a name ("bf16", "q4_k", "float32") or a numpy dtype.
DType to_dtype(const pybind11::handle& obj);
// A Device or a string ("cpu", "cuda:0").
Device to_device(const pybind11::handle& obj);
// numpy dtype for a scalar DType numpy knows (float32, float16, int8, ...); nullopt otherwise.
pybind11::object numpy_dtype(DType dt);

}  // namespace tallow::py_convert
