#pragma once
// Internal: which ranks of a group can share memory. Two ranks can when each opens the other's
// files in /dev/shm (the same tmpfs: one host, or containers sharing it) and both run in one PID
// namespace (so that each can judge whether the other still runs, which the shm transport's crash
// recovery relies on). Such ranks form one "host"; every other pair has to be reached over the
// network.
//
// The test cannot be fooled by equal host names, nor by the equal namespace inode numbers that
// every freshly booted kernel hands out: each rank creates a file of a random 128-bit name in the
// shm directory and publishes its name, device and inode, and its PID namespace's, in the
// group's store; rank i sees rank j when j's file is there under that name with that device and
// inode and j's PID namespace is i's own. Ranks i and j are local when each sees the other; the
// hosts are the classes of that relation (closed transitively), every rank computing the same
// partition from the same published answers. The probe files are removed before it returns,
// also when it fails.
//
// Store keys (in the group's store): "tdshm_locality/probe/<rank>" = "<file name> <dev> <ino>
// <pid-ns dev> <pid-ns ino>", then "tdshm_locality/sees/<rank>" = one '0' or '1' per rank.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace tdshm::detail {

struct Locality {
  /// The ranks of each host, ascending; hosts ordered by their lowest rank (that rank leads it).
  std::vector<std::vector<int>> hosts;
  /// The host index of each rank.
  std::vector<int> host_of;

  bool single_host() const noexcept { return hosts.size() <= 1; }
  bool local(int a, int b) const { return host_of.at(static_cast<size_t>(a)) == host_of.at(static_cast<size_t>(b)); }
  /// The lowest rank of `rank`'s host.
  int leader_of(int rank) const { return hosts.at(static_cast<size_t>(host_of.at(static_cast<size_t>(rank)))).front(); }
};

/// The hosts of a group of `size` ranks, this one being `rank`, found through `store` (every rank
/// of the group calls it once per store). `shm_dir` is where the probe files go: where the
/// segments live (shm::kSegmentDir), or a test's directory.
/// Throws TimeoutError when a rank does not answer within `timeout`, Error when the probe file
/// cannot be created or a published answer is malformed (the store is shared: nothing read from
/// it is trusted).
Locality discover_locality(c10d::Store& store, int rank, int size, std::chrono::milliseconds timeout,
                           const std::string& shm_dir);

/// The partition of `size` ranks that `sees` (sees[i][j]: rank i sees rank j) makes: i and j are
/// local when each sees the other, closed transitively. Pure; exposed for tests.
Locality locality_from(const std::vector<std::vector<bool>>& sees);

}  // namespace tdshm::detail
