#pragma once
/// \file
/// The scenarios' memcpy reference (scenarios.h, transport "memcpy"): a one-way channel between
/// two forked processes made of nothing but memcpy through memory they share and two counters.
/// It moves the same bytes as a transport must (the sender copies into shared memory, the
/// receiver copies out), with none of a transport's work: no tags, no matching, no checks, no
/// futures, no system call but sched_yield. What a scenario reaches over it is what two copies
/// per byte cost on this machine with these processes, the reference a transport is measured
/// against when its ratio to gloo cannot reach a goal.
///
/// Geometry: `slots` slots of `slot_bytes` (the bench uses ProcessGroupShm's default arena, 64
/// slots of 64 KiB per sender); a message larger than a slot streams through the slots, so the
/// receiver copies out while the sender copies in, as in tdshm. Waits spin as tdshm's do (pauses,
/// then sched_yield every few checks, so a peer that shares the core runs) and never sleep;
/// every wait has a deadline (std::runtime_error).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace tdshm::bench {

class CopyChannel {
 public:
  /// Bytes of shared memory one channel needs.
  static size_t bytes_needed(size_t slot_bytes, uint32_t slots) noexcept;

  /// A view of a channel in `memory` (bytes_needed of it, zero when first used, 64-byte aligned).
  CopyChannel(void* memory, size_t slot_bytes, uint32_t slots) noexcept;

  /// Copies `bytes` from `data` into the channel, waiting for free slots until `deadline`.
  void send(const void* data, size_t bytes, std::chrono::steady_clock::time_point deadline);
  /// Copies the next `bytes` out of the channel into `data`, waiting until `deadline`.
  void recv(void* data, size_t bytes, std::chrono::steady_clock::time_point deadline);

 private:
  struct alignas(64) Counter {
    std::atomic<uint64_t> value;
  };
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "the counters live in memory two processes share");

  Counter* produced_;  // chunks written (the sender's only)
  Counter* consumed_;  // chunks read (the receiver's only)
  uint8_t* slots_;
  size_t slot_bytes_;
  uint32_t slots_count_;
};

}  // namespace tdshm::bench
