#pragma once
/// \file
/// The scenarios' hand-written references (scenarios.h): CopyChannel and InplaceChannel.
///
/// The memcpy reference (transport "memcpy"): a one-way channel between
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

/// The one-copy reference (transport "inplace"): what a user writes by hand over shared memory,
/// a spin flag over a buffer (pytorch/rl#3854's proposal). The producer waits until the buffer is
/// empty, writes its batch into it in place (producing it there: its only write of each byte),
/// and sets the flag; the consumer waits for the flag, reads the batch in place and clears the
/// flag. One buffer: the producer cannot write its next batch while the consumer reads this one.
/// Waits spin as CopyChannel's (and tdshm's) do; every wait has a deadline (std::runtime_error).
class InplaceChannel {
 public:
  /// Bytes of shared memory one channel with a buffer of `payload_bytes` needs.
  static size_t bytes_needed(size_t payload_bytes) noexcept;
  /// A view of a channel in `memory` (bytes_needed of it, zero when first used, 64-byte aligned).
  InplaceChannel(void* memory, size_t payload_bytes) noexcept;

  /// The buffer (64-byte aligned).
  uint8_t* payload() const noexcept { return payload_; }
  /// Producer: waits until the consumer emptied the buffer (acquire: its reads are over).
  void wait_empty(std::chrono::steady_clock::time_point deadline);
  /// Producer: the buffer holds a batch (release).
  void publish() noexcept;
  /// Consumer: waits until the buffer holds a batch (acquire).
  void wait_full(std::chrono::steady_clock::time_point deadline);
  /// Consumer: done reading (release).
  void consume() noexcept;

 private:
  struct alignas(64) Flag {
    std::atomic<uint32_t> full;
  };
  Flag* flag_;
  uint8_t* payload_;
};

}  // namespace tdshm::bench
