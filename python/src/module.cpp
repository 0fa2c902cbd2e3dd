// tdshm._C: the Python binding of the shm backend (this file) and of the prepared transfer
// (transfer.cpp).
//
// ProcessGroupShm is bound as a subclass of torch's own torch._C._distributed_c10d.ProcessGroup
// binding, with c10::intrusive_ptr as holder (as torch binds it), so that torch.distributed
// treats it as any other backend: dist.send/recv/isend/irecv and the collectives call the
// virtual methods of c10d::ProcessGroup, which dispatch to ours. This works because torch's
// extension and this one share pybind11's type registry (same pybind11 internals: the module
// is built with the pybind11 torch was built with, and the same C++ ABI).
//
// Every call that can wait (the rendezvous) releases the GIL: the other ranks may be threads of
// this interpreter's process, and torch's own bindings release it the same way.

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <torch/csrc/utils/pybind.h>  // the intrusive_ptr holder declaration torch's bindings use

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#ifndef TDSHM_VERSION
#error "TDSHM_VERSION must be defined by the build"
#endif

namespace py = pybind11;

void bind_transfer(py::module_& m);  // transfer.cpp

namespace {

tdshm::ShmOptions options_with(std::chrono::milliseconds timeout) {
  tdshm::ShmOptions options;
  options.timeout = timeout;
  return options;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tdshm: the shared-memory process group for torch.distributed (backend \"shm\")";
  // Registers torch's c10d bindings (ProcessGroup, Store) before we derive from them.
  py::module_::import("torch.distributed");

  py::class_<tdshm::ProcessGroupShm, c10::intrusive_ptr<tdshm::ProcessGroupShm>, c10d::ProcessGroup>(
      m, "ProcessGroupShm",
      "A process group over one shared-memory segment on this host. Point to point: send, recv "
      "(also recv_anysource). Collectives: broadcast, barrier, allreduce, allreduce_coalesced, reduce, "
      "allgather, _allgather_base, gather, scatter, reduce_scatter, _reduce_scatter_base and alltoall_base "
      "(torch.distributed's all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single are the "
      "_base ones). alltoall (lists of tensors), allgather_coalesced and monitored_barrier raise "
      "RuntimeError, as does a reduce op the dtype does not have, or PREMUL_SUM.")
      .def(py::init([](const std::string& name, int rank, int size, std::chrono::milliseconds timeout) {
             return c10::make_intrusive<tdshm::ProcessGroupShm>(name, rank, size, options_with(timeout));
           }),
           py::arg("name"), py::arg("rank"), py::arg("size"),
           py::arg("timeout") = std::chrono::milliseconds(std::chrono::minutes(30)),
           py::call_guard<py::gil_scoped_release>(),
           "Joins (or creates) the segment /dev/shm/tdshm.<name> as `rank` of `size` and waits for every "
           "rank, at most `timeout` (a datetime.timedelta).")
      .def_property_readonly("segment_name", &tdshm::ProcessGroupShm::segment_name,
                             "The segment's name (the file is /dev/shm/tdshm.<segment_name>).");

  m.def(
      "_create_shm_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
        return tdshm::make_shm_group_from_store(store, rank, size, options_with(timeout));
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
      "The creator torch.distributed calls for backend \"shm\": (prefix store, group rank, group size, timeout).");

  bind_transfer(m);
  m.attr("__version__") = TDSHM_VERSION;
}
