#pragma once
// Internal: a c10d Work that is also its collective's entry in a CollectiveQueue
// (process_group/collective_queue.h): one object per collective, issued at once and run later in issue
// order, by the thread that waits for it or by the queue's helper thread. Shared by the groups
// whose collectives queue (ProcessGroupShm, and the world across hosts).

#include <tdshm/errors.h>

#include "process_group/collective_queue.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::detail {

/// A collective issued to the group's queue (collective_queue.h), and the queue's entry for
/// it: one object per collective. wait() runs it (and those issued before it) in the caller's
/// thread unless the helper thread has started them, then raises its error; isCompleted() and
/// getFuture() ask the helper thread to start it now.
class QueuedWork : public c10d::Work, public QueuedCollective {
 public:
  QueuedWork(int rank, c10d::OpType type, std::shared_ptr<CollectiveQueue> queue, std::chrono::milliseconds limit,
             std::vector<at::Tensor> outputs, const char* backend)
      : c10d::Work(rank, type),
        QueuedCollective(limit),
        queue_(std::move(queue)),
        outputs_(std::move(outputs)),
        backend_(backend) {}

  bool isCompleted() override {
    if (done()) return true;
    queue_->urge();
    return done();
  }
  bool isSuccess() const override { return done() && !error(); }
  std::exception_ptr exception() const override { return done() ? error() : nullptr; }
  std::vector<at::Tensor> result() override { return outputs_; }

  bool wait(std::chrono::milliseconds timeout) override {
    std::optional<CollectiveQueue::Clock::time_point> until;
    if (timeout != kNoTimeout) until = CollectiveQueue::Clock::now() + timeout;
    if (!queue_->wait(*this, until)) {
      throw TimeoutError(std::string(backend_) + ": the collective did not complete within the wait's timeout of " +
                         std::to_string(timeout.count()) + " ms (it goes on)");
    }
    if (error()) std::rethrow_exception(error());
    return true;
  }

  // A collective no thread started is withdrawn; one that runs or ran is left as it is.
  void abort() override {
    queue_->cancel(*this, std::make_exception_ptr(TransportError("the collective was aborted before it ran")));
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard lk(future_mu_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      // The callback holds this Work until the collective is done (then it is dropped).
      auto self = c10::intrusive_ptr<QueuedWork>::unsafe_reclaim_from_nonowning(this);
      queue_->on_done(*this, [future = future_, self] {
        if (self->error()) {
          future->setError(self->error());
        } else {
          future->markCompleted(c10::IValue(self->outputs_));
        }
      });
      queue_->urge();  // a future's user may never call wait()
    }
    return future_;
  }

 private:
  void retain() noexcept override { c10::raw::intrusive_ptr::incref(this); }
  void release() noexcept override { c10::raw::intrusive_ptr::decref(this); }

  std::shared_ptr<CollectiveQueue> queue_;
  std::vector<at::Tensor> outputs_;
  const char* backend_;  // names the group in messages
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// QueuedWork with its body (the collective, a function of its deadline) inline.
template <class Body>
class QueuedWorkOf final : public QueuedWork {
 public:
  QueuedWorkOf(int rank, c10d::OpType type, std::shared_ptr<CollectiveQueue> queue, std::chrono::milliseconds limit,
               std::vector<at::Tensor> outputs, Body body, const char* backend)
      : QueuedWork(rank, type, std::move(queue), limit, std::move(outputs), backend), body_(std::move(body)) {}

 private:
  void run(QueuedCollective::Clock::time_point deadline) override { (*body_)(deadline); }
  void drop_body() noexcept override { body_.reset(); }
  std::optional<Body> body_;
};

}  // namespace tdshm::detail
