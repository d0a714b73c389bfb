// Python signature of gated_linear (tallow._core.gated_linear; see cpp/ops/gated_linear.h) and, in
// CUDA builds, the programmatic-dependent-launch switch (tallow._core.cuda.pdl_enabled / set_pdl_enabled).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops/gated_linear.h"
#ifdef TALLOW_WITH_CUDA
#include "gemv.cuh"
#include "pdl.cuh"
#endif

namespace py = pybind11;
using namespace tallow;

// Call after bind_cuda (it adds to the tallow._core.cuda submodule).
void bind_gated_linear(py::module_& m) {
  m.def("gated_linear", &ops::gated_linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::arg("activation") = "silu", py::arg("out") = py::none(),
        "linear(act(x[..., :K]) * x[..., K:], w, bias) for x [..., 2K], w [N, K]; activation 'silu', "
        "'gelu_tanh' or 'gelu' (erf). The product is rounded to x's dtype first, as silu_and_mul rounds it");
#ifdef TALLOW_WITH_CUDA
  py::module_ c = m.attr("cuda").cast<py::module_>();
  c.def("pdl_enabled", &cuda::pdl_enabled,
        "Whether kernels captured into CUDA graphs use programmatic dependent launch (sm_90+; TALLOW_PDL=0: off)");
  c.def("set_pdl_enabled", &cuda::set_pdl_enabled, py::arg("on"),
        "Turn programmatic dependent launch on or off for later launches and captures");
#endif
}
