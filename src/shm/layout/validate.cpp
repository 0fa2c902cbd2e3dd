// Validation of segment headers and ring entries (see validate.h).

#include "shm/layout/validate.h"

#include <cstring>

namespace tdshm::shm {

namespace {

template <class T>
T load_field(const void* base, size_t offset) noexcept {
  T v;
  std::memcpy(&v, static_cast<const uint8_t*>(base) + offset, sizeof v);
  return v;
}

}  // namespace

HeaderFields read_header(const SegmentHeader& shared) noexcept {
  HeaderFields h;
  h.layout_version = shared.layout_version.load(std::memory_order_acquire);  // pairs with the creator's release
  const void* b = &shared;
  h.magic = load_field<uint64_t>(b, offsetof(SegmentHeader, magic));
  h.header_bytes = load_field<uint32_t>(b, offsetof(SegmentHeader, header_bytes));
  h.segment_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, segment_bytes));
  h.world_size = load_field<uint32_t>(b, offsetof(SegmentHeader, world_size));
  h.ring_entries = load_field<uint32_t>(b, offsetof(SegmentHeader, ring_entries));
  h.slot_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, slot_bytes));
  h.rank_table_offset = load_field<uint64_t>(b, offsetof(SegmentHeader, rank_table_offset));
  h.rings_offset = load_field<uint64_t>(b, offsetof(SegmentHeader, rings_offset));
  h.ring_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, ring_bytes));
  h.entry_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, entry_bytes));
  h.creator_pid = load_field<uint32_t>(b, offsetof(SegmentHeader, creator_pid));
  h.creator_rank = load_field<uint32_t>(b, offsetof(SegmentHeader, creator_rank));
  h.creator_start_time = load_field<uint64_t>(b, offsetof(SegmentHeader, creator_start_time));
  h.incarnation = load_field<uint64_t>(b, offsetof(SegmentHeader, incarnation));
  h.arena_offset = load_field<uint64_t>(b, offsetof(SegmentHeader, arena_offset));
  h.region_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, region_bytes));
  h.slots_per_rank = load_field<uint32_t>(b, offsetof(SegmentHeader, slots_per_rank));
  h.window_offset = load_field<uint64_t>(b, offsetof(SegmentHeader, window_offset));
  h.window_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, window_bytes));
  h.loan_offset = load_field<uint64_t>(b, offsetof(SegmentHeader, loan_offset));
  h.loan_region_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, loan_region_bytes));
  h.loan_bytes = load_field<uint64_t>(b, offsetof(SegmentHeader, loan_bytes));
  h.loan_tickets = load_field<uint32_t>(b, offsetof(SegmentHeader, loan_tickets));
  return h;
}

HeaderCheck check_header(const HeaderFields& h, uint64_t file_bytes) {
  auto fail = [](HeaderVerdict v, std::string what) { return HeaderCheck{v, std::move(what)}; };
  if (h.magic != kSegmentMagic) return fail(HeaderVerdict::kIncomplete, "no tdshm magic");
  if (h.layout_version == 0) return fail(HeaderVerdict::kIncomplete, "layout version 0 (creation never finished)");
  if (h.layout_version != kLayoutVersion) {
    return fail(HeaderVerdict::kOtherVersion, "layout version " + std::to_string(h.layout_version) +
                                                  " but this tdshm uses version " + std::to_string(kLayoutVersion));
  }
  if (h.header_bytes != sizeof(SegmentHeader)) {
    return fail(HeaderVerdict::kCorrupt, "header size " + std::to_string(h.header_bytes));
  }
  if (h.world_size < 1 || h.world_size > kMaxWorld) {
    return fail(HeaderVerdict::kCorrupt, "world size " + std::to_string(h.world_size));
  }
  if (h.ring_entries < 1 || h.ring_entries > kMaxRingEntries) {
    return fail(HeaderVerdict::kCorrupt, "ring entries " + std::to_string(h.ring_entries));
  }
  if (h.slot_bytes < 1 || h.slot_bytes > kMaxSlotBytes) {
    return fail(HeaderVerdict::kCorrupt, "slot bytes " + std::to_string(h.slot_bytes));
  }
  if (h.slots_per_rank < 1 || h.slots_per_rank > kMaxSlotsPerRank) {
    return fail(HeaderVerdict::kCorrupt, "slots per rank " + std::to_string(h.slots_per_rank));
  }
  if (h.window_bytes < kWindowParts * kCacheLine || h.window_bytes > kMaxWindowBytes ||
      h.window_bytes % (kWindowParts * kCacheLine) != 0) {
    return fail(HeaderVerdict::kCorrupt, "collective window bytes " + std::to_string(h.window_bytes));
  }
  if (h.loan_tickets < 1 || h.loan_tickets > kMaxLoanTickets) {
    return fail(HeaderVerdict::kCorrupt, "loan tickets " + std::to_string(h.loan_tickets));
  }
  if (h.loan_bytes > kMaxLoanBytes || h.loan_bytes % kLoanPage != 0) {
    return fail(HeaderVerdict::kCorrupt, "loan bytes " + std::to_string(h.loan_bytes));
  }
  if (h.creator_rank >= h.world_size) {
    return fail(HeaderVerdict::kCorrupt, "creator rank " + std::to_string(h.creator_rank));
  }
  // With the bounds above the geometry cannot overflow 64 bits: rings 2^12 * 2^12 * 2^28, arena
  // 2^12 * 2^16 * 2^30, windows 2^12 * 2^30, loans 2^12 * (2^19 + 2^36).
  const SegmentGeometry g = segment_geometry(h.world_size, h.slot_bytes, h.ring_entries, h.slots_per_rank,
                                             h.window_bytes, h.loan_tickets, h.loan_bytes);
  if (h.entry_bytes != g.entry_bytes || h.ring_bytes != g.ring_bytes || h.rank_table_offset != g.rank_table_offset ||
      h.rings_offset != g.rings_offset || h.arena_offset != g.arena_offset || h.region_bytes != g.region_bytes ||
      h.window_offset != g.window_offset || h.window_bytes != g.window_bytes || h.loan_offset != g.loan_offset ||
      h.loan_region_bytes != g.loan_region_bytes || h.segment_bytes != g.segment_bytes) {
    return fail(HeaderVerdict::kCorrupt,
                "offsets and sizes do not agree with world size, slot bytes, ring entries, "
                "slots per rank, window bytes and loan sizes");
  }
  if (h.segment_bytes != file_bytes) {
    return fail(HeaderVerdict::kTruncated, "the header says " + std::to_string(h.segment_bytes) +
                                               " bytes, the file has " + std::to_string(file_bytes));
  }
  return {HeaderVerdict::kValid, {}};
}

void read_entry(const EntryHeader& shared, const EntryTail& tail, EntryFields& e) noexcept {
  const void* b = &shared;
  e.tag = load_field<int64_t>(b, offsetof(EntryHeader, tag));
  e.total_bytes = load_field<uint64_t>(b, offsetof(EntryHeader, total_bytes));
  e.chunk_bytes = load_field<uint32_t>(b, offsetof(EntryHeader, chunk_bytes));
  e.flags = load_field<uint32_t>(b, offsetof(EntryHeader, flags));
  e.dtype = load_field<uint8_t>(b, offsetof(EntryHeader, dtype));
  e.ndim = load_field<uint8_t>(b, offsetof(EntryHeader, ndim));
  e.check = load_field<uint32_t>(b, offsetof(EntryHeader, check));
  e.leaves = load_field<uint16_t>(b, offsetof(EntryHeader, leaves));
  // flags was read once above; the decisions use that copy.
  const void* t = &tail;
  e.chunk_offset =
      (e.flags & (kEntryFirst | kEntryBatch)) ? 0 : load_field<uint64_t>(t, offsetof(EntryTail, chunk_offset));
  e.slot = chunk_in_ring(e.flags) ? 0 : load_field<uint32_t>(t, offsetof(EntryTail, slot));
}

std::string check_entry(const EntryFields& e, const RxProgress& rx, const ArenaShape& arena,
                        uint64_t max_message_bytes) {
  constexpr uint32_t kChecks = kEntryKeyCheck | kEntrySchemaCheck;
  constexpr uint32_t kKnown =
      kEntryFirst | kEntryLast | kEntryControl | kEntryReference | kChecks | kEntryInline | kEntryLoan | kEntrySpan;
  if (e.flags == kEntryBatch) {
    // Its records are checked one by one as they are read (read_batch_record).
    if (rx.in_message) return "a batch before the previous message ended";
    if (e.leaves == 0) return "a batch of no records";
    if (e.total_bytes != e.chunk_bytes) {
      return "a batch of " + std::to_string(e.chunk_bytes) + " bytes that says " + std::to_string(e.total_bytes);
    }
    if (!span_fits(e.chunk_bytes, arena.ring_entries)) {
      return "batch of " + std::to_string(e.chunk_bytes) + " bytes in a ring of " + std::to_string(arena.ring_entries) +
             " entries";
    }
    return {};
  }
  if (e.flags & ~kKnown) return "unknown flags " + std::to_string(e.flags);
  const bool first = (e.flags & kEntryFirst) != 0, last = (e.flags & kEntryLast) != 0;
  if ((e.flags & kChecks) == kChecks) return "both a key check and a schema check";
  if ((e.flags & kChecks) != 0 && !first) return "a check on a continuation entry";
  if (e.leaves != 0 && (e.flags & kEntryKeyCheck) == 0) return "a leaf count without a key check";
  const bool control = (e.flags & kEntryControl) != 0;
  if (e.flags & kEntrySpan) {
    if (e.flags & (kEntryInline | kEntryReference | kEntryLoan)) return "a span that is inline, a reference or a loan";
    if (!first || !last) return "a span that is not a whole message";
    if (!span_fits(e.chunk_bytes, arena.ring_entries)) {
      return "span of " + std::to_string(e.chunk_bytes) + " bytes in a ring of " + std::to_string(arena.ring_entries) +
             " entries";
    }
  } else if (e.flags & kEntryInline) {
    if (e.chunk_bytes > kInlineBytes) return "inline chunk of " + std::to_string(e.chunk_bytes) + " bytes";
  } else {
    if (e.slot >= arena.slots_per_rank) {
      return "arena slot " + std::to_string(e.slot) + " of " + std::to_string(arena.slots_per_rank);
    }
    if (e.chunk_bytes > arena.slot_bytes) {
      return "chunk of " + std::to_string(e.chunk_bytes) + " bytes in a slot of " + std::to_string(arena.slot_bytes);
    }
  }
  if (first) {
    if (rx.in_message) return "a new message starts before the previous one ended";
    if (e.total_bytes > max_message_bytes) return "message size " + std::to_string(e.total_bytes);
    if (e.ndim != kShapeNotSent && e.ndim > kMaxDims) return "ndim " + std::to_string(e.ndim);
  } else {
    if (!rx.in_message) return "a continuation without a first entry";
    if (control != rx.control) return "control flag changed mid-message";
  }
  if (e.flags & kEntryLoan) {
    if (!first || !last || !(e.flags & kEntryInline) || (e.flags & kEntryReference)) {
      return "a loan that is not a whole message in one entry";
    }
    if (e.chunk_bytes != sizeof(LoanReference)) return "loan reference of " + std::to_string(e.chunk_bytes) + " bytes";
    return {};
  }
  if (e.flags & kEntryReference) {
    if (!first || !last) return "a memmap reference that is not a whole message";
    if (e.chunk_bytes < sizeof(MemmapReference))
      return "memmap reference of " + std::to_string(e.chunk_bytes) + " bytes";
    return {};
  }
  const uint64_t total = first ? e.total_bytes : rx.total;
  const uint64_t received = first ? 0 : rx.received;
  if (e.chunk_offset != received) {
    return "chunk at offset " + std::to_string(e.chunk_offset) + ", expected " + std::to_string(received);
  }
  if (e.chunk_bytes > total - received) {
    return "chunk of " + std::to_string(e.chunk_bytes) + " bytes past the message's " + std::to_string(total);
  }
  if (last != (received + e.chunk_bytes == total)) return "last-entry flag disagrees with the size";
  return {};
}

std::string read_batch_record(const uint8_t* records, uint64_t bytes, uint64_t& offset, EntryFields& out,
                              EntryShape& shape, uint64_t& payload_at) {
  if (offset > bytes || bytes - offset < sizeof(BatchRecord)) {
    return "a record at byte " + std::to_string(offset) + " past the batch's " + std::to_string(bytes);
  }
  BatchRecord r;
  std::memcpy(&r, records + offset, sizeof r);
  constexpr uint32_t kChecks = kEntryKeyCheck | kEntrySchemaCheck;
  if (r.flags & ~(kEntryControl | kChecks)) return "a record with flags " + std::to_string(r.flags);
  if ((r.flags & kChecks) == kChecks) return "a record with both a key check and a schema check";
  if (r.leaves != 0 && (r.flags & kEntryKeyCheck) == 0) return "a record with a leaf count without a key check";
  if (r.ndim != kShapeNotSent && r.ndim > kMaxDims) return "a record of ndim " + std::to_string(r.ndim);
  const uint64_t record = batch_record_bytes(r.ndim, r.bytes);
  if (record > bytes - offset) {
    return "a record of " + std::to_string(r.bytes) + " bytes at byte " + std::to_string(offset) +
           " past the batch's " + std::to_string(bytes);
  }
  const uint64_t dims = r.ndim >= 2 && r.ndim <= kMaxDims ? r.ndim : 0;
  std::memcpy(shape.dims, records + offset + sizeof r, dims * sizeof(int64_t));
  out = EntryFields{};
  out.tag = r.tag;
  out.total_bytes = r.bytes;
  out.chunk_bytes = r.bytes;
  out.flags = kEntryFirst | kEntryLast | kEntryBatch | r.flags;
  out.dtype = r.dtype;
  out.ndim = r.ndim;
  out.check = r.check;
  out.leaves = r.leaves;
  payload_at = offset + sizeof r + dims * sizeof(int64_t);
  offset += record;
  return {};
}

std::string check_reference(const uint8_t* payload, uint64_t bytes, uint64_t total_bytes, ReferenceFields& out) {
  if (bytes < sizeof(MemmapReference)) return "memmap reference of " + std::to_string(bytes) + " bytes";
  MemmapReference r;
  std::memcpy(&r, payload, sizeof r);
  if (r.path_bytes == 0 || r.path_bytes > 4095 || sizeof r + r.path_bytes != bytes) {
    return "memmap reference path length " + std::to_string(r.path_bytes);
  }
  if (r.offset > UINT64_MAX - total_bytes || r.offset + total_bytes > uint64_t{INT64_MAX}) {
    return "memmap reference offset " + std::to_string(r.offset) + " + " + std::to_string(total_bytes) + " bytes";
  }
  std::string path(reinterpret_cast<const char*>(payload) + sizeof r, r.path_bytes);
  if (path.front() != '/') return "memmap reference path is not absolute";
  if (path.find('\0') != std::string::npos) return "memmap reference path holds a NUL byte";
  const std::string tail = path + "/";
  if (tail.find("/../") != std::string::npos || tail.find("/./") != std::string::npos) {
    return "memmap reference path has '.' or '..' parts";
  }
  out.offset = r.offset;
  out.path = std::move(path);
  return {};
}

}  // namespace tdshm::shm
