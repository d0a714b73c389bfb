// Python signatures of the core ops (tallow._core.<op>). Keyword names follow the C++ headers in cpp/ops.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops/ops.h"
#include "ops/token_ids.h"
#include "python/convert.h"

namespace py = pybind11;
using namespace tallow;
using tallow::py_convert::to_dtype;
using OptT = std::optional<Tensor>;

void bind_ops(py::module_& m) {
  m.def("cast", [](const Tensor& x, const py::object& d) { return ops::cast(x, to_dtype(d)); }, py::arg("x"),
        py::arg("dtype"));
  m.def("dequantize", [](const Tensor& q, const py::object& d) { return ops::dequantize(q, to_dtype(d)); },
        py::arg("q"), py::arg("dtype") = "float32");
  m.def("add", &ops::add, py::arg("a"), py::arg("b"), py::arg("out") = py::none());
  m.def("mul", &ops::mul, py::arg("a"), py::arg("b"), py::arg("out") = py::none());
  m.def("scale", &ops::scale, py::arg("a"), py::arg("s"), py::arg("out") = py::none());
  m.def("matmul", &ops::matmul, py::arg("a"), py::arg("b"), py::arg("out") = py::none());
  m.def("linear", &ops::linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("out") = py::none());
  m.def("embedding", [](const Tensor& ids, const Tensor& table, const py::object& d, std::optional<int64_t> start) {
    return ops::embedding(ids, table, d.is_none() ? std::nullopt : std::optional<DType>(to_dtype(d)), start);
  }, py::arg("ids"), py::arg("table"), py::arg("dtype") = py::none(), py::arg("vocab_start") = py::none(),
     "table rows by id; vocab_start: a vocabulary slice's rows, ids outside it give zero rows");
  m.def("rms_norm", &ops::rms_norm, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("gemma_offset") = false,
        py::arg("out") = py::none());
  m.def("fused_add_rms_norm", &ops::fused_add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("w"),
        py::arg("eps"), py::arg("gemma_offset") = false,
        "residual += x in place; returns rms_norm(residual)");
  m.def("layer_norm", &ops::layer_norm, py::arg("x"), py::arg("w") = py::none(), py::arg("b") = py::none(),
        py::arg("eps") = 1e-5f, py::arg("out") = py::none());
  m.def("rotary_embedding", [](const Tensor& pos, Tensor q, OptT k, const Tensor& cache, bool neox) {
    ops::rotary_embedding(pos, q, k, cache, neox);
  }, py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("cos_sin_cache"), py::arg("neox") = true,
     "Rotates q and k in place");
  m.def("silu_and_mul", &ops::silu_and_mul, py::arg("x"), py::arg("out") = py::none());
  m.def("gelu_and_mul", &ops::gelu_and_mul, py::arg("x"), py::arg("approximate") = "tanh", py::arg("out") = py::none());
  m.def("softmax", &ops::softmax, py::arg("x"), py::arg("scale") = 1.0f, py::arg("softcap") = 0.0f,
        py::arg("out") = py::none());
  m.def("attention", &ops::attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
        py::arg("causal") = true, py::arg("sliding_window") = 0, py::arg("softcap") = 0.0f);
  m.def("argmax", &ops::argmax, py::arg("x"));
  m.def("topk", &ops::topk, py::arg("x"), py::arg("k"));
  m.def("fill_from_previous_", &ops::fill_from_previous_, py::arg("ids"), py::arg("previous"),
        "In place: ids[t] < 0 becomes previous[-ids[t] - 1] (tokens sampled by the previous step, still on the device)");
}
