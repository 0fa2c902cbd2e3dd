#pragma once
// A model of the cache lines one message moves between the sender's core and the receiver's, from
// the segment layout (src/shm/layout/segment_layout.h): how many lines each side writes that the other
// then reads, and in how many dependent steps the receiver fetches its lines. On a machine where
// a line takes 0.2-0.3 us to cross (two sockets; this VM's slow minutes) the steps, not the
// instructions, set a small message's latency.

#include <cstddef>
#include <string>
#include <vector>

namespace tdshm::bench {

/// One message's lines (or a batch's). Counts are per message in a ping-pong (a ring with room,
/// the message no larger than a slot); `back` includes the ring's tail, which the sender reads
/// once its cached copy says the ring is full (a fraction a message).
struct WireLines {
  double forward = 0;  // lines the sender writes and the receiver reads
  double back = 0;     // lines the receiver writes and the sender reads
  int steps = 0;       // the receiver's dependent fetches: each waits for the one before
  std::string order;   // what crosses, step by step
};

/// The lines of a message of `bytes` and `ndim` dimensions (2 or more: the entry's shape line) in
/// layout `version` (8: the arena for every message past 72 bytes; 9: spans) with rings of
/// `ring_entries` entries, to a receiver that asks for `asked` lines after the one it polls while
/// it waits (shm::kWaitPrefetchLines; 0 before it did).
WireLines wire_lines(int version, size_t bytes, unsigned ring_entries, int ndim, int asked);

/// A message of a per-leaf transfer: its bytes and dimensions.
struct Leaf {
  size_t bytes;
  int ndim;
};

/// The lines of `leaves` sent together to one receiver (a per-leaf transfer's send_batch): from
/// layout 10 on, one batch entry when two or more fit a span, else one message each.
WireLines batch_lines(int version, const std::vector<Leaf>& leaves, unsigned ring_entries, int asked);

/// Prints the model for `sizes` (up to 64 KiB, 1-D) and for the seed tree's three leaves (8 bytes
/// [2], 24 bytes [2, 3], 40 bytes [2, 1, 5]) sent per leaf, layout 8 beside this build's.
void print_wire_lines(const std::vector<size_t>& sizes, unsigned ring_entries);

}  // namespace tdshm::bench
