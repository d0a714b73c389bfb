// Python signature of rope_and_cache (tallow._core); see cpp/ops/rope_cache.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops/rope_cache.h"

namespace py = pybind11;
using namespace tallow;

void bind_rope_cache(py::module_& m) {
  m.def("rope_and_cache", &ops::rope_and_cache, py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("cos_sin_cache"), py::arg("neox"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("q_norm_weight") = py::none(), py::arg("k_norm_weight") = py::none(), py::arg("norm_eps") = 1e-6f,
        py::arg("gemma_norm") = false, py::arg("k_scale") = 1.0f, py::arg("v_scale") = 1.0f,
        "In place: optional per-head RMSNorm of q [T, Hq, D] and k [T, Hk, D] (weights [D]; gemma_norm: 1 + w), "
        "rotary embedding of both, and the write of k and v [T, Hk, Dv] into slots slot_mapping[t] of the paged "
        "caches (negative slots skipped; float8_e4m3 caches store value / scale). Exactly rms_norm, "
        "rotary_embedding and reshape_and_cache in order; one kernel on CUDA");
}
