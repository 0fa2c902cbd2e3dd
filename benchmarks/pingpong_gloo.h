#pragma once
// The gloo baseline of the ping-pong benchmark (pingpong_gloo.cpp): c10d::ProcessGroupGloo over
// TCP on 127.0.0.1, rendezvous through the Link.

#include "pingpong_link.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>

namespace tdshm::bench::detail {

/// c10d::ProcessGroupGloo over TCP on 127.0.0.1 with a TCPStore served by rank 0 on a free port.
/// Calls link.sync() exactly once on both ranks, whatever fails.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(Link& link, std::chrono::milliseconds timeout);

}  // namespace tdshm::bench::detail
