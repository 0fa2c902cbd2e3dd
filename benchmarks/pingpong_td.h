#pragma once
// The TensorDict workloads of the ping-pong benchmark (`tdshm bench --td`, pingpong_td.cpp):
// the workloads, the ping-pong of TensorDict::send / recv over a two-rank c10d group, and the
// file of the memmap workloads with the check for room to make it.

#include "pingpong_transport.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tdshm::bench::detail {

/// The TD workloads, in table order.
const std::vector<Workload>& td_workloads();

/// Ping-pong of TensorDict::send / recv over a two-rank c10d group, wrapped as a standalone
/// tdshm::Group (peers addressed with group_dst / group_src). Rank 0 sends its tensordict and
/// receives the echo into a second one; rank 1 receives into its tensordict and sends it back.
/// verify() checks the echo's leaves against the pattern rank 0 sent.
std::unique_ptr<PingPong> make_td_pingpong(c10::intrusive_ptr<c10d::ProcessGroup> group, int rank);

/// Why a memmap workload's file of `file_bytes` cannot be made in directory `dir` now (free
/// space of its filesystem), or why the row would run short of memory (`memory_bytes`: the file
/// plus the buffers of the floors at that size, against MemAvailable); "" if there is room.
std::string no_room_for(const std::string& dir, uint64_t file_bytes, uint64_t memory_bytes);

/// The file of a memmap workload, owned by rank 0: created holding the pattern of leaf 0, and
/// unlinked by the destructor, or by SIGINT / SIGTERM / SIGHUP while it exists (the handler
/// then puts the previous action back and re-raises the signal; the previous handlers are also
/// put back when the file is removed). Move-only; at most one exists at a time.
class WorkloadFile {
 public:
  WorkloadFile() = default;
  /// Creates `path` (absolute, must not exist) of `bytes`. Throws MemmapError / runtime_error.
  WorkloadFile(const std::string& path, size_t bytes);
  ~WorkloadFile();
  WorkloadFile(WorkloadFile&& other) noexcept;
  WorkloadFile& operator=(WorkloadFile&& other) noexcept;
  WorkloadFile(const WorkloadFile&) = delete;
  WorkloadFile& operator=(const WorkloadFile&) = delete;
  const std::string& path() const noexcept { return path_; }

 private:
  void remove() noexcept;
  std::string path_;
};

}  // namespace tdshm::bench::detail
