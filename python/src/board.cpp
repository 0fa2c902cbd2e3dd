// tdshm.Board: the versioned board (include/tdshm/board.h) from Python. Trees are dicts of
// tensors (nested dicts for nested keys) or tensordict TensorDicts; view() and like() return
// nested dicts.

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <tdshm/board.h>
#include <tdshm/board_relay.h>
#include <tdshm/distributed.h>

#include <tdshm/errors.h>
#include "typed_errors.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

namespace py = pybind11;
using tdshm_python::released;
using tdshm_python::typed;

namespace {

void add_leaves(py::handle node, const std::optional<tdshm::Key>& prefix, tdshm::TensorDict& out) {
  py::object items;
  if (PyDict_Check(node.ptr())) {
    items = py::reinterpret_borrow<py::dict>(node).attr("items")();
  } else if (py::hasattr(node, "items") && py::hasattr(node, "batch_size")) {  // a tensordict TensorDict
    items = node.attr("items")();
  } else {
    throw tdshm::TypeError(
        "tdshm.Board: a tree is a dict of tensors (nested dicts for nested keys) or a "
        "TensorDict; got " +
        std::string(py::str(py::type::handle_of(node).attr("__name__"))));
  }
  for (py::handle kv : items) {
    const auto pair = py::reinterpret_borrow<py::tuple>(kv);
    if (!py::isinstance<py::str>(pair[0])) throw tdshm::TypeError("tdshm.Board: tree keys are strings");
    const std::string name = pair[0].cast<std::string>();
    tdshm::Key key = prefix ? *prefix / name : tdshm::Key(name);
    py::handle value = pair[1];
    if (THPVariable_Check(value.ptr())) {
      out.set(key, THPVariable_Unpack(value.ptr()));
    } else {
      add_leaves(value, key, out);
    }
  }
}

tdshm::TensorDict tree_of(py::handle tree) {
  tdshm::TensorDict td(std::vector<int64_t>{});
  add_leaves(tree, std::nullopt, td);
  return td;
}

// Nested dicts of the leaves, in their order (keys sorted at each level: the order dict_of gives).
py::dict dict_of(std::vector<std::pair<tdshm::Key, at::Tensor>> leaves) {
  py::dict out;
  for (auto& [key, tensor] : leaves) {
    py::dict node = out;
    const std::vector<std::string>& parts = key.parts();
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      py::str part(parts[i]);
      if (!node.contains(part)) node[part] = py::dict();
      node = py::reinterpret_borrow<py::dict>(node[part]);
    }
    node[py::str(parts.back())] = py::cast(std::move(tensor));
  }
  return out;
}

py::dict dict_of(const tdshm::TensorDict& td) {
  py::dict out;
  for (const std::string& k : td.sorted_keys()) {
    const tdshm::Value v = td.get_value(tdshm::Key(k));
    if (v.is_tensor()) {
      out[py::str(k)] = py::cast(v.tensor());
    } else {
      out[py::str(k)] = dict_of(v.tensordict());
    }
  }
  return out;
}

// A timedelta as milliseconds, clamped to what they hold (pybind11's own conversion of
// timedelta.max, "forever" to a user, overflows to a negative count).
std::chrono::milliseconds timeout_of(py::handle t, const char* what) {
  static const py::object timedelta = py::module_::import("datetime").attr("timedelta");
  if (!py::isinstance(t, timedelta)) {
    throw py::type_error(std::string("tdshm.Board.") + what + ": timeout must be a datetime.timedelta");
  }
  const long double ms = static_cast<long double>(t.attr("days").cast<int64_t>()) * 86'400'000.0L +
                         static_cast<long double>(t.attr("seconds").cast<int64_t>()) * 1'000.0L +
                         static_cast<long double>(t.attr("microseconds").cast<int64_t>()) / 1'000.0L;
  using Ms = std::chrono::milliseconds;
  if (ms >= static_cast<long double>(Ms::max().count())) return Ms::max();
  if (ms <= 0) return Ms(0);
  return Ms(static_cast<Ms::rep>(ms));
}

// wait(slice) with the GIL released, in slices of at most 100 ms, until it returns or `timeout`
// has passed; between slices Python's signal handlers run (Ctrl-C raises KeyboardInterrupt within
// a slice, not at the timeout). wait throws TimeoutError for a slice that ran out; the last one is
// rethrown as timed_out() says.
template <class Wait, class TimedOut>
auto in_slices(std::chrono::milliseconds timeout, Wait&& wait, TimedOut&& timed_out) {
  using Clock = std::chrono::steady_clock;
  const auto check = tdshm_python::python_check();
  // Past a century (timedelta.max as "forever") the sum overflows the clock: forever.
  const Clock::time_point until =
      timeout > std::chrono::hours(24 * 365 * 100) ? Clock::time_point::max() : Clock::now() + timeout;
  return released([&] {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      try {
        return wait(std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(100)));
      } catch (const tdshm::TimeoutError&) {
        if (Clock::now() >= until) throw tdshm::TimeoutError(timed_out());
      }
      check();
    }
  });
}

}  // namespace

void bind_board(py::module_& m) {
  py::class_<tdshm::Board>(m, "Board",
                           "A versioned board: one writer publishes a tree as version 1, 2, ...; readers in other "
                           "processes copy or view the newest complete version (docs/board.md).")
      .def_static(
          "create",
          [](const std::string& name, py::handle like, uint32_t readers) {
            tdshm::TensorDict td = typed([&] { return tree_of(like); });
            return released([&] { return tdshm::Board::create(name, td, {.readers = readers}); });
          },
          py::arg("name"), py::arg("like"), py::arg("readers") = 8,
          "The writer: a board for trees with `like`'s keys, dtypes and shapes.")
      .def_static(
          "open",
          [](const std::string& name, py::handle timeout_arg, std::chrono::microseconds spin) {
            const std::chrono::milliseconds timeout =
                timeout_arg.is_none() ? std::chrono::milliseconds(30000) : timeout_of(timeout_arg, "open");
            return in_slices(
                timeout,
                [&](std::chrono::milliseconds slice) {
                  return tdshm::Board::open(name, {.timeout = slice, .spin = spin});
                },
                [&] {
                  return "tdshm::Board::open: no board '" + name + "' within " + std::to_string(timeout.count()) +
                         " ms";
                });
          },
          py::arg("name"), py::arg("timeout") = py::none(), py::arg("spin") = std::chrono::microseconds(250),
          "A reader: waits up to `timeout` (a timedelta; None: 30 s) for the board and takes a reader slot. "
          "`spin` (a timedelta): how long wait_newer checks before it sleeps on a futex (a wake-up costs tens "
          "of us).")
      .def(
          "publish",
          [](tdshm::Board& b, py::handle tree) {
            tdshm::TensorDict td = typed([&] { return tree_of(tree); });
            return released([&] { return b.publish(td); });
          },
          py::arg("tree"), "Publishes `tree` as the next version (never waits for a reader); returns it.")
      .def(
          "read",
          [](tdshm::Board& b, py::handle tree) {
            tdshm::TensorDict td = typed([&] { return tree_of(tree); });  // the caller's own tensors
            return released([&] { return b.read(td); });
          },
          py::arg("tree"), "Copies the newest version into `tree`'s tensors; returns its version (0: none yet).")
      .def(
          "view", [](tdshm::Board& b) { return dict_of(released([&] { return b.view_leaves(); })); },
          "The newest version as a dict of views of the board, held until they are dropped.")
      .def(
          "wait_newer",
          [](tdshm::Board& b, uint64_t version, py::handle timeout_arg) {
            const std::chrono::milliseconds timeout = timeout_of(timeout_arg, "wait_newer");
            return in_slices(
                timeout, [&](std::chrono::milliseconds slice) { return b.wait_newer(version, slice); },
                [&] {
                  return "tdshm::Board::wait_newer: no version newer than " + std::to_string(version) + " within " +
                         std::to_string(timeout.count()) + " ms";
                });
          },
          py::arg("version"), py::arg("timeout"),
          "Sleeps until a version newer than `version` is published and returns it (TimeoutError after "
          "`timeout`, a timedelta; RuntimeError once the writer closed the board or died: open the "
          "name again for a new writer's versions).")
      .def(
          "begin", [](tdshm::Board& b) { return dict_of(released([&] { return b.begin(); })); },
          "Writer, without a copy: a dict of views of a free buffer to write in place, then commit().")
      .def(
          "commit", [](tdshm::Board& b) { return released([&] { return b.commit(); }); },
          "Publishes the tree of the open begin() as the next version and returns it.")
      .def_property_readonly("version", &tdshm::Board::version, "The newest published version (0: none yet).")
      .def(
          "like", [](const tdshm::Board& b) { return dict_of(b.like()); },
          "A dict of zeros shaped like the board's tree.")
      .def_property_readonly("name", &tdshm::Board::name)
      .def("close", &tdshm::Board::close,
           "Closes it now rather than when it is collected: a writer's readers are told at once, a reader's "
           "slot is freed once its views are dropped too. Later calls raise RuntimeError.")
      .def_property_readonly("closed", &tdshm::Board::is_closed)
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__", [](tdshm::Board& b, py::args) { b.close(); }, "Closes the board (close()).");

  py::class_<tdshm::BoardRelay>(m, "BoardRelay",
                                "A board across hosts: the writer's host sends each newest version to one receiver "
                                "per other host, which publishes it on that host's board (docs/board.md).")
      .def_static(
          "sender",
          [](const std::string& name, const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::vector<int> receivers,
             uint32_t readers) {
            return released([&] {
              return tdshm::BoardRelay::sender(name, tdshm::Group(group), std::move(receivers), {.readers = readers});
            });
          },
          py::arg("name"), py::arg("group"), py::arg("receivers"), py::arg("readers") = 8,
          "On the writer's host: reads board `name` (a reader slot of its own) and sends every newest version "
          "to the ranks `receivers` of `group` (a torch.distributed group spanning the hosts, e.g. gloo).")
      .def_static(
          "receiver",
          [](const std::string& name, py::handle like, const c10::intrusive_ptr<c10d::ProcessGroup>& group, int src,
             uint32_t readers) {
            tdshm::TensorDict td = typed([&] { return tree_of(like); });
            return released(
                [&] { return tdshm::BoardRelay::receiver(name, td, tdshm::Group(group), src, {.readers = readers}); });
          },
          py::arg("name"), py::arg("like"), py::arg("group"), py::arg("src"), py::arg("readers") = 8,
          "On another host: creates this host's board `name` for trees like `like` and publishes every version "
          "rank `src` of `group` sends.")
      .def_property_readonly("count", &tdshm::BoardRelay::count, "Versions sent, or received and published.")
      .def_property_readonly("stopped", &tdshm::BoardRelay::stopped)
      .def_property_readonly("error", &tdshm::BoardRelay::error, "What ended the relay, if not an orderly stop.")
      .def(
          "wait_count",
          [](const tdshm::BoardRelay& r, uint64_t n, std::chrono::milliseconds timeout) {
            return released([&] { return r.wait_count(n, timeout); });
          },
          py::arg("n"), py::arg("timeout"), "Waits until count >= n, the relay stopped, or `timeout` (a timedelta).");
}
