#pragma once
// A process's attachment to a named segment: creation or attach under a lock file, validation of
// everything read from the header, the rank claim, liveness of peers, and clean leave.

#include "shm/segment_layout.h"

#include <boost/interprocess/mapped_region.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tdshm::shm {

/// Identity of a live process: pid plus its start time, so a reused pid is not mistaken for it.
struct ProcessId {
  uint32_t pid = 0;
  uint64_t start_time = 0;
};

/// This process's identity.
ProcessId self_process();
/// Whether the process `id` still runs (false once it exited or its pid was reused).
bool process_alive(const ProcessId& id);

/// Parameters every rank of a segment must agree on.
struct SegmentParams {
  std::string name;  // validated: [A-Za-z0-9._-]{1,200}
  uint32_t world_size = 0;
  uint64_t slot_bytes = 0;
  uint32_t ring_entries = 0;
};

class Segment {
 public:
  /// Attaches `rank`, creating or replacing (stale) the segment as needed; returns once this
  /// rank is live in it (not waiting for the others). Throws SegmentError.
  static std::unique_ptr<Segment> attach(const SegmentParams& params, uint32_t rank,
                                         std::chrono::steady_clock::time_point deadline);
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  /// Leaves (see leave()) and unmaps.
  ~Segment();

  /// Marks this rank as left; the last live rank removes the segment and its lock file.
  void leave() noexcept;

  const SegmentParams& params() const noexcept { return params_; }
  uint32_t rank() const noexcept { return rank_; }
  const SegmentGeometry& geometry() const noexcept { return geometry_; }

  SegmentHeader& header() const noexcept { return *reinterpret_cast<SegmentHeader*>(base_); }
  RankSlot& rank_slot(uint32_t r) const noexcept {
    return *reinterpret_cast<RankSlot*>(base_ + geometry_.rank_table_offset + uint64_t{r} * sizeof(RankSlot));
  }
  RingControl& ring(uint32_t src, uint32_t dst) const noexcept {
    return *reinterpret_cast<RingControl*>(ring_base(src, dst));
  }
  EntryHeader& entry(uint32_t src, uint32_t dst, uint64_t position) const noexcept {
    return *reinterpret_cast<EntryHeader*>(entry_base(src, dst, position));
  }
  uint8_t* payload(uint32_t src, uint32_t dst, uint64_t position) const noexcept {
    return entry_base(src, dst, position) + sizeof(EntryHeader);
  }
  EntryShape& shape(uint32_t src, uint32_t dst, uint64_t position) const noexcept {
    return *reinterpret_cast<EntryShape*>(entry_base(src, dst, position) + geometry_.shape_offset);
  }

  /// Whether rank `r` is attached and its process alive (left or dead ranks are not).
  bool rank_alive(uint32_t r) const;
  /// Whether every rank is live (the rendezvous is complete).
  bool all_live() const;
  /// Whether every rank has arrived: it is live, or it has left since this rank went live (a fast
  /// peer may complete its own rendezvous, send and leave before this rank looks). A rank that had
  /// already left before that belongs to an earlier member and has not arrived.
  bool all_arrived() const;
  /// "rank 1 (pid 1234)" for messages.
  std::string describe_rank(uint32_t r) const;
  /// Empties both rings between this rank and `peer` (a dead peer's entries are reclaimed).
  void reset_rings_with(uint32_t peer) noexcept;

 private:
  Segment(SegmentParams params, uint32_t rank);
  uint8_t* ring_base(uint32_t src, uint32_t dst) const noexcept {
    return base_ + geometry_.rings_offset + (uint64_t{src} * params_.world_size + dst) * geometry_.ring_bytes;
  }
  uint8_t* entry_base(uint32_t src, uint32_t dst, uint64_t position) const noexcept {
    return ring_base(src, dst) + sizeof(RingControl) + (position % params_.ring_entries) * geometry_.entry_bytes;
  }

  SegmentParams params_;
  uint32_t rank_;
  SegmentGeometry geometry_{};
  boost::interprocess::mapped_region region_;
  uint8_t* base_ = nullptr;
  bool left_ = false;
  std::vector<uint32_t> state_before_live_;  // every rank's state just before this one went live
};

/// Removes the segment `name` if no live process is attached. See process_group.h.
bool remove_segment_if_stale(const std::string& name);

}  // namespace tdshm::shm
