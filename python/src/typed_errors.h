#pragma once
// How the module's classes (Board, FeedProducer, FeedConsumer) raise tdshm's errors: the typed
// ones keep their Python meaning (TypeError, KeyError, TimeoutError); the others are
// RuntimeErrors whose text names what went wrong. And how a long wait with the GIL released
// still answers Ctrl-C: its check (python_check) runs Python's signal handlers, and what they
// raise is raised when the wait returns.

#include <pybind11/pybind11.h>

#include <tdshm/errors.h>

#include <exception>
#include <functional>
#include <memory>
#include <optional>

namespace tdshm_python {

namespace py = pybind11;

/// What a Python signal handler raised during a wait with the GIL released (PyErr_Fetch's three).
struct PythonSignal {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};

/// A FeedOptions::check for a wait with the GIL released: takes the GIL, runs the pending signal
/// handlers (Ctrl-C's KeyboardInterrupt, torch's SIGCHLD check of its workers) and then `also`
/// (a Python callable, or None), and throws what they raised as a PythonSignal.
inline std::function<void()> python_check(py::object also = py::none()) {
  // The callable may be dropped where the GIL is not held (a copy of the options): take it then.
  std::shared_ptr<py::object> fn(new py::object(std::move(also)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
  return [fn] {
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() == 0 && !fn->is_none()) {
      PyObject* r = PyObject_CallNoArgs(fn->ptr());
      if (r != nullptr) {
        Py_DECREF(r);
        return;
      }
    } else if (!PyErr_Occurred()) {
      return;
    }
    PythonSignal s;
    PyErr_Fetch(&s.type, &s.value, &s.traceback);
    throw s;
  };
}

[[noreturn]] inline void raise_typed(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const PythonSignal& s) {
    PyErr_Restore(s.type, s.value, s.traceback);
    throw py::error_already_set();
  } catch (const tdshm::TypeError& e) {
    throw py::type_error(e.what());
  } catch (const tdshm::KeyError& e) {
    throw py::key_error(e.what());
  } catch (const tdshm::TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
    throw py::error_already_set();
  }
}

/// f() with the GIL released; its error raised once the GIL is held again.
template <class F>
auto released(F&& f) {
  std::exception_ptr error;
  std::optional<decltype(f())> result;
  {
    py::gil_scoped_release nogil;
    try {
      result.emplace(f());
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error) raise_typed(error);
  return std::move(*result);
}

/// f() with the GIL held, its tdshm errors typed.
template <class F>
auto typed(F&& f) {
  try {
    return f();
  } catch (const tdshm::Error&) {
    raise_typed(std::current_exception());
  }
}

}  // namespace tdshm_python
