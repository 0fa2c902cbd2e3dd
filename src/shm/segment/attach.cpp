// Segment::attach: under the lock file, join the current incarnation of a name, or replace it,
// or create a new one, and claim this rank's slot in it.
//
// Recovery model. Everything that creates, replaces, joins or removes a segment runs under an
// exclusive flock on the lock file; the kernel drops the lock of a process that dies, so a crash
// never wedges the name. Under the lock:
//  * a creator first writes a record {pid, start time, rank, creating = 1} into the lock file,
//    creates the file (O_EXCL), reserves its pages, writes the header, publishes the layout
//    version (release) and claims its slot, then clears `creating`. Whoever takes the lock next
//    and finds `creating` set knows that the creator died mid-way: the file (missing, short,
//    zero, or half-written) is replaced. If the creator still ran when this rank arrived (it
//    waited for the lock behind the creation: the two were to form one group), the dead
//    creator's rank is recorded in the new incarnation as a member that died, so that the
//    rendezvous of this rank and of the others waiting with it fails with PeerLostError at once
//    instead of waiting for their timeout. If the creator was already dead when this rank arrived
//    (a restarted job starts after its processes died), it was never grouped with this rank: its
//    creation is stale, replaced like any stale segment, and its rank is left free for the
//    process that takes it in the new group;
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

#include "shm/segment/segment.h"

#include "common/fd.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "common/log.h"
#include "shm/layout/validate.h"
#include "shm/parts/trust.h"
#include "shm/segment/capacity.h"
#include "shm/segment/liveness.h"
#include "shm/segment/lock_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <optional>
#include <thread>

namespace tdshm::shm {

namespace {

void check_params(const SegmentParams& params, uint32_t rank) {
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
  if (params.loan_tickets < 1 || params.loan_tickets > kMaxLoanTickets) {
    throw SegmentError("loan_tickets " + std::to_string(params.loan_tickets) + " must be in [1, 2^16]");
  }
  if (params.loan_bytes > kMaxLoanBytes) {
    throw SegmentError("loan_bytes " + std::to_string(params.loan_bytes) + " must be at most 2^36");
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

/// The error for an incarnation in use whose parameters differ from `p`'s.
SegmentError mismatch_error(const SegmentParams& p, const HeaderFields& h) {
  return SegmentError(
      "segment '" + p.name + "' is in use with world size " + std::to_string(h.world_size) + ", slot_bytes " +
      std::to_string(h.slot_bytes) + ", ring_entries " + std::to_string(h.ring_entries) + ", slots_per_rank " +
      std::to_string(h.slots_per_rank) + ", window_bytes " + std::to_string(h.window_bytes) + ", loan_tickets " +
      std::to_string(h.loan_tickets) + ", loan_bytes " + std::to_string(h.loan_bytes) +
      "; this rank asked for world size " + std::to_string(p.world_size) + ", slot_bytes " +
      std::to_string(p.slot_bytes) + ", ring_entries " + std::to_string(p.ring_entries) + ", slots_per_rank " +
      std::to_string(p.slots_per_rank) + ", window_bytes " + std::to_string(p.window_bytes) + ", loan_tickets " +
      std::to_string(p.loan_tickets) + ", loan_bytes " + std::to_string(round_up(p.loan_bytes, kLoanPage)));
}

bool same_params(const SegmentParams& p, const HeaderFields& h) {
  return h.world_size == p.world_size && h.slot_bytes == p.slot_bytes && h.ring_entries == p.ring_entries &&
         h.slots_per_rank == p.slots_per_rank && h.window_bytes == p.window_bytes && h.loan_tickets == p.loan_tickets &&
         h.loan_bytes == round_up(p.loan_bytes, kLoanPage);
}

}  // namespace

/// One attach, under the lock file of the name: find the current incarnation and join it or
/// replace it, or create a new one, then claim this rank's slot (the recovery model above).
class Attacher {
 public:
  Attacher(const SegmentParams& params, uint32_t rank, std::chrono::steady_clock::time_point deadline);
  Attacher(const Attacher&) = delete;
  Attacher& operator=(const Attacher&) = delete;
  /// This rank's JoinRecord goes right before it claims its slot (claim()), or when attach throws.
  ~Attacher() { lock_.clear_join(rank_); }

  std::unique_ptr<Segment> run();

 private:
  /// Reads the creator record; decides whether its creation was interrupted, and whether by a
  /// creator that died while this rank waited for it (to be recorded as a member that died).
  void read_creator_record();
  /// Joins the existing file `fd` (true), or unlinks it to be replaced (false); throws when it
  /// must be left alone.
  bool join_or_replace(int fd, uint64_t file_bytes);
  /// Why the existing file is to be replaced, "" to join it; throws when it must be left alone.
  std::string why_replace(const ExistingSegment& existing) const;
  /// The same for a valid incarnation of these parameters, from this rank's slot in it.
  std::string why_replace_slot(const ExistingSegment& existing) const;
  /// Creates and maps a new incarnation (true), or finds the name taken meanwhile (false).
  bool create();
  /// Reserves the pages of the new file `fd` and maps it; undoes the creation when it cannot.
  void reserve_and_map(int fd, uint64_t bytes);
  /// Fills in the header of the new mapping and publishes it.
  void write_header(uint64_t bytes);
  /// Claims this rank's slot and completes the creation record.
  void claim();
  /// The Segment, with its geometry, before anything is locked or mapped.
  static std::unique_ptr<Segment> new_segment(const SegmentParams& params, uint32_t rank);
  CreatorRecord my_record(uint32_t creating) const {
    return {CreatorRecord::kMagic, me_.pid, rank_, me_.start_time, creating, me_.pid_ns};
  }

  const SegmentParams& params_;
  const uint32_t rank_;
  const std::string path_;
  const ProcessId me_;
  std::unique_ptr<Segment> seg_;
  LockFile lock_;
  std::optional<CreatorRecord> record_;
  bool interrupted_ = false;
  bool creator_died_ = false;  // while this rank waited for it: a member that died
};

Attacher::Attacher(const SegmentParams& params, uint32_t rank, std::chrono::steady_clock::time_point deadline)
    : params_(params),
      rank_(rank),
      path_(segment_path(params.name)),
      me_(self_process()),
      seg_(new_segment(params, rank)),
      lock_(params.name, deadline, rank) {
  read_creator_record();
}

std::unique_ptr<Segment> Attacher::new_segment(const SegmentParams& params, uint32_t rank) {
  std::unique_ptr<Segment> seg(new Segment(params, rank));
  seg->geometry_ = segment_geometry(params.world_size, params.slot_bytes, params.ring_entries, params.slots_per_rank,
                                    params.window_bytes, params.loan_tickets, params.loan_bytes);
  return seg;
}

void Attacher::read_creator_record() {
  record_ = lock_.record();
  // `creating` still set while we hold the lock: that creation was interrupted (see the recovery
  // model), whatever /proc says. Its creator is normally dead, but the kernel drops a killed
  // process's flock before /proc shows it as exited, so give it a moment to finish dying (up to
  // a second: with 200 ms, a waiting peer in a loaded test run once waited out its whole timeout
  // instead of failing at once); one that truly lives (it threw mid-way) is not recorded as a
  // dead member.
  interrupted_ = record_ && record_->creating != 0;
  // A creator already dead when this rank arrived is stale, not a member (the recovery model).
  if (!interrupted_ || lock_.dead_on_arrival(*record_)) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (creator_alive(record_) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  creator_died_ = !creator_alive(record_);
}

std::unique_ptr<Segment> Attacher::run() {
  for (int attempt = 0; attempt < 4 && seg_->base_ == nullptr; ++attempt) {
    struct stat st {};
    detail::Fd fd(open_segment(params_.name, st));
    if (fd ? join_or_replace(fd.get(), static_cast<uint64_t>(st.st_size)) : create()) break;
  }
  if (seg_->base_ == nullptr) throw SegmentError("cannot attach segment '" + params_.name + "': it keeps changing");
  claim();
  detail::log().debug("rank {} attached to segment '{}', incarnation {}", rank_, params_.name,
                      hex_id(seg_->incarnation_));
  return std::move(seg_);
}

bool Attacher::join_or_replace(int fd, uint64_t file_bytes) {
  const ExistingSegment existing(fd, file_bytes);
  const std::string why = why_replace(existing);
  if (why.empty()) {
    seg_->map(fd, file_bytes);  // join this incarnation
    seg_->incarnation_ = existing.header().incarnation;
    return true;
  }
  detail::log().debug("segment '{}': replacing it ({})", params_.name, why);
  if (::unlink(path_.c_str()) != 0 && errno != ENOENT) {
    throw SegmentError("cannot replace segment '" + params_.name + "': unlink " + path_ + ": " + std::strerror(errno));
  }
  return false;
}

std::string Attacher::why_replace(const ExistingSegment& existing) const {
  const HeaderVerdict verdict = existing.check().verdict;
  if (verdict == HeaderVerdict::kOtherVersion) {
    throw SegmentError("segment '" + params_.name + "' has " + existing.check().problem +
                       ": all ranks must run the same tdshm build (if no process uses it, remove it with "
                       "tdshm::remove_stale_segment)");
  }
  if (interrupted_ && !(verdict == HeaderVerdict::kValid && existing.live_rank() >= 0)) {
    // (A valid incarnation in use was published: only its record's clearing failed.)
    return "its creator (pid " + std::to_string(record_->pid) + ") was interrupted while creating it" +
           (lock_.dead_on_arrival(*record_) ? "; it was gone before this rank came: stale" : "");
  }
  if (existing.table_readable()) {
    const int live = existing.live_rank();
    if (live < 0) return "stale: no live rank";
    if (verdict == HeaderVerdict::kTruncated) {
      throw SegmentError("segment '" + params_.name + "' was truncated: " + existing.check().problem + "; rank " +
                         std::to_string(live) + " still uses it, so it is left alone");
    }
    if (!same_params(params_, existing.header())) throw mismatch_error(params_, existing.header());
    return why_replace_slot(existing);
  }
  if (creator_alive(record_)) {
    throw SegmentError("segment '" + params_.name +
                       "' is corrupted or not a tdshm segment: " + existing.check().problem +
                       "; the rank that created it still runs, so it is left alone: if no process uses it, remove "
                       "it with tdshm::remove_stale_segment or delete " +
                       path_);
  }
  return "unusable (" + existing.check().problem + ") and its creator is gone";
}

std::string Attacher::why_replace_slot(const ExistingSegment& existing) const {
  const RankSlot& mine = existing.slot(rank_);
  if (mine.state.load(std::memory_order_acquire) == kRankFree) return "";
  if (slot_alive(mine)) {
    throw SegmentError("rank " + std::to_string(rank_) + " of segment '" + params_.name +
                       "' is already taken by the live process " + std::to_string(mine.pid));
  }
  return "rank " + std::to_string(rank_) + " was already a member of incarnation " +
         hex_id(existing.header().incarnation) + ": a new incarnation starts";
}

bool Attacher::create() {
  const uint64_t bytes = seg_->geometry_.segment_bytes;
  try {
    check_capacity(bytes, params_.name);
  } catch (...) {
    if (!record_) lock_.remove_file();  // no segment of this name exists: leave no lock file behind either
    throw;
  }
  lock_.write_record(my_record(1));
  const int raw = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (raw < 0) {
    const int err = errno;
    lock_.write_record(my_record(0));
    if (err == EEXIST) return false;  // someone (not tdshm: we hold the lock) created it: look at it again
    throw open_error(path_, "segment", err);
  }
  detail::Fd created(raw);
  reserve_and_map(raw, bytes);
  write_header(bytes);
  return true;
}

void Attacher::reserve_and_map(int fd, uint64_t bytes) {
  auto undo = [&] {
    ::unlink(path_.c_str());
    lock_.write_record(my_record(0));
  };
  // Reserve every page now: a full /dev/shm is an error here, never a SIGBUS later.
  int err = ::fchmod(fd, 0600) != 0 ? errno : 0;
  if (err == 0) err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));  // returns the error
  if (err != 0) {
    undo();
    throw SegmentError("cannot reserve " + std::to_string(bytes) + " bytes for segment '" + params_.name + "' in " +
                       kSegmentDir + ": " + std::strerror(err) +
                       "; enlarge /dev/shm or make ShmOptions::slot_bytes / slots_per_rank / ring_entries smaller" +
                       (err == ENOSPC ? stale_segments_hint(params_.name) : std::string()));
  }
  try {
    seg_->map(fd, bytes);
  } catch (...) {
    undo();
    throw;
  }
}

void Attacher::write_header(uint64_t bytes) {
  const SegmentGeometry& g = seg_->geometry_;
  auto* hdr = new (seg_->base_) SegmentHeader{};  // the pages are zero; this sets the fields
  hdr->magic = kSegmentMagic;
  hdr->header_bytes = sizeof(SegmentHeader);
  hdr->segment_bytes = bytes;
  hdr->world_size = params_.world_size;
  hdr->ring_entries = params_.ring_entries;
  hdr->slot_bytes = params_.slot_bytes;
  hdr->rank_table_offset = g.rank_table_offset;
  hdr->rings_offset = g.rings_offset;
  hdr->ring_bytes = g.ring_bytes;
  hdr->entry_bytes = g.entry_bytes;
  hdr->arena_offset = g.arena_offset;
  hdr->region_bytes = g.region_bytes;
  hdr->slots_per_rank = params_.slots_per_rank;
  hdr->window_offset = g.window_offset;
  hdr->window_bytes = g.window_bytes;
  hdr->loan_offset = g.loan_offset;
  hdr->loan_region_bytes = g.loan_region_bytes;
  hdr->loan_bytes = g.loan_bytes;
  hdr->loan_tickets = params_.loan_tickets;
  hdr->creator_pid = me_.pid;
  hdr->creator_rank = rank_;
  hdr->creator_start_time = me_.start_time;
  hdr->incarnation = seg_->incarnation_ = random_id();
  if (creator_died_ && record_->rank < params_.world_size && record_->rank != rank_) {
    // The rank that died creating the previous file is a member that died: the others' rendezvous
    // sees it dead and fails at once (PeerLostError). A restarted process for that rank starts a
    // new incarnation, as after any death.
    RankSlot& dead = seg_->rank_slot(record_->rank);
    dead.pid = record_->pid;
    dead.start_time = record_->start_time;
    dead.pid_ns = record_->pid_ns;
    dead.state.store(kRankLive, std::memory_order_release);
  }
  hdr->layout_version.store(kLayoutVersion, std::memory_order_release);  // pairs with read_header
}

void Attacher::claim() {
  RankSlot& slot = seg_->rank_slot(rank_);
  slot.pid = me_.pid;
  slot.start_time = me_.start_time;
  slot.pid_ns = me_.pid_ns;
  slot.features = params_.features;
  // The JoinRecord goes before the slot is claimed, not after: a process killed between the two
  // left a dead joiner for its rank behind, and the next incarnation's rendezvous failed at once
  // with "rank N died while joining" (ShmSegmentProcs.StaleSegmentOfWaitingRankIsReplaced, under
  // load). Killed in the instant between clear and claim, it is neither: the others wait for it
  // up to their timeout.
  lock_.clear_join(rank_);
  slot.state.store(kRankLive, std::memory_order_release);  // pairs with the acquire loads of state
  if (auto r = lock_.record(); r && r->creating != 0) {
    try {
      lock_.write_record({CreatorRecord::kMagic, r->pid, r->rank, r->start_time, 0, r->pid_ns});  // creation complete
    } catch (const SegmentError& e) {
      detail::log().warn("{}", e.what());  // the next attacher still sees a live, valid incarnation
    }
  }
}

std::unique_ptr<Segment> Segment::attach(const SegmentParams& params, uint32_t rank,
                                         std::chrono::steady_clock::time_point deadline) {
  check_params(params, rank);
  return Attacher(params, rank, deadline).run();
}

}  // namespace tdshm::shm
