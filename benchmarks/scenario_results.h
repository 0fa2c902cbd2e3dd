#pragma once
/// The scenarios' measurements as rank 0 reports them, their statistics and the tables' fixed
/// parts (columns, goal lines); scenarios.cpp runs the layouts and prints the rows.

#include "pingpong.h"

#include <cstddef>
#include <string>
#include <vector>

namespace tdshm::bench {

struct Measured {
  std::string pattern, transport;
  int repeat = 0;
  int count = 0;
  double seconds = 0;
  double read_seconds = 0;  // loader: main's time reading and checking batches
};

/// Loader: what one worker reported of one measurement.
struct Written {
  std::string pattern, transport;
  int repeat = 0;
  double batch_seconds = 0;  // the median time it took to write a batch
};

struct LayoutResult {
  std::vector<Measured> measured;
  std::vector<Written> written;
  std::vector<std::string> failures;
};

struct Stats {
  int n = 0;
  double median = 0, min = 0, max = 0;
  double median_seconds = 0;
  // Loader: the share of main's loop spent reading batches, and the rate main would reach if
  // it did nothing else (batches / reading seconds) (medians).
  double read_share = 0, read_bound = 0;
  // Loader: main's median time to read a batch, a worker's to write one (median over the workers
  // and repeats).
  double read_batch_seconds = 0, write_batch_seconds = 0;
};

/// Rates (items per second) of the measurements of (pattern, transport).
Stats stats_of(const LayoutResult& r, const std::string& pattern, const std::string& transport, int items_per_count);
/// The ratios the loans are judged by (docs/loans.md), from this layout's medians.
void print_loan_goals(const LayoutResult& r, const std::string& scenario, int items);
/// The header of a scenario's table.
void print_columns(const std::string& scenario);
/// What a scenario measures, printed above its tables (loader or actor-learner; an actor's
/// trajectory is `trajectory_bytes`).
void print_scenario_header(const BenchOptions& o, const std::string& scenario, size_t trajectory_bytes);

}  // namespace tdshm::bench
