// tdshm._C.TaskRing: main's tasks to one DataLoader worker through memory both share, instead of
// a pipe: a write and a wake-up check in main, no system call in a worker that polls for its next
// task (python/tdshm/loader.py; docs/loader.md, "How a batch travels").
//
// The memory is an anonymous shared mapping main makes before it forks the worker (Python's
// mmap.mmap(-1, n)), so nothing is named and nothing can be left behind. One writer (main), one
// reader (the worker). Layout: a header of two cache lines (the writer's tail and wake-up word;
// the reader's head and its "asleep" flag), then `slots` slots of kSlotBytes: a 4-byte length and
// the message. A message longer than a slot travels through the pipe, announced by a slot of
// length 0 (the marker), so the order of messages is the order of slots. The writer never finds
// the ring full: main has at most prefetch_factor x num_workers tasks unanswered, plus a resume
// and a stop, and the ring is sized for them (a full ring is an error, not a wait).
//
// The reader's sleep is a Dekker pair: it stores asleep = 1 and then loads the tail; the writer
// stores the tail and then loads asleep (both seq_cst), so either the reader sees the message or
// the writer sees the sleeper and wakes it (futex, never FUTEX_PRIVATE_FLAG: two processes).

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>

#include "shm/parts/futex.h"
#include "shm/parts/spin.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

constexpr uint64_t kRingMagic = 0x31474e4952534154ULL;  // "TASRING1"
constexpr size_t kSlotBytes = 512;
constexpr size_t kSlotPayload = kSlotBytes - sizeof(uint32_t);
// A slot's length word for a task put_task wrote: idx and an int index (kTaskSlot), or idx, a
// count and that many ints (kTaskListSlot: a batch sampler's list of indices).
constexpr uint32_t kTaskSlot = ~uint32_t{0}, kTaskListSlot = ~uint32_t{0} - 1;
constexpr size_t kTaskListMax = (kSlotPayload - 2 * sizeof(int64_t)) / sizeof(int64_t);

// `v` as an int64 when it is an int (not a bool, not a subclass) that fits.
bool exact_int64(PyObject* v, int64_t& out) {
  if (!PyLong_CheckExact(v)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow != 0 || (out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

struct RingHeader {
  uint64_t magic;
  uint32_t slots;
  uint32_t reserved;
  std::atomic<uint64_t> tail;              // messages written (the writer's)
  std::atomic<uint32_t> wake;              // futex word: +1 at every wake-up
  alignas(64) std::atomic<uint64_t> head;  // messages read (the reader's)
  std::atomic<uint32_t> asleep;            // 1 while the reader is in (or entering) its futex wait
};
static_assert(sizeof(RingHeader) == 128);
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);

class TaskRing {
 public:
  static size_t bytes_for(uint32_t slots) { return sizeof(RingHeader) + size_t{slots} * kSlotBytes; }

  // Over `memory` (a writable Python buffer, held exported while the ring lives: an mmap cannot
  // be closed under it), made by the writer (create) or checked by the reader.
  TaskRing(const py::buffer& memory, uint32_t slots, bool create) : info_(memory.request(true)) {
    if (slots == 0 || static_cast<size_t>(info_.size) * static_cast<size_t>(info_.itemsize) < bytes_for(slots))
      throw py::value_error("TaskRing: the memory holds fewer than " + std::to_string(slots) + " slots");
    if (reinterpret_cast<uintptr_t>(info_.ptr) % 64 != 0) throw py::value_error("TaskRing: memory not 64-byte aligned");
    header_ = static_cast<RingHeader*>(info_.ptr);
    slots_ = static_cast<uint8_t*>(info_.ptr) + sizeof(RingHeader);
    count_ = slots;
    if (create) {
      std::memset(info_.ptr, 0, bytes_for(slots));
      header_->slots = slots;
      header_->magic = kRingMagic;
    } else if (header_->magic != kRingMagic || header_->slots != slots) {
      throw py::value_error("TaskRing: the memory holds no ring of " + std::to_string(slots) + " slots");
    }
  }

  // Writer: the message in a slot (true), or the marker when it is longer than a slot (false:
  // the caller sends it through the pipe). RuntimeError when every slot is unread.
  bool put(py::bytes message) {
    char* data = nullptr;
    Py_ssize_t length = 0;
    if (PyBytes_AsStringAndSize(message.ptr(), &data, &length) != 0) throw py::error_already_set();
    const bool inline_message = length > 0 && static_cast<size_t>(length) <= kSlotPayload;
    uint8_t* slot = claim();
    const uint32_t stored = inline_message ? static_cast<uint32_t>(length) : 0;
    std::memcpy(slot, &stored, sizeof stored);
    if (inline_message) std::memcpy(slot + sizeof stored, data, stored);
    publish();
    return inline_message;
  }

  // Writer: the task (idx, index), which the reader gets as ("task", idx, index), as integers
  // when idx is an int of 64 bits and index one too or a list of at most kTaskListMax of them (a
  // sampler's index, a batch sampler's list: no pickle on either side); false when they are not
  // (the caller pickles the task and puts it).
  bool put_task(py::handle idx, py::handle index) {
    int64_t values[2 + kTaskListMax];
    if (!exact_int64(idx.ptr(), values[0])) return false;
    uint32_t kind = kTaskSlot;
    size_t words = 2;
    if (PyList_CheckExact(index.ptr())) {
      const Py_ssize_t n = PyList_GET_SIZE(index.ptr());
      if (static_cast<size_t>(n) > kTaskListMax) return false;
      for (Py_ssize_t i = 0; i < n; ++i)
        if (!exact_int64(PyList_GET_ITEM(index.ptr(), i), values[2 + i])) return false;
      kind = kTaskListSlot;
      values[1] = n;
      words = 2 + static_cast<size_t>(n);
    } else if (!exact_int64(index.ptr(), values[1])) {
      return false;
    }
    uint8_t* slot = claim();
    std::memcpy(slot, &kind, sizeof kind);
    std::memcpy(slot + sizeof kind, values, words * sizeof(int64_t));
    publish();
    return true;
  }

  // Reader: the next message (bytes; b"" for the marker: the message is in the pipe; a tuple
  // ("task", idx, index) for put_task's), or None
  // after `timeout` with none. Spins for `spin` first, offering the CPU to others (sched_yield)
  // every few checks, then sleeps. The GIL is released while it waits.
  py::object get(std::chrono::microseconds spin, std::chrono::microseconds timeout) {
    const uint64_t head = header_->head.load(std::memory_order_relaxed);
    if (!ready(head)) {
      bool arrived = false;
      {
        py::gil_scoped_release nogil;
        arrived = wait(head, spin, timeout);
      }
      if (!arrived) return py::none();
    }
    return take(head);
  }

  // Reader: the next message, or None at once.
  py::object try_get() {
    const uint64_t head = header_->head.load(std::memory_order_relaxed);
    if (header_->tail.load(std::memory_order_acquire) == head) return py::none();
    return take(head);
  }

 private:
  uint8_t* slot_at(uint64_t n) const noexcept { return slots_ + (n % count_) * kSlotBytes; }

  // The writer's next slot; RuntimeError when every slot is unread.
  uint8_t* claim() const {
    const uint64_t tail = header_->tail.load(std::memory_order_relaxed);
    if (tail - header_->head.load(std::memory_order_acquire) >= count_)
      throw std::runtime_error("TaskRing: every slot holds an unread message");
    return slot_at(tail);
  }

  // Makes the claimed slot the reader's, waking the reader when it sleeps.
  void publish() noexcept {
    header_->tail.store(header_->tail.load(std::memory_order_relaxed) + 1, std::memory_order_seq_cst);
    if (header_->asleep.load(std::memory_order_seq_cst) != 0) {
      header_->wake.fetch_add(1, std::memory_order_seq_cst);
      tdshm::shm::futex_wake_all(header_->wake);
    }
  }

  bool ready(uint64_t head) const noexcept { return header_->tail.load(std::memory_order_acquire) != head; }

  bool wait(uint64_t head, std::chrono::microseconds spin, std::chrono::microseconds timeout) const noexcept {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto spin_end = start + spin, deadline = start + timeout;
    // A check of ~1 µs, then the CPU offered to others: main, or the worker main waits for, may be
    // queued on this CPU (whole batches 1.13x faster than offering it every 4 checks, 8 pairs;
    // 4 scalars 1.08x; every 16 or 64 checks, slower again).
    while (Clock::now() < spin_end) {
      for (int i = 0; i < 32; ++i) {
        if (ready(head)) return true;
        tdshm::detail::cpu_relax();
      }
      sched_yield();
    }
    for (;;) {
      const uint32_t seen = header_->wake.load(std::memory_order_seq_cst);
      header_->asleep.store(1, std::memory_order_seq_cst);
      if (header_->tail.load(std::memory_order_seq_cst) != head) {
        header_->asleep.store(0, std::memory_order_relaxed);
        return true;
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        header_->asleep.store(0, std::memory_order_relaxed);
        return ready(head);
      }
      tdshm::shm::futex_wait(header_->wake, seen, deadline - now);
      header_->asleep.store(0, std::memory_order_relaxed);
      if (ready(head)) return true;
    }
  }

  py::object take(uint64_t head) {
    const uint8_t* slot = slot_at(head);
    uint32_t length = 0;
    std::memcpy(&length, slot, sizeof length);
    py::object message;
    if (length == kTaskSlot || length == kTaskListSlot) {
      int64_t values[2];
      std::memcpy(values, slot + sizeof length, sizeof values);
      if (length == kTaskSlot) {
        message = py::make_tuple(task_word_, values[0], values[1]);
      } else {
        if (values[1] < 0 || static_cast<uint64_t>(values[1]) > kTaskListMax)
          throw std::runtime_error("TaskRing: a task's count is out of range");
        py::list index(static_cast<size_t>(values[1]));
        for (int64_t i = 0; i < values[1]; ++i) {
          int64_t v = 0;
          std::memcpy(&v, slot + sizeof length + (2 + static_cast<size_t>(i)) * sizeof(int64_t), sizeof v);
          index[static_cast<size_t>(i)] = py::int_(v);
        }
        message = py::make_tuple(task_word_, values[0], std::move(index));
      }
    } else if (length <= kSlotPayload) {
      message = py::bytes(reinterpret_cast<const char*>(slot + sizeof length), length);
    } else {
      throw std::runtime_error("TaskRing: a slot's length is out of range");
    }
    header_->head.store(head + 1, std::memory_order_release);
    return message;
  }

  py::buffer_info info_;
  py::str task_word_{"task"};
  RingHeader* header_ = nullptr;
  uint8_t* slots_ = nullptr;
  uint32_t count_ = 0;
};

}  // namespace

void bind_task_ring(py::module_& m) {
  py::class_<TaskRing>(m, "TaskRing",
                       "Main's messages to one DataLoader worker through a shared anonymous mapping (one writer, "
                       "one reader); a message longer than a slot goes through the pipe, announced by b\"\".")
      .def(py::init<const py::buffer&, uint32_t, bool>(), py::arg("memory"), py::arg("slots"), py::arg("create"))
      .def_static("bytes_for", &TaskRing::bytes_for, py::arg("slots"), "The mapping's size for `slots` slots.")
      .def_property_readonly_static("slot_payload", [](py::object) { return kSlotPayload; })
      .def("put", &TaskRing::put, py::arg("message"),
           "Writer: True when the message went into a slot; False when it is longer than one (the marker went "
           "instead: send the message through the pipe). RuntimeError when every slot is unread.")
      .def("put_task", &TaskRing::put_task, py::arg("idx"), py::arg("index"),
           "Writer: the task (idx, index), read as (\"task\", idx, index), when idx is an int of 64 bits and "
           "index one too or a list of at most 61; "
           "False when not (pickle it and put it).")
      .def("get", &TaskRing::get, py::arg("spin"), py::arg("timeout"),
           "Reader: the next message (b\"\": it is in the pipe), or None after `timeout` (spinning for `spin` "
           "first).")
      .def("try_get", &TaskRing::try_get, "Reader: the next message, or None at once.");
}
