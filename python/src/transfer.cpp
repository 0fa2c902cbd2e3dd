// tdshm._C._Transfer: a per-leaf tensordict transfer prepared once from Python (tdshm.Transfer).
//
// tensordict's td.send walks the tree in Python and makes one torch.distributed call per leaf:
// ~9 us a leaf. Here the tree is walked once into a C++ TensorDict whose leaves are the Python
// tensors themselves (the same TensorImpl: a receive lands in them, a send reads them as they
// are at the call), and each call runs the C++ transfer (TensorDict::isend / irecv, tensordict's
// wire) with the GIL released. What a call costs in Python is one check that the tree still
// holds what was walked: each level's dict has as many keys, and each key the very object it
// held (an identity test per key, ~20 ns); a tree that changed is walked again, so a leaf
// replaced by another tensor is sent from the new one.

#include <tdshm/distributed.h>
#include <tdshm/errors.h>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// What a tree node's children live in: a dict itself, or the `_tensordict` dict of a tensordict
// (tensordict's TensorDict keeps its entries there).
py::object children_of(py::handle node, bool& tensordict) {
  if (PyDict_Check(node.ptr())) {
    tensordict = false;
    return py::reinterpret_borrow<py::object>(node);
  }
  if (py::hasattr(node, "_tensordict")) {
    py::object d = node.attr("_tensordict");
    if (PyDict_Check(d.ptr())) {
      tensordict = true;
      return d;
    }
  }
  throw tdshm::TypeError(std::string("tdshm.Transfer: a tree is a dict of tensors and dicts, or a tensordict; got ") +
                         Py_TYPE(node.ptr())->tp_name);
}

// Runs `f` without the GIL: a transfer may wait for its peer, which may be a thread of this
// interpreter.
template <class F>
auto without_gil(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

class PreparedTransfer {
 public:
  PreparedTransfer(py::object tree, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::vector<int> global_ranks,
                   int64_t init_tag, bool pseudo_rand)
      : tree_(std::move(tree)),
        group_(global_ranks.empty() ? tdshm::Group(std::move(pg)) : tdshm::Group(std::move(pg), std::move(global_ranks))),
        init_tag_(init_tag),
        pseudo_rand_(pseudo_rand) {
    send_.group = recv_.group = group_;
    send_.init_tag = recv_.init_tag = init_tag;
    send_.pseudo_rand = recv_.pseudo_rand = pseudo_rand;
    walk();
  }

  void send(std::optional<int> dst, std::optional<int> group_dst) {
    const tdshm::SendOptions& options = send_options(dst, group_dst, false);
    without_gil([&] { td_.send(options); });
  }

  py::object isend(std::optional<int> dst, std::optional<int> group_dst, bool return_early) {
    const tdshm::SendOptions& options = send_options(dst, group_dst, return_early);
    return to_python(without_gil([&] { return td_.isend(options); }));
  }

  int64_t recv(std::optional<int> src, std::optional<int> group_src) {
    const tdshm::RecvOptions& options = recv_options(src, group_src, false);
    return without_gil([&] { return td_.recv(options); });
  }

  py::object irecv(std::optional<int> src, std::optional<int> group_src, bool return_premature) {
    const tdshm::RecvOptions& options = recv_options(src, group_src, return_premature);
    return to_python(without_gil([&] { return td_.irecv(options); }));
  }

  /// recv into a new tree (see TensorDict::recv_view): nested dicts of the received tensors, views
  /// of the sender's loans over shm (no copy), fresh tensors otherwise.
  py::dict recv_view(std::optional<int> src, std::optional<int> group_src) {
    const tdshm::RecvOptions& options = recv_options(src, group_src, false);
    const tdshm::TensorDict got = without_gil([&] { return td_.recv_view(options); });
    py::dict out;
    for (const auto& key : got.sorted_leaf_keys()) {
      const auto& parts = key.parts();
      py::dict level = out;
      for (size_t i = 0; i + 1 < parts.size(); ++i) {
        py::str name(parts[i]);
        if (!level.contains(name)) level[name] = py::dict();
        level = level[name].cast<py::dict>();
      }
      level[py::str(parts.back())] = got.get(key);
    }
    return out;
  }

  /// The leaves' key paths in transfer order (tuples of str).
  py::list keys() {
    refresh();
    py::list out;
    for (const auto& k : td_.sorted_leaf_keys()) out.append(py::tuple(py::cast(k.parts())));
    return out;
  }

  /// The tags of the leaves, in transfer order.
  std::vector<int64_t> tags() {
    refresh();
    return tdshm::transfer_tags(init_tag_, td_.sorted_leaf_keys().size(), pseudo_rand_);
  }

 private:
  // One dict of the tree (a level), and one key of a level with the object it held.
  struct Level {
    py::object node;  // the dict, or the tensordict that holds it
    py::object dict;
    Py_ssize_t size;
    bool tensordict;
  };
  struct Entry {
    size_t level;
    py::object key;
    py::object value;
  };

  // The options are kept between calls: a Group copy per call would allocate.
  const tdshm::SendOptions& send_options(std::optional<int> dst, std::optional<int> group_dst, bool return_early) {
    refresh();
    send_.dst = dst;
    send_.group_dst = group_dst;
    send_.return_early = return_early;
    return send_;
  }

  const tdshm::RecvOptions& recv_options(std::optional<int> src, std::optional<int> group_src, bool return_premature) {
    refresh();
    recv_.src = src;
    recv_.group_src = group_src;
    recv_.return_premature = return_premature;
    return recv_;
  }

  // As tensordict returns: the works (return_early / return_premature), the last tag (isend), or None.
  static py::object to_python(const tdshm::Transfer& r) {
    if (r.has_works) {
      py::list works;
      for (const auto& w : r.works) works.append(py::cast(w));
      return works;
    }
    if (r.last_tag) return py::int_(*r.last_tag);
    return py::none();
  }

  // Walks the tree again if it no longer holds what was walked (GIL held).
  void refresh() {
    if (!unchanged()) walk();
  }

  bool unchanged() const {
    for (const auto& l : levels_) {
      if (PyDict_GET_SIZE(l.dict.ptr()) != l.size) return false;
      if (l.tensordict) {
        // A tensordict may swap its dict (tensordict does on some in-place updates).
        PyObject* now = PyObject_GetAttrString(l.node.ptr(), "_tensordict");
        if (now == nullptr) throw py::error_already_set();
        Py_DECREF(now);  // compared by identity only; the node keeps it alive
        if (now != l.dict.ptr()) return false;
      }
    }
    for (const auto& e : entries_) {
      PyObject* v = PyDict_GetItemWithError(levels_[e.level].dict.ptr(), e.key.ptr());  // borrowed
      if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (v != e.value.ptr()) return false;
    }
    return true;
  }

  void walk() {
    std::vector<Level> levels;
    std::vector<Entry> entries;
    tdshm::TensorDict td;
    std::vector<std::string> path;
    walk_level(tree_, path, levels, entries, td);
    levels_ = std::move(levels);
    entries_ = std::move(entries);
    td_ = std::move(td);
  }

  static void walk_level(py::handle node, std::vector<std::string>& path, std::vector<Level>& levels,
                         std::vector<Entry>& entries, tdshm::TensorDict& td) {
    if (path.size() > 64) throw tdshm::TypeError("tdshm.Transfer: the tree is more than 64 levels deep (a cycle?)");
    bool tensordict = false;
    py::object dict = children_of(node, tensordict);
    const size_t level = levels.size();
    levels.push_back({py::reinterpret_borrow<py::object>(node), dict, PyDict_GET_SIZE(dict.ptr()), tensordict});
    // tensordict's per-leaf order: sorted keys at every level (Python sorts str by code point,
    // which is the byte order of their UTF-8).
    std::vector<std::pair<std::string, py::object>> items;
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(dict)) {
      if (!PyUnicode_Check(k.ptr())) {
        throw tdshm::TypeError("tdshm.Transfer: keys are str; got a key of type " + std::string(Py_TYPE(k.ptr())->tp_name));
      }
      entries.push_back({level, py::reinterpret_borrow<py::object>(k), py::reinterpret_borrow<py::object>(v)});
      items.emplace_back(py::cast<std::string>(k), py::reinterpret_borrow<py::object>(v));
    }
    std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [key, value] : items) {
      path.push_back(key);
      if (THPVariable_Check(value.ptr())) {
        td.set(tdshm::Key(path), THPVariable_Unpack(value.ptr()));
      } else if (PyDict_Check(value.ptr()) || py::hasattr(value, "_tensordict")) {
        walk_level(value, path, levels, entries, td);
      } else if (!tensordict) {
        // (A tensordict's non-tensor values send nothing, as in tensordict.)
        throw tdshm::TypeError("tdshm.Transfer: the value at " + tdshm::Key(path).str() + " is a " +
                               Py_TYPE(value.ptr())->tp_name + "; a tree's values are tensors and dicts");
      }
      path.pop_back();
    }
  }

  py::object tree_;
  tdshm::Group group_;
  int64_t init_tag_;
  bool pseudo_rand_;
  std::vector<Level> levels_;
  std::vector<Entry> entries_;
  tdshm::TensorDict td_;
  tdshm::SendOptions send_;
  tdshm::RecvOptions recv_;
};

// tdshm's typed errors keep their Python meaning in these calls (the backend's own calls,
// through torch.distributed, raise RuntimeError as every backend does): sets the Python error for
// `p` and returns true when it is one of them.
bool set_typed_error(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const tdshm::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const tdshm::KeyError& e) {
    PyErr_SetString(PyExc_KeyError, e.what());
  } catch (const tdshm::TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
  } catch (...) {
    return false;
  }
  return true;
}

// The calls a loop makes, send(dst) and recv(src) with one positional int, go from CPython's
// vectorcall convention straight into C++: pybind11's dispatcher (its argument loaders, overload
// tries and result cast) cost ~60 ns a call, about a quarter of what Python adds to the seed
// tree's one-way time. Any other call (keywords, group_dst, None, another type) goes to the
// pybind11 overloads, renamed _send and _recv, which say what is wrong with it.
template <bool kSend>
PyObject* fast_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) noexcept {
  if (nargs == 1 && kwnames == nullptr && PyLong_CheckExact(args[0])) {
    int overflow = 0;
    const long peer = PyLong_AsLongAndOverflow(args[0], &overflow);
    if (overflow == 0 && peer >= INT_MIN && peer <= INT_MAX) {
      try {
        auto* t = py::cast<PreparedTransfer*>(py::handle(self));
        if constexpr (kSend) {
          t->send(static_cast<int>(peer), std::nullopt);
          Py_RETURN_NONE;
        } else {
          return PyLong_FromLongLong(t->recv(static_cast<int>(peer), std::nullopt));
        }
      } catch (...) {
        const std::exception_ptr p = std::current_exception();
        if (!set_typed_error(p)) py::detail::translate_exception(p);  // as pybind11's own calls do
        return nullptr;
      }
    }
  }
  PyObject* general = PyObject_GetAttrString(self, kSend ? "_send" : "_recv");
  if (general == nullptr) return nullptr;
  PyObject* out = PyObject_Vectorcall(general, args, static_cast<size_t>(nargs), kwnames);
  Py_DECREF(general);
  return out;
}

PyMethodDef fast_send_def{"send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<true>)),
                          METH_FASTCALL | METH_KEYWORDS,
                          "send(dst=None, group_dst=None): every leaf to the peer, waited for."};
PyMethodDef fast_recv_def{"recv", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<false>)),
                          METH_FASTCALL | METH_KEYWORDS,
                          "recv(src=None, group_src=None): every leaf from the peer, waited for; the last tag."};

}  // namespace

void bind_transfer(py::module_& m) {
  py::register_local_exception_translator([](std::exception_ptr p) {
    if (p && !set_typed_error(p)) std::rethrow_exception(p);  // (not ours: the next translator's)
  });

  py::class_<PreparedTransfer> cls(m, "_Transfer", "The C++ half of tdshm.Transfer (see there).");
  cls.def(py::init<py::object, c10::intrusive_ptr<c10d::ProcessGroup>, std::vector<int>, int64_t, bool>(),
          py::arg("tree"), py::arg("group"), py::arg("global_ranks"), py::arg("init_tag"), py::arg("pseudo_rand"))
      .def("_send", &PreparedTransfer::send, py::arg("dst") = py::none(), py::arg("group_dst") = py::none())
      .def("isend", &PreparedTransfer::isend, py::arg("dst") = py::none(), py::arg("group_dst") = py::none(),
           py::arg("return_early") = false)
      .def("_recv", &PreparedTransfer::recv, py::arg("src") = py::none(), py::arg("group_src") = py::none())
      .def("irecv", &PreparedTransfer::irecv, py::arg("src") = py::none(), py::arg("group_src") = py::none(),
           py::arg("return_premature") = false)
      .def("recv_view", &PreparedTransfer::recv_view, py::arg("src") = py::none(), py::arg("group_src") = py::none())
      .def("keys", &PreparedTransfer::keys)
      .def("tags", &PreparedTransfer::tags);
  // send and recv: fast_call's descriptors, in front of _send and _recv.
  for (PyMethodDef* def : {&fast_send_def, &fast_recv_def}) {
    py::object method = py::reinterpret_steal<py::object>(PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def));
    if (!method) throw py::error_already_set();
    py::setattr(cls, def->ml_name, method);
  }
}
