// Python signature of the random fill (tallow._core.fill_uniform_); see cpp/ops/random.h.
#include <pybind11/pybind11.h>

#include "ops/random.h"

namespace py = pybind11;
using namespace tallow;

void bind_random(py::module_& m) {
  m.def("fill_uniform_", [](Tensor& t, float low, float high, uint64_t seed) -> Tensor {
    return ops::fill_uniform_(t, low, high, seed);
  }, py::arg("t"), py::arg("low") = 0.0f, py::arg("high") = 1.0f, py::arg("seed") = 0,
     "Fills t (float32/float16/bfloat16, contiguous, any device) in place with values uniform in [low, high] from a "
     "counter-based hash of (seed, element index): the same values on every device and thread count. Returns t");
}
