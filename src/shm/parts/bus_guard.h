#pragma once
// Survives a segment file that shrinks under its mappings.
//
// Another process of the same user can truncate /dev/shm/tdshm.<name> while ranks have it mapped
// (a bug, or a careless `truncate`); touching a page past the new end of file raises SIGBUS,
// which kills the process by default. File seals (F_SEAL_SHRINK) would forbid it, but Linux only
// allows them on memfd files, not on files opened by name. So tdshm installs, once, a SIGBUS
// handler that recognises faults inside a registered segment mapping: it replaces the whole
// mapping with private zero pages (mmap MAP_FIXED, a plain system call) and marks it poisoned, and
// the faulting access resumes on zeros. The engine checks poisoned() before it completes any
// transfer and fails the group's transfers with a TransportError instead. Every other SIGBUS
// goes to the handler that was installed before (or the default action, which ends the process).

#include <atomic>
#include <cstddef>

namespace tdshm::shm {

class BusGuard {
 public:
  /// Registers [base, base + bytes) (a segment mapping). Installs the handler on first use.
  /// Returns a registration to pass to the other calls, or -1 when the registry is full (then
  /// the mapping is simply unguarded).
  static int add(void* base, size_t bytes) noexcept;
  /// Forgets a registration; call before unmapping.
  static void remove(int id) noexcept;
  /// Whether a fault was caught in the mapping of `id` (its contents are gone).
  static bool poisoned(int id) noexcept;
  /// The flag that poisoned(id) reads, for a caller that checks it on every poll (null for -1).
  static const std::atomic<bool>* flag(int id) noexcept;
};

}  // namespace tdshm::shm
