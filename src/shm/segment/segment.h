#pragma once
// A process's attachment to a named segment: the mapped file of one incarnation, its rank claim,
// the liveness of its peers, and clean leave. Segment::attach (creation or attach under the lock
// file, and the recovery model) is in attach.cpp; the trust model is in trust.h.

#include "shm/layout/segment_layout.h"
#include "shm/parts/process_identity.h"

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::shm {

class LockFile;

/// Parameters every rank of a segment must agree on.
struct SegmentParams {
  std::string name;  // validated: [A-Za-z0-9._-]{1,200}
  uint32_t world_size = 0;
  uint64_t slot_bytes = 0;
  uint32_t ring_entries = 0;
  uint32_t slots_per_rank = 0;
  uint64_t window_bytes = 0;  // collective window per rank
  uint32_t loan_tickets = 0;  // loans one rank may have lent at once (segment_layout.h)
  uint64_t loan_bytes = 0;    // one rank's loan heap
  uint32_t features = 0;      // this rank's RankSlot::features (not geometry: ranks may differ)
};

/// A segment's mapping, unmapped when its last holder goes: the Segment, and the loans and views
/// (loan_pool.h) that may outlive it, since a user's tensor may point into it.
struct Mapping {
  Mapping(uint8_t* base, uint64_t bytes) noexcept;  // registers it with the bus guard
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint8_t* const base;
  const uint64_t bytes;
  const int guard;  // BusGuard registration (-1: none)
};

class Segment {
 public:
  /// Attaches `rank` to the current incarnation of the group, or creates a new one (no segment
  /// yet, a stale one, an incomplete one, or one in which this rank's slot was already used);
  /// returns once this rank is live in it (not waiting for the others). Throws SegmentError.
  static std::unique_ptr<Segment> attach(const SegmentParams& params, uint32_t rank,
                                         std::chrono::steady_clock::time_point deadline);
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  /// Leaves (see leave()) and unmaps.
  ~Segment();

  /// Marks this rank as left (`abandoned`: before its rendezvous completed); the last live rank
  /// removes the segment, if the name still refers to this incarnation, and the lock file.
  void leave(bool abandoned = false) noexcept;
  /// For a rank whose rendezvous timed out: under the lock that ranks claim their slots under,
  /// leaves as abandoned unless every rank has arrived by now (false: it stays, the group
  /// formed). Without the lock a peer could claim its slot between this rank's last look and its
  /// leaving, find every rank arrived and take the group for formed, alone.
  bool abandon_unless_all_arrived() noexcept;
  /// Removes the segment's name (if it still refers to this incarnation) and its lock file, for a
  /// group whose ranks have all attached and that no process will join again: its members keep
  /// their mappings, and nothing is left in /dev/shm however they end (SIGKILL to all of them).
  void unlink_name() noexcept;
  /// Whether the mapping was lost because the file shrank under it (a fault caught by
  /// bus_guard.h, or check_file() found it shorter).
  bool poisoned() const noexcept {
    // Inline: every poll of the channel asks.
    return truncated_.load(std::memory_order_acquire) ||
           (bus_poisoned_ != nullptr && bus_poisoned_->load(std::memory_order_acquire));
  }
  /// Compares the file's size with the mapping (one fstat): a file cut where this rank reads no
  /// page past the new end raises no fault, but is just as lost.
  void check_file() noexcept;
  /// The mapping, for what must keep it alive beyond this Segment (loans and views).
  const std::shared_ptr<const Mapping>& mapping() const noexcept { return mapping_; }
  /// The random id of this incarnation (in messages).
  uint64_t incarnation() const noexcept { return incarnation_; }

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
  /// The base of the ring src -> dst: its RingControl, then ring_entries entries (ring.h).
  uint8_t* ring_memory(uint32_t src, uint32_t dst) const noexcept { return ring_base(src, dst); }
  /// The arena region of `owner`: its ArenaSlot table, then its slots (arena.h).
  /// Rank `owner`'s collective window (geometry().window_bytes).
  uint8_t* window_memory(uint32_t owner) const noexcept {
    return base_ + geometry_.window_offset + uint64_t{owner} * geometry_.window_bytes;
  }
  uint8_t* region_memory(uint32_t owner) const noexcept {
    return base_ + geometry_.arena_offset + uint64_t{owner} * geometry_.region_bytes;
  }
  /// Rank `owner`'s loan region: its LoanTicket table, then its heap (geometry().loan_table_bytes on).
  uint8_t* loan_memory(uint32_t owner) const noexcept {
    return base_ + geometry_.loan_offset + uint64_t{owner} * geometry_.loan_region_bytes;
  }

  /// Whether rank `r` is attached and its process alive (left or dead ranks are not).
  bool rank_alive(uint32_t r) const;
  /// Whether the process that was rank `r` in this incarnation still runs, whether or not it left
  /// (its views of loans may outlive its group); false for a rank that never arrived.
  bool rank_process_alive(uint32_t r) const;
  /// Whether rank `r` died holding its place: it is still live in the table but its process is
  /// gone (a crash or a kill; a rank that left first, then exited, did not die here).
  bool rank_died(uint32_t r) const;
  /// Rank r's RankSlot::features (read once it is live; 0 before).
  uint32_t rank_features(uint32_t r) const noexcept;
  /// Whether every rank has arrived in this incarnation: it is live, or it has left after its
  /// own rendezvous completed (a fast peer may send and leave before this rank looks).
  bool all_arrived() const;
  /// The first rank whose process runs in another PID namespace than this one, or nullopt.
  struct ForeignRank {
    uint32_t rank;
    ProcessId process;
  };
  std::optional<ForeignRank> foreign_rank() const;
  /// The first rank that abandoned this incarnation's rendezvous (left before it completed), or
  /// -1.
  int first_abandoned() const;
  /// A rank whose slot is still free while the process that announced itself as joining it
  /// (JoinRecord in the lock file) is dead: it will never arrive.
  struct DeadJoiner {
    uint32_t rank;
    uint32_t pid;
  };
  std::optional<DeadJoiner> dead_joiner() const;
  /// "rank 1 (pid 1234)" for messages.
  std::string describe_rank(uint32_t r) const;

 private:
  friend class Attacher;  // attach.cpp: creates the Segment and maps it
  Segment(SegmentParams params, uint32_t rank);
  void map(int fd, uint64_t bytes);
  /// A rank slot's fields: from the mapping, or from the file when the mapping is lost.
  struct SlotView {
    uint32_t state = kRankFree;
    uint32_t pid = 0;
    uint64_t start_time = 0;
    uint32_t pid_ns = 0;
    ProcessId process() const noexcept { return {pid, start_time, pid_ns}; }
  };
  SlotView read_slot(uint32_t r) const noexcept;
  /// Stores this rank's state (through the file when the mapping is lost).
  void store_state(uint32_t state) noexcept;
  uint8_t* ring_base(uint32_t src, uint32_t dst) const noexcept {
    return base_ + geometry_.rings_offset + (uint64_t{src} * params_.world_size + dst) * geometry_.ring_bytes;
  }

  SegmentParams params_;
  uint32_t rank_;
  SegmentGeometry geometry_{};
  std::shared_ptr<const Mapping> mapping_;
  uint8_t* base_ = nullptr;  // mapping_->base
  uint64_t mapped_bytes_ = 0;
  const std::atomic<bool>* bus_poisoned_ = nullptr;  // its flag (BusGuard::flag)
  int fd_ = -1;                                      // the segment file
  std::atomic<bool> truncated_{false};
  dev_t dev_ = 0;  // the file of this incarnation: the name may point elsewhere
  ino_t ino_ = 0;  //   by the time this rank leaves
  uint64_t incarnation_ = 0;
  bool left_ = false;
  bool leave_unless(bool abandoned, bool all_arrived_first) noexcept;  // leave's work; false: stayed
  void remove_name(LockFile& lock) const noexcept;
};

/// An incarnation id as 16 hex digits, for messages.
std::string hex_id(uint64_t v);

}  // namespace tdshm::shm
