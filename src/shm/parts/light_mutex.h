#pragma once
// A mutex of one futex word (within a process: FUTEX_PRIVATE_FLAG) for locks held a few hundred
// nanoseconds on every message (the engine's channel lock). Uncontended, lock is one
// compare-exchange and unlock one exchange, inline: ~10 instructions against glibc's
// pthread_mutex_lock/unlock (~55 per pair, called through the PLT), which an 8-byte ping-pong
// pays two to three times per message and side. A contended lock spins briefly (the holder is
// almost done), then sleeps on the word, so a waiter never burns a core that a descheduled holder
// needs. The three states (0 free, 1 held, 2 held with sleepers) follow the classic futex mutex:
// unlock calls FUTEX_WAKE only when someone may sleep. Meets Lockable (std::lock_guard,
// std::unique_lock). Not recursive; no priority inheritance.

#include "shm/parts/spin.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace tdshm::detail {

class LightMutex {
 public:
  LightMutex() = default;
  LightMutex(const LightMutex&) = delete;
  LightMutex& operator=(const LightMutex&) = delete;

  void lock() noexcept {
    uint32_t free = 0;
    if (state_.compare_exchange_strong(free, 1, std::memory_order_acquire, std::memory_order_relaxed)) return;
    lock_contended();
  }
  bool try_lock() noexcept {
    uint32_t free = 0;
    return state_.compare_exchange_strong(free, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void unlock() noexcept {
    if (state_.exchange(0, std::memory_order_release) == 2) {
      ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAKE | FUTEX_PRIVATE_FLAG, 1, nullptr, nullptr,
                0);
    }
  }

 private:
  // Out of line of the fast path (noinline keeps lock() small enough to inline everywhere).
  [[gnu::noinline]] void lock_contended() noexcept {
    // A holder keeps the lock for well under a microsecond: ~100 pauses usually outlast it.
    for (int i = 0; i < 100; ++i) {
      cpu_relax();
      uint32_t free = 0;
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.compare_exchange_weak(free, 1, std::memory_order_acquire, std::memory_order_relaxed)) {
        return;
      }
    }
    // Mark the lock contended (2) and sleep while it stays so; whoever takes it here leaves 2
    // behind, so its unlock wakes the next sleeper (a spurious wake-up at worst).
    while (state_.exchange(2, std::memory_order_acquire) != 0) {
      ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAIT | FUTEX_PRIVATE_FLAG, 2, nullptr, nullptr,
                0);
    }
  }

  std::atomic<uint32_t> state_{0};
};

}  // namespace tdshm::detail
