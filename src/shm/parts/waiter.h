#pragma once
// Waiting, written once. Point-to-point waits, collective steps and the helper thread all wait
// the same way:
//  * the wake-up pair on a rank's futex word (RankSlot::sleepers, RankSlot::wake_seq): whoever
//    makes progress possible for a rank publishes it, then wakes the rank only if it announced a
//    sleeper (wake); a rank that is about to sleep announces itself, re-checks, then sleeps
//    (SleepAnnouncement). Publish-then-check on one side and announce-then-recheck on the other
//    are ordered by seq_cst fences (Dekker), so no wake-up is lost and a spinning peer costs no
//    system call;
//  * SpinBudget: how long a waiter spins before it sleeps, adapted to how long waits take, and
//    whether offering the core (a yield) has been worth its system call lately;
//  * spin_then_sleep: the loop (check, pause, read the clock now and then, yield while the budget
//    lasts, then sleep), with what differs between waits (what progress is, when the wait is
//    over, what a timeout says, how long to sleep) given by the caller's hooks.
// Torch-free; the unit tests drive it on plain memory.

#include "shm/layout/segment_layout.h"
#include "shm/parts/futex.h"
#include "shm/parts/spin.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace tdshm::shm {

using WaitClock = std::chrono::steady_clock;

// ---- The wake-up pair --------------------------------------------------------------------------

/// Orders this thread's earlier stores (what a sleeper waits for) before the sleeper counts read
/// by wake_if_asleep. One fence serves any number of wake_if_asleep calls after it.
inline void wake_fence() noexcept { std::atomic_thread_fence(std::memory_order_seq_cst); }

/// Wakes the threads sleeping on `slot` (another rank's), if it announced any. Call after
/// wake_fence().
inline void wake_if_asleep(RankSlot& slot) noexcept {
  if (slot.sleepers.load(std::memory_order_relaxed) != 0) {
    slot.wake_seq.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(slot.wake_seq);
  }
}

/// Publication done: wake `slot`'s rank if it sleeps.
inline void wake(RankSlot& slot) noexcept {
  wake_fence();
  wake_if_asleep(slot);
}

/// A sleeper announced in this rank's own slot for as long as it lives (also when the re-check
/// throws): construct, re-check the condition, then sleep() unless it holds.
class SleepAnnouncement {
 public:
  explicit SleepAnnouncement(RankSlot& own) noexcept : own_(own) {
    own_.sleepers.fetch_add(1, std::memory_order_seq_cst);
    // The re-check reads with acquire loads, which the C++ model may order before the
    // announcement; this fence pairs with wake_fence (store-load ordering).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    seen_ = own_.wake_seq.load(std::memory_order_seq_cst);
  }
  ~SleepAnnouncement() { own_.sleepers.fetch_sub(1, std::memory_order_seq_cst); }
  SleepAnnouncement(const SleepAnnouncement&) = delete;
  SleepAnnouncement& operator=(const SleepAnnouncement&) = delete;

  /// Sleeps until a wake-up after the announcement, or `until`.
  void sleep(WaitClock::time_point until) noexcept { futex_wait(own_.wake_seq, seen_, until - WaitClock::now()); }

 private:
  RankSlot& own_;
  uint32_t seen_ = 0;
};

// ---- The spin budget ---------------------------------------------------------------------------

/// How long a waiter spins before it sleeps (any thread; relaxed). It starts at `max` (0: waits
/// never spin) and adapts to how long waits take (note): a wait that ended within `max` would have
/// been served by spinning, so the budget doubles (up to `max`); one that took more than 4 times
/// as long means spinning burnt a core that a peer may have needed (more ranks than cores: a data
/// loader's workers), so it halves, down to 1 us. Waits in between leave it alone (a transfer of
/// 100 leaves takes ~2x the spin: spinning still saves its wake-ups). Ping-pong keeps the whole
/// budget; a receiver that waits milliseconds for its producers sleeps almost at once.
class SpinBudget {
 public:
  explicit SpinBudget(std::chrono::nanoseconds max) noexcept : max_(max), ns_(max.count()) {}

  bool spins() const noexcept { return max_.count() > 0; }
  std::chrono::nanoseconds max() const noexcept { return max_; }
  std::chrono::nanoseconds get() const noexcept {
    return std::chrono::nanoseconds(ns_.load(std::memory_order_relaxed));
  }
  void note(WaitClock::duration elapsed) noexcept {
    constexpr int64_t kMinSpinNs = 1000;
    int64_t b = ns_.load(std::memory_order_relaxed);
    if (elapsed <= max_) {
      b = std::min(max_.count(), std::max(b * 2, kMinSpinNs));
    } else if (elapsed > 4 * max_) {
      b = std::max(kMinSpinNs, b / 2);
    }
    ns_.store(std::min(b, max_.count()), std::memory_order_relaxed);
  }

  // A spinning waiter offers its core (sched_yield) at its clock reads, for a peer that may run on
  // the same core (more ranks than cores: a data loader's workers). A yield that returns at once
  // gave the core to nobody and cost a system call during which the waiter did not look: ~1.2 us
  // in this VM, where a message that arrived meanwhile waited for it (the seed tree's per-leaf
  // ping-pong at 1.7-1.8 us one-way in runs that fell into yields, 0.8-1.0 in runs that did not).
  // After kUselessYields such yields in a row, waiters only offer the core at one clock read in
  // kProbeEvery; one yield that let another thread run makes them yield at every one again.
  static constexpr uint32_t kUselessYields = 64, kProbeEvery = 64;
  static constexpr std::chrono::microseconds kRanAnother{10};
  static_assert((kProbeEvery & (kProbeEvery - 1)) == 0, "a power of two: a probe is a mask");

  /// Whether the waiter offers its core at its clock read number `clock_read` (from 1).
  bool yields_at(uint32_t clock_read) const noexcept {
    return useless_yields_.load(std::memory_order_relaxed) < kUselessYields || clock_read % kProbeEvery == 0;
  }
  /// Notes a yield that took `took`: at once (nobody else ran), or long enough for another thread.
  void yielded(WaitClock::duration took) noexcept {
    const uint32_t n = useless_yields_.load(std::memory_order_relaxed);
    useless_yields_.store(took < kRanAnother ? std::min(n + 1, kUselessYields) : 0, std::memory_order_relaxed);
  }

 private:
  std::chrono::nanoseconds max_;
  std::atomic<int64_t> ns_;
  std::atomic<uint32_t> useless_yields_{0};  // yields in a row that ran nobody else
};

// ---- The loop ----------------------------------------------------------------------------------

/// What one pass of a wait found.
enum class Poll {
  kDone,   // the wait is over
  kMoved,  // not over, but something moved: the spin budget starts again
  kIdle,   // nothing moved
};

/// How a wait is judged for the spin budget once it ends.
enum class Judge {
  // By its length since it last moved. Transfers: every chunk moved starts the budget again, so
  // a message that streams through the arena for milliseconds keeps both ends spinning while
  // bytes flow (judged by the whole wait, the budget of a 64 MiB transfer fell to 1 us and each
  // side slept between chunks, waiting for a futex wake-up with the pipeline stalled).
  kSinceProgress,
  // A wait that slept by how soon after falling asleep it was woken, not by its whole length,
  // which includes the wake-up itself (30-60 us here): woken within 4 x the spin maximum, the
  // peer was close behind and spinning would have served it, so the budget grows again.
  // Collective steps: judged by the whole length, a budget that once shrank (a long wait for a
  // slow peer) stayed small, and every later step paid a sleep and a wake-up.
  kTimeAsleep,
};

/// Waits until `hooks` say it is over:
///   Poll poll()                   one pass (progress and the completion test);
///   bool at_clock(time_point now) run at every clock read (liveness checks; may throw); true
///                                 when the wait is over;
///   void timed_out()              at `deadline`: must throw;
///   void sleep(time_point now, time_point first_sleep)
///                                 once the budget is spent: announce, re-check, sleep.
/// Checks follow SpinChecks (spin.h): pauses, then a clock read and a yield every few checks. The
/// budget starts at the first clock read: a wait that ends sooner never reads the clock. A budget
/// of 0 (blocking-only waits) never spins: every check reads the clock and goes to sleep.
template <class Hooks>
void spin_then_sleep(SpinBudget& budget, Judge judge, WaitClock::time_point deadline, Hooks&& hooks) {
  using TimePoint = WaitClock::time_point;
  const bool spinning = budget.spins();
  TimePoint now{}, start{}, spin_end{}, first_sleep{};
  uint32_t clock_reads = 0;
  auto served = [&](TimePoint at) {
    if (!spinning) return;
    if (start == TimePoint{}) {
      budget.note(WaitClock::duration::zero());  // ended before the first clock read
    } else if (judge == Judge::kTimeAsleep && first_sleep != TimePoint{}) {
      const auto slept = at - first_sleep;
      budget.note(slept <= 4 * budget.max() ? WaitClock::duration::zero() : slept);
    } else {
      budget.note(at - start);
    }
  };
  for (unsigned spins = 1;; ++spins) {
    const Poll p = hooks.poll();
    if (p == Poll::kDone) {
      served(start == TimePoint{} ? TimePoint{} : WaitClock::now());
      return;
    }
    if (p == Poll::kMoved) {
      start = spin_end = TimePoint{};
      continue;
    }
    if (spinning && !detail::SpinChecks::clock_read(spins) && (spin_end == TimePoint{} || now < spin_end)) {
      detail::cpu_relax();
      continue;
    }
    now = WaitClock::now();
    ++clock_reads;
    if (spin_end == TimePoint{}) {
      start = now;
      spin_end = now + budget.get();
    }
    if (hooks.at_clock(now)) {
      served(now);
      return;
    }
    if (now >= deadline) hooks.timed_out();
    if (now < spin_end) {
      if (budget.yields_at(clock_reads)) {
        sched_yield();
        budget.yielded(WaitClock::now() - now);
      }
      continue;
    }
    if (first_sleep == TimePoint{}) first_sleep = now;
    hooks.sleep(now, first_sleep);
  }
}

}  // namespace tdshm::shm
