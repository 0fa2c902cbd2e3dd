// The read-only segment reader behind `tdshm ls` and `tdshm inspect`: what one name in /dev/shm
// is, read from its segment file and its lock file (see inspect.h).

#include "shm/reader/inspect.h"

#include "common/fd.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include "shm/layout/validate.h"
#include "shm/parts/process_identity.h"
#include "shm/parts/trust.h"
#include "shm/reader/file_read.h"

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

namespace tdshm::shm {

namespace {

using namespace reader;

/// A header larger than this is not read (it is reported as corrupt).
constexpr uint32_t kMaxHeaderBytes = 64 << 10;

/// The most of a lock file that is read: the creator record and kMaxWorld join records.
constexpr uint64_t kMaxLockBytes = kJoinRecordsOffset + uint64_t{kMaxWorld} * sizeof(JoinRecord);

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

/// Why a file of this stat may not be read, or "" when it may (the trust model of trust.h).
std::string refusal(const struct stat& st) {
  if (S_ISLNK(st.st_mode)) return "a symbolic link (never followed)";
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  if (st.st_uid != ::geteuid()) {
    return "owned by uid " + std::to_string(st.st_uid) + ", not by this process's uid " + std::to_string(::geteuid());
  }
  if ((st.st_mode & 077) != 0)
    return "mode " + mode_str(st.st_mode) + ": group/other permission bits (tdshm makes 0600)";
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
  const double age =
      static_cast<double>(now.tv_sec - born.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec - born.tv_nsec);
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
      lock.creator =
          LockProcess{rec.pid, rec.rank, rec.start_time, process_alive({rec.pid, rec.start_time, rec.pid_ns})};
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
      ri.pid_ns = load<uint32_t>(slot + offsetof(RankSlot, pid_ns));      // zeros in layout 5's reserved bytes
      ri.features = load<uint32_t>(slot + offsetof(RankSlot, features));  // zeros before layout 8
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
// What is wrong with the prefix's values in `info` (read by read_segment), or "".
static std::string check_prefix(const SegmentInfo& info) {
  if (info.header_bytes < kPrefixBytes || info.header_bytes > kMaxHeaderBytes) {
    return "header size " + std::to_string(info.header_bytes);
  }
  if (info.world_size < 1 || info.world_size > kMaxWorld) return "world size " + std::to_string(info.world_size);
  if (info.segment_bytes < info.header_bytes) {
    return "segment size " + std::to_string(info.segment_bytes) + " below its header size";
  }
  return {};
}

// A header of this build's layout: read whole, checked by the same code as attach, then the
// rank table where it lies within the file.
static void read_current_header(int fd, const uint8_t* header, uint64_t file_bytes, SegmentInfo& info) {
  const HeaderFields h = read_header(*std::launder(reinterpret_cast<const SegmentHeader*>(header)));
  const HeaderCheck check = check_header(h, file_bytes);
  info.header_read = true;
  info.creator_pid = h.creator_pid;
  info.creator_rank = h.creator_rank;
  info.creator_start_time = h.creator_start_time;
  info.incarnation = h.incarnation;
  info.creator_alive = process_alive({h.creator_pid, h.creator_start_time});
  switch (check.verdict) {
    case HeaderVerdict::kValid: info.status = SegmentStatus::kValid; break;
    case HeaderVerdict::kTruncated: info.status = SegmentStatus::kTruncated; break;
    case HeaderVerdict::kIncomplete:  // (read_segment checked magic and version: not expected)
      info.status = SegmentStatus::kIncomplete;
      break;
    case HeaderVerdict::kOtherVersion: info.status = SegmentStatus::kOtherVersion; break;
    case HeaderVerdict::kCorrupt: info.status = SegmentStatus::kCorrupt; break;
  }
  info.problem = check.problem;
  // The rank table: check_header has checked its offset against the geometry (a truncated
  // header is consistent too); it must also lie within the file.
  const uint64_t table_end = h.rank_table_offset + uint64_t{h.world_size} * sizeof(RankSlot);
  if ((info.status == SegmentStatus::kValid || info.status == SegmentStatus::kTruncated) &&
      h.rank_table_offset >= h.header_bytes && table_end <= file_bytes) {
    if (!read_ranks(fd, h.rank_table_offset, h.world_size, file_bytes, info)) {
      info.problem += (info.problem.empty() ? "" : "; ") + std::string("the file shrank while it was read");
    }
  } else if (info.status == SegmentStatus::kTruncated) {
    info.problem += "; its rank table is cut";
  }
}

// The layout details asked for (options.details), and another version's rank table, which only
// the reader of that version knows where to find.
static void read_details(int fd, const uint8_t* header, size_t got, uint64_t file_bytes, const InspectOptions& options,
                         SegmentInfo& info) {
  // Another version's ranks are read where read_layout_details knows that version's rank
  // table; without details asked for, only that (no ring is read).
  const bool need_table = info.status == SegmentStatus::kOtherVersion;
  if (options.details || need_table) {
    InspectOptions o = options;
    if (!options.details) o.max_pairs = 0;
    LayoutDetails d = read_layout_details(fd, file_bytes, header, got, info.layout_version, info.world_size, o);
    if (need_table && d.available && d.rank_table_offset &&
        !read_ranks(fd, *d.rank_table_offset, info.world_size, file_bytes, info)) {
      info.problem += "; its rank table is cut";
    }
    if (options.details) info.details = std::move(d);
  }
}

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
  const size_t got =
      read_at(fd.get(), header.data(), static_cast<size_t>(std::min<uint64_t>(file_bytes, header.size())), 0);
  auto incomplete = [&](const std::string& what) {
    info.status = creator_creating ? SegmentStatus::kCreating : SegmentStatus::kIncomplete;
    info.problem = creator_creating
                       ? what + "; its creator (pid " + std::to_string(info.lock.creator->pid) + ") is creating it"
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
  const std::string prefix_problem = check_prefix(info);

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
    read_current_header(fd.get(), header.data(), file_bytes, info);
  }

  if (prefix_problem.empty() && (info.status == SegmentStatus::kValid || info.status == SegmentStatus::kTruncated ||
                                 info.status == SegmentStatus::kOtherVersion)) {
    read_details(fd.get(), header.data(), got, file_bytes, options, info);
  }
  if (info.status == SegmentStatus::kOtherVersion && !info.ranks_read) info.problem += ": its ranks are not read";
}

SegmentInfo inspect_name(const std::string& name, const InspectOptions& options) {
  SegmentInfo info;
  info.name = name;
  info.name_valid = valid_name(name);
  info.path = segment_path(name);
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

std::vector<std::string> RankInfo::feature_names() const {
  std::vector<std::string> out;
  for (uint32_t bit = 0; bit < 32; ++bit) {
    const uint32_t f = uint32_t{1} << bit;
    if ((features & f) == 0) continue;
    out.push_back(f == kRankFeatureMemmapByReference ? "memmap_by_reference"
                  : f == kRankFeatureTdshmTransfers  ? "tdshm_transfers"
                                                     : "bit " + std::to_string(bit));
  }
  return out;
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
  return static_cast<uint32_t>(
      std::count_if(ranks.begin(), ranks.end(), [](const RankInfo& r) { return r.state != kRankFree; }));
}

uint32_t SegmentInfo::alive_ranks() const {
  return static_cast<uint32_t>(std::count_if(ranks.begin(), ranks.end(), [](const RankInfo& r) { return r.alive; }));
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
    if (file.size() > prefix.size() && file.compare(0, prefix.size(), prefix) == 0)
      entries.insert(file.substr(prefix.size()));
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

}  // namespace tdshm::shm
