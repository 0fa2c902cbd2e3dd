// Segment creation, attach, validation and leave.
//
// All of attach and leave runs under an exclusive flock on /dev/shm/tdshm.<name>.lock, so that
// "is it stale? then replace it" and "am I the last? then remove it" are atomic with respect to
// other processes; the kernel drops the lock of a process that dies, so a crash never wedges it.

#include "shm/segment.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "common/log.h"

#include <boost/interprocess/shared_memory_object.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
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
  return shm::segment_geometry(static_cast<uint32_t>(world_size), options.slot_bytes, options.ring_entries)
      .segment_bytes;
}

bool remove_stale_segment(const std::string& name) { return shm::remove_segment_if_stale(name); }

namespace shm {

namespace bip = boost::interprocess;

namespace {

constexpr uint32_t kMaxWorld = 4096;
constexpr uint32_t kMaxRingEntries = 1u << 20;
constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 30;
const char* const kShmDir = "/dev/shm";

std::string shm_object_name(const std::string& name) { return "tdshm." + name; }
std::string lock_path(const std::string& name) { return std::string(kShmDir) + "/tdshm." + name + ".lock"; }

uint64_t read_start_time(uint32_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return 0;
  // Field 2 (comm) may hold spaces and parentheses: fields resume after the last ')'.
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && (rest >> field); ++i) {
    if (i == 22) return std::stoull(field);
  }
  return 0;
}

// The exclusive lock that serialises attach and leave for one name.
class LockFile {
 public:
  LockFile(const std::string& name, std::chrono::steady_clock::time_point deadline) : path_(lock_path(name)) {
    for (;;) {
      fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      if (fd_ < 0) {
        throw SegmentError("cannot open the lock file '" + path_ + "': " + std::strerror(errno) +
                           " (is /dev/shm mounted and writable?)");
      }
      while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) {
          const int err = errno;
          ::close(fd_);
          throw SegmentError("cannot lock '" + path_ + "': " + std::strerror(err));
        }
        if (std::chrono::steady_clock::now() > deadline) {
          ::close(fd_);
          throw SegmentError("timed out waiting for the lock '" + path_ + "' held by another process");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      // The last leaver may have removed the file while we waited: then our lock is on a
      // deleted inode and means nothing; take the lock again on the current file.
      struct stat held {}, current {};
      if (::fstat(fd_, &held) == 0 && ::stat(path_.c_str(), &current) == 0 && held.st_ino == current.st_ino &&
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

 private:
  std::string path_;
  int fd_ = -1;
};

bool remove_object(const std::string& name) noexcept {
  try {
    return bip::shared_memory_object::remove(shm_object_name(name).c_str());
  } catch (...) {
    return false;
  }
}

// What an existing segment's header says, checked against its real size. Throws SegmentError
// for anything inconsistent; returns false when the creator died before publishing the version.
bool validate_header(const SegmentHeader& h, uint64_t file_bytes, const std::string& name) {
  auto corrupt = [&](const std::string& what) {
    return SegmentError("segment '" + name + "' is corrupted or not a tdshm segment: " + what +
                        "; if no process uses it, remove it with tdshm::remove_stale_segment or delete " +
                        std::string(kShmDir) + "/tdshm." + name);
  };
  if (h.magic != kSegmentMagic) throw corrupt("bad magic");
  const uint32_t version = h.layout_version.load(std::memory_order_acquire);  // pairs with the creator's release
  if (version == 0) return false;
  if (version != kLayoutVersion) {
    throw SegmentError("segment '" + name + "' has layout version " + std::to_string(version) +
                       " but this tdshm uses version " + std::to_string(kLayoutVersion) +
                       ": all ranks must run the same tdshm build");
  }
  if (h.header_bytes != sizeof(SegmentHeader)) throw corrupt("header size " + std::to_string(h.header_bytes));
  if (h.world_size < 1 || h.world_size > kMaxWorld) throw corrupt("world size " + std::to_string(h.world_size));
  if (h.ring_entries < 1 || h.ring_entries > kMaxRingEntries) {
    throw corrupt("ring entries " + std::to_string(h.ring_entries));
  }
  if (h.slot_bytes < 1 || h.slot_bytes > kMaxSlotBytes) throw corrupt("slot bytes " + std::to_string(h.slot_bytes));
  // With the bounds above the geometry cannot overflow 64 bits (2^12 * 2^12 * 2^20 * 2^31).
  const SegmentGeometry g = segment_geometry(h.world_size, h.slot_bytes, h.ring_entries);
  if (h.entry_bytes != g.entry_bytes || h.ring_bytes != g.ring_bytes || h.rank_table_offset != g.rank_table_offset ||
      h.rings_offset != g.rings_offset || h.segment_bytes != g.segment_bytes) {
    throw corrupt("offsets and sizes do not agree with world size, slot bytes and ring entries");
  }
  if (h.segment_bytes != file_bytes) {
    throw corrupt("header says " + std::to_string(h.segment_bytes) + " bytes, the object has " +
                  std::to_string(file_bytes));
  }
  return true;
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
                       ") or make ShmOptions::slot_bytes / ring_entries smaller");
  }
}

}  // namespace

ProcessId self_process() {
  static const ProcessId id{static_cast<uint32_t>(::getpid()), read_start_time(static_cast<uint32_t>(::getpid()))};
  // A forked child has another pid: recompute then.
  if (id.pid != static_cast<uint32_t>(::getpid())) {
    return {static_cast<uint32_t>(::getpid()), read_start_time(static_cast<uint32_t>(::getpid()))};
  }
  return id;
}

bool process_alive(const ProcessId& id) {
  if (id.pid == 0) return false;
  if (::kill(static_cast<pid_t>(id.pid), 0) != 0 && errno == ESRCH) return false;
  const uint64_t start = read_start_time(id.pid);
  if (start == 0) return false;  // gone between the two checks, or a zombie being reaped
  return start == id.start_time;
}

Segment::Segment(SegmentParams params, uint32_t rank) : params_(std::move(params)), rank_(rank) {}

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

  std::unique_ptr<Segment> seg(new Segment(params, rank));
  seg->geometry_ = segment_geometry(params.world_size, params.slot_bytes, params.ring_entries);
  const std::string object = shm_object_name(params.name);
  const ProcessId me = self_process();

  LockFile lock(params.name, deadline);
  bool created = false;
  for (int attempt = 0; attempt < 2 && seg->base_ == nullptr; ++attempt) {
    try {
      bip::shared_memory_object shm(bip::open_only, object.c_str(), bip::read_write);
      bip::offset_t size = 0;
      shm.get_size(size);
      if (static_cast<uint64_t>(size) < sizeof(SegmentHeader)) {
        throw SegmentError("segment '" + params.name + "' is corrupted: only " + std::to_string(size) +
                           " bytes; remove it with tdshm::remove_stale_segment");
      }
      bip::mapped_region region(shm, bip::read_write);
      auto* h = static_cast<SegmentHeader*>(region.get_address());
      const bool ready = validate_header(*h, static_cast<uint64_t>(size), params.name);
      bool live = false;
      if (ready) {
        for (uint32_t r = 0; r < h->world_size && !live; ++r) {
          const auto* slot = reinterpret_cast<const RankSlot*>(static_cast<uint8_t*>(region.get_address()) +
                                                               h->rank_table_offset + uint64_t{r} * sizeof(RankSlot));
          const uint32_t state = slot->state.load(std::memory_order_acquire);
          live = (state == kRankLive || state == kRankClaiming) && process_alive({slot->pid, slot->start_time});
        }
      }
      if (!live) {
        detail::log().info("segment '{}' is stale (no live rank); replacing it", params.name);
        remove_object(params.name);
        continue;  // create below
      }
      if (h->world_size != params.world_size || h->slot_bytes != params.slot_bytes ||
          h->ring_entries != params.ring_entries) {
        throw SegmentError("segment '" + params.name + "' is in use with world size " + std::to_string(h->world_size) +
                           ", slot_bytes " + std::to_string(h->slot_bytes) + ", ring_entries " +
                           std::to_string(h->ring_entries) + "; this rank asked for world size " +
                           std::to_string(params.world_size) + ", slot_bytes " + std::to_string(params.slot_bytes) +
                           ", ring_entries " + std::to_string(params.ring_entries));
      }
      seg->region_ = std::move(region);
      seg->base_ = static_cast<uint8_t*>(seg->region_.get_address());
    } catch (const bip::interprocess_exception& e) {
      if (e.get_error_code() != bip::not_found_error) {
        throw SegmentError("cannot open segment '" + params.name + "': " + e.what());
      }
    }
    if (seg->base_ != nullptr) break;

    // Create it.
    const uint64_t bytes = seg->geometry_.segment_bytes;
    check_capacity(bytes, params.name);
    try {
      bip::permissions perm;
      perm.set_permissions(0600);
      bip::shared_memory_object shm(bip::create_only, object.c_str(), bip::read_write, perm);
      shm.truncate(static_cast<bip::offset_t>(bytes));
      // Reserve every page now: a full /dev/shm is an error here, never a SIGBUS later.
      const int err = ::posix_fallocate(shm.get_mapping_handle().handle, 0, static_cast<off_t>(bytes));
      if (err != 0) {
        remove_object(params.name);
        throw SegmentError("cannot reserve " + std::to_string(bytes) + " bytes for segment '" + params.name +
                           "' in " + kShmDir + ": " + std::strerror(err) +
                           "; enlarge /dev/shm or make ShmOptions::slot_bytes / ring_entries smaller");
      }
      bip::mapped_region region(shm, bip::read_write);
      auto* h = new (region.get_address()) SegmentHeader{};  // the pages are zero; this sets the fields
      h->magic = kSegmentMagic;
      h->header_bytes = sizeof(SegmentHeader);
      h->segment_bytes = bytes;
      h->world_size = params.world_size;
      h->ring_entries = params.ring_entries;
      h->slot_bytes = params.slot_bytes;
      h->rank_table_offset = seg->geometry_.rank_table_offset;
      h->rings_offset = seg->geometry_.rings_offset;
      h->ring_bytes = seg->geometry_.ring_bytes;
      h->entry_bytes = seg->geometry_.entry_bytes;
      h->creator_pid = me.pid;
      h->creator_start_time = me.start_time;
      h->layout_version.store(kLayoutVersion, std::memory_order_release);  // pairs with validate_header
      seg->region_ = std::move(region);
      seg->base_ = static_cast<uint8_t*>(seg->region_.get_address());
      created = true;
    } catch (const bip::interprocess_exception& e) {
      remove_object(params.name);
      throw SegmentError("cannot create segment '" + params.name + "' (" + std::to_string(bytes) + " bytes): " + e.what());
    }
  }
  if (seg->base_ == nullptr) throw SegmentError("cannot attach segment '" + params.name + "'");

  RankSlot& slot = seg->rank_slot(rank);
  const uint32_t state = slot.state.load(std::memory_order_acquire);
  if ((state == kRankLive || state == kRankClaiming) && process_alive({slot.pid, slot.start_time})) {
    seg->base_ = nullptr;  // not ours: do not mark it left
    throw SegmentError("rank " + std::to_string(rank) + " of segment '" + params.name +
                       "' is already taken by the live process " + std::to_string(slot.pid));
  }
  slot.state.store(kRankClaiming, std::memory_order_relaxed);
  slot.pid = me.pid;
  slot.start_time = me.start_time;
  if (!created) {
    for (uint32_t peer = 0; peer < params.world_size; ++peer) seg->reset_rings_with(peer);
  }
  slot.state.store(kRankLive, std::memory_order_release);  // pairs with rank_alive / all_live
  seg->header().attached.fetch_add(1, std::memory_order_acq_rel);
  detail::log().debug("rank {} attached to segment '{}' ({})", rank, params.name, created ? "created" : "existing");
  return seg;
}

Segment::~Segment() { leave(); }

void Segment::leave() noexcept {
  if (left_ || base_ == nullptr) return;
  left_ = true;
  try {
    LockFile lock(params_.name, std::chrono::steady_clock::now() + std::chrono::seconds(2));
    rank_slot(rank_).state.store(kRankLeft, std::memory_order_release);
    header().attached.fetch_sub(1, std::memory_order_acq_rel);
    bool anyone = false;
    for (uint32_t r = 0; r < params_.world_size && !anyone; ++r) anyone = rank_alive(r);
    if (!anyone) {
      remove_object(params_.name);
      lock.remove_file();
      detail::log().debug("last rank left segment '{}': removed", params_.name);
    }
  } catch (const std::exception& e) {
    rank_slot(rank_).state.store(kRankLeft, std::memory_order_release);
    try {
      detail::log().warn("leaving segment '{}': {}", params_.name, e.what());
    } catch (...) {
    }
  }
}

bool Segment::rank_alive(uint32_t r) const {
  const RankSlot& slot = rank_slot(r);
  const uint32_t state = slot.state.load(std::memory_order_acquire);  // pairs with the claim's release
  if (state != kRankLive && state != kRankClaiming) return false;
  if (slot.pid == self_process().pid) return true;  // threads-as-ranks of this process
  return process_alive({slot.pid, slot.start_time});
}

bool Segment::all_live() const {
  for (uint32_t r = 0; r < params_.world_size; ++r) {
    if (rank_slot(r).state.load(std::memory_order_acquire) != kRankLive) return false;
  }
  return true;
}

std::string Segment::describe_rank(uint32_t r) const {
  return "rank " + std::to_string(r) + " (pid " + std::to_string(rank_slot(r).pid) + ")";
}

void Segment::reset_rings_with(uint32_t peer) noexcept {
  for (auto [src, dst] : {std::pair{rank_, peer}, std::pair{peer, rank_}}) {
    RingControl& ring = this->ring(src, dst);
    ring.head.store(0, std::memory_order_relaxed);
    ring.tail.store(0, std::memory_order_relaxed);
    for (uint64_t i = 0; i < params_.ring_entries; ++i) entry(src, dst, i).seq.store(0, std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_release);
}

bool remove_segment_if_stale(const std::string& name) {
  validate_segment_name(name);
  LockFile lock(name, std::chrono::steady_clock::now() + std::chrono::seconds(5));
  try {
    bip::shared_memory_object shm(bip::open_only, shm_object_name(name).c_str(), bip::read_write);
    bip::offset_t size = 0;
    shm.get_size(size);
    if (static_cast<uint64_t>(size) >= sizeof(SegmentHeader)) {
      bip::mapped_region region(shm, bip::read_write);
      const auto* h = static_cast<const SegmentHeader*>(region.get_address());
      bool valid = false;
      try {
        valid = validate_header(*h, static_cast<uint64_t>(size), name);
      } catch (const SegmentError&) {
        valid = false;  // unusable by anyone: removable
      }
      for (uint32_t r = 0; valid && r < h->world_size; ++r) {
        const auto* slot = reinterpret_cast<const RankSlot*>(static_cast<const uint8_t*>(region.get_address()) +
                                                             h->rank_table_offset + uint64_t{r} * sizeof(RankSlot));
        const uint32_t state = slot->state.load(std::memory_order_acquire);
        if ((state == kRankLive || state == kRankClaiming) && process_alive({slot->pid, slot->start_time})) {
          throw SegmentError("segment '" + name + "' is in use: rank " + std::to_string(r) + " (pid " +
                             std::to_string(slot->pid) + ") is alive");
        }
      }
    }
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::not_found_error) {
      lock.remove_file();
      return false;
    }
    throw SegmentError("cannot open segment '" + name + "': " + e.what());
  }
  const bool removed = remove_object(name);
  lock.remove_file();
  return removed;
}

}  // namespace shm
}  // namespace tdshm
