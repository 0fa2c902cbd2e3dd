#pragma once
// The collective steps of one rank (the protocol is in engine/collectives.h): each rank's window in the
// segment, its step words in its RankSlot, and the waits between them (waiter.h). It knows
// nothing of point-to-point transfers: what it needs of the engine that runs it (is the group
// still whole, when to check peers, how long to sleep) it asks through StepPeers.
//
// Every rank runs the same steps in the same order. In step s a rank writes into part
// s % kWindowParts of its window (my_part), publishes it, waits until the peers have published
// step s with the same `what`, reads the parts it needs (part_of), and ends the step. Callers
// hold mutex() for a whole collective; everything here is guarded by it.

#include "shm/parts/waiter.h"
#include "shm/segment/segment.h"

#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>

namespace tdshm::shm {

/// What the collective steps ask of the engine that runs them.
class StepPeers {
 public:
  /// The error the group fails with now that it cannot go on (destroyed, or its segment cut),
  /// else null.
  virtual std::exception_ptr unusable() = 0;
  /// unusable(), else the error of a lost peer: `awaited`'s first (the rank a step still waits
  /// for), else any peer's; null while every peer is there.
  virtual std::exception_ptr lost(int awaited) = 0;
  /// Runs the liveness checks that are due at `now`.
  virtual void check_due(WaitClock::time_point now) = 0;
  /// The latest a step's waiter may sleep before it checks again.
  virtual WaitClock::time_point sleep_limit(WaitClock::time_point now, WaitClock::time_point deadline) const = 0;
  /// Runs the group's wait hooks (wait_hook.h): a step is about to wait.
  virtual void before_wait() noexcept = 0;

 protected:
  virtual ~StepPeers() = default;
};

class CollectiveSteps {
 public:
  CollectiveSteps(Segment& segment, SpinBudget& spin, StepPeers& peers) noexcept;
  CollectiveSteps(const CollectiveSteps&) = delete;
  CollectiveSteps& operator=(const CollectiveSteps&) = delete;

  std::mutex& mutex() noexcept { return mu_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  /// Bytes of one part (window_bytes / kWindowParts).
  uint64_t part_bytes() const noexcept;
  /// Starts the next step, describing it by `what` (the collective, its sizes, its step within
  /// it): waits until every peer has ended the step that last used the same part. Throws the
  /// error of an earlier collective that failed midway (the group's steps are out of step then).
  uint64_t begin_step(uint64_t what, WaitClock::time_point deadline);
  uint8_t* my_part(uint64_t step) const noexcept;
  const uint8_t* part_of(int rank, uint64_t step) const noexcept;
  void publish_step(uint64_t step);
  /// Waits until every peer (or only rank `from`, when >= 0) has published `step`;
  /// TransportError if one describes it otherwise (the ranks called different collectives, or
  /// with other sizes), PeerLostError, TimeoutError.
  void await_step(uint64_t step, WaitClock::time_point deadline, int from = -1);
  /// This rank has read everything it needs of `step` (TransportError if the segment was cut).
  void end_step(uint64_t step);
  /// The last step begun (the same number on every rank that runs the same collectives).
  uint64_t last_step() const noexcept { return step_; }
  /// Marks the group's collectives as failed with `error` (later collectives throw it).
  void fail(std::exception_ptr error) noexcept;

 private:
  template <class Pending>
  void wait_for(Pending pending, WaitClock::time_point deadline, uint64_t step, const char* what);
  [[noreturn]] void fail_and_throw(std::exception_ptr error);
  void wake_peers() noexcept;

  Segment& segment_;
  SpinBudget& spin_;
  StepPeers& peers_;
  const int rank_;
  const int size_;
  std::mutex mu_;                     // a whole collective; guards what follows
  uint64_t step_ = 0;                 // last step begun
  uint64_t what_[kWindowParts] = {};  // `what` of the step in each window part
  std::exception_ptr error_;          // a collective failed midway: later ones fail with it
};

}  // namespace tdshm::shm
