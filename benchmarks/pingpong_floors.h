#pragma once
// The floors and the ceiling of the ping-pong benchmark, and ping-pong over any c10d group
// (pingpong_floors.cpp): the spin and futex floors over the shared payload buffers, the spin
// floor's wire behind c10d's API (c10d-spin), the memcpy ceiling, and the PingPong of send/recv
// of a uint8 tensor that the shm and gloo groups are measured with.

#include "pingpong_link.h"
#include "pingpong_transport.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace tdshm::bench::detail {

std::unique_ptr<PingPong> make_floor_pingpong(Link& link, WaitMode mode, uint8_t* payload0, uint8_t* payload1);
/// The spin floor's wire behind c10d's API: a two-rank c10d::ProcessGroup whose send copies the
/// tensor into the payload buffer and bumps a sequence word, and whose recv's Work spins on that
/// word and copies out. What any ProcessGroup pays for c10d's calls and Work objects on top of
/// the spin floor (messages must fit the payload buffers, as the floor's do).
c10::intrusive_ptr<c10d::ProcessGroup> make_spin_floor_group(Link& link, uint8_t* payload0, uint8_t* payload1,
                                                             size_t capacity);
std::unique_ptr<PingPong> make_memcpy_pingpong();
/// Ping-pong with send/recv of a uint8 tensor over a two-rank c10d group; rank 1 receives into
/// its buffer and sends that buffer back.
std::unique_ptr<PingPong> make_c10d_pingpong(c10::intrusive_ptr<c10d::ProcessGroup> group);

}  // namespace tdshm::bench::detail
