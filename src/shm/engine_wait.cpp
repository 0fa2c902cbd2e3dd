// Waiting in ShmEngine: wake-ups (futex words in the rank table), the adaptive spin-then-sleep
// wait, and the helper thread that completes futures (see engine.h).

#include "shm/engine_internal.h"

#include "common/log.h"
#include "shm/futex.h"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace tdshm::detail {

using shm::EntryHeader;

void ShmEngine::notify(int r) {
  shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(r));
  // Orders the publication above before the sleepers check (pairs with sleep_until_event).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (slot.sleepers.load(std::memory_order_relaxed) != 0) {
    slot.wake_seq.fetch_add(1, std::memory_order_seq_cst);
    shm::futex_wake_all(slot.wake_seq);
  }
}

void ShmEngine::sleep_until_event(Clock::time_point until, bool drain_all) {
  shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(rank_));
  slot.sleepers.fetch_add(1, std::memory_order_seq_cst);  // announce, then re-check (see notify)
  // The re-check below reads ring words with acquire loads, which the C++ model may order before
  // the announcement; this fence pairs with the one in notify (store-load ordering, Dekker).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const uint32_t seen = slot.wake_seq.load(std::memory_order_seq_cst);
  bool moved;
  {
    std::lock_guard lk(mu_);
    moved = progress_locked(drain_all);
  }
  if (!moved) shm::futex_wait(slot.wake_seq, seen, until - Clock::now());
  slot.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void ShmEngine::wait(std::span<const std::shared_ptr<ShmOp>> ops, Clock::time_point deadline, bool stop_on_error) {
  // Ops complete mostly in order (a pair's messages match in order): the first one not known to
  // be done is remembered, so a check does not walk a batch of 100 leaves each time. A failure
  // further on (stop_on_error) is looked for at every clock read.
  size_t first_pending = 0;
  auto failed = [](const std::shared_ptr<ShmOp>& op) {
    return op && op->done.load(std::memory_order_acquire) && op->error;
  };
  auto all_done = [&] {
    while (first_pending < ops.size() && is_done(ops[first_pending])) {
      if (stop_on_error && failed(ops[first_pending])) return true;
      ++first_pending;
    }
    return first_pending == ops.size();
  };
  auto failed_later = [&] { return stop_on_error && std::any_of(ops.begin() + first_pending, ops.end(), failed); };
  if (all_done()) return;
  // Checks follow SpinChecks (shm/spin.h): pauses, then a clock read and a yield every
  // few checks. The spin budget starts at the first clock read: a wait that ends sooner never
  // reads the clock. Blocking-only waits (spin 0) never spin. The budget adapts (note_wait):
  // spinning only pays while waits are short. What counts is the time without progress: every
  // chunk this rank moves starts the budget again, so a message that streams through the arena
  // for milliseconds keeps both ends spinning while bytes flow (judged by the whole wait, the
  // budget of a 64 MiB transfer fell to 1 us and each side slept between chunks, waiting for a
  // futex wake-up with the pipeline stalled).
  const bool spinning = options_.spin.count() > 0;
  Clock::time_point now{}, start{}, spin_end{}, first_sleep{};
  auto done = [&] {
    if (!all_done()) return false;
    if (spinning) note_wait(start == Clock::time_point{} ? Clock::duration::zero() : Clock::now() - start);
    return true;
  };
  for (unsigned spins = 1;; ++spins) {
    bool moved;
    {
      std::lock_guard lk(mu_);
      moved = progress_locked(/*drain_all=*/false);
    }
    if (done()) return;
    if (moved) {
      start = spin_end = Clock::time_point{};
      continue;
    }
    if (spinning && !SpinChecks::clock_read(spins) && (spin_end == Clock::time_point{} || now < spin_end)) {
      cpu_relax();
      continue;
    }
    now = Clock::now();
    if (spin_end == Clock::time_point{}) {
      start = now;
      spin_end = now + std::chrono::nanoseconds(spin_budget_ns_.load(std::memory_order_relaxed));
    }
    maybe_check_peers(now);
    if (done()) return;
    if (failed_later()) return;
    if (now >= deadline) {
      std::string pending;
      for (const auto& op : ops) {
        if (!is_done(op)) pending += (pending.empty() ? "" : "; ") + op->what();
      }
      std::lock_guard lk(mu_);
      for (size_t p = 0; p < held_bytes_.size(); ++p) {
        if (held_bytes_[p] != 0) {
          pending += "; a message of " + std::to_string(held_bytes_[p]) + " bytes from rank " + std::to_string(p) +
                     " waits in its ring for its recv (early messages already hold " +
                     std::to_string(unexpected_bytes_) + " bytes of ShmOptions::max_unexpected_bytes = " +
                     std::to_string(options_.max_unexpected_bytes) + ")";
        }
      }
      auto error = make_error<TimeoutError>("segment '" + name_ + "', rank " + std::to_string(rank_) +
                                            ": timed out waiting for " + pending);
      for (const auto& op : ops) withdraw(op, error);
      std::rethrow_exception(error);
    }
    if (now < spin_end) {
      sched_yield();
      continue;
    }
    // Before sleeping, messages from sources nobody waits on are drained into process memory
    // (early messages), so that a sender blocked on room that this rank waits for indirectly
    // (two ranks that both send more than the arena holds before they receive) goes on. Not at
    // once, though: a data loader's main rank that sleeps a few microseconds for worker 1 would
    // otherwise copy the batches that workers 2-4 have queued (they run ahead by design) out of
    // their slots into fresh buffers, and copy them again when it posts their receives (4
    // workers, consolidated: that double copy was half of the main rank's memcpy time). After
    // kDrainOthersAfter of sleeping (a deadlock costs that much once), a sleep drains if every
    // rank this wait depends on sleeps too: one that runs is not blocked on this rank and will
    // deliver (more ranks than cores: a descheduled worker). Draining then only made copies: a
    // loader's main rank that waited for one worker past 1 ms took the other workers' queued
    // batches out of their rings every time, fell behind, and in 2 of 6 runs of 80,000 batches
    // held 7,000-10,000 early messages and ran at 44-53k batches/s instead of 78-83k. A rank
    // that waits on room without sleeping (a caller polling isCompleted()) is not seen asleep:
    // after kDrainAnywayAfter every sleep drains, so such a cycle costs that much once.
    constexpr auto kDrainOthersAfter = std::chrono::milliseconds(1);
    constexpr auto kDrainAnywayAfter = std::chrono::milliseconds(20);
    if (first_sleep == Clock::time_point{}) first_sleep = now;
    const auto slept = now - first_sleep;
    const bool drain_others =
        slept >= kDrainAnywayAfter || (slept >= kDrainOthersAfter && waited_ranks_asleep(ops));
    const auto next_check = from_ticks(next_peer_check_.load(std::memory_order_relaxed));
    auto until = std::min({deadline, std::max(next_check, now), now + std::chrono::milliseconds(100)});
    if (slept < kDrainOthersAfter) until = std::min(until, first_sleep + kDrainOthersAfter);
    if (!drain_others) until = std::min(until, first_sleep + kDrainAnywayAfter);
    sleep_until_event(until, drain_others);
  }
}

// Whether every rank that one of `ops` still waits on (its peer; every peer for an any-source
// receive) announces a sleeper in its RankSlot: whether this wait may be part of a cycle of
// ranks blocked on each other. The counts are read without trust: a peer that lies only makes
// this rank drain sooner or later (kDrainAnywayAfter bounds it). A lost peer's ops fail through
// the liveness checks, whatever this says.
bool ShmEngine::waited_ranks_asleep(std::span<const std::shared_ptr<ShmOp>> ops) const {
  auto asleep = [&](int p) {
    return segment_->rank_slot(static_cast<uint32_t>(p)).sleepers.load(std::memory_order_relaxed) != 0;
  };
  for (const auto& op : ops) {
    if (!op || op->done.load(std::memory_order_acquire)) continue;
    if (op->peer >= 0) {
      if (!asleep(op->peer)) return false;
      continue;
    }
    for (int p = 0; p < size_; ++p) {
      if (p != rank_ && !asleep(p)) return false;
    }
  }
  return true;
}

// Adapts the spin budget to how long waits take: a wait that ended within ShmOptions::spin would
// have been served by spinning, so the budget doubles (up to ShmOptions::spin); one that took more
// than 4 times as long means spinning burnt a core that a peer may have needed (more ranks than
// cores: a data loader's workers), so it halves, down to 1 us. Waits in between leave it alone
// (a transfer of 100 leaves takes ~2x the spin: spinning still saves its wake-ups). Ping-pong
// keeps the full budget; a receiver that waits milliseconds for its producers sleeps almost at once.
void ShmEngine::note_wait(Clock::duration elapsed) noexcept {
  constexpr int64_t kMinSpinNs = 1000;
  const int64_t max = std::chrono::duration_cast<std::chrono::nanoseconds>(options_.spin).count();
  int64_t b = spin_budget_ns_.load(std::memory_order_relaxed);
  if (elapsed <= options_.spin) {
    b = std::min(max, std::max(b * 2, kMinSpinNs));
  } else if (elapsed > 4 * options_.spin) {
    b = std::max(kMinSpinNs, b / 2);
  }
  spin_budget_ns_.store(std::min(b, max), std::memory_order_relaxed);
}

void ShmEngine::watch(std::vector<std::shared_ptr<ShmOp>> ops, std::function<void()> on_done) {
  const bool done = std::all_of(ops.begin(), ops.end(), is_done);
  if (done) {
    on_done();
    return;
  }
  {
    std::lock_guard lk(watch_mu_);
    watches_.push_back({std::move(ops), std::move(on_done)});
    if (!background_.joinable() && !stopping_) background_ = std::thread(background_loop, weak_from_this());
  }
  watch_cv_.notify_all();
}

// The helper thread holds the engine only while it works on it, so that the engine can be
// destroyed (by a callback, even) while the thread runs.
void ShmEngine::background_loop(std::weak_ptr<ShmEngine> weak) {
  for (;;) {
    auto self = weak.lock();
    if (!self || !self->background_step()) return;
  }
}

// One round of the helper thread; false once it should end. Nothing escapes it.
bool ShmEngine::background_step() {
  std::vector<Watch> ready;
  bool stop = false;
  {
    std::unique_lock lk(watch_mu_);
    watch_cv_.wait(lk, [&] { return stopping_ || !watches_.empty(); });
    if (stopping_) {
      stop = true;
      ready = std::move(watches_);  // fail-fast: their ops were finished with errors or will be
      watches_.clear();
    }
  }
  auto run = [&](std::vector<Watch>& list) {
    for (auto& w : list) {
      try {
        w.on_done();
      } catch (const std::exception& e) {
        log().error("segment '{}': a future's completion callback threw: {}", name_, e.what());
      } catch (...) {
        log().error("segment '{}': a future's completion callback threw", name_);
      }
    }
  };
  if (stop) {  // also when no watch is left: shutdown() joins this thread
    run(ready);
    return false;
  }
  try {
    {
      std::lock_guard lk(mu_);
      progress_locked();
    }
    maybe_check_peers(Clock::now());
  } catch (const std::exception& e) {
    log().error("segment '{}': progress on the helper thread failed: {}", name_, e.what());
  }
  {
    std::lock_guard lk(watch_mu_);
    auto it = std::partition(watches_.begin(), watches_.end(), [](const Watch& w) {
      return !std::all_of(w.ops.begin(), w.ops.end(), is_done);
    });
    std::move(it, watches_.end(), std::back_inserter(ready));
    watches_.erase(it, watches_.end());
  }
  run(ready);
  if (ready.empty()) {
    try {
      sleep_until_event(Clock::now() + std::chrono::milliseconds(1));
    } catch (...) {
    }
  }
  return true;
}

}  // namespace tdshm::detail
