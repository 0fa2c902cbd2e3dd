// `tdshm bench --collectives` (collectives.h): the ranks' schedule of each world, the memcpy
// reference, the tables and the goal ratios.

#include "collectives.h"

#include "bench_ranks.h"
#include "bench_report.h"

#include <tdshm/distributed.h>
#include <tdshm/process_group.h>
#include <tdshm/tensordict.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace tdshm::bench {

namespace {

using Clock = std::chrono::steady_clock;

const char* const kOps[] = {"all_reduce", "all_gather", "broadcast", "scatter"};
const char* const kCollectiveTransports[] = {"shm", "gloo"};

// Calibration: ops double until a batch between two barriers takes this long (the warm-up).
constexpr double kCalibrateSeconds = 0.010;
// Time budget of one round (one measurement of one transport).
constexpr double kRoundSeconds = 0.100;
constexpr int64_t kMaxOpsPerRound = 100000;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

int64_t floats_of(size_t bytes) { return std::max<int64_t>(1, static_cast<int64_t>(bytes / sizeof(float))); }

// ---- one op on one group ----

// Sets every element of a float tensor.
void fill(const at::Tensor& t, float v) {
  float* p = t.data_ptr<float>();
  std::fill(p, p + t.numel(), v);
}

// Throws unless every element of `t` is `v`.
void check(const at::Tensor& t, float v, int rank, const std::string& where) {
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (p[i] != v) {
      throw std::runtime_error(where + ": rank " + std::to_string(rank) + " has " + std::to_string(p[i]) +
                               " at element " + std::to_string(i) + ", expected " + std::to_string(v));
    }
  }
}

// The tensors of one (op, size) on one rank, made once and used by both transports.
class OpBuffers {
 public:
  OpBuffers(const std::string& op, int64_t n, int rank, int world) : op_(op), rank_(rank), world_(world) {
    if (op == "all_reduce" || op == "broadcast") {
      tensor_ = {at::zeros({n})};
    } else if (op == "all_gather") {
      tensor_ = {at::zeros({n})};
      lists_.emplace_back();
      for (int r = 0; r < world; ++r) lists_[0].push_back(at::zeros({n}));
    } else {  // scatter from rank 0
      tensor_ = {at::zeros({n})};
      if (rank == 0) {
        lists_.emplace_back();
        for (int r = 0; r < world; ++r) lists_[0].push_back(at::zeros({n}));
      }
    }
  }

  void run(c10d::ProcessGroup& pg) {
    if (op_ == "all_reduce") {
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      pg.allreduce(tensor_, o)->wait();
    } else if (op_ == "all_gather") {
      pg.allgather(lists_, tensor_)->wait();
    } else if (op_ == "broadcast") {
      c10d::BroadcastOptions o;
      o.rootRank = 0;
      pg.broadcast(tensor_, o)->wait();
    } else {
      c10d::ScatterOptions o;
      o.rootRank = 0;
      pg.scatter(tensor_, lists_, o)->wait();
    }
  }

  // One op with values that differ per rank, its result checked; leaves zeros behind.
  void run_checked(c10d::ProcessGroup& pg, const std::string& where) {
    const float mine = static_cast<float>(rank_ + 1);
    float expected = 0;
    if (op_ == "all_reduce") {
      fill(tensor_[0], mine);
      expected = static_cast<float>(world_ * (world_ + 1) / 2);
    } else if (op_ == "all_gather") {
      fill(tensor_[0], mine);
      for (auto& t : lists_[0]) fill(t, -1.0f);
    } else if (op_ == "broadcast") {
      fill(tensor_[0], rank_ == 0 ? 7.0f : -1.0f);
      expected = 7.0f;
    } else {
      fill(tensor_[0], -1.0f);
      if (rank_ == 0) {
        for (int r = 0; r < world_; ++r) fill(lists_[0][static_cast<size_t>(r)], static_cast<float>(r + 1));
      }
      expected = mine;
    }
    run(pg);
    if (op_ == "all_gather") {
      for (int r = 0; r < world_; ++r) check(lists_[0][static_cast<size_t>(r)], static_cast<float>(r + 1), rank_, where);
      for (auto& t : lists_[0]) fill(t, 0.0f);
    } else {
      check(tensor_[0], expected, rank_, where);
    }
    fill(tensor_[0], 0.0f);
    for (auto& list : lists_) {
      for (auto& t : list) fill(t, 0.0f);
    }
  }

 private:
  std::string op_;
  int rank_, world_;
  std::vector<at::Tensor> tensor_;
  std::vector<std::vector<at::Tensor>> lists_;
};

// ---- TensorDict::all_reduce / all_gather / gather_and_stack ----

// The TD workloads: the seed tree {("a","b"): zeros(2), "c": zeros(2,3), "_": zeros(2,1,5)},
// batch [2] (72 B), and ten float leaves of 1 MiB.
const char* const kTdOps[] = {"td.all_reduce", "td.all_gather", "td.gather_and_stack"};
const char* const kTdWorkloads[] = {"seed", "10x1MiB"};
constexpr int64_t kMiBFloats = (int64_t{1} << 20) / static_cast<int64_t>(sizeof(float));

TensorDict make_td(const std::string& workload) {
  if (workload == "seed") {
    return TensorDict({{{"a", "b"}, at::zeros({2})}, {"c", at::zeros({2, 3})}, {"_", at::zeros({2, 1, 5})}}, {2});
  }
  TensorDict td;
  for (int i = 0; i < 10; ++i) td.set("x" + std::to_string(i), at::zeros({kMiBFloats}));
  return td;
}

std::vector<at::Tensor> leaves_of(const TensorDict& td, const std::string& workload) {
  if (workload == "seed") return {td.get({"a", "b"}), td.get("c"), td.get("_")};
  std::vector<at::Tensor> out;
  for (int i = 0; i < 10; ++i) out.push_back(td.get("x" + std::to_string(i)));
  return out;
}

size_t td_bytes(const std::string& workload) {
  size_t bytes = 0;
  for (const auto& t : leaves_of(make_td(workload), workload)) bytes += static_cast<size_t>(t.numel()) * sizeof(float);
  return bytes;
}

// A TD op's tensordict on one rank, made once and used by both transports.
class TdBuffers {
 public:
  TdBuffers(const std::string& op, const std::string& workload, int rank, int world)
      : op_(op), workload_(workload), rank_(rank), world_(world), td_(make_td(workload)) {
    if (op_ == "td.gather_and_stack" && rank_ == 0) {
      // Rank 0 gathers: its tree has the other ranks' entries along a new first dimension.
      std::vector<int64_t> batch{world_ - 1};
      for (const int64_t d : td_.batch_size()) batch.push_back(d);
      stacked_ = td_.expand(batch).contiguous();
    }
  }

  void run(const Group& g) {
    if (op_ == "td.all_reduce") {
      td_.all_reduce({.group = g});
    } else if (op_ == "td.gather_and_stack") {
      (rank_ == 0 ? stacked_ : td_).gather_and_stack({.group = g, .group_dst = 0});
    } else {
      gathered_ = td_.all_gather({.group = g});
    }
  }

  void run_checked(const Group& g, const std::string& where) {
    for (const auto& t : leaves_of(td_, workload_)) fill(t, static_cast<float>(rank_ + 1));
    run(g);
    if (op_ == "td.all_reduce") {
      for (const auto& t : leaves_of(td_, workload_)) check(t, static_cast<float>(world_ * (world_ + 1) / 2), rank_, where);
    } else if (op_ == "td.gather_and_stack") {
      if (rank_ == 0) {
        for (const auto& t : leaves_of(stacked_, workload_)) {
          for (int j = 0; j + 1 < world_; ++j) check(t[j], static_cast<float>(j + 2), rank_, where);  // rank j + 1
          t.zero_();
        }
      }
    } else {
      if (gathered_.size() != static_cast<size_t>(world_)) {
        throw std::runtime_error(where + ": all_gather returned " + std::to_string(gathered_.size()) + " tensordicts");
      }
      for (int r = 0; r < world_; ++r) {
        for (const auto& t : leaves_of(gathered_[static_cast<size_t>(r)], workload_)) {
          check(t, static_cast<float>(r + 1), rank_, where);
        }
      }
    }
    for (const auto& t : leaves_of(td_, workload_)) fill(t, 0.0f);
    gathered_.clear();
  }

 private:
  std::string op_, workload_;
  int rank_, world_;
  TensorDict td_;
  TensorDict stacked_;  // td.gather_and_stack on rank 0
  std::vector<TensorDict> gathered_;
};

// ---- a rank ----

struct World {
  int world = 2;
  std::vector<size_t> sizes;
  int repeat = 3;
  std::string segment;
  bool progress = false, tty = false;
};

// `ops` ops between two barriers of g; rank 0's seconds.
template <typename Buffers>
double timed_ops(const Group& g, Buffers& b, int64_t ops) {
  barrier(g);
  const auto start = Clock::now();
  for (int64_t i = 0; i < ops; ++i) run_on(b, g);
  barrier(g);
  return seconds_since(start);
}

void run_on(OpBuffers& b, const Group& g) { b.run(g.backend()); }
void run_on(TdBuffers& b, const Group& g) { b.run(g); }
void run_checked_on(OpBuffers& b, const Group& g, const std::string& where) { b.run_checked(g.backend(), where); }
void run_checked_on(TdBuffers& b, const Group& g, const std::string& where) { b.run_checked(g, where); }

// Rank 0's value of `v`, on every rank (over gloo).
int64_t from_rank0(const Groups& groups, int64_t v) {
  std::vector<at::Tensor> t{at::empty({1}, at::kLong)};
  t[0].data_ptr<int64_t>()[0] = v;
  c10d::BroadcastOptions o;
  o.rootRank = 0;
  groups.gloo.backend().broadcast(t, o)->wait();
  return t[0].data_ptr<int64_t>()[0];
}

// Warm-up and calibration; the ops per round, the same on every rank.
template <typename Buffers>
int64_t calibrate(const Groups& groups, const Group& g, Buffers& b) {
  for (int64_t ops = 1;; ops *= 2) {
    const double s = timed_ops(g, b, ops);
    // Rank 0 decides: 0 = go on doubling, else the ops per round.
    int64_t per_round = 0;
    if (s >= kCalibrateSeconds || ops >= kMaxOpsPerRound) {
      per_round = std::clamp<int64_t>(static_cast<int64_t>(kRoundSeconds * static_cast<double>(ops) / std::max(s, 1e-9)),
                                      1, kMaxOpsPerRound);
    }
    per_round = from_rank0(groups, per_round);
    if (per_round > 0) return per_round;
  }
}

// One (op, size) or (TD op, workload) of a world: checked, calibrated and measured per
// transport; rank 0 reports "M <name> <transport> <bytes> <round> <ops> <seconds>".
template <typename Buffers>
void measure(const World& w, const Groups& groups, int rank, const Reporter& report, const std::string& name,
             size_t bytes, Buffers& b) {
  int64_t per_round[2] = {0, 0};
  for (int t = 0; t < 2; ++t) {
    const Group& g = groups[kCollectiveTransports[t]];
    run_checked_on(b, g, name + " " + kCollectiveTransports[t] + " " + size_label(static_cast<double>(bytes)) + " world " +
                             std::to_string(w.world));
    per_round[t] = calibrate(groups, g, b);
  }
  for (int r = 0; r < w.repeat; ++r) {
    for (int k = 0; k < 2; ++k) {
      const int t = r % 2 == 0 ? k : 1 - k;  // the order alternates from round to round
      const double s = timed_ops(groups[kCollectiveTransports[t]], b, per_round[t]);
      if (rank == 0) {
        char line[256];
        std::snprintf(line, sizeof line, "M %s %s %zu %d %lld %.9g", name.c_str(), kCollectiveTransports[t], bytes, r,
                      static_cast<long long>(per_round[t]), s);
        report.line(line);
      }
    }
  }
}

int run_world_rank(const World& w, int rank, Control& control, const Reporter& report) {
  at::set_num_threads(1);
  try {
    const Groups groups = make_groups(w.segment, rank, w.world, control);
    const int total = static_cast<int>(std::size(kOps) * w.sizes.size() + std::size(kTdOps) * std::size(kTdWorkloads));
    int index = 0;
    auto progress = [&](const std::string& what) {
      ++index;
      if (rank != 0 || !w.progress) return;
      std::fprintf(stderr, "%s[collectives world %d %d/%d] %s ...%s", w.tty ? "\r\033[K" : "", w.world, index, total,
                   what.c_str(), w.tty ? "" : "\n");
      std::fflush(stderr);
    };
    for (const char* op : kOps) {
      for (const size_t size : w.sizes) {
        const int64_t n = floats_of(size);
        const size_t bytes = static_cast<size_t>(n) * sizeof(float);
        progress(std::string(op) + " " + size_label(static_cast<double>(bytes)));
        OpBuffers b(op, n, rank, w.world);
        measure(w, groups, rank, report, op, bytes, b);
      }
    }
    for (const char* op : kTdOps) {
      for (const char* workload : kTdWorkloads) {
        progress(std::string(op) + " " + workload);
        TdBuffers b(op, workload, rank, w.world);
        measure(w, groups, rank, report, std::string(op) + ":" + workload, td_bytes(workload), b);
      }
    }
    // Nobody tears a group down while a peer still waits in it.
    barrier(groups.gloo);
    barrier(groups.shm);
    if (rank == 0 && w.progress && w.tty) std::fprintf(stderr, "\r\033[K");
    return 0;
  } catch (const std::exception& e) {
    report.line("E " + std::to_string(rank) + " " + e.what());
    return 1;
  }
}

// ---- the coordinator ----

// Per-op seconds of each round, by (op, transport, bytes).
using Key = std::tuple<std::string, std::string, size_t>;
struct Rounds {
  std::vector<double> per_op;
  int64_t ops = 0;
};

struct CollectiveStats {
  int n = 0;
  double p50_us = 0, min_us = 0, max_us = 0, gbps = 0;
  int64_t ops = 0;
};

CollectiveStats stats_of(const Rounds& r, size_t bytes) {
  CollectiveStats s;
  s.n = static_cast<int>(r.per_op.size());
  if (s.n == 0) return s;
  s.p50_us = median_of(r.per_op) * 1e6;
  s.min_us = *std::min_element(r.per_op.begin(), r.per_op.end()) * 1e6;
  s.max_us = *std::max_element(r.per_op.begin(), r.per_op.end()) * 1e6;
  s.gbps = static_cast<double>(bytes) / (s.p50_us * 1e3);
  s.ops = r.ops;
  return s;
}

// One copy of `bytes` with memcpy, single thread: median and min-max of `repeat` rounds of
// about kRoundSeconds each. No LibTorch here: this is the coordinator.
Rounds measure_memcpy(size_t bytes, int repeat) {
  // Page-aligned buffers: with heap blocks next to each other, dst - src is a multiple of 4 KiB
  // plus a few bytes, which makes the CPU's fast string copy crawl (64 KiB at 3 GB/s here).
  const size_t capacity = (bytes + 4095) / 4096 * 4096;
  struct Free {
    void operator()(char* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<char, Free> src(static_cast<char*>(std::aligned_alloc(4096, capacity)));
  std::unique_ptr<char, Free> dst(static_cast<char*>(std::aligned_alloc(4096, capacity)));
  if (!src || !dst) throw std::bad_alloc();
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 0, bytes);
  volatile char sink = 0;
  auto copies = [&](int64_t n) {
    const auto start = Clock::now();
    for (int64_t i = 0; i < n; ++i) {
      src.get()[i % static_cast<int64_t>(bytes)] = static_cast<char>(i);
      std::memcpy(dst.get(), src.get(), bytes);
      sink = sink + dst.get()[bytes - 1];
    }
    return seconds_since(start);
  };
  int64_t per_round = 1;
  for (int64_t ops = 1;; ops *= 2) {
    const double s = copies(ops);
    if (s >= kCalibrateSeconds || ops >= kMaxOpsPerRound * 10) {
      per_round = std::clamp<int64_t>(static_cast<int64_t>(kRoundSeconds * static_cast<double>(ops) / std::max(s, 1e-9)),
                                      1, kMaxOpsPerRound * 10);
      break;
    }
  }
  Rounds r;
  r.ops = per_round;
  for (int i = 0; i < repeat; ++i) r.per_op.push_back(copies(per_round) / static_cast<double>(per_round));
  return r;
}

std::string spread(const CollectiveStats& s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%10.1f - %-10.1f", s.min_us, s.max_us);
  return buf;
}

Row make_row(const std::string& op, const std::string& transport, int workers, size_t bytes, const CollectiveStats& s) {
  Row r;
  r.set("scenario", "collectives").set("pattern", op).set("transport", transport);
  r.set_int("workers", workers).set_int("bytes", static_cast<int64_t>(bytes));
  r.set_int("iters", s.ops).set_int("repeats", s.n);
  r.set_number("p50_us", s.p50_us).set_number("min_us", s.min_us).set_number("max_us", s.max_us);
  r.set_number("gbps", s.gbps);
  return r;
}

struct Goal {
  const char* label;
  const char* what;
  double limit;
  std::optional<double> ratio;
};

}  // namespace

const std::vector<size_t>& default_collective_sizes() {
  static const std::vector<size_t> sizes{8, size_t{1} << 10, size_t{64} << 10, size_t{1} << 20, size_t{16} << 20,
                                         size_t{64} << 20};
  return sizes;
}

ScenarioRun run_collectives(const BenchOptions& options) {
  ScenarioRun run;
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  const bool progress = options.progress || tty;
  const int cpus = allowed_cpu_count();
  std::vector<size_t> sizes;
  for (const size_t s : options.sizes) {
    const size_t bytes = static_cast<size_t>(floats_of(s)) * sizeof(float);
    if (std::find(sizes.begin(), sizes.end(), bytes) == sizes.end()) sizes.push_back(bytes);
  }

  std::printf("\ncollectives: all_reduce (SUM, float32), all_gather, broadcast (from rank 0), scatter (from rank 0)\n"
              "  over ProcessGroupShm and gloo (127.0.0.1) in the same forked processes, one layout per world size\n"
              "  bytes: the float32 tensor of each rank (scatter: what each rank receives; the root sends world x\n"
              "  bytes); per-op time: rank 0 times rounds of ops from the end of a barrier to the end of a closing\n"
              "  barrier (the slowest rank's time, plus one barrier per round) / ops; a round is calibrated to\n"
              "  ~%.0f ms after a warm-up, every op and size checked once per transport on every rank;\n"
              "  median of %d round(s), min-max beside it; GB/s = bytes / median (10^9 B/s);\n"
              "  shm/gloo = gloo time / shm time\n",
              kRoundSeconds * 1e3, options.repeat);
  std::string crowded;
  for (const int world : options.world_sizes) {
    if (world > cpus) crowded += (crowded.empty() ? "" : ", ") + std::to_string(world);
  }
  if (!crowded.empty()) {
    std::printf("\nnote: world %s run%s more processes than this machine's %d CPU(s): oversubscribed, so those\n"
                "      rows measure time sharing of the CPUs as much as the transports\n",
                crowded.c_str(), crowded.find(',') == std::string::npos ? "s" : "", cpus);
  }
  std::printf("  TensorDict rows: td.all_reduce / td.all_gather / td.gather_and_stack (TensorDict::all_reduce,\n"
              "  TensorDict::all_gather, TensorDict::gather_and_stack to rank 0: one all_reduce per leaf;\n"
              "  consolidate + metadata all_gather_object + one storage all_gather; per leaf into rank 0's entries) of\n"
              "  the seed tree {(\"a\",\"b\"): zeros(2), \"c\": zeros(2,3), \"_\": zeros(2,1,5)}, batch [2] (%zu B), and\n"
              "  of 10 float leaves of 1 MiB (%zu B); bytes = the leaves' bytes per rank\n",
              td_bytes("seed"), td_bytes("10x1MiB"));

  // The memcpy reference, in this process (no LibTorch).
  std::printf("\nmemcpy reference: one copy of the size, single thread (this process)\n");
  std::printf("%10s  %-10s %10s  %-23s %8s %9s\n", "size", "transport", "p50 us", "   min - max", "GB/s", "ops/round");
  std::map<size_t, CollectiveStats> memcpy_stats;
  for (const size_t bytes : sizes) {
    const CollectiveStats s = stats_of(measure_memcpy(bytes, options.repeat), bytes);
    memcpy_stats[bytes] = s;
    std::printf("%10s  %-10s %10.2f  %-23s %8.3f %9lld\n", size_label(static_cast<double>(bytes)).c_str(), "memcpy",
                s.p50_us, spread(s).c_str(), s.gbps, static_cast<long long>(s.ops));
    run.rows.push_back(make_row("memcpy", "memcpy", 1, bytes, s));
  }
  std::fflush(stdout);

  std::map<std::tuple<std::string, std::string, int, size_t>, CollectiveStats> all;
  for (const int world : options.world_sizes) {
    World w;
    w.world = world;
    w.sizes = sizes;
    w.repeat = options.repeat;
    w.segment = "tdshm-bench-" + std::to_string(::getpid()) + "-collectives-" + std::to_string(world);
    w.progress = progress;
    w.tty = tty;
    RankJob job;
    job.world = world;
    job.segment = w.segment;
    job.run_rank = [&w](int rank, Control& control, const Reporter& report) {
      return run_world_rank(w, rank, control, report);
    };
    job.rank_name = [](int rank) { return "rank " + std::to_string(rank); };
    const auto started = Clock::now();
    RanksResult result;
    try {
      // A safety net only: every wait of the ranks has its own 60 s deadline.
      result = run_ranks(job, std::chrono::seconds(900));
    } catch (const std::exception& e) {
      result.failures.push_back(e.what());
    }
    if (progress && tty) std::fprintf(stderr, "\r\033[K");
    const std::string where = "collectives world " + std::to_string(world) + ": ";
    std::map<Key, Rounds> rounds;
    for (const auto& line : result.reports) {
      char op[64], transport[16];
      size_t bytes = 0;
      int r = 0;
      long long ops = 0;
      double seconds = 0;
      if (std::sscanf(line.c_str(), "M %63s %15s %zu %d %lld %lf", op, transport, &bytes, &r, &ops, &seconds) != 6 ||
          ops <= 0) {
        result.failures.push_back("unreadable report from a rank: " + line);
        continue;
      }
      Rounds& rr = rounds[{op, transport, bytes}];
      rr.per_op.push_back(seconds / static_cast<double>(ops));
      rr.ops = ops;
    }
    for (const auto& f : result.failures) {
      run.failures.push_back(where + f);
      std::fprintf(stderr, "tdshm bench: %s\n", run.failures.back().c_str());
    }

    std::printf("\nworld %d (%d processes on %d CPU(s)%s), %.0f s\n", world, world, cpus,
                world > cpus ? ": oversubscribed" : "", seconds_since(started));
    std::printf("%-21s %10s  %-9s %10s  %-23s %8s %9s %9s\n", "op", "size", "transport", "p50 us", "   min - max",
                "GB/s", "shm/gloo", "ops/round");
    struct Line {
      std::string name, pattern, workload;
      size_t bytes;
    };
    std::vector<Line> table;
    for (const char* op : kOps) {
      for (const size_t bytes : sizes) table.push_back({op, op, "", bytes});
    }
    for (const char* op : kTdOps) {
      for (const char* workload : kTdWorkloads) {
        table.push_back({std::string(op) + ":" + workload, op, workload, td_bytes(workload)});
      }
    }
    for (const auto& line : table) {
      {
        const size_t bytes = line.bytes;
        const std::string label = line.workload.empty() ? line.pattern : line.pattern + " " + line.workload;
        const CollectiveStats shm = stats_of(rounds[{line.name, "shm", bytes}], bytes);
        const CollectiveStats gloo = stats_of(rounds[{line.name, "gloo", bytes}], bytes);
        for (const char* transport : kCollectiveTransports) {
          const bool is_shm = std::string(transport) == "shm";
          const CollectiveStats& s = is_shm ? shm : gloo;
          const std::string size_text = is_shm ? size_label(static_cast<double>(bytes)) : "";
          const char* op = label.c_str();
          if (s.n < options.repeat) {
            if (result.failures.empty()) {
              run.failures.push_back(where + label + " " + transport + " " + size_label(static_cast<double>(bytes)) +
                                     ": " + std::to_string(s.n) + " of " + std::to_string(options.repeat) +
                                     " measurements came back");
            }
            std::printf("%-21s %10s  %-9s %10s\n", is_shm ? op : "", size_text.c_str(), transport, "not measured");
            continue;
          }
          char ratio[32] = "";
          std::optional<double> speedup;
          if (is_shm && gloo.n > 0 && shm.p50_us > 0) {
            speedup = gloo.p50_us / shm.p50_us;
            std::snprintf(ratio, sizeof ratio, "%8.2fx", *speedup);
          }
          std::printf("%-21s %10s  %-9s %10.2f  %-23s %8.3f %9s %9lld\n", is_shm ? op : "", size_text.c_str(),
                      transport, s.p50_us, spread(s).c_str(), s.gbps, ratio, static_cast<long long>(s.ops));
          Row row = make_row(line.pattern, transport, world, bytes, s);
          if (!line.workload.empty()) row.set("workload", line.workload);
          if (speedup) row.set_number("speedup", *speedup);
          run.rows.push_back(std::move(row));
          all[{line.name, transport, world, bytes}] = s;
        }
      }
    }
    std::fflush(stdout);
  }

  // The goals (the issue's), from this run.
  auto find = [&](const char* op, const char* transport, int world, size_t bytes) -> const CollectiveStats* {
    const auto it = all.find({op, transport, world, bytes});
    return it == all.end() ? nullptr : &it->second;
  };
  auto speedup = [&](const char* op, int world, size_t bytes) -> std::optional<double> {
    const CollectiveStats* s = find(op, "shm", world, bytes);
    const CollectiveStats* g = find(op, "gloo", world, bytes);
    if (s == nullptr || g == nullptr) return std::nullopt;
    return g->p50_us / s->p50_us;
  };
  std::optional<double> bcast;
  if (const CollectiveStats* s = find("broadcast", "shm", 4, size_t{64} << 20); s != nullptr) {
    const auto m = memcpy_stats.find(size_t{64} << 20);
    if (m != memcpy_stats.end()) bcast = s->gbps / m->second.gbps;
  }
  const Goal goals[] = {
      {"all_reduce 1 MiB", "world 4: gloo p50 / shm p50", 5, speedup("all_reduce", 4, size_t{1} << 20)},
      {"all_reduce 8 B", "world 4: gloo p50 / shm p50", 20, speedup("all_reduce", 4, 8)},
      {"broadcast 64 MiB", "world 4: shm GB/s / memcpy GB/s", 0.8, bcast},
      {"gather_and_stack", "seed, world 4: gloo p50 / shm p50", 20, speedup("td.gather_and_stack:seed", 4, td_bytes("seed"))},
  };
  std::printf("\ngoals (ratios from this run's medians):\n");
  for (const auto& g : goals) {
    if (!g.ratio) {
      std::printf("  %-17s %-33s %9s  >= %-4g n/a (not measured)\n", g.label, g.what, "", g.limit);
      continue;
    }
    std::printf("  %-17s %-33s %9.3f  >= %-4g %s\n", g.label, g.what, *g.ratio, g.limit,
                *g.ratio >= g.limit ? "PASS" : "MISS");
  }
  std::fflush(stdout);
  return run;
}

}  // namespace tdshm::bench
