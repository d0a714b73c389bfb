// tallow._core.cuda in a build without the CUDA backend: it says so (is_available() is False and the
// rest raises RuntimeError naming the reason). A CUDA build compiles cuda/python/bind_cuda.cpp instead
// (CMakeLists.txt), so nothing in cpp/ includes cuda/.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace py = pybind11;

void bind_cuda(py::module_& m) {
  py::module_ c = m.def_submodule("cuda", "CUDA runtime: devices, memory, streams, events, graphs");
  c.attr("built") = false;
  c.def("is_available", [] { return false; });
  c.def("device_count", [] { return 0; });
  const char* why = "this build of tallow has no CUDA backend (built without nvcc and cuBLAS, or with TALLOW_CUDA=OFF)";
  for (const char* name : {"current_device", "set_device", "mem_get_info", "synchronize", "get_device_properties",
                           "memory_stats", "reset_peak_memory_stats", "empty_cache", "empty_pinned", "copy_to_host_async", "current_stream",
                           "set_current_stream", "default_stream", "graph_pool_handle", "Stream", "Event",
                           "CUDAGraph"}) {
    std::string msg = std::string(name) + ": " + why;
    c.def(name, [msg](py::args, py::kwargs) -> py::object { throw std::runtime_error(msg); });
  }
}
