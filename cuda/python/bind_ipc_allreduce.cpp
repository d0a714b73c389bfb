// tallow._core.cuda.IpcAllReduce: the one-shot all-reduce over CUDA IPC buffers (cuda/ipc_allreduce.h),
// for tensor parallelism's small messages. Called from bind_cuda() in a CUDA build.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "ipc_allreduce.h"

namespace py = pybind11;

void bind_ipc_allreduce(py::module_& c) {
  using tallow::cuda::IpcAllReduce;
  py::class_<IpcAllReduce>(c, "IpcAllReduce",
                           "One-shot in-place sum over `world_size` processes, one GPU each, through CUDA IPC "
                           "buffers of `max_bytes` a phase. Each rank makes one, sends handle() to the others, "
                           "calls open() with every rank's handle in rank order, then all ranks call "
                           "all_reduce() with tensors of the same size in the same order (graph-capturable; "
                           "the same bits on every rank). Messages of up to max_bytes only: check supports().")
      .def(py::init<int, int, int, size_t>(), py::arg("device"), py::arg("rank"), py::arg("world_size"),
           py::arg("max_bytes"))
      .def("handle", [](const IpcAllReduce& a) { return py::bytes(a.handle()); },
           "This rank's CUDA IPC memory handle (64 bytes)")
      .def("open", &IpcAllReduce::open, py::arg("handles"),
           "Map every other rank's buffers; `handles`: every rank's handle() in rank order, this one's included")
      .def("supports", &IpcAllReduce::supports, py::arg("t"),
           "True when t can be reduced here: CUDA on this device, contiguous, 16-byte aligned, "
           "float32/float16/bfloat16, nbytes <= max_bytes and a multiple of 16, and open() was called")
      .def("unsupported_reason", &IpcAllReduce::unsupported_reason, py::arg("t"),
           "Why supports(t) is False ('' when it is True)")
      .def("all_reduce", [](IpcAllReduce& a, tallow::Tensor& t) { a.all_reduce(t); }, py::arg("t"),
           "In place on the current stream of t's device: t becomes the sum over the ranks (f32 in rank order)")
      .def_property_readonly("device", &IpcAllReduce::device)
      .def_property_readonly("rank", &IpcAllReduce::rank)
      .def_property_readonly("world_size", &IpcAllReduce::world_size)
      .def_property_readonly("max_bytes", &IpcAllReduce::max_bytes)
      .def_property_readonly("opened", &IpcAllReduce::opened);
}
