#pragma once
// tdshm._C.AnswerCodec's two halves (answer_codec.cpp), for FeedProducer.put_answer and
// FeedConsumer.next_answer: a DataLoader answer's header bytes without pickle.

#include <Python.h>

#include <cstddef>
#include <string>
#include <vector>

namespace tdshm_python {

/// encode_answer's output and its working lists, kept for their capacity.
struct AnswerScratch {
  std::string header;
  std::vector<PyObject*> leaves;      // borrowed from the answer, in order
  std::vector<PyObject*> containers;  // borrowed, while it encodes
};

/// Writes the answer (kind, idx, payload) into s.header and its instances of `tensor_type` into
/// s.leaves (borrowed: valid while the answer lives). convert: the payload as torch's
/// default_convert returns it. 1: written; 0: the codec leaves it to pickle; -1: a Python error
/// is set. Holds the GIL.
int encode_answer(PyObject* kind, PyObject* idx, PyObject* payload, bool convert, PyTypeObject* tensor_type,
                  AnswerScratch& s);

/// The answer AnswerCodec encoded into `data` (`size` bytes), its tensors taken in order from
/// `leaves` (a list): a new reference; Py_None (new) when the header is not the codec's (a
/// pickle); nullptr with ValueError set when it is malformed. Holds the GIL.
PyObject* decode_answer(const char* data, size_t size, PyObject* leaves);

}  // namespace tdshm_python
