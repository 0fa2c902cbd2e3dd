#pragma once
// The ring floor of the ping-pong benchmark (pingpong_ring.cpp): per direction, a ring of
// cache-line elements in the shared mapping, each carrying its own sequence word next to 56
// bytes of payload, so that the consumer polls the very line it will read and an 8-byte
// message moves one cache line. The "spin" floor (pingpong_floors.h) moves two (its sequence
// word and its payload live on different lines). What the hardware allows a shared-memory
// transport that owns its buffers: a message is copied into the ring and out of it.

#include "pingpong_link.h"
#include "pingpong_transport.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

namespace tdshm::bench::detail {

/// One element of the ring: written by the producer (payload first, then `seq` with release
/// order), read by the consumer once `seq` says the element holds the line it waits for.
struct alignas(kCacheLine) RingLine {
  static constexpr size_t kPayload = kCacheLine - sizeof(uint32_t);
  uint32_t seq;  // (position of this line in the producer's stream + 1), modulo 2^32
  uint8_t payload[kPayload];
};
static_assert(sizeof(RingLine) == kCacheLine, "one element per cache line");

/// One direction: the consumer's position (published every quarter of the ring, so that the
/// producer reads it only when it believes the ring full), then the lines.
struct RingDirection {
  static constexpr size_t kLines = 4096;  // 256 KiB: a message of any size streams through it
  SharedWord consumed;                    // lines consumed so far, modulo 2^32
  RingLine lines[kLines];
};
static_assert(std::is_trivially_copyable_v<RingDirection> && std::is_standard_layout_v<RingDirection>,
              "RingDirection lives in a mapping both processes use");

/// The ring floor over `rings[0]` (rank 0 -> 1) and `rings[1]` (rank 1 -> 0), both zeroed. A
/// row's messages are the leaves of its workload (ring_messages()): per-leaf workloads move one
/// message per leaf, as the transports under test do; each message starts on a fresh line.
std::unique_ptr<PingPong> make_ring_pingpong(Link& link, RingDirection* rings);

}  // namespace tdshm::bench::detail
