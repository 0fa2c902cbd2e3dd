#pragma once
// Validation of what is read from a segment: the header (at attach) and ring entries (on every
// receive). Values in shared memory can change under the reader (a buggy peer), so the rule is
// "read once, check, then use only the copy": the callers copy the bytes out with the read_*
// functions below and pass the copies here. Pure functions of their arguments, without LibTorch,
// so that the fuzz targets (tests/fuzz/) exercise exactly this code.

#include "shm/layout/segment_layout.h"

#include <cstdint>
#include <string>

namespace tdshm::shm {

inline constexpr uint32_t kMaxWorld = 4096;
inline constexpr uint32_t kMaxRingEntries = 1u << 20;
inline constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 30;
inline constexpr uint32_t kMaxSlotsPerRank = 1u << 16;
inline constexpr uint64_t kMaxWindowBytes = uint64_t{1} << 30;
inline constexpr uint32_t kMaxLoanTickets = 1u << 16;
inline constexpr uint64_t kMaxLoanBytes = uint64_t{1} << 36;

/// The header's fields, copied out of shared memory.
struct HeaderFields {
  uint64_t magic = 0;
  uint32_t layout_version = 0;
  uint32_t header_bytes = 0;
  uint64_t segment_bytes = 0;
  uint32_t world_size = 0;
  uint32_t ring_entries = 0;
  uint64_t slot_bytes = 0;
  uint64_t rank_table_offset = 0;
  uint64_t rings_offset = 0;
  uint64_t ring_bytes = 0;
  uint64_t entry_bytes = 0;
  uint32_t creator_pid = 0;
  uint32_t creator_rank = 0;
  uint64_t creator_start_time = 0;
  uint64_t incarnation = 0;
  uint64_t arena_offset = 0;
  uint64_t region_bytes = 0;
  uint32_t slots_per_rank = 0;
  uint64_t window_offset = 0;
  uint64_t window_bytes = 0;
  uint64_t loan_offset = 0;
  uint64_t loan_region_bytes = 0;
  uint64_t loan_bytes = 0;
  uint32_t loan_tickets = 0;
};

/// Copies the header at `shared` (layout_version with acquire order first, so that a published
/// version comes with the fields it publishes).
HeaderFields read_header(const SegmentHeader& shared) noexcept;

enum class HeaderVerdict {
  kValid,         // a complete header of this layout that agrees with the file's size
  kIncomplete,    // no magic, or the version is still 0: its creator has not finished (or died)
  kOtherVersion,  // a complete header of another layout version
  kCorrupt,       // sizes or offsets that disagree with each other or are out of range
  kTruncated,     // a consistent header, but the file is not as large as it says
};

struct HeaderCheck {
  HeaderVerdict verdict = HeaderVerdict::kIncomplete;
  std::string problem;  // empty when valid
};

/// Checks a header copy against the size of the file it was read from.
HeaderCheck check_header(const HeaderFields& h, uint64_t file_bytes);

/// An entry's fields after seq, copied out of shared memory.
struct EntryFields {
  int64_t tag = 0;
  uint64_t total_bytes = 0;
  uint64_t chunk_offset = 0;
  uint32_t chunk_bytes = 0;
  uint32_t flags = 0;
  uint8_t dtype = 0;
  uint8_t ndim = 0;
  uint32_t check = 0;
  uint16_t leaves = 0;
  uint32_t slot = 0;
};

/// Copies the fields of the entry `shared` with tail `tail` (call after the acquire load of its
/// seq). The tail is read only where the flags say the entry has it: a first entry's chunk offset
/// is 0, an inline or span chunk's slot 0. Written into `out` in place (the caller's copy): a returned
/// struct, stored field by field and then copied whole, stalled the copy's wide loads.
void read_entry(const EntryHeader& shared, const EntryTail& tail, EntryFields& out) noexcept;

/// What the consumer of one ring knows when an entry arrives: the message in progress, if any.
struct RxProgress {
  bool in_message = false;  // a first entry came and its last has not
  bool control = false;
  uint64_t total = 0;
  uint64_t received = 0;
};

/// The arena's shape, as the receiver knows it from its own parameters.
struct ArenaShape {
  uint64_t slot_bytes = 0;
  uint32_t slots_per_rank = 0;
  uint32_t ring_entries = 0;  // of the ring the entry came from: bounds a span
};

/// Checks one entry against the ring's state, the arena's shape and the largest message the
/// receiver accepts. Returns "" when the entry is well formed, else what is wrong. (Whether the
/// slot it names was handed to the receiver is the arena's state, checked by the caller.)
std::string check_entry(const EntryFields& e, const RxProgress& rx, const ArenaShape& arena,
                        uint64_t max_message_bytes);

/// Reads the batch record at `offset` of a batch's `bytes` of `records` (segment_layout.h's
/// BatchRecord; records may be the ring's bytes: the record is copied once, then checked): the
/// message it stands for as a whole message's entry into `out` (flags kEntryFirst | kEntryLast |
/// kEntryBatch and the record's), its sizes into `shape` (2 to kMaxDims dimensions), where its
/// bytes start into `payload_at`, and `offset` past the record. Returns "" when the record is well
/// formed and within the batch, else what is wrong (nothing is then used).
std::string read_batch_record(const uint8_t* records, uint64_t bytes, uint64_t& offset, EntryFields& out,
                              EntryShape& shape, uint64_t& payload_at);

/// A MemmapReference payload, decoded and checked.
struct ReferenceFields {
  uint64_t offset = 0;
  std::string path;
};

/// Decodes the payload of a kEntryReference entry (`bytes` = its chunk_bytes, already checked to
/// fit where it is). Returns "" when it is well formed (an absolute path of 1 to 4095 bytes
/// without NUL and without "/../" or "/./" parts, and offset + total_bytes without overflow),
/// else what is wrong.
std::string check_reference(const uint8_t* payload, uint64_t bytes, uint64_t total_bytes, ReferenceFields& out);

}  // namespace tdshm::shm
