// The parts of a segment (layout 7) on plain buffers, without OS shared memory or processes: the
// metadata ring (ring.h) and what its consumer does with an entry (validate.h: read_entry,
// check_entry), the slot arena (arena.h), the matcher of receives and messages (matcher.h), the
// pool of early-message buffers (buffer_pool.h), and the recycled blocks of the per-message
// objects (common/recycle.h), and the engine's lock (light_mutex.h).
// Both ends of a ring or an arena are driven from one thread, except in
// ShmRingThreads.MillionEntriesThroughEightSlots, which runs a producer and a consumer thread
// against each other (the acquire/release pairs; it also runs under the tsan preset), and
// LightMutexThreads, whose threads contend for one lock.

#include "common/recycle.h"
#include "shm/collective/reduce.h"
#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"
#include "shm/parts/arena.h"
#include "shm/parts/buffer_pool.h"
#include "shm/parts/light_mutex.h"
#include "shm/parts/matcher.h"
#include "shm/parts/ring.h"

#include <atomic>
#include <bit>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace tdshm::shm;

#if defined(__SANITIZE_THREAD__)
constexpr bool kUnderTsan = true;
#else
constexpr bool kUnderTsan = false;
#endif

/// Zeroed bytes starting on a cache line (what a fresh segment's pages are).
class AlignedBuffer {
 public:
  explicit AlignedBuffer(uint64_t bytes) : lines_((bytes + kCacheLine - 1) / kCacheLine), bytes_(bytes) {}
  uint8_t* data() noexcept { return lines_.front().b; }
  uint64_t size() const noexcept { return bytes_; }

 private:
  struct alignas(kCacheLine) Line {
    uint8_t b[kCacheLine] = {};
  };
  std::vector<Line> lines_;
  uint64_t bytes_;
};

// ---- ring ------------------------------------------------------------------------------------

uint64_t ring_bytes(uint32_t entries) { return sizeof(RingControl) + uint64_t{entries} * kEntryBytes; }

uint8_t inline_byte(uint64_t i, uint64_t k) { return static_cast<uint8_t>(i * 7 + k * 13 + 1); }

/// Fills the producer's current entry with values derived from `i` (every field differs from
/// one i to the next, so a stale or misplaced entry shows).
void fill_entry(RingProducer& p, uint64_t i) {
  EntryHeader& e = p.entry();
  e.tag = static_cast<int64_t>(i) * 3 - 1000000007;
  e.total_bytes = i ^ 0x5555;
  p.tail().chunk_offset = i * 2;
  e.chunk_bytes = static_cast<uint32_t>(i % 73);
  e.flags = static_cast<uint32_t>(i & 127);
  e.dtype = static_cast<uint8_t>(i);
  e.ndim = static_cast<uint8_t>(i % 9);
  e.leaves = static_cast<uint16_t>(i * 5);
  e.check = static_cast<uint32_t>(i * 2654435761u);
  p.tail().slot = static_cast<uint32_t>(i % 64);
  p.tail().reserved = 0;
  uint8_t* inl = p.inline_bytes();
  for (uint64_t k = 0; k < kInlineBytes; ++k) inl[k] = inline_byte(i, k);
  EntryShape& s = p.shape();
  for (size_t d = 0; d < kMaxDims; ++d) s.dims[d] = static_cast<int64_t>(i * 10 + d);
}

/// "" when the consumer's copy, inline bytes and shape are those fill_entry(i) wrote.
std::string mismatch(const EntryFields& f, const RingConsumer& c, uint64_t i) {
  auto bad = [i](const char* what) { return std::string(what) + " of entry " + std::to_string(i); };
  if (f.tag != static_cast<int64_t>(i) * 3 - 1000000007) return bad("tag");
  if (f.total_bytes != (i ^ 0x5555)) return bad("total_bytes");
  // The tail is read only where the flags say the entry has it.
  if (f.chunk_offset != ((i & kEntryFirst) ? 0 : i * 2)) return bad("chunk_offset");
  if (f.chunk_bytes != static_cast<uint32_t>(i % 73)) return bad("chunk_bytes");
  if (f.flags != static_cast<uint32_t>(i & 127)) return bad("flags");
  if (f.dtype != static_cast<uint8_t>(i)) return bad("dtype");
  if (f.ndim != static_cast<uint8_t>(i % 9)) return bad("ndim");
  if (f.leaves != static_cast<uint16_t>(i * 5)) return bad("leaves");
  if (f.check != static_cast<uint32_t>(i * 2654435761u)) return bad("check");
  if (f.slot != ((i & kEntryInline) ? 0 : static_cast<uint32_t>(i % 64))) return bad("slot");
  const uint8_t* inl = c.inline_bytes();
  for (uint64_t k = 0; k < kInlineBytes; ++k) {
    if (inl[k] != inline_byte(i, k)) return bad("inline byte") + " at " + std::to_string(k);
  }
  for (size_t d = 0; d < kMaxDims; ++d) {
    if (c.shape().dims[d] != static_cast<int64_t>(i * 10 + d)) return bad("shape dim");
  }
  return {};
}

/// The key of the test rings' seq words (any ring_key).
constexpr uint64_t kTestKey = ring_key(0x1234, 0, 1);

/// A zeroed ring of `entries` entries with both ends.
struct TestRing {
  explicit TestRing(uint32_t n)
      : buffer(ring_bytes(n)), view(buffer.data(), n, kTestKey), producer(view), consumer(view) {}
  AlignedBuffer buffer;
  RingView view;
  RingProducer producer;
  RingConsumer consumer;

  void push(uint64_t i) {
    ASSERT_TRUE(producer.has_room());
    fill_entry(producer, i);
    producer.publish();
  }
  void pop(uint64_t i) {
    EntryFields f;
    ASSERT_TRUE(consumer.peek(f)) << "entry " << i;
    EXPECT_EQ(mismatch(f, consumer, i), "");
    consumer.consume();
  }
};

TEST(ShmRing, ViewAddressesEntriesModuloTheirCount) {
  TestRing r(4);
  uint8_t* base = r.buffer.data();
  EXPECT_EQ(static_cast<void*>(&r.view.control()), base);
  EXPECT_EQ(r.view.entry_base(0), base + 128);
  EXPECT_EQ(r.view.entry_base(3), base + 128 + 3 * 192);
  EXPECT_EQ(r.view.entry_base(4), r.view.entry_base(0));
  EXPECT_EQ(r.view.entry_base(4 * 1000 + 2), r.view.entry_base(2));
  EXPECT_EQ(r.view.inline_bytes(1), base + 128 + 192 + 40);
  EXPECT_EQ(reinterpret_cast<uint8_t*>(&r.view.tail(1)), base + 128 + 192 + 112);
  EXPECT_EQ(reinterpret_cast<uint8_t*>(&r.view.shape(1)), base + 128 + 192 + 128);
  // The last entry ends where the buffer does.
  EXPECT_EQ(r.view.entry_base(3) + kEntryBytes, base + r.buffer.size());
}

TEST(ShmRing, LinesAfterAnEntryGoOnAtEntryZeroAndStayInTheRing) {
  TestRing r(2);
  uint8_t* start = r.buffer.data() + sizeof(RingControl);
  uint8_t* end = r.buffer.data() + r.buffer.size();
  auto lines = [&](uint64_t position, int n) {
    std::vector<const uint8_t*> out;
    r.view.for_lines_after(position, n, [&](const uint8_t* line) { out.push_back(line); });
    return out;
  };
  // Entry 0: its lines 1 and 2, then entry 1's three lines.
  EXPECT_EQ(lines(0, kWaitPrefetchLines),
            (std::vector<const uint8_t*>{start + 64, start + 128, start + 192, start + 256, start + 320}));
  // Entry 1 (position 3: the second lap): its lines 1 and 2, then entry 0's, from the ring's start.
  EXPECT_EQ(lines(3, 5), (std::vector<const uint8_t*>{start + 256, start + 320, start, start + 64, start + 128}));
  // Any count, at any position: every line inside the ring, on a line boundary, one after another.
  for (uint64_t position : {0ull, 1ull, 2ull, 1001ull}) {
    const auto all = lines(position, 20);
    ASSERT_EQ(all.size(), 20u);
    for (size_t i = 0; i < all.size(); ++i) {
      EXPECT_GE(all[i], start);
      EXPECT_LT(all[i], end);
      EXPECT_EQ((all[i] - start) % 64, 0);
      const uint8_t* before = i == 0 ? r.view.entry_base(position) : all[i - 1];
      EXPECT_EQ(all[i], before + 64 == end ? start : before + 64);
    }
  }
  EXPECT_TRUE(lines(0, 0).empty());
}

TEST(ShmRing, TheReadyHintSaysWhatPeekSays) {
  TestRing r(4);
  for (uint64_t i = 0; i < 9; ++i) {  // over two laps and a wrap of the lines it asks for
    EXPECT_FALSE(r.consumer.ready_hint()) << i;
    ASSERT_TRUE(r.producer.has_room());
    fill_entry(r.producer, i);
    EXPECT_FALSE(r.consumer.ready_hint()) << i;  // filled, not published
    r.producer.publish();
    EXPECT_TRUE(r.consumer.ready_hint()) << i;
    r.pop(i);
  }
}

TEST(ShmRing, AWaitingConsumerAsksForFewerLinesAfterALongSpan) {
  TestRing r(8);
  EXPECT_EQ(r.consumer.wait_lines(), kWaitPrefetchLines);  // nothing received yet
  const std::vector<uint8_t> bytes(3 * kEntryBytes, 7);
  for (const uint64_t span : {0, 1, 2, 0, 3, 1}) {
    ASSERT_TRUE(r.producer.has_room(1 + span));
    fill_entry(r.producer, span);
    r.producer.write_span(bytes.data(), span * kEntryBytes);
    r.producer.publish(span);
    EntryFields f;
    ASSERT_TRUE(r.consumer.peek(f));
    r.consumer.consume(span);
    EXPECT_EQ(r.consumer.wait_lines(), span <= 1 ? kWaitPrefetchLines : kWaitPrefetchLinesAfterSpan) << span;
    EXPECT_EQ(RingConsumer(r.consumer).wait_lines(), r.consumer.wait_lines());  // copies keep it
  }
}

TEST(ShmRing, ProducerHasRoomUntilFullThenAfterEachConsume) {
  constexpr uint32_t n = 4;
  TestRing r(n);
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(r.producer.has_room()) << "after " << i << " entries";
    fill_entry(r.producer, i);
    r.producer.publish();
  }
  EXPECT_FALSE(r.producer.has_room());
  EXPECT_FALSE(r.producer.has_room());  // asking again reads the tail again; still full
  EXPECT_EQ(r.producer.position(), n);
  EXPECT_EQ(r.consumer.depth(), n);
  EXPECT_EQ(r.view.control().head.load(), n);

  // Peeking does not hand the entry back; consuming does.
  EntryFields f;
  ASSERT_TRUE(r.consumer.peek(f));
  EXPECT_FALSE(r.producer.has_room());
  r.consumer.consume();
  EXPECT_EQ(r.view.control().tail.load(), 1u);
  ASSERT_TRUE(r.producer.has_room());
  fill_entry(r.producer, n);
  r.producer.publish();
  EXPECT_FALSE(r.producer.has_room());

  // Drain: every entry comes out in order, then there is nothing.
  for (uint64_t i = 1; i <= n; ++i) r.pop(i);
  EXPECT_FALSE(r.consumer.peek(f));
  EXPECT_EQ(r.consumer.depth(), 0u);
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(r.producer.has_room()) << i;
    fill_entry(r.producer, 100 + i);
    r.producer.publish();
  }
  EXPECT_FALSE(r.producer.has_room());
}

TEST(ShmRing, PositionsWrapAndEveryEntryReadsBackInOrder) {
  for (uint32_t n : {1u, 3u, 5u, 8u}) {
    SCOPED_TRACE("ring of " + std::to_string(n));
    TestRing r(n);
    const uint64_t total = 10ull * n;
    uint64_t pushed = 0, popped = 0;
    // Batches of varying size (1 .. n), so the ring is full, half full and empty at every offset.
    for (uint64_t round = 0; popped < total; ++round) {
      ASSERT_LT(round, 10 * total) << "no progress: " << pushed << " pushed, " << popped << " popped";
      const uint64_t batch = 1 + round % n;
      for (uint64_t k = 0; k < batch && pushed < total && r.producer.has_room(); ++k) r.push(pushed++);
      if (pushed - popped == n) {
        EXPECT_FALSE(r.producer.has_room());
      }
      for (uint64_t k = 0; k < (round % 2 == 0 ? batch : n) && popped < pushed; ++k) r.pop(popped++);
      if (HasFatalFailure()) return;
    }
    EXPECT_EQ(r.producer.position(), total);
    EXPECT_EQ(r.consumer.position(), total);
    EXPECT_EQ(r.view.control().head.load(), total);
    EXPECT_EQ(r.view.control().tail.load(), total);
    EntryFields f;
    EXPECT_FALSE(r.consumer.peek(f));
  }
}

TEST(ShmRing, PeekIsFalseForAnEntryNotPublished) {
  TestRing r(4);
  EntryFields f;
  EXPECT_FALSE(r.consumer.peek(f));  // zeroed ring
  // Filled but not published: the consumer does not see it.
  ASSERT_TRUE(r.producer.has_room());
  fill_entry(r.producer, 7);
  EXPECT_FALSE(r.consumer.peek(f));
  EXPECT_EQ(r.consumer.depth(), 0u);
  r.producer.publish();
  ASSERT_TRUE(r.consumer.peek(f));
  EXPECT_EQ(mismatch(f, r.consumer, 7), "");
  // Peek does not move on: the same entry again until consume().
  ASSERT_TRUE(r.consumer.peek(f));
  EXPECT_EQ(r.consumer.position(), 0u);
  r.consumer.consume();
  EXPECT_FALSE(r.consumer.peek(f));
}

TEST(ShmRing, ConsumerSeesOnlyTheSeqWordOfItsPosition) {
  constexpr uint32_t n = 4;
  TestRing r(n);
  // Move both ends past a lap and a half: the consumer's entry (position 6, entry 2) holds the
  // seq of position 2 from the previous lap.
  for (uint64_t i = 0; i < 6; ++i) {
    r.push(i);
    r.pop(i);
  }
  ASSERT_EQ(r.consumer.position(), 6u);
  std::atomic<uint64_t>& seq = r.view.header(6).seq;
  EXPECT_EQ(seq.load(), seq_word(kTestKey, 2));  // the older lap's

  EntryFields sentinel;
  sentinel.tag = -42;
  sentinel.slot = 12345;
  // Unkeyed values (position + 1, what a span's payload may hold) and other positions' words.
  for (uint64_t hostile : {uint64_t{3}, uint64_t{0}, uint64_t{7}, uint64_t{8}, seq_word(kTestKey, 5),
                           seq_word(kTestKey, 7), seq_word(kTestKey, 6 + n), seq_word(kTestKey, 6 - n),
                           seq_word(ring_key(0x1234, 1, 0), 6), uint64_t{UINT64_MAX}, uint64_t{7} << 32 | 7}) {
    SCOPED_TRACE("seq " + std::to_string(hostile));
    seq.store(hostile);
    EntryFields f = sentinel;
    EXPECT_FALSE(r.consumer.peek(f));
    EXPECT_EQ(f.tag, -42);  // untouched
    EXPECT_EQ(f.slot, 12345u);
    EXPECT_EQ(r.consumer.position(), 6u);
  }
  // The right seq (as the producer would store it) is seen.
  fill_entry(r.producer, 6);
  seq.store(seq_word(kTestKey, 6));
  EntryFields f;
  ASSERT_TRUE(r.consumer.peek(f));
  EXPECT_EQ(mismatch(f, r.consumer, 6), "");
}

TEST(ShmRing, HostileHeadAndTailDoNotMakeTheConsumerRead) {
  constexpr uint32_t n = 4;
  TestRing r(n);
  // Entries filled (as a crashed or buggy producer may leave them) but none published, and a
  // head that claims many: the consumer goes by seq only.
  for (uint32_t e = 0; e < n; ++e) {
    std::memset(r.view.entry_base(e), 0xab, kEntryBytes);
    r.view.header(e).seq.store(0);
  }
  EntryFields f;
  for (uint64_t head : {uint64_t{1}, uint64_t{n}, uint64_t{1000}, uint64_t{UINT64_MAX}}) {
    r.view.control().head.store(head);
    r.view.control().tail.store(head / 2);
    EXPECT_FALSE(r.consumer.peek(f)) << "head " << head;
    EXPECT_EQ(r.consumer.position(), 0u);
  }
  // A hostile head/tail does not move the consumer either: after a real publish (which stores
  // head = 1 again) it reads position 0's entry.
  r.view.control().head.store(77);
  ASSERT_TRUE(r.producer.has_room());
  fill_entry(r.producer, 0);
  r.producer.publish();
  r.view.control().head.store(12345);
  r.pop(0);
  EXPECT_FALSE(r.consumer.peek(f));
  EXPECT_EQ(r.consumer.position(), 1u);
}

TEST(ShmRing, ATailPastTheHeadGivesTheProducerNoRoom) {
  // A consumer that stores a tail beyond what was published cannot make the producer believe
  // it has more than a full ring of room (pos - tail wraps to a huge value: no room).
  constexpr uint32_t n = 4;
  TestRing r(n);
  for (uint64_t i = 0; i < n; ++i) r.push(i);
  ASSERT_FALSE(r.producer.has_room());
  for (uint64_t tail : {uint64_t{n + 1}, uint64_t{1000}, uint64_t{UINT64_MAX / 2}}) {
    r.view.control().tail.store(tail);
    EXPECT_FALSE(r.producer.has_room()) << "tail " << tail;
  }
}

TEST(ShmRing, ReadEntryCopiesTheFields) {
  TestRing r(2);
  r.push(5);
  EntryFields f;
  ASSERT_TRUE(r.consumer.peek(f));
  EXPECT_EQ(mismatch(f, r.consumer, 5), "");
  // The peer rewrites the entry after the copy was taken: the copy keeps what it read.
  EntryHeader& e = r.view.header(0);
  EntryTail& t = r.view.tail(0);
  e.tag = 999;
  e.total_bytes = 1ull << 40;
  t.chunk_offset = 3;
  e.chunk_bytes = 1u << 31;
  e.flags = kEntryControl;  // a continuation in a slot: its tail is read
  e.dtype = 200;
  e.ndim = 250;
  e.leaves = 65535;
  e.check = 1;
  t.slot = 1u << 30;
  EXPECT_EQ(f.tag, 5 * 3 - 1000000007);
  EXPECT_EQ(f.total_bytes, 5u ^ 0x5555u);
  EXPECT_EQ(f.chunk_offset, 0u);  // entry 5's flags are kEntryFirst | kEntryControl: offset 0
  EXPECT_EQ(f.chunk_bytes, 5u);
  EXPECT_EQ(f.flags, 5u);
  EXPECT_EQ(f.dtype, 5u);
  EXPECT_EQ(f.ndim, 5u);
  EXPECT_EQ(f.leaves, 25u);
  EXPECT_EQ(f.check, static_cast<uint32_t>(5 * 2654435761u));
  EXPECT_EQ(f.slot, 5u);
  // A fresh read_entry sees the new values (it reads the memory, not a cache of it).
  EntryFields g;
  read_entry(e, t, g);
  EXPECT_EQ(g.tag, 999);
  EXPECT_EQ(g.total_bytes, 1ull << 40);
  EXPECT_EQ(g.chunk_offset, 3u);
  EXPECT_EQ(g.chunk_bytes, 1u << 31);
  EXPECT_EQ(g.flags, uint32_t{kEntryControl});
  EXPECT_EQ(g.ndim, 250u);
  EXPECT_EQ(g.leaves, 65535u);
  EXPECT_EQ(g.slot, 1u << 30);
}

// check_entry on copies of entries a peer wrote into the ring: the peer's values, read once.
class ShmRingCheck : public ::testing::Test {
 protected:
  static constexpr ArenaShape kArena{65536, 64, 4};
  static constexpr uint64_t kMaxMessage = uint64_t{1} << 30;

  /// Publishes an entry with these fields at the ring's next position and returns the
  /// consumer's copy.
  EntryFields through_ring(uint32_t flags, uint64_t total, uint64_t offset, uint32_t chunk, uint32_t slot,
                           uint8_t ndim = 1) {
    EXPECT_TRUE(ring_.producer.has_room());
    EntryHeader& e = ring_.producer.entry();
    e.tag = 11;
    e.total_bytes = total;
    ring_.producer.tail().chunk_offset = offset;
    e.chunk_bytes = chunk;
    e.flags = flags;
    e.dtype = 6;
    e.ndim = ndim;
    e.leaves = 0;
    e.check = 0;
    ring_.producer.tail().slot = slot;
    ring_.producer.publish();
    EntryFields f;
    EXPECT_TRUE(ring_.consumer.peek(f));
    ring_.consumer.consume();
    return f;
  }
  std::string check(const EntryFields& f, const RxProgress& rx = {}) { return check_entry(f, rx, kArena, kMaxMessage); }

  TestRing ring_{4};
};

TEST_F(ShmRingCheck, ValidInlineAndSlotEntriesAreAccepted) {
  constexpr uint32_t whole_inline = kEntryFirst | kEntryLast | kEntryInline;
  EXPECT_EQ(check(through_ring(whole_inline, 40, 0, 40, 0)), "");
  EXPECT_EQ(check(through_ring(whole_inline, 72, 0, 72, 0)), "");  // exactly kInlineBytes
  EXPECT_EQ(check(through_ring(whole_inline, 0, 0, 0, 0)), "");    // an empty tensor
  // With kEntryInline the slot field is not looked at.
  EXPECT_EQ(check(through_ring(whole_inline, 8, 0, 8, 0xffffffffu)), "");
  // A whole message in the last slot, exactly slot_bytes.
  EXPECT_EQ(check(through_ring(kEntryFirst | kEntryLast, 65536, 0, 65536, 63)), "");
  // A two-chunk message: a full first slot, then the rest.
  EXPECT_EQ(check(through_ring(kEntryFirst, 100000, 0, 65536, 5)), "");
  RxProgress rx;
  rx.in_message = true;
  rx.total = 100000;
  rx.received = 65536;
  EXPECT_EQ(check(through_ring(kEntryLast, 0, 65536, 100000 - 65536, 6), rx), "");
  // A last chunk small enough to travel inline.
  rx.received = 100000 - 50;
  EXPECT_EQ(check(through_ring(kEntryLast | kEntryInline, 0, 100000 - 50, 50, 0), rx), "");
}

TEST_F(ShmRingCheck, HostileEntriesAreRefused) {
  constexpr uint32_t whole = kEntryFirst | kEntryLast;
  // An inline chunk larger than the entry holds.
  EXPECT_EQ(check(through_ring(whole | kEntryInline, 73, 0, 73, 0)), "inline chunk of 73 bytes");
  EXPECT_EQ(check(through_ring(whole | kEntryInline, 1u << 31, 0, 1u << 31, 0)), "inline chunk of 2147483648 bytes");
  // A slot the sender's region does not have.
  EXPECT_EQ(check(through_ring(whole, 100, 0, 100, 64)), "arena slot 64 of 64");
  EXPECT_EQ(check(through_ring(whole, 100, 0, 100, 0xffffffffu)), "arena slot 4294967295 of 64");
  // A chunk larger than a slot.
  EXPECT_EQ(check(through_ring(whole, 65537, 0, 65537, 0)), "chunk of 65537 bytes in a slot of 65536");
  EXPECT_EQ(check(through_ring(whole, 1u << 31, 0, 0xffffffffu, 0)), "chunk of 4294967295 bytes in a slot of 65536");
  // Flags tdshm does not know.
  EXPECT_EQ(check(through_ring(whole | 512, 8, 0, 8, 0)), "unknown flags 515");
  // A loan is one whole inline entry whose chunk is a LoanReference.
  EXPECT_EQ(check(through_ring(whole | kEntryInline | kEntryLoan, 100, 0, 16, 0)), "");
  EXPECT_EQ(check(through_ring(whole | kEntryInline | kEntryLoan, 100, 0, 8, 0)), "loan reference of 8 bytes");
  EXPECT_EQ(check(through_ring(whole | kEntryLoan, 100, 0, 16, 0)), "a loan that is not a whole message in one entry");
  EXPECT_EQ(check(through_ring(kEntryFirst | kEntryInline | kEntryLoan, 100, 0, 16, 0)),
            "a loan that is not a whole message in one entry");
  EXPECT_EQ(check(through_ring(whole | kEntryInline | kEntryLoan | kEntryReference, 100, 0, 16, 0)),
            "a loan that is not a whole message in one entry");
  EXPECT_EQ(check(through_ring(whole | kEntryInline | 0x80000000u, 8, 0, 8, 0)),
            "unknown flags " + std::to_string(whole | kEntryInline | 0x80000000u));
  // The arena checks apply to continuation chunks too.
  RxProgress rx;
  rx.in_message = true;
  rx.total = 200000;
  rx.received = 65536;
  EXPECT_EQ(check(through_ring(0, 0, 65536, 65536, 64), rx), "arena slot 64 of 64");
  EXPECT_EQ(check(through_ring(kEntryInline, 0, 65536, 100, 0), rx), "inline chunk of 100 bytes");
  EXPECT_EQ(check(through_ring(0, 0, 65536, 65537, 1), rx), "chunk of 65537 bytes in a slot of 65536");
}

TEST_F(ShmRingCheck, SpansAreWholeMessagesTheRingCanHold) {
  constexpr uint32_t whole = kEntryFirst | kEntryLast;
  // The test ring has 4 entries: a span of up to 3 entries (576 bytes) after its header.
  EXPECT_EQ(check(through_ring(whole | kEntrySpan, 500, 0, 500, 0xffffffffu)), "");  // no slot read
  EXPECT_EQ(check(through_ring(whole | kEntrySpan, 576, 0, 576, 0)), "");
  EXPECT_EQ(check(through_ring(whole | kEntrySpan, 577, 0, 577, 0)), "span of 577 bytes in a ring of 4 entries");
  EXPECT_EQ(check(through_ring(whole | kEntrySpan, 1u << 31, 0, 0xffffffffu, 0)),
            "span of 4294967295 bytes in a ring of 4 entries");
  EXPECT_EQ(check(through_ring(kEntryFirst | kEntrySpan, 1000, 0, 500, 0)), "a span that is not a whole message");
  EXPECT_EQ(check(through_ring(whole | kEntrySpan | kEntryInline, 50, 0, 50, 0)),
            "a span that is inline, a reference or a loan");
  EXPECT_EQ(check(through_ring(whole | kEntrySpan | kEntryLoan, 100, 0, 16, 0)),
            "a span that is inline, a reference or a loan");
  EXPECT_EQ(check(through_ring(whole | kEntrySpan | kEntryReference, 100, 0, 100, 0)),
            "a span that is inline, a reference or a loan");
  EXPECT_EQ(check(through_ring(whole | kEntrySpan, 600, 0, 500, 0)), "last-entry flag disagrees with the size");
  // Beyond kMaxSpanBytes even in a ring that could hold it.
  const ArenaShape big{65536, 64, 1024};
  const EntryFields f = through_ring(whole | kEntrySpan, kMaxSpanBytes + 1, 0, kMaxSpanBytes + 1, 0);
  EXPECT_EQ(check_entry(f, {}, big, kMaxMessage), "span of 8193 bytes in a ring of 1024 entries");
  const EntryFields g = through_ring(whole | kEntrySpan, kMaxSpanBytes, 0, kMaxSpanBytes, 0);
  EXPECT_EQ(check_entry(g, {}, big, kMaxMessage), "");
}

TEST_F(ShmRingCheck, BatchesAreAloneAndFitTheRing) {
  // A batch header: flags kEntryBatch alone, its records' bytes in chunk_bytes and total_bytes,
  // the number of records in `leaves`, a span the ring can hold (576 bytes in the 4-entry ring).
  auto batch = [&](uint32_t flags, uint64_t total, uint32_t chunk, uint16_t records) {
    EntryFields f = through_ring(flags, total, 0, chunk, 0xffffffffu, 0);
    f.leaves = records;
    return f;
  };
  EXPECT_EQ(check(batch(kEntryBatch, 184, 184, 3)), "");
  EXPECT_EQ(batch(kEntryBatch, 184, 184, 3).slot, 0u) << "no slot read";
  EXPECT_EQ(batch(kEntryBatch, 184, 184, 3).chunk_offset, 0u) << "no tail read";
  EXPECT_EQ(check(batch(kEntryBatch, 576, 576, 2)), "");
  EXPECT_EQ(check(batch(kEntryBatch, 577, 577, 2)), "batch of 577 bytes in a ring of 4 entries");
  EXPECT_EQ(check(batch(kEntryBatch, 0xffffffffu, 0xffffffffu, 2)), "batch of 4294967295 bytes in a ring of 4 entries");
  EXPECT_EQ(check(batch(kEntryBatch, 200, 184, 3)), "a batch of 184 bytes that says 200");
  EXPECT_EQ(check(batch(kEntryBatch, 184, 184, 0)), "a batch of no records");
  EXPECT_EQ(check(batch(kEntryBatch | kEntryFirst | kEntryLast, 184, 184, 3)),
            "unknown flags " + std::to_string(kEntryBatch | kEntryFirst | kEntryLast));
  EXPECT_EQ(check(batch(kEntryBatch | kEntryInline, 48, 48, 1)),
            "unknown flags " + std::to_string(kEntryBatch | kEntryInline));
  RxProgress rx;
  rx.in_message = true;
  rx.total = 100000;
  rx.received = 65536;
  EXPECT_EQ(check(batch(kEntryBatch, 184, 184, 3), rx), "a batch before the previous message ended");
}

namespace {

// Appends a batch record (segment_layout.h's BatchRecord, sizes, bytes, padding) to `out`.
void add_record(std::vector<uint8_t>& out, const BatchRecord& r, const std::vector<int64_t>& sizes,
                const std::vector<uint8_t>& bytes, size_t padding) {
  const size_t at = out.size();
  out.resize(at + sizeof r);
  std::memcpy(out.data() + at, &r, sizeof r);
  for (const int64_t d : sizes) {
    const size_t k = out.size();
    out.resize(k + sizeof d);
    std::memcpy(out.data() + k, &d, sizeof d);
  }
  out.insert(out.end(), bytes.begin(), bytes.end());
  out.insert(out.end(), padding, 0);
}

BatchRecord record(int64_t tag, uint32_t bytes, uint32_t flags, uint8_t ndim) {
  BatchRecord r{};
  r.tag = tag;
  r.bytes = bytes;
  r.flags = flags;
  r.dtype = 6;
  r.ndim = ndim;
  return r;
}

}  // namespace

TEST(ShmBatchRecord, RecordsReadBackAsWholeMessages) {
  std::vector<uint8_t> records;
  BatchRecord a = record(7, 8, 0, 1);
  add_record(records, a, {}, std::vector<uint8_t>(8, 0xa1), 0);
  BatchRecord b = record(-3, 24, kEntryKeyCheck | kEntryControl, 2);
  b.leaves = 3;
  b.check = 0xdeadbeef;
  add_record(records, b, {2, 3}, std::vector<uint8_t>(24, 0xb2), 0);
  BatchRecord c = record(9, 5, kEntrySchemaCheck, 3);
  c.check = 42;
  add_record(records, c, {1, 1, 5}, std::vector<uint8_t>(5, 0xc3), 3);
  ASSERT_EQ(records.size(), batch_record_bytes(1, 8) + batch_record_bytes(2, 24) + batch_record_bytes(3, 5));

  uint64_t offset = 0, payload_at = 0;
  EntryFields f;
  EntryShape shape{};
  ASSERT_EQ(read_batch_record(records.data(), records.size(), offset, f, shape, payload_at), "");
  EXPECT_EQ(f.tag, 7);
  EXPECT_EQ(f.total_bytes, 8u);
  EXPECT_EQ(f.chunk_bytes, 8u);
  EXPECT_EQ(f.flags, kEntryFirst | kEntryLast | kEntryBatch);
  EXPECT_EQ(f.ndim, 1u);
  EXPECT_EQ(payload_at, sizeof(BatchRecord));
  EXPECT_EQ(records[payload_at], 0xa1);
  EXPECT_EQ(offset, 32u);

  ASSERT_EQ(read_batch_record(records.data(), records.size(), offset, f, shape, payload_at), "");
  EXPECT_EQ(f.tag, -3);
  EXPECT_EQ(f.flags, kEntryFirst | kEntryLast | kEntryBatch | kEntryKeyCheck | kEntryControl);
  EXPECT_EQ(f.leaves, 3u);
  EXPECT_EQ(f.check, 0xdeadbeefu);
  EXPECT_EQ(f.ndim, 2u);
  EXPECT_EQ(shape.dims[0], 2);
  EXPECT_EQ(shape.dims[1], 3);
  EXPECT_EQ(payload_at, 32u + sizeof(BatchRecord) + 16u);
  EXPECT_EQ(records[payload_at + 23], 0xb2);

  ASSERT_EQ(read_batch_record(records.data(), records.size(), offset, f, shape, payload_at), "");
  EXPECT_EQ(f.total_bytes, 5u);
  EXPECT_EQ(f.check, 42u);
  EXPECT_EQ(shape.dims[2], 5);
  EXPECT_EQ(records[payload_at + 4], 0xc3);
  EXPECT_EQ(offset, records.size());
  // Past the last record: refused, nothing read.
  EXPECT_EQ(
      read_batch_record(records.data(), records.size(), offset, f, shape, payload_at),
      "a record at byte " + std::to_string(records.size()) + " past the batch's " + std::to_string(records.size()));
}

TEST(ShmBatchRecord, HostileRecordsAreRefused) {
  auto read = [](const std::vector<uint8_t>& records) {
    uint64_t offset = 0, payload_at = 0;
    EntryFields f;
    EntryShape shape{};
    std::string problem = read_batch_record(records.data(), records.size(), offset, f, shape, payload_at);
    if (problem.empty()) {
      EXPECT_LE(offset, records.size());
    }
    return problem;
  };
  auto one = [](const BatchRecord& r, const std::vector<int64_t>& sizes, size_t bytes, size_t padding = 0) {
    std::vector<uint8_t> out;
    add_record(out, r, sizes, std::vector<uint8_t>(bytes, 1), padding);
    return out;
  };
  EXPECT_EQ(read(std::vector<uint8_t>(23, 0)), "a record at byte 0 past the batch's 23");
  EXPECT_EQ(read(one(record(1, 8, kEntryFirst, 1), {}, 8)), "a record with flags 1");
  EXPECT_EQ(read(one(record(1, 8, kEntryInline, 1), {}, 8)), "a record with flags 64");
  EXPECT_EQ(read(one(record(1, 8, kEntryLoan, 1), {}, 8)), "a record with flags 128");
  EXPECT_EQ(read(one(record(1, 8, kEntryBatch, 1), {}, 8)), "a record with flags 512");
  EXPECT_EQ(read(one(record(1, 8, kEntryKeyCheck | kEntrySchemaCheck, 1), {}, 8)),
            "a record with both a key check and a schema check");
  BatchRecord leaves = record(1, 8, 0, 1);
  leaves.leaves = 2;
  EXPECT_EQ(read(one(leaves, {}, 8)), "a record with a leaf count without a key check");
  EXPECT_EQ(read(one(record(1, 8, 0, 9), {}, 8)), "a record of ndim 9");
  // Sizes or bytes that run past the batch (the bytes field at its largest, too).
  EXPECT_EQ(read(one(record(1, 16, 0, 1), {}, 8)), "a record of 16 bytes at byte 0 past the batch's 32");
  EXPECT_EQ(read(one(record(1, 8, 0, 3), {2, 2}, 8)), "a record of 8 bytes at byte 0 past the batch's 48");
  EXPECT_EQ(read(one(record(1, 0xffffffffu, 0, 1), {}, 8)),
            "a record of 4294967295 bytes at byte 0 past the batch's 32");
  // The padding belongs to the record: a record whose bytes end the batch unpadded is refused.
  EXPECT_EQ(read(one(record(1, 5, 0, 1), {}, 5)), "a record of 5 bytes at byte 0 past the batch's 29");
  EXPECT_EQ(read(one(record(1, 5, 0, 1), {}, 5, 3)), "");
  // More than 8 dimensions: no sizes sent, the bytes follow the record at once.
  EXPECT_EQ(read(one(record(1, 8, 0, kShapeNotSent), {}, 8)), "");
}

TEST(ShmRing, SpansFillTheEntriesAfterTheirHeaderAndWrap) {
  constexpr uint32_t n = 8;
  TestRing r(n);
  std::vector<uint8_t> stage(kMaxSpanBytes);
  uint64_t published = 0;
  // Spans of 1 to 3 entries at every start position, through many laps: the bytes read are the
  // bytes written, contiguous in the ring or staged where they wrap around its end.
  for (uint64_t i = 0; i < 200; ++i) {
    const uint64_t bytes = 73 + (i * 97) % (3 * kEntryBytes - 72);
    const uint64_t span = span_entries(bytes);
    ASSERT_LE(span, 3u);
    std::vector<uint8_t> payload(bytes);
    for (uint64_t k = 0; k < bytes; ++k) payload[k] = static_cast<uint8_t>(i * 31 + k);
    ASSERT_TRUE(r.producer.has_room(1 + span));
    fill_entry(r.producer, i);
    r.producer.write_span(payload.data(), bytes);
    r.producer.publish(span);
    published += 1 + span;
    EXPECT_EQ(r.producer.position(), published);
    EntryFields f;
    ASSERT_TRUE(r.consumer.peek(f)) << i;
    EXPECT_EQ(f.tag, static_cast<int64_t>(i) * 3 - 1000000007);
    const uint8_t* got = r.consumer.span(bytes, stage.data());
    const bool wraps = (r.consumer.position() + 1) % n + span > n;
    EXPECT_EQ(got == stage.data(), wraps) << i;
    EXPECT_EQ(std::memcmp(got, payload.data(), bytes), 0) << i;
    r.consumer.consume(span);
    EXPECT_EQ(r.consumer.position(), published);
    EXPECT_EQ(r.view.control().tail.load(), published);
  }
}

TEST(ShmRing, APayloadThatHoldsPositionsNeverReadsAsPublished) {
  // A span leaves payload where a later lap expects headers. A payload of position + 1 values
  // (what seq held before layout 9) at every entry's start is not a publication.
  constexpr uint32_t n = 8;
  TestRing r(n);
  std::vector<uint8_t> payload(7 * kEntryBytes);
  for (uint64_t e = 0; e < 7; ++e) {
    // Entry 1 + e holds, at its start, position + 1 for the position it has in the next lap.
    const uint64_t old_seq = n + 1 + e + 1;
    std::memcpy(payload.data() + e * kEntryBytes, &old_seq, sizeof old_seq);
  }
  ASSERT_TRUE(r.producer.has_room(8));
  fill_entry(r.producer, 0);
  r.producer.write_span(payload.data(), payload.size());
  r.producer.publish(7);
  EntryFields f;
  ASSERT_TRUE(r.consumer.peek(f));
  r.consumer.consume(7);
  // Position 8 (entry 0): not published yet. Then positions 9.. (entries 1..): payload, never
  // published, whatever the consumer's position.
  EXPECT_FALSE(r.consumer.peek(f));
  TestRing other(n);
  std::memcpy(other.buffer.data(), r.buffer.data(), ring_bytes(n));
  for (uint64_t pos = n + 1; pos < 2 * n; ++pos) {
    RingConsumer c(other.view);
    for (uint64_t k = 0; k < pos; ++k) c.consume();  // move to `pos`
    EXPECT_FALSE(c.peek(f)) << pos;
    EXPECT_FALSE(c.ready_hint()) << pos;
    EXPECT_TRUE(c.empty()) << pos;
  }
}

TEST(ShmRing, RoomForASpanCountsEveryEntryItFills) {
  constexpr uint32_t n = 8;
  TestRing r(n);
  EXPECT_TRUE(r.producer.has_room(8));
  EXPECT_FALSE(r.producer.has_room(9));
  fill_entry(r.producer, 0);
  r.producer.write_span(std::vector<uint8_t>(2 * kEntryBytes, 1).data(), 2 * kEntryBytes);
  r.producer.publish(2);  // 3 entries
  EXPECT_TRUE(r.producer.has_room(5));
  EXPECT_FALSE(r.producer.has_room(6));
  EntryFields f;
  ASSERT_TRUE(r.consumer.peek(f));
  r.consumer.consume(2);
  EXPECT_TRUE(r.producer.has_room(8));  // reads the tail once its cached copy says full
  EXPECT_EQ(span_entries(1), 1u);
  EXPECT_EQ(span_entries(kEntryBytes), 1u);
  EXPECT_EQ(span_entries(kEntryBytes + 1), 2u);
  EXPECT_EQ(span_limit(64), kSpanSendBytes);  // 31 entries would hold 5,952 bytes
  EXPECT_EQ(span_limit(2), 0u);
  EXPECT_EQ(span_limit(4), kEntryBytes);
  EXPECT_EQ(span_limit(8), 3 * kEntryBytes);
  EXPECT_EQ(span_limit(1u << 20), kSpanSendBytes);
  EXPECT_LE(kSpanSendBytes, kMaxSpanBytes);
}

// ---- two threads -----------------------------------------------------------------------------

TEST(ShmRingThreads, MillionEntriesThroughEightSlots) {
  // A producer and a consumer thread on a ring of 8 entries: every entry arrives once, in order,
  // with the fields, inline bytes and shape its producer wrote (a missing acquire/release pair
  // may show as a torn entry here, and does as a data race under TSan). Bounded by a deadline,
  // generous against a busy machine (it takes ~1 s in RelWithDebInfo, ~8 s under TSan): a stuck
  // position fails the test instead of hanging it.
  constexpr uint32_t n = 8;
  constexpr uint64_t count = 1000000;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kUnderTsan ? 120 : 60);
  TestRing r(n);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> produced{0};
  std::string error;

  std::thread producer([&] {
    for (uint64_t i = 0; i < count; ++i) {
      for (uint32_t spins = 0; !r.producer.has_room(); ++spins) {
        if (stop.load(std::memory_order_relaxed)) return;
        if (spins % 64 == 63) {
          if (std::chrono::steady_clock::now() > deadline) return;
          std::this_thread::yield();
        }
      }
      fill_entry(r.producer, i);
      r.producer.publish();
      produced.store(i + 1, std::memory_order_relaxed);
    }
  });
  uint64_t consumed = 0;
  std::thread consumer([&] {
    EntryFields f;
    for (uint64_t i = 0; i < count; ++i) {
      for (uint32_t spins = 0; !r.consumer.peek(f); ++spins) {
        if (spins % 64 == 63) {
          if (std::chrono::steady_clock::now() > deadline) {
            error = "deadline passed at entry " + std::to_string(i);
            stop.store(true);
            return;
          }
          std::this_thread::yield();
        }
      }
      std::string bad = mismatch(f, r.consumer, i);
      if (!bad.empty()) {
        error = bad;
        stop.store(true);
        return;
      }
      r.consumer.consume();
      consumed = i + 1;
    }
  });
  producer.join();
  consumer.join();
  EXPECT_EQ(error, "");
  EXPECT_EQ(consumed, count);
  EXPECT_EQ(produced.load(), count);
  EXPECT_EQ(r.view.control().head.load(), count);
  EXPECT_EQ(r.view.control().tail.load(), count);
  EntryFields f;
  EXPECT_FALSE(r.consumer.peek(f));
}

// ---- arena -----------------------------------------------------------------------------------

/// One rank's region, as segment_geometry lays it out, between two guard areas.
struct TestRegion {
  static constexpr uint64_t kGuard = 256;
  static constexpr uint8_t kGuardByte = 0x5a;

  TestRegion(uint64_t slot_bytes_, uint32_t slots)
      : g(segment_geometry(3, slot_bytes_, 4, slots, 256, 1, 0)),
        slot_bytes(slot_bytes_),
        buffer(kGuard + g.region_bytes + kGuard),
        view(buffer.data() + kGuard, slots, g.slot_table_bytes, g.slot_stride) {
    std::memset(buffer.data(), kGuardByte, kGuard);
    std::memset(buffer.data() + kGuard + g.region_bytes, kGuardByte, kGuard);
  }
  uint8_t* base() { return buffer.data() + kGuard; }
  bool guards_intact() {
    for (uint64_t k = 0; k < kGuard; ++k) {
      if (buffer.data()[k] != kGuardByte || base()[g.region_bytes + k] != kGuardByte) return false;
    }
    return true;
  }

  SegmentGeometry g;
  uint64_t slot_bytes;
  AlignedBuffer buffer;
  RegionView view;
};

TEST(ShmArena, TakeHandsOutEverySlotOnceThenNothing) {
  TestRegion r(1000, 10);
  SlotAllocator alloc(r.view);
  std::set<uint32_t> seen;
  for (uint32_t k = 0; k < 10; ++k) {
    const std::optional<uint32_t> s = alloc.take(2);
    ASSERT_TRUE(s.has_value()) << "take " << k;
    EXPECT_EQ(*s, k);  // a fresh region is handed out in order
    EXPECT_TRUE(seen.insert(*s).second) << "slot " << *s << " twice";
    EXPECT_EQ(r.view.state(*s).load(), 3u);  // dst + 1
    EXPECT_EQ(alloc.data(*s), r.view.data(*s));
  }
  EXPECT_FALSE(alloc.take(2).has_value());
  EXPECT_FALSE(alloc.take(0).has_value());
  for (uint32_t s = 0; s < 10; ++s) EXPECT_EQ(r.view.state(s).load(), 3u);
  // Slots handed to different receivers carry each one's rank.
  TestRegion r2(64, 3);
  SlotAllocator alloc2(r2.view);
  EXPECT_EQ(alloc2.take(0), std::optional<uint32_t>(0));
  EXPECT_EQ(alloc2.take(7), std::optional<uint32_t>(1));
  EXPECT_EQ(alloc2.take(4095), std::optional<uint32_t>(2));
  EXPECT_EQ(r2.view.state(0).load(), 1u);
  EXPECT_EQ(r2.view.state(1).load(), 8u);
  EXPECT_EQ(r2.view.state(2).load(), 4096u);
  EXPECT_TRUE(r.guards_intact());
  EXPECT_TRUE(r2.guards_intact());
}

TEST(ShmArena, ClaimedChunkOnlyForTheReceiverItWasHandedTo) {
  TestRegion r(1000, 10);
  SlotAllocator alloc(r.view);
  const uint32_t s = *alloc.take(1);  // slot 0, for rank 1
  const uint32_t t = *alloc.take(2);  // slot 1, for rank 2
  EXPECT_EQ(claimed_chunk(r.view, s, 1), r.view.data(s));
  EXPECT_EQ(claimed_chunk(r.view, t, 2), r.view.data(t));
  EXPECT_EQ(claimed_chunk(r.view, s, 2), nullptr);  // another rank's
  EXPECT_EQ(claimed_chunk(r.view, s, 0), nullptr);
  EXPECT_EQ(claimed_chunk(r.view, t, 1), nullptr);
  EXPECT_EQ(claimed_chunk(r.view, 2, 1), nullptr);  // a free slot
  EXPECT_EQ(claimed_chunk(r.view, 9, 1), nullptr);
  EXPECT_EQ(claimed_chunk(r.view, 10, 1), nullptr);  // past the region
  EXPECT_EQ(claimed_chunk(r.view, 0xffffffffu, 1), nullptr);
  // Out of range even where the bytes past the table would read as "handed to me": slot 10's
  // state word would be the first 4 bytes of the table's padding (table of 10 slots padded to
  // 128 bytes), here forged to name rank 1.
  ASSERT_EQ(r.g.slot_table_bytes, 128u);
  reinterpret_cast<ArenaSlot*>(r.base())[10].state.store(2);
  EXPECT_EQ(claimed_chunk(r.view, 10, 1), nullptr);
  // Once released, the slot is nobody's.
  release_slot(r.view, s);
  EXPECT_EQ(r.view.state(s).load(), kSlotFree);
  EXPECT_EQ(claimed_chunk(r.view, s, 1), nullptr);
  EXPECT_EQ(claimed_chunk(r.view, t, 2), r.view.data(t));
}

TEST(ShmArena, ReleasedSlotsAreTakenAgainRoundRobin) {
  TestRegion r(1000, 10);
  SlotAllocator alloc(r.view);
  for (uint32_t k = 0; k < 5; ++k) ASSERT_EQ(alloc.take(1), std::optional<uint32_t>(k));
  // Slot 1 comes back while the cursor is at 5: the search goes on from 5, and finds 1 only after
  // wrapping around.
  release_slot(r.view, 1);
  EXPECT_EQ(r.view.state(1).load(), kSlotFree);
  for (uint32_t k = 5; k < 10; ++k) EXPECT_EQ(alloc.take(1), std::optional<uint32_t>(k));
  EXPECT_EQ(alloc.take(2), std::optional<uint32_t>(1));
  EXPECT_EQ(r.view.state(1).load(), 3u);
  EXPECT_FALSE(alloc.take(1).has_value());
  // Two released: taken in cursor order (the cursor is past 1, at 2), then nothing.
  release_slot(r.view, 8);
  release_slot(r.view, 3);
  EXPECT_EQ(alloc.take(0), std::optional<uint32_t>(3));
  EXPECT_EQ(alloc.take(0), std::optional<uint32_t>(8));
  EXPECT_FALSE(alloc.take(0).has_value());
  // Every slot released: the next take continues after 8.
  for (uint32_t s = 0; s < 10; ++s) release_slot(r.view, s);
  EXPECT_EQ(alloc.take(0), std::optional<uint32_t>(9));
  EXPECT_EQ(alloc.take(0), std::optional<uint32_t>(0));
}

TEST(ShmArena, ReclaimFreesExactlyTheSlotsOfOneReceiver) {
  TestRegion r(1000, 10);
  SlotAllocator alloc(r.view);
  for (uint32_t k = 0; k < 10; ++k) ASSERT_EQ(alloc.take(k % 3), std::optional<uint32_t>(k));  // dst = slot % 3
  release_slot(r.view, 4);          // rank 1 already gave one back
  EXPECT_EQ(alloc.reclaim(1), 2u);  // slots 1 and 7
  for (uint32_t s = 0; s < 10; ++s) {
    if (s % 3 == 1) {
      EXPECT_EQ(r.view.state(s).load(), kSlotFree) << "slot " << s;
    } else {
      EXPECT_EQ(r.view.state(s).load(), s % 3 + 1) << "slot " << s;
    }
  }
  EXPECT_EQ(alloc.reclaim(1), 0u);  // nothing left of rank 1
  EXPECT_EQ(alloc.reclaim(5), 0u);  // a rank that holds nothing
  EXPECT_EQ(alloc.reclaim(2), 3u);  // slots 2, 5, 8
  EXPECT_EQ(alloc.reclaim(0), 4u);  // slots 0, 3, 6, 9
  for (uint32_t s = 0; s < 10; ++s) EXPECT_EQ(r.view.state(s).load(), kSlotFree) << "slot " << s;
  // Reclaimed slots are taken again.
  uint32_t taken = 0;
  while (alloc.take(1)) ++taken;
  EXPECT_EQ(taken, 10u);
}

TEST(ShmArena, SlotsDoNotOverlapAndStayInTheRegion) {
  // A slot size that is a multiple of a cache line and two that are not; a table that fills its
  // cache lines exactly (8 slots) and ones that do not.
  struct Case {
    uint64_t slot_bytes;
    uint32_t slots;
  };
  for (const Case c : {Case{1000, 10}, Case{4096, 8}, Case{1, 17}, Case{65536, 3}}) {
    const uint64_t slot_bytes = c.slot_bytes;
    const uint32_t slots = c.slots;
    SCOPED_TRACE(std::to_string(slots) + " slots of " + std::to_string(slot_bytes) + " bytes");
    TestRegion r(slot_bytes, slots);
    EXPECT_EQ(r.g.slot_stride % kCacheLine, 0u);
    EXPECT_GE(r.g.slot_stride, slot_bytes);
    EXPECT_GE(r.g.slot_table_bytes, slots * sizeof(ArenaSlot));
    SlotAllocator alloc(r.view);
    for (uint32_t s = 0; s < slots; ++s) {
      ASSERT_EQ(alloc.take(s % 4), std::optional<uint32_t>(s));
      uint8_t* d = alloc.data(s);
      // Within the region, after the state table, on a cache line.
      EXPECT_GE(d, r.base() + r.g.slot_table_bytes);
      EXPECT_LE(d + slot_bytes, r.base() + r.g.region_bytes);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(d) % kCacheLine, 0u);
      if (s > 0) {
        EXPECT_GE(d, r.view.data(s - 1) + slot_bytes);
      }
      for (uint64_t k = 0; k < slot_bytes; ++k) d[k] = static_cast<uint8_t>(s * 31 + k * 7 + 1);
    }
    // Writing every slot in full changed no other slot, no state word and nothing outside.
    for (uint32_t s = 0; s < slots; ++s) {
      const uint8_t* d = claimed_chunk(r.view, s, s % 4);
      ASSERT_NE(d, nullptr) << "slot " << s;
      uint64_t wrong = 0;
      for (uint64_t k = 0; k < slot_bytes; ++k) wrong += d[k] != static_cast<uint8_t>(s * 31 + k * 7 + 1);
      EXPECT_EQ(wrong, 0u) << "bytes of slot " << s << " overwritten";
      EXPECT_EQ(r.view.state(s).load(), s % 4 + 1);
    }
    EXPECT_TRUE(r.guards_intact());
    // The last slot ends within slot_stride of the region's end (no slack beyond padding).
    EXPECT_EQ(r.view.data(slots - 1) + r.g.slot_stride, r.base() + r.g.region_bytes);
  }
}

// ---- matcher ---------------------------------------------------------------------------------

struct TestOp {
  int peer;  // -1: any source
  int64_t tag;
  bool control;
  int id;
};
struct TestMsg {
  int src;
  int64_t tag;
  bool control;
  int id;
};
using TestMatcher = Matcher<TestOp, TestMsg>;

std::shared_ptr<TestOp> recv_op(int peer, int64_t tag, int id, bool control = false) {
  return std::make_shared<TestOp>(TestOp{peer, tag, control, id});
}
std::shared_ptr<TestMsg> early_msg(int src, int64_t tag, int id, bool control = false) {
  return std::make_shared<TestMsg>(TestMsg{src, tag, control, id});
}
int id_of(const auto& p) { return p ? p->id : 0; }
// What the engine does for a message: the oldest receive that accepts it, taken out of the queue.
std::shared_ptr<TestOp> take_posted(TestMatcher& m, int src, int64_t tag, bool control) {
  const auto found = m.find_posted(src, tag, control);
  return found == m.none() ? nullptr : m.take_posted(found);
}

TEST(ShmMatcher, ReceivesOnOneTagCompleteInPostingOrder) {
  TestMatcher m;
  m.post(recv_op(1, 5, 1));
  m.post(recv_op(1, 7, 2));
  m.post(recv_op(1, 5, 3));
  EXPECT_EQ(m.posted_count(), 3u);
  EXPECT_EQ(id_of(take_posted(m, 1, 5, false)), 1);
  EXPECT_EQ(id_of(take_posted(m, 1, 5, false)), 3);
  EXPECT_EQ(take_posted(m, 1, 5, false), nullptr);
  EXPECT_EQ(id_of(take_posted(m, 1, 7, false)), 2);
  EXPECT_EQ(m.posted_count(), 0u);
}

TEST(ShmMatcher, SourceTagAndControlMustAllMatch) {
  TestMatcher m;
  m.post(recv_op(1, 5, 1));
  m.post(recv_op(2, 5, 2, /*control=*/true));
  EXPECT_EQ(take_posted(m, 2, 5, false), nullptr) << "a receive from rank 1 took rank 2's message";
  EXPECT_EQ(take_posted(m, 1, 6, false), nullptr) << "a receive on tag 5 took tag 6";
  EXPECT_EQ(take_posted(m, 1, 5, true), nullptr) << "a user receive took a control message";
  EXPECT_EQ(id_of(take_posted(m, 2, 5, true)), 2);
  EXPECT_EQ(id_of(take_posted(m, 1, 5, false)), 1);

  m.add_early(early_msg(1, 5, 10, /*control=*/true));
  m.add_early(early_msg(2, 5, 11));
  EXPECT_EQ(m.take_early(1, 5, false), nullptr) << "a user receive took a control message";
  EXPECT_EQ(m.take_early(3, 5, false), nullptr) << "a receive from rank 3 took another rank's message";
  EXPECT_EQ(m.take_early(2, 4, false), nullptr) << "a receive on tag 4 took tag 5";
  EXPECT_EQ(id_of(m.take_early(2, 5, false)), 11);
  EXPECT_EQ(id_of(m.take_early(1, 5, true)), 10);
  EXPECT_EQ(m.early_count(), 0u);
}

TEST(ShmMatcher, AnySourceReceivesTakeMessagesInArrivalOrder) {
  TestMatcher m;
  m.add_early(early_msg(2, 3, 1));
  m.add_early(early_msg(1, 3, 2));
  m.add_early(early_msg(2, 3, 3));
  EXPECT_EQ(id_of(m.take_early(-1, 3, false)), 1);
  EXPECT_EQ(id_of(m.take_early(2, 3, false)), 3) << "rank 2's next message, past rank 1's";
  EXPECT_EQ(id_of(m.take_early(-1, 3, false)), 2);
  EXPECT_EQ(m.take_early(-1, 3, false), nullptr);

  // A message takes the oldest receive that accepts it: an any-source receive posted first.
  m.post(recv_op(-1, 3, 4));
  m.post(recv_op(1, 3, 5));
  EXPECT_EQ(id_of(take_posted(m, 1, 3, false)), 4);
  EXPECT_EQ(id_of(take_posted(m, 1, 3, false)), 5);
}

TEST(ShmMatcher, WaitsOnSeesReceivesFromTheSourceOrFromAny) {
  TestMatcher m;
  EXPECT_FALSE(m.waits_on(1));
  m.post(recv_op(2, 9, 1));
  EXPECT_FALSE(m.waits_on(1));
  EXPECT_TRUE(m.waits_on(2));
  auto any = recv_op(-1, 9, 2);
  m.post(any);
  EXPECT_TRUE(m.waits_on(1));
  EXPECT_TRUE(m.withdraw(any));
  EXPECT_FALSE(m.withdraw(any)) << "withdrawn twice";
  EXPECT_FALSE(m.waits_on(1));
}

TEST(ShmMatcher, DroppedAndClearedReceivesAreHandedBackOnceInOrder) {
  TestMatcher m;
  for (int i = 1; i <= 6; ++i) m.post(recv_op(i % 3 == 0 ? -1 : i % 3, 1, i));  // peers 1, 2, -1, 1, 2, -1
  std::vector<int> dropped;
  m.drop_posted_if([](const TestOp& op) { return op.peer == 1; },
                   [&](const std::shared_ptr<TestOp>& op) { dropped.push_back(op->id); });
  EXPECT_EQ(dropped, (std::vector<int>{1, 4}));
  EXPECT_EQ(m.posted_count(), 4u);
  EXPECT_EQ(take_posted(m, 1, 1, false)->id, 3) << "the any-source receives stay";

  auto kept = early_msg(1, 1, 20);
  m.add_early(early_msg(2, 1, 21));
  m.add_early(kept);
  EXPECT_TRUE(m.remove_early(kept));
  EXPECT_FALSE(m.remove_early(kept));
  EXPECT_EQ(m.early_count(), 1u);

  dropped.clear();
  m.clear([&](const std::shared_ptr<TestOp>& op) { dropped.push_back(op->id); });
  EXPECT_EQ(dropped, (std::vector<int>{2, 5, 6}));
  EXPECT_EQ(m.posted_count(), 0u);
  EXPECT_EQ(m.early_count(), 0u);
  EXPECT_EQ(m.take_early(2, 1, false), nullptr);
}

TEST(ShmMatcher, ThousandsOfEarlyMessagesKeepTheirOrderPerSourceAndTag) {
  // What a data loader's main rank can hold after draining its workers: 4 sources x 8 tags,
  // 12,000 messages in all. Receives from a source take its messages per tag in sending order;
  // any-source receives take, per tag, the oldest arrival over every source.
  TestMatcher m;
  constexpr int kSources = 4, kTags = 8, kEach = 375;
  std::vector<std::vector<std::vector<int>>> sent(kSources + 1, std::vector<std::vector<int>>(kTags));
  std::vector<std::vector<int>> arrival_per_tag(kTags);  // ids in arrival order, per tag
  int id = 0;
  for (int round = 0; round < kEach; ++round) {
    for (int t = 0; t < kTags; ++t) {
      for (int s = 1; s <= kSources; ++s) {
        const int src = (s + round) % kSources + 1;  // the sources interleave differently per round
        m.add_early(early_msg(src, t, ++id));
        sent[src][t].push_back(id);
        arrival_per_tag[t].push_back(id);
      }
    }
  }
  ASSERT_EQ(m.early_count(), static_cast<size_t>(kSources * kTags * kEach));
  // Tags 0-3 by source; tags 4-7 any-source.
  for (int t = 0; t < 4; ++t) {
    for (int s = kSources; s >= 1; --s) {
      for (int want : sent[s][t]) ASSERT_EQ(id_of(m.take_early(s, t, false)), want) << "source " << s << ", tag " << t;
      ASSERT_EQ(m.take_early(s, t, false), nullptr);
    }
  }
  for (int t = 4; t < kTags; ++t) {
    for (int want : arrival_per_tag[t]) ASSERT_EQ(id_of(m.take_early(-1, t, false)), want) << "tag " << t;
    ASSERT_EQ(m.take_early(-1, t, false), nullptr);
  }
  EXPECT_EQ(m.early_count(), 0u);
}

// ---- buffer pool -----------------------------------------------------------------------------

TEST(ShmBufferPool, TakeGivesAPowerOfTwoOfAtLeastAPage) {
  BufferPool pool(uint64_t{1} << 26);
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{4097}, uint64_t{8192},
                     uint64_t{65535}, uint64_t{100000}, uint64_t{1} << 20, (uint64_t{1} << 20) + 1}) {
    SCOPED_TRACE("take(" + std::to_string(n) + ")");
    BufferPool::Buffer b = pool.take(n);
    ASSERT_NE(b.get(), nullptr);
    EXPECT_GE(b.capacity, n);
    EXPECT_GE(b.capacity, 4096u);
    EXPECT_TRUE(std::has_single_bit(b.capacity));
    EXPECT_LT(b.capacity, std::max<uint64_t>(2 * n, 4097));  // the smallest such power of two
    std::memset(b.get(), 0xcd, b.capacity);                  // all of it is usable
  }
  EXPECT_EQ(pool.kept(), 0u);
}

TEST(ShmBufferPool, AGivenBackBufferIsHandedOutAgainForItsClass) {
  BufferPool pool(uint64_t{1} << 26);
  BufferPool::Buffer b = pool.take(5000);
  ASSERT_EQ(b.capacity, 8192u);
  uint8_t* const p = b.get();
  pool.give_back(std::move(b));
  EXPECT_EQ(pool.kept(), 8192u);
  // Another class does not get it.
  BufferPool::Buffer small = pool.take(4096);
  EXPECT_NE(small.get(), p);
  EXPECT_EQ(small.capacity, 4096u);
  BufferPool::Buffer big = pool.take(8193);
  EXPECT_NE(big.get(), p);
  EXPECT_EQ(big.capacity, 16384u);
  EXPECT_EQ(pool.kept(), 8192u);
  // Any request of its class does.
  BufferPool::Buffer again = pool.take(4097);
  EXPECT_EQ(again.get(), p);
  EXPECT_EQ(again.capacity, 8192u);
  EXPECT_EQ(pool.kept(), 0u);
  pool.give_back(std::move(again));
  BufferPool::Buffer once_more = pool.take(8192);
  EXPECT_EQ(once_more.get(), p);
  // Two of a class given back: both are handed out again, each once.
  uint8_t* const q = small.get();
  BufferPool::Buffer small2 = pool.take(100);
  uint8_t* const q2 = small2.get();
  pool.give_back(std::move(small));
  pool.give_back(std::move(small2));
  EXPECT_EQ(pool.kept(), 8192u);
  BufferPool::Buffer t1 = pool.take(1), t2 = pool.take(4000);
  EXPECT_EQ(std::set<uint8_t*>({t1.get(), t2.get()}), std::set<uint8_t*>({q, q2}));
  EXPECT_EQ(pool.kept(), 0u);
  pool.give_back(std::move(big));
  pool.give_back(std::move(once_more));
  EXPECT_EQ(pool.kept(), 16384u + 8192u);
}

TEST(ShmBufferPool, WhatIsKeptIsBoundedByTheLimit) {
  BufferPool pool(16384);
  BufferPool::Buffer a = pool.take(8192), b = pool.take(8192), c = pool.take(4096), d = pool.take(16384);
  uint8_t* const pa = a.get();
  uint8_t* const pb = b.get();
  pool.give_back(std::move(a));
  pool.give_back(std::move(b));
  EXPECT_EQ(pool.kept(), 16384u);  // exactly the limit: kept
  pool.give_back(std::move(c));    // beyond it: freed
  EXPECT_EQ(pool.kept(), 16384u);
  pool.give_back(std::move(d));
  EXPECT_EQ(pool.kept(), 16384u);
  // What is kept is still handed out.
  BufferPool::Buffer a2 = pool.take(8192);
  EXPECT_EQ(pool.kept(), 8192u);
  BufferPool::Buffer b2 = pool.take(5000);
  EXPECT_EQ(std::set<uint8_t*>({a2.get(), b2.get()}), std::set<uint8_t*>({pa, pb}));
  EXPECT_EQ(pool.kept(), 0u);
  // A buffer larger than the limit is never kept.
  pool.give_back(pool.take(32768));
  EXPECT_EQ(pool.kept(), 0u);
  // A pool with limit 0 keeps nothing.
  BufferPool none(0);
  none.give_back(none.take(4096));
  EXPECT_EQ(none.kept(), 0u);
}

TEST(ShmBufferPool, AnEmptyBufferGivenBackIsIgnored) {
  BufferPool pool(1 << 20);
  pool.give_back(BufferPool::Buffer{});
  EXPECT_EQ(pool.kept(), 0u);
  pool.give_back(BufferPool::Buffer{nullptr, 65536});  // a capacity without memory
  EXPECT_EQ(pool.kept(), 0u);
  BufferPool::Buffer b = pool.take(10);
  EXPECT_NE(b.get(), nullptr);
  EXPECT_EQ(b.capacity, 4096u);
  pool.give_back(std::move(b));
  EXPECT_EQ(pool.kept(), 4096u);
}

// ---------------------------------------------------------------------------------------------
// Reductions of the collectives (reduce.h)

TEST(ShmReduce, IntegersWrapAroundAsTorchDoes) {
  using tdshm::detail::ReduceKind;
  const int32_t a[3] = {INT32_MAX, INT32_MIN, 7};
  const int32_t b[3] = {1, -1, -3};
  int32_t out[3];
  tdshm::detail::reduce_into(out, a, b, 3, at::kInt, ReduceKind::kSum);
  EXPECT_EQ(out[0], INT32_MIN);
  EXPECT_EQ(out[1], INT32_MAX);
  EXPECT_EQ(out[2], 4);
  const int16_t c[2] = {300, -300}, d[2] = {300, 300};
  int16_t prod[2];
  tdshm::detail::reduce_into(prod, c, d, 2, at::kShort, ReduceKind::kProduct);
  EXPECT_EQ(prod[0], static_cast<int16_t>(90000 - 65536 * 1));  // 90000 mod 2^16, as int16
  EXPECT_EQ(prod[1], static_cast<int16_t>(-90000 + 65536 * 1));
}

TEST(ShmReduce, MinMaxLetNaNWinAndBitwiseOpsNeedIntegers) {
  using tdshm::detail::ReduceKind;
  const float a[3] = {1.f, NAN, -2.f}, b[3] = {NAN, 3.f, 5.f};
  float mn[3], mx[3];
  tdshm::detail::reduce_into(mn, a, b, 3, at::kFloat, ReduceKind::kMin);
  tdshm::detail::reduce_into(mx, a, b, 3, at::kFloat, ReduceKind::kMax);
  EXPECT_TRUE(std::isnan(mn[0]) && std::isnan(mn[1]) && mn[2] == -2.f);
  EXPECT_TRUE(std::isnan(mx[0]) && std::isnan(mx[1]) && mx[2] == 5.f);
  EXPECT_NE(tdshm::detail::reduce_problem(ReduceKind::kBand, at::kFloat).find("BAND"), std::string::npos);
  EXPECT_NE(tdshm::detail::reduce_problem(ReduceKind::kMin, at::kComplexFloat).find("complex"), std::string::npos);
  EXPECT_NE(tdshm::detail::reduce_problem(ReduceKind::kAvg, at::kLong).find("AVG"), std::string::npos);
  EXPECT_TRUE(tdshm::detail::reduce_problem(ReduceKind::kBxor, at::kBool).empty());
  EXPECT_TRUE(tdshm::detail::reduce_problem(ReduceKind::kAvg, at::kBFloat16).empty());
  const bool p[4] = {true, true, false, false}, q[4] = {true, false, true, false};
  bool x[4];
  tdshm::detail::reduce_into(x, p, q, 4, at::kBool, ReduceKind::kBxor);
  EXPECT_EQ(std::vector<bool>(x, x + 4), (std::vector<bool>{false, true, true, false}));
}

// ---- the per-message objects' blocks (common/recycle.h) ----

TEST(RecycledBlocks, AThreadReusesItsLast64FreedBlocksFirst) {
  // In a thread of its own: a fresh cache, given back to the heap when the thread ends.
  std::vector<void*> freed, taken;
  std::thread t([&] {
    using Blocks = tdshm::detail::RecycledBlocks<48>;
    for (int i = 0; i < 100; ++i) freed.push_back(Blocks::get());
    for (void* p : freed) Blocks::put(p);  // the first 64 are kept, the other 36 go to the heap
    for (int i = 0; i < 64; ++i) taken.push_back(Blocks::get());
    for (void* p : taken) Blocks::put(p);
  });
  t.join();
  ASSERT_EQ(taken.size(), 64u);
  // Last in, first out: the 64 kept are the first 64 freed, taken back in reverse order.
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(taken[i], freed[63 - i]) << "block " << i;
}

TEST(RecycledBlocks, AllocateSharedTakesTheBlockItsThreadFreed) {
  using Alloc = tdshm::detail::RecyclingAllocator<int64_t>;
  auto a = std::allocate_shared<int64_t>(Alloc{}, 7);
  const void* first = a.get();
  a.reset();
  auto b = std::allocate_shared<int64_t>(Alloc{}, 9);
  EXPECT_EQ(static_cast<const void*>(b.get()), first);
  EXPECT_EQ(*b, 9);
  // An array is not a single block: it comes from the heap and goes back there.
  Alloc alloc;
  int64_t* many = alloc.allocate(3);
  many[2] = 5;
  EXPECT_EQ(many[2], 5);
  alloc.deallocate(many, 3);
}

TEST(LightMutex, TryLockFailsWhileHeldAndSucceedsOnceFree) {
  tdshm::detail::LightMutex mu;
  ASSERT_TRUE(mu.try_lock());
  std::thread other([&] { EXPECT_FALSE(mu.try_lock()); });
  other.join();
  mu.unlock();
  EXPECT_TRUE(mu.try_lock());
  mu.unlock();
}

// Four threads (more than this machine's cores: holders get descheduled, waiters sleep on the
// word) each add 1 a million times to a plain counter under the lock: no increment is lost, and
// every thread's last write is seen by the others (the lock orders them).
TEST(LightMutexThreads, ContendingThreadsLoseNoUpdate) {
  tdshm::detail::LightMutex mu;
  uint64_t counter = 0;  // not atomic: the lock alone protects it
  constexpr int kThreads = 4, kEach = 1'000'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        std::lock_guard lk(mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, uint64_t{kThreads} * kEach);
}

}  // namespace
