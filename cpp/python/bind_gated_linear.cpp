// Python signature of gated_linear (tallow._core.gated_linear; see cpp/ops/gated_linear.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops/gated_linear.h"

namespace py = pybind11;
using namespace tallow;

void bind_gated_linear(py::module_& m) {
  m.def("gated_linear", &ops::gated_linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::arg("activation") = "silu", py::arg("out") = py::none(),
        "linear(act(x[..., :K]) * x[..., K:], w, bias) for x [..., 2K], w [N, K]; activation 'silu', "
        "'gelu_tanh' or 'gelu' (erf). The product is rounded to x's dtype first, as silu_and_mul rounds it");
}
