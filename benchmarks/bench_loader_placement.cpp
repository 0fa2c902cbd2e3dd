// Where the data loader's time goes on a machine with fewer cores than processes: the loader of
// `tdshm bench --scenario loader` over shm (N workers send per-leaf batches to one main rank),
// run twice per round, side by side:
//
//   free         every rank where the kernel puts it (what the scenario measures)
//   main-pinned  the main rank alone on the first allowed CPU, the workers on the others
//
// On the 2-CPU development machine the main rank does most of the copying (one copy out of the
// arena per byte) and the workers are ahead of it, room-blocked in the arena, almost all the
// time; unpinned, the kernel still puts workers on main's CPU, and main loses it to them. The
// ratio main-pinned / free tells how much of the loader's throughput that costs: placement is
// the application's choice (taskset, os.sched_setaffinity), tdshm never changes a process's
// affinity.
//
//   build/benchmarks/tdshm_bench_loader_placement [--workers N] [--batches B] [--rounds R]
//                                                  [--pattern blocking|irecv-ahead]
//
// The coordinator (this process) never touches LibTorch: it forks every rank of every run afresh
// and reaps it; a rank that fails reports on stderr and exits non-zero, and every wait has the
// group's 60 s deadline.

#include <tdshm/distributed.h>
#include <tdshm/process_group.h>
#include <tdshm/tensordict.h>

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kBatch = 32;

struct Options {
  int workers = 4;
  int batches = 20000;
  int rounds = 4;
  bool irecv_ahead = true;
};

tdshm::TensorDict make_batch() {
  return tdshm::TensorDict({{"image", at::zeros({kBatch, 3, 64, 64}, at::kByte)},
                            {"label", at::zeros({kBatch}, at::kLong)},
                            {{"meta", "idx"}, at::zeros({kBatch}, at::kLong)},
                            {{"meta", "worker"}, at::zeros({kBatch}, at::kLong)}},
                           {kBatch});
}

void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (::sched_setaffinity(0, sizeof set, &set) != 0) throw std::runtime_error(std::string("sched_setaffinity: ") + std::strerror(errno));
}

// Rank `rank` of one run; main (rank 0) stores its batches/s in *result. Throws on a wrong batch.
void run_rank(const Options& o, const std::string& segment, int rank, const std::vector<int>& cpus, bool pinned,
              double* result) {
  if (pinned) {
    if (rank == 0) {
      pin_to(cpus[0]);
    } else {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (size_t i = 1; i < cpus.size(); ++i) CPU_SET(cpus[i], &set);
      if (::sched_setaffinity(0, sizeof set, &set) != 0) throw std::runtime_error("sched_setaffinity failed");
    }
  }
  at::set_num_threads(1);
  tdshm::ShmOptions shm_options;
  shm_options.timeout = std::chrono::seconds(60);
  tdshm::Group g(c10::make_intrusive<tdshm::ProcessGroupShm>(segment, rank, o.workers + 1, shm_options));
  const int warm = std::max(10, o.batches / 10);
  if (rank != 0) {
    tdshm::TensorDict b = make_batch();
    auto* worker = b.get({"meta", "worker"}).data_ptr<int64_t>();
    for (int64_t k = 0; k < kBatch; ++k) worker[k] = rank;
    for (int i = 0; i < warm + o.batches; ++i) {
      b.get("image").data_ptr<uint8_t>()[0] = static_cast<uint8_t>(i);
      b.get("label").data_ptr<int64_t>()[0] = i;
      b.send({.group = g, .group_dst = 0});
    }
    g.backend().barrier()->wait();
    return;
  }
  std::vector<tdshm::TensorDict> into;
  for (int w = 0; w <= o.workers; ++w) into.push_back(make_batch());
  std::vector<tdshm::Transfer> pending(static_cast<size_t>(o.workers) + 1);
  Clock::time_point start;
  for (int i = 0; i < warm + o.batches; ++i) {
    if (i == warm) start = Clock::now();
    if (o.irecv_ahead) {
      for (int w = 1; w <= o.workers; ++w) pending[w] = into[w].irecv({.group = g, .group_src = w, .return_premature = true});
    }
    for (int w = 1; w <= o.workers; ++w) {
      if (o.irecv_ahead) {
        pending[w].wait();
      } else {
        into[w].recv({.group = g, .group_src = w});
      }
      if (into[w].get("label").data_ptr<int64_t>()[0] != i ||
          into[w].get("image").data_ptr<uint8_t>()[0] != static_cast<uint8_t>(i) ||
          into[w].get({"meta", "worker"}).data_ptr<int64_t>()[kBatch - 1] != w) {
        throw std::runtime_error("batch " + std::to_string(i) + " of worker " + std::to_string(w) + " holds wrong values");
      }
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  *result = static_cast<double>(o.workers) * o.batches / seconds;
  g.backend().barrier()->wait();
}

// One run: forks every rank, reaps them all; batches/s of main, or a negative value on failure.
double run_once(const Options& o, const std::vector<int>& cpus, bool pinned, int index) {
  auto* result = static_cast<double*>(::mmap(nullptr, sizeof(double), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (result == MAP_FAILED) throw std::runtime_error("mmap failed");
  *result = -1;
  const std::string segment = "tdshm-placement-" + std::to_string(::getpid()) + "-" + std::to_string(index);
  std::vector<pid_t> children;
  for (int rank = 0; rank <= o.workers; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      try {
        run_rank(o, segment, rank, cpus, pinned, result);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        ::_exit(1);
      }
      ::_exit(0);
    }
    children.push_back(pid);
  }
  bool ok = true;
  for (const pid_t pid : children) {
    int status = 0;
    if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ok = false;
      for (const pid_t other : children) ::kill(other, SIGKILL);  // the others would wait for it
    }
  }
  tdshm::remove_stale_segment(segment);  // left behind only when a rank failed
  const double value = ok ? *result : -1;
  ::munmap(result, sizeof(double));
  return value;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto number = [&](int lo, int hi) {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      const int v = std::atoi(argv[++i]);
      if (v < lo || v > hi) throw std::invalid_argument(arg + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
      return v;
    };
    if (arg == "--workers") {
      o.workers = number(1, 64);
    } else if (arg == "--batches") {
      o.batches = number(1, 10000000);
    } else if (arg == "--rounds") {
      o.rounds = number(1, 1000);
    } else if (arg == "--pattern" && i + 1 < argc) {
      const std::string p = argv[++i];
      if (p != "blocking" && p != "irecv-ahead") throw std::invalid_argument("--pattern is blocking or irecv-ahead");
      o.irecv_ahead = p == "irecv-ahead";
    } else {
      throw std::invalid_argument("unknown argument '" + arg + "' (--workers N --batches B --rounds R --pattern P)");
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    parse(argc, argv, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdshm_bench_loader_placement: %s\n", e.what());
    return 2;
  }
  cpu_set_t allowed;
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    }
  }
  if (cpus.size() < 2) {
    std::printf("only %zu CPU allowed: nothing to place\n", cpus.size());
    return 0;
  }
  std::printf("loader over shm, %d workers, %s, %d batches per worker per run; %zu CPUs allowed; main-pinned: "
              "main on CPU %d, workers on the other %zu\n",
              o.workers, o.irecv_ahead ? "irecv-ahead" : "blocking", o.batches, cpus.size(), cpus[0], cpus.size() - 1);
  std::vector<double> free_runs, pinned_runs;
  int index = 0;
  for (int r = 0; r < o.rounds; ++r) {
    // The order alternates, so that neither always runs first.
    for (const bool pinned : r % 2 == 0 ? std::vector<bool>{false, true} : std::vector<bool>{true, false}) {
      const double v = run_once(o, cpus, pinned, index++);
      if (v < 0) {
        std::fprintf(stderr, "round %d (%s) failed\n", r + 1, pinned ? "main-pinned" : "free");
        return 1;
      }
      (pinned ? pinned_runs : free_runs).push_back(v);
      std::printf("round %d  %-12s %10.0f batches/s\n", r + 1, pinned ? "main-pinned" : "free", v);
      std::fflush(stdout);
    }
  }
  const auto [fmin, fmax] = std::minmax_element(free_runs.begin(), free_runs.end());
  const auto [pmin, pmax] = std::minmax_element(pinned_runs.begin(), pinned_runs.end());
  std::printf("free         median %10.0f  [%.0f-%.0f]\nmain-pinned  median %10.0f  [%.0f-%.0f]\n"
              "main-pinned / free: %.2fx\n",
              median(free_runs), *fmin, *fmax, median(pinned_runs), *pmin, *pmax, median(pinned_runs) / median(free_runs));
  return 0;
}
