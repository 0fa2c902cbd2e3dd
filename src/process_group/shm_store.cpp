// make_shm_group_from_store and make_group_from_store (include/tdshm/process_group.h): the shm
// backend over a c10d store, as every torch.distributed backend meets. On one host the store only
// carries the segment's name; everything else happens in the segment (ProcessGroupShm's own
// rendezvous). Across hosts (docs/hosts.md) it also carries the ranks' locality answers and the
// rendezvous of the gloo groups beside each host's segment.
//
// Store layout (in the group's own store, which torch has already prefixed with
// "default_pg/<group name>/"): "tdshm_shm_segment" = the segment name, set by group rank 0.
// The name is random (128 bits from std::random_device), so two groups of one run, and two runs
// over one store, never meet on one segment by accident.

#include "common/format.h"
#include "common/random_name.h"
#include "process_group/gloo_group.h"
#include "process_group/locality.h"
#include "process_group/process_group_hosts.h"
#include "shm/parts/trust.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace tdshm {

namespace {

constexpr const char* kSegmentKey = "tdshm_shm_segment";

/// "pg-<pid>-<32 hex digits>": only characters validate_segment_name accepts.
std::string random_segment_name() { return "pg-" + std::to_string(::getpid()) + "-" + detail::random_hex128(); }

}  // namespace

c10::intrusive_ptr<ProcessGroupShm> make_shm_group_from_store(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                              int size, ShmOptions options) {
  if (!store) throw Error("make_shm_group_from_store: the store is null");
  if (size < 1) throw Error("make_shm_group_from_store: size must be at least 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size) {
    throw Error("make_shm_group_from_store: rank " + std::to_string(rank) + " is outside [0, " +
                std::to_string(size) + ")");
  }
  std::string name;
  if (rank == 0) {
    name = random_segment_name();
    store->set(kSegmentKey, std::vector<uint8_t>(name.begin(), name.end()));
  } else {
    try {
      store->wait({kSegmentKey}, options.timeout);
    } catch (const std::exception& e) {
      std::string message = e.what();
      message = detail::first_line(std::move(message));
      throw TimeoutError("make_shm_group_from_store: rank " + std::to_string(rank) +
                         " did not get the segment name from group rank 0 within " +
                         std::to_string(options.timeout.count()) + " ms (" + message + ")");
    }
    const std::vector<uint8_t> value = store->get(kSegmentKey);
    name.assign(value.begin(), value.end());
    validate_segment_name(name);  // the store is shared: check what we read before using it
  }
  return c10::make_intrusive<ProcessGroupShm>(name, rank, size, std::move(options));
}

c10::intrusive_ptr<c10d::ProcessGroup> make_group_from_store(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                             int size, ShmOptions options) {
  if (!store) throw Error("make_group_from_store: the store is null");
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error("make_group_from_store: rank " + std::to_string(rank) + " of a group of " + std::to_string(size));
  }
  detail::Locality locality = detail::discover_locality(*store, rank, size, options.timeout, shm::kSegmentDir);
  if (locality.single_host()) return make_shm_group_from_store(store, rank, size, std::move(options));
  const int host = locality.host_of.at(static_cast<size_t>(rank));
  const std::vector<int>& mine = locality.hosts.at(static_cast<size_t>(host));
  const int local_rank = static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
  detail::ProcessGroupHosts::Parts parts;
  parts.store = store;
  parts.timeout = options.timeout;
  const detail::GlooDevice device = detail::make_gloo_device(detail::tcp_store_host(store));
  // Each part meets under its own prefix of the group's store.
  parts.local = make_shm_group_from_store(
      c10::make_intrusive<c10d::PrefixStore>("tdshm_host_" + std::to_string(mine.front()), store), local_rank,
      static_cast<int>(mine.size()), options);
  parts.network = detail::make_gloo(c10::make_intrusive<c10d::PrefixStore>("tdshm_network", store), rank, size,
                                    options.timeout, device);
  if (local_rank == 0) {
    parts.leaders = detail::make_gloo(c10::make_intrusive<c10d::PrefixStore>("tdshm_leaders", store), host,
                                      static_cast<int>(locality.hosts.size()), options.timeout, device);
  }
  parts.locality = std::move(locality);
  return c10::make_intrusive<detail::ProcessGroupHosts>(rank, size, std::move(parts));
}

}  // namespace tdshm
