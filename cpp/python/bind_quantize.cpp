// Python signature of quantize (tallow._core; see cpp/ops/quantize.h).
#include <pybind11/pybind11.h>

#include "ops/quantize.h"
#include "python/convert.h"

namespace py = pybind11;
using namespace tallow;

void bind_quantize(py::module_& m) {
  m.def(
      "quantize", [](const Tensor& x, const py::object& d) { return ops::quantize(x, py_convert::to_dtype(d)); },
      py::arg("x"), py::arg("dtype"),
      "float x [..., K] -> the same shape in a GGUF block dtype (a DType or a name: q4_0, q4_1, q5_0, q5_1, q8_0, "
      "q8_1, q2_k, q3_k, q4_k, q5_k, q6_k, q8_k, iq4_nl, iq4_xs) on x's device; gguf-py's / llama.cpp's reference quantizers, bit "
      "for bit, the same bytes on CPU and CUDA");
}
