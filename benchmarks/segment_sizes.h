#pragma once
/// \file
/// `tdshm bench --world 2,9,65`: the size of the shm segment per world size.

#include "bench_report.h"

#include <vector>

namespace tdshm::bench {

/// Prints the size of the shm segment for each world size in `worlds` with default ShmOptions
/// (tdshm::shm_segment_bytes) and returns one row per world size:
/// {"scenario":"segment","world":N,"segment_bytes":B}.
std::vector<Row> print_segment_sizes(const std::vector<int>& worlds);

}  // namespace tdshm::bench
