// The cache-line model of a message on the wire (wire_lines.h), from segment_layout.h's constants.

#include "wire_lines.h"

#include "pingpong_table.h"
#include "shm/segment_layout.h"

#include <cstdio>

namespace tdshm::bench {

namespace {

constexpr uint64_t kLine = shm::kCacheLine;
// Bytes of an entry's inline payload on its first line (after the 40-byte header).
constexpr uint64_t kInlineOnLine0 = kLine - sizeof(shm::EntryHeader);
static_assert(kInlineOnLine0 == 24);

uint64_t lines_of(uint64_t bytes) { return (bytes + kLine - 1) / kLine; }

}  // namespace

WireLines wire_lines(int version, size_t bytes, unsigned ring_entries) {
  WireLines w;
  uint64_t entries = 1;  // ring entries the message takes
  if (bytes <= kInlineOnLine0) {
    w.forward = 1;
    w.steps = 1;
    w.order = "entry line 0 (seq, header, bytes)";
  } else if (bytes <= shm::kInlineBytes) {
    w.forward = 2;
    w.steps = 2;
    w.order = "entry line 0, then line 1 (the rest of the bytes)";
  } else if (version >= 9 && bytes <= shm::span_limit(ring_entries)) {
    entries += shm::span_entries(bytes);
    w.forward = 1 + static_cast<double>(lines_of(bytes));
    w.steps = 2;
    w.order = "entry line 0, then the span's " + std::to_string(lines_of(bytes)) + " lines together";
  } else {
    // The slot index on the entry's line 1, then the slot's state and its payload; the receiver
    // frees the state, which the sender reads when it takes that slot again.
    w.forward = 3 + static_cast<double>(lines_of(bytes));
    w.back = 1;
    w.steps = 3;
    w.order = "entry line 0, then line 1 (slot index), then the slot's state and its " +
              std::to_string(lines_of(bytes)) + " lines; back: the slot's state";
  }
  // The sender reads the tail's line once a ring's worth of entries went by.
  w.back += static_cast<double>(entries) / ring_entries;
  return w;
}

void print_wire_lines(const std::vector<size_t>& sizes, unsigned ring_entries) {
  std::printf(
      "\ncache lines crossing between the two cores per message (a model from the segment layout, a\n"
      "%u-entry ring; forward: written by the sender, read by the receiver; back: the other way;\n"
      "steps: the receiver's fetches that wait for the one before)\n",
      ring_entries);
  std::printf("%9s  %23s  %23s  %s\n", "size", "layout 8 fwd/back/steps", "this build (9)", "this build, in order");
  auto row = [&](const std::string& label, const std::vector<size_t>& messages) {
    WireLines old, now;
    for (const size_t bytes : messages) {
      const WireLines o = wire_lines(8, bytes, ring_entries), n = wire_lines(shm::kLayoutVersion, bytes, ring_entries);
      old.forward += o.forward, old.back += o.back, old.steps += o.steps;
      now.forward += n.forward, now.back += n.back, now.steps += n.steps;
      now.order += (now.order.empty() ? "" : "; ") + n.order;
    }
    std::printf("%9s  %9.1f %6.2f %6d  %9.1f %6.2f %6d  %s\n", label.c_str(), old.forward, old.back, old.steps,
                now.forward, now.back, now.steps, now.order.c_str());
  };
  for (const size_t bytes : sizes) {
    if (bytes <= (size_t{64} << 10)) row(detail::size_label(bytes), {bytes});
  }
  row("seed tree", {8, 24, 40});  // its three leaves, one message each
  std::fflush(stdout);
}

}  // namespace tdshm::bench
