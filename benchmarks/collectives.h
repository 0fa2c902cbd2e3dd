#pragma once
/// \file
/// `tdshm bench --collectives`: all_reduce (SUM, float32), all_gather, broadcast (from rank 0)
/// and scatter (from rank 0) over ProcessGroupShm against gloo, in the same forked processes
/// (bench_ranks.h), for each world size and message size, next to a single-thread memcpy of
/// each size, and TensorDict::all_reduce / all_gather of the seed tree and of 10 x 1 MiB float
/// leaves over both; then the goal ratios. Not part of `--scenario all`.
///
/// Schedule of a world (the same on every rank): for each op and size, per transport one
/// checked op (values set per rank, the result checked on every rank), then a calibration that
/// doubles the ops between two barriers until they take 10 ms (the warm-up), from which rank 0
/// picks the ops per round for a budget of 100 ms (at least 1, at most 100000) and broadcasts
/// it over gloo; then `repeat` rounds per transport, the transport order alternating. Rank 0
/// times a round from the end of a barrier to the end of a closing barrier and divides by the
/// round's ops: every rank has finished its last op before the closing barrier ends, so a round
/// is the slowest rank's time, plus one barrier.
///
/// Bytes: the float32 tensor each rank contributes (all_reduce, all_gather, broadcast) or
/// receives (scatter: the root sends world x bytes); GB/s = bytes / per-op time (algorithm
/// bandwidth, 10^9 bytes/s).

#include "scenarios.h"

namespace tdshm::bench {

/// The default sizes and world sizes of --collectives.
const std::vector<size_t>& default_collective_sizes();

/// Measures and prints the memcpy reference and every world of options.world_sizes; returns
/// the rows (scenario "collectives") and what went wrong. Forks: must be called while this
/// process has started no LibTorch thread.
ScenarioRun run_collectives(const BenchOptions& options);

}  // namespace tdshm::bench
