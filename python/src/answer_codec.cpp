// tdshm._C.AnswerCodec: a DataLoader worker's answers (kind, task index, payload) as header bytes
// and tensors without pickle, for the trees batches usually are (python/tdshm/loader.py). A
// worker's pickling and torch's default_convert took ~1.0 µs a whole batch, main's unpickling
// ~0.6 µs, every batch, on CPUs the workers and main share; this codec walks the tree once on
// each side. It knows None, bool, int (64 bits), float, str, bytes, and exact lists, tuples and
// dicts (keys: str, int, float, bool, None or bytes) of them, and plain tensors (plain_tensor.h;
// set aside in order, as LeafIds does). Anything else — a namedtuple, a subclass (a Parameter
// too), a tensor requiring grad or not strided, a numpy value, a shared or cyclic
// container — makes encode() answer None: the worker pickles that answer instead.
//
// A header: kMagic, then the tree in pre-order, each value a tag byte:
//   'N' None, 'T' True, 'F' False, 'i' int64, 'f' float64 (8 bytes, little-endian),
//   's' str / 'b' bytes (u32 length, then UTF-8 / the bytes), 'L' list / 'U' tuple (u32 count,
//   then the items), 'D' dict (u32 count, then key and value of each), 'X' the next tensor.
// Pickle's headers start with 0x80 (PROTO), never with kMagic. decode() trusts nothing: a bad
// header is a ValueError, and every tensor must be used, in order.

#include <pybind11/pybind11.h>

#include <Python.h>
#include <structmember.h>

#include "answer_codec.h"
#include "plain_tensor.h"

#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr char kMagic[4] = {'T', 'D', 'A', '1'};
constexpr int kMaxDepth = 64;
// Containers an answer may hold before the codec leaves it to pickle (each is looked for among
// the others: a shared one must stay shared).
constexpr size_t kMaxContainers = 256;

struct AnswerCodecObject {
  PyObject ob_base;           // PyObject_HEAD, spelled out
  PyTypeObject* tensor_type;  // torch.Tensor: its plain instances (plain_tensor.h) are leaves
  tdshm_python::AnswerScratch* scratch;
};

// ---- encode --------------------------------------------------------------------------------

struct Encoder {
  PyTypeObject* tensor_type;
  std::string& out;
  std::vector<PyObject*>& leaves;      // borrowed, in order
  std::vector<PyObject*>& containers;  // borrowed: every list, tuple and dict met so far
  bool convert;                        // torch's default_convert: a payload's tuples become lists

  void u32(size_t n) {
    const auto v = static_cast<uint32_t>(n);
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void word(const void* p) { out.append(static_cast<const char*>(p), 8); }

  // 1: written; 0: not this codec's (the caller pickles); -1: a Python error.
  int scalar(PyObject* o) {
    if (o == Py_None) {
      out += 'N';
    } else if (o == Py_True || o == Py_False) {
      out += o == Py_True ? 'T' : 'F';
    } else if (PyLong_CheckExact(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow != 0) return 0;
      if (v == -1 && PyErr_Occurred()) return -1;
      const int64_t w = v;
      out += 'i';
      word(&w);
    } else if (PyFloat_CheckExact(o)) {
      const double d = PyFloat_AS_DOUBLE(o);
      out += 'f';
      word(&d);
    } else if (PyUnicode_CheckExact(o)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(o, &n);
      if (s == nullptr) {  // a lone surrogate: pickle's
        PyErr_Clear();
        return 0;
      }
      if (static_cast<size_t>(n) > UINT32_MAX) return 0;
      out += 's';
      u32(static_cast<size_t>(n));
      out.append(s, static_cast<size_t>(n));
    } else if (PyBytes_CheckExact(o)) {
      const Py_ssize_t n = PyBytes_GET_SIZE(o);
      if (static_cast<size_t>(n) > UINT32_MAX) return 0;
      out += 'b';
      u32(static_cast<size_t>(n));
      out.append(PyBytes_AS_STRING(o), static_cast<size_t>(n));
    } else {
      return 0;
    }
    return 1;
  }

  // Whether container `o` may be written: one of at most kMaxContainers, and not met before
  // (pickle keeps a shared one shared, and a cyclic one would never end) unless convert (torch's
  // default_convert copies each occurrence; the depth still ends a cycle).
  bool first_time(PyObject* o) {
    if (containers.size() >= kMaxContainers) return false;
    if (!convert) {
      for (PyObject* c : containers) {
        if (c == o) return false;
      }
    }
    containers.push_back(o);
    return true;
  }

  int value(PyObject* o, int depth, bool convert_here) {
    if (const int r = scalar(o); r != 0) return r;
    if (depth >= kMaxDepth) return 0;
    if (PyObject_TypeCheck(o, tensor_type)) {
      if (Py_TYPE(o) != tensor_type || !tdshm_python::plain_tensor(o)) return 0;  // pickled (plain_tensor.h)
      out += 'X';
      leaves.push_back(o);
      return 1;
    }
    const bool list = PyList_CheckExact(o), tuple = PyTuple_CheckExact(o);
    if (list || tuple) {
      if (!first_time(o)) return 0;
      const Py_ssize_t n = list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
      out += list || convert_here ? 'L' : 'U';
      u32(static_cast<size_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        // A list may change under a value's encoding only through Python code, which none runs.
        PyObject* item = list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
        if (const int r = value(item, depth + 1, convert_here); r != 1) return r;
      }
      return 1;
    }
    if (PyDict_CheckExact(o)) {
      if (!first_time(o)) return 0;
      out += 'D';
      u32(static_cast<size_t>(PyDict_GET_SIZE(o)));
      Py_ssize_t pos = 0;
      PyObject *key = nullptr, *item = nullptr;
      while (PyDict_Next(o, &pos, &key, &item)) {
        if (const int r = scalar(key); r != 1) return r;  // keys stay as they are (default_convert too)
        if (const int r = value(item, depth + 1, convert_here); r != 1) return r;
      }
      return 1;
    }
    return 0;
  }
};

}  // namespace

int tdshm_python::encode_answer(PyObject* kind, PyObject* idx, PyObject* payload, bool convert,
                                PyTypeObject* tensor_type, AnswerScratch& s) {
  s.header.assign(kMagic, sizeof kMagic);
  s.leaves.clear();
  s.containers.clear();
  Encoder e{tensor_type, s.header, s.leaves, s.containers, convert};
  int r = -1;
  try {
    // The answer's own tuple stays a tuple; only its payload is converted.
    s.header += 'U';
    e.u32(3);
    r = e.value(kind, 1, false);
    if (r == 1) r = e.value(idx, 1, false);
    if (r == 1) r = e.value(payload, 1, convert);
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  }
  s.containers.clear();
  return r;
}

namespace {

PyObject* codec_encode(PyObject* self_obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<AnswerCodecObject*>(self_obj);
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "encode(kind, idx, payload, convert)");
    return nullptr;
  }
  const int convert = PyObject_IsTrue(args[3]);
  if (convert < 0) return nullptr;
  tdshm_python::AnswerScratch& s = *self->scratch;
  const int r = tdshm_python::encode_answer(args[0], args[1], args[2], convert != 0, self->tensor_type, s);
  if (r < 0) return nullptr;
  if (r == 0) Py_RETURN_NONE;
  PyObject* leaves = PyList_New(static_cast<Py_ssize_t>(s.leaves.size()));
  if (leaves == nullptr) return nullptr;
  for (size_t i = 0; i < s.leaves.size(); ++i) {
    Py_INCREF(s.leaves[i]);
    PyList_SET_ITEM(leaves, static_cast<Py_ssize_t>(i), s.leaves[i]);
  }
  s.leaves.clear();
  PyObject* header = PyBytes_FromStringAndSize(s.header.data(), static_cast<Py_ssize_t>(s.header.size()));
  if (header == nullptr) {
    Py_DECREF(leaves);
    return nullptr;
  }
  PyObject* pair = PyTuple_New(2);
  if (pair == nullptr) {
    Py_DECREF(header);
    Py_DECREF(leaves);
    return nullptr;
  }
  PyTuple_SET_ITEM(pair, 0, header);
  PyTuple_SET_ITEM(pair, 1, leaves);
  return pair;
}

// ---- decode --------------------------------------------------------------------------------

struct Decoder {
  const char* at;
  const char* end;
  PyObject* leaves;  // a list
  Py_ssize_t next_leaf = 0;

  PyObject* bad(const char* what) {
    PyErr_Format(PyExc_ValueError, "tdshm: a DataLoader answer's header is malformed: %s", what);
    return nullptr;
  }
  bool take(void* to, size_t n) {
    if (static_cast<size_t>(end - at) < n) return false;
    std::memcpy(to, at, n);
    at += n;
    return true;
  }
  // A count of items, each at least one byte: never more than the bytes left.
  bool count(uint32_t& n) { return take(&n, sizeof n) && n <= static_cast<size_t>(end - at); }

  PyObject* value(int depth, bool key = false) {
    char tag = 0;
    if (!take(&tag, 1)) return bad("it ends early");
    switch (tag) {
      case 'N': Py_RETURN_NONE;
      case 'T': Py_RETURN_TRUE;
      case 'F': Py_RETURN_FALSE;
      case 'i': {
        int64_t v = 0;
        if (!take(&v, sizeof v)) return bad("it ends inside an int");
        return PyLong_FromLongLong(v);
      }
      case 'f': {
        double d = 0;
        if (!take(&d, sizeof d)) return bad("it ends inside a float");
        return PyFloat_FromDouble(d);
      }
      case 's':
      case 'b': {
        uint32_t n = 0;
        if (!take(&n, sizeof n) || n > static_cast<size_t>(end - at)) return bad("a string runs past its end");
        const char* s = at;
        at += n;
        return tag == 's' ? PyUnicode_DecodeUTF8(s, n, "strict") : PyBytes_FromStringAndSize(s, n);
      }
      default: break;
    }
    if (key) return bad("a dict key that is not a str, int, float, bool, None or bytes");
    if (depth >= kMaxDepth) return bad("it nests too deep");
    switch (tag) {
      case 'X': {
        if (next_leaf >= PyList_GET_SIZE(leaves)) return bad("more tensors than the answer holds");
        PyObject* t = PyList_GET_ITEM(leaves, next_leaf++);
        Py_INCREF(t);
        return t;
      }
      case 'L':
      case 'U': {
        uint32_t n = 0;
        if (!count(n)) return bad("a list longer than its bytes");
        PyObject* seq = tag == 'L' ? PyList_New(n) : PyTuple_New(n);
        if (seq == nullptr) return nullptr;
        for (uint32_t i = 0; i < n; ++i) {
          PyObject* item = value(depth + 1);
          if (item == nullptr) {
            Py_DECREF(seq);  // the slots not filled are NULL: both deallocators skip them
            return nullptr;
          }
          if (tag == 'L') {
            PyList_SET_ITEM(seq, i, item);
          } else {
            PyTuple_SET_ITEM(seq, i, item);
          }
        }
        return seq;
      }
      case 'D': {
        uint32_t n = 0;
        if (!count(n)) return bad("a dict longer than its bytes");
        PyObject* dict = PyDict_New();
        if (dict == nullptr) return nullptr;
        for (uint32_t i = 0; i < n; ++i) {
          PyObject* k = value(depth + 1, true);
          PyObject* v = k == nullptr ? nullptr : value(depth + 1);
          const int r = v == nullptr ? -1 : PyDict_SetItem(dict, k, v);
          Py_XDECREF(k);
          Py_XDECREF(v);
          if (r != 0) {
            Py_DECREF(dict);
            return nullptr;
          }
        }
        return dict;
      }
      default: return bad("an unknown tag");
    }
  }
};

PyObject* codec_decode(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyBytes_Check(args[0]) || !PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "decode(header: bytes, tensors: list)");
    return nullptr;
  }
  return tdshm_python::decode_answer(PyBytes_AS_STRING(args[0]), static_cast<size_t>(PyBytes_GET_SIZE(args[0])),
                                     args[1]);
}

}  // namespace

PyObject* tdshm_python::decode_answer(const char* data, size_t size, PyObject* leaves) {
  if (size < sizeof kMagic || std::memcmp(data, kMagic, sizeof kMagic) != 0) Py_RETURN_NONE;  // pickle's
  Decoder d{data + sizeof kMagic, data + size, leaves};
  PyObject* answer = d.value(0);
  if (answer == nullptr) return nullptr;
  if (d.at != d.end || d.next_leaf != PyList_GET_SIZE(leaves)) {
    Py_DECREF(answer);
    return d.bad(d.at != d.end ? "bytes after its end" : "tensors it does not use");
  }
  return answer;
}

namespace {

// ---- the type ------------------------------------------------------------------------------

PyObject* codec_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* tensor_type = nullptr;
  static const char* keywords[] = {"tensor_type", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!:AnswerCodec", const_cast<char**>(keywords), &PyType_Type,
                                   &tensor_type)) {
    return nullptr;
  }
  auto* self = reinterpret_cast<AnswerCodecObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  try {
    self->scratch = new tdshm_python::AnswerScratch();
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  Py_INCREF(tensor_type);
  self->tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type);
  return reinterpret_cast<PyObject*>(self);
}

int codec_traverse(PyObject* self_obj, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self_obj));  // a heap type
  Py_VISIT(reinterpret_cast<AnswerCodecObject*>(self_obj)->tensor_type);
  return 0;
}

int codec_clear(PyObject* self_obj) {
  Py_CLEAR(reinterpret_cast<AnswerCodecObject*>(self_obj)->tensor_type);
  return 0;
}

void codec_dealloc(PyObject* self_obj) {
  auto* self = reinterpret_cast<AnswerCodecObject*>(self_obj);
  PyTypeObject* type = Py_TYPE(self_obj);
  PyObject_GC_UnTrack(self_obj);
  codec_clear(self_obj);
  delete self->scratch;
  type->tp_free(self_obj);
  Py_DECREF(type);
}

PyMethodDef codec_methods[] = {
    {"encode", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(codec_encode)), METH_FASTCALL,
     "encode(kind, idx, payload, convert): (header bytes, tensors) for the answer (kind, idx, payload), or None "
     "when it holds what only pickle keeps (pickle it then). convert: the payload as torch's default_convert "
     "returns it (tuples become lists)."},
    {"decode", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(codec_decode)), METH_FASTCALL,
     "decode(header, tensors): the answer encode() wrote, or None when the header is not one of its (a pickle). "
     "ValueError for a malformed header."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot codec_slots[] = {
    {Py_tp_doc, const_cast<char*>("AnswerCodec(tensor_type): a DataLoader answer as header bytes and the "
                                  "instances of tensor_type it holds, without pickle, for trees of plain values.")},
    {Py_tp_new, reinterpret_cast<void*>(codec_new)},
    {Py_tp_traverse, reinterpret_cast<void*>(codec_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(codec_clear)},
    {Py_tp_dealloc, reinterpret_cast<void*>(codec_dealloc)},
    {Py_tp_methods, codec_methods},
    {0, nullptr},
};

PyType_Spec codec_spec = {
    "tdshm._C.AnswerCodec", sizeof(AnswerCodecObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, codec_slots,
};

}  // namespace

void bind_answer_codec(py::module_& m) {
  PyObject* type = PyType_FromSpec(&codec_spec);
  if (type == nullptr) throw py::error_already_set();
  m.add_object("AnswerCodec", py::reinterpret_steal<py::object>(type));
}
