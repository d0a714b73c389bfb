// tallow._core.cuda's NCCL bindings (cuda/nccl.h): load the library, make the unique id, and one
// rank's communicator. Calls that block on the other ranks (initialisation, abort) release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "nccl.h"

namespace py = pybind11;

void bind_nccl(py::module_& c) {
  using namespace tallow::cuda;
  c.def("nccl_load", &nccl_load, py::arg("path") = "", "Open libnccl (a path; '' tries libnccl.so.2)");
  c.def("nccl_loaded", &nccl_loaded);
  c.def("nccl_version", &nccl_version, "NCCL's version code, e.g. 22809 for 2.28.9");
  c.def("nccl_unique_id", [] { return py::bytes(nccl_unique_id()); }, "ncclGetUniqueId: 128 bytes for every rank");
  py::class_<NcclComm, std::shared_ptr<NcclComm>>(c, "NcclComm", "One rank's NCCL communicator")
      .def(py::init([](const py::bytes& id, int world_size, int rank, int device) {
             std::string s = id;
             py::gil_scoped_release nogil;
             return std::make_shared<NcclComm>(s, world_size, rank, device);
           }),
           py::arg("unique_id"), py::arg("world_size"), py::arg("rank"), py::arg("device"),
           "Blocks until every rank has joined (ncclCommInitRank)")
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("world_size", &NcclComm::world_size)
      .def_property_readonly("device", &NcclComm::device)
      .def("all_reduce", &NcclComm::all_reduce, py::arg("t"), "Sum over the ranks in place, on the current stream")
      .def("all_gather", &NcclComm::all_gather, py::arg("out"), py::arg("input"),
           "out (world_size x input's elements) gets every rank's input in rank order")
      .def("broadcast", &NcclComm::broadcast, py::arg("t"), py::arg("root"))
      .def("async_error", &NcclComm::async_error, "'' while healthy, else NCCL's description of the failure")
      .def("abort", &NcclComm::abort, py::call_guard<py::gil_scoped_release>());
}
