// The read-only segment reader and gc behind `tdshm ls`, `tdshm inspect` and `tdshm gc` (see
// inspect.h).

#include "shm/inspect.h"

#include "common/fd.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "shm/segment.h"
#include "shm/validate.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>
#include <set>
#include <span>
#include <tuple>

namespace tdshm::shm {

namespace {

// The header prefix every layout version shares: the reader classifies any file by it.
constexpr size_t kMagicAt = 0;
constexpr size_t kVersionAt = 8;
constexpr size_t kHeaderBytesAt = 12;
constexpr size_t kSegmentBytesAt = 16;
constexpr size_t kWorldSizeAt = 24;
constexpr size_t kPrefixBytes = 28;
static_assert(offsetof(SegmentHeader, magic) == kMagicAt && offsetof(SegmentHeader, layout_version) == kVersionAt &&
                  offsetof(SegmentHeader, header_bytes) == kHeaderBytesAt &&
                  offsetof(SegmentHeader, segment_bytes) == kSegmentBytesAt &&
                  offsetof(SegmentHeader, world_size) == kWorldSizeAt,
              "the header prefix that every layout version shares moved: inspect.cpp reads it at fixed offsets");
// The rank slot's fields every layout version shares.
static_assert(sizeof(RankSlot) == 128 && offsetof(RankSlot, state) == 0 && offsetof(RankSlot, pid) == 4 &&
                  offsetof(RankSlot, start_time) == 8,
              "the rank slot that every layout version shares changed");

/// A header larger than this is not read (it is reported as corrupt).
constexpr uint32_t kMaxHeaderBytes = 64 << 10;
/// The most of a lock file that is read: the creator record and kMaxWorld join records.
constexpr uint64_t kMaxLockBytes = kJoinRecordsOffset + uint64_t{kMaxWorld} * sizeof(JoinRecord);

template <class T>
T load(const uint8_t* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// pread until `len` bytes or the end of the file; returns the bytes read (0 on error).
size_t read_at(int fd, void* buf, size_t len, uint64_t offset) noexcept {
  size_t done = 0;
  while (done < len) {
    const ssize_t n = ::pread(fd, static_cast<uint8_t*>(buf) + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return done;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

using detail::Fd;

bool valid_name(const std::string& name) {
  if (name.empty() || name.size() > 200) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

std::string mode_str(uint32_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", mode & 07777);
  return buf;
}

/// Why a file of this stat may not be read, or "" when it may (segment.cpp's trust model).
std::string refusal(const struct stat& st) {
  if (S_ISLNK(st.st_mode)) return "a symbolic link (never followed)";
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  if (st.st_uid != ::geteuid()) {
    return "owned by uid " + std::to_string(st.st_uid) + ", not by this process's uid " + std::to_string(::geteuid());
  }
  if ((st.st_mode & 077) != 0) return "mode " + mode_str(st.st_mode) + ": group/other permission bits (tdshm makes 0600)";
  return {};
}

/// Seconds since the file was made: its birth time where the kernel tells it, else its ctime.
double age_of(int fd, const struct stat& st) {
  timespec born = st.st_ctim;
#ifdef STATX_BTIME
  struct statx sx {};
  if (fd >= 0 && ::statx(fd, "", AT_EMPTY_PATH, STATX_BTIME, &sx) == 0 && (sx.stx_mask & STATX_BTIME) != 0) {
    born.tv_sec = sx.stx_btime.tv_sec;
    born.tv_nsec = sx.stx_btime.tv_nsec;
  }
#else
  (void)fd;
#endif
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const double age = static_cast<double>(now.tv_sec - born.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec - born.tv_nsec);
  return age < 0 ? 0 : age;
}

void fill_stat(SegmentInfo& info, int fd, const struct stat& st) {
  info.stat_ok = true;
  info.file_bytes = st.st_size > 0 ? static_cast<uint64_t>(st.st_size) : 0;
  info.uid = st.st_uid;
  info.mode = st.st_mode & 07777;
  info.age_seconds = age_of(fd, st);
}

/// Opens `path` for reading, refusing links and untrusted files; `st` is the fstat of what was
/// opened. Returns a closed Fd and sets `why` (and `refused`) when it may not be read.
int open_trusted(const std::string& path, struct stat& st, std::string& why, bool& refused) {
  refused = false;
  // O_NONBLOCK: a FIFO swapped in after the lstat does not block the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    refused = err == ELOOP;
    why = refused ? "a symbolic link (never followed)" : std::string("cannot open: ") + std::strerror(err);
    return -1;
  }
  if (::fstat(fd, &st) != 0) {
    why = std::string("cannot stat: ") + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  why = refusal(st);
  if (!why.empty()) {
    refused = true;
    ::close(fd);
    return -1;
  }
  return fd;
}

void read_lock(const std::string& path, LockInfo& lock, SegmentInfo* owner_stat) {
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) != 0) return;  // no lock file (or it vanished)
  lock.present = true;
  lock.problem = refusal(lst);
  if (!lock.problem.empty()) {
    lock.refused = true;
    if (owner_stat != nullptr) fill_stat(*owner_stat, -1, lst);
    return;
  }
  struct stat st {};
  Fd fd(open_trusted(path, st, lock.problem, lock.refused));
  if (!fd) {
    if (owner_stat != nullptr) fill_stat(*owner_stat, -1, lst);
    return;
  }
  if (owner_stat != nullptr) fill_stat(*owner_stat, fd.get(), st);
  lock.file_bytes = static_cast<uint64_t>(std::max<off_t>(st.st_size, 0));
  std::vector<uint8_t> bytes(static_cast<size_t>(std::min(lock.file_bytes, kMaxLockBytes)));
  const size_t got = read_at(fd.get(), bytes.data(), bytes.size(), 0);
  if (got >= sizeof(CreatorRecord)) {
    CreatorRecord rec;
    std::memcpy(&rec, bytes.data(), sizeof rec);
    if (rec.magic == CreatorRecord::kMagic) {
      lock.creator = LockProcess{rec.pid, rec.rank, rec.start_time, process_alive({rec.pid, rec.start_time, rec.pid_ns})};
      lock.creating = rec.creating != 0;
    }
  }
  for (uint64_t at = kJoinRecordsOffset, r = 0; at + sizeof(JoinRecord) <= got; at += sizeof(JoinRecord), ++r) {
    JoinRecord rec;
    std::memcpy(&rec, bytes.data() + at, sizeof rec);
    if (rec.magic != JoinRecord::kMagic || rec.rank != r) continue;
    lock.joiners.push_back({rec.pid, rec.rank, rec.start_time, process_alive({rec.pid, rec.start_time, rec.pid_ns})});
  }
}

bool all_zero(const uint8_t* p, size_t n) {
  return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
}

/// Reads the rank table (`world` RankSlots at `offset`, which the caller has validated for its
/// layout version): the part of a rank slot that every layout version shares.
bool read_ranks(int fd, uint64_t offset, uint32_t world, uint64_t file_bytes, SegmentInfo& info) {
  const uint64_t bytes = uint64_t{world} * sizeof(RankSlot);
  if (world < 1 || world > kMaxWorld || offset > file_bytes || bytes > file_bytes - offset) return false;
  std::vector<uint8_t> table(static_cast<size_t>(bytes));
  if (read_at(fd, table.data(), table.size(), offset) != table.size()) return false;  // the file shrank
  info.ranks.clear();
  info.ranks.reserve(world);
  for (uint32_t r = 0; r < world; ++r) {
    const uint8_t* slot = table.data() + uint64_t{r} * sizeof(RankSlot);
    RankInfo ri;
    ri.rank = r;
    ri.state = load<uint32_t>(slot + offsetof(RankSlot, state));
    if (ri.state != kRankFree) {  // pid and start time are meaningful once claimed
      ri.pid = load<uint32_t>(slot + offsetof(RankSlot, pid));
      ri.start_time = load<uint64_t>(slot + offsetof(RankSlot, start_time));
      ri.pid_ns = load<uint32_t>(slot + offsetof(RankSlot, pid_ns));  // zeros in layout 5's reserved bytes
    }
    ri.foreign = foreign_pid_namespace({ri.pid, ri.start_time, ri.pid_ns});
    ri.alive = ri.state == kRankLive && process_alive({ri.pid, ri.start_time, ri.pid_ns});
    info.ranks.push_back(ri);
  }
  info.ranks_read = true;
  return true;
}

/// Classifies the segment file (already lstat'ed as a trusted regular file) and reads what its
/// status allows.
void read_segment(const std::string& path, SegmentInfo& info, const InspectOptions& options) {
  struct stat st {};
  std::string why;
  bool refused = false;
  Fd fd(open_trusted(path, st, why, refused));
  if (!fd) {
    info.status = refused ? SegmentStatus::kRefused : SegmentStatus::kUnreadable;
    info.problem = why;
    return;
  }
  fill_stat(info, fd.get(), st);
  const uint64_t file_bytes = info.file_bytes;
  const bool creator_creating = info.lock.creating && info.lock.creator && info.lock.creator->alive;

  alignas(SegmentHeader) std::array<uint8_t, sizeof(SegmentHeader)> header{};
  const size_t got = read_at(fd.get(), header.data(), static_cast<size_t>(std::min<uint64_t>(file_bytes, header.size())), 0);
  auto incomplete = [&](const std::string& what) {
    info.status = creator_creating ? SegmentStatus::kCreating : SegmentStatus::kIncomplete;
    info.problem = creator_creating ? what + "; its creator (pid " + std::to_string(info.lock.creator->pid) +
                                          ") is creating it"
                                    : what + "; no live creator: its creation never finished";
  };
  if (got < kPrefixBytes) {
    if (got > 0 && !all_zero(header.data(), got) && load<uint64_t>(header.data()) != kSegmentMagic) {
      info.status = SegmentStatus::kNotTdshm;
      info.problem = "only " + std::to_string(got) + " bytes, without the tdshm magic";
      return;
    }
    incomplete(got == 0 ? std::string("empty") : "only " + std::to_string(got) + " bytes, shorter than a header");
    return;
  }
  const uint64_t magic = load<uint64_t>(header.data() + kMagicAt);
  if (magic != kSegmentMagic) {
    if (all_zero(header.data(), got)) {
      incomplete("zeros where the header goes");
    } else {
      info.status = SegmentStatus::kNotTdshm;
      info.problem = "no tdshm magic: not a tdshm segment";
    }
    return;
  }
  // The prefix: each value read once from the local copy, then checked.
  info.prefix_read = true;
  info.layout_version = load<uint32_t>(header.data() + kVersionAt);
  info.header_bytes = load<uint32_t>(header.data() + kHeaderBytesAt);
  info.segment_bytes = load<uint64_t>(header.data() + kSegmentBytesAt);
  info.world_size = load<uint32_t>(header.data() + kWorldSizeAt);
  if (info.layout_version == 0) {
    incomplete("layout version 0 (the header is not published)");
    return;
  }
  std::string prefix_problem;
  if (info.header_bytes < kPrefixBytes || info.header_bytes > kMaxHeaderBytes) {
    prefix_problem = "header size " + std::to_string(info.header_bytes);
  } else if (info.world_size < 1 || info.world_size > kMaxWorld) {
    prefix_problem = "world size " + std::to_string(info.world_size);
  } else if (info.segment_bytes < info.header_bytes) {
    prefix_problem = "segment size " + std::to_string(info.segment_bytes) + " below its header size";
  }

  if (info.layout_version != kLayoutVersion) {
    info.status = prefix_problem.empty() ? SegmentStatus::kOtherVersion : SegmentStatus::kCorrupt;
    info.problem = "layout version " + std::to_string(info.layout_version) + " (this tdshm reads version " +
                   std::to_string(kLayoutVersion) + ")";
    if (!prefix_problem.empty()) info.problem += "; " + prefix_problem;
    if (prefix_problem.empty() && info.segment_bytes != file_bytes) {
      info.problem += "; the header says " + std::to_string(info.segment_bytes) + " bytes, the file has " +
                      std::to_string(file_bytes);
    }
  } else if (got < sizeof(SegmentHeader)) {
    info.status = SegmentStatus::kTruncated;
    info.problem = "only " + std::to_string(file_bytes) + " bytes, shorter than its header";
    return;
  } else {
    // This build's layout: the whole header, checked by the same code as attach.
    const HeaderFields h = read_header(*std::launder(reinterpret_cast<const SegmentHeader*>(header.data())));
    const HeaderCheck check = check_header(h, file_bytes);
    info.header_read = true;
    info.creator_pid = h.creator_pid;
    info.creator_rank = h.creator_rank;
    info.creator_start_time = h.creator_start_time;
    info.incarnation = h.incarnation;
    info.creator_alive = process_alive({h.creator_pid, h.creator_start_time});
    switch (check.verdict) {
      case HeaderVerdict::kValid:
        info.status = SegmentStatus::kValid;
        break;
      case HeaderVerdict::kTruncated:
        info.status = SegmentStatus::kTruncated;
        break;
      case HeaderVerdict::kIncomplete:  // (magic and version were seen above: not expected)
        info.status = SegmentStatus::kIncomplete;
        break;
      case HeaderVerdict::kOtherVersion:
        info.status = SegmentStatus::kOtherVersion;
        break;
      case HeaderVerdict::kCorrupt:
        info.status = SegmentStatus::kCorrupt;
        break;
    }
    info.problem = check.problem;
    // The rank table: check_header has checked its offset against the geometry (a truncated
    // header is consistent too); it must also lie within the file.
    const uint64_t table_end = h.rank_table_offset + uint64_t{h.world_size} * sizeof(RankSlot);
    if ((info.status == SegmentStatus::kValid || info.status == SegmentStatus::kTruncated) &&
        h.rank_table_offset >= h.header_bytes && table_end <= file_bytes) {
      if (!read_ranks(fd.get(), h.rank_table_offset, h.world_size, file_bytes, info)) {
        info.problem += (info.problem.empty() ? "" : "; ") + std::string("the file shrank while it was read");
      }
    } else if (info.status == SegmentStatus::kTruncated) {
      info.problem += "; its rank table is cut";
    }
  }

  if (prefix_problem.empty() && (info.status == SegmentStatus::kValid || info.status == SegmentStatus::kTruncated ||
                                 info.status == SegmentStatus::kOtherVersion)) {
    // Another version's ranks are read where read_layout_details knows that version's rank
    // table; without details asked for, only that (no ring is read).
    const bool need_table = info.status == SegmentStatus::kOtherVersion;
    if (options.details || need_table) {
      InspectOptions o = options;
      if (!options.details) o.max_pairs = 0;
      LayoutDetails d = read_layout_details(fd.get(), file_bytes, header.data(), got, info.layout_version,
                                            info.world_size, o);
      if (need_table && d.available && d.rank_table_offset &&
          !read_ranks(fd.get(), *d.rank_table_offset, info.world_size, file_bytes, info)) {
        info.problem += "; its rank table is cut";
      }
      if (options.details) info.details = std::move(d);
    }
  }
  if (info.status == SegmentStatus::kOtherVersion && !info.ranks_read) info.problem += ": its ranks are not read";
}

SegmentInfo inspect_name(const std::string& name, const InspectOptions& options) {
  SegmentInfo info;
  info.name = name;
  info.name_valid = valid_name(name);
  info.path = std::string(kSegmentDir) + "/" + kSegmentFilePrefix + name;
  SegmentInfo lock_stat;  // the lock file's stat, for the size and age of a lock file alone
  read_lock(info.path + ".lock", info.lock, &lock_stat);
  struct stat lst {};
  if (::lstat(info.path.c_str(), &lst) != 0) {
    const int err = errno;
    if (err != ENOENT) {
      info.status = SegmentStatus::kUnreadable;
      info.problem = std::string("cannot stat: ") + std::strerror(err);
      return info;
    }
    if (info.lock.present) {
      info.status = SegmentStatus::kLockOnly;
      info.problem = "a lock file without a segment";
      if (info.lock.refused) info.problem += "; the lock file is " + info.lock.problem;
      info.stat_ok = lock_stat.stat_ok;
      info.file_bytes = lock_stat.file_bytes;
      info.uid = lock_stat.uid;
      info.mode = lock_stat.mode;
      info.age_seconds = lock_stat.age_seconds;
    } else {
      info.status = SegmentStatus::kMissing;
      info.problem = "no such segment";
    }
    return info;
  }
  if (const std::string why = refusal(lst); !why.empty()) {
    info.stat_ok = true;
    info.file_bytes = lst.st_size > 0 ? static_cast<uint64_t>(lst.st_size) : 0;
    info.uid = lst.st_uid;
    info.mode = lst.st_mode & 07777;
    info.status = SegmentStatus::kRefused;
    info.problem = why;
    return info;
  }
  read_segment(info.path, info, options);
  return info;
}

/// A name ending in ".lock" whose segment is not there: a segment of that name (it starts with the
/// segment magic) or an orphan lock file.
bool starts_with_segment_magic(const std::string& path) {
  struct stat st {};
  std::string why;
  bool refused = false;
  Fd fd(open_trusted(path, st, why, refused));
  uint64_t magic = 0;
  return fd && read_at(fd.get(), &magic, sizeof magic, 0) == sizeof magic && magic == kSegmentMagic;
}

// ---------------------------------------------------------------------------------------------
// The steps that layout versions 4 and 5 share, each parameterized by the version's offsets and
// sizes (written out in the version's namespace below).

constexpr uint64_t round_up_to(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

std::string to_s(uint64_t v) { return std::to_string(v); }

/// Where a version's header keeps the ring parameters and offsets (beyond the shared prefix).
struct RingHeaderAt {
  size_t ring_entries, slot_bytes, rank_table, rings, ring_bytes, entry_bytes;
};

/// Those values, read from the local copy of the header.
struct RingHeader {
  uint32_t ring_entries;
  uint64_t slot_bytes, rank_table, rings, ring_bytes, entry_bytes;
};

RingHeader load_ring_header(const uint8_t* header, const RingHeaderAt& at) {
  return {load<uint32_t>(header + at.ring_entries), load<uint64_t>(header + at.slot_bytes),
          load<uint64_t>(header + at.rank_table), load<uint64_t>(header + at.rings),
          load<uint64_t>(header + at.ring_bytes), load<uint64_t>(header + at.entry_bytes)};
}

/// A version's rank slot: its size and where it keeps its futex counters.
struct RankSlotAt {
  uint64_t slot_bytes;
  size_t wake_seq, sleepers;
};

/// Starts a version's details: d.layout_version = version; false, with d.note saying why, when the
/// header read is shorter than the version's header_bytes.
bool header_long_enough(uint32_t version, size_t header_len, uint64_t header_bytes, LayoutDetails& d) {
  d.layout_version = version;
  if (header_len < header_bytes) {
    d.note = "the file is shorter than a version " + to_s(version) + " header";
    return false;
  }
  return true;
}

/// Once a version's geometry checks out: the details are available, with the rank table's place
/// and the rank slots' futex counters (none when the table cannot be read whole). Returns whether
/// the rings are to be read as well (options.max_pairs != 0).
bool read_rank_table(int fd, uint64_t file_bytes, uint64_t rank_table, uint32_t world, const RankSlotAt& at,
                     const InspectOptions& options, LayoutDetails& d) {
  d.available = true;
  d.rank_table_offset = rank_table;
  std::vector<uint8_t> table(static_cast<size_t>(at.slot_bytes * world));
  if (rank_table + table.size() <= file_bytes && read_at(fd, table.data(), table.size(), rank_table) == table.size()) {
    for (uint32_t r = 0; r < world; ++r) {
      const uint8_t* slot = table.data() + uint64_t{r} * at.slot_bytes;
      d.counters.push_back({r, load<uint32_t>(slot + at.wake_seq), load<uint32_t>(slot + at.sleepers)});
    }
  }
  return options.max_pairs != 0;
}

/// The note when there are more ring pairs than options.max_pairs (none are read then).
std::string too_many_pairs_note(uint64_t pairs, uint64_t max_pairs) {
  return to_s(pairs) + " ring pairs: more than " + to_s(max_pairs) + ", not read";
}

/// The note when options.max_entries ran out before every pair's entries were read.
std::string entries_budget_note(uint64_t max_entries) {
  return "more than " + to_s(max_entries) + " entries in flight: bytes partial";
}

/// For each ordered pair (src, dst) of `world` ranks, by src then dst: read_pair(p, base) with
/// p.src and p.dst set and base the offset of the pair's ring (`rings` + its index * `ring_bytes`);
/// then p goes to d.pairs.
template <class ReadPair>
void for_each_pair(uint32_t world, uint64_t rings, uint64_t ring_bytes, LayoutDetails& d, ReadPair read_pair) {
  for (uint32_t src = 0; src < world; ++src) {
    for (uint32_t dst = 0; dst < world; ++dst) {
      PairInfo p;
      p.src = src;
      p.dst = dst;
      read_pair(p, rings + (uint64_t{src} * world + dst) * ring_bytes);
      d.pairs.push_back(p);
    }
  }
}

/// What is left of options.max_entries across all pairs, and whether it ran out.
struct EntryBudget {
  uint64_t left;
  bool ran_out = false;
};

/// A version's ring: where its entries start after the ring control, their number and size.
struct EntriesAt {
  uint64_t ring_control_bytes;
  uint32_t ring_entries;
  uint64_t entry_bytes;
};

/// Reads the entry header (entry.size() bytes) of each position from p.tail to p.head of the ring
/// at `base`, one of the budget each, and calls visit(pos, header). Stops when the budget runs out
/// (p.note says so) or at an entry beyond the end of the file (p.note = beyond_end_note, if any).
template <class Visit>
void read_entries(int fd, uint64_t file_bytes, uint64_t base, const EntriesAt& at, std::span<uint8_t> entry,
                  const char* beyond_end_note, EntryBudget& budget, PairInfo& p, Visit visit) {
  for (uint64_t pos = p.tail; pos < p.head; ++pos) {
    if (budget.left == 0) {
      budget.ran_out = true;
      p.note = "entries not all read (limit)";
      break;
    }
    --budget.left;
    const uint64_t entry_at = base + at.ring_control_bytes + (pos % at.ring_entries) * at.entry_bytes;
    if (entry_at + entry.size() > file_bytes || read_at(fd, entry.data(), entry.size(), entry_at) != entry.size()) {
      if (beyond_end_note != nullptr) p.note = beyond_end_note;
      break;
    }
    visit(pos, static_cast<const uint8_t*>(entry.data()));
  }
}

// ---------------------------------------------------------------------------------------------
// Layout version 4: per-pair rings of whole entries (EntryHeader, payload slot, shape). These
// constants are version 4's bytes, written out here so that this reader keeps reading version 4
// segments after segment_layout.h has moved on.
namespace v4 {
constexpr uint32_t kVersion = 4;
constexpr uint64_t kHeaderBytes = 256;
constexpr uint64_t kRankSlotBytes = 128;
constexpr uint64_t kCacheLineBytes = 64;
// Header fields beyond the shared prefix.
constexpr size_t kRingEntriesAt = 28;
constexpr size_t kSlotBytesAt = 32;
constexpr size_t kRankTableAt = 40;
constexpr size_t kRingsAt = 48;
constexpr size_t kRingBytesAt = 56;
constexpr size_t kEntryBytesAt = 64;
// RankSlot's second cache line.
constexpr size_t kWakeSeqAt = 64;
constexpr size_t kSleepersAt = 68;
// RingControl: head, tail on their own cache lines.
constexpr uint64_t kRingControlBytes = 128;
constexpr uint64_t kHeadAt = 0;
constexpr uint64_t kTailAt = 64;
// EntryHeader (48 bytes): seq at 0, chunk_bytes at 32, flags at 36; flags bit 1 = first chunk.
constexpr uint64_t kEntryHeaderBytes = 48;
constexpr size_t kSeqAt = 0;
constexpr size_t kChunkBytesAt = 32;
constexpr size_t kFlagsAt = 36;
constexpr uint32_t kFirstFlag = 1;
constexpr uint64_t kShapeBytes = 64;
constexpr uint32_t kMaxRingEntries = 1u << 20;
constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 30;

LayoutDetails read(int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len, uint32_t world,
                   const InspectOptions& options) {
  LayoutDetails d;
  if (!header_long_enough(kVersion, header_len, kHeaderBytes, d)) return d;
  const auto [ring_entries, slot_bytes, rank_table, rings, ring_bytes, entry_bytes] =
      load_ring_header(header, {kRingEntriesAt, kSlotBytesAt, kRankTableAt, kRingsAt, kRingBytesAt, kEntryBytesAt});
  d.geometry = {{"ring_entries", ring_entries}, {"slot_bytes", slot_bytes},   {"entry_bytes", entry_bytes},
                {"ring_bytes", ring_bytes},     {"rank_table_offset", rank_table}, {"rings_offset", rings}};
  // Version 4's geometry (segment_geometry of that version), recomputed from the three
  // parameters and compared: only then are the offsets used.
  if (ring_entries < 1 || ring_entries > kMaxRingEntries || slot_bytes < 1 || slot_bytes > kMaxSlotBytes ||
      world < 1 || world > kMaxWorld) {
    d.note = "version 4 header out of range (ring_entries " + std::to_string(ring_entries) + ", slot_bytes " +
             std::to_string(slot_bytes) + ")";
    return d;
  }
  const uint64_t want_entry = round_up_to(round_up_to(kEntryHeaderBytes + slot_bytes, 8) + kShapeBytes, kCacheLineBytes);
  const uint64_t want_ring = kRingControlBytes + want_entry * ring_entries;  // < 2^52
  const uint64_t want_rings = round_up_to(kHeaderBytes + kRankSlotBytes * world, kCacheLineBytes);
  const uint64_t pairs = uint64_t{world} * world;
  uint64_t rings_end = 0;
  if (entry_bytes != want_entry || ring_bytes != want_ring || rank_table != kHeaderBytes || rings != want_rings ||
      __builtin_mul_overflow(want_ring, pairs, &rings_end) || __builtin_add_overflow(rings_end, rings, &rings_end)) {
    d.note = "version 4 offsets and sizes disagree with world size, slot bytes and ring entries";
    return d;
  }

  if (!read_rank_table(fd, file_bytes, rank_table, world, {kRankSlotBytes, kWakeSeqAt, kSleepersAt}, options, d)) {
    return d;  // the rank table's place only
  }
  if (pairs > options.max_pairs) {
    d.note = too_many_pairs_note(pairs, options.max_pairs);
    return d;
  }
  EntryBudget budget{options.max_entries};
  std::array<uint8_t, kEntryHeaderBytes> entry{};
  const EntriesAt entries_at{kRingControlBytes, ring_entries, entry_bytes};
  for_each_pair(world, rings, ring_bytes, d, [&](PairInfo& p, uint64_t base) {
    // Tail first, then head: both only grow and tail <= head, so head read after tail is >= it
    // unless the file is corrupt.
    uint64_t tail = 0, head = 0;
    if (base + kRingControlBytes > file_bytes || read_at(fd, &tail, sizeof tail, base + kTailAt) != sizeof tail ||
        read_at(fd, &head, sizeof head, base + kHeadAt) != sizeof head) {
      p.note = "beyond the end of the file";
      return;
    }
    p.head = head;
    p.tail = tail;
    if (head < tail || head - tail > ring_entries) {
      p.inconsistent = true;
      p.note = "inconsistent: head " + to_s(head) + " and tail " + to_s(tail) + " disagree (a ring holds at most " +
               to_s(ring_entries) + " entries)";
      return;
    }
    p.depth = head - tail;
    read_entries(fd, file_bytes, base, entries_at, entry, nullptr, budget, p, [&](uint64_t pos, const uint8_t* e) {
      if (load<uint64_t>(e + kSeqAt) != pos + 1) return;  // being written, or taken meanwhile
      const uint32_t chunk = load<uint32_t>(e + kChunkBytesAt);
      if (chunk <= slot_bytes) p.bytes_in_flight += chunk;
      if (load<uint32_t>(e + kFlagsAt) & kFirstFlag) ++p.messages;
    });
  });
  if (budget.ran_out) d.note = entries_budget_note(options.max_entries);
  return d;
}
}  // namespace v4

// ---------------------------------------------------------------------------------------------
// Layout version 5: per-pair metadata rings of 192-byte entries (a chunk of up to 72 bytes inline,
// a larger one in a slot of the sender's arena) and one slot arena per rank. As for version 4,
// its bytes are written out here, so that this reader keeps reading version 5 segments after
// segment_layout.h moves on; while this build is version 5 they are checked against it.
// Version 6 is version 5 plus one collective window per rank after the arena (window_offset and
// window_bytes in the header; step words in RankSlot's first cache line): read here too.
namespace v5 {
constexpr uint32_t kVersion = 5;
constexpr uint32_t kVersion6 = 6;
constexpr size_t kWindowAt = 120;
constexpr size_t kWindowBytesAt = 128;
constexpr uint64_t kMaxWindowBytes = uint64_t{1} << 30;
constexpr uint64_t kWindowUnit = 256;  // four parts of whole cache lines
constexpr uint64_t kHeaderBytes = 256;
constexpr uint64_t kRankSlotBytes = 128;
constexpr uint64_t kCacheLineBytes = 64;
// Header fields beyond the shared prefix.
constexpr size_t kRingEntriesAt = 28;
constexpr size_t kSlotBytesAt = 32;
constexpr size_t kRankTableAt = 40;
constexpr size_t kRingsAt = 48;
constexpr size_t kRingBytesAt = 56;
constexpr size_t kEntryBytesAt = 64;
constexpr size_t kArenaAt = 96;
constexpr size_t kRegionBytesAt = 104;
constexpr size_t kSlotsPerRankAt = 112;
// RankSlot's second cache line.
constexpr size_t kWakeSeqAt = 64;
constexpr size_t kSleepersAt = 68;
// RingControl: head, tail on their own cache lines.
constexpr uint64_t kRingControlBytes = 128;
constexpr uint64_t kHeadAt = 0;
constexpr uint64_t kTailAt = 64;
// An entry: EntryHeader (56 B: seq at 0, chunk_bytes at 32, flags at 36, slot at 48), the inline
// bytes (72), the shape (64).
constexpr uint64_t kEntryBytes = 192;
constexpr uint64_t kEntryHeaderBytes = 56;
constexpr size_t kSeqAt = 0;
constexpr size_t kChunkBytesAt = 32;
constexpr size_t kFlagsAt = 36;
constexpr size_t kSlotAt = 48;
constexpr uint32_t kFirstFlag = 1;
constexpr uint32_t kInlineFlag = 64;
constexpr uint64_t kInlineChunkBytes = 72;
// ArenaSlot: a 32-bit state (0 free, else 1 + the rank the slot was handed to), 8 bytes each.
constexpr uint64_t kArenaSlotBytes = 8;
constexpr uint32_t kFree = 0;
// Limits of the parameters (validate.h's, as of version 5).
constexpr uint32_t kMaxRingEntries = 1u << 20;
constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 30;
constexpr uint32_t kMaxSlotsPerRank = 1u << 16;
constexpr uint32_t kMaxWorldSize = 4096;
/// Reads of head and tail before a pair whose tail moved meanwhile counts as "in motion".
constexpr int kIndexReads = 4;

struct Geometry {
  uint64_t ring_bytes, rings_offset, slot_table_bytes, slot_stride, region_bytes, arena_offset, window_offset,
      segment_bytes;
};

/// Version 5's segment_geometry (version 6's with `window_bytes`, 0 in version 5); false if it
/// overflows (it cannot within the limits above).
bool geometry(uint32_t world, uint64_t slot_bytes, uint32_t ring_entries, uint32_t slots, uint64_t window_bytes,
              Geometry& g) {
  g.ring_bytes = kRingControlBytes + kEntryBytes * ring_entries;
  g.rings_offset = round_up_to(kHeaderBytes + kRankSlotBytes * world, kCacheLineBytes);
  g.slot_table_bytes = round_up_to(kArenaSlotBytes * slots, kCacheLineBytes);
  g.slot_stride = round_up_to(slot_bytes, kCacheLineBytes);
  uint64_t pairs = 0, rings = 0, region_slots = 0, regions = 0;
  return !__builtin_mul_overflow(uint64_t{world}, uint64_t{world}, &pairs) &&
         !__builtin_mul_overflow(g.ring_bytes, pairs, &rings) &&
         !__builtin_add_overflow(g.rings_offset, rings, &g.arena_offset) &&
         !__builtin_mul_overflow(g.slot_stride, uint64_t{slots}, &region_slots) &&
         !__builtin_add_overflow(g.slot_table_bytes, region_slots, &g.region_bytes) &&
         !__builtin_mul_overflow(g.region_bytes, uint64_t{world}, &regions) &&
         !__builtin_add_overflow(g.arena_offset, regions, &g.window_offset) &&
         g.window_offset + window_bytes * world >= g.window_offset &&
         (g.segment_bytes = g.window_offset + window_bytes * world, true);
}

// While this build's layout is version 5, the constants above are its structs.
static_assert((kLayoutVersion != 5 && kLayoutVersion != 6) ||
                  (sizeof(SegmentHeader) == kHeaderBytes && offsetof(SegmentHeader, ring_entries) == kRingEntriesAt &&
                   offsetof(SegmentHeader, slot_bytes) == kSlotBytesAt &&
                   offsetof(SegmentHeader, rank_table_offset) == kRankTableAt &&
                   offsetof(SegmentHeader, rings_offset) == kRingsAt &&
                   offsetof(SegmentHeader, ring_bytes) == kRingBytesAt &&
                   offsetof(SegmentHeader, entry_bytes) == kEntryBytesAt &&
                   offsetof(SegmentHeader, arena_offset) == kArenaAt &&
                   offsetof(SegmentHeader, region_bytes) == kRegionBytesAt &&
                   offsetof(SegmentHeader, slots_per_rank) == kSlotsPerRankAt),
              "version 5 header constants");
static_assert((kLayoutVersion != 5 && kLayoutVersion != 6) ||
                  (sizeof(RankSlot) == kRankSlotBytes && offsetof(RankSlot, wake_seq) == kWakeSeqAt &&
                   offsetof(RankSlot, sleepers) == kSleepersAt && sizeof(RingControl) == kRingControlBytes &&
                   offsetof(RingControl, head) == kHeadAt && offsetof(RingControl, tail) == kTailAt),
              "version 5 rank slot and ring control constants");
static_assert((kLayoutVersion != 5 && kLayoutVersion != 6) ||
                  (kEntryBytes == shm::kEntryBytes && sizeof(EntryHeader) == kEntryHeaderBytes &&
                   offsetof(EntryHeader, seq) == kSeqAt && offsetof(EntryHeader, chunk_bytes) == kChunkBytesAt &&
                   offsetof(EntryHeader, flags) == kFlagsAt && offsetof(EntryHeader, slot) == kSlotAt &&
                   kFirstFlag == shm::kEntryFirst && kInlineFlag == shm::kEntryInline &&
                   kInlineChunkBytes == shm::kInlineBytes && sizeof(ArenaSlot) == kArenaSlotBytes &&
                   offsetof(ArenaSlot, state) == 0 && kFree == kSlotFree),
              "version 5 entry and arena constants");
static_assert((kLayoutVersion != 5 && kLayoutVersion != 6) || (kMaxRingEntries == shm::kMaxRingEntries && kMaxSlotBytes == shm::kMaxSlotBytes &&
                                      kMaxSlotsPerRank == shm::kMaxSlotsPerRank && kMaxWorldSize == shm::kMaxWorld),
              "version 5 limits");
constexpr bool same_geometry(uint32_t world, uint64_t slot_bytes, uint32_t entries, uint32_t slots, uint64_t window) {
  const SegmentGeometry want = segment_geometry(world, slot_bytes, entries, slots, window);
  const uint64_t ring = kRingControlBytes + kEntryBytes * entries;
  const uint64_t rings = round_up_to(kHeaderBytes + kRankSlotBytes * world, kCacheLineBytes);
  const uint64_t region = round_up_to(kArenaSlotBytes * slots, kCacheLineBytes) + round_up_to(slot_bytes, kCacheLineBytes) * slots;
  const uint64_t arena = rings + ring * world * world;
  return want.ring_bytes == ring && want.rings_offset == rings && want.region_bytes == region &&
         want.arena_offset == arena && want.window_offset == arena + region * world &&
         want.segment_bytes == arena + region * world + window * world;
}
static_assert(kLayoutVersion != 6 || (same_geometry(3, 65536, 64, 64, 1 << 20) && same_geometry(9, 100, 5, 3, 256)),
              "version 6 geometry");
static_assert(kLayoutVersion != 6 || (offsetof(SegmentHeader, window_offset) == kWindowAt &&
                                      offsetof(SegmentHeader, window_bytes) == kWindowBytesAt &&
                                      kMaxWindowBytes == shm::kMaxWindowBytes &&
                                      kWindowUnit == shm::kWindowParts * shm::kCacheLine),
              "version 6 window constants");

/// What read_indices found.
enum class Indices { kStable, kInMotion, kInconsistent, kBeyondEnd };

/// Reads head and tail of the ring at `base` as a consistent pair: tail, head, tail again, until
/// the two tails agree and head - tail is a depth the ring can hold (both only grow; the consumer
/// may store tail = head + 1 for a moment, as the producer stores seq before head). Fills p.head,
/// p.tail and, when stable, p.depth; otherwise p.note, and p.depth clamped to [0, ring_entries]
/// while in motion, 0 when inconsistent (the tail stood still and the pair still makes no sense).
Indices read_indices(int fd, uint64_t file_bytes, uint64_t base, uint32_t ring_entries, PairInfo& p) {
  if (base > file_bytes || kRingControlBytes > file_bytes - base) return Indices::kBeyondEnd;
  uint64_t tail = 0, head = 0, tail2 = 0;
  for (int attempt = 0; attempt < kIndexReads; ++attempt) {
    if (read_at(fd, &tail, sizeof tail, base + kTailAt) != sizeof tail ||
        read_at(fd, &head, sizeof head, base + kHeadAt) != sizeof head ||
        read_at(fd, &tail2, sizeof tail2, base + kTailAt) != sizeof tail2) {
      return Indices::kBeyondEnd;  // the file shrank meanwhile
    }
    if (tail == tail2 && head >= tail && head - tail <= ring_entries) {
      p.head = head;
      p.tail = tail;
      p.depth = head - tail;
      return Indices::kStable;
    }
  }
  p.head = head;
  p.tail = tail;
  if (tail != tail2) {
    p.depth = head >= tail ? std::min<uint64_t>(head - tail, ring_entries) : 0;
    p.note = "in motion: its tail moved from " + to_s(tail) + " to " + to_s(tail2) + " while it was read";
    return Indices::kInMotion;
  }
  p.inconsistent = true;
  p.depth = 0;
  p.note = "inconsistent: head " + to_s(head) + ", tail " + to_s(tail) + (head < tail ? " (tail > head)" : "") +
           " (a ring holds at most " + to_s(ring_entries) + " entries)";
  return Indices::kInconsistent;
}

LayoutDetails read(uint32_t version, int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len,
                   uint32_t world, const InspectOptions& options) {
  LayoutDetails d;
  if (!header_long_enough(version, header_len, kHeaderBytes, d)) return d;
  // Each value read once from the local copy of the header.
  const uint64_t segment_bytes = load<uint64_t>(header + kSegmentBytesAt);
  const uint32_t header_bytes = load<uint32_t>(header + kHeaderBytesAt);
  const auto [ring_entries, slot_bytes, rank_table, rings, ring_bytes, entry_bytes] =
      load_ring_header(header, {kRingEntriesAt, kSlotBytesAt, kRankTableAt, kRingsAt, kRingBytesAt, kEntryBytesAt});
  const uint64_t arena = load<uint64_t>(header + kArenaAt);
  const uint64_t region_bytes = load<uint64_t>(header + kRegionBytesAt);
  const uint32_t slots = load<uint32_t>(header + kSlotsPerRankAt);
  const uint64_t window_at = version == kVersion6 ? load<uint64_t>(header + kWindowAt) : 0;
  const uint64_t window_bytes = version == kVersion6 ? load<uint64_t>(header + kWindowBytesAt) : 0;
  d.geometry = {{"ring_entries", ring_entries},
                {"slot_bytes", slot_bytes},
                {"slots_per_rank", slots},
                {"entry_bytes", entry_bytes},
                {"ring_bytes", ring_bytes},
                {"region_bytes", region_bytes},
                {"rank_table_offset", rank_table},
                {"rings_offset", rings},
                {"arena_offset", arena}};
  if (version == kVersion6) {
    d.geometry.emplace_back("window_offset", window_at);
    d.geometry.emplace_back("window_bytes", window_bytes);
  }
  if (ring_entries < 1 || ring_entries > kMaxRingEntries || slot_bytes < 1 || slot_bytes > kMaxSlotBytes ||
      slots < 1 || slots > kMaxSlotsPerRank || world < 1 || world > kMaxWorldSize ||
      (version == kVersion6 && (window_bytes < kWindowUnit || window_bytes > kMaxWindowBytes ||
                                window_bytes % kWindowUnit != 0))) {
    d.note = "version " + to_s(version) + " header out of range (ring_entries " + to_s(ring_entries) + ", slot_bytes " + to_s(slot_bytes) +
             ", slots_per_rank " + to_s(slots) + ", world size " + to_s(world) + ")";
    return d;
  }
  // The geometry recomputed from the four parameters and compared: only then are offsets used.
  Geometry g{};
  if (!geometry(world, slot_bytes, ring_entries, slots, window_bytes, g) || header_bytes != kHeaderBytes ||
      entry_bytes != kEntryBytes || ring_bytes != g.ring_bytes || rank_table != kHeaderBytes ||
      rings != g.rings_offset || arena != g.arena_offset || region_bytes != g.region_bytes ||
      (version == kVersion6 && window_at != g.window_offset) || segment_bytes != g.segment_bytes) {
    d.note = "version " + to_s(version) + " offsets and sizes disagree with world size, slot bytes, ring entries, "
             "slots per rank and window bytes";
    return d;
  }

  if (!read_rank_table(fd, file_bytes, rank_table, world, {kRankSlotBytes, kWakeSeqAt, kSleepersAt}, options, d)) {
    return d;  // the rank table's place only
  }

  std::vector<std::string> notes;
  // The rings.
  const uint64_t pairs = uint64_t{world} * world;
  if (pairs > options.max_pairs) {
    notes.push_back(too_many_pairs_note(pairs, options.max_pairs));
  } else {
    EntryBudget budget{options.max_entries};
    uint64_t malformed = 0, inconsistent = 0;
    std::array<uint8_t, kEntryHeaderBytes> entry{};
    const EntriesAt entries_at{kRingControlBytes, ring_entries, kEntryBytes};
    // Each base < arena: no overflow.
    for_each_pair(world, rings, ring_bytes, d, [&](PairInfo& p, uint64_t base) {
      const Indices indices = read_indices(fd, file_bytes, base, ring_entries, p);
      if (indices != Indices::kStable) {
        if (indices == Indices::kBeyondEnd) p.note = "beyond the end of the file";
        if (indices == Indices::kInconsistent) ++inconsistent;
        return;  // its entries are not read: which ones are in the ring is unknown
      }
      uint64_t pair_changed = 0, pair_malformed = 0;
      read_entries(fd, file_bytes, base, entries_at, entry, "entries beyond the end of the file", budget, p,
                   [&](uint64_t pos, const uint8_t* e) {
                     if (load<uint64_t>(e + kSeqAt) != pos + 1) {  // taken and reused meanwhile
                       ++pair_changed;
                       return;
                     }
                     const uint32_t chunk = load<uint32_t>(e + kChunkBytesAt);
                     const uint32_t flags = load<uint32_t>(e + kFlagsAt);
                     const uint32_t slot = load<uint32_t>(e + kSlotAt);
                     const bool well_formed =
                         (flags & kInlineFlag) ? chunk <= kInlineChunkBytes : chunk <= slot_bytes && slot < slots;
                     if (!well_formed) {
                       ++pair_malformed;
                       return;
                     }
                     p.bytes_in_flight += chunk;
                     if (flags & kFirstFlag) ++p.messages;
                   });
      if (pair_changed != 0 || pair_malformed != 0) {
        std::string n;
        if (pair_changed != 0) n = to_s(pair_changed) + " entries taken while read (in motion)";
        if (pair_malformed != 0) {
          n += (n.empty() ? "" : "; ") + to_s(pair_malformed) + " malformed entries not counted";
        }
        p.note += (p.note.empty() ? "" : "; ") + n;
        malformed += pair_malformed;
      }
    });
    if (inconsistent != 0) notes.push_back(to_s(inconsistent) + " rings with inconsistent head and tail");
    if (malformed != 0) notes.push_back(to_s(malformed) + " malformed entries not counted");
    if (budget.ran_out) notes.push_back(entries_budget_note(options.max_entries));
  }

  // The arena: each rank's slot states.
  uint64_t slots_budget = options.max_slots;
  uint64_t invalid = 0;
  std::vector<uint8_t> states(static_cast<size_t>(kArenaSlotBytes * slots));  // <= 512 KiB
  std::vector<uint64_t> per_dst(world);
  bool slots_note = false;
  for (uint32_t owner = 0; owner < world; ++owner) {
    ArenaInfo a;
    a.owner = owner;
    a.slots = slots;
    const uint64_t at = arena + uint64_t{owner} * region_bytes;  // <= segment_bytes: no overflow
    if (slots_budget < slots) {
      slots_note = true;
      a.note = "not read (limit)";
      d.arenas.push_back(std::move(a));
      continue;
    }
    if (at > file_bytes || states.size() > file_bytes - at ||
        read_at(fd, states.data(), states.size(), at) != states.size()) {
      a.note = "beyond the end of the file";
      d.arenas.push_back(std::move(a));
      continue;
    }
    slots_budget -= slots;
    a.read = true;
    std::fill(per_dst.begin(), per_dst.end(), 0);
    for (uint32_t s = 0; s < slots; ++s) {
      const uint32_t state = load<uint32_t>(states.data() + uint64_t{s} * kArenaSlotBytes);
      if (state == kFree) continue;
      ++a.slots_taken;
      if (state - 1 < world) {
        ++per_dst[state - 1];
      } else {
        ++a.invalid_states;
      }
    }
    a.bytes_taken = a.slots_taken * slot_bytes;  // <= 2^16 * 2^30
    for (uint32_t dst = 0; dst < world; ++dst) {
      if (per_dst[dst] != 0) a.taken_by_dst.emplace_back(dst, per_dst[dst]);
    }
    if (a.invalid_states != 0) {
      a.note = to_s(a.invalid_states) + " slots in a state that names no rank";
      invalid += a.invalid_states;
    }
    d.arenas.push_back(std::move(a));
  }
  if (invalid != 0) notes.push_back(to_s(invalid) + " arena slots in a state that names no rank");
  if (slots_note) notes.push_back("more than " + to_s(options.max_slots) + " arena slots: regions partly read");
  for (const std::string& n : notes) d.note += (d.note.empty() ? "" : "; ") + n;
  return d;
}
}  // namespace v5

}  // namespace

const char* status_name(SegmentStatus status) {
  switch (status) {
    case SegmentStatus::kValid: return "valid";
    case SegmentStatus::kCreating: return "creating";
    case SegmentStatus::kIncomplete: return "incomplete";
    case SegmentStatus::kNotTdshm: return "not-tdshm";
    case SegmentStatus::kCorrupt: return "corrupt";
    case SegmentStatus::kTruncated: return "truncated";
    case SegmentStatus::kOtherVersion: return "other-version";
    case SegmentStatus::kRefused: return "refused";
    case SegmentStatus::kUnreadable: return "unreadable";
    case SegmentStatus::kLockOnly: return "lock-only";
    case SegmentStatus::kMissing: return "missing";
  }
  return "unknown";
}

std::string RankInfo::state_name() const {
  switch (state) {
    case kRankFree: return "free";
    case kRankLive: return alive ? "live" : "dead";
    case kRankLeft: return "left";
    case kRankAbandoned: return "abandoned";
    default: return "state " + std::to_string(state);
  }
}

uint32_t SegmentInfo::attached_ranks() const {
  return static_cast<uint32_t>(std::count_if(ranks.begin(), ranks.end(), [](const RankInfo& r) { return r.state != kRankFree; }));
}

uint32_t SegmentInfo::alive_ranks() const {
  return static_cast<uint32_t>(std::count_if(ranks.begin(), ranks.end(), [](const RankInfo& r) { return r.alive; }));
}

// The one place that knows a layout version's geometry beyond the shared header prefix and rank
// table: one case per version.
LayoutDetails read_layout_details(int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len,
                                  uint32_t layout_version, uint32_t world_size, const InspectOptions& options) {
  switch (layout_version) {
    case v4::kVersion:
      return v4::read(fd, file_bytes, header, header_len, world_size, options);
    case v5::kVersion:
    case v5::kVersion6:
      return v5::read(layout_version, fd, file_bytes, header, header_len, world_size, options);
    default: {
      LayoutDetails d;
      d.layout_version = layout_version;
      d.note = "details not available for layout version " + std::to_string(layout_version);
      return d;
    }
  }
}

SegmentInfo inspect_segment(const std::string& name, const InspectOptions& options) {
  validate_segment_name(name);  // throws SegmentError
  return inspect_name(name, options);
}

std::vector<SegmentInfo> list_segments(const InspectOptions& options) {
  DIR* dir = ::opendir(kSegmentDir);
  if (dir == nullptr) {
    throw SegmentError(std::string("cannot list ") + kSegmentDir + ": " + std::strerror(errno));
  }
  std::set<std::string> entries;  // the part after "tdshm."
  const std::string prefix = kSegmentFilePrefix;
  for (errno = 0; const dirent* e = ::readdir(dir); errno = 0) {
    const std::string file = e->d_name;
    if (file.size() > prefix.size() && file.compare(0, prefix.size(), prefix) == 0) entries.insert(file.substr(prefix.size()));
  }
  const int err = errno;
  ::closedir(dir);
  if (err != 0) throw SegmentError(std::string("cannot list ") + kSegmentDir + ": " + std::strerror(err));

  const std::string lock_suffix = ".lock";
  std::set<std::string> names;
  for (const std::string& entry : entries) {
    const bool lock_like = entry.size() > lock_suffix.size() &&
                           entry.compare(entry.size() - lock_suffix.size(), lock_suffix.size(), lock_suffix) == 0;
    if (!lock_like) {
      names.insert(entry);
      continue;
    }
    const std::string base = entry.substr(0, entry.size() - lock_suffix.size());
    if (entries.count(base) != 0) continue;  // the lock file of a listed segment
    if (starts_with_segment_magic(std::string(kSegmentDir) + "/" + prefix + entry)) {
      names.insert(entry);  // a segment whose own name ends in ".lock"
    } else {
      names.insert(base);  // a lock file without its segment
    }
  }
  std::vector<SegmentInfo> out;
  out.reserve(names.size());
  for (const std::string& name : names) {
    SegmentInfo info = inspect_name(name, options);
    if (info.status != SegmentStatus::kMissing) out.push_back(std::move(info));  // (gone meanwhile)
  }
  return out;
}

std::pair<bool, std::string> gc_decision(const SegmentInfo& info) {
  const auto keep = [](std::string why) { return std::pair<bool, std::string>{false, std::move(why)}; };
  const auto remove = [](std::string why) { return std::pair<bool, std::string>{true, std::move(why)}; };
  if (!info.name_valid) return keep("not a segment name tdshm uses");
  if (info.lock.refused) return keep("its lock file is refused (" + info.lock.problem + ")");
  if (info.lock.creating && info.lock.creator && info.lock.creator->alive) {
    return keep("being created by pid " + std::to_string(info.lock.creator->pid));
  }
  for (const LockProcess& j : info.lock.joiners) {
    if (j.alive) return keep("pid " + std::to_string(j.pid) + " is joining it as rank " + std::to_string(j.rank));
  }
  switch (info.status) {
    case SegmentStatus::kValid:
    case SegmentStatus::kTruncated: {
      if (!info.ranks_read) return keep("its rank table cannot be read (" + info.problem + "): cannot tell whether it is in use");
      for (const RankInfo& r : info.ranks) {
        if (r.alive) return keep("in use: rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) + ") is alive");
      }
      std::string states;
      for (const RankInfo& r : info.ranks) {
        if (r.rank >= 8) {
          states += ", ...";
          break;
        }
        states += (states.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r.rank) + " " + r.state_name();
      }
      return remove("no live rank (" + states + ")");
    }
    case SegmentStatus::kIncomplete:
      if (info.lock.creator && info.lock.creating && !info.lock.creator->alive) {
        return remove("its creation was interrupted: creator pid " + std::to_string(info.lock.creator->pid) + " died");
      }
      return keep("incomplete (" + info.problem + ") and no record of an interrupted creation: not provably stale");
    case SegmentStatus::kLockOnly:
      return remove("a lock file without a segment, with no live creator or joiner");
    case SegmentStatus::kCreating:
      return keep("being created");
    case SegmentStatus::kOtherVersion: {
      // Never removed from here: remove_stale_segment's re-check under the lock cannot read
      // another version's ranks, so a group of that version re-created meanwhile would go too.
      const std::string version = "layout version " + std::to_string(info.layout_version) + ", not this tdshm's " +
                                  std::to_string(kLayoutVersion);
      if (!info.ranks_read) return keep(version + ": its ranks cannot be read");
      for (const RankInfo& r : info.ranks) {
        if (r.alive) {
          return keep("in use (" + version + "): rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) +
                      ") is alive");
        }
      }
      return keep(version + ": no live rank, but only a tdshm of that version removes it; if no process uses it, "
                  "delete " + info.path + " and " + info.path + ".lock");
    }
    case SegmentStatus::kNotTdshm:
    case SegmentStatus::kCorrupt:
    case SegmentStatus::kRefused:
    case SegmentStatus::kUnreadable:
      return keep(std::string(status_name(info.status)) + " (" + info.problem + "): not provably stale; remove it by hand if it is yours and unused");
    case SegmentStatus::kMissing:
      return keep("no such segment");
  }
  return keep("unknown status");
}

std::vector<GcItem> collect_garbage(const GcOptions& options) {
  std::vector<SegmentInfo> infos;
  if (options.names.empty()) {
    infos = list_segments();
  } else {
    for (const std::string& name : options.names) infos.push_back(inspect_segment(name));
  }
  std::vector<GcItem> items;
  for (const SegmentInfo& info : infos) {
    GcItem item;
    item.name = info.name;
    item.status = info.status;
    std::tie(item.removable, item.reason) = gc_decision(info);
    if (item.removable && !options.dry_run) {
      const std::string lock = info.path + ".lock";
      struct stat st {};
      const bool had_lock = ::lstat(lock.c_str(), &st) == 0;
      try {
        // Re-checks under the lock file: throws SegmentError if a rank lives by now.
        item.removed_segment = tdshm::remove_stale_segment(info.name);
        item.removed_lock = had_lock && ::lstat(lock.c_str(), &st) != 0 && errno == ENOENT;
      } catch (const SegmentError& e) {
        item.removable = false;
        item.reason = std::string("kept at removal: ") + e.what();
        if (std::strstr(e.what(), "timed out") != nullptr) item.error = e.what();
      } catch (const std::exception& e) {
        item.error = e.what();
      }
    }
    items.push_back(std::move(item));
  }
  return items;
}

}  // namespace tdshm::shm
