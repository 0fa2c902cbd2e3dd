// The reader of the layout-specific part of layout versions 5 to 10: metadata rings, slot arenas,
// collective windows (and version 8's loan regions, whose size it checks).

#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"
#include "shm/reader/file_read.h"
#include "shm/reader/inspect.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>
#include <vector>

namespace tdshm::shm::reader {

// ---------------------------------------------------------------------------------------------
// Layout version 5: per-pair metadata rings of 192-byte entries (a chunk of up to 72 bytes inline,
// a larger one in a slot of the sender's arena) and one slot arena per rank. As for version 4,
// its bytes are written out here, so that this reader keeps reading version 5 segments after
// segment_layout.h moves on; while this build's layout is one of the versions read here (5 to 10)
// they are checked against its structs (the static_asserts below).
// Version 6 is version 5 plus one collective window per rank after the arena (window_offset and
// window_bytes in the header; step words in RankSlot's first cache line): read here too. Version 7
// is version 6 with another entry header (40 bytes, 24 inline bytes on line 0; chunk offset and
// slot after the inline bytes): only the entry's field offsets differ. Version 8 is version 7 plus
// one loan region per rank after the windows (its offset rounded up to a page; loan_offset,
// loan_region_bytes, loan_bytes and loan_tickets in the header). Version 9 is version 8 with keyed
// seq words (shm::seq_word: position + 1 mixed with the ring's key, from the incarnation and the
// pair) and spans: an entry with flag 256 is followed by ceil(chunk_bytes / 192) entries of raw
// payload, which are not entries. Version 10 is version 9 with batches: an entry whose flags are
// 512 alone is followed by a span as well, which holds `leaves` (at 34) whole messages.
namespace v5 {
constexpr size_t kIncarnationAt = 88;
constexpr uint32_t kSpanFlag = 256;
constexpr uint32_t kBatchFlag = 512;
constexpr size_t kLeavesAt7 = 34;
constexpr uint64_t kMaxSpanChunkBytes = 8192;
constexpr size_t kLoanAt = 136;
constexpr size_t kLoanRegionBytesAt = 144;
constexpr size_t kLoanBytesAt = 152;
constexpr size_t kLoanTicketsAt = 160;
constexpr uint64_t kPage = 4096;
constexpr uint32_t kMaxLoanTickets = 1u << 16;
constexpr uint64_t kMaxLoanBytes = uint64_t{1} << 36;
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
// Version 7's entry: EntryHeader (40 B: chunk_bytes at 24, flags at 28), the inline bytes (72),
// EntryTail (chunk_offset at 112, slot at 120), the shape.
constexpr size_t kChunkBytesAt7 = 24;
constexpr size_t kFlagsAt7 = 28;
constexpr size_t kSlotAt7 = 120;
// The bytes of an entry this reader reads: up to version 7's slot.
constexpr uint64_t kEntryReadBytes = 128;
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
      segment_bytes, loan_offset, loan_region_bytes;
};

/// Version 5's segment_geometry (version 6's with `window_bytes`, 0 in version 5); false if it
/// overflows (it cannot within the limits above).
bool geometry(uint32_t world, uint64_t slot_bytes, uint32_t ring_entries, uint32_t slots, uint64_t window_bytes,
              uint32_t loan_tickets, uint64_t loan_bytes, Geometry& g) {
  // Version 8's loan regions (none before): within the limits checked first, no overflow.
  g.loan_region_bytes = round_up_to(kArenaSlotBytes * loan_tickets, kPage) + round_up_to(loan_bytes, kPage);
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
         (g.segment_bytes = g.window_offset + window_bytes * world, true) &&
         (g.loan_offset = round_up_to(g.segment_bytes, kPage), true);
}

// While this build's layout is one that this file reads (5 to 10), the header and rank-slot
// constants above are its structs.
static_assert((kLayoutVersion < 5 || kLayoutVersion > 10) ||
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
static_assert((kLayoutVersion < 5 || kLayoutVersion > 10) ||
                  (sizeof(RankSlot) == kRankSlotBytes && offsetof(RankSlot, wake_seq) == kWakeSeqAt &&
                   offsetof(RankSlot, sleepers) == kSleepersAt && sizeof(RingControl) == kRingControlBytes &&
                   offsetof(RingControl, head) == kHeadAt && offsetof(RingControl, tail) == kTailAt),
              "version 5 rank slot and ring control constants");
// Versions 5 and 6's entry constants above were checked against EntryHeader by a static_assert
// while this build was version 6; they stay fixed now that EntryHeader is version 7's.
static_assert((kLayoutVersion < 7 || kLayoutVersion > 10) ||
                  (kEntryBytes == shm::kEntryBytes && offsetof(EntryHeader, seq) == kSeqAt &&
                   offsetof(EntryHeader, chunk_bytes) == kChunkBytesAt7 && offsetof(EntryHeader, flags) == kFlagsAt7 &&
                   kEntryTailOffset + offsetof(EntryTail, slot) == kSlotAt7 && kSlotAt7 + 4 <= kEntryReadBytes &&
                   kFirstFlag == shm::kEntryFirst && kInlineFlag == shm::kEntryInline &&
                   kInlineChunkBytes == shm::kInlineBytes && sizeof(ArenaSlot) == kArenaSlotBytes &&
                   offsetof(ArenaSlot, state) == 0 && kFree == kSlotFree),
              "version 7 entry and arena constants");
// Version 9's seq words: the key of a pair, pinned by a value (a change of ring_key is a new version).
static_assert((kLayoutVersion != 9 && kLayoutVersion != 10) ||
                  (offsetof(SegmentHeader, incarnation) == kIncarnationAt && kSpanFlag == shm::kEntrySpan &&
                   kMaxSpanChunkBytes == shm::kMaxSpanBytes &&
                   shm::ring_key(0x0123456789abcdefull, 2, 5) == 0x96f5076973a02b13ull &&
                   shm::seq_word(shm::ring_key(7, 0, 1), 41) == (42 ^ shm::ring_key(7, 0, 1))),
              "version 9 seq words");
static_assert(kLayoutVersion != 10 || (kBatchFlag == shm::kEntryBatch && offsetof(EntryHeader, leaves) == kLeavesAt7),
              "version 10 batches");
static_assert((kLayoutVersion < 5 || kLayoutVersion > 10) ||
                  (kMaxRingEntries == shm::kMaxRingEntries && kMaxSlotBytes == shm::kMaxSlotBytes &&
                   kMaxSlotsPerRank == shm::kMaxSlotsPerRank && kMaxWorldSize == shm::kMaxWorld),
              "version 5 limits");
constexpr bool same_geometry(uint32_t world, uint64_t slot_bytes, uint32_t entries, uint32_t slots, uint64_t window) {
  const SegmentGeometry want = segment_geometry(world, slot_bytes, entries, slots, window, 1, 0);
  const uint64_t ring = kRingControlBytes + kEntryBytes * entries;
  const uint64_t rings = round_up_to(kHeaderBytes + kRankSlotBytes * world, kCacheLineBytes);
  const uint64_t region =
      round_up_to(kArenaSlotBytes * slots, kCacheLineBytes) + round_up_to(slot_bytes, kCacheLineBytes) * slots;
  const uint64_t arena = rings + ring * world * world;
  return want.ring_bytes == ring && want.rings_offset == rings && want.region_bytes == region &&
         want.arena_offset == arena && want.window_offset == arena + region * world &&
         want.loan_offset == round_up_to(arena + region * world + window * world, kPage);
}
constexpr bool same_loans(uint32_t world, uint32_t tickets, uint64_t loan_bytes) {
  const SegmentGeometry want = segment_geometry(world, 65536, 64, 64, 1 << 20, tickets, loan_bytes);
  const uint64_t region = round_up_to(tickets * kArenaSlotBytes, kPage) + round_up_to(loan_bytes, kPage);
  return want.loan_region_bytes == region && want.segment_bytes == want.loan_offset + region * world;
}
static_assert((kLayoutVersion < 8 || kLayoutVersion > 10) ||
                  (same_loans(3, 64, 1 << 20) && same_loans(5, 1000, 12345) &&
                   offsetof(SegmentHeader, loan_offset) == kLoanAt &&
                   offsetof(SegmentHeader, loan_region_bytes) == kLoanRegionBytesAt &&
                   offsetof(SegmentHeader, loan_bytes) == kLoanBytesAt &&
                   offsetof(SegmentHeader, loan_tickets) == kLoanTicketsAt && kPage == shm::kLoanPage &&
                   kMaxLoanTickets == shm::kMaxLoanTickets && kMaxLoanBytes == shm::kMaxLoanBytes),
              "version 8 loan constants");
static_assert((kLayoutVersion < 6 || kLayoutVersion > 10) ||
                  (same_geometry(3, 65536, 64, 64, 1 << 20) && same_geometry(9, 100, 5, 3, 256)),
              "version 6 geometry");
static_assert((kLayoutVersion != 6 && kLayoutVersion != 7) ||
                  (offsetof(SegmentHeader, window_offset) == kWindowAt &&
                   offsetof(SegmentHeader, window_bytes) == kWindowBytesAt && kMaxWindowBytes == shm::kMaxWindowBytes &&
                   kWindowUnit == shm::kWindowParts * shm::kCacheLine),
              "version 6 window constants");

namespace {

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

// What a version 5 to 10 header says, each value read once from the local copy (read_values).
struct Values {
  uint32_t version = 0;
  uint32_t world = 0;
  RingHeader ring{};  // ring_entries, slot_bytes, rank_table, rings, ring_bytes, entry_bytes
  uint64_t segment_bytes = 0;
  uint32_t header_bytes = 0;
  uint64_t arena = 0;
  uint64_t region_bytes = 0;
  uint32_t slots = 0;
  bool has_window = false;  // 6 to 10
  bool has_loans = false;   // 8 to 10
  bool keyed = false;       // 9 and 10: seq words and spans
  bool batches = false;     // 10
  uint64_t incarnation = 0;
  struct {
    uint64_t at = 0, region_bytes = 0, bytes = 0;
    uint32_t tickets = 0;
  } loans;  // has_loans
  struct {
    uint64_t at = 0, bytes = 0;
  } window;  // has_window
};

Values read_values(uint32_t version, uint32_t world, const uint8_t* header) {
  Values v;
  v.version = version;
  v.world = world;
  v.segment_bytes = load<uint64_t>(header + kSegmentBytesAt);
  v.header_bytes = load<uint32_t>(header + kHeaderBytesAt);
  v.ring =
      load_ring_header(header, {kRingEntriesAt, kSlotBytesAt, kRankTableAt, kRingsAt, kRingBytesAt, kEntryBytesAt});
  v.arena = load<uint64_t>(header + kArenaAt);
  v.region_bytes = load<uint64_t>(header + kRegionBytesAt);
  v.slots = load<uint32_t>(header + kSlotsPerRankAt);
  v.has_window = version != kVersion;
  v.has_loans = version >= kVersion8;
  v.keyed = version >= kVersion9;
  v.batches = version >= kVersion10;
  if (v.keyed) v.incarnation = load<uint64_t>(header + kIncarnationAt);
  if (v.has_loans) {
    v.loans.at = load<uint64_t>(header + kLoanAt);
    v.loans.region_bytes = load<uint64_t>(header + kLoanRegionBytesAt);
    v.loans.bytes = load<uint64_t>(header + kLoanBytesAt);
    v.loans.tickets = load<uint32_t>(header + kLoanTicketsAt);
  }
  if (v.has_window) {
    v.window.at = load<uint64_t>(header + kWindowAt);
    v.window.bytes = load<uint64_t>(header + kWindowBytesAt);
  }
  return v;
}

void add_geometry(const Values& v, LayoutDetails& d) {
  const RingHeader& r = v.ring;
  d.geometry = {{"ring_entries", r.ring_entries},    {"slot_bytes", r.slot_bytes}, {"slots_per_rank", v.slots},
                {"entry_bytes", r.entry_bytes},      {"ring_bytes", r.ring_bytes}, {"region_bytes", v.region_bytes},
                {"rank_table_offset", r.rank_table}, {"rings_offset", r.rings},    {"arena_offset", v.arena}};
  if (v.has_window) {
    d.geometry.emplace_back("window_offset", v.window.at);
    d.geometry.emplace_back("window_bytes", v.window.bytes);
  }
  if (v.has_loans) {
    d.geometry.emplace_back("loan_offset", v.loans.at);
    d.geometry.emplace_back("loan_region_bytes", v.loans.region_bytes);
    d.geometry.emplace_back("loan_bytes", v.loans.bytes);
    d.geometry.emplace_back("loan_tickets", v.loans.tickets);
  }
}

// "" when the values are in range and their offsets and sizes are the ones the parameters give
// (only then are offsets used), else the note that says which is wrong.
std::string check_values(const Values& v) {
  const RingHeader& r = v.ring;
  const uint32_t world = v.world;
  if (r.ring_entries < 1 || r.ring_entries > kMaxRingEntries || r.slot_bytes < 1 || r.slot_bytes > kMaxSlotBytes ||
      v.slots < 1 || v.slots > kMaxSlotsPerRank || world < 1 || world > kMaxWorldSize ||
      (v.has_window &&
       (v.window.bytes < kWindowUnit || v.window.bytes > kMaxWindowBytes || v.window.bytes % kWindowUnit != 0)) ||
      (v.has_loans && (v.loans.tickets < 1 || v.loans.tickets > kMaxLoanTickets || v.loans.bytes > kMaxLoanBytes ||
                       v.loans.bytes % kPage != 0))) {
    return "version " + to_s(v.version) + " header out of range (ring_entries " + to_s(r.ring_entries) +
           ", slot_bytes " + to_s(r.slot_bytes) + ", slots_per_rank " + to_s(v.slots) + ", world size " + to_s(world) +
           ")";
  }
  Geometry g{};
  if (!geometry(world, r.slot_bytes, r.ring_entries, v.slots, v.window.bytes, v.loans.tickets, v.loans.bytes, g) ||
      v.header_bytes != kHeaderBytes || r.entry_bytes != kEntryBytes || r.ring_bytes != g.ring_bytes ||
      r.rank_table != kHeaderBytes || r.rings != g.rings_offset || v.arena != g.arena_offset ||
      v.region_bytes != g.region_bytes || (v.has_window && v.window.at != g.window_offset) ||
      v.segment_bytes != (v.has_loans ? g.loan_offset + g.loan_region_bytes * world : g.segment_bytes) ||
      (v.has_loans && (v.loans.at != g.loan_offset || v.loans.region_bytes != g.loan_region_bytes))) {
    return "version " + to_s(v.version) +
           " offsets and sizes disagree with world size, slot bytes, ring entries, "
           "slots per rank and window bytes";
  }
  return {};
}

// Counts the entries of one ring (a pair's) as read_entries hands them over: its messages and
// bytes in flight, the entries taken while read, the malformed ones.
struct EntryCounter {
  const Values& v;
  uint64_t key;  // the pair's seq key (0 before version 9: the word is position + 1)
  size_t chunk_at, flags_at, slot_at;
  uint64_t payload_until = 0;  // versions 9 and 10: the entries before it hold a span's payload
  uint64_t changed = 0, malformed = 0;

  void count(PairInfo& p, uint64_t pos, const uint8_t* e) {
    if (pos < payload_until) return;
    if (load<uint64_t>(e + kSeqAt) != shm::seq_word(key, pos)) {
      ++changed;  // taken and reused meanwhile
      return;
    }
    const uint32_t chunk = load<uint32_t>(e + chunk_at);
    const uint32_t flags = load<uint32_t>(e + flags_at);
    const uint32_t slot = load<uint32_t>(e + slot_at);
    const bool batch = v.batches && flags == kBatchFlag;
    const bool span = batch || (v.keyed && (flags & kSpanFlag) != 0);
    if (span) payload_until = pos + 1 + (uint64_t{chunk} + kEntryBytes - 1) / kEntryBytes;
    const bool well_formed = span                    ? chunk <= kMaxSpanChunkBytes
                             : (flags & kInlineFlag) ? chunk <= kInlineChunkBytes
                                                     : chunk <= v.ring.slot_bytes && slot < v.slots;
    if (!well_formed) {
      ++malformed;
      return;
    }
    p.bytes_in_flight += chunk;  // (a batch's: its records, with their headers)
    if (batch) {
      p.messages += load<uint16_t>(e + kLeavesAt7);
    } else if (flags & kFirstFlag) {
      ++p.messages;
    }
  }
};

// The rings: each pair's head, tail and entries (within the options' budgets).
void read_rings(int fd, uint64_t file_bytes, const Values& v, const InspectOptions& options, LayoutDetails& d,
                std::vector<std::string>& notes) {
  const uint64_t pairs = uint64_t{v.world} * v.world;
  if (pairs > options.max_pairs) {
    notes.push_back(too_many_pairs_note(pairs, options.max_pairs));
    return;
  }
  EntryBudget budget{options.max_entries};
  uint64_t malformed = 0, inconsistent = 0;
  std::array<uint8_t, kEntryReadBytes> entry{};
  const bool entry7 = v.version >= kVersion7;
  const EntriesAt entries_at{kRingControlBytes, v.ring.ring_entries, kEntryBytes};
  // Each base < arena: no overflow.
  for_each_pair(v.world, v.ring.rings, v.ring.ring_bytes, d, [&](PairInfo& p, uint64_t base) {
    const Indices indices = read_indices(fd, file_bytes, base, v.ring.ring_entries, p);
    if (indices != Indices::kStable) {
      if (indices == Indices::kBeyondEnd) p.note = "beyond the end of the file";
      if (indices == Indices::kInconsistent) ++inconsistent;
      return;  // its entries are not read: which ones are in the ring is unknown
    }
    EntryCounter counter{v, v.keyed ? shm::ring_key(v.incarnation, p.src, p.dst) : 0,
                         entry7 ? kChunkBytesAt7 : kChunkBytesAt, entry7 ? kFlagsAt7 : kFlagsAt,
                         entry7 ? kSlotAt7 : kSlotAt};
    read_entries(fd, file_bytes, base, entries_at, entry, "entries beyond the end of the file", budget, p,
                 [&](uint64_t pos, const uint8_t* e) { counter.count(p, pos, e); });
    if (counter.changed != 0 || counter.malformed != 0) {
      std::string n;
      if (counter.changed != 0) n = to_s(counter.changed) + " entries taken while read (in motion)";
      if (counter.malformed != 0) {
        n += (n.empty() ? "" : "; ") + to_s(counter.malformed) + " malformed entries not counted";
      }
      p.note += (p.note.empty() ? "" : "; ") + n;
      malformed += counter.malformed;
    }
  });
  if (inconsistent != 0) notes.push_back(to_s(inconsistent) + " rings with inconsistent head and tail");
  if (malformed != 0) notes.push_back(to_s(malformed) + " malformed entries not counted");
  if (budget.ran_out) notes.push_back(entries_budget_note(options.max_entries));
}

// A table of states (a 32-bit state per 8 bytes, 0 free, else 1 + the rank it was handed to) per
// rank: the arena's slots, or (version 8 on) the loan tickets. Reads `count` states of each
// owner's table at base + owner * stride while `budget` (states, for all tables) lasts; counts the
// states that name no rank into `bad`; sets `over_budget` when a table was left unread.
struct StateTables {
  int fd;
  uint64_t file_bytes;
  uint32_t world;
  uint64_t budget;
  bool over_budget = false;

  void read(uint64_t base, uint64_t stride, uint32_t count, uint64_t& bad, std::vector<ArenaInfo>& out) {
    std::vector<uint8_t> states(static_cast<size_t>(kArenaSlotBytes * count));  // <= 512 KiB
    std::vector<uint64_t> per_dst(world);
    for (uint32_t owner = 0; owner < world; ++owner) {
      ArenaInfo a;
      a.owner = owner;
      a.slots = count;
      const uint64_t at = base + uint64_t{owner} * stride;  // <= segment_bytes: no overflow
      if (budget < count) {
        over_budget = true;
        a.note = "not read (limit)";
      } else if (at > file_bytes || states.size() > file_bytes - at ||
                 read_at(fd, states.data(), states.size(), at) != states.size()) {
        a.note = "beyond the end of the file";
      } else {
        budget -= count;
        a.read = true;
        count_states(states, count, per_dst, a);
        bad += a.invalid_states;
      }
      out.push_back(std::move(a));
    }
  }

  void count_states(const std::vector<uint8_t>& states, uint32_t count, std::vector<uint64_t>& per_dst,
                    ArenaInfo& a) const {
    std::fill(per_dst.begin(), per_dst.end(), 0);
    for (uint32_t s = 0; s < count; ++s) {
      const uint32_t state = load<uint32_t>(states.data() + uint64_t{s} * kArenaSlotBytes);
      if (state == kFree) continue;
      ++a.slots_taken;
      if (state - 1 < world) {
        ++per_dst[state - 1];
      } else {
        ++a.invalid_states;
      }
    }
    for (uint32_t dst = 0; dst < world; ++dst) {
      if (per_dst[dst] != 0) a.taken_by_dst.emplace_back(dst, per_dst[dst]);
    }
    if (a.invalid_states != 0) a.note = to_s(a.invalid_states) + " entries in a state that names no rank";
  }
};

}  // namespace

LayoutDetails read(uint32_t version, int fd, uint64_t file_bytes, const uint8_t* header, size_t header_len,
                   uint32_t world, const InspectOptions& options) {
  LayoutDetails d;
  if (!header_long_enough(version, header_len, kHeaderBytes, d)) return d;
  const Values v = read_values(version, world, header);
  add_geometry(v, d);
  if (std::string note = check_values(v); !note.empty()) {
    d.note = std::move(note);
    return d;
  }
  if (!read_rank_table(fd, file_bytes, v.ring.rank_table, world, {kRankSlotBytes, kWakeSeqAt, kSleepersAt}, options,
                       d)) {
    return d;  // the rank table's place only
  }
  std::vector<std::string> notes;
  read_rings(fd, file_bytes, v, options, d, notes);
  // The arena's slot states and (version 8 on) the loan tickets' states of each rank.
  uint64_t invalid = 0, invalid_tickets = 0;
  StateTables tables{fd, file_bytes, world, options.max_slots};
  tables.read(v.arena, v.region_bytes, v.slots, invalid, d.arenas);
  for (ArenaInfo& a : d.arenas) a.bytes_taken = a.slots_taken * v.ring.slot_bytes;  // <= 2^16 * 2^30
  if (v.has_loans) tables.read(v.loans.at, v.loans.region_bytes, v.loans.tickets, invalid_tickets, d.loans);
  if (invalid_tickets != 0) notes.push_back(to_s(invalid_tickets) + " loan tickets in a state that names no rank");
  if (invalid != 0) notes.push_back(to_s(invalid) + " arena slots in a state that names no rank");
  if (tables.over_budget) notes.push_back("more than " + to_s(options.max_slots) + " arena slots: regions partly read");
  for (const std::string& n : notes) d.note += (d.note.empty() ? "" : "; ") + n;
  return d;
}
}  // namespace v5

}  // namespace tdshm::shm::reader
