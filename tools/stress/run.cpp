// `tdshm stress`: the shm transport under real lifecycles, through the public API only. This
// file runs it: the worker mode, the options, then the kill loop over the scenarios and the
// recreate runs, the summary and the exit code. The parts live beside it in tools/stress/.
//
// Kill loop (scenarios a-h). Every trial starts one process per rank (fork + exec of this tool in
// a hidden worker mode, `tdshm stress --worker ...`; `--spawn fork` skips the exec), with a
// segment name of its own, waits until all are ready, starts the scenario and SIGKILLs one rank
// at a uniformly random instant of the scenario's active window (measured beforehand by one run
// without a kill). The survivors report what their waits ended in and when. Then a fresh group of
// all ranks under the same name must rendezvous and do one checked transfer, with no cleanup in
// between; only after that is the name cleaned with tdshm::remove_stale_segment, and whatever
// was left in /dev/shm is reported as a leak.
//
// Re-creation loop (`--scenario recreate`): W ranks run N cycles of init_process_group, a
// checked transfer, a barrier every other cycle and destroy_process_group under ONE name, with
// random 0-2 ms sleeps between the calls so that the ranks' calls interleave in every way.
//
// Where each part is:
//   worker.cpp     a worker process: one rank's lifecycle, reported as events on fd 3
//   transfers.cpp  what the ranks send and check
//   events.cpp     the event lines: written by workers, parsed by the driver
//   driver.cpp     the driver's processes: spawn, pump the reports, reap, kill hangs
//   trial.cpp      one kill trial (or calibration run), its recovery and cleanup
//   classify.cpp   what a survivor's run ended in, and what fails a trial
//   recreate.cpp   one run of the re-creation loop
//   leftovers.cpp  /dev/shm entries and worker logs left behind
//   report.cpp     printed lines, statistics, tables and JSON
//   options.cpp    the command line and the usage text

#include "stress.h"

#include "stress_internal.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace tdshm::tools {
namespace stress {
namespace {

/// Opens /dev/null on any of fds 0-2 that is closed, so that pipes never land there.
void ensure_std_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int n = ::open("/dev/null", O_RDWR);
      if (n >= 0 && n != fd) {
        ::dup2(n, fd);
        ::close(n);
      }
    }
  }
}

int run_driver(const Options& o) {
  ensure_std_fds();
  ::signal(SIGPIPE, SIG_IGN);  // a GO written to a worker that died
  Driver d;
  std::error_code ec;
  d.exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) {
    std::fprintf(stderr, "tdshm stress: cannot read /proc/self/exe: %s\n", ec.message().c_str());
    return 1;
  }
  d.fork_only = o.fork_only;
  if (d.fork_only) {
    // A fork without exec is only as safe as the driver is single-threaded (it never runs ATen ops,
    // so LibTorch's pools are not started; check rather than trust).
    size_t threads = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task", ec)) ++threads;
    if (threads != 1) {
      std::printf("tdshm stress: the driver runs %zu threads: workers are exec'd after all\n", threads);
      d.fork_only = false;
    }
  }
  d.hang_s = o.hang_s;
  d.verbose = o.verbose;
  std::string dir_template = (std::filesystem::temp_directory_path() / "tdshm-stress-XXXXXX").string();
  if (::mkdtemp(dir_template.data()) == nullptr) {
    std::fprintf(stderr, "tdshm stress: mkdtemp: %s\n", std::strerror(errno));
    return 1;
  }
  d.log_dir = dir_template;
  const uint64_t seed = o.seed ? *o.seed : std::random_device{}();
  std::mt19937_64 rng(seed);
  std::ofstream json;
  if (!o.json.empty()) {
    json.open(o.json, std::ios::out | std::ios::trunc);
    if (!json) {
      std::fprintf(stderr, "tdshm stress: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }

  std::vector<const Scenario*> kills;
  bool recreate = false;
  for (const std::string& n : o.scenarios) {
    if (n == "recreate") {
      recreate = true;
    } else {
      kills.push_back(find_scenario(n));
    }
  }
  std::printf("tdshm stress: seed %" PRIu64 ", pid %d, %s, hang deadline %.0f s after a kill, logs in %s\n", seed,
              static_cast<int>(::getpid()), o.fork_only ? "workers forked" : "workers forked and exec'd", o.hang_s,
              d.log_dir.string().c_str());
  int failures = 0;

  if (!kills.empty()) {
    std::printf("kill loop: %d trials over %zu scenarios\n", o.trials, kills.size());
    std::vector<Stats> per(kills.size());
    for (size_t k = 0; k < kills.size(); ++k) {
      const Scenario& s = *kills[k];
      const int n = o.trials / static_cast<int>(kills.size()) + (static_cast<int>(k) < o.trials % static_cast<int>(kills.size()) ? 1 : 0);
      if (n == 0) continue;
      std::printf("%c %-13s %s\n", s.letter, s.name, s.what);
      std::fflush(stdout);
      // The window: the median of the calibration runs (one run alone is at the mercy of a busy CPU).
      std::vector<double> measured;
      for (int c = 0; c < o.calibrations; ++c) {
        const Trial cal = run_trial(d, s, c, true, 0, rng);
        per[k].add(cal);
        print_trial(cal, o.verbose || cal.failed());
        if (json.is_open()) json << trial_json(cal) << "\n";
        if (!cal.failed()) remove_logs(d, cal.name);
        if (cal.measured_ms > 0) measured.push_back(cal.measured_ms);
      }
      std::sort(measured.begin(), measured.end());
      const double window = measured.empty() ? 100.0 : measured[measured.size() / 2];
      std::printf("  window %.2f ms (median of %zu calibration runs without a kill), %d trials\n", window,
                  measured.size(), n);
      std::fflush(stdout);
      for (int i = 0; i < n; ++i) {
        const Trial t = run_trial(d, s, i, false, window, rng);
        per[k].add(t);
        print_trial(t, o.verbose);
        if (json.is_open()) json << trial_json(t) << "\n";
        if (!t.failed()) remove_logs(d, t.name);
      }
    }
    std::printf("\n");
    print_stats_header();
    Stats total;
    for (size_t k = 0; k < kills.size(); ++k) {
      const std::string label = std::string(1, kills[k]->letter) + " " + kills[k]->name;
      print_stats_row(label.c_str(), per[k]);
      if (json.is_open()) json << stats_json(kills[k]->name, per[k]) << "\n";
      total.merge(per[k]);
    }
    print_stats_row("total", total);
    if (json.is_open()) json << stats_json("total", total) << "\n";
    std::printf(
        "(surv: surviving ranks; PeerLost<=1s: PeerLostError within 1 s of the kill among the survivors whose\n"
        " waits did not complete; timeout: TimeoutError, a failure except in rendezvous and create where the victim\n"
        " may die before it registers; crashes: killed by a signal, another exception type, no report, or a rank\n"
        " that failed before the kill; recovery: a fresh group of all ranks under the same name, no cleanup before;\n"
        " leaks: trials that left /dev/shm entries; kills after the victim had finished: %d; calibration failures: %d)\n",
        total.kills_after_end, total.calibration_failures);
    failures += total.failures();
  }

  if (recreate) {
    std::printf("\nre-creation loop: init_process_group / checked transfer / barrier every other cycle / "
                "destroy_process_group under one name, 0-2 ms random sleeps between the calls\n");
    print_recreate_header();
    for (const int world : o.ranks) {
      const RecreateResult r = run_recreate(d, world, o.cycles, rng());
      print_recreate(r);
      if (json.is_open()) json << recreate_json(r) << "\n";
      failures += r.failures();
    }
  }

  const std::vector<std::string> left = shm_entries("stress." + std::to_string(::getpid()) + ".", true);
  if (!left.empty()) {
    std::printf("leak: /dev/shm still holds %s\n", join(left).c_str());
    unlink_entries(left);
    ++failures;
  }
  std::filesystem::remove(d.log_dir, ec);  // only if empty: the logs of failed trials stay
  if (std::filesystem::exists(d.log_dir)) std::printf("logs of the failed runs: %s\n", d.log_dir.string().c_str());
  std::printf("%s\n", failures == 0 ? "stress passed" : "stress FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace stress

int run_stress(int argc, char** argv) {
  if (argc >= 1 && std::string(argv[0]) == "--worker") {
    int code = 64;
    try {
      code = stress::run_worker(stress::parse_worker(argc, argv));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tdshm stress worker: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  stress::Options o;
  try {
    o = stress::parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "tdshm stress: %s\n", e.what());
    print_stress_usage(stderr);
    return 2;
  }
  if (o.help) {
    print_stress_usage(stdout);
    return 0;
  }
  return stress::run_driver(o);
}

}  // namespace tdshm::tools
