// The scenarios' statistics and the tables' fixed parts (scenario_results.h).

#include "scenario_results.h"

#include "bench_ranks.h"
#include "loader_batch.h"

#include <algorithm>
#include <cstdio>

namespace tdshm::bench {

Stats stats_of(const LayoutResult& r, const std::string& pattern, const std::string& transport, int items_per_count) {
  std::vector<double> rates, seconds, shares, bounds;
  for (const auto& m : r.measured) {
    if (m.pattern != pattern || m.transport != transport || m.seconds <= 0) continue;
    rates.push_back(static_cast<double>(m.count) * items_per_count / m.seconds);
    seconds.push_back(m.seconds);
    if (m.read_seconds > 0) {
      shares.push_back(m.read_seconds / m.seconds);
      bounds.push_back(static_cast<double>(m.count) * items_per_count / m.read_seconds);
    }
  }
  std::vector<double> writes;
  for (const auto& w : r.written) {
    if (w.pattern == pattern && w.transport == transport && w.batch_seconds > 0) writes.push_back(w.batch_seconds);
  }
  Stats s;
  s.n = static_cast<int>(rates.size());
  if (s.n == 0) return s;
  s.median = median_of(rates);
  s.min = *std::min_element(rates.begin(), rates.end());
  s.max = *std::max_element(rates.begin(), rates.end());
  s.median_seconds = median_of(seconds);
  if (!shares.empty()) {
    s.read_share = median_of(shares);
    s.read_bound = median_of(bounds);
    s.read_batch_seconds = 1 / s.read_bound;
  }
  if (!writes.empty()) s.write_batch_seconds = median_of(writes);
  return s;
}

void print_loan_goals(const LayoutResult& r, const std::string& scenario, int items) {
  auto median = [&](const char* pattern, const char* transport) { return stats_of(r, pattern, transport, items).median; };
  auto line = [](const char* what, double num, double den, const char* goal, double limit) {
    if (num <= 0 || den <= 0) return;
    std::printf("  goal: %-44s %6.2f  %s %.2f  %s\n", what, num / den, goal, limit, num / den >= limit ? "PASS" : "MISS");
  };
  if (scenario == "loader") {
    line("shm loan-view / shm irecv-ahead", median("loan-view", "shm"), median("irecv-ahead", "shm"), ">=", 2.0);
    line("shm loan-view / inplace (hand-written)", median("loan-view", "shm"), median("loan-view", "inplace"), ">=", 1.2);
    line("shm loan-view-c / shm irecv-ahead", median("loan-view-c", "shm"), median("irecv-ahead", "shm"), ">=", 2.0);
    line("shm loan-view-c / inplace (hand-written)", median("loan-view-c", "shm"), median("loan-view", "inplace"), ">=",
         1.2);
    line("shm loan-copy / shm irecv-ahead", median("loan-copy", "shm"), median("irecv-ahead", "shm"), ">=", 1.3);
    // The ready-made core (tdshm::Feed) against what it replaces: the hand-written loans loop and
    // the hand-written in-place reference.
    line("shm feed / shm loan-view (hand-written loans)", median("feed", "shm"), median("loan-view", "shm"), ">=", 0.9);
    line("shm feed / inplace (hand-written)", median("feed", "shm"), median("loan-view", "inplace"), ">=", 0.95);
    // What main reading every byte and nothing else would take (measured in the in-place
    // reference, whose main does nothing else but wait on one flag); and what the CPUs allow when
    // they only write every byte once (the workers) and read it once (main): no transport can do
    // less, so no pattern passes min(1 / read, N / write, CPUs / (write + read)) batches/s.
    const Stats inplace = stats_of(r, "loan-view", "inplace", items);
    const double copying = median("irecv-ahead", "shm");
    if (inplace.read_bound > 0 && inplace.median > 0 && copying > 0) {
      std::printf("  ceiling: inplace's main reads for %.0f %% of its loop; reading alone, main would take %.1f batches/s\n"
                  "           = %.2fx inplace, %.2fx shm irecv-ahead (what reading alone allows this minute)\n",
                  100 * inplace.read_share, inplace.read_bound, inplace.read_bound / inplace.median,
                  inplace.read_bound / copying);
      const double write = inplace.write_batch_seconds, read = inplace.read_batch_seconds;
      const int cpus = allowed_cpu_count();
      if (write > 0 && cpus > 0) {
        const double bound = std::min({1 / read, items / write, cpus / (write + read)});
        std::printf("  ceiling: a worker writes a batch in %.1f us, main reads it in %.1f us (inplace, medians); with %d\n"
                    "           CPU(s) doing nothing else: %.1f batches/s = %.2fx inplace, %.2fx shm irecv-ahead\n",
                    write * 1e6, read * 1e6, cpus, bound, bound / inplace.median, bound / copying);
      }
    }
  } else {
    line("shm loan-view / shm weights-trajectory", median("loan-view", "shm"), median("weights-trajectory", "shm"), ">=",
         2.0);
  }
}

void print_columns(const std::string& scenario) {
  if (scenario == "loader") {
    std::printf("\n%7s  %-13s %-9s %11s  %-23s %8s %9s %11s %10s\n", "workers", "pattern", "transport", "batches/s",
                "  min - max", "GB/s", "shm/gloo", "shm/ref", "main reads");
  } else {
    std::printf("\n%7s  %-19s %-9s %11s  %-23s %8s %9s %11s\n", "actors", "pattern", "transport", "steps/s",
                "  min - max", "GB/s", "shm/gloo", "shm/ref");
  }
  std::fflush(stdout);
}

void print_scenario_header(const BenchOptions& o, const std::string& scenario, size_t trajectory_bytes) {
  if (scenario == "loader") {
    std::printf("\nscenario loader: N worker processes -> 1 main process, over shm and gloo in the same processes\n"
                "  batch: {\"image\": uint8 [32,3,64,64], \"label\": int64 [32], \"meta\": {\"idx\", \"worker\": int64 [32]}},\n"
                "         batch size [32], %zu bytes of leaves; %d batches per worker per measurement, main checks every batch\n"
                "  blocking      main: per-leaf recv round-robin over the workers (worker 1's batch, worker 2's, ...)\n"
                "  irecv-ahead   main: irecv from every worker, then waits for each\n"
                "  consolidated  workers consolidate() each batch and send it as one message; main receives into\n"
                "                a consolidated tensordict per worker, round-robin\n"
                "  loan-copy     workers fill loans (tdshm::loan, four in turn) and isend them by reference; main\n"
                "                irecvs into its own tensordicts as irecv-ahead does: one copy per byte\n"
                "  loan-view     the same workers; main takes views (recv_view) round-robin: no copy\n"
                "  loan-view-c   the same with one consolidated loan per batch: one reference, one view\n"
                "  memcpy        the same processes and bytes through plain memcpy into shared memory and out\n"
                "                (the bench's copy_channel.h: no tags, matching or checks), in the copying\n"
                "                patterns (irecv-ahead is blocking there); what two copies per byte cost here\n"
                "  inplace       (loan-view) what a user writes by hand: a spin flag over one shared buffer per\n"
                "                worker, written in place by the worker and read in place by main (rl#3854)\n"
                "  every transport: the worker writes every byte of every batch once, main reads every byte once\n"
                "  batches/s = batches main received / seconds of its receive loop; GB/s = batches/s x %zu B;\n"
                "  median of %d measurement(s), min-max beside it; shm/gloo and shm/ref = ratios of the medians\n"
                "  (ref: memcpy, or inplace for loan-view)\n",
                kBatchBytes, o.batches, kBatchBytes, o.repeat);
  } else {
    std::printf("\nscenario actor-learner: 1 learner, %d actor process(es), over shm and gloo in the same processes\n"
                "  per step: the learner isends 4 MiB of weights (consolidated: 4 float leaves of 1 MiB) to every\n"
                "  actor and irecvs each actor's trajectory {\"obs\": float [64,16], \"action\": int64 [64],\n"
                "  \"reward\": float [64]} (per-leaf, %zu B); %d steps per measurement, both sides check every step\n"
                "  loan-view: the weights are a consolidated loan sent by reference; actors take views\n"
                "  memcpy: the same processes and bytes through plain memcpy into shared memory and out (the\n"
                "  bench's copy_channel.h: no tags, matching or checks): what two copies per byte cost here\n"
                "  steps/s = steps / seconds of the learner's loop; GB/s counts both directions;\n"
                "  median of %d measurement(s), min-max beside it; shm/gloo and shm/ref = ratios of the medians\n",
                o.actors, trajectory_bytes, o.steps, o.repeat);
  }
  std::fflush(stdout);
}

}  // namespace tdshm::bench
