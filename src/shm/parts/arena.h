#pragma once
// The slot arena (segment_layout.h): each rank owns one region of `slots` fixed-size slots and is
// the only one that takes its free slots, so allocation is a scan of its own state words without
// any atomic read-modify-write; the rank a slot was handed to gives it back. Works on any memory
// (unit tests use a plain buffer).
//
// Life of a slot: the owner finds it free (acquire: the previous reader's copy is finished),
// marks it taken for `dst` (relaxed: the entry that names it is published with release after the
// chunk is written), writes the chunk, publishes the entry. The receiver checks that the slot
// names it (acquire), copies the chunk out, and frees it (release). When a peer is gone, its
// owner takes back every slot handed to it: a dead rank never holds a slot, so the allocator never
// waits on a dead peer.

#include "shm/layout/segment_layout.h"

#include <atomic>
#include <cstdint>
#include <optional>

namespace tdshm::shm {

/// The shared memory of one rank's region.
class RegionView {
 public:
  RegionView() = default;
  RegionView(uint8_t* base, uint32_t slots, uint64_t slot_table_bytes, uint64_t slot_stride) noexcept
      : base_(base), slots_(slots), table_bytes_(slot_table_bytes), stride_(slot_stride) {}

  std::atomic<uint32_t>& state(uint32_t slot) const noexcept { return reinterpret_cast<ArenaSlot*>(base_)[slot].state; }
  uint8_t* data(uint32_t slot) const noexcept { return base_ + table_bytes_ + uint64_t{slot} * stride_; }
  uint32_t slots() const noexcept { return slots_; }

 private:
  uint8_t* base_ = nullptr;
  uint32_t slots_ = 0;
  uint64_t table_bytes_ = 0;
  uint64_t stride_ = 0;
};

/// The owner's side: takes free slots of its own region.
class SlotAllocator {
 public:
  SlotAllocator() = default;
  explicit SlotAllocator(RegionView region) noexcept : region_(region) {}

  /// A free slot, now marked as handed to `dst`; nullopt when every slot is taken. Scans from
  /// where the last search ended, so slots are reused round-robin (their pages stay warm).
  std::optional<uint32_t> take(uint32_t dst) noexcept {
    const uint32_t n = region_.slots();
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t s = next_;
      next_ = next_ + 1 == n ? 0 : next_ + 1;
      auto& state = region_.state(s);
      if (state.load(std::memory_order_acquire) != kSlotFree) continue;  // pairs with the reader's release
      state.store(dst + 1, std::memory_order_relaxed);
      return s;
    }
    return std::nullopt;
  }
  /// Takes back every slot handed to `dst` (a rank that is gone; nothing of it reads them).
  /// Returns how many.
  uint32_t reclaim(uint32_t dst) noexcept {
    uint32_t n = 0;
    for (uint32_t s = 0; s < region_.slots(); ++s) {
      auto& state = region_.state(s);
      if (state.load(std::memory_order_acquire) == dst + 1) {
        state.store(kSlotFree, std::memory_order_relaxed);
        ++n;
      }
    }
    return n;
  }
  uint8_t* data(uint32_t slot) const noexcept { return region_.data(slot); }

 private:
  RegionView region_;
  uint32_t next_ = 0;
};

/// The receiver's side of a peer's region: the chunk of `slot` if the slot is handed to `me`
/// (else null: a corrupt entry); release() gives it back after the copy.
inline const uint8_t* claimed_chunk(const RegionView& region, uint32_t slot, uint32_t me) noexcept {
  if (slot >= region.slots()) return nullptr;
  if (region.state(slot).load(std::memory_order_acquire) != me + 1) return nullptr;
  return region.data(slot);
}
inline void release_slot(const RegionView& region, uint32_t slot) noexcept {
  region.state(slot).store(kSlotFree, std::memory_order_release);  // pairs with the owner's acquire in take()
}

}  // namespace tdshm::shm
