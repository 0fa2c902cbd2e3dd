// Liveness of an existing segment's ranks, and the removal of a stale segment.

#include "shm/segment/liveness.h"

#include "common/fd.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "shm/parts/bus_guard.h"
#include "shm/parts/process_identity.h"
#include "shm/parts/trust.h"
#include "shm/segment/lock_file.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

namespace tdshm {

bool remove_stale_segment(const std::string& name) { return shm::remove_segment_if_stale(name); }

namespace shm {

using detail::Fd;

bool slot_alive(const RankSlot& slot) {
  if (slot.state.load(std::memory_order_acquire) != kRankLive) return false;  // pairs with the claim's release
  return alive_or_self({slot.pid, slot.start_time, slot.pid_ns});
}

ExistingSegment::ExistingSegment(int fd, uint64_t file_bytes) : bytes_(file_bytes) {
  if (file_bytes >= sizeof(SegmentHeader)) {
    void* p = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw SegmentError(std::string("cannot map an existing segment: ") + std::strerror(errno));
    base_ = static_cast<const uint8_t*>(p);
    guard_ = BusGuard::add(const_cast<uint8_t*>(base_), bytes_);
    header_ = read_header(*reinterpret_cast<const SegmentHeader*>(base_));
    check_ = check_header(header_, file_bytes);
  } else {
    check_ = {HeaderVerdict::kIncomplete, "only " + std::to_string(file_bytes) + " bytes"};
  }
}

ExistingSegment::~ExistingSegment() {
  if (base_ != nullptr) {
    BusGuard::remove(guard_);
    ::munmap(const_cast<uint8_t*>(base_), bytes_);
  }
}

int ExistingSegment::live_rank() const {
  for (uint32_t r = 0; r < header_.world_size; ++r) {
    if (slot_alive(slot(r))) return static_cast<int>(r);
  }
  return -1;
}

bool remove_segment_if_stale(const std::string& name) {
  validate_segment_name(name);
  LockFile lock(name, std::chrono::steady_clock::now() + std::chrono::seconds(5));
  struct stat st {};
  Fd fd(open_segment(name, st));
  if (!fd) {
    lock.remove_file();
    return false;
  }
  {
    const ExistingSegment existing(fd.get(), static_cast<uint64_t>(st.st_size));
    if (existing.table_readable()) {
      if (const int live = existing.live_rank(); live >= 0) {
        throw SegmentError("segment '" + name + "' is in use: rank " + std::to_string(live) + " (pid " +
                           std::to_string(existing.slot(static_cast<uint32_t>(live)).pid) + ") is alive");
      }
    } else if (existing.check().verdict != HeaderVerdict::kOtherVersion && creator_alive(lock.record()) &&
               lock.record()->creating == 0) {
      throw SegmentError("segment '" + name + "' is unusable (" + existing.check().problem +
                         ") but the rank that created it still runs: not removed");
    }
  }
  const bool removed = ::unlink(segment_path(name).c_str()) == 0;
  lock.remove_file();
  return removed;
}

}  // namespace shm
}  // namespace tdshm
