#pragma once
// Which tensors a DataLoader answer carries as they are, by the feed (tdshm._C.LeafIds,
// AnswerCodec): the others are pickled, as torch's queue would, so that they arrive as torch's
// loader gives them.

#include <Python.h>

namespace tdshm_python {

/// Whether `o` is exactly a torch.Tensor (a subclass such as Parameter keeps its type only
/// through its pickle) on the CPU, strided, not quantized, without a conjugate or negative bit,
/// and not requiring grad (the feed sends bytes, views arrive without autograd): what the feed
/// sends by reference or inside a frame and main receives as a plain view or tensor.
bool plain_tensor(PyObject* o);

}  // namespace tdshm_python
