// make_shm_group_from_store (include/tdshm/process_group.h): a shm group whose ranks meet through
// a c10d store, as every torch.distributed backend does. The store only carries the segment's
// name; everything else happens in the segment (ProcessGroupShm's own rendezvous).
//
// Store layout (in the group's own store, which torch has already prefixed with
// "default_pg/<group name>/"): "tdshm_shm_segment" = the segment name, set by group rank 0.
// The name is random (128 bits from std::random_device), so two groups of one run, and two runs
// over one store, never meet on one segment by accident.

#include "common/format.h"
#include "common/random_name.h"

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <unistd.h>

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

}  // namespace tdshm
