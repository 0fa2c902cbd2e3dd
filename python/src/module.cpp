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

#include <torch/csrc/Dtype.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>

#ifndef TDSHM_VERSION
#error "TDSHM_VERSION must be defined by the build"
#endif

namespace py = pybind11;

void bind_transfer(py::module_& m);      // transfer.cpp
void bind_board(py::module_& m);         // board.cpp
void bind_feed(py::module_& m);          // feed.cpp
void bind_task_ring(py::module_& m);     // task_ring.cpp
void bind_leaf_ids(py::module_& m);      // leaf_ids.cpp
void bind_answer_codec(py::module_& m);  // answer_codec.cpp

namespace {

// The loan heap's size from the environment (TDSHM_LOAN_BYTES, TDSHM_LOAN_TICKETS), for groups
// that torch.distributed creates (init_process_group, new_group), which take no options of ours.
tdshm::ShmOptions options_with(std::chrono::milliseconds timeout, std::optional<size_t> loan_bytes = std::nullopt,
                               std::optional<uint32_t> loan_tickets = std::nullopt) {
  tdshm::ShmOptions options;
  options.timeout = timeout;
  auto from_env = [](const char* name, uint64_t fallback) -> uint64_t {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return fallback;
    char* end = nullptr;
    errno = 0;
    const unsigned long long parsed = std::strtoull(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0') {
      throw tdshm::SegmentError(std::string(name) + "=" + v + " is not a number of bytes or tickets");
    }
    return parsed;
  };
  options.loan_bytes = loan_bytes ? *loan_bytes : static_cast<size_t>(from_env("TDSHM_LOAN_BYTES", options.loan_bytes));
  const uint64_t tickets = loan_tickets ? *loan_tickets : from_env("TDSHM_LOAN_TICKETS", options.loan_tickets);
  if (tickets > UINT32_MAX) throw tdshm::SegmentError("loan_tickets " + std::to_string(tickets) + " is too large");
  options.loan_tickets = static_cast<uint32_t>(tickets);
  // Python's tensordict transfers are tensordict's own: from_remote_init expects every byte in
  // the storage, gather_and_stack pickles.
  options.memmap_by_reference = false;
  options.tdshm_transfers = false;
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
      .def(py::init([](const std::string& name, int rank, int size, std::chrono::milliseconds timeout,
                       std::optional<size_t> loan_bytes, std::optional<uint32_t> loan_tickets,
                       std::optional<std::chrono::microseconds> spin, std::optional<uint32_t> slots_per_rank,
                       std::optional<size_t> window_bytes) {
             tdshm::ShmOptions options = options_with(timeout, loan_bytes, loan_tickets);
             if (spin) options.spin = *spin;
             if (slots_per_rank) options.slots_per_rank = *slots_per_rank;
             if (window_bytes) options.window_bytes = *window_bytes;
             return c10::make_intrusive<tdshm::ProcessGroupShm>(name, rank, size, options);
           }),
           py::arg("name"), py::arg("rank"), py::arg("size"),
           py::arg("timeout") = std::chrono::milliseconds(std::chrono::minutes(30)), py::arg("loan_bytes") = py::none(),
           py::arg("loan_tickets") = py::none(), py::kw_only(), py::arg("spin") = py::none(),
           py::arg("slots_per_rank") = py::none(), py::arg("window_bytes") = py::none(),
           py::call_guard<py::gil_scoped_release>(),
           "Joins (or creates) the segment /dev/shm/tdshm.<name> as `rank` of `size` and waits for every "
           "rank, at most `timeout` (a datetime.timedelta). loan_bytes / loan_tickets: each rank's loan heap "
           "(default: $TDSHM_LOAN_BYTES or 1 MiB, $TDSHM_LOAN_TICKETS or 64); every rank must give the same, "
           "as for slots_per_rank (64) and window_bytes (1 MiB: the collectives' window). spin (a timedelta, "
           "default 250 us): how long a wait spins before it sleeps.")
      .def(
          "loan",
          [](tdshm::ProcessGroupShm& pg, std::vector<int64_t> shape, py::object dtype) {
            if (!THPDtype_Check(dtype.ptr())) throw tdshm::TypeError("loan: dtype must be a torch.dtype");
            const at::ScalarType st = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
            py::gil_scoped_release nogil;
            return pg.loan(shape, st);
          },
          py::arg("shape"), py::arg("dtype"),
          "A tensor whose bytes live in this rank's loan heap: sent to a rank of this group it goes by "
          "reference, and the send completes once the receiver no longer reads it (tdshm.empty).")
      .def(
          "try_loan",
          [](tdshm::ProcessGroupShm& pg, std::vector<int64_t> shape, py::object dtype) -> std::optional<at::Tensor> {
            if (!THPDtype_Check(dtype.ptr())) throw tdshm::TypeError("try_loan: dtype must be a torch.dtype");
            const at::ScalarType st = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
            at::Tensor t;
            {
              py::gil_scoped_release nogil;
              t = pg.try_loan(shape, st);
            }
            if (!t.defined()) return std::nullopt;
            return t;
          },
          py::arg("shape"), py::arg("dtype"),
          "loan() without waiting: None when the heap has no room now, or is smaller than the tensor.")
      .def("is_loan", &tdshm::ProcessGroupShm::is_loan, py::arg("tensor"),
           "Whether the tensor lies wholly inside one live loan of this group.")
      .def(
          "recv_view",
          [](tdshm::ProcessGroupShm& pg, int src, int tag) {
            py::gil_scoped_release nogil;
            return pg.recv_view(src, tag);
          },
          py::arg("src"), py::arg("tag") = 0,
          "Receives whatever tensor group rank `src` sends with `tag`, in the sender's shape and dtype: a "
          "view of its bytes when they are a loan (given back when the view is dropped), else a fresh tensor.")
      .def(
          "recv_views",
          [](tdshm::ProcessGroupShm& pg, int src, int tag, size_t n) {
            py::gil_scoped_release nogil;
            if (n == 0) return std::vector<at::Tensor>{};
            auto work = pg.irecv_views(src, tag, n);
            work->wait();
            return work->result();
          },
          py::arg("src"), py::arg("tag"), py::arg("n"),
          "The next `n` messages group rank `src` sends with `tag`, as recv_view receives each (views of "
          "loans, fresh tensors otherwise), posted at once and waited for together.")
      .def(
          "irecv_view",
          [](tdshm::ProcessGroupShm& pg, int src, int tag) {
            py::gil_scoped_release nogil;
            return pg.irecv_view(src, tag);
          },
          py::arg("src"), py::arg("tag") = 0,
          "recv_view, not waited: a Work whose result()[0] is the received tensor once wait() returned.")
      .def(
          "shutdown", [](tdshm::ProcessGroupShm& pg) { pg.shutdown(); }, py::call_guard<py::gil_scoped_release>(),
          "Leaves the group now, as destroying it does (its pending and later works fail), while the object "
          "lives on: views of loans received stay readable.")
      .def_property_readonly("segment_name", &tdshm::ProcessGroupShm::segment_name,
                             "The segment's name (the file is /dev/shm/tdshm.<segment_name>).");

  m.def(
      "_create_shm_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
        return tdshm::make_group_from_store(store, rank, size, options_with(timeout));  // (loans: from the environment)
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
      "The creator torch.distributed calls for backend \"shm\": (prefix store, group rank, group size, timeout).");

  m.def("_release_view", &tdshm::release_view, py::arg("tensor"),
        "Gives a view's bytes back to their sender now (tdshm.release).");

  bind_transfer(m);
  bind_board(m);
  bind_feed(m);
  bind_task_ring(m);
  bind_leaf_ids(m);
  bind_answer_codec(m);
  m.attr("__version__") = TDSHM_VERSION;
}
