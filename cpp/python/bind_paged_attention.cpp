// Python signatures of paged attention and the KV-cache write (tallow._core); see cpp/ops/paged_attention.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops/paged_attention.h"

namespace py = pybind11;
using namespace tallow;

void bind_paged_attention(py::module_& m) {
  m.def("reshape_and_cache", &ops::reshape_and_cache, py::arg("k"), py::arg("v"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::arg("k_scale") = 1.0f, py::arg("v_scale") = 1.0f,
        "Writes k [T, Hk, D] / v [T, Hk, Dv] into flat slots slot_mapping[t] of the paged caches, in place "
        "(negative slots are skipped; values are converted to the caches' dtype; float8_e4m3 caches store "
        "value / k_scale and value / v_scale)");
  m.def("paged_attention", &ops::paged_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("softcap") = 0.0f, py::arg("out") = py::none(),
        py::arg("k_scale") = 1.0f, py::arg("v_scale") = 1.0f, py::arg("settled_cache") = false,
        "Causal attention of q [T, Hq, D] (the last query_start_loc[b+1] - query_start_loc[b] tokens of each "
        "sequence b) over the paged KV cache; returns [T, Hq, Dv] in q's dtype. float8_e4m3 caches are read "
        "as stored * k_scale / stored * v_scale. settled_cache=True promises that no kernel still running when the "
        "call starts writes cache rows before each sequence's new tokens (true right after rope_and_cache / "
        "reshape_and_cache): the CUDA decode kernel then reads them early");
}
