#pragma once
// A Work of many messages to or from one peer (Transport::send_batch / recv_batch) that answers
// for each message too, so that a per-leaf transfer builds one Work per leaf only when it must
// (a failure, or an irecv's Work per leaf) and none when the batch succeeds. Message i is the
// i-th tensor given to the batch.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

namespace tdshm::detail {

class BatchWork : public c10d::Work {
 public:
  using c10d::Work::Work;

  /// Polls once (never waits); true once message i completed, with or without an error.
  virtual bool message_completed(size_t i) = 0;
  /// Message i completed without an error.
  virtual bool message_succeeded(size_t i) const = 0;
  /// Message i's error; null while it is pending or when it succeeded.
  virtual std::exception_ptr message_error(size_t i) const = 0;
  /// Waits for message i alone (the group's timeout for kNoTimeout), rethrowing its error.
  virtual void wait_message(size_t i, std::chrono::milliseconds timeout) = 0;
  /// Fails message i if it is still pending.
  virtual void abort_message(size_t i) = 0;
  /// Message i's receive failed on a leaf count: the sender's count (else 0).
  virtual uint16_t message_sender_leaves(size_t i) const = 0;
  /// Waits at most `timeout` and leaves the work pending at the deadline (false), where wait()
  /// would withdraw it; true once done, rethrowing its error. For callers that wait in slices
  /// (a loader's main process checking for Ctrl-C).
  virtual bool wait_keeping(std::chrono::milliseconds timeout) = 0;
  /// One Work per message, each with its own error.
  virtual std::vector<c10::intrusive_ptr<c10d::Work>> messages() const = 0;
};

}  // namespace tdshm::detail
