#pragma once
// The bytes of a tdshm segment (/dev/shm/tdshm.<name>). Everything here lives in shared memory,
// is read by other processes, and is pinned by static_asserts: a change to any struct must bump
// kLayoutVersion (tests/unit/test_shm_layout.cpp hard-codes the sizes and offsets).
//
//   0                 256                 rings_offset                      arena_offset               window_offset
//   +-----------------+-------------------+---------------------------------+--------------------------+-----------------+
//   | SegmentHeader   | RankSlot[world]   | Ring[src*world + dst] ...       | Region[owner] ...        |
//   Window[owner]...| | magic, version, | pid, start time,  |  RingControl (128 B)            |  ArenaSlot[slots]
//   (state)|  four parts of  | | sizes, creator  | state, collective |  Entry[ring_entries] (192 B):   |  slot 0 | slot
//   1 | ...   |  window_bytes/4 | |                 | steps, futex word |   header, inline bytes, shape   | | |
//   +-----------------+-------------------+---------------------------------+--------------------------+-----------------+
//
// Memory grows with the world, not its square: the per-pair rings hold small metadata entries
// (tag, sizes, dtype, shape, check; a payload of up to kInlineBytes travels inline, a whole
// message of up to span_limit() in the entries after its own when the ring has room: a span),
// and other payload bytes go through an arena of fixed-size slots, one region of
// `slots_per_rank` slots per rank. A rank writes only into its own region (it is the one allocator of its slots, so
// allocation needs no atomic read-modify-write and one sender can never starve another); each
// slot carries its state, the rank it was handed to, which the receiver resets once it has
// copied the chunk out. Collectives go through each rank's collective window (window_bytes,
// kWindowParts parts used by consecutive steps in turn): a rank writes its part of a step into its own window and
// every peer reads it there directly (engine/collectives.h). With the defaults (64 entries of 192 B per
// ordered pair, 64 slots of 64 KiB and a 1 MiB window per rank) world 9 takes 46 MiB and world
// 64 takes 369 MiB (world 64 in layout 4: 16.9 GiB).
//
// Offsets, never pointers: each process maps the segment at its own address. Atomics are
// lock-free std::atomic of 32 and 64 bits (asserted), which are address-free and so work
// across processes.
//
// Incarnations. One file is one incarnation of a group: each rank slot is claimed at most once
// in a file's life (Free -> Live -> Left or Abandoned) and never reset. A rank whose slot in the
// current file is already used (it was a member before, or died in it) creates a fresh file under
// the same name (the old one is unlinked; its members keep their mapping and finish with it), so
// a re-created group never meets, resets or reads the rings of an earlier one. See attach.cpp
// for the recovery model (lock file, crashed creators, stale segments), trust.h for the trust model.
//
// Trust. The bytes of a segment are written by the ranks of one user. trust.cpp refuses a file
// that another uid owns or that group/other may open. A member may still be buggy: the engine
// reads every field once into a local copy and validates it (validate.h) before use; a slot is
// read only from the sending rank's own region and only while its state names the reader.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace tdshm::shm {

inline constexpr size_t kCacheLine = 64;
/// "TDSHMSG1" little-endian.
inline constexpr uint64_t kSegmentMagic = 0x3147534d48534454ull;
inline constexpr uint32_t kLayoutVersion = 10;  // 2: kEntryReference; 3: incarnations; 4: entry checks;
                                                // 5: metadata rings + slot arena; 6: collective windows;
                                                // 7: a 40-byte entry header (24 inline bytes on line 0);
                                                // 8: loan regions (kEntryLoan); 9: keyed seq words and
                                                // spans (kEntrySpan); 10: batches (kEntryBatch)
inline constexpr size_t kMaxDims = 8;

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words and states must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring indices must be lock-free");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4,
              "atomics in shared memory must have the size of their value");

/// At offset 0. layout_version is stored last, with release order, once everything else is
/// initialised: a reader that sees it non-zero (acquire) sees a complete header and tables.
struct SegmentHeader {
  uint64_t magic;                        // 0   kSegmentMagic
  std::atomic<uint32_t> layout_version;  // 8   0 while the creator initialises
  uint32_t header_bytes;                 // 12  sizeof(SegmentHeader)
  uint64_t segment_bytes;                // 16  whole segment
  uint32_t world_size;                   // 24
  uint32_t ring_entries;                 // 28  entries per ring
  uint64_t slot_bytes;                   // 32  payload bytes per arena slot
  uint64_t rank_table_offset;            // 40
  uint64_t rings_offset;                 // 48
  uint64_t ring_bytes;                   // 56  RingControl + entries
  uint64_t entry_bytes;                  // 64  one ring entry (kEntryBytes)
  uint32_t creator_pid;                  // 72
  uint32_t creator_rank;                 // 76
  uint64_t creator_start_time;           // 80  clock ticks since boot (/proc/<pid>/stat field 22)
  uint64_t incarnation;                  // 88  random, fixed at creation: names this incarnation
  uint64_t arena_offset;                 // 96  region of rank r at arena_offset + r * region_bytes
  uint64_t region_bytes;                 // 104 ArenaSlot table + slots of one rank
  uint32_t slots_per_rank;               // 112
  uint32_t reserved0;                    // 116 zero
  uint64_t window_offset;                // 120 collective window of rank r at window_offset + r * window_bytes
  uint64_t window_bytes;                 // 128 one rank's window (two halves)
  uint64_t loan_offset;                  // 136 loan region of rank r at loan_offset + r * loan_region_bytes
  uint64_t loan_region_bytes;            // 144 LoanTicket table + heap of one rank
  uint64_t loan_bytes;                   // 152 one rank's loan heap
  uint32_t loan_tickets;                 // 160 tickets per rank
  uint32_t reserved1;                    // 164 zero
  uint8_t reserved[88];                  // 168 zero
};
static_assert(sizeof(SegmentHeader) == 256);
static_assert(offsetof(SegmentHeader, layout_version) == 8);
static_assert(offsetof(SegmentHeader, world_size) == 24);
static_assert(offsetof(SegmentHeader, slot_bytes) == 32);
static_assert(offsetof(SegmentHeader, creator_start_time) == 80);
static_assert(offsetof(SegmentHeader, incarnation) == 88);
static_assert(offsetof(SegmentHeader, arena_offset) == 96);
static_assert(offsetof(SegmentHeader, slots_per_rank) == 112);
static_assert(offsetof(SegmentHeader, window_offset) == 120 && offsetof(SegmentHeader, window_bytes) == 128);
static_assert(offsetof(SegmentHeader, loan_offset) == 136 && offsetof(SegmentHeader, loan_bytes) == 152 &&
              offsetof(SegmentHeader, loan_tickets) == 160);

/// A slot's life in one incarnation: Free -> Live -> Left or Abandoned, each step once.
enum RankState : uint32_t {
  kRankFree = 0,       // not yet claimed in this incarnation
  kRankLive = 1,       // claimed by the process in pid/start_time (which may since have died)
  kRankLeft = 2,       // left after its rendezvous completed
  kRankAbandoned = 3,  // left before its rendezvous completed (timed out or failed)
};

/// A collective window is this many parts, used by consecutive steps in turn (step s writes part
/// s % kWindowParts): a rank may be that many steps ahead of the slowest reader.
inline constexpr uint32_t kWindowParts = 4;

/// One per rank, at rank_table_offset + rank * sizeof(RankSlot). pid and start_time are written
/// once, before state becomes Live (release): a reader that loads Live (acquire) reads them.
/// The collective step words are written by their rank only (engine/collectives.h):
/// `step_check[s % kWindowParts]` (relaxed) before `published` = s (release), which peers read
/// with acquire.
struct RankSlot {
  std::atomic<uint32_t> state;                     // 0   RankState
  uint32_t pid;                                    // 4
  uint64_t start_time;                             // 8   with pid: identifies the process (pid reuse)
  std::atomic<uint64_t> published;                 // 16  last collective step whose part is in the window
  std::atomic<uint64_t> consumed;                  // 24  last collective step this rank finished reading
  std::atomic<uint64_t> step_check[kWindowParts];  // 32  what step s (in part s % 4) is: collective, sizes, step
  // Second cache line: written by every peer that wakes this rank.
  std::atomic<uint32_t> wake_seq;  // 64  futex word: bumped after each event for this rank
  std::atomic<uint32_t> sleepers;  // 68  > 0 while a thread of the rank sleeps on wake_seq
  // Written with pid and start_time (before state becomes live). Added in layout 6's reserved
  // bytes, so 0 (a build that did not write it) means "not known": that rank's liveness is then
  // judged by pid alone, as before.
  uint32_t pid_ns;  // 72  inode of the process's PID namespace (its pid is valid there)
  // Written with pid (layout 8's reserved bytes: 0 from a build that did not write it, which
  // offers nothing). kRankFeature* bits.
  uint32_t features;      // 76
  uint8_t reserved1[48];  // 80
};
static_assert(sizeof(RankSlot) == 128);
static_assert(offsetof(RankSlot, wake_seq) == 64 && offsetof(RankSlot, pid_ns) == 72 &&
              offsetof(RankSlot, features) == 76);

/// RankSlot::features: this rank's init_remote and from_remote_init exchange MemoryMappedTensor
/// leaves by reference with a rank that offers it too (remote_init.cpp); a rank whose
/// from_remote_init is tensordict's (a Python rank) does not offer it.
inline constexpr uint32_t kRankFeatureMemmapByReference = 1;
/// RankSlot::features: this rank's tensordict transfers are tdshm's C++ ones
/// (ShmOptions::tdshm_transfers; a Python rank's are tensordict's), so it speaks
/// gather_and_stack's protocol (distributed/gather_and_stack.cpp).
inline constexpr uint32_t kRankFeatureTdshmTransfers = 2;
static_assert(offsetof(RankSlot, published) == 16 && offsetof(RankSlot, consumed) == 24 &&
              offsetof(RankSlot, step_check) == 32);

/// Start of each ring (ordered pair src -> dst): the producer's and the consumer's index, each on
/// its own cache line. Positions grow forever; entry = position % ring_entries.
struct RingControl {
  alignas(kCacheLine) std::atomic<uint64_t> head;  // 0   next position the producer writes
  uint8_t reserved0[56];
  alignas(kCacheLine) std::atomic<uint64_t> tail;  // 64  next position the consumer reads
  uint8_t reserved1[56];
};
static_assert(sizeof(RingControl) == 128);
static_assert(offsetof(RingControl, tail) == 64);

enum EntryFlags : uint32_t {
  kEntryFirst = 1,      // first chunk of a message: tag, total size, dtype and shape are valid
  kEntryLast = 2,       // last chunk of a message
  kEntryControl = 4,    // a collective's message (barrier, broadcast), matched apart from user tags
  kEntryReference = 8,  // the message's bytes are in a file: the payload is a MemmapReference
  // First entry only, at most one of the two: `check` holds what tdshm's transfer layer knows of
  // the message (tensordict's wire has no room for it, so it rides here): a 32-bit hash of the
  // sender's leaf key, or of its consolidated schema. A receiver with a check of the same kind
  // compares them; one without (a Python tensordict rank) ignores them.
  kEntryKeyCheck = 16,
  kEntrySchemaCheck = 32,
  // The chunk's bytes (at most kInlineBytes) follow the header in the entry itself; without it
  // they are in the sender's arena slot `slot`.
  kEntryInline = 64,
  // The message's bytes are in the sender's loan heap: the inline payload is a LoanReference
  // (always a whole message: kEntryFirst | kEntryLast | kEntryInline).
  kEntryLoan = 128,
  // The message's bytes fill the ring entries right after this one (a span, see EntryHeader):
  // always a whole message, kEntryFirst | kEntryLast, never with kEntryInline.
  kEntrySpan = 256,
  // The entry's span holds several whole messages, one BatchRecord each (a batch, see
  // BatchRecord): always alone (no other flag); `leaves` is the number of records.
  kEntryBatch = 512,
};

/// Payload of a kEntryLoan entry: the message's total_bytes are at `offset` in the sender's loan
/// heap, lent to the receiver under the sender's ticket `ticket` (LoanTicket), which the receiver
/// hands back once it no longer reads them (after its copy, or when its last view is dropped).
struct LoanReference {
  uint64_t offset;    // 0
  uint32_t ticket;    // 8
  uint32_t reserved;  // 12 zero
};
static_assert(sizeof(LoanReference) == 16);

/// Payload of a kEntryReference entry (always a whole message: kEntryFirst | kEntryLast): the
/// message's total_bytes are at `offset` in the file whose absolute path follows this struct
/// (path_bytes bytes, no terminating NUL). A MemoryMappedTensor travels so over shm.
struct MemmapReference {
  uint64_t offset;      // 0
  uint32_t path_bytes;  // 8
  uint32_t reserved;    // 12
};
static_assert(sizeof(MemmapReference) == 16);

/// The header of one ring entry; `seq` is stored last (release): seq_word(key, position) once the
/// entry is complete. The consumer polls `seq` in the entry's first cache line, which also holds
/// every field a whole small message needs and its first 24 inline bytes: a message of up to 24
/// bytes moves one cache line (the seed tree's 8- and 24-byte leaves), one of up to kInlineBytes
/// two. The fields only some entries need (EntryTail: a continuation's offset, a slot) follow the
/// inline bytes, and the shape of a tensor of 2 or more dimensions comes last (EntryShape); each is
/// read only then.
///
///   entry (kEntryBytes):  | EntryHeader (40 B) | inline payload (72 B) | EntryTail (16 B) | EntryShape (64 B) |
///                         |<---------------- line 0 ------------>|<------ line 1 ------------->|<-- line 2 -->|
///
/// Spans (layout 9). A whole message of up to span_limit() bytes that is too large to be inline
/// travels in the entries right after its header entry, as raw bytes from the first byte of the
/// next entry on (ceil(bytes / kEntryBytes) entries; at the ring's end they go on at entry 0): the
/// consumer reads the header's line, then the payload's lines, all at once, and no slot state,
/// slot index or tail line. The header entry's lines 1 and 2 are read only for a shape. Because a
/// span leaves payload bytes where a later lap expects a header, an entry's seq is not position + 1
/// but that mixed with the ring's random key (seq_word): payload never reads as published.
struct EntryHeader {
  std::atomic<uint64_t> seq;  // 0
  int64_t tag;                // 8   first entry only
  uint64_t total_bytes;       // 16  first entry only: of the whole message
  uint32_t chunk_bytes;       // 24  <= slot_bytes, or <= kInlineBytes with kEntryInline
  uint32_t flags;             // 28  EntryFlags
  uint8_t dtype;              // 32  first entry only: c10::ScalarType of the sender's tensor
  uint8_t ndim;               // 33  first entry only: <= kMaxDims, or kShapeNotSent
  uint16_t leaves;            // 34  with kEntryKeyCheck: leaves of the sender's transfer (0: unknown)
  uint32_t check;             // 36  with kEntryKeyCheck / kEntrySchemaCheck, else 0
};
static_assert(sizeof(EntryHeader) == 40);
static_assert(offsetof(EntryHeader, chunk_bytes) == 24);
static_assert(offsetof(EntryHeader, dtype) == 32);

inline constexpr uint64_t kInlineBytes = 72;

/// The fields of an entry that only some entries carry, after its inline bytes; written and read
/// only for those (a first entry's chunk offset is 0, an inline chunk has no slot).
struct EntryTail {
  uint64_t chunk_offset;  // 0  continuation entries: of this chunk in the message
  uint32_t slot;          // 8  without kEntryInline: index of the sender's arena slot
  uint32_t reserved;      // 12 zero
};
static_assert(sizeof(EntryTail) == 16);

inline constexpr uint64_t kEntryTailOffset = sizeof(EntryHeader) + kInlineBytes;
static_assert(kEntryTailOffset == 112, "the tail ends line 1");

/// The sizes of a tensor of 2 to kMaxDims dimensions, written with a message's first entry (a
/// 0- or 1-dimensional shape follows from the byte size and dtype).
struct EntryShape {
  int64_t dims[kMaxDims];
};
static_assert(sizeof(EntryShape) == 64);

inline constexpr uint64_t kEntryShapeOffset = kEntryTailOffset + sizeof(EntryTail);
inline constexpr uint64_t kEntryBytes = kEntryShapeOffset + sizeof(EntryShape);
static_assert(kEntryShapeOffset == 128 && kEntryBytes == 192, "an entry is three cache lines");

inline constexpr uint8_t kShapeNotSent = 255;

/// A span's payload: at most this many bytes (a receiver refuses more, and stages a span that
/// wraps around the ring's end in a buffer of this size).
inline constexpr uint64_t kMaxSpanBytes = 8192;

/// The entries a span of `bytes` fills after its header entry.
constexpr uint64_t span_entries(uint64_t bytes) { return (bytes + kEntryBytes - 1) / kEntryBytes; }

/// Whether a receiver takes a span of `bytes` from a ring of `ring_entries` (at most
/// kMaxSpanBytes, and room for its header entry besides).
constexpr bool span_fits(uint64_t bytes, uint32_t ring_entries) {
  return bytes <= kMaxSpanBytes && 1 + span_entries(bytes) <= ring_entries;
}

/// Whether an entry's chunk lies in the ring (inline, a span or a batch) rather than in an arena
/// slot.
constexpr bool chunk_in_ring(uint32_t flags) { return (flags & (kEntryInline | kEntrySpan | kEntryBatch)) != 0; }

/// Whether an entry is followed by a span (of its chunk_bytes): a span's or a batch's.
constexpr bool has_span(uint32_t flags) { return (flags & (kEntrySpan | kEntryBatch)) != 0; }

/// Batches (layout 10). Small whole messages that a sender posts together to one receiver (a
/// tensordict's leaves, sent per leaf) travel as one entry whose span holds them all, one record
/// each, back to back from the span's first byte to its last: the receiver reads one header line,
/// then every message's lines at once, instead of one entry (and its dependent line fetches) per
/// message. A record: this struct, then the shape's sizes when ndim is 2 to kMaxDims (int64 each),
/// then the message's bytes, then zeros up to a multiple of 8. The batch entry's chunk_bytes and
/// total_bytes are the records' bytes; each record is received as the whole message it stands for.
struct BatchRecord {
  int64_t tag;      // 0
  uint32_t bytes;   // 8   the message's size
  uint32_t flags;   // 12  kEntryControl, kEntryKeyCheck or kEntrySchemaCheck only
  uint8_t dtype;    // 16
  uint8_t ndim;     // 17  <= kMaxDims, or kShapeNotSent
  uint16_t leaves;  // 18  with kEntryKeyCheck, as EntryHeader's
  uint32_t check;   // 20  with a check flag, as EntryHeader's
};
static_assert(sizeof(BatchRecord) == 24 && offsetof(BatchRecord, dtype) == 16 && offsetof(BatchRecord, check) == 20);

/// The bytes of a record of a message of `bytes` bytes and `ndim` dimensions.
constexpr uint64_t batch_record_bytes(uint8_t ndim, uint64_t bytes) {
  const uint64_t dims = ndim >= 2 && ndim <= kMaxDims ? ndim * sizeof(int64_t) : 0;
  return sizeof(BatchRecord) + dims + (bytes + 7) / 8 * 8;
}

/// The largest span this build's senders write (a sender's choice, not the layout's: receivers
/// take up to kMaxSpanBytes). Measured here in minutes when lines cross cores slowly (three
/// alternating pairs, one-way against UCX's in the same run): a span against a slot 2 KiB 0.87x
/// against 1.02x, 3 KiB 0.89x against 0.94x, 4 KiB 0.96x against 0.92x (docs/benchmarks.md).
inline constexpr uint64_t kSpanSendBytes = 3072;

/// The largest message a sender puts in a span of a ring of `ring_entries`: at most
/// kSpanSendBytes, and one that with its header takes at most half the ring (the other half keeps
/// room for what follows).
constexpr uint64_t span_limit(uint32_t ring_entries) {
  const uint64_t half = ring_entries / 2;
  return half < 2 ? 0 : std::min<uint64_t>(kSpanSendBytes, (half - 1) * kEntryBytes);
}

/// The random key of the ring src -> dst in the incarnation `incarnation` (SegmentHeader): a
/// splitmix64 of the two, with the top bit set so that no seq word of a position below 2^63 is 0.
constexpr uint64_t ring_key(uint64_t incarnation, uint32_t src, uint32_t dst) {
  uint64_t z = incarnation + 0x9e3779b97f4a7c15ull * (1 + (uint64_t{src} << 32 | dst));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | (uint64_t{1} << 63);
}

/// What `seq` holds once the entry of `position` is published in a ring of key `key`.
constexpr uint64_t seq_word(uint64_t key, uint64_t position) { return (position + 1) ^ key; }

/// The state of one arena slot, at the start of its owner's region (ArenaSlot[slots_per_rank],
/// padded to a cache line). Only the owner moves a slot from free to taken (before it writes
/// the chunk and publishes the entry that names the slot, release); only the rank it was handed
/// to moves it back to free (after it copied the chunk out, release), except that the owner takes
/// back the slots of a rank that is gone.
struct ArenaSlot {
  std::atomic<uint32_t> state;  // 0   kSlotFree, or 1 + the rank the chunk was handed to
  uint32_t reserved;            // 4   zero
};
static_assert(sizeof(ArenaSlot) == 8);
inline constexpr uint32_t kSlotFree = 0;

/// Each rank's loan region (after the collective windows): LoanTicket[loan_tickets], padded to a
/// page, then its loan heap of loan_bytes (a multiple of a page). The owner alone allocates in its
/// heap (process memory keeps the allocations, loan_pool.h); a send of a loan takes a ticket, marks
/// it handed to the receiver (as an arena slot is), and names it with the bytes' offset in the
/// ring entry. The receiver reads the bytes only while the ticket names it, and frees the ticket
/// (release) once it no longer reads them; the owner takes back the tickets of a rank that is gone.
using LoanTicket = ArenaSlot;
inline constexpr uint64_t kLoanPage = 4096;

static_assert(std::is_standard_layout_v<SegmentHeader> && std::is_standard_layout_v<RankSlot> &&
                  std::is_standard_layout_v<RingControl> && std::is_standard_layout_v<EntryHeader> &&
                  std::is_standard_layout_v<EntryShape> && std::is_standard_layout_v<ArenaSlot>,
              "shared structs must be standard-layout");
static_assert(std::is_trivially_destructible_v<SegmentHeader> && std::is_trivially_destructible_v<RankSlot> &&
                  std::is_trivially_destructible_v<RingControl> && std::is_trivially_destructible_v<EntryHeader>,
              "shared structs are never destroyed");

/// At offset 0 of the lock file /dev/shm/tdshm.<name>.lock: the last creator under the name.
/// Written (pwrite) only under the lock: `creating` is 1 from before the segment file is created
/// until its creator has published the header and claimed its slot, so whoever takes the lock
/// and finds it set with a dead pid knows that creation was interrupted (attach.cpp).
struct CreatorRecord {
  static constexpr uint64_t kMagic = 0x314b434c4d534454ull;  // "TDSMLCK1"
  uint64_t magic = 0;                                        // 0
  uint32_t pid = 0;                                          // 8
  uint32_t rank = 0;                                         // 12
  uint64_t start_time = 0;                                   // 16
  uint32_t creating = 0;                                     // 24
  uint32_t pid_ns = 0;  // 28  PID namespace inode (0: not known, written by an older build)
};
static_assert(sizeof(CreatorRecord) == 32);

/// At offset kJoinRecordsOffset + rank * sizeof(JoinRecord) of the lock file: a process that is
/// joining as `rank`. Written before the process waits for the lock, cleared (zeros) once it has
/// claimed its slot or given up; so a record whose process is dead names a rank that died while
/// joining, and the ranks waiting for it in their rendezvous fail at once (PeerLostError).
struct JoinRecord {
  static constexpr uint64_t kMagic = 0x314e4a4d53445454ull;  // "TTDSMJN1"
  uint64_t magic = 0;                                        // 0
  uint32_t pid = 0;                                          // 8
  uint32_t rank = 0;                                         // 12
  uint64_t start_time = 0;                                   // 16
  uint32_t pid_ns = 0;    // 24  PID namespace inode (0: not known, written by an older build)
  uint32_t reserved = 0;  // 28
};
static_assert(sizeof(JoinRecord) == 32);
inline constexpr uint64_t kJoinRecordsOffset = 64;

/// Byte sizes and offsets of a segment with the given parameters (the one place they are computed).
struct SegmentGeometry {
  uint64_t entry_bytes;
  uint64_t ring_bytes;
  uint64_t rank_table_offset;
  uint64_t rings_offset;
  uint64_t slot_table_bytes;  // ArenaSlot[slots_per_rank], padded to a cache line
  uint64_t slot_stride;       // slot_bytes, padded to a cache line
  uint64_t region_bytes;
  uint64_t arena_offset;
  uint64_t window_offset;
  uint64_t window_bytes;       // per rank, a multiple of kWindowParts cache lines
  uint64_t loan_offset;        // page-aligned
  uint64_t loan_table_bytes;   // LoanTicket[loan_tickets], padded to a page
  uint64_t loan_bytes;         // one rank's heap, a multiple of a page
  uint64_t loan_region_bytes;  // table + heap
  uint64_t segment_bytes;
};

constexpr uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

constexpr SegmentGeometry segment_geometry(uint32_t world_size, uint64_t slot_bytes, uint32_t ring_entries,
                                           uint32_t slots_per_rank, uint64_t window_bytes, uint32_t loan_tickets,
                                           uint64_t loan_bytes) {
  SegmentGeometry g{};
  g.entry_bytes = kEntryBytes;
  g.ring_bytes = sizeof(RingControl) + g.entry_bytes * ring_entries;
  g.rank_table_offset = sizeof(SegmentHeader);
  g.rings_offset = round_up(g.rank_table_offset + sizeof(RankSlot) * world_size, kCacheLine);
  g.slot_table_bytes = round_up(sizeof(ArenaSlot) * uint64_t{slots_per_rank}, kCacheLine);
  g.slot_stride = round_up(slot_bytes, kCacheLine);
  g.region_bytes = g.slot_table_bytes + g.slot_stride * slots_per_rank;
  g.arena_offset = g.rings_offset + g.ring_bytes * world_size * world_size;
  g.window_offset = g.arena_offset + g.region_bytes * world_size;
  g.window_bytes = round_up(window_bytes, kWindowParts * kCacheLine);
  g.loan_offset = round_up(g.window_offset + g.window_bytes * world_size, kLoanPage);
  g.loan_table_bytes = round_up(sizeof(LoanTicket) * uint64_t{loan_tickets}, kLoanPage);
  g.loan_bytes = round_up(loan_bytes, kLoanPage);
  g.loan_region_bytes = g.loan_table_bytes + g.loan_bytes;
  g.segment_bytes = g.loan_offset + g.loan_region_bytes * world_size;
  return g;
}

}  // namespace tdshm::shm
