#pragma once
// One measured row of the ping-pong benchmark (pingpong_measurement.cpp): the statistics of a
// transport's recorded round trips on a row, and the JSON line --json writes for it.

#include "pingpong_transport.h"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace tdshm::bench::detail {

struct Measurement {
  std::string transport;
  std::string mode;
  std::string workload;  // "" in size mode
  int leaves = 1;        // tensor leaves of the workload (1 in size mode)
  size_t bytes = 0;
  int iters = 0;
  int warmup = 0;
  int rounds = 0;
  double p50_us = 0, p99_us = 0, min_us = 0, mean_us = 0;
  double gbps = 0;  // decimal GB/s: bytes / p50 one-way time
  // Unpinned runs: the share of rank 0's samples that found both ranks on one CPU (NaN: pinned,
  // or one process).
  double one_cpu = std::numeric_limits<double>::quiet_NaN();
};

/// The measurement of `transport` on `workload` from the recorded times (`round_trips`: each is a
/// round trip, so one way is half of it; otherwise each is a one-way time).
Measurement summarize(const std::string& transport, const Workload& workload, int warmup, int rounds,
                      const std::vector<int64_t>& elapsed_ns, bool round_trips);

/// The measurement of a transport that another program measured (PingPong::external()): p50 is
/// the median of the rounds' p50s, the mean the mean of their means weighted by round trips;
/// p99 and min are unknown (NaN: JSON null, "n/a" in the table).
Measurement summarize_external(const std::string& transport, const Workload& workload, int warmup, int iters,
                               const std::vector<ExternalRound>& rounds);

/// One measurement as one JSON object (no newline). Transport, mode and workload names are
/// plain ASCII identifiers: no escaping needed.
std::string json_line(const Measurement& m);
/// Writes one JSON line per measurement to `path` (replacing it). Throws std::runtime_error.
void write_json(const std::string& path, const std::vector<Measurement>& results);

}  // namespace tdshm::bench::detail
