#pragma once
// Loans: tensors whose bytes live in this rank's loan heap (segment_layout.h, "loan region"), so
// that a send of them posts a reference (kEntryLoan) and no byte is copied by the transport.
//
// The owner's side is a LoanPool, in process memory, shared by the channel (which sends loans and
// sees their tickets come back) and by every loan tensor it handed out (whose deleter gives the
// bytes back from whatever thread drops the last reference). An allocation's bytes are reused only
// when its tensor is gone *and* no ticket naming it is out: a receiver that holds a view keeps
// them, and a new loan then waits for room (back-pressure), never overwrites.
//
// Tickets are the arena's slot protocol again (arena.h): the owner alone takes a free ticket and
// marks it handed to the receiver (relaxed: the entry naming it is published with release); the
// receiver frees it (release) once it no longer reads the bytes, and the owner's acquire load of a
// free ticket orders that reading before any later write into the bytes. The owner takes back the
// tickets of a rank that is gone.
//
// The pool keeps the segment's mapping alive (Mapping): a loan or a view may outlive its group.

#include "shm/layout/segment_layout.h"
#include "shm/segment/segment.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::shm {

/// The tickets and heap of one rank's loan region, in a mapping.
struct LoanRegionView {
  LoanTicket* tickets = nullptr;
  uint32_t ticket_count = 0;
  uint8_t* heap = nullptr;
  uint64_t heap_bytes = 0;
  static LoanRegionView of(const Segment& segment, uint32_t owner) noexcept {
    const auto& g = segment.geometry();
    uint8_t* base = segment.loan_memory(owner);
    return {reinterpret_cast<LoanTicket*>(base), segment.params().loan_tickets, base + g.loan_table_bytes,
            g.loan_bytes};
  }
};

class LoanPool : public std::enable_shared_from_this<LoanPool> {
 public:
  /// Over `owner`'s loan region of `segment`, whose mapping it keeps.
  LoanPool(const Segment& segment, uint32_t owner);
  LoanPool(const LoanPool&) = delete;
  LoanPool& operator=(const LoanPool&) = delete;

  uint64_t heap_bytes() const noexcept { return region_.heap_bytes; }
  /// Whether this pool ever handed out a loan (inline: before it has, no tensor can be one, and a
  /// send need not look at its tensor's address).
  bool ever_lent() const noexcept { return ever_lent_.load(std::memory_order_relaxed); }
  /// Whether `data` points into the heap (inline: every send asks).
  bool in_heap(const void* data) const noexcept {
    const auto* p = static_cast<const uint8_t*>(data);
    return p >= region_.heap && p < region_.heap + region_.heap_bytes;
  }
  /// A tensor of `sizes` and `dtype` (contiguous, CPU) in the heap, or an undefined tensor when
  /// there is no room now. Any thread.
  at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype);

  /// Where a contiguous span of `bytes` at `data` lies in the heap: its offset and the offset of
  /// the allocation it is part of; nullopt when it is not wholly inside one live allocation. Any
  /// thread.
  struct Place {
    uint64_t offset;      // of `data` in the heap
    uint64_t allocation;  // offset of its allocation
  };
  std::optional<Place> find(const void* data, uint64_t bytes) const;

  /// A free ticket, now handed to `dst` for a send out of `allocation`; nullopt when every ticket
  /// is out. The channel's thread (under the engine's lock).
  std::optional<uint32_t> take_ticket(uint32_t dst, uint64_t allocation);
  /// Whether ticket `t` came back (acquire: the receiver's reads of the bytes happened before).
  bool ticket_free(uint32_t t) const noexcept {
    return region_.tickets[t].state.load(std::memory_order_acquire) == kSlotFree;
  }
  /// Ticket `t`, seen free, is forgotten: its allocation is freed if its tensor is gone too.
  void ticket_returned(uint32_t t);
  /// Takes back every ticket handed to `dst` (a rank that is gone). Returns how many.
  uint32_t reclaim(uint32_t dst);
  /// "rank 1 holds 2 loans (786432 bytes)" for each rank holding tickets, "; "-separated; "" if none.
  std::string holders() const;

 private:
  struct Allocation {
    uint64_t bytes = 0;
    uint32_t tickets_out = 0;
    bool tensor_alive = true;
  };
  void drop(uint64_t allocation);  // the loan tensor's deleter
  void free_locked(uint64_t allocation);

  std::shared_ptr<const Mapping> mapping_;
  LoanRegionView region_;
  uint32_t owner_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;           // offset -> bytes, coalesced
  std::map<uint64_t, Allocation> allocations_;  // offset -> allocation
  std::vector<uint64_t> ticket_allocation_;     // per ticket: its allocation while out
  std::vector<uint8_t> out_;                    // per ticket: 1 from take_ticket to ticket_returned
  uint32_t next_ticket_ = 0;
  // Set by the first allocate (any thread; relaxed: a tensor reaches another thread's send with a
  // synchronisation of its own, which makes the store visible).
  std::atomic<bool> ever_lent_{false};
};

/// The receiver's side of `owner`'s region: the bytes a LoanReference names if its ticket is
/// handed to `me` and [offset, offset + bytes) lies in the heap; null otherwise (a corrupt entry).
const uint8_t* lent_bytes(const LoanRegionView& region, const LoanReference& ref, uint64_t bytes, uint32_t me) noexcept;
/// After reading lent bytes: whether ticket `t` still names `me` (the reads are ordered before
/// this check, as a seqlock's reader orders them); false when the owner took it back meanwhile.
bool still_lent(const LoanRegionView& region, uint32_t t, uint32_t me) noexcept;
/// Gives ticket `t` of `region` back (release) and wakes its owner (`owner_slot`).
void give_back(const LoanRegionView& region, uint32_t t, RankSlot& owner_slot) noexcept;
/// Gives the bytes of a view (view_of_loan) back to their sender now, before the view is dropped;
/// false (doing nothing) for a tensor that is not such a view, or one given back already.
bool release_view(const at::Tensor& view) noexcept;
/// A tensor of `sizes` and `dtype` over `data` (lent bytes) that gives ticket `t` back when its
/// last reference goes (or at release_view); it keeps `mapping` alive.
at::Tensor view_of_loan(std::shared_ptr<const Mapping> mapping, const LoanRegionView& region, uint32_t t,
                        RankSlot& owner_slot, const uint8_t* data, c10::IntArrayRef sizes, c10::ScalarType dtype);

}  // namespace tdshm::shm
