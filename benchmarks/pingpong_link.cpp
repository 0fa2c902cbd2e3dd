// The Link between the two ranks of the ping-pong benchmark (pingpong_link.h): synchronisation
// points and errors through the shared control block, the checks for a peer that died or gave
// up, and the waits on a sequence word (spinning or in FUTEX_WAIT) with their posts.

#include "pingpong_link.h"

#include "shm/parts/spin.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tdshm::bench::detail {

namespace {

using Clock = std::chrono::steady_clock;

using tdshm::detail::cpu_relax;  // shm/parts/spin.h

// Non-private futex operations: the word lives in a MAP_SHARED mapping of two processes.
long futex_wait(uint32_t* word, uint32_t seen, std::chrono::nanoseconds timeout) noexcept {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
  return ::syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(uint32_t* word) noexcept { ::syscall(SYS_futex, word, FUTEX_WAKE, 1, nullptr, nullptr, 0); }

uint32_t load_acquire(uint32_t& word) noexcept {
  // Pairs with the release store in post_word / Link::sync / Link::abort of the other rank.
  return std::atomic_ref<uint32_t>(word).load(std::memory_order_acquire);
}

}  // namespace

// ---- Link ----

Link::Link(ControlBlock* block, int rank, pid_t peer, bool peer_on_own_cpu, const std::atomic<int>* peer_exit_status)
    : block_(block), rank_(rank), peer_(peer), peer_on_own_cpu_(peer_on_own_cpu), peer_exit_status_(peer_exit_status) {}

void Link::publish_cpu() noexcept {
  const int cpu = ::sched_getcpu();  // a vDSO call: ~2 ns here
  const auto value = static_cast<uint32_t>(cpu + 1);
  if (cpu < 0 || value == published_cpu_) return;
  published_cpu_ = value;
  std::atomic_ref<uint32_t>(block_->cpu[rank_].value).store(value, std::memory_order_relaxed);
}

bool Link::on_peer_cpu() const noexcept {
  const uint32_t peer = std::atomic_ref<uint32_t>(block_->cpu[1 - rank_].value).load(std::memory_order_relaxed);
  return peer != 0 && static_cast<uint32_t>(::sched_getcpu() + 1) == peer;
}

void Link::check_peer() {
  if (load_acquire(block_->aborted.value) != 0) {
    const std::string why = peer_error();
    throw PeerFailed("rank " + std::to_string(1 - rank_) + " gave up" + (why.empty() ? "" : ": " + why));
  }
  if (rank_ == 0) {
    const int status = peer_exit_status_ != nullptr ? peer_exit_status_->load(std::memory_order_acquire) : -1;
    if (status >= 0) {
      throw PeerFailed("rank 1 died (" +
                       (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                            : "exit code " + std::to_string(WEXITSTATUS(status))) +
                       ")");
    }
  } else if (::getppid() != peer_) {
    throw PeerFailed("rank 0 died");
  }
}

bool Link::sync(bool ok, std::chrono::milliseconds deadline) {
  ++generation_;
  // Two slots per rank, used by turns: the peer can be at most one sync ahead (it waits for this
  // rank at the next one), so it never overwrites the slot this rank is about to read.
  const unsigned slot = generation_ & 1u;
  const uint32_t mine = (generation_ << 1) | (ok ? 1u : 0u);
  // Release: what this rank wrote before (port, error message) is visible to the peer's
  // acquire load of this slot.
  std::atomic_ref<uint32_t>(block_->arrived[rank_][slot].value).store(mine, std::memory_order_release);
  futex_wake(&block_->arrived[rank_][slot].value);
  uint32_t* theirs = &block_->arrived[1 - rank_][slot].value;
  const auto end = Clock::now() + deadline;
  for (;;) {
    const uint32_t seen = load_acquire(*theirs);
    if ((seen >> 1) == generation_) return ok && (seen & 1u) != 0;
    check_peer();
    if (Clock::now() > end) throw PeerFailed("timed out waiting for the other rank at a synchronisation point");
    futex_wait(theirs, seen, std::chrono::milliseconds(20));
  }
}

void Link::set_error(const std::string& why) noexcept {
  char* dst = block_->error[rank_];
  const size_t n = std::min(why.size(), sizeof(block_->error[0]) - 1);
  std::memcpy(dst, why.data(), n);
  dst[n] = '\0';
}

void Link::abort(const std::string& why) noexcept {
  set_error(why);
  // Release: the message above is visible to a peer that sees aborted != 0.
  std::atomic_ref<uint32_t>(block_->aborted.value).store(1, std::memory_order_release);
  // Wake the peer wherever it sleeps, so it notices now rather than at its next timeout.
  for (SharedWord* w : {&block_->arrived[rank_][0], &block_->arrived[rank_][1], &block_->futex_seq[0],
                        &block_->futex_seq[1]}) {
    ::syscall(SYS_futex, &w->value, FUTEX_WAKE, 2, nullptr, nullptr, 0);
  }
}

std::string Link::peer_error() const {
  const char* src = block_->error[1 - rank_];
  return std::string(src, ::strnlen(src, sizeof(block_->error[0])));
}

// ---- waiting on a word ----

void wait_for_word(uint32_t& word, uint32_t expected, WaitMode mode, Link& link, std::chrono::milliseconds deadline) {
  if (mode == WaitMode::spin) {
    // Check the peer and the clock every 2^14 spins only: on the hot path a spin is one load.
    const bool yield = !link.peer_on_own_cpu();
    Clock::time_point end{};
    for (uint64_t spins = 1;; ++spins) {
      if (load_acquire(word) == expected) return;
      cpu_relax();
      if (yield && (spins & 63) == 0) ::sched_yield();
      if ((spins & ((1u << 14) - 1)) == 0) {
        if (spins == (1u << 14)) end = Clock::now() + deadline;
        link.check_peer();
        if (Clock::now() > end) throw PeerFailed("timed out in the spin floor");
      }
    }
  }
  const auto end = Clock::now() + deadline;
  for (;;) {
    const uint32_t seen = load_acquire(word);
    if (seen == expected) return;
    if (futex_wait(&word, seen, std::chrono::milliseconds(50)) == -1 && errno == ETIMEDOUT) {
      link.check_peer();
      if (Clock::now() > end) throw PeerFailed("timed out in the futex floor");
    }
  }
}

void post_word(uint32_t& word, uint32_t value, WaitMode mode) {
  // Release: the payload copied before this store is visible to the acquire load in the peer's
  // wait_for_word that sees `value`.
  std::atomic_ref<uint32_t>(word).store(value, std::memory_order_release);
  if (mode == WaitMode::futex) futex_wake(&word);
}

}  // namespace tdshm::bench::detail
