#pragma once
// Simulated hosts for the tests and benchmarks of worlds that span hosts (tests/dist/test_hosts.cpp,
// benchmarks/bench_hosts.cpp), made as the OS makes them: a host is a process that enters its
// own namespaces and forks its ranks, which inherit them.
//  * kOwnShm: its own mount namespace with a private tmpfs on /dev/shm (what another machine's
//    /dev/shm is to this one) and its own UTS namespace. Every such host takes the same host
//    name, "node", so that nothing can tell hosts apart by name. The network is shared, so gloo
//    runs over 127.0.0.1, and so is /tmp (where file stores live).
//  * kOwnPid: its own PID namespace, /dev/shm shared (containers sharing /dev/shm but not their
//    processes).
//  * kSame: no namespace of its own.
// Namespaces need root (unshare); sim_hosts_unavailable() says why they cannot be made, for a
// GTEST_SKIP.

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::sim {

enum class HostView { kSame, kOwnShm, kOwnPid };

struct SimHost {
  HostView view = HostView::kSame;
  std::vector<int> ranks;  // the ranks it runs (global rank numbers)
};

/// Why namespaces cannot be made here (not root, unshare or mount refused), or nullopt.
std::optional<std::string> sim_hosts_unavailable();

/// Runs `body(rank)` in one process per rank, each on its host; a rank fails when body throws
/// or an SHM_CHECK fails in it. A kOwnShm host also fails when anything named "tdshm.*" is left
/// in its /dev/shm once its ranks are gone. Returns one message per failed rank or host (empty:
/// all passed). Every process is killed at `deadline` (a failure too).
std::vector<std::string> run_sim_hosts(const std::vector<SimHost>& hosts, const std::function<void(int rank)>& body,
                                       std::chrono::seconds deadline = std::chrono::seconds(60));

}  // namespace tdshm::sim
