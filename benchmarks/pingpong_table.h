#pragma once
// What rank 0 of the ping-pong benchmark prints (pingpong_table.cpp): the header with the
// transports, a table row per measurement, and the goal ratios under the table.

#include "pingpong_measurement.h"

#include <cstddef>
#include <string>
#include <vector>

namespace tdshm::bench::detail {

/// "8 B", "64 KiB", "1 MiB", "1 GiB": a size that is no whole multiple of a unit stays in the
/// smaller one.
std::string size_label(size_t bytes);

/// The title, the method, the transports and the column heads (workload columns with `td`).
void print_header(const std::vector<std::string>& transports, bool td, const std::string& pinning);
/// One table row; `first_of_row`: the first transport of a size or workload, which names it.
void print_row(const Measurement& m, bool first_of_row);
/// The goal ratios of this run's measurements (the TensorDict goals with `td`).
void print_goals(const std::vector<Measurement>& results, bool td);

}  // namespace tdshm::bench::detail
