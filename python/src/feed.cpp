// tdshm.FeedProducer / tdshm.FeedConsumer: the feed (include/tdshm/feed.h) from Python, with raw
// items (header bytes and a list of tensors): what tdshm.DataLoader's workers and main process
// speak. The consumer's waits answer Ctrl-C and torch's SIGCHLD handler (typed_errors.h).

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <tdshm/errors.h>
#include <tdshm/feed.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "answer_codec.h"
#include "typed_errors.h"

namespace py = pybind11;
using tdshm_python::released;

namespace {

tdshm::FeedOptions feed_options(std::optional<std::chrono::milliseconds> timeout, uint32_t items_in_heap,
                                size_t first_heap_bytes, std::chrono::microseconds spin, pid_t watch_pid,
                                py::object check = py::none(), double shm_share = 1.0) {
  tdshm::FeedOptions o;
  o.timeout = timeout.value_or(std::chrono::milliseconds(0));
  o.items_in_heap = items_in_heap;
  o.first_heap_bytes = first_heap_bytes;
  o.spin = spin;
  o.watch_pid = watch_pid;
  o.check = tdshm_python::python_check(std::move(check));
  o.shm_share = shm_share;
  return o;
}

at::ScalarType dtype_of(py::handle dtype) {
  if (!THPDtype_Check(dtype.ptr())) throw py::type_error("dtype must be a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

}  // namespace

void bind_feed(py::module_& m) {
  py::class_<tdshm::FeedProducer>(m, "FeedProducer",
                                  "A producer's end of a feed: hands items (header bytes and tensors) to one consumer "
                                  "process in order; tensors in its heap go by reference (docs/loader.md).")
      .def(py::init([](const std::string& name, int index, std::optional<std::chrono::milliseconds> timeout,
                       uint32_t items_in_heap, size_t first_heap_bytes, std::chrono::microseconds spin, pid_t watch_pid,
                       py::object check, double shm_share) {
             return tdshm_python::typed([&] {
               return tdshm::FeedProducer(name, index,
                                          feed_options(timeout, items_in_heap, first_heap_bytes, spin, watch_pid,
                                                       std::move(check), shm_share));
             });
           }),
           py::arg("name"), py::arg("index"), py::kw_only(), py::arg("timeout") = py::none(),
           py::arg("items_in_heap") = 6, py::arg("first_heap_bytes") = size_t{1} << 20,
           py::arg("spin") = std::chrono::microseconds(250), py::arg("watch_pid") = 0, py::arg("check") = py::none(),
           py::arg("shm_share") = 1.0,
           "Producer `index` of feed `name`. timeout (a timedelta, None: forever) bounds its waits for the "
           "consumer; watch_pid: the consumer's process (a wait for it ends once it is gone); check: a "
           "callable run every 100 ms or so while put waits (what it raises ends the wait); shm_share: the share "
           "of /dev/shm's size its group may grow to.")
      .def(
          "try_loan",
          [](tdshm::FeedProducer& p, std::vector<int64_t> shape, py::handle dtype) -> std::optional<at::Tensor> {
            const at::ScalarType st = dtype_of(dtype);
            at::Tensor t = released([&] { return p.try_loan(shape, st); });
            if (!t.defined()) return std::nullopt;
            return t;
          },
          py::arg("shape"), py::arg("dtype"),
          "A tensor in this producer's heap (put() sends it by reference), or None: no heap yet, or no room.")
      .def("is_loan", &tdshm::FeedProducer::is_loan, py::arg("tensor"))
      .def(
          "heap_allocations",
          [](tdshm::FeedProducer& p, size_t min_bytes) {
            return std::make_unique<tdshm::FeedProducer::HeapAllocations>(p, min_bytes);
          },
          py::arg("min_bytes") = size_t{64} << 10, py::keep_alive<0, 1>(),
          "A context manager: inside it, the tensors torch allocates on this thread of at least min_bytes are "
          "carved out of this producer's heap when it has room, so that put() sends them by reference (no "
          "copy). Before the first put there is no heap: allocations are torch's ordinary ones.")
      .def(
          "put",
          [](tdshm::FeedProducer& p, py::bytes header, std::vector<at::Tensor> tensors) {
            std::string h = header;
            released([&] {
              p.put(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.data()), h.size()), tensors);
              return true;
            });
          },
          py::arg("header"), py::arg("tensors"),
          "Hands the next item to the consumer: `header` (bytes) and `tensors` (dense CPU tensors; loans by "
          "reference, those of at most 4 KiB by value, others copied into the heap, or by value when the "
          "consumer holds it).")
      .def(
          "put_answer",
          [](tdshm::FeedProducer& p, py::handle kind, py::handle idx, py::handle payload, bool convert) {
            // Kept for their capacity; the header and tensors are read while the GIL is released.
            thread_local tdshm_python::AnswerScratch scratch;
            thread_local std::vector<at::Tensor> tensors;
            const int r = tdshm_python::encode_answer(kind.ptr(), idx.ptr(), payload.ptr(), convert,
                                                      reinterpret_cast<PyTypeObject*>(THPVariableClass), scratch);
            if (r < 0) throw py::error_already_set();
            if (r == 0) return false;
            tensors.clear();
            for (PyObject* t : scratch.leaves) tensors.push_back(THPVariable_Unpack(t));
            scratch.leaves.clear();
            const std::string& h = scratch.header;
            try {
              released([&] {
                p.put(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.data()), h.size()), tensors);
                return true;
              });
            } catch (...) {
              tensors.clear();
              throw;
            }
            tensors.clear();  // none of the item's tensors outlives its put
            return true;
          },
          py::arg("kind"), py::arg("idx"), py::arg("payload"), py::arg("convert"),
          "tdshm.DataLoader's answer (kind, idx, payload) as one item, its header written by AnswerCodec "
          "(convert: the payload as torch's default_convert returns it): True; False, and nothing put, when the "
          "answer holds what only pickle keeps. Fails as put does.")
      .def(
          "close",
          [](tdshm::FeedProducer& p) {
            released([&] {
              p.close();
              return true;
            });
          },
          "Ends this producer's items (the consumer's next_from returns None for it).")
      .def_property_readonly("generation", &tdshm::FeedProducer::generation)
      .def_property_readonly("items", &tdshm::FeedProducer::items);

  using HeapAllocations = tdshm::FeedProducer::HeapAllocations;
  py::class_<HeapAllocations>(m, "HeapAllocations", "FeedProducer.heap_allocations()'s scope.")
      .def(
          "__enter__", [](HeapAllocations& h) -> HeapAllocations& { return h; },
          py::return_value_policy::reference_internal)
      .def("__exit__",
           [](HeapAllocations& h, const py::args&) {
             h.end();
             return false;
           })
      .def("end", &HeapAllocations::end)
      .def_property_readonly("active", &HeapAllocations::active);

  py::class_<tdshm::FeedConsumer>(m, "FeedConsumer",
                                  "The consumer's end of a feed of `producers` producers (docs/loader.md).")
      .def(py::init([](const std::string& name, int producers, std::optional<std::chrono::milliseconds> timeout,
                       size_t first_heap_bytes, std::chrono::microseconds spin) {
             return tdshm_python::typed([&] {
               return tdshm::FeedConsumer(name, producers, feed_options(timeout, 6, first_heap_bytes, spin, 0));
             });
           }),
           py::arg("name"), py::arg("producers"), py::kw_only(), py::arg("timeout") = py::none(),
           py::arg("first_heap_bytes") = size_t{1} << 20, py::arg("spin") = std::chrono::microseconds(250),
           "timeout (a timedelta, None: forever): the wait for one item (TimeoutError past it). Waits run "
           "Python's signal handlers every 100 ms: Ctrl-C interrupts them.")
      .def(
          "next_from",
          [](tdshm::FeedConsumer& c, int k) -> py::object {
            std::optional<tdshm::FeedItem> item = released([&] { return c.next_from(k); });
            if (!item) return py::none();
            py::bytes header(reinterpret_cast<const char*>(item->header.data()), item->header.size());
            return py::make_tuple(header, py::cast(item->tensors));
          },
          py::arg("k"),
          "Producer k's next item, (header bytes, list of tensors: views of its loans, or fresh tensors), or "
          "None once it closed. TimeoutError past the timeout; RuntimeError when the producer died or left.")
      .def(
          "next_answer",
          [](tdshm::FeedConsumer& c, int k, const py::object& unpickle) -> py::object {
            std::optional<tdshm::FeedItem> item = released([&] { return c.next_from(k); });
            if (!item) return py::none();
            py::list leaves = py::cast(item->tensors);
            const auto* header = reinterpret_cast<const char*>(item->header.data());
            PyObject* answer = tdshm_python::decode_answer(header, item->header.size(), leaves.ptr());
            if (answer == nullptr) throw py::error_already_set();
            if (answer != Py_None) return py::reinterpret_steal<py::object>(answer);
            Py_DECREF(answer);
            return unpickle(py::bytes(header, item->header.size()), leaves);
          },
          py::arg("k"), py::arg("unpickle"),
          "tdshm.DataLoader's receive: producer k's next item as the answer AnswerCodec encoded in it, or "
          "unpickle(header, tensors) when its header is not the codec's; None once the producer closed. Fails "
          "as next_from does, and ValueError for a malformed header.")
      .def("watch", &tdshm::FeedConsumer::watch, py::arg("k"), py::arg("pid"),
           "Producer k's process: a wait for it to join ends once it is gone.")
      .def("closed", &tdshm::FeedConsumer::closed, py::arg("k"))
      .def(
          "shutdown", [](tdshm::FeedConsumer& c) { c.shutdown(); }, py::call_guard<py::gil_scoped_release>(),
          "Leaves every group (producers waiting on it fail), removing those whose producer died; call again "
          "once the producers ended. Views received stay readable.")
      .def_property_readonly("producers", &tdshm::FeedConsumer::producers);
}
