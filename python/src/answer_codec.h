#pragma once
// The decoding half of tdshm._C.AnswerCodec (answer_codec.cpp), for FeedConsumer.next_answer.

#include <Python.h>

#include <cstddef>

namespace tdshm_python {

/// The answer AnswerCodec encoded into `data` (`size` bytes), its tensors taken in order from
/// `leaves` (a list): a new reference; Py_None (new) when the header is not the codec's (a
/// pickle); nullptr with ValueError set when it is malformed. Holds the GIL.
PyObject* decode_answer(const char* data, size_t size, PyObject* leaves);

}  // namespace tdshm_python
