// Collective steps in ShmEngine: each rank's window in the segment, its step words in its
// RankSlot, and the waits between them (the protocol is described in collective.h).

#include "shm/engine_internal.h"

#include "shm/futex.h"

#include <sched.h>

namespace tdshm::detail {

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

using shm::kWindowParts;

uint64_t ShmEngine::part_bytes() const noexcept { return segment_->geometry().window_bytes / kWindowParts; }

uint8_t* ShmEngine::my_part(uint64_t step) const noexcept {
  return segment_->window_memory(static_cast<uint32_t>(rank_)) + (step % kWindowParts) * part_bytes();
}

const uint8_t* ShmEngine::part_of(int rank, uint64_t step) const noexcept {
  return segment_->window_memory(static_cast<uint32_t>(rank)) + (step % kWindowParts) * part_bytes();
}

void ShmEngine::fail_collectives(std::exception_ptr error) noexcept {
  if (!coll_error_) coll_error_ = std::move(error);
}

uint64_t ShmEngine::begin_step(uint64_t what, Clock::time_point deadline) {
  if (coll_error_) std::rethrow_exception(coll_error_);
  {
    std::lock_guard lk(mu_);
    if (shut_down_) std::rethrow_exception(shut_down_);
    if (check_poisoned()) std::rethrow_exception(poisoned_);
  }
  const uint64_t step = ++coll_step_;
  if (step > kWindowParts) {
    // Part step % kWindowParts was last used by step - kWindowParts: every peer must have read it.
    wait_collective(
        [&] {
          for (int p = 0; p < size_; ++p) {
            if (p == rank_) continue;
            if (segment_->rank_slot(static_cast<uint32_t>(p)).consumed.load(std::memory_order_acquire) + kWindowParts <
                step) {
              return false;
            }
          }
          return true;
        },
        deadline, step, "to finish reading its previous part");
  }
  coll_what_[step % kWindowParts] = what;
  segment_->rank_slot(static_cast<uint32_t>(rank_))
      .step_check[step % kWindowParts]
      .store(step_word(what, step), std::memory_order_relaxed);
  return step;
}

void ShmEngine::publish_step(uint64_t step) {
  // Releases this rank's part and its step word (pairs with the acquire in await_step).
  segment_->rank_slot(static_cast<uint32_t>(rank_)).published.store(step, std::memory_order_release);
  notify_peers();
}

void ShmEngine::await_step(uint64_t step, Clock::time_point deadline, int from) {
  const uint64_t want = step_word(coll_what_[step % kWindowParts], step);
  auto awaited = [&](int p) { return p != rank_ && (from < 0 || p == from); };
  wait_collective(
      [&] {
        for (int p = 0; p < size_; ++p) {
          if (!awaited(p)) continue;
          const shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(p));
          if (slot.published.load(std::memory_order_acquire) < step) return false;
        }
        return true;
      },
      deadline, step, "to publish its part");
  for (int p = 0; p < size_; ++p) {
    if (!awaited(p)) continue;
    const shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(p));
    // Read once; published >= step was loaded with acquire above, and the peer cannot reuse this
    // part before this rank ends the step.
    if (slot.step_check[step % kWindowParts].load(std::memory_order_relaxed) != want) {
      auto error = make_error<TransportError>(
          "shm collective: " + segment_->describe_rank(static_cast<uint32_t>(p)) + " of segment '" + name_ +
          "' is in another collective, or in the same one with other sizes, dtype, op or root (collective step " +
          std::to_string(step) + " of rank " + std::to_string(rank_) +
          "): every rank must call the same collectives in the same order with matching tensors");
      fail_collectives(error);
      std::rethrow_exception(error);
    }
  }
}

void ShmEngine::end_step(uint64_t step) {
  if (segment_->poisoned()) {
    std::lock_guard lk(mu_);
    check_poisoned();
    fail_collectives(poisoned_);
    std::rethrow_exception(poisoned_);
  }
  segment_->rank_slot(static_cast<uint32_t>(rank_)).consumed.store(step, std::memory_order_release);
  notify_peers();
}

void ShmEngine::notify_peers() {
  // One fence for all peers (see notify): the stores above before the sleepers are read.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(p));
    if (slot.sleepers.load(std::memory_order_relaxed) != 0) {
      slot.wake_seq.fetch_add(1, std::memory_order_seq_cst);
      shm::futex_wake_all(slot.wake_seq);
    }
  }
}

// Throws the error of a lost peer or a cut segment (collectives need every rank).
void ShmEngine::check_collective_peers() {
  std::lock_guard lk(mu_);
  std::exception_ptr error = shut_down_;
  if (!error && check_poisoned()) error = poisoned_;
  for (int p = 0; !error && p < size_; ++p) {
    if (p != rank_) error = peer_error_[static_cast<size_t>(p)];
  }
  if (error) {
    fail_collectives(error);
    std::rethrow_exception(error);
  }
}

// Spins while waits are short (the budget adapts as for transfers), checks liveness and the
// deadline at every clock read, then sleeps on this rank's futex word, which every peer bumps
// when it publishes or ends a step.
// A wait that slept is judged by how soon after falling asleep it was woken, not by its whole
// length, which includes the wake-up itself (30-60 us here): woken within 4 x `spin`, the peer was
// close behind and spinning would have served it, so the budget grows again. Judged by the whole length, a
// budget that once shrank (a long wait for a slow peer) stayed small, and every later step paid a
// sleep and a wake-up.
template <class Ready>
void ShmEngine::wait_collective(Ready ready, Clock::time_point deadline, uint64_t step, const char* what) {
  if (ready()) return;
  const Clock::time_point start = Clock::now();
  const Clock::time_point spin_end = start + std::chrono::nanoseconds(spin_budget_ns_.load(std::memory_order_relaxed));
  Clock::time_point first_sleep{};
  auto served = [&](Clock::time_point now) {
    if (first_sleep == Clock::time_point{}) {
      note_wait(now - start);
    } else {
      const auto slept = now - first_sleep;
      note_wait(slept <= 4 * options_.spin ? Clock::duration::zero() : slept);
    }
  };
  for (unsigned spins = 1;; ++spins) {
    if (ready()) {
      served(Clock::now());
      return;
    }
    if (!SpinChecks::clock_read(spins)) {  // spins, then yields now and then (SpinChecks)
      cpu_relax();
      continue;
    }
    const Clock::time_point now = Clock::now();
    maybe_check_peers(now);
    // Ready first: a peer that published its part and then left (its last collective done) is
    // gone, but what this rank waits for is there.
    if (ready()) {
      served(now);
      return;
    }
    check_collective_peers();
    if (now >= deadline) {
      auto error = make_error<TimeoutError>("segment '" + name_ + "', rank " + std::to_string(rank_) +
                                            ": timed out in a collective (step " + std::to_string(step) +
                                            ") waiting for a peer " + what);
      fail_collectives(error);
      std::rethrow_exception(error);
    }
    if (now < spin_end && options_.spin.count() > 0) {
      sched_yield();
      continue;
    }
    if (first_sleep == Clock::time_point{}) first_sleep = now;
    shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(rank_));
    slot.sleepers.fetch_add(1, std::memory_order_seq_cst);  // announce, then re-check (see notify)
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const uint32_t seen = slot.wake_seq.load(std::memory_order_seq_cst);
    if (!ready()) {
      const auto next_check = from_ticks(next_peer_check_.load(std::memory_order_relaxed));
      const auto until = std::min({deadline, std::max(next_check, now), now + std::chrono::milliseconds(100)});
      shm::futex_wait(slot.wake_seq, seen, until - Clock::now());
    }
    slot.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace tdshm::detail
