// libFuzzer target: the checks of what another process writes into the shared-memory segment
// (src/shm/layout/validate.h): check_header on a header copy, check_entry over a ring's sequence of
// entries, read_batch_record over a batch's records, and check_reference on a memmap reference
// payload. Torch-free: it compiles
// src/shm/layout/validate.cpp and nothing else of tdshm. The input format is in shm_entry_format.h.
//
// The contract checked: the functions return a verdict for any input, without crashing,
// sanitizer report, exception, hang or large allocation, and what they accept is safe for the
// engine to use:
//   - header: kValid exactly when the problem is empty; a valid header has the magic, this
//     layout version and header size, world size, ring entries and slot bytes within their
//     limits, a creator rank inside the world, offsets and sizes equal to segment_geometry's,
//     and as many bytes as the file;
//   - entries: a consumer that starts idle and follows every accepted entry as the engine does
//     (a first entry opens a message of total_bytes, a chunk adds its bytes, a last entry or a
//     reference closes it; the first refused entry ends the ring) only ever accepts known flags,
//     chunks of at most kInlineBytes inline or at most a slot in an arena slot of the region, a first entry only when
//     idle with total_bytes within the receiver's limit and ndim <= kMaxDims or kShapeNotSent, a continuation only
//     mid-message with the same control flag, a chunk at exactly the bytes received so far and within the message, the
//     last flag exactly when the message is then complete, and a reference only as a whole message of at least a
//     MemmapReference;
//   - batch: records read one after the other from offset 0 (the first refused one ends the
//     batch) each lie wholly within the batch, start where the one before ended, are whole
//     messages (first, last, batch flags, plus control and at most one check), and have
//     ndim <= kMaxDims or kShapeNotSent; their bytes end within the batch;
//   - reference: an accepted payload is a MemmapReference followed by exactly path_bytes bytes of
//     an absolute path of 1 to 4095 bytes without NUL and without "." or ".." parts, and its
//     offset plus the message's size fits in int64; the returned fields are the payload's.

#include "shm_entry_format.h"

#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace {

namespace shm = tdshm::shm;
using tdshm::fuzz::InputReader;

[[noreturn]] void bug(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_shm_entry: contract broken: %s%s%s\n", what, detail.empty() ? "" : ": ", detail.c_str());
  std::abort();
}

void expect(bool ok, const char* what, const std::string& detail = {}) {
  if (!ok) bug(what, detail);
}

void fuzz_header(InputReader& r) {
  const shm::HeaderFields h = tdshm::fuzz::read_header_fields(r);
  const uint64_t file_bytes = r.u64();
  const shm::HeaderCheck check = shm::check_header(h, file_bytes);
  expect((check.verdict == shm::HeaderVerdict::kValid) == check.problem.empty(),
         "check_header: the verdict is kValid exactly when the problem is empty", check.problem);
  if (check.verdict != shm::HeaderVerdict::kValid) return;
  expect(h.magic == shm::kSegmentMagic && h.layout_version == shm::kLayoutVersion &&
             h.header_bytes == sizeof(shm::SegmentHeader),
         "check_header accepted another magic, version or header size");
  expect(h.world_size >= 1 && h.world_size <= shm::kMaxWorld && h.ring_entries >= 1 &&
             h.ring_entries <= shm::kMaxRingEntries && h.slot_bytes >= 1 && h.slot_bytes <= shm::kMaxSlotBytes,
         "check_header accepted a world size, ring length or slot size out of range");
  expect(h.creator_rank < h.world_size, "check_header accepted a creator rank outside the world");
  expect(h.slots_per_rank >= 1 && h.slots_per_rank <= shm::kMaxSlotsPerRank,
         "check_header accepted a number of arena slots out of range");
  constexpr uint64_t kWindowUnit = uint64_t{shm::kWindowParts} * shm::kCacheLine;
  expect(h.window_bytes >= kWindowUnit && h.window_bytes <= shm::kMaxWindowBytes && h.window_bytes % kWindowUnit == 0,
         "check_header accepted a collective window size out of range");
  expect(h.loan_tickets >= 1 && h.loan_tickets <= shm::kMaxLoanTickets && h.loan_bytes <= shm::kMaxLoanBytes &&
             h.loan_bytes % shm::kLoanPage == 0,
         "check_header accepted a loan region out of range");
  const shm::SegmentGeometry g =
      shm::segment_geometry(h.world_size, h.slot_bytes, h.ring_entries, h.slots_per_rank, h.window_bytes,
                            h.loan_tickets, h.loan_bytes);
  expect(h.entry_bytes == g.entry_bytes && h.ring_bytes == g.ring_bytes && h.rank_table_offset == g.rank_table_offset &&
             h.rings_offset == g.rings_offset && h.arena_offset == g.arena_offset &&
             h.region_bytes == g.region_bytes && h.window_offset == g.window_offset &&
             h.loan_offset == g.loan_offset && h.loan_region_bytes == g.loan_region_bytes &&
             h.segment_bytes == g.segment_bytes,
         "check_header accepted offsets or sizes other than segment_geometry's");
  expect(h.segment_bytes == file_bytes, "check_header accepted a header whose size is not the file's");
}

// check_reference on exactly `payload` (an exact-size copy, so that ASan sees any read past it).
void fuzz_reference(std::span<const uint8_t> payload, uint64_t total_bytes) {
  const std::vector<uint8_t> copy(payload.begin(), payload.end());
  shm::ReferenceFields out;
  const std::string problem = shm::check_reference(copy.data(), copy.size(), total_bytes, out);
  if (!problem.empty()) return;
  shm::MemmapReference header;
  expect(copy.size() >= sizeof header, "check_reference accepted a payload shorter than a MemmapReference");
  std::memcpy(&header, copy.data(), sizeof header);
  const std::string path(copy.begin() + sizeof header, copy.end());
  expect(header.path_bytes == path.size(), "check_reference accepted a path length other than the payload's");
  expect(out.path == path && out.offset == header.offset, "check_reference returned other fields than the payload's");
  expect(!path.empty() && path.size() <= 4095 && path.front() == '/', "check_reference accepted a path that is "
         "empty, longer than 4095 bytes or not absolute", path);
  expect(path.find('\0') == std::string::npos, "check_reference accepted a path with a NUL byte");
  const std::string parts = path + "/";
  expect(parts.find("/./") == std::string::npos && parts.find("/../") == std::string::npos,
         "check_reference accepted a path with '.' or '..' parts", path);
  expect(header.offset <= std::numeric_limits<uint64_t>::max() - total_bytes &&
             header.offset + total_bytes <= uint64_t{std::numeric_limits<int64_t>::max()},
         "check_reference accepted an offset + size past int64");
}

void fuzz_batch(std::span<const uint8_t> records) {
  // A copy of exactly the batch's bytes: a read past them is a sanitizer report.
  const std::vector<uint8_t> batch(records.begin(), records.end());
  constexpr uint32_t kWhole = shm::kEntryFirst | shm::kEntryLast | shm::kEntryBatch;
  constexpr uint32_t kChecks = shm::kEntryKeyCheck | shm::kEntrySchemaCheck;
  uint64_t offset = 0;
  while (offset < batch.size()) {
    shm::EntryFields e;
    shm::EntryShape shape{};
    uint64_t next = offset, payload_at = 0;
    if (!shm::read_batch_record(batch.data(), batch.size(), next, e, shape, payload_at).empty()) {
      expect(next == offset, "read_batch_record moved the offset past a refused record");
      return;
    }
    expect(next > offset && next <= batch.size(), "read_batch_record accepted a record outside the batch");
    expect(payload_at >= offset + sizeof(shm::BatchRecord) && payload_at <= next &&
               e.total_bytes <= next - payload_at && e.chunk_bytes == e.total_bytes,
           "read_batch_record accepted bytes outside their record");
    expect((e.flags & kWhole) == kWhole && (e.flags & ~(kWhole | shm::kEntryControl | kChecks)) == 0,
           "read_batch_record returned flags of another kind of entry", std::to_string(e.flags));
    expect((e.flags & kChecks) != kChecks, "read_batch_record accepted a key check and a schema check at once");
    expect(e.leaves == 0 || (e.flags & shm::kEntryKeyCheck) != 0,
           "read_batch_record accepted a leaf count without a key check");
    expect(e.ndim <= shm::kMaxDims || e.ndim == shm::kShapeNotSent, "read_batch_record accepted ndim > kMaxDims",
           std::to_string(e.ndim));
    offset = next;
  }
}

void fuzz_entries(InputReader& r) {
  const uint64_t slot_bytes = 1 + r.u32() % tdshm::fuzz::kMaxFuzzSlotBytes;
  const uint32_t slots = 1u + r.u16();
  const uint64_t max_message_bytes = r.u64();
  shm::RxProgress rx;  // the consumer of the ring, idle at first
  while (!r.done()) {
    const shm::EntryFields e = tdshm::fuzz::read_entry_fields(r);
    const uint16_t given = r.u16();
    const bool in_line = (e.flags & shm::kEntryInline) != 0;
    const uint64_t room = in_line ? shm::kInlineBytes : slot_bytes;
    std::vector<uint8_t> payload(e.chunk_bytes <= room ? e.chunk_bytes : 0);
    for (size_t i = 0; i < given && !r.done(); ++i) {
      const uint8_t b = r.u8();
      if (i < payload.size()) payload[i] = b;
    }
    const std::string problem = shm::check_entry(e, rx, {slot_bytes, slots}, max_message_bytes);
    if (!problem.empty()) return;  // the engine throws: the ring is not read any further

    const bool first = (e.flags & shm::kEntryFirst) != 0;
    const bool last = (e.flags & shm::kEntryLast) != 0;
    const bool control = (e.flags & shm::kEntryControl) != 0;
    const bool reference = (e.flags & shm::kEntryReference) != 0;
    const bool loan = (e.flags & shm::kEntryLoan) != 0;
    constexpr uint32_t kChecks = shm::kEntryKeyCheck | shm::kEntrySchemaCheck;
    constexpr uint32_t kKnown = shm::kEntryFirst | shm::kEntryLast | shm::kEntryControl | shm::kEntryReference |
                                kChecks | shm::kEntryInline | shm::kEntryLoan;
    expect((e.flags & ~kKnown) == 0, "check_entry accepted unknown flags", std::to_string(e.flags));
    expect((e.flags & kChecks) != kChecks, "check_entry accepted a key check and a schema check at once");
    expect((e.flags & kChecks) == 0 || first, "check_entry accepted a check on a continuation entry");
    expect(e.leaves == 0 || (e.flags & shm::kEntryKeyCheck) != 0, "check_entry accepted a leaf count without a key check");
    expect(e.chunk_bytes <= room, "check_entry accepted a chunk larger than where it is (inline or a slot)");
    expect(in_line || e.slot < slots, "check_entry accepted an arena slot outside the region");
    if (first) {
      expect(!rx.in_message, "check_entry accepted a first entry in the middle of a message");
      expect(e.total_bytes <= max_message_bytes, "check_entry accepted a message larger than the limit");
      expect(e.ndim <= shm::kMaxDims || e.ndim == shm::kShapeNotSent, "check_entry accepted ndim > kMaxDims",
             std::to_string(e.ndim));
      rx = shm::RxProgress{true, control, e.total_bytes, 0};
    } else {
      expect(rx.in_message, "check_entry accepted a continuation outside a message");
      expect(control == rx.control, "check_entry accepted a change of the control flag mid-message");
    }
    if (loan) {
      expect(first && last && in_line && !reference, "check_entry accepted a loan that is not one inline entry");
      expect(e.chunk_bytes == sizeof(shm::LoanReference), "check_entry accepted a loan reference of another size");
      rx = shm::RxProgress{};
      continue;
    }
    if (reference) {
      expect(first && last, "check_entry accepted a reference that is not a whole message");
      expect(e.chunk_bytes >= sizeof(shm::MemmapReference), "check_entry accepted a reference shorter than its header");
      fuzz_reference(payload, e.total_bytes);
      rx = shm::RxProgress{};
      continue;
    }
    expect(e.chunk_offset == rx.received, "check_entry accepted a chunk at another offset than the bytes received");
    expect(e.chunk_bytes <= rx.total - rx.received, "check_entry accepted a chunk past the end of the message");
    rx.received += e.chunk_bytes;
    expect(last == (rx.received == rx.total), "check_entry accepted a last flag that disagrees with the size");
    if (last) rx = shm::RxProgress{};
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  InputReader r(std::span<const uint8_t>(data, size));
  try {
    switch (static_cast<tdshm::fuzz::ShmFuzzMode>(r.u8() % 4)) {
      case tdshm::fuzz::ShmFuzzMode::kHeader:
        fuzz_header(r);
        break;
      case tdshm::fuzz::ShmFuzzMode::kEntries:
        fuzz_entries(r);
        break;
      case tdshm::fuzz::ShmFuzzMode::kBatch: fuzz_batch(r.rest()); break;
      case tdshm::fuzz::ShmFuzzMode::kReference: {
        const uint64_t total_bytes = r.u64();
        fuzz_reference(r.rest(), total_bytes);
        break;
      }
    }
  } catch (const std::exception& e) {
    bug("an exception escaped", e.what());
  }
  return 0;
}
