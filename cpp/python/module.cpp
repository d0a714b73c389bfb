// tallow._core: the pybind11 module. Errors from the core become Python exceptions of the same name.
#include <pybind11/pybind11.h>

#include "core/error.h"
#include "core/parallel.h"

namespace py = pybind11;

void bind_tensor(py::module_& m);
void bind_ops(py::module_& m);
void bind_backends(py::module_& m);
void bind_cuda(py::module_& m);
void bind_paged_attention(py::module_& m);
void bind_rope_cache(py::module_& m);
void bind_sampling(py::module_& m);
void bind_random(py::module_& m);
void bind_gated_linear(py::module_& m);
void bind_tuning(py::module_& m);
void bind_quant_linear(py::module_& m);
void bind_quantize(py::module_& m);

PYBIND11_MODULE(_core, m) {
  m.doc() = "tallow's C++ core: tensors and ops";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tallow::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const tallow::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const tallow::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const tallow::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });
  m.def("get_num_threads", &tallow::get_num_threads, "Threads used by CPU kernels");
  m.def("set_num_threads", &tallow::set_num_threads, py::arg("n"),
        "Set the threads used by CPU kernels (n <= 0: all cores, or TALLOW_NUM_THREADS)");
  bind_tensor(m);
  bind_ops(m);
  bind_paged_attention(m);
  bind_rope_cache(m);
  bind_sampling(m);
  bind_random(m);
  bind_backends(m);
  bind_cuda(m);
  bind_gated_linear(m);
  bind_tuning(m);
  bind_quant_linear(m);
  bind_quantize(m);
}
