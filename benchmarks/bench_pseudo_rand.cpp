// Cost of one pseudo-random transfer tag, against tensordict's Python _int_generator (a fresh
// numpy default_rng per tag, about 1e-5 s each).
//
//   cmake --build build --target tdshm_bench_pseudo_rand && build/benchmarks/tdshm_bench_pseudo_rand
//
// Two workloads: independent seeds through pseudo_rand_tag (the calls can overlap in the CPU),
// and transfer_tags' chain, where each seed is the previous tag + 1 (each call waits for the one
// before, what a transfer of many leaves pays). Each is timed over many tags, repeated; the
// median of the repeats is reported, with the fastest and slowest. Both wall-clock and the
// thread's CPU time are shown: on a shared machine the process may get a fraction of a core, and
// then only the CPU time says what a tag costs.

#include <tdshm/distributed.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <time.h>

namespace {

constexpr int kRepeats = 15;
constexpr size_t kTagsPerRepeat = 200000;
constexpr double kTensordictNsPerTag = 1e4;

// Keeps the compiler from dropping the work whose result nothing else reads.
volatile int64_t g_sink;

double thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

void print_row(const char* name, const char* clock, std::vector<double>& ns_per_tag) {
  std::sort(ns_per_tag.begin(), ns_per_tag.end());
  const double median = ns_per_tag[ns_per_tag.size() / 2];
  std::printf("%-34s %-4s median %6.1f ns/tag (min %6.1f, max %6.1f)  %5.0fx faster than 1e-5 s\n",
              name, clock, median, ns_per_tag.front(), ns_per_tag.back(), kTensordictNsPerTag / median);
}

template <class Body>
void report(const char* name, Body body) {
  body();  // warm-up: page in the code, settle the clock
  std::vector<double> wall, cpu;
  for (int r = 0; r < kRepeats; ++r) {
    const double cpu_start = thread_cpu_ns();
    const auto wall_start = std::chrono::steady_clock::now();
    body();
    const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - wall_start;
    cpu.push_back((thread_cpu_ns() - cpu_start) / static_cast<double>(kTagsPerRepeat));
    wall.push_back(elapsed.count() / static_cast<double>(kTagsPerRepeat));
  }
  print_row(name, "wall", wall);
  print_row(name, "cpu", cpu);
}

}  // namespace

int main() {
  std::printf("%d repeats of %zu tags\n", kRepeats, kTagsPerRepeat);
  report("pseudo_rand_tag, independent seeds", [] {
    int64_t sum = 0;
    for (size_t i = 0; i < kTagsPerRepeat; ++i) sum += tdshm::pseudo_rand_tag(static_cast<int64_t>(i));
    g_sink = sum;
  });
  report("transfer_tags chain", [] {
    const std::vector<int64_t> tags = tdshm::transfer_tags(1, kTagsPerRepeat, true);
    g_sink = tags.back();
  });
  return 0;
}
