#pragma once
// Futex wait/wake on a 32-bit word in shared memory (never FUTEX_PRIVATE_FLAG: the word is
// shared between processes).

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>

namespace tdshm::shm {

/// Sleeps while *word == expected, at most `timeout`. Returns on wake-up, value change, timeout
/// or signal; callers re-check their condition.
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  if (timeout.count() <= 0) return;
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

/// Wakes every thread sleeping on `word`, in any process.
inline void futex_wake_all(std::atomic<uint32_t>& word) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace tdshm::shm
