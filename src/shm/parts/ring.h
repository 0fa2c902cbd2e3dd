#pragma once
// One metadata ring: a single-producer single-consumer queue of fixed-size entries in shared
// memory (segment_layout.h: RingControl, then `entries` entries of kEntryBytes), as its two ends
// see it. Works on any memory (unit tests use a plain buffer). Positions grow forever; the entry
// of position p is p % entries.
//
//  * The producer fills the entry at its position, then publishes it: seq = seq_word(key,
//    position) (release), then head. It reads the consumer's tail only when its cached copy says
//    the ring is full, so in the common case it never touches the consumer's cache line.
//  * The consumer polls seq of the entry at its position (acquire), copies the fields out once
//    (validate.h: only the copy is used), and consumes it by storing tail (release), which hands
//    the entry back to the producer.
//  * A span (segment_layout.h) is an entry whose message fills the entries after it: the producer
//    writes those first and publishes the header entry, moving on by 1 + span_entries(bytes); the
//    consumer copies the span out and consumes as many.
// Nothing here trusts the other end: a seq that is not exactly the seq word of the position is
// "not yet", and the copy is validated by the caller before use.

#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace tdshm::shm {

/// Asks the cache for the line at `line` to be read (a hint: it never faults). On x86 an
/// instruction the compiler must keep: GCC 12 removed a loop of __builtin_prefetch whose
/// addresses wrap as RingView::for_lines_after's do, as if it had no effect.
inline void prefetch_line(const uint8_t* line) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*line));
#else
  __builtin_prefetch(line, 0, 3);
#endif
}

/// The shared memory of one ring.
class RingView {
 public:
  RingView() = default;
  /// `key`: ring_key() of the pair in its incarnation.
  RingView(uint8_t* base, uint32_t entries, uint64_t key) noexcept : base_(base), entries_(entries), key_(key) {}

  RingControl& control() const noexcept { return *reinterpret_cast<RingControl*>(base_); }
  uint8_t* entry_base(uint64_t position) const noexcept {
    return base_ + sizeof(RingControl) + (position % entries_) * kEntryBytes;
  }
  EntryHeader& header(uint64_t position) const noexcept {
    return *reinterpret_cast<EntryHeader*>(entry_base(position));
  }
  uint8_t* inline_bytes(uint64_t position) const noexcept { return entry_base(position) + sizeof(EntryHeader); }
  EntryTail& tail(uint64_t position) const noexcept {
    return *reinterpret_cast<EntryTail*>(entry_base(position) + kEntryTailOffset);
  }
  EntryShape& shape(uint64_t position) const noexcept {
    return *reinterpret_cast<EntryShape*>(entry_base(position) + kEntryShapeOffset);
  }
  uint32_t entries() const noexcept { return entries_; }
  /// Calls `f` with each of the `lines` cache lines after the first of the entry of `position`,
  /// in order, on at entry 0 past the ring's end.
  template <class F>
  void for_lines_after(uint64_t position, int lines, F&& f) const noexcept {
    const uint8_t* ring_start = base_ + sizeof(RingControl);
    const uint8_t* ring_end = ring_start + uint64_t{entries_} * kEntryBytes;
    const uint8_t* line = entry_base(position);
    for (int i = 0; i < lines; ++i) {
      line += kCacheLine;
      if (line == ring_end) line = ring_start;
      f(line);
    }
  }
  /// Asks the cache for the `lines` lines after the first of the entry of `position` (a hint: it
  /// never faults, and nothing waits for it).
  void prefetch_after(uint64_t position, int lines) const noexcept {
    for_lines_after(position, lines, [](const uint8_t* line) { prefetch_line(line); });
  }
  uint64_t seq(uint64_t position) const noexcept { return seq_word(key_, position); }
  /// Copies `bytes` into the span after the entry of `position`, on at entry 0 past the end.
  void write_span(uint64_t position, const uint8_t* from, uint64_t bytes) const noexcept {
    const uint64_t room = span_room(position);
    std::memcpy(entry_base(position + 1), from, std::min(bytes, room));
    if (bytes > room) std::memcpy(entry_base(0), from + room, bytes - room);
  }
  /// The span of `bytes` after the entry of `position`: in the ring when it does not wrap, else
  /// copied into `stage` (kMaxSpanBytes) and there.
  const uint8_t* read_span(uint64_t position, uint64_t bytes, uint8_t* stage) const noexcept {
    const uint64_t room = span_room(position);
    if (bytes <= room) return entry_base(position + 1);
    std::memcpy(stage, entry_base(position + 1), room);
    std::memcpy(stage + room, entry_base(0), bytes - room);
    return stage;
  }

 private:
  // Bytes from the entry after `position` to the ring's end.
  uint64_t span_room(uint64_t position) const noexcept { return (entries_ - (position + 1) % entries_) * kEntryBytes; }

  uint8_t* base_ = nullptr;
  uint32_t entries_ = 1;
  uint64_t key_ = 0;
};

/// The producer's end (process-local state: its position and the last tail it read).
class RingProducer {
 public:
  RingProducer() = default;
  explicit RingProducer(RingView ring) noexcept : ring_(ring) {}

  /// Whether the `n` entries from the current position on are free.
  /// (A tail past the position, which only a hostile consumer stores, leaves no room.)
  bool has_room(uint64_t n = 1) noexcept {
    if (fits(n)) return true;
    tail_ = ring_.control().tail.load(std::memory_order_acquire);  // pairs with the consumer's release
    return fits(n);
  }
  /// The entry to fill (call after has_room()).
  EntryHeader& entry() const noexcept { return ring_.header(pos_); }
  EntryTail& tail() const noexcept { return ring_.tail(pos_); }
  uint8_t* inline_bytes() const noexcept { return ring_.inline_bytes(pos_); }
  EntryShape& shape() const noexcept { return ring_.shape(pos_); }
  /// Writes a span after the current entry (has_room(1 + span_entries(bytes)) was true).
  void write_span(const uint8_t* from, uint64_t bytes) const noexcept { ring_.write_span(pos_, from, bytes); }
  /// Publishes the filled entry and moves on past it and the `span` entries after it.
  void publish(uint64_t span = 0) noexcept {
    ring_.header(pos_).seq.store(ring_.seq(pos_), std::memory_order_release);  // pairs with the consumer's acquire
    pos_ += 1 + span;
    ring_.control().head.store(pos_, std::memory_order_release);
  }
  uint64_t position() const noexcept { return pos_; }

 private:
  bool fits(uint64_t n) const noexcept {
    const uint64_t used = pos_ - tail_;
    return used <= ring_.entries() && n <= ring_.entries() - used;
  }

  RingView ring_;
  uint64_t pos_ = 0;
  uint64_t tail_ = 0;
};

/// Lines after an entry's first that a waiting consumer asks for (RingConsumer::ready_hint), as
/// the last message from its producer was: after one of at most one span entry (inline, a batch,
/// a span of up to 192 bytes) the entry's other two lines (inline bytes past 24, a shape) and the
/// next entry's three (such a span or batch); after a longer span, the entry's own two only (a
/// slot's index, a shape). Each is a prefetch: a line in cache costs one instruction, one the
/// producer has written since is fetched while the consumer waits anyway. A long span's first
/// lines are not asked for: taking them from a producer still copying the span made 2-3 KiB
/// spans slower (docs/benchmarks.md).
inline constexpr int kWaitPrefetchLines = 5;
inline constexpr int kWaitPrefetchLinesAfterSpan = 2;

/// The consumer's end (process-local state: its position). The position is an atomic (relaxed:
/// a plain load and store on x86) only so that ready_hint() may read it without the lock that
/// guards every other use.
class RingConsumer {
 public:
  RingConsumer() = default;
  explicit RingConsumer(RingView ring) noexcept : ring_(ring) {}
  RingConsumer(const RingConsumer& other) noexcept
      : ring_(other.ring_), pos_(other.position()), wait_lines_(other.wait_lines_.load(std::memory_order_relaxed)) {}
  RingConsumer& operator=(const RingConsumer& other) noexcept {
    ring_ = other.ring_;
    pos_.store(other.position(), std::memory_order_relaxed);
    wait_lines_.store(other.wait_lines_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    return *this;
  }

  /// Copies the fields of the entry at the current position into `out` if it was published;
  /// false if not (yet). Validating the copy is the caller's job.
  bool peek(EntryFields& out) const noexcept {
    const uint64_t pos = position();
    const EntryHeader& e = ring_.header(pos);
    if (e.seq.load(std::memory_order_acquire) != ring_.seq(pos)) return false;  // pairs with the producer's release
    read_entry(e, ring_.tail(pos), out);
    return true;
  }
  /// The current entry's inline bytes and shape (valid after peek() returned true).
  const uint8_t* inline_bytes() const noexcept { return ring_.inline_bytes(position()); }
  const EntryShape& shape() const noexcept { return ring_.shape(position()); }
  /// The current entry's span of `bytes` (<= kMaxSpanBytes; RingView::read_span).
  const uint8_t* span(uint64_t bytes, uint8_t* stage) const noexcept {
    return ring_.read_span(position(), bytes, stage);
  }
  /// Hands the current entry and the `span` entries after it back to the producer and moves on.
  void consume(uint64_t span = 0) noexcept {
    const uint64_t next = position() + 1 + span;
    pos_.store(next, std::memory_order_relaxed);
    wait_lines_.store(span <= 1 ? kWaitPrefetchLines : kWaitPrefetchLinesAfterSpan, std::memory_order_relaxed);
    ring_.control().tail.store(next, std::memory_order_release);  // the entry may be reused now
  }
  uint64_t position() const noexcept { return pos_.load(std::memory_order_relaxed); }
  /// Entries published and not yet consumed (the producer's head, read once).
  uint64_t depth() const noexcept { return ring_.control().head.load(std::memory_order_acquire) - position(); }
  /// Whether the entry at the current position is not yet published: the ring is empty as far
  /// as this end can tell. Reads only the entry this end polls anyway, not the producer's head
  /// (whose cache line the producer writes at every publish: reading it costs a miss each time).
  bool empty() const noexcept {
    const uint64_t pos = position();
    return ring_.header(pos).seq.load(std::memory_order_acquire) != ring_.seq(pos);
  }
  /// Whether an entry seems published at the current position, without the lock that guards the
  /// consumer (a hint: the position may move meanwhile; peek() under the lock decides). While it
  /// is not, the lines a message there may fill after the first are asked for (wait_lines(),
  /// prefetch_after): its producer writes them before the seq word, so they come with line 0
  /// instead of a round of line transfers after it (an inline message past 24 bytes, a shape, a
  /// span or batch of up to three lines: the seed tree).
  bool ready_hint() const noexcept {
    const uint64_t pos = position();
    if (ring_.header(pos).seq.load(std::memory_order_relaxed) == ring_.seq(pos)) return true;
    ring_.prefetch_after(pos, wait_lines());
    return false;
  }
  /// The lines ready_hint() asks for while it waits: kWaitPrefetchLines, or
  /// kWaitPrefetchLinesAfterSpan after a span of more than one entry.
  int wait_lines() const noexcept { return wait_lines_.load(std::memory_order_relaxed); }

 private:
  RingView ring_;
  std::atomic<uint64_t> pos_{0};
  std::atomic<uint8_t> wait_lines_{kWaitPrefetchLines};  // atomic for ready_hint(), as pos_
};

}  // namespace tdshm::shm
