#pragma once
/// \file
/// Workload scenarios of `tdshm bench --scenario`: what a data loader and an actor-learner pair
/// get from tdshm, measured with real forked processes through the public API only
/// (TensorDict::send / recv / isend / irecv on standalone tdshm::Group objects over a
/// ProcessGroupShm and over gloo_group_from_store with a TCPStore on 127.0.0.1, in the same
/// processes and the same run).
///
/// Processes: the calling process (the coordinator) never touches LibTorch. For each process
/// layout (a worker or actor count) it forks every rank afresh (rank 0: main / learner), so each
/// rank forks before LibTorch has started a thread; the ranks die with the coordinator
/// (PR_SET_PDEATHSIG). Rank 0 reports each measurement to the coordinator through a pipe, every
/// rank reports its error there before it exits non-zero. Every wait of the ranks has a deadline
/// (group and store timeouts of 60 s); the coordinator kills and reaps all ranks of a layout
/// when one of them fails or when the layout overruns its own deadline, and removes the layout's
/// segment (/dev/shm/tdshm.tdshm-bench-<pid>-<scenario>-<N>) if the ranks left it behind. On
/// SIGINT, SIGTERM or SIGHUP it does the same, then ends by that signal.
///
/// Schedule of a layout (the same on every rank): one warm-up per (pattern, transport), then
/// `repeat` rounds, each measuring every pattern over shm and gloo (the transport order
/// alternates from round to round), each measurement preceded by a barrier of its group. Rank 0
/// times its receive loop with steady_clock from the barrier to the last batch checked.
///
/// loader (N = --workers): worker w sends --batches batches; a batch is the TensorDict
/// {"image": uint8 [32,3,64,64], "label": int64 [32], "meta": {"idx": int64 [32],
/// "worker": int64 [32]}}, batch size [32] (393984 bytes of leaves), with values that depend on
/// w and a batch number that keeps growing across measurements; main checks every leaf of
/// every batch it receives (meta.worker == w, meta.idx increasing, label, three image bytes),
/// and a wrong value fails the run. Patterns:
///   blocking      main: for each batch, recv (per-leaf) from worker 1, then 2, ... N
///   irecv-ahead   main: irecv(return_premature) from every worker, then wait for each
///   consolidated  workers: consolidate() each batch (one copy), send(consolidated); main: recv
///                 into a consolidated tensordict per worker, round-robin
/// batches/s = N * batches / the receive loop's seconds; GB/s = batches/s * 393984 / 10^9.
///
/// actor-learner (A = --actors): per step the learner isend(consolidated, return_early)s its
/// weights (4 float leaves of 1 MiB, consolidated once) to every actor, then irecv
/// (return_premature)s every actor's trajectory {"obs": float [64,16], "action": int64 [64],
/// "reward": float [64]} (per-leaf) and waits for all; an actor recv(consolidated)s the
/// weights, checks the step number in them, writes it into its trajectory and sends that.
/// steps/s = steps / seconds; GB/s counts both directions.
///
/// Test hook: the environment variable TDSHM_BENCH_FAULT makes rank 1 misbehave, so that tests
/// can see a failure reported and every process reaped: "loader-data" (worker 1 sends a wrong
/// meta.worker in batch 5: main's check fails) or "worker-exit" (worker or actor 1 exits with 7
/// before its batch or step 3).

#include "bench_report.h"
#include "pingpong.h"

#include <string>
#include <vector>

namespace tdshm::bench {

/// The scenario names, in the order `all` runs them: "loader", "actor-learner" ("collectives",
/// which `--collectives` runs, is not one of them).
const std::vector<std::string>& all_scenarios();

/// What run_scenarios measured: one row per (scenario, pattern, transport, N) with the median
/// over the repeats (see `tdshm bench --help` for the fields), and what went wrong.
struct ScenarioRun {
  std::vector<Row> rows;
  std::vector<std::string> failures;
};

/// Runs options.scenarios in order, printing a table per process layout to stdout as each ends,
/// and a progress line to stderr when stderr is a terminal or options.progress is set. Must be
/// called while this process has started no LibTorch thread (it forks).
ScenarioRun run_scenarios(const BenchOptions& options);

}  // namespace tdshm::bench
