#pragma once
// A read-only reader of the segments in /dev/shm, for operators (`tdshm ls`, `tdshm inspect`,
// `tdshm gc`; tools/segments.cpp) and tests. It never maps, locks, writes or creates anything:
// every file is opened O_RDONLY | O_NOFOLLOW and read with pread into local buffers, so a file
// that shrinks, grows or changes while it is read can make a report wrong but never faults; every
// value is read once and validated before it is used as a size or an offset. Implemented in
// inspect.cpp (what a name is), layout_details.cpp and layout_since_v5.cpp (the layout-specific
// part). It reads with the parts alone (process_identity.h, trust.h, validate.h), so the
// segment's lifecycle can read through it: gc (segment/gc.h) removes what it proves stale, and
// capacity.h counts the stale segments an out-of-room error names.
//
// Trust model (the same as trust.h's): a file that is a symbolic link, not a regular file,
// owned by another uid or open to group/other is reported as refused and not read.
//
// What is read:
//  - the header prefix that every layout version shares (magic, layout_version at 8,
//    header_bytes, segment_bytes, world_size at 24): any file is classified by it;
//  - for this build's layout version (kLayoutVersion) the whole header, checked by validate.h's
//    check_header, and the rank table (state, pid, start time: liveness by process_alive); for
//    another version, the rank table where read_layout_details knows that version's geometry;
//  - the lock file's creator and join records (segment_layout.h);
//  - on request, the layout-specific part (rings, arena): read_layout_details, the one function
//    that knows a version's geometry beyond the header prefix and the rank table.
//
#include "shm/layout/segment_layout.h"
#include "shm/parts/trust.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tdshm::shm {

/// What one name in /dev/shm is, as far as this reader can tell.
enum class SegmentStatus {
  kValid,         // a complete header of this build's layout version that agrees with the file
  kCreating,      // no header published yet, and the lock file's creator is alive and creating it
  kIncomplete,    // zeros, or layout version 0, and no live creator: creation never finished
  kNotTdshm,      // no tdshm magic (and not all zeros)
  kCorrupt,       // a header whose sizes or offsets are out of range or disagree
  kTruncated,     // a consistent header of this layout version, but the file's size differs
  kOtherVersion,  // a complete header of another layout version (never removed by gc)
  kRefused,       // a link, not a regular file, another uid's, or group/other permission bits
  kUnreadable,    // could not be opened or read (vanished meanwhile, permissions)
  kLockOnly,      // a lock file without a segment
  kMissing,       // neither a segment nor a lock file of that name
};
/// "valid", "creating", ... (one word, for tables and JSON).
const char* status_name(SegmentStatus status);

/// One rank slot of the rank table.
struct RankInfo {
  uint32_t rank = 0;
  uint32_t state = kRankFree;  // RankState as stored
  uint32_t pid = 0;
  uint64_t start_time = 0;
  uint32_t pid_ns = 0;    // its PID namespace (RankSlot::pid_ns; 0: not recorded)
  uint32_t features = 0;  // what it offers its peers (RankSlot::features, kRankFeature*; 0: nothing)
  /// The names of the features it offers ("memmap_by_reference", "tdshm_transfers", "bit N").
  std::vector<std::string> feature_names() const;
  bool alive = false;    // state is Live and the process (pid + start time) still runs, or runs in
                         // another PID namespace (foreign_pid_namespace: not checkable, so kept)
  bool foreign = false;  // recorded by a process of another PID namespace than the reader's
  /// "free", "live", "dead" (Live but its process is gone), "left", "abandoned" or "state N".
  std::string state_name() const;
};

/// A process named in the lock file (the last creator, or one waiting to join as `rank`).
struct LockProcess {
  uint32_t pid = 0;
  uint32_t rank = 0;
  uint64_t start_time = 0;
  bool alive = false;
};

/// The lock file /dev/shm/tdshm.<name>.lock.
struct LockInfo {
  bool present = false;
  bool refused = false;  // a link, not regular, another uid's or group/other bits (see problem)
  std::string problem;   // why refused or unreadable
  uint64_t file_bytes = 0;
  std::optional<LockProcess> creator;  // the CreatorRecord, when it has its magic
  bool creating = false;               // the creator's `creating` flag
  std::vector<LockProcess> joiners;    // JoinRecords with their magic
};

/// One ordered pair's ring (layout-specific; see read_layout_details).
struct PairInfo {
  uint32_t src = 0;
  uint32_t dst = 0;
  uint64_t head = 0;             // entries the producer has published, ever
  uint64_t tail = 0;             // entries the consumer has taken, ever
  uint64_t depth = 0;            // head - tail: entries in the ring now (0 when inconsistent)
  uint64_t messages = 0;         // first entries among them
  uint64_t bytes_in_flight = 0;  // payload bytes of the published entries among them
  /// head and tail make no sense together (tail > head, or more than the ring holds) however
  /// often they were read: depth, messages and bytes are then 0, not trusted.
  bool inconsistent = false;
  std::string note;  // empty, or why the numbers are partial or missing ("inconsistent", "in motion", ...)
};

/// One rank's slot arena (layout version 5 on; empty before): its region's slot states.
struct ArenaInfo {
  uint32_t owner = 0;
  uint64_t slots = 0;        // slots_per_rank
  uint64_t slots_taken = 0;  // slots whose state is not free (in use)
  uint64_t bytes_taken = 0;  // slots_taken * slot_bytes: payload bytes those slots reserve
  /// (destination rank, slots handed to it), for each destination with at least one, by rank.
  std::vector<std::pair<uint32_t, uint64_t>> taken_by_dst;
  uint64_t invalid_states = 0;  // taken slots whose state names no rank of the group (counted in slots_taken)
  bool read = false;            // false: the region was not read (see note)
  std::string note;             // empty, or why the region was not (all) read or looks wrong
};

/// Per-rank counters kept in the rank slot (futex word, sleepers).
struct RankCounters {
  uint32_t rank = 0;
  uint32_t wake_seq = 0;
  uint32_t sleepers = 0;
};

/// The layout-specific part of a segment: what read_layout_details knows for a version.
struct LayoutDetails {
  uint32_t layout_version = 0;
  bool available = false;
  std::string note;  // when !available: why; else empty or a remark (pairs skipped, ...)
  std::vector<std::pair<std::string, uint64_t>> geometry;  // named sizes and offsets, in order
  /// Where the version keeps its rank table (RankSlot[world], validated against its geometry):
  /// lets the reader show the ranks of a segment of another version than this build's.
  std::optional<uint64_t> rank_table_offset;
  std::vector<PairInfo> pairs;
  std::vector<ArenaInfo> arenas;
  /// Layout 8: each rank's loan tickets, read as an arena's slots are (slots: tickets; slots_taken:
  /// tickets out, each a loan lent to the rank in taken_by_dst; bytes_taken 0: loan sizes live in
  /// their owner's process memory).
  std::vector<ArenaInfo> loans;
  std::vector<RankCounters> counters;
};

/// Everything the reader found under one name.
struct SegmentInfo {
  std::string name;
  std::string path;
  bool name_valid = true;  // a name tdshm accepts ([A-Za-z0-9._-]{1,200})
  SegmentStatus status = SegmentStatus::kMissing;
  std::string problem;  // empty when valid; else what is wrong, in words

  // The file (lstat/fstat); for kLockOnly, the lock file's.
  bool stat_ok = false;
  uint64_t file_bytes = 0;
  uint32_t uid = 0;
  uint32_t mode = 0;        // permission bits
  double age_seconds = -1;  // since creation (birth time where the kernel tells it, else ctime); < 0 unknown

  // The header prefix every version shares (when prefix_read).
  bool prefix_read = false;
  uint32_t layout_version = 0;
  uint32_t header_bytes = 0;
  uint64_t segment_bytes = 0;
  uint32_t world_size = 0;

  // This build's layout version only (when header_read).
  bool header_read = false;
  uint32_t creator_pid = 0;
  uint32_t creator_rank = 0;
  uint64_t creator_start_time = 0;
  uint64_t incarnation = 0;
  bool creator_alive = false;

  // The rank table (when ranks_read: this layout version, or another one whose rank table
  // read_layout_details locates; and the table is within the file).
  bool ranks_read = false;
  std::vector<RankInfo> ranks;

  LockInfo lock;
  /// Filled when asked for (InspectOptions::details) and the header prefix is sound.
  std::optional<LayoutDetails> details;

  /// Ranks whose slot was claimed (not free).
  uint32_t attached_ranks() const;
  /// Ranks that are Live with a running process.
  uint32_t alive_ranks() const;
};

struct InspectOptions {
  bool details = false;             // read the layout-specific part too
  uint64_t max_pairs = 1u << 16;    // ring pairs read at most (world² can reach 2^24)
  uint64_t max_entries = 1u << 20;  // ring entries read at most, over all pairs (bytes in flight)
  uint64_t max_slots = 1u << 24;    // arena slot states read at most, over all ranks (version 5 on)
};

/// Inspects /dev/shm/tdshm.<name> and its lock file. Throws SegmentError for a name tdshm would
/// not accept; never for what the files hold (that is the status).
SegmentInfo inspect_segment(const std::string& name, const InspectOptions& options = {});

/// Every tdshm.* entry of /dev/shm, sorted by name: segments (of any status) and lock files
/// without a segment (kLockOnly). A lock file next to its segment is not listed on its own. A
/// name ending in ".lock" is a lock file unless the file starts with the segment magic. Throws
/// SegmentError if /dev/shm cannot be read. A name that vanishes while it is read is left out.
std::vector<SegmentInfo> list_segments(const InspectOptions& options = {});

/// The layout-specific part of a segment: given the open file (`fd`, `file_bytes` from its
/// fstat), the bytes of its header as read (`header`, `header_len` of them) and the header
/// prefix's `layout_version` and `world_size` (validated: 1 to kMaxWorld), reads what the version
/// keeps beyond the header prefix and the rank table. Implemented for
///  - layout version 4: per-pair ring depth from RingControl head/tail, messages and bytes in
///    flight from the published entries, the rank slots' futex counters (no arena);
///  - layout version 5: the same for its metadata rings (an inline chunk counts its bytes, a
///    chunk in a slot its chunk_bytes), and per rank its slot arena: slots in use (state not
///    free), per destination rank, and the bytes they reserve (slots in use * slot_bytes).
/// For any other version it returns available = false and the note "details not available for
/// layout version N". Bounded: every read is a pread within file_bytes into a local buffer, every
/// value read is checked before it is used (the geometry is recomputed from the header's
/// parameters and compared; head and tail are re-read until the tail is stable, and a pair whose
/// head and tail still disagree is marked inconsistent, not trusted; an entry counts only when
/// its seq is its position + 1 and its sizes are in range). With options.max_pairs 0 it reads no
/// ring and no arena (the geometry, rank_table_offset and counters only).
LayoutDetails read_layout_details(int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len,
                                  uint32_t layout_version, uint32_t world_size, const InspectOptions& options);

}  // namespace tdshm::shm
