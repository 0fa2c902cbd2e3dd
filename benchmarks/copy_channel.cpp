// The scenarios' hand-written references (copy_channel.h): the memcpy channel and the in-place one.

#include "copy_channel.h"

#include "shm/parts/spin.h"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace tdshm::bench {

namespace {

using Clock = std::chrono::steady_clock;

// Waits until `ready()`, spinning as tdshm's waits do (shm/parts/spin.h), so that the reference is
// neither helped nor hurt by another policy; it never sleeps.
template <class Ready>
void spin_until(Ready ready, Clock::time_point deadline, const char* what) {
  for (unsigned checks = 1; !ready(); ++checks) {
    if (!tdshm::detail::SpinChecks::clock_read(checks)) {
      tdshm::detail::cpu_relax();
      continue;
    }
    if (Clock::now() > deadline) throw std::runtime_error(std::string("reference channel: timed out waiting ") + what);
    sched_yield();
  }
}

}  // namespace

size_t CopyChannel::bytes_needed(size_t slot_bytes, uint32_t slots) noexcept {
  return 2 * sizeof(Counter) + slot_bytes * slots;
}

CopyChannel::CopyChannel(void* memory, size_t slot_bytes, uint32_t slots) noexcept
    : produced_(static_cast<Counter*>(memory)),
      consumed_(static_cast<Counter*>(memory) + 1),
      slots_(static_cast<uint8_t*>(memory) + 2 * sizeof(Counter)),
      slot_bytes_(slot_bytes),
      slots_count_(slots) {}

void CopyChannel::send(const void* data, size_t bytes, Clock::time_point deadline) {
  const auto* from = static_cast<const uint8_t*>(data);
  uint64_t next = produced_->value.load(std::memory_order_relaxed);
  for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += slot_bytes_) {
    // A free slot: the receiver has consumed the chunk that used it last (acquire: its copy
    // out is over before this copy in starts).
    spin_until([&] { return next - consumed_->value.load(std::memory_order_acquire) < slots_count_; }, deadline,
               "for a free slot");
    const size_t chunk = std::min(slot_bytes_, bytes - off);
    if (chunk != 0) std::memcpy(slots_ + (next % slots_count_) * slot_bytes_, from + off, chunk);
    produced_->value.store(++next, std::memory_order_release);
    if (bytes == 0) break;
  }
}

void CopyChannel::recv(void* data, size_t bytes, Clock::time_point deadline) {
  auto* to = static_cast<uint8_t*>(data);
  uint64_t next = consumed_->value.load(std::memory_order_relaxed);
  for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += slot_bytes_) {
    spin_until([&] { return produced_->value.load(std::memory_order_acquire) > next; }, deadline, "for a chunk");
    const size_t chunk = std::min(slot_bytes_, bytes - off);
    if (chunk != 0) std::memcpy(to + off, slots_ + (next % slots_count_) * slot_bytes_, chunk);
    consumed_->value.store(++next, std::memory_order_release);
    if (bytes == 0) break;
  }
}

size_t InplaceChannel::bytes_needed(size_t payload_bytes) noexcept { return sizeof(Flag) + (payload_bytes + 63) / 64 * 64; }

InplaceChannel::InplaceChannel(void* memory, size_t) noexcept
    : flag_(static_cast<Flag*>(memory)), payload_(static_cast<uint8_t*>(memory) + sizeof(Flag)) {}

void InplaceChannel::wait_empty(Clock::time_point deadline) {
  spin_until([&] { return flag_->full.load(std::memory_order_acquire) == 0; }, deadline, "for an empty buffer");
}

void InplaceChannel::publish() noexcept { flag_->full.store(1, std::memory_order_release); }

void InplaceChannel::wait_full(Clock::time_point deadline) {
  spin_until([&] { return flag_->full.load(std::memory_order_acquire) != 0; }, deadline, "for a full buffer");
}

void InplaceChannel::consume() noexcept { flag_->full.store(0, std::memory_order_release); }

}  // namespace tdshm::bench
