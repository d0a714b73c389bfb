// Python signature of quant_linear (tallow._core; see cpp/ops/quant_linear.h), and the CPU kernel-set
// switch that its tests use to run the scalar reference row routines next to the vectorized ones.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "ops/gemm_kernel.h"
#include "ops/quant_dot.h"
#include "ops/quant_linear.h"

namespace py = pybind11;
using namespace tallow;

void bind_quant_linear(py::module_& m) {
  m.def("quant_linear", &ops::quant_linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::arg("out") = py::none(),
        "x [..., K] @ dequantize(w [N, K])^T (+ bias [N]) -> [..., N] in x's dtype, w kept in its GGUF block "
        "format (a float w: plain linear); CPU: 8-bit quantized x and integer dots for <= 16 rows of x");
  m.def("quant_linear_parts", &ops::quant_linear_parts, py::arg("x"), py::arg("parts"),
        py::arg("bias") = py::none(), py::arg("out") = py::none(),
        "x [..., K] @ [parts[0]; parts[1]; ...]^T (+ bias) -> [..., sum N_i]: quant_linear over the parts of a "
        "fused layer kept apart (block types may differ), one parallel region for all (CPU only)");
  m.def("_cpu_isa", [] { return std::string(ops::gemm::isa_name()); },
        "The CPU kernel set in use by the GEMM and the dequantization row routines (avx512, avx2, portable)");
  m.def("_quant_dot_kernel", [] { return std::string(ops::qdot::kernel_name()); },
        "The kernel set quant_linear's decode path uses (avx512-vnni, avx2, portable; follows _cpu_isa)");
  m.def("_set_cpu_isa", [](const std::string& name) { return ops::gemm::set_isa(name.c_str()); }, py::arg("name"),
        "Switch the CPU kernel set (tests and comparisons); False when this CPU or build lacks it");
}
