// tallow._core.cuda in a CUDA build: the CUDA runtime (devices, memory statistics, streams, events,
// graphs) and the backend's own switches. Compiled into the extension only when the CUDA backend is
// built (CMakeLists.txt); cpp/python/bind_cuda.cpp is the stand-in of CPU-only builds. Importing
// tallow._core registers the backend (init(): allocator, copies, op table).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "gemv.cuh"
#include "host_async.h"
#include "ops_cuda.h"
#include "runtime.h"

namespace py = pybind11;

void bind_nccl(py::module_& c);           // bind_nccl.cpp
void bind_ipc_allreduce(py::module_& c);  // bind_ipc_allreduce.cpp

namespace {

using namespace tallow::cuda;

py::dict stats_dict(const MemoryStats& s) {
  py::dict d;
  d["allocated_bytes"] = s.allocated_bytes;
  d["requested_bytes"] = s.requested_bytes;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_allocated_bytes"] = s.peak_allocated_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["num_cache_hits"] = s.num_cache_hits;
  d["num_device_mallocs"] = s.num_device_mallocs;
  d["num_device_frees"] = s.num_device_frees;
  d["cached_bytes"] = s.cached_bytes;
  d["graph_pool_bytes"] = s.graph_pool_bytes;
  d["pinned_bytes_reserved"] = pinned_bytes_reserved();
  return d;
}

StreamHandle handle_of(const py::object& s, int device = -1) {
  if (s.is_none()) return current_stream(device);
  return s.cast<std::shared_ptr<Stream>>()->handle();
}

}  // namespace

void bind_cuda(py::module_& m) {
  py::module_ c = m.def_submodule("cuda", "CUDA runtime: devices, memory, streams, events, graphs");
  init();
  c.attr("built") = true;
  bind_nccl(c);
  bind_ipc_allreduce(c);
  c.def("is_available", &is_available, "True when a CUDA driver and at least one device are present");
  c.def("device_count", &device_count);
  c.def("current_device", &current_device);
  c.def("set_device", &set_device, py::arg("device"));
  c.def("mem_get_info", &mem_get_info, py::arg("device") = -1, "(free, total) bytes of the device");
  c.def("synchronize", &synchronize, py::arg("device") = -1, py::call_guard<py::gil_scoped_release>());
  c.def("get_device_properties", [](int device) {
    const DeviceProperties p = device_properties(device);
    py::dict d;
    d["name"] = p.name;
    d["major"] = p.major;
    d["minor"] = p.minor;
    d["multi_processor_count"] = p.multiprocessors;
    d["total_memory"] = p.total_memory;
    d["l2_cache_size"] = p.l2_cache_bytes;
    d["shared_memory_per_block_optin"] = p.shared_memory_per_block_optin;
    d["memory_bus_width"] = p.memory_bus_width;
    return d;
  }, py::arg("device") = -1);
  c.def("memory_stats", [](int device) { return stats_dict(memory_stats(device)); }, py::arg("device") = -1);
  c.def("reset_peak_memory_stats", &reset_peak_memory_stats, py::arg("device") = -1);
  c.def("skinny_max_m", &skinny_max_m, "Rows up to which linear/matmul use tallow's skinny GEMM kernel");
  c.def("set_skinny_max_m", &set_skinny_max_m, py::arg("m"), "0 sends every product to cuBLASLt");
  c.def("index_checks", &index_checks);
  c.def("set_index_checks", &set_index_checks, py::arg("on"),
        "Validate positions/ids/slots/block ids on the device and raise before returning (default on)");
  c.def("set_gemv_config", &set_gemv_config, py::arg("spec"),
        "Override the decode GEMV launch config ('warps=8,split=2,...'; '' restores the heuristic); "
        "also kernel_tuning()['gemv_config']");
  c.def("gemv_config", &gemv_config, py::arg("m"), py::arg("n"), py::arg("k"),
        "The decode GEMV launch config chosen for an [m, k] x [n, k]^T product");
  c.def("empty_pinned", [](const tallow::Shape& shape, const py::object& dtype) {
    return empty_pinned(shape, py::module_::import("tallow._core").attr("dtype")(dtype).cast<tallow::DType>());
  }, py::arg("shape"), py::arg("dtype") = "float32", "A CPU tensor in page-locked memory (fast, asynchronous copies)");
  c.def("copy_to_host_async", &copy_to_host_async, py::arg("dst"), py::arg("src"),
        "Queue src (CUDA, contiguous) -> dst (CPU, pinned) on the current stream without waiting; "
        "record an Event after it and synchronize that before reading dst");
  c.def("empty_cache", &empty_cache, "Return cached device blocks (not graph pools') to the driver");

  py::class_<Stream, std::shared_ptr<Stream>>(c, "Stream", "A CUDA stream (non-blocking)")
      .def(py::init([](int device, int priority) { return std::make_shared<Stream>(device, priority); }),
           py::arg("device") = -1, py::arg("priority") = 0)
      .def_property_readonly("handle", [](const Stream& s) { return (uintptr_t)s.handle(); })
      .def_property_readonly("device", &Stream::device)
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Stream::query)
      .def("wait_stream", &Stream::wait_stream, py::arg("other"))
      .def("set_private_scratch", [](const Stream& s) { set_private_scratch(s.handle()); },
           "Give this stream its own cuBLASLt workspace and decode-attention counters (for ops that run "
           "concurrently with another stream's)")
      .def("wait_event", [](const Stream& s, const Event& e) { e.wait(s.handle()); }, py::arg("event"))
      .def("__eq__", [](const Stream& a, const Stream& b) { return a.handle() == b.handle(); })
      .def("__hash__", [](const Stream& s) { return (uintptr_t)s.handle(); })
      .def("__repr__", [](const Stream& s) {
        return "<tallow.cuda.Stream device=cuda:" + std::to_string(s.device()) + " handle=" +
               std::to_string((uintptr_t)s.handle()) + ">";
      });
  c.def("current_stream", [](int device) { return Stream::wrap(current_stream(device), device); },
        py::arg("device") = -1);
  c.def("set_current_stream", [](const std::shared_ptr<Stream>& s) { set_current_stream(s->handle(), s->device()); },
        py::arg("stream"));
  c.def("default_stream", [](int device) { return Stream::wrap(nullptr, device); }, py::arg("device") = -1);

  py::class_<Event, std::shared_ptr<Event>>(c, "Event", "A CUDA event")
      .def(py::init<bool>(), py::arg("enable_timing") = false)
      .def("record", [](Event& e, const py::object& s) { e.record(handle_of(s)); }, py::arg("stream") = py::none())
      .def("wait", [](const Event& e, const py::object& s) { e.wait(handle_of(s)); }, py::arg("stream") = py::none())
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Event::query)
      .def("elapsed_time", &Event::elapsed_ms, py::arg("end"), "Milliseconds from this event to `end`");

  py::class_<GraphPool, std::shared_ptr<GraphPool>>(c, "GraphPool", "Memory pool owned by CUDA graphs");
  c.def("graph_pool_handle", [](int device) { return new_graph_pool(device); }, py::arg("device") = -1);

  py::class_<Graph>(c, "CUDAGraph", "A captured sequence of CUDA work, replayable")
      .def(py::init<>())
      .def("capture_begin",
           [](Graph& g, const std::shared_ptr<Stream>& s, const std::shared_ptr<GraphPool>& pool) {
             g.capture_begin(s->handle(), pool);
           },
           py::arg("stream"), py::arg("pool") = nullptr)
      .def("capture_end", &Graph::capture_end)
      .def("replay", [](Graph& g, const py::object& s) { g.replay(handle_of(s)); }, py::arg("stream") = py::none(),
           "Launch the captured work on `stream` (default: the current stream)")
      .def("reset", &Graph::reset)
      .def("pool", &Graph::pool)
      .def_property_readonly("captured", &Graph::captured)
      .def_property_readonly("num_nodes", &Graph::num_nodes);
}
