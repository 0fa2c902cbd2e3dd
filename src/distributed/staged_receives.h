#pragma once
// Receives that go in stages: what a later receive may be depends on a header from the sender
// (the layout descriptor, the consolidated header). irecv posts the header's receive and
// returns; the stages after it run when the header is in, from a wait or from a poll
// (isCompleted), and each only checks and posts receives, never waits. So irecv never blocks,
// isCompleted never blocks, and ranks that post receives before sends do not deadlock.
//
// Internal to the distributed layer (the protocols of protocols.h use it).

#include <tdshm/distributed.h>

#include "distributed/transfer_errors.h"

#include <algorithm>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace tdshm::detail {

/// One stage: the receives it posted and, unless it is the last, what to do once they all
/// completed.
struct Stage {
  std::vector<WorkPtr> pending;
  /// Checks what `pending` brought and returns the next stage (posting its receives, never
  /// waiting); null in the last stage.
  std::function<Stage()> next;
  /// Last stage only: the transfer's error. A refused transfer's last stage drains the
  /// sender's messages (`pending`); the Deferred waits for them before it reports the error.
  std::exception_ptr error;
};

// Every backend work is waited exactly once (a gloo receive's wait() waits for one more message
// each time it is called), so the works of a stage are waited by the Deferred alone, except
// the last stage's receives of a successful transfer, each of which is handed to one user work.

class Deferred {
 public:
  /// `what` names what the first stage receives, for messages ("layout descriptor").
  Deferred(std::string what, Stage first) : what_(std::move(what)), stage_(std::move(first)) {}

  /// Never waits for a message, nor for a thread that waits in wait(): advances through every
  /// stage whose receives have completed. True once the last stage is posted (and, for a
  /// refused transfer, its drains have completed).
  bool poll() {
    std::unique_lock lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) return false;  // a wait() is advancing it
    return advance(/*block=*/false, ::kNoTimeout);
  }
  /// Waits (each backend wait with `timeout`) until poll() would return true.
  void wait(std::chrono::milliseconds timeout) {
    std::lock_guard lk(mu_);
    advance(/*block=*/true, timeout);
  }
  /// The last stage: read it only after poll() returned true or wait() returned (it never
  /// changes after that).
  const Stage& last() const { return stage_; }

 private:
  // Requires mu_.
  bool advance(bool block, std::chrono::milliseconds timeout) {
    while (stage_.next || (stage_.error && !stage_.pending.empty())) {
      if (!block && !std::all_of(stage_.pending.begin(), stage_.pending.end(),
                                 [](const WorkPtr& w) { return w->isCompleted(); })) {
        return false;
      }
      std::exception_ptr failed;
      for (const auto& w : stage_.pending) {
        try {
          w->wait(timeout);  // completed already when polling
        } catch (...) {
          if (!failed) failed = current_with_context("receiving the sender's " + what_ + ": ");
        }
      }
      if (!stage_.next) {
        // A refused transfer's drains: its refusal says what went wrong first, a drain can only
        // fail after it.
        stage_.pending.clear();
        break;
      }
      const std::function<Stage()> next = std::move(stage_.next);
      stage_.next = nullptr;
      if (failed) {
        stage_ = Stage{{}, nullptr, failed};
        break;
      }
      try {
        stage_ = next();
      } catch (...) {
        stage_ = Stage{{}, nullptr, current_with_context("")};  // a tdshm error keeps its type
      }
    }
    return true;
  }

  std::mutex mu_;
  const std::string what_;
  Stage stage_;
};

/// Waits for `d`'s last stage and returns its receives; for a refused transfer (once the
/// drains completed), throws the refusal.
inline const std::vector<WorkPtr>& wait_last(Deferred& d) {
  d.wait(::kNoTimeout);
  const Stage& last = d.last();
  if (last.error) std::rethrow_exception(last.error);
  return last.pending;
}

}  // namespace tdshm::detail
