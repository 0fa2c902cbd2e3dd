// The collective steps of one rank (see collective/steps.h; the protocol is in engine/collectives.h).

#include "shm/collective/steps.h"

#include <tdshm/errors.h>

#include <utility>

namespace tdshm::shm {

namespace {

// The word a rank publishes for step `step` described by `what`: both go in, so a peer that is a
// step behind or ahead, or in another collective, never matches.
uint64_t step_word(uint64_t what, uint64_t step) noexcept {
  uint64_t x = what ^ (step * 0x9e3779b97f4a7c15ull);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x | 1;  // never 0, the value of a fresh segment
}

}  // namespace

CollectiveSteps::CollectiveSteps(Segment& segment, SpinBudget& spin, StepPeers& peers) noexcept
    : segment_(segment),
      spin_(spin),
      peers_(peers),
      rank_(static_cast<int>(segment.rank())),
      size_(static_cast<int>(segment.params().world_size)) {}

uint64_t CollectiveSteps::part_bytes() const noexcept { return segment_.geometry().window_bytes / kWindowParts; }

uint8_t* CollectiveSteps::my_part(uint64_t step) const noexcept {
  return segment_.window_memory(static_cast<uint32_t>(rank_)) + (step % kWindowParts) * part_bytes();
}

const uint8_t* CollectiveSteps::part_of(int rank, uint64_t step) const noexcept {
  return segment_.window_memory(static_cast<uint32_t>(rank)) + (step % kWindowParts) * part_bytes();
}

void CollectiveSteps::fail(std::exception_ptr error) noexcept {
  if (!error_) error_ = std::move(error);
}

void CollectiveSteps::fail_and_throw(std::exception_ptr error) {
  fail(error);
  std::rethrow_exception(error);
}

uint64_t CollectiveSteps::begin_step(uint64_t what, WaitClock::time_point deadline) {
  if (error_) std::rethrow_exception(error_);
  if (std::exception_ptr e = peers_.unusable()) std::rethrow_exception(e);
  const uint64_t step = ++step_;
  if (step > kWindowParts) {
    // Part step % kWindowParts was last used by step - kWindowParts: every peer must have read it.
    wait_for(
        [&] {
          for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            if (segment_.rank_slot(static_cast<uint32_t>(p)).consumed.load(std::memory_order_acquire) + kWindowParts <
                step) {
              return p;
            }
          }
          return -1;
        },
        deadline, step, "to finish reading its previous part");
  }
  what_[step % kWindowParts] = what;
  segment_.rank_slot(static_cast<uint32_t>(rank_))
      .step_check[step % kWindowParts]
      .store(step_word(what, step), std::memory_order_relaxed);
  return step;
}

void CollectiveSteps::publish_step(uint64_t step) {
  // Releases this rank's part and its step word (pairs with the acquire in await_step).
  segment_.rank_slot(static_cast<uint32_t>(rank_)).published.store(step, std::memory_order_release);
  wake_peers();
}

void CollectiveSteps::await_step(uint64_t step, WaitClock::time_point deadline, int from) {
  const uint64_t want = step_word(what_[step % kWindowParts], step);
  auto awaited = [&](int p) { return p != rank_ && (from < 0 || p == from); };
  wait_for(
      [&] {
        for (int p = 0; p < size_; ++p) {
          if (!awaited(p)) continue;
          const RankSlot& slot = segment_.rank_slot(static_cast<uint32_t>(p));
          if (slot.published.load(std::memory_order_acquire) < step) return p;
        }
        return -1;
      },
      deadline, step, "to publish its part");
  for (int p = 0; p < size_; ++p) {
    if (!awaited(p)) continue;
    const RankSlot& slot = segment_.rank_slot(static_cast<uint32_t>(p));
    // Read once; published >= step was loaded with acquire above, and the peer cannot reuse this
    // part before this rank ends the step.
    if (slot.step_check[step % kWindowParts].load(std::memory_order_relaxed) != want) {
      fail_and_throw(std::make_exception_ptr(TransportError(
          "shm collective: " + segment_.describe_rank(static_cast<uint32_t>(p)) + " of segment '" +
          segment_.params().name +
          "' is in another collective, or in the same one with other sizes, dtype, op or root (collective step " +
          std::to_string(step) + " of rank " + std::to_string(rank_) +
          "): every rank must call the same collectives in the same order with matching tensors")));
    }
  }
}

void CollectiveSteps::end_step(uint64_t step) {
  if (segment_.poisoned()) {
    if (std::exception_ptr e = peers_.unusable()) fail_and_throw(e);
  }
  segment_.rank_slot(static_cast<uint32_t>(rank_)).consumed.store(step, std::memory_order_release);
  wake_peers();
}

void CollectiveSteps::wake_peers() noexcept {
  wake_fence();  // one fence for all peers
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) wake_if_asleep(segment_.rank_slot(static_cast<uint32_t>(p)));
  }
}

// Waits until `pending()` (the first rank still awaited, or -1) says every awaited rank is there,
// on spin_then_sleep: spins while waits are short, checks liveness and the deadline at every
// clock read, then sleeps on this rank's wake word, which every peer bumps when it publishes or
// ends a step. Judged by time asleep (waiter.h, Judge::kTimeAsleep).
template <class Pending>
void CollectiveSteps::wait_for(Pending pending, WaitClock::time_point deadline, uint64_t step, const char* what) {
  if (pending() < 0) return;
  peers_.before_wait();  // a collective the group left to run may be what a peer awaits (wait_hook.h)
  struct Hooks {
    CollectiveSteps& s;
    Pending& pending;
    WaitClock::time_point deadline;
    uint64_t step;
    const char* what;
    Poll poll() { return pending() < 0 ? Poll::kDone : Poll::kIdle; }
    bool at_clock(WaitClock::time_point now) {
      s.peers_.check_due(now);
      // Ready first: a peer that published its part and then left (its last collective done) is
      // gone, but what this rank waits for is there. Else the error of a lost peer names the
      // rank this step still lacks: a survivor that published the step, then failed and left its
      // group, is gone too, but it is not the one that failed the collective.
      const int awaited = pending();
      if (awaited < 0) return true;
      if (std::exception_ptr e = s.peers_.lost(awaited)) s.fail_and_throw(e);
      return false;
    }
    void timed_out() {
      s.fail_and_throw(std::make_exception_ptr(
          TimeoutError("segment '" + s.segment_.params().name + "', rank " + std::to_string(s.rank_) +
                       ": timed out in a collective (step " + std::to_string(step) + ") waiting for a peer " + what)));
    }
    void sleep(WaitClock::time_point now, WaitClock::time_point) {
      SleepAnnouncement asleep(s.segment_.rank_slot(static_cast<uint32_t>(s.rank_)));
      if (pending() >= 0) asleep.sleep(s.peers_.sleep_limit(now, deadline));
    }
  };
  Hooks hooks{*this, pending, deadline, step, what};
  spin_then_sleep(spin_, Judge::kTimeAsleep, deadline, hooks);
}

}  // namespace tdshm::shm
