// One measured row of the ping-pong benchmark (pingpong_measurement.h): nearest-rank percentiles
// and the mean of the one-way times, GB/s from p50, and the row as a JSON line.

#include "pingpong_measurement.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace tdshm::bench::detail {

namespace {

// Nearest-rank percentile of sorted values: the smallest value with at least p% at or below it.
double percentile(const std::vector<double>& sorted, double p) {
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// A row's identity: what it measured, where, with how much warm-up, in how many rounds.
Measurement row_of(const std::string& transport, const Workload& workload, int warmup, int rounds) {
  Measurement m;
  m.transport = transport;
  m.mode = transport_info(transport).mode;
  m.workload = workload.name;
  m.leaves = workload.leaves;
  m.bytes = workload.bytes;
  m.warmup = warmup;
  m.rounds = rounds;
  return m;
}

double gbps_of(size_t bytes, double p50_us) {
  return p50_us > 0 ? static_cast<double>(bytes) / (p50_us * 1000.0) : 0.0;  // bytes per ns = GB/s
}

}  // namespace

Measurement summarize(const std::string& transport, const Workload& workload, int warmup, int rounds,
                      const std::vector<int64_t>& elapsed_ns, bool round_trips) {
  const size_t bytes = workload.bytes;
  std::vector<double> one_way_us;
  one_way_us.reserve(elapsed_ns.size());
  double sum = 0;
  for (const int64_t ns : elapsed_ns) {
    const double us = static_cast<double>(ns) / 1000.0 / (round_trips ? 2.0 : 1.0);
    one_way_us.push_back(us);
    sum += us;
  }
  std::sort(one_way_us.begin(), one_way_us.end());
  Measurement m = row_of(transport, workload, warmup, rounds);
  m.iters = static_cast<int>(elapsed_ns.size());
  m.p50_us = percentile(one_way_us, 50);
  m.p99_us = percentile(one_way_us, 99);
  m.min_us = one_way_us.front();
  m.mean_us = sum / static_cast<double>(one_way_us.size());
  m.gbps = gbps_of(bytes, m.p50_us);
  return m;
}

Measurement summarize_external(const std::string& transport, const Workload& workload, int warmup, int iters,
                               const std::vector<ExternalRound>& rounds) {
  std::vector<double> p50s;
  double mean = 0;
  for (const auto& r : rounds) {
    p50s.push_back(r.p50_us);
    mean += r.mean_us;
  }
  std::sort(p50s.begin(), p50s.end());
  Measurement m = row_of(transport, workload, warmup, static_cast<int>(rounds.size()));
  m.iters = iters;
  const size_t n = p50s.size();
  m.p50_us = n == 0 ? NAN : n % 2 == 1 ? p50s[n / 2] : (p50s[n / 2 - 1] + p50s[n / 2]) / 2;
  m.p99_us = NAN;
  m.min_us = NAN;
  m.mean_us = n == 0 ? NAN : mean / static_cast<double>(n);  // the rounds have equal shares, give or take one
  m.gbps = gbps_of(m.bytes, m.p50_us);
  return m;
}

std::string json_line(const Measurement& m) {
  return "{\"transport\":\"" + m.transport + "\",\"mode\":\"" + m.mode + "\",\"workload\":\"" + m.workload +
         "\",\"leaves\":" + std::to_string(m.leaves) + ",\"bytes\":" + std::to_string(m.bytes) +
         ",\"iters\":" + std::to_string(m.iters) + ",\"warmup\":" + std::to_string(m.warmup) +
         ",\"rounds\":" + std::to_string(m.rounds) + ",\"p50_us\":" + json_number(m.p50_us) +
         ",\"p99_us\":" + json_number(m.p99_us) + ",\"min_us\":" + json_number(m.min_us) +
         ",\"mean_us\":" + json_number(m.mean_us) + ",\"gbps\":" + json_number(m.gbps) +
         ",\"one_cpu\":" + json_number(m.one_cpu) + "}";
}

void write_json(const std::string& path, const std::vector<Measurement>& results) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw std::runtime_error("cannot open '" + path + "' for writing the JSON results");
  for (const auto& m : results) out << json_line(m) << "\n";
  if (!out.flush()) throw std::runtime_error("cannot write the JSON results to '" + path + "'");
}

}  // namespace tdshm::bench::detail
