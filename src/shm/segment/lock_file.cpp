// The lock file of a segment name: its flock, its creator record and its join records.

#include "shm/segment/lock_file.h"

#include <tdshm/errors.h>

#include "shm/parts/trust.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace tdshm::shm {

off_t join_record_offset(uint32_t rank) {
  return static_cast<off_t>(kJoinRecordsOffset + uint64_t{rank} * sizeof(JoinRecord));
}

bool creator_alive(const std::optional<CreatorRecord>& rec) { return rec && alive_or_self(creator_process(*rec)); }

LockFile::LockFile(const std::string& name, std::chrono::steady_clock::time_point deadline,
                   std::optional<uint32_t> joining)
    : path_(lock_path(name)) {
  while (!lock_current_file(deadline, joining)) {
    // The file was removed while this process waited: it locks the current one.
  }
}

bool LockFile::lock_current_file(std::chrono::steady_clock::time_point deadline, std::optional<uint32_t> joining) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd_ < 0) throw open_error(path_, "lock file", errno);
  try {
    check_owned(fd_, path_, "lock file");
  } catch (...) {
    ::close(fd_);
    throw;
  }
  if (joining) {
    const ProcessId me = self_process();
    const JoinRecord rec{JoinRecord::kMagic, me.pid, *joining, me.start_time, me.pid_ns, 0};
    (void)!::pwrite(fd_, &rec, sizeof rec, join_record_offset(*joining));
    // Read without the lock: a record its writer tore has no magic, or names no dead creator
    // that the holder of the lock will find, and counts as none.
    const std::optional<CreatorRecord> r = record();
    dead_on_arrival_ = r && r->creating != 0 && !creator_alive(r) ? r : std::nullopt;
  }
  while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      const int err = errno;
      if (joining) clear_join(*joining);
      ::close(fd_);
      throw SegmentError("cannot lock '" + path_ + "': " + std::strerror(err));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      if (joining) clear_join(*joining);
      ::close(fd_);
      // A timeout, as the group's own (a creator sizing a large segment holds the lock a while):
      // a caller that waits in slices tries again.
      throw TimeoutError("timed out waiting for the lock '" + path_ + "' held by another process");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // The last leaver may have removed the file while we waited: then our lock is on a
  // deleted inode and means nothing; take the lock again on the current file.
  struct stat held {
  }, current{};
  if (::fstat(fd_, &held) == 0 && ::lstat(path_.c_str(), &current) == 0 && held.st_ino == current.st_ino &&
      held.st_dev == current.st_dev) {
    return true;
  }
  ::close(fd_);
  return false;
}

LockFile::~LockFile() { ::close(fd_); }

void LockFile::remove_file() noexcept { ::unlink(path_.c_str()); }

std::optional<CreatorRecord> LockFile::record() const noexcept {
  CreatorRecord r;
  if (::pread(fd_, &r, sizeof r, 0) != static_cast<ssize_t>(sizeof r) || r.magic != CreatorRecord::kMagic) {
    return std::nullopt;
  }
  return r;
}

void LockFile::write_record(const CreatorRecord& r) const {
  if (::pwrite(fd_, &r, sizeof r, 0) != static_cast<ssize_t>(sizeof r)) {
    throw SegmentError("cannot write the lock file '" + path_ + "': " + std::strerror(errno));
  }
}

bool LockFile::dead_on_arrival(const CreatorRecord& r) const noexcept {
  const std::optional<CreatorRecord>& a = dead_on_arrival_;
  return a && a->pid == r.pid && a->rank == r.rank && a->start_time == r.start_time && a->pid_ns == r.pid_ns;
}

void LockFile::clear_join(uint32_t rank) const noexcept {
  JoinRecord rec;
  if (::pread(fd_, &rec, sizeof rec, join_record_offset(rank)) == static_cast<ssize_t>(sizeof rec) &&
      rec.magic == JoinRecord::kMagic && rec.pid == self_process().pid &&
      !foreign_pid_namespace({rec.pid, rec.start_time, rec.pid_ns})) {
    const JoinRecord zero{};
    (void)!::pwrite(fd_, &zero, sizeof zero, join_record_offset(rank));
  }
}

}  // namespace tdshm::shm
