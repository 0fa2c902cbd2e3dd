#pragma once
// What the files of the read-only reader share (inspect.cpp, layout_details.cpp, layout_since_v5.cpp):
// bounded reads of a file into local buffers, the header prefix that every layout version
// shares, and the steps of the layout-version readers, each parameterized by a version's offsets
// and sizes (written out in the version's namespace, in layout_details.cpp and layout_since_v5.cpp).

#include "shm/layout/segment_layout.h"
#include "shm/reader/inspect.h"

#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

namespace tdshm::shm::reader {

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
              "the header prefix that every layout version shares moved: the reader reads it at fixed offsets");
// The rank slot's fields every layout version shares.
static_assert(sizeof(RankSlot) == 128 && offsetof(RankSlot, state) == 0 && offsetof(RankSlot, pid) == 4 &&
                  offsetof(RankSlot, start_time) == 8,
              "the rank slot that every layout version shares changed");

template <class T>
T load(const uint8_t* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// pread until `len` bytes or the end of the file; returns the bytes read (0 on error).
inline size_t read_at(int fd, void* buf, size_t len, uint64_t offset) noexcept {
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

constexpr uint64_t round_up_to(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

inline std::string to_s(uint64_t v) { return std::to_string(v); }

/// Where a version's header keeps the ring parameters and offsets (beyond the shared prefix).
struct RingHeaderAt {
  size_t ring_entries, slot_bytes, rank_table, rings, ring_bytes, entry_bytes;
};

/// Those values, read from the local copy of the header.
struct RingHeader {
  uint32_t ring_entries;
  uint64_t slot_bytes, rank_table, rings, ring_bytes, entry_bytes;
};

inline RingHeader load_ring_header(const uint8_t* header, const RingHeaderAt& at) {
  return {load<uint32_t>(header + at.ring_entries), load<uint64_t>(header + at.slot_bytes),
          load<uint64_t>(header + at.rank_table),   load<uint64_t>(header + at.rings),
          load<uint64_t>(header + at.ring_bytes),   load<uint64_t>(header + at.entry_bytes)};
}

/// A version's rank slot: its size and where it keeps its futex counters.
struct RankSlotAt {
  uint64_t slot_bytes;
  size_t wake_seq, sleepers;
};

/// Starts a version's details: d.layout_version = version; false, with d.note saying why, when the
/// header read is shorter than the version's header_bytes.
inline bool header_long_enough(uint32_t version, size_t header_len, uint64_t header_bytes, LayoutDetails& d) {
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
inline bool read_rank_table(int fd, uint64_t file_bytes, uint64_t rank_table, uint32_t world, const RankSlotAt& at,
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
inline std::string too_many_pairs_note(uint64_t pairs, uint64_t max_pairs) {
  return to_s(pairs) + " ring pairs: more than " + to_s(max_pairs) + ", not read";
}

/// The note when options.max_entries ran out before every pair's entries were read.
inline std::string entries_budget_note(uint64_t max_entries) {
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

namespace v4 {
/// Layout version 4's details (layout_details.cpp).
LayoutDetails read(int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len, uint32_t world,
                   const InspectOptions& options);
}  // namespace v4

namespace v5 {
inline constexpr uint32_t kVersion = 5;
inline constexpr uint32_t kVersion6 = 6;
inline constexpr uint32_t kVersion7 = 7;
inline constexpr uint32_t kVersion8 = 8;
inline constexpr uint32_t kVersion9 = 9;
inline constexpr uint32_t kVersion10 = 10;
/// Layout version 5's to 10's details (layout_since_v5.cpp).
LayoutDetails read(uint32_t version, int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len,
                   uint32_t world, const InspectOptions& options);
}  // namespace v5

}  // namespace tdshm::shm::reader
