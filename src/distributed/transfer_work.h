#pragma once
// The Work a transfer hands to its user (TransferWork), over backend works or a Deferred's last
// stage (staged_receives.h), and the waits that name the key of a failed leaf. Internal to the
// distributed layer.

#include <tdshm/distributed.h>

#include "distributed/staged_receives.h"
#include "distributed/transfer_errors.h"

#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace tdshm::detail {

// The Work handed to users: backend works (given, or the index-th receive of a Deferred's last
// stage) plus what to do once they all succeeded (copy a staged leaf back), with errors that
// name the key.
//
// Locking: progress_mu_ is held by whoever advances the work (wait() blocks for it,

// isCompleted() only tries it); mu_ guards the state that isSuccess(), exception() and abort()
// read, and is never held across a wait.
class TransferWork final : public c10d::Work {
 public:
  TransferWork(std::string context, std::vector<WorkPtr> inner, c10d::OpType type,
               std::function<void()> on_success = {})
      : c10d::Work(-1, type),
        context_(std::move(context)),
        inner_(std::move(inner)),
        on_success_(std::move(on_success)) {}
  TransferWork(std::string context, std::shared_ptr<Deferred> deferred, size_t index, c10d::OpType type,
               std::function<void()> on_success = {})
      : c10d::Work(-1, type),
        context_(std::move(context)),
        deferred_(std::move(deferred)),
        index_(index),
        on_success_(std::move(on_success)) {}

  /// Only polls: never waits for a message, nor for a thread that waits in wait().
  bool isCompleted() override {
    {
      std::lock_guard lk(mu_);
      if (finished_) return true;
    }
    std::unique_lock progress(progress_mu_, std::try_to_lock);
    if (!progress.owns_lock()) return false;  // a wait() is advancing this work
    if (!resolve(/*block=*/false, ::kNoTimeout)) return false;
    for (const auto& w : inner_) {
      if (!w->isCompleted()) return false;
    }
    complete(::kNoTimeout);  // every work has completed: nothing in there waits
    return true;
  }
  bool isSuccess() const override {
    std::lock_guard lk(mu_);
    return finished_ && !error_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard lk(mu_);
    return error_;
  }
  std::vector<at::Tensor> result() override { return {}; }
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override {
    {
      std::lock_guard progress(progress_mu_);
      bool finished;
      {
        std::lock_guard lk(mu_);
        finished = finished_;
      }
      if (!finished) {
        resolve(/*block=*/true, timeout);
        complete(timeout);
      }
    }
    std::lock_guard lk(mu_);
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  void abort() override {
    std::vector<WorkPtr> inner;
    {
      std::lock_guard lk(mu_);
      inner = inner_;
    }
    for (auto& w : inner) w->abort();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    TORCH_CHECK(inner_.size() == 1 && !deferred_ && !on_success_,
                "this tdshm transfer work has no future; call wait()");
    return inner_[0]->getFuture();
  }

 private:
  // Requires progress_mu_. A deferred work's backend work is the receive the Deferred's last
  // stage posted for it; for a refused transfer there is none (the Deferred drained the
  // sender's messages), and the refusal is its error (it names the key itself). False while the
  // Deferred is not done (only when !block).
  bool resolve(bool block, std::chrono::milliseconds timeout) {
    if (!deferred_ || resolved_) return true;
    if (block) {
      deferred_->wait(timeout);
    } else if (!deferred_->poll()) {
      return false;
    }
    const Stage& last = deferred_->last();
    std::lock_guard lk(mu_);
    if (last.error) {
      refusal_ = last.error;
    } else {
      inner_ = {last.pending.at(index_)};
    }
    resolved_ = true;
    return true;
  }

  // Requires progress_mu_. Waits for every inner work (all of them, even after a failure:
  // nothing stays posted into a leaf the caller may reuse), then runs on_success, once.
  void complete(std::chrono::milliseconds timeout) {
    std::exception_ptr error = refusal_;
    for (const auto& w : inner_) {
      try {
        w->wait(timeout);
      } catch (...) {
        if (!error) error = current_with_context(context_);
      }
    }
    if (!error && on_success_) {
      try {
        on_success_();
      } catch (...) {
        error = current_with_context(context_);
      }
    }
    std::lock_guard lk(mu_);
    error_ = error;
    finished_ = true;
  }

  const std::string context_;
  std::vector<WorkPtr> inner_;  // written under both locks, read under either
  const std::shared_ptr<Deferred> deferred_;
  const size_t index_ = 0;
  const std::function<void()> on_success_;
  std::mutex progress_mu_;
  bool resolved_ = false;       // progress_mu_
  std::exception_ptr refusal_;  // progress_mu_
  mutable std::mutex mu_;
  bool finished_ = false;
  std::exception_ptr error_;
};

/// Waits for every work (all of them) and rethrows the first error, its message prefixed with
/// `verb` and the key of its leaf (works[i] moves keys[i]; the strings are built only on error).
void wait_keyed(const std::vector<WorkPtr>& works, const std::vector<Key>& keys, const char* verb);
/// The same with the key of works[i] computed by key_of(i), only on error.
void wait_keyed(const std::vector<WorkPtr>& works, const std::function<Key(size_t)>& key_of, const char* verb);
/// Waits for every work (all of them) and rethrows the first error.
void wait_all(const std::vector<WorkPtr>& works);

}  // namespace tdshm::detail
