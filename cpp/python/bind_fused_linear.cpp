// Python signatures of rms_norm_linear, linear_add and gated_linear_add (tallow._core; see
// cpp/ops/fused_linear.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops/fused_linear.h"

namespace py = pybind11;
using namespace tallow;

void bind_fused_linear(py::module_& m) {
  m.def("rms_norm_linear", &ops::rms_norm_linear, py::arg("x"), py::arg("norm_w"), py::arg("eps"),
        py::arg("gemma_offset"), py::arg("w"), py::arg("bias") = py::none(),
        "linear(rms_norm(x, norm_w, eps, gemma_offset), w, bias); one GEMV on CUDA for decode shapes");
  m.def("linear_add", &ops::linear_add, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("residual"),
        "residual += linear(x, w, bias) in place (the product rounded first); returns residual");
  m.def("gated_linear_add", &ops::gated_linear_add, py::arg("x"), py::arg("w"), py::arg("bias"),
        py::arg("activation"), py::arg("residual"),
        "residual += gated_linear(x, w, bias, activation) in place; returns residual");
}
