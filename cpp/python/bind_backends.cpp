// Which backends this build has and what CPU features the kernels were dispatched for.
#include <pybind11/pybind11.h>

#include "core/allocator.h"

namespace py = pybind11;

void bind_backends(py::module_& m) {
  py::dict info;
#ifdef TALLOW_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
#ifdef TALLOW_WITH_CUTLASS
  info["cutlass"] = true;
#else
  info["cutlass"] = false;
#endif
  info["metal"] = false;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  info["cpu_avx2"] = (bool)__builtin_cpu_supports("avx2");
  info["cpu_fma"] = (bool)__builtin_cpu_supports("fma");
  info["cpu_avx512f"] = (bool)__builtin_cpu_supports("avx512f");
#endif
  m.attr("build_info") = info;
  m.def(
      "cpu_memory_stats",
      [] {
        auto s = tallow::get_allocator(tallow::DeviceType::CPU)->stats();
        py::dict d;
        d["allocated_bytes"] = s.allocated_bytes;
        d["reserved_bytes"] = s.reserved_bytes;
        d["peak_allocated_bytes"] = s.peak_allocated_bytes;
        d["num_allocs"] = s.num_allocs;
        return d;
      },
      "Bytes held by tensors the CPU allocator made (reserved includes cached free blocks)");
  m.def("cpu_empty_cache", [] { tallow::get_allocator(tallow::DeviceType::CPU)->empty_cache(); },
        "Return the CPU allocator's cached free blocks to the system");
}
