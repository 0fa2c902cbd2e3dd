#pragma once
/// \file
/// `tdshm bench --scenario board`: the versioned board against TorchRL's shared-buffer + pipe +
/// ack pattern for 4 MiB of weights, in the same run (board_scenario.cpp says what each row
/// measures). Readers: --actors (default 2); updates per measurement: --steps.

#include "pingpong.h"
#include "scenarios.h"

namespace tdshm::bench {

/// Prints the board's table and goal lines; returns its rows ("board" scenario, p50_us metric).
/// Must be called while this process has started no LibTorch thread (it forks).
ScenarioRun run_board(const BenchOptions& options);

}  // namespace tdshm::bench
