// `tdshm bench`: options, the two-rank driver, statistics, the table, JSON Lines, the goals.
// The method is described in pingpong.h; the transports live in pingpong_*.cpp.

#include "pingpong.h"

#include "pingpong_internal.h"
#include "collectives.h"
#include "scenarios.h"

#include <ATen/Parallel.h>

#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace tdshm::bench {

namespace {

using namespace detail;
using Clock = std::chrono::steady_clock;

// Deadline of every setup and every wait of the c10d transports: far above the slowest round
// trip (64 MiB through gloo takes well under a second), short enough that a peer that failed
// on its own is noticed before a CI job times out.
constexpr std::chrono::milliseconds kTransportTimeout{std::chrono::seconds(30)};
// ShmOptions::spin of the spinning mode (the default, what users get); the blocking-only mode
// uses 0.
const std::chrono::microseconds kShmSpin = default_shm_spin();

// The directory of the memmap workloads' files.
constexpr const char* kMemmapDir = "/dev/shm";
// Round trips of a gloo transport at most: max(kGlooMinIters, kGlooBudget / bytes), so that a
// 1 GiB workload over TCP takes seconds, not minutes.
constexpr uint64_t kGlooBudget = uint64_t{4} << 30;
constexpr uint64_t kGlooMinIters = 5;

struct TransportInfo {
  const char* name;
  const char* mode;
  const char* what;
  bool sizes;  // measured in the size sweep (the default mode)
  bool td;     // measured in the TensorDict mode (--td)
};

// Table order, in each mode: the floors, the transport under test, the baseline, the ceiling.
constexpr TransportInfo kTransports[] = {
    {"spin", "spinning", "floor: sequence word on a shared cache line, peer spins; payload copied in and out", true, true},
    {"futex", "blocking", "floor: the same, every wait sleeps in FUTEX_WAIT, every post calls FUTEX_WAKE", true, false},
    {"c10d-spin", "spinning", "floor through c10d: the spin floor's wire behind a c10d::ProcessGroup (send, recv, Work, wait)", true, false},
    {"shm", "spinning", "tdshm::ProcessGroupShm, waiters spin (default ShmOptions::spin, 250 us) then sleep on a futex", true, false},
    {"shm-blocking", "blocking", "tdshm::ProcessGroupShm with spin = 0 (waiters only sleep)", true, false},
    {"td-shm", "spinning", "TensorDict send/recv over tdshm::ProcessGroupShm (\"shm\") as a standalone Group", false, true},
    {"gloo", "tcp-loopback", "c10d::ProcessGroupGloo over TCP on 127.0.0.1", true, false},
    {"td-gloo", "tcp-loopback", "TensorDict send/recv over the same gloo group as a standalone Group", false, true},
    {"memcpy", "single-process", "ceiling: one memcpy between two warm buffers in one process", true, true},
};

bool is_gloo(const std::string& transport) { return transport == "gloo" || transport == "td-gloo"; }

std::vector<std::string> transports_of(bool td) {
  std::vector<std::string> v;
  for (const auto& t : kTransports) {
    if (td ? t.td : t.sizes) v.emplace_back(t.name);
  }
  return v;
}

const TransportInfo& info(const std::string& name) {
  for (const auto& t : kTransports) {
    if (name == t.name) return t;
  }
  throw std::invalid_argument("unknown transport '" + name + "'");
}

// ---- option parsing ----

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = list.find(',', start);
    std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(std::move(item));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ",") + item;
  return out;
}

// "4096", "4K", "4KiB", "64M", "1G": binary multiples.
size_t parse_size(const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr == text.data()) throw std::invalid_argument("bad size '" + text + "'");
  std::string unit(ptr, end);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  unsigned shift = 0;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    shift = 10;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    shift = 20;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    shift = 30;
  } else {
    throw std::invalid_argument("bad size unit in '" + text + "' (use B, K/KiB, M/MiB or G/GiB)");
  }
  if (value == 0 || value > (uint64_t{1} << (40 - shift))) {
    throw std::invalid_argument("size '" + text + "' out of range (1 B to 1 TiB)");
  }
  return static_cast<size_t>(value << shift);
}

int parse_count(const std::string& flag, const std::string& text, int min) {
  int value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || value < min) {
    throw std::invalid_argument(flag + " needs an integer >= " + std::to_string(min) + ", got '" + text + "'");
  }
  return value;
}

// "1,2,4,8": positive integers in [min, max], in the given order, no duplicates.
std::vector<int> parse_int_list(const std::string& flag, const std::string& text, int min, int max) {
  std::vector<int> out;
  for (const auto& item : split(text)) {
    const int v = parse_count(flag, item, min);
    if (v > max) throw std::invalid_argument(flag + " values must be at most " + std::to_string(max) + ", got " + item);
    if (std::find(out.begin(), out.end(), v) != out.end()) throw std::invalid_argument(flag + " lists " + item + " twice");
    out.push_back(v);
  }
  if (out.empty()) throw std::invalid_argument(flag + " needs at least one number");
  return out;
}

std::string size_label(size_t bytes) {
  if (bytes >= (size_t{1} << 30) && bytes % (size_t{1} << 30) == 0) return std::to_string(bytes >> 30) + " GiB";
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (size_t{1} << 10) && bytes % (size_t{1} << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

// ---- statistics ----

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
};

// Nearest-rank percentile of sorted values: the smallest value with at least p% at or below it.
double percentile(const std::vector<double>& sorted, double p) {
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

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
  Measurement m;
  m.transport = transport;
  m.mode = info(transport).mode;
  m.workload = workload.name;
  m.leaves = workload.leaves;
  m.bytes = bytes;
  m.iters = static_cast<int>(elapsed_ns.size());
  m.warmup = warmup;
  m.rounds = rounds;
  m.p50_us = percentile(one_way_us, 50);
  m.p99_us = percentile(one_way_us, 99);
  m.min_us = one_way_us.front();
  m.mean_us = sum / static_cast<double>(one_way_us.size());
  m.gbps = m.p50_us > 0 ? static_cast<double>(bytes) / (m.p50_us * 1000.0) : 0.0;  // bytes per ns = GB/s
  return m;
}

// ---- the two ranks ----

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

bool pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return ::sched_setaffinity(0, sizeof(set), &set) == 0;
}

// The anonymous shared mapping made before fork: control block, then the floors' payloads.
class SharedMapping {
 public:
  explicit SharedMapping(size_t bytes) : bytes_(bytes) {
    data_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (data_ == MAP_FAILED) {
      throw std::system_error(errno, std::generic_category(),
                              "mmap of " + std::to_string(bytes) + " shared bytes for the benchmark");
    }
  }
  ~SharedMapping() { ::munmap(data_, bytes_); }
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  uint8_t* data() const noexcept { return static_cast<uint8_t*>(data_); }

 private:
  void* data_;
  size_t bytes_;
};

struct Session {
  const BenchOptions& options;
  std::vector<std::string> transports;  // in table order
  std::vector<Workload> rows;           // in table order
  Link& link;
  uint8_t* payload0;
  uint8_t* payload1;
  size_t payload_bytes;  // capacity of each payload buffer
  std::string run_id;  // unique per run: names the shm segments and the memmap files
  // Rank 0 only.
  std::vector<Measurement> results;
  std::vector<std::string> failures;
  std::vector<std::string> skipped;  // rows left out on purpose (no room), not failures

  std::string segment(const char* which) const { return run_id + "-" + which; }
  std::string memmap_file(const Workload& w) const { return std::string(kMemmapDir) + "/" + run_id + "-" + w.name; }
};

std::unique_ptr<PingPong> make_transport(const std::string& name, Session& s) {
  if (name == "spin") return make_floor_pingpong(s.link, WaitMode::spin, s.payload0, s.payload1);
  if (name == "futex") return make_floor_pingpong(s.link, WaitMode::futex, s.payload0, s.payload1);
  if (name == "memcpy") return make_memcpy_pingpong();
  if (name == "c10d-spin") {
    return make_c10d_pingpong(make_spin_floor_group(s.link, s.payload0, s.payload1, s.payload_bytes));
  }
  if (name == "gloo") return make_c10d_pingpong(make_gloo_group(s.link, kTransportTimeout));
  if (name == "shm") {
    return make_c10d_pingpong(make_shm_group(s.segment("spin"), s.link.rank(), kShmSpin, kTransportTimeout));
  }
  if (name == "shm-blocking") {
    return make_c10d_pingpong(
        make_shm_group(s.segment("blocking"), s.link.rank(), std::chrono::microseconds(0), kTransportTimeout));
  }
  if (name == "td-shm") {
    return make_td_pingpong(make_shm_group(s.segment("td"), s.link.rank(), kShmSpin, kTransportTimeout), s.link.rank());
  }
  if (name == "td-gloo") return make_td_pingpong(make_gloo_group(s.link, kTransportTimeout), s.link.rank());
  throw std::invalid_argument("unknown transport '" + name + "'");
}

void print_header(const Session& s, const std::string& pinning) {
  std::printf("tdshm bench: two-process ping-pong; %s\n", pinning.c_str());
  std::printf("one-way latency = round trip / 2 (memcpy: one copy in one process); p50/p99 over the recorded\n"
              "round trips after warm-up; GB/s = 10^9 bytes/s = bytes / p50 one-way time\n\n");
  for (const auto& name : s.transports) std::printf("  %-13s %s\n", name.c_str(), info(name).what);
  if (s.options.td) {
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
  std::printf("%-13s %-15s %7d %11.3f %11.3f %10.3f\n", m.transport.c_str(), m.mode.c_str(), m.iters, m.p50_us,
              m.p99_us, m.gbps);
  std::fflush(stdout);
}

// Brings every requested transport up in both ranks. A transport that fails on either rank is
// left out on both, with its error recorded by rank 0.
std::vector<std::pair<std::string, std::unique_ptr<PingPong>>> set_up(Session& s) {
  std::vector<std::pair<std::string, std::unique_ptr<PingPong>>> live;
  const int rank = s.link.rank();
  for (const auto& name : s.transports) {
    if (name == "memcpy") {
      if (rank == 0) live.emplace_back(name, make_memcpy_pingpong());
      continue;
    }
    std::unique_ptr<PingPong> transport;
    std::string error;
    try {
      transport = make_transport(name, s);
    } catch (const std::exception& e) {
      error = e.what();
      s.link.set_error(error);
    }
    if (s.link.sync(transport != nullptr)) {
      live.emplace_back(name, std::move(transport));
      continue;
    }
    if (rank == 0) {
      std::string why = error.empty() ? "" : "rank 0: " + error;
      const std::string peer = s.link.peer_error();
      if (!peer.empty() && peer != error) why += (why.empty() ? "rank 1: " : "; rank 1: ") + peer;
      s.failures.push_back(name + ": not measured: could not be set up (" + why + ")");
      std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
    }
    // Rank 1 keeps its message in place until rank 0 has read it.
    s.link.sync(true);
    s.link.set_error("");
  }
  return live;
}

// One round of one transport at one size: `warmup` round trips, then `iters` timed ones whose
// times are appended to `elapsed_ns` (rank 0; rank 1 only answers).
void run_round(Session& s, PingPong& transport, int warmup, int iters, std::vector<int64_t>& elapsed_ns) {
  if (!transport.single_process()) {
    s.link.sync(true);  // both ranks ready: the first warm-up ping meets a waiting pong
    if (s.link.rank() == 1) {
      for (int i = 0; i < warmup + iters; ++i) transport.pong();
      return;
    }
  }
  for (int i = 0; i < warmup; ++i) transport.ping();
  for (int i = 0; i < iters; ++i) {
    const auto start = Clock::now();
    transport.ping();
    elapsed_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  }
}

using Live = std::vector<std::pair<std::string, std::unique_ptr<PingPong>>>;

// Memory a memmap row needs at `bytes`: its file, plus the buffers of the live floors (spin:
// two page buffers per rank and the two shared payload buffers; memcpy: two page buffers).
uint64_t memory_for_memmap_row(const Live& live, size_t bytes) {
  uint64_t buffers = 1;
  for (const auto& [name, transport] : live) {
    if (name == "spin" || name == "futex") buffers += 6;
    if (name == "memcpy") buffers += 2;
  }
  return buffers * bytes;
}

// A memmap row's file: rank 0 checks for room and creates it, both ranks agree. Returns false
// (on both ranks) if the row is skipped; rank 0 has then recorded why.
bool make_workload_file(Session& s, const Live& live, Workload& w, WorkloadFile& file) {
  w.file = s.memmap_file(w);
  std::string why;
  if (s.link.rank() == 0) {
    why = no_room_for(kMemmapDir, w.bytes, memory_for_memmap_row(live, w.bytes));
    if (why.empty()) {
      try {
        file = WorkloadFile(w.file, w.bytes);
      } catch (const std::exception& e) {
        why = std::string("could not create ") + w.file + ": " + e.what();
      }
    }
  }
  if (s.link.sync(why.empty())) return true;
  if (s.link.rank() == 0) {
    s.skipped.push_back(w.name + ": skipped: " + why);
    std::printf("%-18s skipped: %s\n\n", w.name.c_str(), why.c_str());
    std::fflush(stdout);
  }
  return false;
}

// Measures every live transport on one row (a size, or a TD workload). The iterations are cut
// into rounds and the rounds interleave the transports (round 1 of each, then round 2 of each,
// ...), so that a change in the machine's load during the row's measurement hits every
// transport alike and the ratios between them stay fair; each round starts with its share of
// the warm-up. A gloo transport may get fewer iterations than the others (iterations_for): it
// then sits out the rounds its share leaves empty.
void measure_row(Session& s, Live& live, Workload w) {
  const int rank = s.link.rank();
  WorkloadFile file;  // rank 0, memmap rows: removed when the row is done, whatever happens
  if (w.tree == Workload::Tree::memmap && !make_workload_file(s, live, w, file)) return;
  std::vector<int> iters(live.size()), warmups(live.size());
  int most = 1;
  for (size_t t = 0; t < live.size(); ++t) {
    iters[t] = iterations_for(s.options, w.bytes, live[t].first);
    warmups[t] = warmup_for(s.options, w.bytes, live[t].first);
    most = std::max(most, iters[t]);
  }
  const int rounds = std::min(s.options.rounds, most);
  std::vector<std::vector<int64_t>> elapsed(live.size());
  for (auto& [name, transport] : live) {
    if (rank == 0 || !transport->single_process()) transport->prepare(w);
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t t = 0; t < live.size(); ++t) {
      PingPong& transport = *live[t].second;
      if (transport.single_process() && rank != 0) continue;
      // Rounds split a transport's iterations as evenly as integers allow.
      const int n = iters[t] * (r + 1) / rounds - iters[t] * r / rounds;
      if (n == 0) continue;
      run_round(s, transport, (warmups[t] + rounds - 1) / rounds, n, elapsed[t]);
    }
  }
  if (rank != 0) return;
  for (size_t t = 0; t < live.size(); ++t) {
    const auto& [name, transport] = live[t];
    const std::string where = w.name.empty() ? size_label(w.bytes) : w.name;
    if (!transport->verify()) {
      s.failures.push_back(name + " at " + where + ": the echoed message differs from the one sent");
      std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
    }
    const int warmup_rounds = std::min(rounds, iters[t]);  // the rounds it took part in
    s.results.push_back(summarize(name, w, (warmups[t] + rounds - 1) / rounds * warmup_rounds, rounds, elapsed[t],
                                  !transport->single_process()));
    print_row(s.results.back(), t == 0);
  }
  std::printf("\n");
}

// Both ranks run this; rank 1 only answers. Throws on a failure the run cannot go on from.
void run_rank(Session& s) {
  auto live = set_up(s);
  if (live.empty()) return;
  for (const Workload& w : s.rows) measure_row(s, live, w);
}

// ---- goals and JSON ----

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
  constexpr size_t k64MiB = size_t{64} << 20;
  const Compact goals[] = {
      {8, "shm", "spin", false, true, 2.0},          {8, "shm-blocking", "futex", false, true, 1.3},
      {8, "gloo", "shm", false, false, 100.0},       {k64MiB, "shm", "memcpy", true, false, 0.8},
      {k64MiB, "shm", "gloo", true, false, 3.0},
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
      {"seed", "one-way td-gloo p50 / td-shm p50", {"td-gloo", "seed", 0}, {"td-shm", "seed", 0}, false, false, 100.0},
      {"seed", "td-shm p50 / spin p50 (72 B)", {"td-shm", "seed", 0}, {"spin", "seed", 0}, false, true, 3.0},
      {"64MiB-consolidated", "td-shm GB/s / memcpy GB/s", {"td-shm", "64MiB-consolidated", 0},
       {"memcpy", "64MiB-consolidated", 0}, true, false, 0.8},
      {"memmap-1GiB", "td-shm p50 / memmap-4KiB td-shm p50", {"td-shm", "memmap-1GiB", 0}, {"td-shm", "memmap-4KiB", 0},
       false, true, 2.0},
  };
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

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// One measurement as one JSON object (no newline). Transport, mode and workload names are
// plain ASCII identifiers: no escaping needed.
std::string json_line(const Measurement& m) {
  return "{\"transport\":\"" + m.transport + "\",\"mode\":\"" + m.mode + "\",\"workload\":\"" + m.workload +
         "\",\"leaves\":" + std::to_string(m.leaves) + ",\"bytes\":" + std::to_string(m.bytes) +
         ",\"iters\":" + std::to_string(m.iters) + ",\"warmup\":" + std::to_string(m.warmup) +
         ",\"rounds\":" + std::to_string(m.rounds) + ",\"p50_us\":" + json_number(m.p50_us) +
         ",\"p99_us\":" + json_number(m.p99_us) + ",\"min_us\":" + json_number(m.min_us) +
         ",\"mean_us\":" + json_number(m.mean_us) + ",\"gbps\":" + json_number(m.gbps) + "}";
}

void write_json(const std::string& path, const std::vector<Measurement>& results) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw std::runtime_error("cannot open '" + path + "' for writing the JSON results");
  for (const auto& m : results) out << json_line(m) << "\n";
  if (!out.flush()) throw std::runtime_error("cannot write the JSON results to '" + path + "'");
}

// ---- the child's end ----
//
// Rank 0 reaps rank 1 from a SIGCHLD handler as soon as it exits. An unreaped child is a zombie,
// and a zombie still looks alive to liveness checks that probe the pid (kill(pid, 0) and
// /proc/<pid>/stat keep answering until it is reaped): without the handler, a transport waiting
// on a dead rank 1 would only give up at its timeout.

std::atomic<pid_t> g_child{0};
std::atomic<int> g_child_status{-1};  // wait status once reaped
static_assert(std::atomic<pid_t>::is_always_lock_free && std::atomic<int>::is_always_lock_free,
              "the SIGCHLD handler may only touch lock-free atomics");

extern "C" void reap_child_on_sigchld(int /*signal*/) {
  const int saved_errno = errno;
  const pid_t child = g_child.load(std::memory_order_acquire);
  int status = 0;
  if (child > 0 && ::waitpid(child, &status, WNOHANG) == child) {
    g_child_status.store(status, std::memory_order_release);
  }
  errno = saved_errno;
}

// Installs the handler for the lifetime of the run and puts the previous one back.
class ChildReaper {
 public:
  ChildReaper() {
    struct sigaction action {};
    action.sa_handler = reap_child_on_sigchld;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    g_child_status.store(-1, std::memory_order_relaxed);
    if (::sigaction(SIGCHLD, &action, &previous_) != 0) {
      throw std::system_error(errno, std::generic_category(), "sigaction(SIGCHLD) for the benchmark's peer");
    }
  }
  ~ChildReaper() { restore(); }
  ChildReaper(const ChildReaper&) = delete;
  ChildReaper& operator=(const ChildReaper&) = delete;

  void watch(pid_t child) {
    g_child.store(child, std::memory_order_release);
    reap_child_on_sigchld(SIGCHLD);  // in case it ended before the store
  }
  /// In the forked child: the handler is not its business.
  void restore() noexcept {
    if (!restored_) ::sigaction(SIGCHLD, &previous_, nullptr);
    restored_ = true;
    g_child.store(0, std::memory_order_release);
  }
  /// Waits up to `grace` for the child to end, then kills it. Returns its wait status.
  int reap(pid_t child, std::chrono::milliseconds grace) const {
    auto end = Clock::now() + grace;
    bool killed = false;
    for (;;) {
      int status = 0;
      if (::waitpid(child, &status, WNOHANG) == child) return status;
      // Reaped by the handler (on whichever thread it ran), or about to be stored by it.
      if (const int reaped = g_child_status.load(std::memory_order_acquire); reaped >= 0) return reaped;
      if (Clock::now() > end) {
        if (killed) return -1;
        ::kill(child, SIGKILL);
        killed = true;
        end = Clock::now() + std::chrono::seconds(5);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

 private:
  struct sigaction previous_ {};
  bool restored_ = false;
};

// ---- the run's segments, removed on a stop signal ----
// A stop signal (Ctrl-C, kill) ends rank 0 by its default action and rank 1 with it (its death
// signal), so neither reaches the removal at the end of the run, and the segments stayed in
// /dev/shm. Rank 0's handler unlinks them and their lock files (paths made beforehand: a handler
// may only call async-signal-safe functions), puts back the previous action and re-raises, so the
// process still ends by the signal. The memmap workloads' handler (pingpong_td.cpp) chains here.

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr size_t kMaxCleanupPaths = 8;
char g_cleanup_paths[kMaxCleanupPaths][256];
std::atomic<size_t> g_cleanup_count{0};
struct sigaction g_stop_previous[std::size(kStopSignals)];

extern "C" void remove_segments_on_signal(int sig) {
  const size_t n = g_cleanup_count.load(std::memory_order_acquire);  // pairs with the release in the guard
  for (size_t i = 0; i < n; ++i) ::unlink(g_cleanup_paths[i]);
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    if (kStopSignals[i] == sig) ::sigaction(sig, &g_stop_previous[i], nullptr);
  }
  ::raise(sig);  // blocked while this runs: delivered with the previous action once it returns
}

/// While alive, a stop signal removes the files of `names` (segments as ProcessGroupShm names
/// them: /dev/shm/tdshm.<name> and its .lock) before the process ends by it.
class SegmentsRemovedOnSignal {
 public:
  explicit SegmentsRemovedOnSignal(const std::vector<std::string>& names) {
    size_t n = 0;
    for (const std::string& name : names) {
      for (const char* suffix : {"", ".lock"}) {
        const std::string path = "/dev/shm/tdshm." + name + suffix;
        if (n == kMaxCleanupPaths || path.size() >= sizeof g_cleanup_paths[0]) {
          throw std::logic_error("too many or too long segment names to remove on a signal: " + path);
        }
        std::memcpy(g_cleanup_paths[n++], path.c_str(), path.size() + 1);
      }
    }
    g_cleanup_count.store(n, std::memory_order_release);
    struct sigaction action {};
    action.sa_handler = remove_segments_on_signal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < std::size(kStopSignals); ++i) {
      ::sigaction(kStopSignals[i], nullptr, &g_stop_previous[i]);
      // An ignored signal stays ignored (a shell's background job ignores SIGINT): it stops nothing.
      installed_[i] = g_stop_previous[i].sa_handler != SIG_IGN;
      if (installed_[i]) ::sigaction(kStopSignals[i], &action, nullptr);
    }
  }
  ~SegmentsRemovedOnSignal() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i) {
      if (installed_[i]) ::sigaction(kStopSignals[i], &g_stop_previous[i], nullptr);
    }
    g_cleanup_count.store(0, std::memory_order_release);
  }
  SegmentsRemovedOnSignal(const SegmentsRemovedOnSignal&) = delete;
  SegmentsRemovedOnSignal& operator=(const SegmentsRemovedOnSignal&) = delete;

 private:
  bool installed_[std::size(kStopSignals)] = {};
};

}  // namespace

const std::vector<std::string>& all_transports() {
  static const std::vector<std::string> names = transports_of(false);
  return names;
}

const std::vector<std::string>& all_td_transports() {
  static const std::vector<std::string> names = transports_of(true);
  return names;
}

const std::vector<std::string>& all_workloads() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& w : td_workloads()) v.push_back(w.name);
    return v;
  }();
  return names;
}

int iterations_for(const BenchOptions& options, size_t bytes, const std::string& transport) {
  // A byte budget per row keeps big rows short; a floor keeps p50 meaningful.
  const uint64_t budget = options.quick ? uint64_t{16} << 20 : uint64_t{512} << 20;
  const uint64_t floor = options.quick ? 5 : 20;
  const uint64_t size = std::max<size_t>(bytes, 1);
  uint64_t by_budget = std::max<uint64_t>(floor, budget / size);
  // TCP moves about a GB/s here: 20 round trips of 1 GiB would take a minute.
  if (is_gloo(transport)) by_budget = std::min(by_budget, std::max(kGlooMinIters, kGlooBudget / size));
  return static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(options.iters), by_budget));
}

int warmup_for(const BenchOptions& options, size_t bytes, const std::string& transport) {
  const int iters = iterations_for(options, bytes, transport);
  return std::min(options.warmup, std::max(2, iters / 4));
}

void print_bench_usage(FILE* out) {
  std::fprintf(out,
               "usage: tdshm bench [options]\n"
               "       tdshm bench --td [--workloads LIST] [options]\n"
               "       tdshm bench --scenario loader|actor-learner|all [options]\n"
               "       tdshm bench --collectives [--world-sizes LIST] [--sizes LIST] [options]\n"
               "       tdshm bench --world LIST | --from FILES [--compare OLD] [--plot FILE]\n"
               "Two-process ping-pong: rank 0 sends a message, rank 1 sends it back; one-way latency is half\n"
               "the round trip. Ranks are pinned to the first two allowed CPUs. Prints a table per size (or\n"
               "per TensorDict workload with --td) and the goal ratios. Exit code 0 unless a measurement\n"
               "could not run (missed goals and workloads skipped for want of room are not errors).\n"
               "\n"
               "  --sizes LIST       message sizes, e.g. 8,4K,64KiB,1M (default 8,64,4K,64K,1M,16M,64M)\n"
               "  --td               TensorDict mode: the rows are workloads, the transports td-shm and\n"
               "                     td-gloo (rank 0: td.send(group_dst=1), then td_back.recv(group_src=1);\n"
               "                     rank 1: recv, then send back) next to spin and memcpy at the workload's\n"
               "                     total bytes (one message)\n"
               "  --workloads LIST   TD workloads to measure (implies --td; default: all of them):\n"
               "                       seed                the seed tree {(\"a\",\"b\"): 2 floats, \"c\": 2x3,\n"
               "                                           \"_\": 2x1x5}, batch [2]: 3 leaves, 72 B, per-leaf\n"
               "                       seed-consolidated   the same, send/recv(consolidated=True) between\n"
               "                                           consolidated tensordicts\n"
               "                       100x1KiB            100 leaves of 1 KiB, per-leaf\n"
               "                       10x1MiB             10 leaves of 1 MiB, per-leaf\n"
               "                       64MiB-consolidated  one 64 MiB storage, consolidated\n"
               "                       memmap-4KiB         one named MemoryMappedTensor leaf, per-leaf; both\n"
               "                       memmap-1GiB         ranks map the same file in /dev/shm (removed at\n"
               "                                           the end): by reference over shm, by value over\n"
               "                                           gloo; skipped with a message when /dev/shm or\n"
               "                                           memory has no room (1 GiB needs ~8 GiB of memory\n"
               "                                           with the floors)\n"
               "  --iters N          recorded round trips per row at most (default 10000; big rows get\n"
               "                     fewer: a byte budget of 512 MiB per row, at least 20; gloo and td-gloo\n"
               "                     at most max(5, 4 GiB / bytes): 5 at 1 GiB)\n"
               "  --warmup N         warm-up round trips per row at most (default 1000; at most iters/4)\n"
               "  --rounds N         split each row's iterations into N rounds that interleave the\n"
               "                     transports, each with its share of the warm-up (default 5), so that\n"
               "                     load changing during a row hits all transports alike\n"
               "  --transports LIST  any of spin,futex,c10d-spin,shm,shm-blocking,gloo,memcpy (default: all); with\n"
               "                     --td any of spin,td-shm,td-gloo,memcpy (default: all four)\n"
               "  --json FILE        write one JSON object per measurement per line (JSON Lines) with the\n"
               "                     fields transport, mode, workload (\"\" in the size sweep), leaves (1 in\n"
               "                     the size sweep), bytes, iters, warmup, rounds, p50_us, p99_us, min_us,\n"
               "                     mean_us, gbps (GB/s, 10^9 bytes/s, from p50)\n"
               "  --quick            short run for smoke tests (iters 200, warmup 20, rounds 2, 16 MiB per\n"
               "                     row)\n"
               "  --no-pin           do not pin the ranks to CPUs\n"
               "  -h, --help         this text\n"
               "\n"
               "workload scenarios (real forked processes, the public TensorDict API over ProcessGroupShm\n"
               "and gloo on 127.0.0.1 in the same run; with any of --scenario, --world, --from the size\n"
               "sweep does not run):\n"
               "  --scenario LIST    loader, actor-learner or all:\n"
               "                       loader         N workers -> 1 main; each worker sends --batches\n"
               "                                      batches {image uint8 [32,3,64,64], label int64 [32],\n"
               "                                      meta {idx, worker} int64 [32]}, batch [32]; main\n"
               "                                      receives them in three patterns: blocking (per-leaf\n"
               "                                      recv round-robin over workers), irecv-ahead (irecv\n"
               "                                      from every worker, then wait), consolidated (workers\n"
               "                                      consolidate() each batch, main receives into a\n"
               "                                      consolidated tensordict); main checks every batch\n"
               "                       actor-learner  1 learner, --actors actors; per step the learner\n"
               "                                      sends 4 MiB of weights (consolidated, 4 float leaves\n"
               "                                      of 1 MiB) to every actor, each actor replies with a\n"
               "                                      trajectory {obs float [64,16], action int64 [64],\n"
               "                                      reward float [64]} (per-leaf)\n"
               "  --workers LIST     loader: worker counts, one process layout each (default 1,2,4,8)\n"
               "  --actors N         actor-learner: actors (default 2)\n"
               "  --batches N        loader: batches per worker per measurement (default 300; quick 30)\n"
               "  --steps N          actor-learner: steps per measurement (default 200; quick 20)\n"
               "  --repeat R         measurements of each row; the table shows the median and min-max\n"
               "                     (default 3; quick 1)\n"
               "  --progress         progress line on stderr (default: only when stderr is a terminal)\n"
               "  --world LIST       print the shm segment size of each world size with default\n"
               "                     ShmOptions (tdshm::shm_segment_bytes), e.g. 2,5,9,17,65\n"
               "\n"
               "collectives (not part of --scenario all):\n"
               "  --collectives      all_reduce (SUM, float32), all_gather, broadcast (from rank 0) and scatter\n"
               "                     (from rank 0) over shm against gloo in the same forked processes (each\n"
               "                     rank holds both groups), per world size and message size, next to a\n"
               "                     memcpy row per size (one copy, single thread); then the goal ratios\n"
               "                     (all_reduce 1 MiB and 8 B over 4 ranks: gloo/shm >= 5 and >= 20; broadcast\n"
               "                     64 MiB to 4 ranks: shm GB/s / memcpy GB/s >= 0.8). Bytes: each rank's\n"
               "                     float32 tensor (scatter: what each rank receives). Timing: rank 0 times\n"
               "                     rounds of ops from the end of a barrier to the end of a closing barrier\n"
               "                     (the slowest rank's time plus one barrier) / ops; each (op, size,\n"
               "                     transport) is checked once, warmed up and calibrated (ops doubling to\n"
               "                     10 ms) to rounds of ~100 ms (1 to 100000 ops); --repeat rounds each\n"
               "                     (default 3), median and min-max of the per-op time; GB/s = bytes / median\n"
               "                     time; shm/gloo = gloo time / shm time. Worlds above the CPU count are\n"
               "                     oversubscribed (said above the tables). TensorDict rows:\n"
               "                     td.all_reduce and td.all_gather (TensorDict::all_reduce / all_gather)\n"
               "                     of the seed tree (72 B, workload seed) and of 10 x 1 MiB float leaves\n"
               "                     (workload 10x1MiB), bytes = the leaves' bytes per rank\n"
               "  --world-sizes LIST world sizes, one process layout each (default 2,4,8)\n"
               "  --sizes LIST       with --collectives: tensor sizes (default 8,1K,64K,1M,16M,64M)\n"
               "\n"
               "reports (on this run's rows: the sweep's or the scenarios', plus those of --from):\n"
               "  --json FILE        scenario rows too: scenario, pattern, transport, workers (loader) or\n"
               "                     actors (actor-learner), batches or steps (per measurement), repeats,\n"
               "                     batches_per_s or steps_per_s (median) with _min and _max, gbps,\n"
               "                     seconds (median); --world rows: scenario \"segment\", world,\n"
               "                     segment_bytes; --collectives rows: scenario \"collectives\", pattern\n"
               "                     (the op, td.all_reduce, td.all_gather or memcpy), transport (shm, gloo,\n"
               "                     memcpy), workers (the world; 1 for memcpy), bytes, iters (ops per\n"
               "                     round), repeats, p50_us, min_us, max_us (per-op time over the\n"
               "                     rounds), gbps, speedup (shm rows: gloo p50 / shm p50), workload (TD)\n"
               "  --from LIST        read rows from these JSON Lines files (--plot-from is the same);\n"
               "                     without --scenario nothing is measured\n"
               "  --plot FILE        draw with gnuplot into FILE (.png or .svg): p50 latency and GB/s\n"
               "                     against size of every transport (size-sweep rows), and the\n"
               "                     scenarios' throughput, shm next to gloo, min-max as error bars, and\n"
               "                     per world size the collectives' GB/s against size (memcpy dashed)\n"
               "  --compare OLD      compare this run's rows with OLD's (JSON Lines; matched on scenario,\n"
               "                     pattern, transport, workers/actors (and size for --collectives, whose\n"
               "                     metric is p50_us), or transport and size/workload):\n"
               "                     prints old, new and %% change; exit 3 when a throughput dropped or a\n"
               "                     p50 latency rose by more than --threshold; rows on one side only are\n"
               "                     listed, not failures\n"
               "  --threshold PCT    --compare's limit in percent (default 25)\n"
               "\n"
               "exit codes: 0 ok; 1 a measurement, check or plot failed; 2 bad arguments; 3 --compare found\n"
               "a regression\n"
               "\n"
               "transports:\n");
  for (const auto& t : kTransports) {
    std::fprintf(out, "  %-13s %-15s %s%s\n", t.name, t.mode, t.what, t.sizes ? "" : " (--td)");
  }
}

BenchOptions parse_bench_options(int argc, char** argv, bool& help) {
  BenchOptions o;
  help = false;
  std::optional<int> iters, warmup, rounds, batches, steps, repeat;
  bool sizes_given = false;
  // Options of the size sweep, which does not run with a scenario, --world or --from.
  std::vector<std::string> sweep_flags;
  bool workers_given = false, actors_given = false, threshold_given = false, world_sizes_given = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = arg.substr(eq + 1);
      arg.resize(eq);
    }
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      help = true;
    } else if (arg == "--sizes") {
      sweep_flags.push_back(arg);
      o.sizes.clear();
      for (const auto& item : split(value())) o.sizes.push_back(parse_size(item));
      if (o.sizes.empty()) throw std::invalid_argument("--sizes needs at least one size");
      sizes_given = true;
    } else if (arg == "--td") {
      sweep_flags.push_back(arg);
      o.td = true;
    } else if (arg == "--workloads") {
      sweep_flags.push_back(arg);
      const auto wanted = split(value());
      if (wanted.empty()) throw std::invalid_argument("--workloads needs at least one workload");
      for (const auto& name : wanted) {
        if (std::find(all_workloads().begin(), all_workloads().end(), name) == all_workloads().end()) {
          throw std::invalid_argument("unknown workload '" + name + "'");
        }
      }
      o.workloads = wanted;
      o.td = true;
    } else if (arg == "--iters") {
      sweep_flags.push_back(arg);
      iters = parse_count(arg, value(), 1);
    } else if (arg == "--warmup") {
      sweep_flags.push_back(arg);
      warmup = parse_count(arg, value(), 0);
    } else if (arg == "--rounds") {
      sweep_flags.push_back(arg);
      rounds = parse_count(arg, value(), 1);
    } else if (arg == "--transports") {
      sweep_flags.push_back(arg);
      const auto wanted = split(value());
      if (wanted.empty()) throw std::invalid_argument("--transports needs at least one transport");
      o.transports = wanted;
    } else if (arg == "--json") {
      o.json_path = value();
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--no-pin") {
      sweep_flags.push_back(arg);
      o.pin = false;
    } else if (arg == "--scenario") {
      const auto wanted = split(value());
      if (wanted.empty()) throw std::invalid_argument("--scenario needs at least one scenario");
      for (const auto& name : wanted) {
        const auto& known = all_scenarios();
        if (name == "all") {
          for (const auto& k : known) {
            if (std::find(o.scenarios.begin(), o.scenarios.end(), k) == o.scenarios.end()) o.scenarios.push_back(k);
          }
        } else if (std::find(known.begin(), known.end(), name) == known.end()) {
          throw std::invalid_argument("unknown scenario '" + name + "' (use " + join(known) + " or all)");
        } else if (std::find(o.scenarios.begin(), o.scenarios.end(), name) == o.scenarios.end()) {
          o.scenarios.push_back(name);
        }
      }
    } else if (arg == "--collectives") {
      if (std::find(o.scenarios.begin(), o.scenarios.end(), "collectives") == o.scenarios.end()) {
        o.scenarios.push_back("collectives");
      }
    } else if (arg == "--world-sizes") {
      o.world_sizes = parse_int_list(arg, value(), 1, 64);
      world_sizes_given = true;
    } else if (arg == "--workers") {
      o.workers = parse_int_list(arg, value(), 1, 64);
      workers_given = true;
    } else if (arg == "--actors") {
      o.actors = parse_count(arg, value(), 1);
      if (o.actors > 64) throw std::invalid_argument("--actors must be at most 64");
      actors_given = true;
    } else if (arg == "--batches") {
      batches = parse_count(arg, value(), 1);
    } else if (arg == "--steps") {
      steps = parse_count(arg, value(), 1);
    } else if (arg == "--repeat") {
      repeat = parse_count(arg, value(), 1);
    } else if (arg == "--progress") {
      o.progress = true;
    } else if (arg == "--world") {
      o.worlds = parse_int_list(arg, value(), 1, 4096);
    } else if (arg == "--plot") {
      o.plot_path = value();
      const auto dot = o.plot_path.rfind('.');
      std::string ext = dot == std::string::npos ? "" : o.plot_path.substr(dot);
      std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (ext != ".png" && ext != ".svg") {
        throw std::invalid_argument("--plot needs a file name ending in .png or .svg, got '" + o.plot_path + "'");
      }
    } else if (arg == "--from" || arg == "--plot-from") {
      const auto files = split(value());
      if (files.empty()) throw std::invalid_argument(arg + " needs at least one file");
      o.from_paths.insert(o.from_paths.end(), files.begin(), files.end());
    } else if (arg == "--compare") {
      o.compare_path = value();
      if (o.compare_path.empty()) throw std::invalid_argument("--compare needs a file");
    } else if (arg == "--threshold") {
      const std::string text = value();
      char* end = nullptr;
      const double pct = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size() || !(pct > 0) || pct >= 1000) {
        throw std::invalid_argument("--threshold needs a percentage above 0 and below 1000, got '" + text + "'");
      }
      o.threshold = pct;
      threshold_given = true;
    } else {
      throw std::invalid_argument("unknown option '" + arg + "'");
    }
  }
  if (o.td && sizes_given) throw std::invalid_argument("--sizes is for the size sweep; --td measures workloads");
  const auto& known = o.td ? all_td_transports() : all_transports();
  for (const auto& name : o.transports) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      throw std::invalid_argument("unknown transport '" + name + "'" + (o.td ? " with --td" : "") + " (use one of " +
                                  join(known) + ")");
    }
  }
  const bool scenario = !o.scenarios.empty();
  const auto wants = [&](const char* name) {
    return std::find(o.scenarios.begin(), o.scenarios.end(), name) != o.scenarios.end();
  };
  // --sizes also chooses the sizes of --collectives.
  if (wants("collectives")) {
    sweep_flags.erase(std::remove(sweep_flags.begin(), sweep_flags.end(), std::string("--sizes")), sweep_flags.end());
    if (!sizes_given) o.sizes = default_collective_sizes();
  }
  if (world_sizes_given && !wants("collectives")) throw std::invalid_argument("--world-sizes is an option of --collectives");
  if (!o.sweep() && !sweep_flags.empty()) {
    throw std::invalid_argument(sweep_flags.front() +
                                " is an option of the size sweep, which does not run with --scenario, "
                                "--collectives, --world or --from");
  }
  if ((workers_given || batches) && !wants("loader")) {
    throw std::invalid_argument(std::string(workers_given ? "--workers" : "--batches") +
                                " is an option of --scenario loader");
  }
  if ((actors_given || steps) && !wants("actor-learner")) {
    throw std::invalid_argument(std::string(actors_given ? "--actors" : "--steps") +
                                " is an option of --scenario actor-learner");
  }
  if ((repeat || o.progress) && !scenario) {
    throw std::invalid_argument(std::string(repeat ? "--repeat" : "--progress") +
                                " is an option of --scenario and --collectives");
  }
  if (threshold_given && o.compare_path.empty()) throw std::invalid_argument("--threshold is an option of --compare");
  o.batches = batches.value_or(o.quick ? 30 : o.batches);
  o.steps = steps.value_or(o.quick ? 20 : o.steps);
  o.repeat = repeat.value_or(o.quick ? 1 : o.repeat);
  o.iters = iters.value_or(o.quick ? 200 : o.iters);
  o.warmup = warmup.value_or(o.quick ? 20 : o.warmup);
  o.rounds = rounds.value_or(o.quick ? 2 : o.rounds);
  return o;
}

int run_pingpong_bench(const BenchOptions& options, std::vector<std::string>* json_lines) {
  std::vector<std::string> transports;
  for (const auto& name : options.td ? all_td_transports() : all_transports()) {
    if (options.transports.empty() ||
        std::find(options.transports.begin(), options.transports.end(), name) != options.transports.end()) {
      transports.push_back(name);
    }
  }
  std::vector<Workload> rows;
  if (options.td) {
    for (const auto& w : td_workloads()) {
      if (options.workloads.empty() ||
          std::find(options.workloads.begin(), options.workloads.end(), w.name) != options.workloads.end()) {
        rows.push_back(w);
      }
    }
  } else {
    for (const size_t bytes : options.sizes) rows.push_back(message_workload(bytes));
  }
  if (rows.empty()) throw std::invalid_argument(options.td ? "no workloads given" : "no message sizes given");

  // Control block, then the two payload buffers of the floors, page aligned.
  constexpr size_t kPage = 4096;
  const size_t max_bytes =
      std::max_element(rows.begin(), rows.end(), [](const Workload& a, const Workload& b) { return a.bytes < b.bytes; })
          ->bytes;
  const size_t control_bytes = (sizeof(ControlBlock) + kPage - 1) / kPage * kPage;
  const size_t payload_bytes = (max_bytes + kPage - 1) / kPage * kPage;
  SharedMapping mapping(control_bytes + 2 * payload_bytes);
  auto* block = new (mapping.data()) ControlBlock{};

  const std::vector<int> cpus = allowed_cpus();
  const bool pin = options.pin && cpus.size() >= 2;
  const std::string run_id = "tdshm-bench-" + std::to_string(::getpid());

  ChildReaper reaper;
  // Fork now, before LibTorch has started any thread in this process.
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) throw std::system_error(errno, std::generic_category(), "fork of the benchmark's peer");
  const int rank = child == 0 ? 1 : 0;
  if (rank == 1) {
    // Rank 1 dies with rank 0, whatever happens to rank 0.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    reaper.restore();
  } else {
    reaper.watch(child);
  }
  Link link(block, rank, rank == 0 ? child : parent, pin, rank == 0 ? &g_child_status : nullptr);
  Session s{options,
            transports,
            rows,
            link,
            mapping.data() + control_bytes,
            mapping.data() + control_bytes + payload_bytes,
            payload_bytes,
            run_id,
            {},
            {},
            {}};

  at::set_num_threads(1);
  std::string pinning = "ranks not pinned";
  if (pin) {
    const bool ok = pin_to(cpus[static_cast<size_t>(rank)]);
    pinning = "rank 0 on CPU " + std::to_string(cpus[0]) + ", rank 1 on CPU " + std::to_string(cpus[1]);
    if (!ok) pinning = "pinning failed: ranks not pinned";
  } else if (options.pin) {
    pinning = "ranks not pinned (fewer than 2 CPUs allowed)";
  }

  if (rank == 1) {
    int rc = 0;
    try {
      run_rank(s);
    } catch (const std::exception& e) {
      link.abort(e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    // No atexit handlers or static destructors in the forked copy; the transports are gone.
    ::_exit(rc);
  }

  const SegmentsRemovedOnSignal on_signal({s.segment("spin"), s.segment("blocking"), s.segment("td")});
  print_header(s, pinning);
  bool aborted = false;
  try {
    run_rank(s);
  } catch (const std::exception& e) {
    link.abort(e.what());
    s.failures.push_back(std::string("run stopped: ") + e.what());
    std::fprintf(stderr, "tdshm bench: %s\n", s.failures.back().c_str());
    aborted = true;
  }
  const int status =
      reaper.reap(child, aborted ? std::chrono::milliseconds(200) : std::chrono::milliseconds(kTransportTimeout));
  if (!aborted && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    s.failures.push_back("rank 1 ended badly (wait status " + std::to_string(status) + ")" +
                         (link.peer_error().empty() ? "" : ": " + link.peer_error()));
  }
  for (const char* which : {"spin", "blocking", "td"}) remove_shm_segment(s.segment(which));

  print_goals(s.results, options.td);
  if (json_lines != nullptr) {
    for (const auto& m : s.results) json_lines->push_back(json_line(m));
  }
  if (!options.json_path.empty()) {
    write_json(options.json_path, s.results);
    std::printf("\nwrote %zu measurements to %s (JSON Lines)\n", s.results.size(), options.json_path.c_str());
  }
  if (!s.skipped.empty()) {
    std::printf("\n%zu workload(s) skipped:\n", s.skipped.size());
    for (const auto& why : s.skipped) std::printf("  %s\n", why.c_str());
  }
  if (!s.failures.empty()) {
    std::printf("\n%zu problem(s):\n", s.failures.size());
    for (const auto& f : s.failures) std::printf("  %s\n", f.c_str());
  }
  return s.failures.empty() ? 0 : 1;
}

}  // namespace tdshm::bench
