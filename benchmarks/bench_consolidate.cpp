// consolidate() throughput next to a plain memcpy of the same total bytes, in the same run.
//
//   tools/dev.sh bench [google-benchmark flags...]
//
// Workloads: 100 leaves x 1 KiB and 10 leaves x 1 MiB (float32). Baselines: memcpy of the same
// total into a buffer allocated once (the ceiling), and allocate + memcpy + free (what any
// copy into fresh memory pays). After the table, one line per workload gives the ratio of
// consolidate's median bytes/s to each baseline's; then paired rounds (all three timed back to
// back in each round) give the same ratios with the machine's noise cancelled out.

#include <tdshm/tensordict.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/randn.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

tdshm::TensorDict make_td(int64_t leaves, int64_t leaf_bytes) {
  tdshm::TensorDict td;
  for (int64_t i = 0; i < leaves; ++i) td.set("leaf" + std::to_string(i), at::randn({leaf_bytes / 4}));
  return td;
}

void BM_Consolidate(benchmark::State& state) {
  const int64_t leaves = state.range(0), leaf_bytes = state.range(1);
  tdshm::TensorDict td = make_td(leaves, leaf_bytes);
  for (auto _ : state) {
    tdshm::TensorDict c = td.consolidate();
    benchmark::DoNotOptimize(c.consolidated_storage().data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * leaves * leaf_bytes);
}

void BM_Memcpy(benchmark::State& state) {
  const auto total = static_cast<size_t>(state.range(0) * state.range(1));
  std::vector<char> src(total, 1), dst(total, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), total);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * total));
}

void BM_AllocMemcpy(benchmark::State& state) {
  const auto total = static_cast<size_t>(state.range(0) * state.range(1));
  std::vector<char> src(total, 1);
  for (auto _ : state) {
    std::unique_ptr<char[]> dst(new char[total]);
    std::memcpy(dst.get(), src.data(), total);
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * total));
}

#define TDSHM_WORKLOADS Args({100, 1024})->Args({10, 1 << 20})
BENCHMARK(BM_Consolidate)->TDSHM_WORKLOADS;
BENCHMARK(BM_Memcpy)->TDSHM_WORKLOADS;
BENCHMARK(BM_AllocMemcpy)->TDSHM_WORKLOADS;

// Collects bytes/s per (benchmark, workload) to print ratios after the table.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      auto it = r.counters.find("bytes_per_second");
      if (it == r.counters.end()) continue;
      const std::string name = r.run_name.function_name;
      const std::string workload = r.run_name.args;
      if (aggregate) {
        medians_[workload][name] = it->second.value;
      } else {
        singles_[workload][name].push_back(it->second.value);
      }
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nconsolidate throughput relative to memcpy of the same bytes (median bytes/s):\n");
    for (auto& [workload, by_name] : singles_) {
      for (auto& [name, values] : by_name) {
        if (medians_[workload].count(name)) continue;  // a median aggregate wins over single runs
        std::sort(values.begin(), values.end());
        medians_[workload][name] = values[values.size() / 2];
      }
    }
    for (auto& [workload, m] : medians_) {
      if (!m.count("BM_Consolidate") || !m.count("BM_Memcpy") || !m.count("BM_AllocMemcpy")) continue;
      std::printf("  workload %-12s consolidate %8.2f GB/s | memcpy %8.2f GB/s (ratio %.2f) | alloc+memcpy %8.2f GB/s (ratio %.2f)\n",
                  workload.c_str(), m["BM_Consolidate"] / 1e9, m["BM_Memcpy"] / 1e9,
                  m["BM_Consolidate"] / m["BM_Memcpy"], m["BM_AllocMemcpy"] / 1e9,
                  m["BM_Consolidate"] / m["BM_AllocMemcpy"]);
    }
  }

 private:
  std::map<std::string, std::map<std::string, double>> medians_;
  std::map<std::string, std::map<std::string, std::vector<double>>> singles_;
};

// Paired measurement: each round times consolidate, then memcpy, then alloc+memcpy, back to
// back, so machine noise lands on all three alike; the ratios are of the per-kind medians.
void paired_ratios(int64_t leaves, int64_t leaf_bytes, int rounds) {
  tdshm::TensorDict td = make_td(leaves, leaf_bytes);
  const auto total = static_cast<size_t>(leaves * leaf_bytes);
  std::vector<char> src(total, 1), dst(total, 0);
  std::vector<double> t_cons, t_copy, t_alloc;
  using clock = std::chrono::steady_clock;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = clock::now();
    {
      tdshm::TensorDict c = td.consolidate();
      benchmark::DoNotOptimize(c.consolidated_storage().data_ptr());
    }
    auto t1 = clock::now();
    std::memcpy(dst.data(), src.data(), total);
    benchmark::ClobberMemory();
    auto t2 = clock::now();
    {
      std::unique_ptr<char[]> fresh(new char[total]);
      std::memcpy(fresh.get(), src.data(), total);
      benchmark::DoNotOptimize(fresh.get());
      benchmark::ClobberMemory();
    }
    auto t3 = clock::now();
    t_cons.push_back(std::chrono::duration<double>(t1 - t0).count());
    t_copy.push_back(std::chrono::duration<double>(t2 - t1).count());
    t_alloc.push_back(std::chrono::duration<double>(t3 - t2).count());
  }
  auto median = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double c = median(t_cons), m = median(t_copy), a = median(t_alloc);
  std::printf("  %3" PRId64 " x %7" PRId64 " B  consolidate %8.1f us %6.2f GB/s | memcpy %8.1f us (ratio %.2f) | "
              "alloc+memcpy %8.1f us (ratio %.2f)\n",
              leaves, leaf_bytes, c * 1e6, static_cast<double>(total) / c / 1e9, m * 1e6, m / c, a * 1e6, a / c);
}

}  // namespace

int main(int argc, char** argv) {
  // Defaults for a shared, noisy machine: repetitions interleaved at random, so drifting load
  // hits consolidate and its baselines alike, and medians. Flags given later override them.
  std::vector<char*> args{argv[0]};
  std::string defaults[] = {"--benchmark_repetitions=15", "--benchmark_enable_random_interleaving=true",
                            "--benchmark_report_aggregates_only=true", "--benchmark_min_time=0.1"};
  for (auto& d : defaults) args.push_back(d.data());
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  std::printf("\npaired rounds (ratio = baseline time / consolidate time; >= 1 means consolidate is as fast):\n");
  paired_ratios(100, 1024, 2001);
  paired_ratios(10, 1 << 20, 301);
  return 0;
}
