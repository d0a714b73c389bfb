// Python signatures of the sampling ops (tallow._core); see cpp/ops/sampling.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/backend.h"
#include "ops/sampling.h"

namespace py = pybind11;
using namespace tallow;

void bind_sampling(py::module_& m) {
  m.def("apply_penalties", &ops::apply_penalties, py::arg("logits"), py::arg("token_ids"), py::arg("token_counts"),
        py::arg("repetition_penalty"), py::arg("frequency_penalty"), py::arg("presence_penalty"),
        "In place on logits f32 [B, V]: bans (count < 0), repetition, frequency and presence penalties for the "
        "ids listed per row in token_ids i32 [B, L] (-1: padding) with output counts token_counts i32 [B, L]");
  m.def("apply_token_bitmask_", &ops::apply_token_bitmask_, py::arg("logits"), py::arg("bitmask"),
        "In place: logits [B, V] -> -inf where bit j % 32 of bitmask i32 [B, W][b, j / 32] is 0 (a grammar's "
        "next-token mask)");
  m.def("sample_tokens", &ops::sample_tokens, py::arg("logits"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::arg("seeds"), py::arg("offsets"),
        "One token per row of logits [B, V] (i32 [B]): greedy below temperature 1e-5, else top-k, min-p, top-p "
        "and a seeded Gumbel-max draw keyed by (seeds[b], offsets[b])");
  m.def("logprobs", &ops::logprobs, py::arg("logits"), py::arg("token_ids"), py::arg("num_top") = 0,
        "log_softmax of logits [B, V]: (values f32 [B, 1 + num_top], ids i32 [B, 1 + num_top], ranks i32 [B]); "
        "column 0 is token_ids, then the num_top most probable tokens");
  m.def("_set_sampling_buffer_capacity", [](int n) {
    for (DeviceType t : {DeviceType::CUDA, DeviceType::Metal})
      if (const BackendOps* b = find_backend(t); b && b->set_sampling_buffer_capacity) b->set_sampling_buffer_capacity(n);
  }, py::arg("n"), "Testing: the device sampling kernels' candidate buffer size (n <= 0: the default)");
}
