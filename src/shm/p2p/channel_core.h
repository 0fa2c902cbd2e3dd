#pragma once
// What the three parts of one rank's point-to-point channel share (channel.h): the segment and
// this rank's place in it, set once; the failure state (peers lost, the group closed, the mapping
// cut); and how an op completes. The channel owns it; its sender (sender.h), its receiver
// (receiver.h) and its by-reference part (by_reference.h) each hold a reference to it.

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "shm/layout/validate.h"
#include "shm/p2p/op.h"
#include "shm/parts/arena.h"
#include "shm/segment/segment.h"

#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace tdshm::detail {

class ChannelCore {
 public:
  /// Over `segment`'s arena regions, as `rank` of `size`. The segment outlives it.
  ChannelCore(shm::Segment& segment, int rank, int size, const ShmOptions& options);
  ChannelCore(const ChannelCore&) = delete;
  ChannelCore& operator=(const ChannelCore&) = delete;

  shm::Segment& segment() const noexcept { return segment_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const ShmOptions& options() const noexcept { return options_; }
  /// `r`'s arena region (this rank's own, or a sender's whose slots this rank reads).
  const shm::RegionView& region(int r) const noexcept { return regions_[static_cast<size_t>(r)]; }
  /// What an entry is checked against (validate.h).
  shm::ArenaShape arena() const noexcept {
    return {options_.slot_bytes, options_.slots_per_rank, options_.ring_entries};
  }
  const std::string& name() const noexcept { return segment_.params().name; }

  /// Whether posts to or from `peer` fail at once: the group closed, its mapping lost, `peer` lost.
  bool refused(int peer) const noexcept { return closed_ || poisoned_ || peer_error_[static_cast<size_t>(peer)]; }
  /// The error they fail with (refused(peer) is true).
  const std::exception_ptr& refusal(int peer) const noexcept {
    return closed_ ? closed_ : poisoned_ ? poisoned_ : peer_error_[static_cast<size_t>(peer)];
  }
  const std::exception_ptr& closed() const noexcept { return closed_; }
  const std::exception_ptr& poisoned() const noexcept { return poisoned_; }
  const std::exception_ptr& peer_error(int peer) const noexcept { return peer_error_[static_cast<size_t>(peer)]; }
  /// Whether any peer but this rank is not lost.
  bool someone_alive() const noexcept;
  /// Sets `peer`'s error (the first one stays) and returns it.
  const std::exception_ptr& lose_peer(int peer, const std::exception_ptr& error);
  /// Every peer not lost yet is lost with `error`.
  void lose_all(const std::exception_ptr& error);
  /// Closes the group (false when it was closed already).
  bool close(const std::exception_ptr& error);
  /// Whether the segment's mapping is lost (a peer cut the file). The first time, the error every
  /// transfer fails with from now on is made and logged; the channel fails what is pending.
  bool check_poisoned() {
    if (poisoned_) return true;
    return segment_.poisoned() && record_poison();  // inline: every poll asks
  }

  /// Completes `op` (once) with `error`, or with the lost mapping's error when the bytes went
  /// through a mapping the file no longer backs; a strided receive gets its staged bytes.
  void finish(ShmOp& op, std::exception_ptr error);
  /// finish(op, nullptr), inline where nothing more is needed: a receive that landed in its own
  /// contiguous tensor, not failed before, the mapping intact.
  void complete(ShmOp& op) {
    if (op.staging.defined() || op.error || op.done.load(std::memory_order_relaxed) || segment_.poisoned()) {
      finish(op, nullptr);
      return;
    }
    op.done.store(true, std::memory_order_release);  // pairs with acquire loads of done in waiters
  }
  /// Wakes rank `r` (waiter.h: no system call while it spins).
  void wake_peer(int r) noexcept;
  /// The error of a malformed entry (or record) from `src`: "corrupted entry from <rank>: what".
  TransportError corrupted(int src, const std::string& what) const;

 private:
  bool record_poison();

  shm::Segment& segment_;
  int rank_;
  int size_;
  ShmOptions options_;
  std::vector<shm::RegionView> regions_;        // per rank: its arena region
  std::vector<std::exception_ptr> peer_error_;  // per peer: set once it is lost
  std::exception_ptr closed_;                   // set by close(): the error of later posts
  std::exception_ptr poisoned_;                 // set once the segment's mapping was lost (bus_guard.h)
};

}  // namespace tdshm::detail
