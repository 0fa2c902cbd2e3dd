#pragma once
// The lock-file protocol: the exclusive flock on /dev/shm/tdshm.<name>.lock that serialises
// everything that creates, joins, replaces, leaves or removes the segment of one name, and the
// records in that file (segment_layout.h): the last creator, and the processes joining.

#include "shm/layout/segment_layout.h"
#include "shm/parts/process_identity.h"

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace tdshm::shm {

/// Where rank `rank`'s JoinRecord lies in the lock file.
off_t join_record_offset(uint32_t rank);

/// The process a creator record names.
inline ProcessId creator_process(const CreatorRecord& r) { return {r.pid, r.start_time, r.pid_ns}; }
/// Whether the record names a creator that still runs (this process included).
bool creator_alive(const std::optional<CreatorRecord>& rec);

// The exclusive lock that serialises attach and leave for one name.
class LockFile {
 public:
  /// Takes the lock of `name`, waiting until `deadline` at most (then SegmentError).
  /// `joining`: the rank this process joins as; its JoinRecord is written before it waits.
  LockFile(const std::string& name, std::chrono::steady_clock::time_point deadline,
           std::optional<uint32_t> joining = std::nullopt);
  LockFile(const LockFile&) = delete;
  LockFile& operator=(const LockFile&) = delete;
  ~LockFile();  // closing drops the flock
  void remove_file() noexcept;

  /// The creator record, when the file holds one.
  std::optional<CreatorRecord> record() const noexcept;
  void write_record(const CreatorRecord& r) const;
  /// Clears this process's JoinRecord for `rank` (it claimed its slot, or gave up).
  void clear_join(uint32_t rank) const noexcept;
  /// For a joining process: whether `r` is the creator record it found when it arrived (before
  /// it waited for the lock) with `creating` set and its creator already dead. Such a creator
  /// was never grouped with this process (attach.cpp's recovery model).
  bool dead_on_arrival(const CreatorRecord& r) const noexcept;

 private:
  /// One try: opens the file, announces `joining`, waits for the flock. False when the file was
  /// removed meanwhile (the lock is then on a deleted inode: try again on the current file).
  bool lock_current_file(std::chrono::steady_clock::time_point deadline, std::optional<uint32_t> joining);

  std::string path_;
  int fd_ = -1;
  std::optional<CreatorRecord> dead_on_arrival_;  // see dead_on_arrival()
};

}  // namespace tdshm::shm
