#pragma once
// How tdshm spins while it waits for another process: one pause per check, and the SpinChecks
// policy of when a check also reads the clock and offers the core to others. Shared by every
// wait of the transport (waiter.h's loop) and by the benchmarks' references
// (benchmarks/copy_channel.cpp, pingpong_link.cpp), so that a reference spins as tdshm does.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tdshm::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Checks are cheap (one pause between them, ~30 ns here). The first kQuietChecks only pause: a
// reply in a ping-pong arrives within them (~1 us) and never pays a clock read or a system call.
// After them, every kYieldEvery-th check reads the clock and offers the core to others
// (sched_yield, which returns at once when nobody else wants it): with more ranks than cores (a
// data loader's workers), the rank a waiter waits for often runs on the waiter's own core, and
// spinning without yielding left it queued for the whole spin (4 workers: 48k batches/s when
// waiters yielded every ~30 us, 80-88k when every ~250 ns after the first ~1 us, in the same
// run; ping-pong unchanged). Whether a clock read also yields is SpinBudget's call (waiter.h): not
// while yields keep returning at once, each a system call the waiter spends blind.
struct SpinChecks {
  static constexpr unsigned kQuietChecks = 32, kYieldEvery = 8;
  static_assert((kQuietChecks & (kQuietChecks - 1)) == 0 && (kYieldEvery & (kYieldEvery - 1)) == 0,
                "powers of two: a check is a mask, not a division");
  /// True when check number `spins` (from 1) reads the clock (and, spinning, yields).
  static constexpr bool clock_read(unsigned spins) noexcept {
    return spins <= kQuietChecks ? spins % kQuietChecks == 0 : spins % kYieldEvery == 0;
  }
};

}  // namespace tdshm::detail
