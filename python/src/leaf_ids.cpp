// tdshm._C.LeafIds: a DataLoader worker pickler's persistent_id (python/tdshm/loader.py,
// _Splitter). The pickler calls it for every object it pickles; it sets the plain tensors aside
// (plain_tensor.h; their index among them becomes their persistent id) and answers None for the
// rest. A Python function there cost a frame per object: splitting a whole batch's answer took
// 1.06 µs, 0.32 of them the pickling itself. A C callable (vectorcall, no argument tuple) leaves
// the pickling.

#include <pybind11/pybind11.h>

#include <Python.h>
#include <structmember.h>

#include "plain_tensor.h"

#include <cstddef>

namespace py = pybind11;

namespace {

struct LeafIdsObject {
  PyObject ob_base;           // PyObject_HEAD, spelled out
  PyTypeObject* tensor_type;  // torch.Tensor: its plain instances (plain_tensor.h) are leaves
  PyObject* leaves;           // a list
  vectorcallfunc vectorcall;
};

PyObject* leaf_ids_call(PyObject* self_obj, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<LeafIdsObject*>(self_obj);
  if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "LeafIds takes one object");
    return nullptr;
  }
  PyObject* obj = args[0];
  // Any other tensor is pickled: its __reduce_ex__ then hands its plain parts (a Parameter's data,
  // a sparse tensor's indices and values) to this callable in turn.
  if (Py_TYPE(obj) != self->tensor_type || !tdshm_python::plain_tensor(obj)) Py_RETURN_NONE;
  const Py_ssize_t index = PyList_GET_SIZE(self->leaves);
  if (PyList_Append(self->leaves, obj) != 0) return nullptr;
  return PyLong_FromSsize_t(index);
}

PyObject* leaf_ids_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* tensor_type = nullptr;
  static const char* keywords[] = {"tensor_type", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!:LeafIds", const_cast<char**>(keywords), &PyType_Type,
                                   &tensor_type)) {
    return nullptr;
  }
  PyObject* leaves = PyList_New(0);
  if (leaves == nullptr) return nullptr;
  auto* self = reinterpret_cast<LeafIdsObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) {
    Py_DECREF(leaves);
    return nullptr;
  }
  Py_INCREF(tensor_type);
  self->tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type);
  self->leaves = leaves;
  self->vectorcall = leaf_ids_call;
  return reinterpret_cast<PyObject*>(self);
}

int leaf_ids_traverse(PyObject* self_obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<LeafIdsObject*>(self_obj);
  Py_VISIT(Py_TYPE(self_obj));  // a heap type
  Py_VISIT(self->tensor_type);
  Py_VISIT(self->leaves);
  return 0;
}

int leaf_ids_clear(PyObject* self_obj) {
  auto* self = reinterpret_cast<LeafIdsObject*>(self_obj);
  Py_CLEAR(self->tensor_type);
  Py_CLEAR(self->leaves);
  return 0;
}

void leaf_ids_dealloc(PyObject* self_obj) {
  PyTypeObject* type = Py_TYPE(self_obj);
  PyObject_GC_UnTrack(self_obj);
  leaf_ids_clear(self_obj);
  type->tp_free(self_obj);
  Py_DECREF(type);
}

// take(): the tensors set aside since the last take, in order; the next ids start at 0 again.
PyObject* leaf_ids_take(PyObject* self_obj, PyObject*) {
  auto* self = reinterpret_cast<LeafIdsObject*>(self_obj);
  PyObject* fresh = PyList_New(0);
  if (fresh == nullptr) return nullptr;
  PyObject* taken = self->leaves;
  self->leaves = fresh;
  return taken;
}

PyMethodDef leaf_ids_methods[] = {
    {"take", leaf_ids_take, METH_NOARGS,
     "The tensors set aside since the last take(), in order (a tensor's persistent id is its index); the next "
     "ids start at 0."},
    {nullptr, nullptr, 0, nullptr},
};

PyMemberDef leaf_ids_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(LeafIdsObject, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyType_Slot leaf_ids_slots[] = {
    {Py_tp_doc, const_cast<char*>("LeafIds(tensor_type): a pickler's persistent_id that sets aside every plain "
                                  "instance of tensor_type (exactly that type; on the CPU, strided, not requiring "
                                  "grad; its id: its index among them) and answers None for any other object.")},
    {Py_tp_new, reinterpret_cast<void*>(leaf_ids_new)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_traverse, reinterpret_cast<void*>(leaf_ids_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(leaf_ids_clear)},
    {Py_tp_dealloc, reinterpret_cast<void*>(leaf_ids_dealloc)},
    {Py_tp_methods, leaf_ids_methods},
    {Py_tp_members, leaf_ids_members},
    {0, nullptr},
};

PyType_Spec leaf_ids_spec = {
    "tdshm._C.LeafIds", sizeof(LeafIdsObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    leaf_ids_slots,
};

}  // namespace

void bind_leaf_ids(py::module_& m) {
  PyObject* type = PyType_FromSpec(&leaf_ids_spec);
  if (type == nullptr) throw py::error_already_set();
  m.add_object("LeafIds", py::reinterpret_steal<py::object>(type));
}
