#pragma once
// UCX's shared-memory transport in the ping-pong benchmark (pingpong_ucx.cpp): the transport
// "ucx-posix" runs UCX's own `ucx_perftest -t tag_lat` (Debian package ucx-utils) as two
// processes pinned to the CPUs of the benchmark's ranks, with UCX_TLS=posix,self, once per
// round, in the same rounds as the other transports. Optional: without ucx_perftest the
// default run leaves it out and says so; naming it in --transports makes its absence an error.

#include "pingpong_transport.h"

#include <memory>
#include <string>
#include <vector>

namespace tdshm::bench::detail {

/// ucx_perftest's path: $TDSHM_UCX_PERFTEST if set, else the first executable one in $PATH;
/// "" if there is none.
std::string find_ucx_perftest();

/// The "ucx-posix" transport: rank 0 only (external()). `cpus`: the CPUs of rank 0 and rank 1
/// (the client and the server are pinned there), empty when the ranks are not pinned.
/// Throws std::runtime_error if ucx_perftest is not found.
std::unique_ptr<PingPong> make_ucx_pingpong(std::vector<int> cpus);

}  // namespace tdshm::bench::detail
