// The mapped segment of one incarnation: its file and mapping, the rank slots (read even when
// the mapping is lost), leave, and what the rendezvous asks about the peers.

#include "shm/segment/segment.h"

#include "common/fd.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "common/log.h"
#include "shm/parts/bus_guard.h"
#include "shm/parts/trust.h"
#include "shm/segment/lock_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>

namespace tdshm {

size_t shm_segment_bytes(int world_size, const ShmOptions& options) {
  return shm::segment_geometry(static_cast<uint32_t>(world_size), options.slot_bytes, options.ring_entries,
                               options.slots_per_rank, options.window_bytes, options.loan_tickets, options.loan_bytes)
      .segment_bytes;
}

namespace shm {

using detail::Fd;

std::string hex_id(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

Segment::Segment(SegmentParams params, uint32_t rank) : params_(std::move(params)), rank_(rank) {}

void Segment::map(int fd, uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw SegmentError("cannot map segment '" + params_.name + "' (" + std::to_string(bytes) +
                       " bytes): " + std::strerror(errno));
  }
  mapping_ = std::make_shared<const Mapping>(static_cast<uint8_t*>(p), bytes);
  base_ = mapping_->base;
  mapped_bytes_ = bytes;
  bus_poisoned_ = BusGuard::flag(mapping_->guard);
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

Mapping::Mapping(uint8_t* b, uint64_t n) noexcept : base(b), bytes(n), guard(BusGuard::add(b, n)) {}

Mapping::~Mapping() {
  BusGuard::remove(guard);
  ::munmap(base, bytes);
}

Segment::~Segment() {
  leave();
  mapping_.reset();  // unmapped here unless a loan or a view still points into it
  if (fd_ >= 0) ::close(fd_);
}

void Segment::leave(bool abandoned) noexcept { (void)leave_unless(abandoned, /*all_arrived_first=*/false); }

bool Segment::abandon_unless_all_arrived() noexcept { return leave_unless(true, /*all_arrived_first=*/true); }

bool Segment::leave_unless(bool abandoned, bool all_arrived_first) noexcept {
  if (left_ || base_ == nullptr) return true;
  check_file();
  const uint32_t state = abandoned ? kRankAbandoned : kRankLeft;
  try {
    LockFile lock(params_.name, std::chrono::steady_clock::now() + std::chrono::seconds(2));
    if (all_arrived_first && all_arrived()) return false;
    left_ = true;
    store_state(state);
    bool anyone = false;
    for (uint32_t r = 0; r < params_.world_size && !anyone; ++r) anyone = rank_alive(r);
    if (!anyone) {
      remove_name(lock);
      detail::log().debug("last rank left segment '{}', incarnation {}", params_.name, hex_id(incarnation_));
    }
  } catch (const std::exception& e) {
    left_ = true;
    store_state(state);
    try {
      detail::log().warn("leaving segment '{}': {}", params_.name, e.what());
    } catch (...) {
    }
  }
  return true;
}

// Under `lock`: removes the name only while it still refers to this incarnation; then the lock
// file, when no segment is left under the name.
void Segment::remove_name(LockFile& lock) const noexcept {
  const std::string path = segment_path(params_.name);
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) ::unlink(path.c_str());
  if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) lock.remove_file();
}

void Segment::unlink_name() noexcept {
  if (base_ == nullptr) return;
  try {
    LockFile lock(params_.name, std::chrono::steady_clock::now() + std::chrono::seconds(2));
    remove_name(lock);
  } catch (const std::exception& e) {
    try {
      detail::log().debug("unlinking segment '{}': {}", params_.name, e.what());
    } catch (...) {
    }
  }
}

bool Segment::rank_alive(uint32_t r) const {
  const SlotView v = read_slot(r);
  if (v.state != kRankLive) return false;
  return alive_or_self(v.process());
}

bool Segment::rank_process_alive(uint32_t r) const {
  const SlotView v = read_slot(r);
  return v.state != kRankFree && alive_or_self(v.process());
}

bool Segment::rank_died(uint32_t r) const {
  const SlotView v = read_slot(r);
  return v.state == kRankLive && !alive_or_self(v.process());
}

uint32_t Segment::rank_features(uint32_t r) const noexcept {
  const RankSlot& slot = rank_slot(r);
  const uint32_t state = slot.state.load(std::memory_order_acquire);  // pairs with the claim's release
  return state == kRankLive || state == kRankLeft ? slot.features : 0;
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

}  // namespace shm
}  // namespace tdshm
