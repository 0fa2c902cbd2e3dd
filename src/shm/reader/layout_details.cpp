// The layout-specific part of a segment (read_layout_details): the dispatch by layout version,
// and the reader of layout version 4.

#include "shm/layout/validate.h"
#include "shm/reader/file_read.h"
#include "shm/reader/inspect.h"

#include <array>
#include <string>

namespace tdshm::shm {

namespace reader {

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
  d.geometry = {{"ring_entries", ring_entries}, {"slot_bytes", slot_bytes},        {"entry_bytes", entry_bytes},
                {"ring_bytes", ring_bytes},     {"rank_table_offset", rank_table}, {"rings_offset", rings}};
  // Version 4's geometry (segment_geometry of that version), recomputed from the three
  // parameters and compared: only then are the offsets used.
  if (ring_entries < 1 || ring_entries > kMaxRingEntries || slot_bytes < 1 || slot_bytes > kMaxSlotBytes || world < 1 ||
      world > kMaxWorld) {
    d.note = "version 4 header out of range (ring_entries " + std::to_string(ring_entries) + ", slot_bytes " +
             std::to_string(slot_bytes) + ")";
    return d;
  }
  const uint64_t want_entry =
      round_up_to(round_up_to(kEntryHeaderBytes + slot_bytes, 8) + kShapeBytes, kCacheLineBytes);
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

}  // namespace reader

// The one place that knows a layout version's geometry beyond the shared header prefix and rank
// table: one case per version.
LayoutDetails read_layout_details(int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len,
                                  uint32_t layout_version, uint32_t world_size, const InspectOptions& options) {
  switch (layout_version) {
    case reader::v4::kVersion: return reader::v4::read(fd, file_bytes, header, header_len, world_size, options);
    case reader::v5::kVersion:
    case reader::v5::kVersion6:
    case reader::v5::kVersion7:
    case reader::v5::kVersion8:
    case reader::v5::kVersion9:
    case reader::v5::kVersion10:
      return reader::v5::read(layout_version, fd, file_bytes, header, header_len, world_size, options);
    default: {
      LayoutDetails d;
      d.layout_version = layout_version;
      d.note = "details not available for layout version " + std::to_string(layout_version);
      return d;
    }
  }
}

}  // namespace tdshm::shm
