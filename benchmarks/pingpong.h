#pragma once
/// \file
/// Two-process ping-pong benchmark: what a user of tdshm feels, next to its floors and ceilings,
/// measured in the same run (`tdshm bench`).
///
/// Method (after Aeron's Ping/Pong samples): the bench forks one peer before LibTorch starts any
/// thread, pins rank 0 and rank 1 to two different CPUs, brings every transport up in both
/// processes, then, size by size (or workload by workload, below) and transport by transport,
/// rank 0 sends a message of the size to rank 1, which receives it and sends a message of the
/// same size back. Each round trip is timed on rank 0 with steady_clock; one-way latency is half
/// of it. Warm-up round trips come first and are not recorded. A row's round trips are cut into
/// rounds that interleave the transports, so that a change of load on the (shared) machine hits
/// them all alike. p50 and p99 are nearest-rank percentiles of the recorded one-way times; GB/s
/// is bytes / p50 one-way time in decimal units (10^9 bytes per second).
///
/// Transports (names as `--transports` spells them):
///   shm           ProcessGroupShm, waiters spin (250 us) then sleep on a futex mode "spinning"
///   shm-blocking  ProcessGroupShm with spin = 0: waiters only sleep          mode "blocking"
///   gloo          c10d::ProcessGroupGloo over TCP on 127.0.0.1                mode "tcp-loopback"
///   spin          floor: a sequence word per direction on its own cache line of a shared
///                 mapping, the peer spins on it; the payload is copied into and out of a
///                 shared buffer                                               mode "spinning"
///   futex         floor: the same, but every wait sleeps in FUTEX_WAIT and every post calls
///                 FUTEX_WAKE                                                  mode "blocking"
///   ring          floor: per direction a ring of cache-line elements (a sequence word and 56
///                 payload bytes each) that the consumer polls in place; one message per leaf
///                 in --td                                                     mode "spinning"
///   ucx-posix     UCX's ucx_perftest -t tag_lat (UCX_TLS=posix,self), pinned to the ranks'
///                 CPUs, one run per round; only where installed (pingpong_ucx.h) mode "spinning"
///   memcpy        ceiling: one memcpy of the size between two warm buffers, one process;
///                 its "one-way" time is the copy time                         mode "single-process"
///
/// TensorDict mode (`tdshm bench --td`, BenchOptions::td): the rows are TensorDict workloads
/// instead of sizes, and the transports are
///   td-shm        TensorDict::send / recv over a ProcessGroupShm (spinning, as for "shm")
///                 wrapped as a standalone tdshm::Group                         mode "spinning"
///   td-gloo       the same over the gloo group above                          mode "tcp-loopback"
///   spin, memcpy  the floor and the ceiling above, at the workload's total bytes (one message)
///   ring          the ring floor, one message per leaf (per-leaf workloads)
/// The ping: rank 0 td.send({group, group_dst = 1}) then td_back.recv({group, group_src = 1});
/// the pong: rank 1 recv into its tensordict, then sends it back. verify() checks that every
/// leaf of td_back holds the pattern rank 0 sent. Workloads (names as `--workloads` spells them):
///   seed                {("a","b"): 2 floats, "c": 2x3 floats, "_": 2x1x5 floats}, batch [2]:
///                       3 leaves, 72 bytes, per-leaf
///   seed-consolidated   the same tree, send/recv(consolidated=True) between consolidated
///                       tensordicts (the sender keeps its consolidated copy: no copy per send)
///   100x1KiB            100 float leaves of 1 KiB, per-leaf
///   10x1MiB             10 float leaves of 1 MiB, per-leaf
///   64MiB-consolidated  one 64 MiB leaf, consolidated send/recv of its 64 MiB storage
///   memmap-4KiB         one named MemoryMappedTensor leaf over a file in /dev/shm (unique name,
///   memmap-1GiB         removed when the row ends, on an exception, or on SIGINT/SIGTERM/SIGHUP)
///                       that both ranks' leaves map, per-leaf: over shm it goes by reference and
///                       nothing is copied; over gloo it travels by value. Rank 0 checks the free
///                       space of /dev/shm and MemAvailable first and skips the row with a message
///                       (not an error) when there is no room.
/// Gloo transports get at most max(5, 4 GiB / bytes) recorded round trips per row (1 GiB: 5),
/// and sit out the rounds that leaves empty.

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

namespace tdshm::bench {

/// Options of `tdshm bench`; the defaults are the full run.
struct BenchOptions {
  /// Message sizes in bytes, measured in this order (size sweep; not with `td`).
  std::vector<size_t> sizes{8, 64, size_t{4} << 10, size_t{64} << 10, size_t{1} << 20, size_t{16} << 20,
                            size_t{64} << 20};
  /// Recorded round trips per size at most; big sizes get fewer (see iterations_for()).
  int iters = 10000;
  /// Warm-up round trips per size at most; big sizes get fewer.
  int warmup = 1000;
  /// Each size's iterations are split into this many rounds that interleave the transports.
  int rounds = 5;
  /// Transports to measure, in table order. Empty: all of them (all_transports(), or
  /// all_td_transports() with `td`).
  std::vector<std::string> transports;
  /// TensorDict mode: the rows are the TD workloads instead of `sizes`.
  bool td = false;
  /// TD workloads to measure, in table order (names from all_workloads()). Empty: all of them.
  std::vector<std::string> workloads;
  /// If not empty, one JSON object per measurement is written to this file (JSON Lines).
  std::string json_path;
  /// A short run for smoke tests: fewer iterations and a smaller byte budget per size.
  bool quick = false;
  /// Pin rank 0 and rank 1 to the first two CPUs this process may run on.
  bool pin = true;

  // ---- workload scenarios (scenarios.h); when any is given, the size sweep does not run ----
  /// Scenarios to run, in this order: "loader", "actor-learner", "collectives" (--collectives).
  std::vector<std::string> scenarios;
  /// loader: the numbers of worker processes, one process layout each.
  std::vector<int> workers{1, 2, 4, 8};
  /// actor-learner: the number of actor processes.
  int actors = 2;
  /// loader: batches each worker sends per measurement (parse_bench_options: 300, quick 30).
  int batches = 300;
  /// actor-learner: steps per measurement (parse_bench_options: 200, quick 20).
  int steps = 200;
  /// Measurements of each (pattern, transport, N); the report gives median and min-max
  /// (parse_bench_options: 3, quick 1).
  int repeat = 3;
  /// A progress line on stderr during scenarios even when stderr is not a terminal.
  bool progress = false;
  /// World sizes whose shm segment size (default ShmOptions) is printed.
  std::vector<int> worlds;
  /// --collectives (scenario "collectives", never in --scenario all): the world sizes, one
  /// layout each; the message sizes are `sizes` (parse_bench_options: default_collective_sizes()
  /// unless --sizes is given).
  std::vector<int> world_sizes{2, 4, 8};

  // ---- reports (bench_report.h) ----
  /// If not empty, draw the size sweep and the scenarios' throughput into this .png or .svg.
  std::string plot_path;
  /// JSON Lines files whose rows join this run's rows (for --plot and --compare); given alone
  /// (no scenario), nothing is measured.
  std::vector<std::string> from_paths;
  /// If not empty, compare this run's rows with the rows of this earlier JSON Lines file.
  std::string compare_path;
  /// --compare fails (exit 3) when a matched throughput dropped, or a latency rose, by more
  /// than this percentage.
  double threshold = 25.0;

  /// Whether the two-process size sweep (or --td) runs: no scenario, --world or --from given.
  bool sweep() const { return scenarios.empty() && worlds.empty() && from_paths.empty(); }
};

/// Every transport name of the size sweep, in the default table order.
const std::vector<std::string>& all_transports();
/// Every transport name of the TensorDict mode, in table order.
const std::vector<std::string>& all_td_transports();
/// Every TD workload name, in table order.
const std::vector<std::string>& all_workloads();

/// Parses the arguments that follow `bench` (argv[0] is the first of them). Throws
/// std::invalid_argument with a message naming the bad argument. `help` is set for -h/--help.
BenchOptions parse_bench_options(int argc, char** argv, bool& help);

/// Writes the usage text of `tdshm bench` to `out`.
void print_bench_usage(FILE* out);

/// Recorded and warm-up round trips of `transport` on a row that moves `bytes` one way under
/// `options` (a gloo transport may get fewer; "" stands for any other transport).
int iterations_for(const BenchOptions& options, size_t bytes, const std::string& transport = "");
int warmup_for(const BenchOptions& options, size_t bytes, const std::string& transport = "");

/// Runs the benchmark: forks the peer, measures, prints the table and the goal ratios, writes
/// the JSON file. Returns 0 if every requested measurement ran (a missed goal is not a
/// failure), 1 otherwise. Must be called before this process has started LibTorch threads.
/// If `json_lines` is not null, the JSON object of every measurement (one line each, without
/// the newline, as --json writes them) is appended to it, with or without --json.
int run_pingpong_bench(const BenchOptions& options, std::vector<std::string>* json_lines = nullptr);

}  // namespace tdshm::bench
