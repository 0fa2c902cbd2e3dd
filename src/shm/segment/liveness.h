#pragma once
// Liveness of an existing segment: a read-only view of its file (header check, rank table), which
// of its ranks live, and the removal of a segment that no live rank holds (stale).

#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"

#include <cstdint>
#include <string>

namespace tdshm::shm {

/// Whether the slot is claimed (Live) by a process that runs, this process included.
bool slot_alive(const RankSlot& slot);

/// A read-only view of an existing segment file, for deciding what to do with it.
class ExistingSegment {
 public:
  /// Maps the file `fd` (`file_bytes` long) read-only, when it can hold a header, and checks the
  /// header (validate.h). Throws SegmentError if the mapping fails.
  ExistingSegment(int fd, uint64_t file_bytes);
  ExistingSegment(const ExistingSegment&) = delete;
  ExistingSegment& operator=(const ExistingSegment&) = delete;
  ~ExistingSegment();
  const HeaderFields& header() const noexcept { return header_; }
  const HeaderCheck& check() const noexcept { return check_; }
  /// Whether the rank table can be read: the header's geometry is consistent and fits the file.
  bool table_readable() const noexcept {
    return check_.verdict == HeaderVerdict::kValid ||
           (check_.verdict == HeaderVerdict::kTruncated &&
            header_.rank_table_offset + uint64_t{header_.world_size} * sizeof(RankSlot) <= bytes_);
  }
  /// Rank r's slot (requires table_readable()).
  const RankSlot& slot(uint32_t r) const noexcept {
    return *reinterpret_cast<const RankSlot*>(base_ + header_.rank_table_offset + uint64_t{r} * sizeof(RankSlot));
  }
  /// The first live rank, or -1.
  int live_rank() const;

 private:
  const uint8_t* base_ = nullptr;
  uint64_t bytes_;
  int guard_ = -1;
  HeaderFields header_{};
  HeaderCheck check_{};
};

/// Removes the segment `name` if no live process is attached. See process_group.h.
bool remove_segment_if_stale(const std::string& name);

}  // namespace tdshm::shm
