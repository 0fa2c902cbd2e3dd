// Binary compatibility of the structs that live in a segment. These numbers are the layout that
// kLayoutVersion 8 promises to every process attached to a segment: changing a struct without
// bumping the version makes one of these fail.

#include "shm/layout/segment_layout.h"

#include <tdshm/process_group.h>

#include <cstring>
#include <vector>

namespace {

using namespace tdshm::shm;

TEST(ShmLayout, VersionAndMagicArePinned) {
  EXPECT_EQ(kLayoutVersion, 10u);
  char magic[8];
  std::memcpy(magic, &kSegmentMagic, 8);
  EXPECT_EQ(std::string(magic, 8), "TDSHMSG1");
  EXPECT_EQ(kCacheLine, 64u);
  EXPECT_EQ(kMaxDims, 8u);
}

TEST(ShmLayout, BatchesArePinned) {
  // Layout 10: the flag and a record's bytes (its struct, the sizes of 2 to 8 dimensions, the
  // message padded to 8 bytes).
  EXPECT_EQ(uint32_t{kEntryBatch}, 512u);
  EXPECT_EQ(sizeof(BatchRecord), 24u);
  EXPECT_EQ(offsetof(BatchRecord, tag), 0u);
  EXPECT_EQ(offsetof(BatchRecord, bytes), 8u);
  EXPECT_EQ(offsetof(BatchRecord, flags), 12u);
  EXPECT_EQ(offsetof(BatchRecord, dtype), 16u);
  EXPECT_EQ(offsetof(BatchRecord, ndim), 17u);
  EXPECT_EQ(offsetof(BatchRecord, leaves), 18u);
  EXPECT_EQ(offsetof(BatchRecord, check), 20u);
  EXPECT_EQ(batch_record_bytes(1, 8), 32u);
  EXPECT_EQ(batch_record_bytes(2, 24), 24u + 16u + 24u);
  EXPECT_EQ(batch_record_bytes(3, 41), 24u + 24u + 48u);
  EXPECT_EQ(batch_record_bytes(0, 0), 24u);
  EXPECT_EQ(batch_record_bytes(kShapeNotSent, 4), 32u);  // no sizes sent past 8 dimensions
  EXPECT_TRUE(chunk_in_ring(kEntryBatch));
  EXPECT_TRUE(has_span(kEntryBatch));
  EXPECT_TRUE(has_span(kEntrySpan | kEntryFirst | kEntryLast));
  EXPECT_FALSE(has_span(kEntryInline | kEntryFirst | kEntryLast));
}

TEST(ShmLayout, SpansAndSeqWordsArePinned) {
  // Layout 9: the flag, the limits and the seq word a peer of the same layout computes.
  EXPECT_EQ(uint32_t{kEntrySpan}, 256u);
  EXPECT_EQ(kMaxSpanBytes, 8192u);
  EXPECT_EQ(span_entries(4096), 22u);
  EXPECT_EQ(span_limit(64), 3072u);  // this build's senders (receivers take up to 8 KiB)
  EXPECT_EQ(ring_key(0x0123456789abcdefull, 2, 5), 0x96f5076973a02b13ull);
  EXPECT_NE(ring_key(1, 0, 1), ring_key(1, 1, 0));
  EXPECT_EQ(seq_word(0x8000000000000000ull, 0), 0x8000000000000001ull);
  for (uint64_t pos : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 40}) EXPECT_NE(seq_word(ring_key(9, 3, 4), pos), 0u);
}

TEST(ShmLayout, SegmentHeaderV3) {
  EXPECT_EQ(sizeof(SegmentHeader), 256u);
  EXPECT_EQ(alignof(SegmentHeader), 8u);
  EXPECT_EQ(offsetof(SegmentHeader, magic), 0u);
  EXPECT_EQ(offsetof(SegmentHeader, layout_version), 8u);
  EXPECT_EQ(offsetof(SegmentHeader, header_bytes), 12u);
  EXPECT_EQ(offsetof(SegmentHeader, segment_bytes), 16u);
  EXPECT_EQ(offsetof(SegmentHeader, world_size), 24u);
  EXPECT_EQ(offsetof(SegmentHeader, ring_entries), 28u);
  EXPECT_EQ(offsetof(SegmentHeader, slot_bytes), 32u);
  EXPECT_EQ(offsetof(SegmentHeader, rank_table_offset), 40u);
  EXPECT_EQ(offsetof(SegmentHeader, rings_offset), 48u);
  EXPECT_EQ(offsetof(SegmentHeader, ring_bytes), 56u);
  EXPECT_EQ(offsetof(SegmentHeader, entry_bytes), 64u);
  EXPECT_EQ(offsetof(SegmentHeader, creator_pid), 72u);
  EXPECT_EQ(offsetof(SegmentHeader, creator_rank), 76u);
  EXPECT_EQ(offsetof(SegmentHeader, creator_start_time), 80u);
  EXPECT_EQ(offsetof(SegmentHeader, incarnation), 88u);
  EXPECT_EQ(offsetof(SegmentHeader, arena_offset), 96u);
  EXPECT_EQ(offsetof(SegmentHeader, region_bytes), 104u);
  EXPECT_EQ(offsetof(SegmentHeader, slots_per_rank), 112u);
  EXPECT_EQ(offsetof(SegmentHeader, window_offset), 120u);
  EXPECT_EQ(offsetof(SegmentHeader, window_bytes), 128u);
  EXPECT_EQ(offsetof(SegmentHeader, loan_offset), 136u);
  EXPECT_EQ(offsetof(SegmentHeader, loan_region_bytes), 144u);
  EXPECT_EQ(offsetof(SegmentHeader, loan_bytes), 152u);
  EXPECT_EQ(offsetof(SegmentHeader, loan_tickets), 160u);
  EXPECT_TRUE(std::is_standard_layout_v<SegmentHeader>);
}

TEST(ShmLayout, RankSlotV3) {
  EXPECT_EQ(sizeof(RankSlot), 128u);
  EXPECT_EQ(offsetof(RankSlot, state), 0u);
  EXPECT_EQ(offsetof(RankSlot, pid), 4u);
  EXPECT_EQ(offsetof(RankSlot, start_time), 8u);
  EXPECT_EQ(offsetof(RankSlot, published), 16u);
  EXPECT_EQ(offsetof(RankSlot, consumed), 24u);
  EXPECT_EQ(offsetof(RankSlot, step_check), 32u);
  EXPECT_EQ(sizeof(RankSlot::step_check), 32u);
  EXPECT_EQ(offsetof(RankSlot, wake_seq), 64u);
  EXPECT_EQ(offsetof(RankSlot, sleepers), 68u);
  EXPECT_EQ(offsetof(RankSlot, pid_ns), 72u);  // in layout 6's reserved bytes: 0 = not recorded
  EXPECT_EQ(kRankFree, 0u);
  EXPECT_EQ(kRankLive, 1u);
  EXPECT_EQ(kRankLeft, 2u);
  EXPECT_EQ(kRankAbandoned, 3u);
}

TEST(ShmLayout, RingControlV1) {
  EXPECT_EQ(sizeof(RingControl), 128u);
  EXPECT_EQ(alignof(RingControl), 64u);
  EXPECT_EQ(offsetof(RingControl, head), 0u);
  EXPECT_EQ(offsetof(RingControl, tail), 64u);
}

TEST(ShmLayout, EntryHeaderV7) {
  // Line 0: the fields a whole small message needs and its first 24 inline bytes.
  EXPECT_EQ(sizeof(EntryHeader), 40u);
  EXPECT_EQ(offsetof(EntryHeader, seq), 0u);
  EXPECT_EQ(offsetof(EntryHeader, tag), 8u);
  EXPECT_EQ(offsetof(EntryHeader, total_bytes), 16u);
  EXPECT_EQ(offsetof(EntryHeader, chunk_bytes), 24u);
  EXPECT_EQ(offsetof(EntryHeader, flags), 28u);
  EXPECT_EQ(offsetof(EntryHeader, dtype), 32u);
  EXPECT_EQ(offsetof(EntryHeader, ndim), 33u);
  EXPECT_EQ(offsetof(EntryHeader, leaves), 34u);
  EXPECT_EQ(offsetof(EntryHeader, check), 36u);
  EXPECT_EQ(kInlineBytes, 72u);
  EXPECT_EQ(kCacheLine - sizeof(EntryHeader), 24u);  // inline bytes on line 0
  // Line 1: the rest of the inline bytes, then the tail.
  EXPECT_EQ(kEntryTailOffset, 112u);
  EXPECT_EQ(sizeof(EntryTail), 16u);
  EXPECT_EQ(offsetof(EntryTail, chunk_offset), 0u);
  EXPECT_EQ(offsetof(EntryTail, slot), 8u);
  EXPECT_EQ(offsetof(EntryTail, reserved), 12u);
  EXPECT_EQ(kEntryShapeOffset, 128u);
  EXPECT_EQ(kEntryBytes, 192u);
  EXPECT_EQ(sizeof(EntryShape), 64u);
  EXPECT_EQ(kEntryFirst, 1u);
  EXPECT_EQ(kEntryLast, 2u);
  EXPECT_EQ(kEntryControl, 4u);
  EXPECT_EQ(kEntryReference, 8u);
  EXPECT_EQ(kEntryKeyCheck, 16u);
  EXPECT_EQ(kEntrySchemaCheck, 32u);
  EXPECT_EQ(kEntryInline, 64u);
  EXPECT_EQ(kEntryLoan, 128u);
  EXPECT_EQ(kShapeNotSent, 255u);
}

TEST(ShmLayout, ArenaSlotV5) {
  EXPECT_EQ(sizeof(ArenaSlot), 8u);
  EXPECT_EQ(offsetof(ArenaSlot, state), 0u);
  EXPECT_EQ(kSlotFree, 0u);
}

TEST(ShmLayout, MemmapReference) {
  EXPECT_EQ(sizeof(MemmapReference), 16u);
  EXPECT_EQ(offsetof(MemmapReference, offset), 0u);
  EXPECT_EQ(offsetof(MemmapReference, path_bytes), 8u);
}

TEST(ShmLayout, LoanReference) {
  EXPECT_EQ(sizeof(LoanReference), 16u);
  EXPECT_EQ(offsetof(LoanReference, offset), 0u);
  EXPECT_EQ(offsetof(LoanReference, ticket), 8u);
  EXPECT_EQ(sizeof(LoanTicket), 8u);
  EXPECT_EQ(kLoanPage, 4096u);
}

TEST(ShmLayout, GeometryOfAKnownSegment) {
  // 2 ranks, 4 KiB slots, rings of 4 entries, 8 slots per rank, 1 KiB windows.
  const SegmentGeometry g = segment_geometry(2, 4096, 4, 8, 1024, 64, 10000);
  EXPECT_EQ(g.entry_bytes, 192u);
  EXPECT_EQ(g.ring_bytes, 128u + 4u * 192u);
  EXPECT_EQ(g.rank_table_offset, 256u);
  EXPECT_EQ(g.rings_offset, 512u);
  EXPECT_EQ(g.arena_offset, 512u + 4u * g.ring_bytes);
  EXPECT_EQ(g.slot_table_bytes, 64u);
  EXPECT_EQ(g.slot_stride, 4096u);
  EXPECT_EQ(g.region_bytes, 64u + 8u * 4096u);
  EXPECT_EQ(g.window_offset, g.arena_offset + 2u * g.region_bytes);
  EXPECT_EQ(g.window_bytes, 1024u);
  // Layout 8: the loan regions after the windows, on a page; 64 tickets take one page, a heap
  // of 10000 bytes three.
  EXPECT_EQ(g.loan_offset, (g.window_offset + 2u * 1024u + 4095u) / 4096u * 4096u);
  EXPECT_EQ(g.loan_table_bytes, 4096u);
  EXPECT_EQ(g.loan_bytes, 12288u);
  EXPECT_EQ(g.loan_region_bytes, 4096u + 12288u);
  EXPECT_EQ(g.segment_bytes, g.loan_offset + 2u * g.loan_region_bytes);
  // A window is four cache-line-aligned parts.
  EXPECT_EQ(segment_geometry(2, 4096, 4, 8, 100, 1, 0).window_bytes, 256u);
  // A slot size that is not a multiple of a cache line is padded to one; 9 slots take 2 lines of states.
  EXPECT_EQ(segment_geometry(3, 100, 2, 9, 256, 1, 0).slot_stride, 128u);
  EXPECT_EQ(segment_geometry(3, 100, 2, 9, 256, 1, 0).slot_table_bytes, 128u);
  EXPECT_EQ(segment_geometry(3, 100, 2, 9, 256, 1, 0).rings_offset, 640u);
  // The first 24 inline payload bytes share the header's cache line.
  EXPECT_EQ(sizeof(EntryHeader) + 24, kCacheLine);
}

TEST(ShmLayout, MemoryGrowsWithTheWorldNotItsSquare) {
  // Defaults: 64 KiB slots, 64 slots per rank, rings of 64 entries, 1 MiB windows.
  auto mib = [](uint32_t world) {
    return double(segment_geometry(world, 64 << 10, 64, 64, 1 << 20, 64, 1 << 20).segment_bytes) / (1 << 20);
  };
  EXPECT_LT(mib(9), 64.0);    // an 8-worker loader fits Docker's 64 MiB /dev/shm
  EXPECT_LT(mib(64), 512.0);  // was 16.9 GiB in layout 4
  // The arena, the windows and the loan regions (a page of tickets and 1 MiB of heap) are linear
  // in the world; the rings (12 KiB per ordered pair) are the square term.
  EXPECT_NEAR(mib(64) - 64 * (6.0 + 4096.0 / (1 << 20)), 64.0 * 64 * (128 + 64 * 192) / (1 << 20), 1.0);
  // The defaults of ShmOptions are these.
  const tdshm::ShmOptions o;
  EXPECT_EQ(o.loan_bytes, size_t{1} << 20);
  EXPECT_EQ(o.loan_tickets, 64u);
}

TEST(ShmLayout, StructsWorkOnAPlainByteBuffer) {
  // Offsets, not pointers: a header written into one buffer reads the same from a copy of it.
  std::vector<uint64_t> a(32, 0), b(32, 0);
  auto* h = reinterpret_cast<SegmentHeader*>(a.data());
  h->magic = kSegmentMagic;
  h->world_size = 3;
  h->layout_version.store(kLayoutVersion);
  std::memcpy(b.data(), a.data(), sizeof(SegmentHeader));
  const auto* copy = reinterpret_cast<const SegmentHeader*>(b.data());
  EXPECT_EQ(copy->magic, kSegmentMagic);
  EXPECT_EQ(copy->world_size, 3u);
  EXPECT_EQ(copy->layout_version.load(), kLayoutVersion);
}

}  // namespace
