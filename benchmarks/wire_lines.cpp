// The cache-line model of a message on the wire (wire_lines.h), from segment_layout.h's constants.

#include "wire_lines.h"

#include "pingpong_table.h"
#include "shm/layout/segment_layout.h"
#include "shm/parts/ring.h"

#include <algorithm>
#include <cstdio>

namespace tdshm::bench {

namespace {

constexpr uint64_t kLine = shm::kCacheLine;
// Bytes of an entry's inline payload on its first line (after the 40-byte header).
constexpr uint64_t kInlineOnLine0 = kLine - sizeof(shm::EntryHeader);
static_assert(kInlineOnLine0 == 24);

uint64_t lines_of(uint64_t bytes) { return (bytes + kLine - 1) / kLine; }

// The receiver's steps for a header line and `span_lines` lines from the next entry on, when a
// waiting receiver asks for `asked` lines after the header's first (they come with it).
int span_steps(uint64_t span_lines, int asked) {
  return static_cast<int>(2 + span_lines) <= asked ? 1 : 2;  // the header entry's lines 1-2 come first
}

}  // namespace

WireLines wire_lines(int version, size_t bytes, unsigned ring_entries, int ndim, int asked) {
  WireLines w;
  uint64_t entries = 1;  // ring entries the message takes
  if (bytes <= kInlineOnLine0) {
    w.forward = 1;
    w.steps = 1;
    w.order = "entry line 0 (seq, header, bytes)";
  } else if (bytes <= shm::kInlineBytes) {
    w.forward = 2;
    w.steps = asked >= 1 ? 1 : 2;
    w.order = asked >= 1 ? "entry lines 0 and 1 together" : "entry line 0, then line 1 (the rest of the bytes)";
  } else if (version >= 9 && bytes <= shm::span_limit(ring_entries)) {
    entries += shm::span_entries(bytes);
    // In a ping-pong of one size the last message was as long: after a span of more than one
    // entry, the waiting receiver asks for its entry's own lines only.
    if (asked > 0 && shm::span_entries(bytes) > 1) asked = std::min(asked, shm::kWaitPrefetchLinesAfterSpan);
    w.forward = 1 + static_cast<double>(lines_of(bytes));
    w.steps = span_steps(lines_of(bytes), asked);
    w.order = w.steps == 1 ? "entry line 0 and the span's " + std::to_string(lines_of(bytes)) + " lines together"
                           : "entry line 0, then the span's " + std::to_string(lines_of(bytes)) + " lines together";
  } else {
    // The slot index on the entry's line 1, then the slot's state and its payload; the receiver
    // frees the state, which the sender reads when it takes that slot again.
    w.forward = 3 + static_cast<double>(lines_of(bytes));
    w.back = 1;
    w.steps = asked >= 1 ? 2 : 3;
    w.order = std::string(asked >= 1 ? "entry lines 0 and 1 (slot index) together"
                                     : "entry line 0, then line 1 (slot index)") +
              ", then the slot's state and its " + std::to_string(lines_of(bytes)) + " lines; back: the slot's state";
  }
  if (ndim >= 2 && ndim <= static_cast<int>(shm::kMaxDims)) {
    // The shape on the header entry's third line, fetched once line 0 says how many dimensions
    // (with the entry's other lines, not after them).
    w.forward += 1;
    w.steps = std::max(w.steps, asked >= 2 ? 1 : 2);
    w.order += " + line 2 (the shape)";
  }
  // The sender reads the tail's line once a ring's worth of entries went by.
  w.back += static_cast<double>(entries) / ring_entries;
  return w;
}

WireLines batch_lines(int version, const std::vector<Leaf>& leaves, unsigned ring_entries, int asked) {
  uint64_t records = 0;
  for (const Leaf& l : leaves) {
    records += shm::batch_record_bytes(
        l.ndim <= static_cast<int>(shm::kMaxDims) ? static_cast<uint8_t>(l.ndim) : shm::kShapeNotSent, l.bytes);
  }
  WireLines w;
  if (version >= 10 && leaves.size() >= 2 && records <= shm::span_limit(ring_entries)) {
    w.forward = 1 + static_cast<double>(lines_of(records));
    w.steps = span_steps(lines_of(records), asked);
    w.back = static_cast<double>(1 + shm::span_entries(records)) / ring_entries;
    w.order = "one batch: entry line 0, " + std::string(w.steps == 1 ? "and" : "then") + " its " +
              std::to_string(lines_of(records)) + " lines of " + std::to_string(leaves.size()) + " records together";
    return w;
  }
  for (const Leaf& l : leaves) {
    const WireLines one = wire_lines(version, l.bytes, ring_entries, l.ndim, asked);
    w.forward += one.forward, w.back += one.back, w.steps += one.steps;
    w.order += (w.order.empty() ? "" : "; ") + one.order;
  }
  return w;
}

void print_wire_lines(const std::vector<size_t>& sizes, unsigned ring_entries) {
  std::printf(
      "\ncache lines crossing between the two cores per message (a model from the segment layout, a\n"
      "%u-entry ring; forward: written by the sender, read by the receiver; back: the other way;\n"
      "steps: the receiver's fetches that wait for the one before; this build's receiver, while it\n"
      "waits, asks for the %d lines after the one it polls, which then come with it; %d after a span\n"
      "of more than one entry)\n",
      ring_entries, shm::kWaitPrefetchLines, shm::kWaitPrefetchLinesAfterSpan);
  const std::string build = "this build (" + std::to_string(shm::kLayoutVersion) + ")";
  std::printf("%9s  %23s  %23s  %s\n", "size", "layout 8 fwd/back/steps", build.c_str(), "this build, in order");
  auto row = [&](const std::string& label, const std::vector<Leaf>& messages) {
    const WireLines old = batch_lines(8, messages, ring_entries, 0);
    const WireLines now = batch_lines(shm::kLayoutVersion, messages, ring_entries, shm::kWaitPrefetchLines);
    std::printf("%9s  %9.1f %6.2f %6d  %9.1f %6.2f %6d  %s\n", label.c_str(), old.forward, old.back, old.steps,
                now.forward, now.back, now.steps, now.order.c_str());
  };
  for (const size_t bytes : sizes) {
    if (bytes <= (size_t{64} << 10)) row(detail::size_label(bytes), {{bytes, 1}});
  }
  row("seed tree", {{8, 1}, {24, 2}, {40, 3}});  // its three leaves, one message each
  std::fflush(stdout);
}

}  // namespace tdshm::bench
