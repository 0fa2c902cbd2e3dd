// What rank 0 of the ping-pong benchmark prints (pingpong_table.h): the header, the table rows
// and the goal ratios.

#include "pingpong_table.h"

#include "pingpong_transport.h"

#include <cmath>
#include <cstdio>

namespace tdshm::bench::detail {

namespace {

// One side of a goal's ratio: a transport on a row (a size, or a TD workload by name).
struct Side {
  std::string transport;
  std::string workload;  // "" for a size row
  size_t bytes = 0;      // size rows only
};

const Measurement* find(const std::vector<Measurement>& results, const Side& side) {
  for (const auto& m : results) {
    if (m.transport == side.transport && m.workload == side.workload && (!side.workload.empty() || m.bytes == side.bytes)) {
      return &m;
    }
  }
  return nullptr;
}

// A spin floor under this one-way p50 (at 128 B or less) marks a minute in which cache lines move
// fast between the CPUs (measured: 0.05-0.08 us then, 0.2-0.3 us in slow minutes).
constexpr double kFastMinuteUs = 0.15;

struct Goal {
  std::string label;  // first column: the size or the workload
  std::string what;
  Side a, b;
  bool bandwidth;  // ratio of GB/s (a / b); otherwise ratio of p50 latencies (a / b)
  bool at_most;    // goal: ratio <= limit; otherwise ratio >= limit
  double limit;
};

std::vector<Goal> size_goals() {
  struct Compact {
    size_t bytes;
    const char* a;
    const char* b;
    bool bandwidth, at_most;
    double limit;
  };
  constexpr size_t k4KiB = size_t{4} << 10, k1MiB = size_t{1} << 20, k64MiB = size_t{64} << 20;
  const Compact goals[] = {
      {8, "shm", "spin", false, true, 2.0},           {8, "shm-blocking", "futex", false, true, 1.3},
      {8, "gloo", "shm", false, false, 100.0},        {k64MiB, "shm", "memcpy", true, false, 0.8},
      {k64MiB, "shm", "gloo", true, false, 3.0},      {8, "shm", "ucx-posix", false, true, 1.3},
      {k4KiB, "shm", "ucx-posix", false, true, 1.0},  {k1MiB, "shm", "ucx-posix", true, false, 1.0},
      {k64MiB, "shm", "ucx-posix", true, false, 1.0},
  };
  std::vector<Goal> out;
  for (const auto& g : goals) {
    const char* unit = g.bandwidth ? " GB/s" : " p50";
    out.push_back({size_label(g.bytes), std::string(g.a) + unit + " / " + g.b + unit, {g.a, "", g.bytes},
                   {g.b, "", g.bytes}, g.bandwidth, g.at_most, g.limit});
  }
  return out;
}

std::vector<Goal> td_goals() {
  return {
      {"seed", "one-way td-gloo p50 / td-shm p50", {"td-gloo", "seed", 0}, {"td-shm", "seed", 0}, false, false, 150.0},
      {"100x1KiB", "td-shm p50 / ring p50 (100 messages)", {"td-shm", "100x1KiB", 0}, {"ring", "100x1KiB", 0}, false,
       true, 2.0},
      {"seed", "td-shm p50 / spin p50 (72 B)", {"td-shm", "seed", 0}, {"spin", "seed", 0}, false, true, 3.0},
      {"64MiB-consolidated", "td-shm GB/s / memcpy GB/s", {"td-shm", "64MiB-consolidated", 0},
       {"memcpy", "64MiB-consolidated", 0}, true, false, 0.8},
      {"memmap-1GiB", "td-shm p50 / memmap-4KiB td-shm p50", {"td-shm", "memmap-1GiB", 0}, {"td-shm", "memmap-4KiB", 0},
       false, true, 2.0},
  };
}

// The state of the minute, from the spin floor's smallest row: this machine moves cache lines
// between its CPUs cheaply in some minutes and ~3x dearer in others, and only figures of one
// state compare.
void minute_note(const std::vector<Measurement>& results) {
  const Measurement* spin = nullptr;
  for (const auto& m : results) {
    if (m.transport == "spin" && (spin == nullptr || m.bytes < spin->bytes)) spin = &m;
  }
  if (spin == nullptr || spin->bytes > 128) return;
  std::printf("  minute: spin floor p50 at %s %.3f us: %s\n", size_label(spin->bytes).c_str(), spin->p50_us,
              spin->p50_us < kFastMinuteUs ? "cache lines move fast" : "cache lines move slowly (compare with care)");
}

}  // namespace

std::string size_label(size_t bytes) {
  if (bytes >= (size_t{1} << 30) && bytes % (size_t{1} << 30) == 0) return std::to_string(bytes >> 30) + " GiB";
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (size_t{1} << 10) && bytes % (size_t{1} << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

void print_header(const std::vector<std::string>& transports, bool td, const std::string& pinning) {
  std::printf("tdshm bench: two-process ping-pong; %s\n", pinning.c_str());
  std::printf(
      "one-way latency = round trip / 2 (memcpy: one copy in one process); p50/p99 over the recorded\n"
      "round trips after warm-up; GB/s = 10^9 bytes/s = bytes / p50 one-way time\n");
  if (pinning.rfind("ranks not pinned", 0) == 0) {
    std::printf(
        "one CPU = share of samples (every 16th round trip) that found both ranks on one CPU: there\n"
        "a message waits for the scheduler, whatever the transport\n");
  }
  std::printf("\n");
  for (const auto& name : transports) std::printf("  %-13s %s\n", name.c_str(), transport_info(name).what);
  if (td) {
    std::printf("\nrows are TensorDict workloads: td-* move the tensordict (per-leaf: one message per leaf;\n"
                "consolidated: one storage), the floor and the ceiling move `bytes` as one message\n");
    std::printf("\n%-18s %6s %9s  %-13s %-15s %7s %11s %11s %10s\n", "workload", "leaves", "bytes", "transport", "mode",
                "iters", "p50 us", "p99 us", "GB/s");
  } else {
    std::printf("\n%9s  %-13s %-15s %7s %11s %11s %10s\n", "size", "transport", "mode", "iters", "p50 us", "p99 us",
                "GB/s");
  }
  std::fflush(stdout);
}

void print_row(const Measurement& m, bool first_of_row) {
  if (m.workload.empty()) {
    std::printf("%9s  ", first_of_row ? size_label(m.bytes).c_str() : "");
  } else if (first_of_row) {
    std::printf("%-18s %6d %9s  ", m.workload.c_str(), m.leaves, size_label(m.bytes).c_str());
  } else {
    std::printf("%-18s %6s %9s  ", "", "", "");
  }
  char p99[32] = "n/a";  // a transport measured by another program reports no p99
  if (std::isfinite(m.p99_us)) std::snprintf(p99, sizeof p99, "%.3f", m.p99_us);
  std::printf("%-13s %-15s %7d %11.3f %11s %10.3f", m.transport.c_str(), m.mode.c_str(), m.iters, m.p50_us, p99,
              m.gbps);
  // Unpinned: how often the ranks shared a CPU (then every message waits for the scheduler).
  if (std::isfinite(m.one_cpu)) std::printf("  one CPU %3.0f%%", 100.0 * m.one_cpu);
  std::printf("\n");
  std::fflush(stdout);
}

void print_goals(const std::vector<Measurement>& results, bool td) {
  // Column widths: the size mode's table is as it always was.
  const int label_width = td ? 18 : 7, what_width = td ? 36 : 32;
  std::printf("goals (ratios from this run):\n");
  for (const auto& g : td ? td_goals() : size_goals()) {
    char limit[32];
    std::snprintf(limit, sizeof(limit), "%s %g", g.at_most ? "<=" : ">=", g.limit);
    const Measurement* a = find(results, g.a);
    const Measurement* b = find(results, g.b);
    if (a == nullptr || b == nullptr) {
      std::printf("  %-*s %-*s %9s  %-7s n/a (not measured)\n", label_width, g.label.c_str(), what_width, g.what.c_str(),
                  "", limit);
      continue;
    }
    const double ratio = g.bandwidth ? a->gbps / b->gbps : a->p50_us / b->p50_us;
    const bool pass = g.at_most ? ratio <= g.limit : ratio >= g.limit;
    std::printf("  %-*s %-*s %9.3f  %-7s %s\n", label_width, g.label.c_str(), what_width, g.what.c_str(), ratio, limit,
                pass ? "PASS" : "MISS");
  }
  minute_note(results);
  if (td) return;
  // Where the 8 B gap goes: c10d's API by itself, and what tdshm adds to it.
  const Measurement* spin = find(results, {"spin", "", 8});
  const Measurement* c10d = find(results, {"c10d-spin", "", 8});
  const Measurement* shm = find(results, {"shm", "", 8});
  if (spin != nullptr && c10d != nullptr) {
    std::printf("  %-*s %-*s %9.3f  (the floor through c10d's API)\n", label_width, "8 B", what_width,
                "c10d-spin p50 / spin p50", c10d->p50_us / spin->p50_us);
  }
  if (shm != nullptr && c10d != nullptr) {
    std::printf("  %-*s %-*s %9.3f  (tdshm's own share)\n", label_width, "8 B", what_width, "shm p50 / c10d-spin p50",
                shm->p50_us / c10d->p50_us);
  }
}

}  // namespace tdshm::bench::detail
