#pragma once
/// \file
/// The process machinery that `tdshm bench --scenario` and `--collectives` share (scenarios.h,
/// collectives.h): forking the ranks of one process layout from a coordinator that never touches
/// LibTorch, each rank holding a ProcessGroupShm and a gloo group (TCPStore on 127.0.0.1) over
/// the same ranks; one line per report from the ranks to the coordinator through a pipe; killing
/// and reaping every rank on a failure, an overrun deadline or SIGINT / SIGTERM / SIGHUP (then
/// ending by that signal); removing the layout's segment if the ranks left it behind.

#include <tdshm/distributed.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tdshm::bench {

/// Deadline of every rendezvous and every wait of a rank (shm, gloo, the TCPStore).
inline constexpr std::chrono::milliseconds kGroupTimeout{std::chrono::seconds(60)};

/// Shared by the coordinator and the ranks of one layout (MAP_SHARED | MAP_ANONYMOUS, made
/// before fork, zero at first).
struct Control {
  std::atomic<uint32_t> gloo_port;  // rank 0's TCPStore port; 0 until it listens
  std::atomic<uint32_t> gave_up;    // 1 once a rank failed before the gloo rendezvous
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "Control lives in a mapping several processes use");

/// A rank's end of the pipe to the coordinator: one line per message, each written with one
/// write() of at most PIPE_BUF bytes, so lines of different ranks never mix.
class Reporter {
 public:
  explicit Reporter(int fd) : fd_(fd) {}
  void line(std::string text) const;

 private:
  int fd_;
};

/// Both groups of a rank, over the same ranks.
struct Groups {
  Group shm;
  Group gloo;
  const Group& operator[](const std::string& transport) const { return transport == "shm" ? shm : gloo; }
};

/// Makes the rank's groups: ProcessGroupShm on `segment`, and gloo through a TCPStore that rank
/// 0 serves on 127.0.0.1 (its port passed through `control`). On failure, tells the other ranks
/// through `control` and rethrows.
Groups make_groups(const std::string& segment, int rank, int world, Control& control);

/// A barrier of `g`'s backend, waited.
void barrier(const Group& g);

/// One process layout: `world` ranks forked afresh, each running `run_rank` (its exit code).
/// A rank reports a measurement with a line of its own format (anything but "E ...") and an
/// error with "E <rank> <message>" before it exits non-zero.
struct RankJob {
  int world = 1;
  std::string segment;  ///< removed afterwards if the ranks left it behind
  std::function<int(int rank, Control& control, const Reporter& report)> run_rank;
  std::function<std::string(int rank)> rank_name;
};

/// What run_ranks collected: the ranks' report lines other than errors, in arrival order, and
/// what went wrong (ranks that ended without a word first, then the ranks' errors, then ranks
/// the coordinator killed after the failure, then a segment left behind).
struct RanksResult {
  std::vector<std::string> reports;
  std::vector<std::string> failures;
};

/// Forks every rank of `job`, collects their reports, reaps every rank; kills them all when one
/// fails (after a grace of 2 s) or when `deadline_after` has passed. Must be called while this
/// process has started no LibTorch thread.
RanksResult run_ranks(const RankJob& job, std::chrono::seconds deadline_after);

/// The median of `v` (not empty).
double median_of(std::vector<double> v);

/// CPUs this process may run on.
int allowed_cpu_count();

}  // namespace tdshm::bench
