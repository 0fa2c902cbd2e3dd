// tdshm_python::plain_tensor (plain_tensor.h).

#include "plain_tensor.h"

#include <torch/csrc/autograd/python_variable.h>

bool tdshm_python::plain_tensor(PyObject* o) {
  if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
  const at::Tensor& t = THPVariable_Unpack(o);
  return t.device().is_cpu() && t.layout() == at::kStrided && !t.is_quantized() && !t.is_conj() && !t.is_neg() &&
         !t.requires_grad();
}
