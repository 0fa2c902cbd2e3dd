#pragma once
// The two processes of the ping-pong benchmark (pingpong_processes.cpp): the shared mapping made
// before fork, the CPUs they may run on and the pinning of each, rank 0's reaping of rank 1 from
// a SIGCHLD handler, and the removal of the run's segments when a stop signal ends rank 0.

#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

namespace tdshm::bench::detail {

/// The CPUs this process may run on, in increasing order (empty if they cannot be read).
std::vector<int> allowed_cpus();
/// Pins this process to `cpu`; false if that failed.
bool pin_to(int cpu);

// The anonymous shared mapping made before fork: control block, then the floors' payloads.
class SharedMapping {
 public:
  explicit SharedMapping(size_t bytes);
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  uint8_t* data() const noexcept { return static_cast<uint8_t*>(data_); }

 private:
  void* data_;
  size_t bytes_;
};

// Rank 0 reaps rank 1 from a SIGCHLD handler as soon as it exits. An unreaped child is a zombie,
// and a zombie still looks alive to liveness checks that probe the pid (kill(pid, 0) and
// /proc/<pid>/stat keep answering until it is reaped): without the handler, a transport waiting
// on a dead rank 1 would only give up at its timeout.
//
// Installs the handler for the lifetime of the run and puts the previous one back.
class ChildReaper {
 public:
  ChildReaper();
  ~ChildReaper() { restore(); }
  ChildReaper(const ChildReaper&) = delete;
  ChildReaper& operator=(const ChildReaper&) = delete;

  void watch(pid_t child);
  /// In the forked child: the handler is not its business.
  void restore() noexcept;
  /// Waits up to `grace` for the child to end, then kills it. Returns its wait status.
  int reap(pid_t child, std::chrono::milliseconds grace) const;
  /// The watched child's wait status once the handler has reaped it (-1 before).
  static const std::atomic<int>* child_status() noexcept;

 private:
  struct sigaction previous_ {};
  bool restored_ = false;
};

// A stop signal (Ctrl-C, kill) ends rank 0 by its default action and rank 1 with it (its death
// signal), so neither reaches the removal at the end of the run, and the segments stayed in
// /dev/shm. Rank 0's handler unlinks them and their lock files (paths made beforehand: a handler
// may only call async-signal-safe functions), puts back the previous action and re-raises, so the
// process still ends by the signal. The memmap workloads' handler (pingpong_td.cpp) chains here.
inline constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

/// While alive, a stop signal removes the files of `names` (segments as ProcessGroupShm names
/// them: /dev/shm/tdshm.<name> and its .lock) before the process ends by it.
class SegmentsRemovedOnSignal {
 public:
  explicit SegmentsRemovedOnSignal(const std::vector<std::string>& names);
  ~SegmentsRemovedOnSignal();
  SegmentsRemovedOnSignal(const SegmentsRemovedOnSignal&) = delete;
  SegmentsRemovedOnSignal& operator=(const SegmentsRemovedOnSignal&) = delete;

 private:
  bool installed_[std::size(kStopSignals)] = {};
};

}  // namespace tdshm::bench::detail
