// Segment creation, attach, validation and leave.
//
// Trust model. Trusted: processes of the same user (effective uid) that joined the group.
// Everything else is refused, never joined, truncated or written:
//  * the segment /dev/shm/tdshm.<name> and its lock file /dev/shm/tdshm.<name>.lock must be
//    regular files owned by the caller's effective uid with no group/other permission bits (they
//    are created 0600 with O_EXCL); both are opened with O_NOFOLLOW, so a symlink planted at
//    either path is an error, never followed;
//  * a segment whose size disagrees with its header is never mapped past the file's end; a file
//    truncated later, while mapped, is survived (bus_guard.h);
//  * a member may still be buggy: every value the engine reads from the segment is read once,
//    bounded and validated (validate.h), and a bad entry fails that pair's transfers with a
//    TransportError.
//
// Recovery model. Everything that creates, replaces, joins or removes a segment runs under an
// exclusive flock on the lock file; the kernel drops the lock of a process that dies, so a crash
// never wedges the name. Under the lock:
//  * a creator first writes a record {pid, start time, rank, creating = 1} into the lock file,
//    creates the file (O_EXCL), reserves its pages, writes the header, publishes the layout
//    version (release) and claims its slot, then clears `creating`. Whoever takes the lock next
//    and finds `creating` set knows that the creator died mid-way: the file (missing, short,
//    zero, or half-written) is replaced, and the dead creator's rank is recorded in the new
//    incarnation as a member that died, so that the other ranks' rendezvous fails with
//    PeerLostError at once instead of waiting for their timeout;
//  * a header that is incomplete, corrupt or truncated is refused while the rank that created it
//    lives (someone damaged a group in use) and replaced otherwise;
//  * a valid segment with no live rank (all left or dead) is stale: it is replaced;
//  * a rank whose slot in the current incarnation is already used (it left, or died) starts a
//    new incarnation: the old file is unlinked (its members keep their mapping) and a new one is
//    created under the name. The members of the old incarnation finish with it; messages never
//    cross incarnations because they never share a file;
//  * the last live rank to leave removes the file, if the name still refers to its incarnation,
//    and then the lock file. A dead rank leaves its slot Live with its pid: peers see it dead
//    (process_alive compares pid and start time, so a reused pid is not mistaken for it), and the
//    next group under the name replaces the segment. tdshm::remove_stale_segment removes one by
//    hand;
//  * pids are only meaningful in one PID namespace: each record carries its process's namespace
//    (pid_ns), a process of another namespace is never taken for dead (foreign_pid_namespace),
//    and the rendezvous refuses a group that spans namespaces (ShmEngine::rendezvous).

#include "shm/segment.h"

#include "common/fd.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "common/log.h"
#include "shm/bus_guard.h"
#include "shm/inspect.h"
#include "shm/validate.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

namespace tdshm {

void validate_segment_name(const std::string& name) {
  if (name.empty() || name.size() > 200) {
    throw SegmentError("segment name '" + name + "' must have 1 to 200 characters");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) {
      throw SegmentError("segment name '" + name + "' may only contain letters, digits, '.', '_' and '-'");
    }
  }
}

size_t shm_segment_bytes(int world_size, const ShmOptions& options) {
  return shm::segment_geometry(static_cast<uint32_t>(world_size), options.slot_bytes, options.ring_entries,
                               options.slots_per_rank, options.window_bytes)
      .segment_bytes;
}

bool remove_stale_segment(const std::string& name) { return shm::remove_segment_if_stale(name); }

namespace shm {

namespace {

const char* const kShmDir = "/dev/shm";

std::string segment_path(const std::string& name) { return std::string(kShmDir) + "/tdshm." + name; }
std::string lock_path(const std::string& name) { return segment_path(name) + ".lock"; }

// Plain open/read and hand parsing, no iostreams: they take the locale's locks, which a child
// forked from a multi-threaded program (a data loader's worker) may find held forever.
uint64_t read_start_time(uint32_t pid) {
  char path[32];
  std::snprintf(path, sizeof path, "/proc/%u/stat", pid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[1024];
  size_t len = 0;
  for (ssize_t n; len < sizeof buf - 1 && (n = ::read(fd, buf + len, sizeof buf - 1 - len)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    len += static_cast<size_t>(n);
  }
  ::close(fd);
  buf[len] = '\0';
  // Field 2 (comm) may hold spaces and parentheses: fields resume after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return 0;
  ++p;
  for (int field = 3; field <= 22; ++field) {
    while (*p == ' ') ++p;
    if (*p == '\0') return 0;
    // Field 3 is the state: a zombie (Z) or dead (X) process has exited, though its parent has
    // not reaped it yet; it counts as gone.
    if (field == 3 && (*p == 'Z' || *p == 'X')) return 0;
    if (field == 22) return std::strtoull(p, nullptr, 10);
    while (*p != ' ' && *p != '\0') ++p;
  }
  return 0;
}

using detail::Fd;

std::string uid_str(uid_t uid) { return std::to_string(static_cast<unsigned long>(uid)); }

/// Why open(path) failed, in words that point the user the right way.
SegmentError open_error(const std::string& path, const std::string& what, int err) {
  struct stat st {};
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  // (With fs.protected_symlinks, opening another user's link in /dev/shm fails with EACCES.)
  if (err == ELOOP || (exists && S_ISLNK(st.st_mode))) {
    const std::string owner = exists && st.st_uid != ::geteuid() ? " owned by uid " + uid_str(st.st_uid) : "";
    return SegmentError("the " + what + " '" + path + "' is a symbolic link" + owner +
                        "; tdshm never follows links there (someone may be redirecting it): remove the link, or use "
                        "another segment name");
  }
  if ((err == EACCES || err == EPERM) && exists && st.st_uid != ::geteuid()) {
    return SegmentError("the " + what + " '" + path + "' belongs to uid " + uid_str(st.st_uid) +
                        ", not to this process's uid " + uid_str(::geteuid()) +
                        ": refusing another user's file; remove it or use another segment name");
  }
  if (err == ENOSPC || err == EROFS || err == ENOENT) {
    return SegmentError("cannot create the " + what + " '" + path + "': " + std::strerror(err) + " (is " + kShmDir +
                        " a writable tmpfs?)");
  }
  return SegmentError("cannot open the " + what + " '" + path + "': " + std::strerror(err));
}

/// Checks that `fd` (opened from `path`) is a regular file of this uid, private to it.
void check_owned(int fd, const std::string& path, const std::string& what, struct stat* out = nullptr) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw SegmentError("cannot stat the " + what + " '" + path + "': " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {
    throw SegmentError("the " + what + " '" + path + "' is not a regular file; refusing it: remove it or use another segment name");
  }
  if (st.st_uid != ::geteuid()) {
    throw SegmentError("the " + what + " '" + path + "' is owned by uid " + uid_str(st.st_uid) +
                       ", not by this process's uid " + uid_str(::geteuid()) +
                       ": refusing another user's file (it could read or forge this group's data); remove it or "
                       "use another segment name");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw SegmentError("the " + what + " '" + path + "' has mode " + mode +
                       ": group/other permission bits would let other users read or write it, and tdshm "
                       "creates its files 0600; refusing it: remove it or use another segment name");
  }
  if (out != nullptr) *out = st;
}

off_t join_record_offset(uint32_t rank) { return static_cast<off_t>(kJoinRecordsOffset + uint64_t{rank} * sizeof(JoinRecord)); }

// The exclusive lock that serialises attach and leave for one name.
class LockFile {
 public:
  /// `joining`: the rank this process joins as; its JoinRecord is written before it waits.
  LockFile(const std::string& name, std::chrono::steady_clock::time_point deadline,
           std::optional<uint32_t> joining = std::nullopt)
      : path_(lock_path(name)) {
    for (;;) {
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
          throw SegmentError("timed out waiting for the lock '" + path_ + "' held by another process");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      // The last leaver may have removed the file while we waited: then our lock is on a
      // deleted inode and means nothing; take the lock again on the current file.
      struct stat held {}, current {};
      if (::fstat(fd_, &held) == 0 && ::lstat(path_.c_str(), &current) == 0 && held.st_ino == current.st_ino &&
          held.st_dev == current.st_dev) {
        return;
      }
      ::close(fd_);
    }
  }
  LockFile(const LockFile&) = delete;
  LockFile& operator=(const LockFile&) = delete;
  ~LockFile() { ::close(fd_); }  // closing drops the flock
  void remove_file() noexcept { ::unlink(path_.c_str()); }

  std::optional<CreatorRecord> record() const noexcept {
    CreatorRecord r;
    if (::pread(fd_, &r, sizeof r, 0) != static_cast<ssize_t>(sizeof r) || r.magic != CreatorRecord::kMagic) {
      return std::nullopt;
    }
    return r;
  }
  void write_record(const CreatorRecord& r) const {
    if (::pwrite(fd_, &r, sizeof r, 0) != static_cast<ssize_t>(sizeof r)) {
      throw SegmentError("cannot write the lock file '" + path_ + "': " + std::strerror(errno));
    }
  }
  /// Clears this process's JoinRecord for `rank` (it claimed its slot, or gave up).
  void clear_join(uint32_t rank) const noexcept {
    JoinRecord rec;
    if (::pread(fd_, &rec, sizeof rec, join_record_offset(rank)) == static_cast<ssize_t>(sizeof rec) &&
        rec.magic == JoinRecord::kMagic && rec.pid == self_process().pid &&
        !foreign_pid_namespace({rec.pid, rec.start_time, rec.pid_ns})) {
      const JoinRecord zero{};
      (void)!::pwrite(fd_, &zero, sizeof zero, join_record_offset(rank));
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
};

/// Opens the segment file of `name` read-write, refusing links and other users' files; returns
/// a closed Fd when there is none.
int open_segment(const std::string& name, struct stat& st) {
  const std::string path = segment_path(name);
  const int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return -1;
    throw open_error(path, "segment", errno);
  }
  try {
    check_owned(fd, path, "segment", &st);
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

/// A read-only view of an existing segment file, for deciding what to do with it.
class Inspection {
 public:
  Inspection(int fd, uint64_t file_bytes) : bytes_(file_bytes) {
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
  Inspection(const Inspection&) = delete;
  Inspection& operator=(const Inspection&) = delete;
  ~Inspection() {
    if (base_ != nullptr) {
      BusGuard::remove(guard_);
      ::munmap(const_cast<uint8_t*>(base_), bytes_);
    }
  }
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

// Whether the process `id` runs, this process included (threads-as-ranks share its pid).
bool alive_or_self(const ProcessId& id) {
  if (id.pid == self_process().pid && !foreign_pid_namespace(id)) return true;
  return process_alive(id);
}

bool slot_alive(const RankSlot& slot) {
  if (slot.state.load(std::memory_order_acquire) != kRankLive) return false;  // pairs with the claim's release
  return alive_or_self({slot.pid, slot.start_time, slot.pid_ns});
}

int Inspection::live_rank() const {
  for (uint32_t r = 0; r < header_.world_size; ++r) {
    if (slot_alive(slot(r))) return static_cast<int>(r);
  }
  return -1;
}

bool creator_alive(const std::optional<CreatorRecord>& rec) {
  return rec && alive_or_self({rec->pid, rec->start_time, rec->pid_ns});
}

// What segments that `tdshm gc` would remove hold in /dev/shm, for an error about its free space
// ("" when none): groups whose processes were all killed leave theirs behind, and a job whose
// names are fresh each run (the Python backend's are random) never replaces them. Only read
// (inspect.h): nothing is removed without the user's say.
std::string stale_segments_hint(const std::string& except) {
  uint64_t count = 0, held = 0;
  try {
    for (const SegmentInfo& info : list_segments()) {
      if (info.name == except || !gc_decision(info).first) continue;
      ++count;
      held += info.file_bytes;
    }
  } catch (...) {
    return "";  // a hint only
  }
  if (count == 0) return "";
  return "; " + std::to_string(count) + " stale tdshm segment" + (count == 1 ? "" : "s") +
         " (every rank dead) hold " + std::to_string(held >> 20) + " MiB there: `tdshm gc` removes " +
         (count == 1 ? "it" : "them") + " (tdshm::remove_stale_segment(name) from code)";
}

void check_capacity(uint64_t bytes, const std::string& name) {
  struct statvfs fs {};
  if (::statvfs(kShmDir, &fs) != 0) return;  // not measurable: fallocate below still guards
  const uint64_t avail = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (bytes > avail) {
    throw SegmentError("segment '" + name + "' needs " + std::to_string(bytes) + " bytes (" +
                       std::to_string(bytes >> 20) + " MiB) but " + kShmDir + " has " + std::to_string(avail) +
                       " bytes free: enlarge it (docker run --shm-size=" + std::to_string((bytes >> 20) + 64) +
                       "m, or mount -o remount,size=... " + kShmDir +
                       ") or make ShmOptions::slot_bytes / slots_per_rank / ring_entries smaller" +
                       stale_segments_hint(name));
  }
}

uint64_t random_id() {
  uint64_t v = 0;
  if (::getrandom(&v, sizeof v, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof v)) {
    v = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
        (uint64_t{self_process().pid} << 32);
  }
  return v;
}

std::string hex(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

// The inode of this process's PID namespace (the same for all its threads; a fork keeps it), 0 if
// /proc does not say.
uint32_t read_pid_namespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint32_t>(st.st_ino);  // namespace inodes are 32-bit (proc_inum)
}

ProcessId self_process() {
  static const ProcessId id{static_cast<uint32_t>(::getpid()), read_start_time(static_cast<uint32_t>(::getpid())),
                            read_pid_namespace()};
  // A forked child has another pid, and may be in another PID namespace (its parent unshared
  // one): recompute then.
  if (id.pid != static_cast<uint32_t>(::getpid())) {
    return {static_cast<uint32_t>(::getpid()), read_start_time(static_cast<uint32_t>(::getpid())), read_pid_namespace()};
  }
  return id;
}

bool foreign_pid_namespace(const ProcessId& id) {
  const uint32_t mine = self_process().pid_ns;
  return id.pid_ns != 0 && mine != 0 && id.pid_ns != mine;
}

bool process_alive(const ProcessId& id) {
  if (foreign_pid_namespace(id)) return true;  // cannot be checked from here: never taken for dead
  if (id.pid == 0) return false;
  if (::kill(static_cast<pid_t>(id.pid), 0) != 0 && errno == ESRCH) return false;
  const uint64_t start = read_start_time(id.pid);
  if (start == 0) return false;  // gone between the two checks, or a zombie being reaped
  return start == id.start_time;
}

Segment::Segment(SegmentParams params, uint32_t rank) : params_(std::move(params)), rank_(rank) {}

void Segment::map(int fd, uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw SegmentError("cannot map segment '" + params_.name + "' (" + std::to_string(bytes) + " bytes): " +
                       std::strerror(errno));
  }
  base_ = static_cast<uint8_t*>(p);
  mapped_bytes_ = bytes;
  guard_ = BusGuard::add(base_, bytes);
  fd_ = ::dup(fd);  // kept: the file's size is watched, and a lost mapping is updated through it
  if (fd_ >= 0) ::fcntl(fd_, F_SETFD, FD_CLOEXEC);
  struct stat st {};
  if (::fstat(fd, &st) == 0) {
    dev_ = st.st_dev;
    ino_ = st.st_ino;
  }
}

void Segment::check_file() noexcept {
  struct stat st {};
  if (fd_ >= 0 && !truncated_.load(std::memory_order_relaxed) && ::fstat(fd_, &st) == 0 &&
      static_cast<uint64_t>(st.st_size) < mapped_bytes_) {
    // A cut that spares the pages this rank touches raises no SIGBUS, but the tail of the page
    // at the new end reads zeros from now on: the mapping is as lost as after a fault.
    truncated_.store(true, std::memory_order_release);
  }
}

Segment::SlotView Segment::read_slot(uint32_t r) const noexcept {
  const uint64_t offset = geometry_.rank_table_offset + uint64_t{r} * sizeof(RankSlot);
  if (!poisoned()) {
    const RankSlot& slot = rank_slot(r);
    const uint32_t state = slot.state.load(std::memory_order_acquire);  // pairs with the claim's release
    if (state == kRankFree) return {};  // pid and start time are being written, or never were
    return {state, slot.pid, slot.start_time, slot.pid_ns};
  }
  // The mapping is gone (private zeros, or a cut file): read what is left of the file itself.
  uint8_t bytes[offsetof(RankSlot, pid_ns) + sizeof(uint32_t)] = {};
  if (fd_ < 0 || ::pread(fd_, bytes, sizeof bytes, static_cast<off_t>(offset)) != static_cast<ssize_t>(sizeof bytes)) {
    return {};
  }
  SlotView v;
  std::memcpy(&v.state, bytes + offsetof(RankSlot, state), sizeof v.state);
  std::memcpy(&v.pid, bytes + offsetof(RankSlot, pid), sizeof v.pid);
  std::memcpy(&v.start_time, bytes + offsetof(RankSlot, start_time), sizeof v.start_time);
  std::memcpy(&v.pid_ns, bytes + offsetof(RankSlot, pid_ns), sizeof v.pid_ns);
  return v;
}

void Segment::store_state(uint32_t state) noexcept {
  if (!poisoned()) {
    rank_slot(rank_).state.store(state, std::memory_order_release);
    return;
  }
  // Through the file, only where it still has bytes (a write past its end would grow it).
  const uint64_t offset = geometry_.rank_table_offset + uint64_t{rank_} * sizeof(RankSlot) + offsetof(RankSlot, state);
  struct stat st {};
  if (fd_ >= 0 && ::fstat(fd_, &st) == 0 && offset + sizeof state <= static_cast<uint64_t>(st.st_size)) {
    (void)!::pwrite(fd_, &state, sizeof state, static_cast<off_t>(offset));
  }
}

std::unique_ptr<Segment> Segment::attach(const SegmentParams& params, uint32_t rank,
                                         std::chrono::steady_clock::time_point deadline) {
  validate_segment_name(params.name);
  if (params.world_size < 1 || params.world_size > kMaxWorld) {
    throw SegmentError("world size " + std::to_string(params.world_size) + " must be in [1, " +
                       std::to_string(kMaxWorld) + "]");
  }
  if (rank >= params.world_size) {
    throw SegmentError("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(params.world_size) + ")");
  }
  if (params.slot_bytes < 64 || params.slot_bytes > kMaxSlotBytes) {
    throw SegmentError("slot_bytes " + std::to_string(params.slot_bytes) + " must be in [64, 2^30]");
  }
  if (params.ring_entries < 1 || params.ring_entries > kMaxRingEntries) {
    throw SegmentError("ring_entries " + std::to_string(params.ring_entries) + " must be in [1, 2^20]");
  }
  if (params.slots_per_rank < 1 || params.slots_per_rank > kMaxSlotsPerRank) {
    throw SegmentError("slots_per_rank " + std::to_string(params.slots_per_rank) + " must be in [1, 2^16]");
  }
  if (params.window_bytes < kWindowParts * kCacheLine || params.window_bytes > kMaxWindowBytes ||
      params.window_bytes % (kWindowParts * kCacheLine) != 0) {
    throw SegmentError("window_bytes " + std::to_string(params.window_bytes) + " must be a multiple of " +
                       std::to_string(kWindowParts * kCacheLine) + " in [" + std::to_string(kWindowParts * kCacheLine) +
                       ", 2^30]");
  }

  std::unique_ptr<Segment> seg(new Segment(params, rank));
  seg->geometry_ = segment_geometry(params.world_size, params.slot_bytes, params.ring_entries, params.slots_per_rank,
                                    params.window_bytes);
  const std::string path = segment_path(params.name);
  const ProcessId me = self_process();

  LockFile lock(params.name, deadline, rank);
  // This rank's JoinRecord goes right before it claims its slot (below), or when attach throws.
  const struct ClearJoin {
    const LockFile& lock;
    uint32_t rank;
    ~ClearJoin() { lock.clear_join(rank); }
  } clear_join{lock, rank};
  const std::optional<CreatorRecord> record = lock.record();
  // `creating` still set while we hold the lock: that creation was interrupted (see the recovery
  // model), whatever /proc says. Its creator is normally dead, but the kernel drops a killed
  // process's flock before /proc shows it as exited, so give it a moment to finish dying; one
  // that truly lives (it threw mid-way) is not recorded as a dead member.
  const bool interrupted = record && record->creating != 0;
  bool creator_died = false;
  if (interrupted) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (creator_alive(record) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    creator_died = !creator_alive(record);
  }
  auto corrupt = [&](const std::string& what) {
    return SegmentError("segment '" + params.name + "' is corrupted or not a tdshm segment: " + what +
                        "; the rank that created it still runs, so it is left alone: if no process uses it, remove "
                        "it with tdshm::remove_stale_segment or delete " + path);
  };

  for (int attempt = 0; attempt < 4 && seg->base_ == nullptr; ++attempt) {
    struct stat st {};
    Fd fd(open_segment(params.name, st));
    if (fd) {
      const auto file_bytes = static_cast<uint64_t>(st.st_size);
      const Inspection existing(fd.get(), file_bytes);
      const HeaderFields& h = existing.header();
      const HeaderVerdict verdict = existing.check().verdict;
      std::string why_replace;
      if (verdict == HeaderVerdict::kOtherVersion) {
        throw SegmentError("segment '" + params.name + "' has " + existing.check().problem +
                           ": all ranks must run the same tdshm build (if no process uses it, remove it with "
                           "tdshm::remove_stale_segment)");
      } else if (interrupted && !(verdict == HeaderVerdict::kValid && existing.live_rank() >= 0)) {
        // (A valid incarnation in use was published: only its record's clearing failed.)
        why_replace = "its creator (pid " + std::to_string(record->pid) + ") was interrupted while creating it";
      } else if (existing.table_readable()) {
        const int live = existing.live_rank();
        if (live < 0) {
          why_replace = "stale: no live rank";
        } else if (verdict == HeaderVerdict::kTruncated) {
          throw SegmentError("segment '" + params.name + "' was truncated: " + existing.check().problem +
                             "; rank " + std::to_string(live) + " still uses it, so it is left alone");
        } else if (h.world_size != params.world_size || h.slot_bytes != params.slot_bytes ||
                   h.ring_entries != params.ring_entries || h.slots_per_rank != params.slots_per_rank ||
                   h.window_bytes != params.window_bytes) {
          throw SegmentError("segment '" + params.name + "' is in use with world size " + std::to_string(h.world_size) +
                             ", slot_bytes " + std::to_string(h.slot_bytes) + ", ring_entries " +
                             std::to_string(h.ring_entries) + ", slots_per_rank " + std::to_string(h.slots_per_rank) +
                             ", window_bytes " + std::to_string(h.window_bytes) + "; this rank asked for world size " +
                             std::to_string(params.world_size) + ", slot_bytes " + std::to_string(params.slot_bytes) +
                             ", ring_entries " + std::to_string(params.ring_entries) + ", slots_per_rank " +
                             std::to_string(params.slots_per_rank) + ", window_bytes " +
                             std::to_string(params.window_bytes));
        } else {
          const RankSlot& mine = existing.slot(rank);
          const uint32_t state = mine.state.load(std::memory_order_acquire);
          if (state == kRankFree) {
            seg->map(fd.get(), file_bytes);  // join this incarnation
            seg->incarnation_ = h.incarnation;
            break;
          }
          if (slot_alive(mine)) {
            throw SegmentError("rank " + std::to_string(rank) + " of segment '" + params.name +
                               "' is already taken by the live process " + std::to_string(mine.pid));
          }
          why_replace = "rank " + std::to_string(rank) + " was already a member of incarnation " + hex(h.incarnation) +
                        ": a new incarnation starts";
        }
      } else if (creator_alive(record)) {
        throw corrupt(existing.check().problem);
      } else {
        why_replace = "unusable (" + existing.check().problem + ") and its creator is gone";
      }
      detail::log().debug("segment '{}': replacing it ({})", params.name, why_replace);
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
        throw SegmentError("cannot replace segment '" + params.name + "': unlink " + path + ": " + std::strerror(errno));
      }
      continue;
    }

    // Create a new incarnation.
    const uint64_t bytes = seg->geometry_.segment_bytes;
    try {
      check_capacity(bytes, params.name);
    } catch (...) {
      if (!record) lock.remove_file();  // no segment of this name exists: leave no lock file behind either
      throw;
    }
    lock.write_record({CreatorRecord::kMagic, me.pid, rank, me.start_time, 1, me.pid_ns});
    auto undo = [&] {
      ::unlink(path.c_str());
      lock.write_record({CreatorRecord::kMagic, me.pid, rank, me.start_time, 0, me.pid_ns});
    };
    const int raw = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (raw < 0) {
      const int err = errno;
      lock.write_record({CreatorRecord::kMagic, me.pid, rank, me.start_time, 0, me.pid_ns});
      if (err == EEXIST) continue;  // someone (not tdshm: we hold the lock) created it: look at it again
      throw open_error(path, "segment", err);
    }
    Fd created(raw);
    // Reserve every page now: a full /dev/shm is an error here, never a SIGBUS later.
    int err = ::fchmod(raw, 0600) != 0 ? errno : 0;
    if (err == 0) err = ::posix_fallocate(raw, 0, static_cast<off_t>(bytes));  // returns the error
    if (err != 0) {
      undo();
      throw SegmentError("cannot reserve " + std::to_string(bytes) + " bytes for segment '" + params.name + "' in " +
                         kShmDir + ": " + std::strerror(err) +
                         "; enlarge /dev/shm or make ShmOptions::slot_bytes / slots_per_rank / ring_entries smaller" +
                         (err == ENOSPC ? stale_segments_hint(params.name) : std::string()));
    }
    try {
      seg->map(raw, bytes);
    } catch (...) {
      undo();
      throw;
    }
    auto* hdr = new (seg->base_) SegmentHeader{};  // the pages are zero; this sets the fields
    hdr->magic = kSegmentMagic;
    hdr->header_bytes = sizeof(SegmentHeader);
    hdr->segment_bytes = bytes;
    hdr->world_size = params.world_size;
    hdr->ring_entries = params.ring_entries;
    hdr->slot_bytes = params.slot_bytes;
    hdr->rank_table_offset = seg->geometry_.rank_table_offset;
    hdr->rings_offset = seg->geometry_.rings_offset;
    hdr->ring_bytes = seg->geometry_.ring_bytes;
    hdr->entry_bytes = seg->geometry_.entry_bytes;
    hdr->arena_offset = seg->geometry_.arena_offset;
    hdr->region_bytes = seg->geometry_.region_bytes;
    hdr->slots_per_rank = params.slots_per_rank;
    hdr->window_offset = seg->geometry_.window_offset;
    hdr->window_bytes = seg->geometry_.window_bytes;
    hdr->creator_pid = me.pid;
    hdr->creator_rank = rank;
    hdr->creator_start_time = me.start_time;
    hdr->incarnation = seg->incarnation_ = random_id();
    if (creator_died && record->rank < params.world_size && record->rank != rank) {
      // The rank that died creating the previous file is a member that died: the others' rendezvous
      // sees it dead and fails at once (PeerLostError). A restarted process for that rank starts a
      // new incarnation, as after any death.
      RankSlot& dead = seg->rank_slot(record->rank);
      dead.pid = record->pid;
      dead.start_time = record->start_time;
      dead.pid_ns = record->pid_ns;
      dead.state.store(kRankLive, std::memory_order_release);
    }
    hdr->layout_version.store(kLayoutVersion, std::memory_order_release);  // pairs with read_header
    break;
  }
  if (seg->base_ == nullptr) throw SegmentError("cannot attach segment '" + params.name + "': it keeps changing");

  RankSlot& slot = seg->rank_slot(rank);
  slot.pid = me.pid;
  slot.start_time = me.start_time;
  slot.pid_ns = me.pid_ns;
  // The JoinRecord goes before the slot is claimed, not after: a process killed between the two
  // left a dead joiner for its rank behind, and the next incarnation's rendezvous failed at once
  // with "rank N died while joining" (ShmSegmentProcs.StaleSegmentOfWaitingRankIsReplaced, under
  // load). Killed in the instant between clear and claim, it is neither: the others wait for it
  // up to their timeout.
  lock.clear_join(rank);
  slot.state.store(kRankLive, std::memory_order_release);  // pairs with the acquire loads of state
  if (auto r = lock.record(); r && r->creating != 0) {
    try {
      lock.write_record({CreatorRecord::kMagic, r->pid, r->rank, r->start_time, 0, r->pid_ns});  // creation complete
    } catch (const SegmentError& e) {
      detail::log().warn("{}", e.what());  // the next attacher still sees a live, valid incarnation
    }
  }
  detail::log().debug("rank {} attached to segment '{}', incarnation {}", rank, params.name, hex(seg->incarnation_));
  return seg;
}

Segment::~Segment() {
  leave();
  if (base_ != nullptr) {
    BusGuard::remove(guard_);
    ::munmap(base_, mapped_bytes_);
  }
  if (fd_ >= 0) ::close(fd_);
}

bool Segment::poisoned() const noexcept {
  return truncated_.load(std::memory_order_acquire) || BusGuard::poisoned(guard_);
}

void Segment::leave(bool abandoned) noexcept {
  if (left_ || base_ == nullptr) return;
  left_ = true;
  check_file();
  const uint32_t state = abandoned ? kRankAbandoned : kRankLeft;
  try {
    LockFile lock(params_.name, std::chrono::steady_clock::now() + std::chrono::seconds(2));
    store_state(state);
    bool anyone = false;
    for (uint32_t r = 0; r < params_.world_size && !anyone; ++r) anyone = rank_alive(r);
    if (!anyone) {
      // Remove the name only while it still refers to this incarnation; then the lock file, when
      // no segment is left under the name.
      const std::string path = segment_path(params_.name);
      struct stat st {};
      if (::lstat(path.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) ::unlink(path.c_str());
      if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) lock.remove_file();
      detail::log().debug("last rank left segment '{}', incarnation {}", params_.name, hex(incarnation_));
    }
  } catch (const std::exception& e) {
    store_state(state);
    try {
      detail::log().warn("leaving segment '{}': {}", params_.name, e.what());
    } catch (...) {
    }
  }
}

bool Segment::rank_alive(uint32_t r) const {
  const SlotView v = read_slot(r);
  if (v.state != kRankLive) return false;
  return alive_or_self(v.process());
}

bool Segment::all_arrived() const {
  for (uint32_t r = 0; r < params_.world_size; ++r) {
    const uint32_t state = rank_slot(r).state.load(std::memory_order_acquire);
    if (state != kRankLive && state != kRankLeft) return false;
  }
  return true;
}

std::optional<Segment::DeadJoiner> Segment::dead_joiner() const {
  const std::string path = lock_path(params_.name);
  Fd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0 || st.st_uid != ::geteuid()) return std::nullopt;
  const uint32_t me = self_process().pid;
  for (uint32_t r = 0; r < params_.world_size; ++r) {
    if (rank_slot(r).state.load(std::memory_order_acquire) != kRankFree) continue;
    JoinRecord rec;
    if (::pread(fd.get(), &rec, sizeof rec, join_record_offset(r)) != static_cast<ssize_t>(sizeof rec) ||
        rec.magic != JoinRecord::kMagic || rec.rank != r || rec.pid == me) {
      continue;
    }
    if (!process_alive({rec.pid, rec.start_time, rec.pid_ns})) return DeadJoiner{r, rec.pid};
  }
  return std::nullopt;
}

std::optional<Segment::ForeignRank> Segment::foreign_rank() const {
  for (uint32_t r = 0; r < params_.world_size; ++r) {
    const SlotView v = read_slot(r);
    if (v.state != kRankFree && foreign_pid_namespace(v.process())) return ForeignRank{r, v.process()};
  }
  return std::nullopt;
}

int Segment::first_abandoned() const {
  for (uint32_t r = 0; r < params_.world_size; ++r) {
    if (rank_slot(r).state.load(std::memory_order_acquire) == kRankAbandoned) return static_cast<int>(r);
  }
  return -1;
}

std::string Segment::describe_rank(uint32_t r) const {
  return "rank " + std::to_string(r) + " (pid " + std::to_string(read_slot(r).pid) + ")";
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
    const Inspection existing(fd.get(), static_cast<uint64_t>(st.st_size));
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
