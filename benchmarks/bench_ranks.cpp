// Forking and reaping the ranks of one process layout of `tdshm bench` (bench_ranks.h).

#include "bench_ranks.h"

#include <tdshm/process_group.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <new>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace tdshm::bench {

namespace {

using Clock = std::chrono::steady_clock;

// How long the other ranks of a layout get to end on their own once one has failed.
constexpr std::chrono::milliseconds kFailureGrace{std::chrono::seconds(2)};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

class SharedControl {
 public:
  SharedControl() {
    void* p = ::mmap(nullptr, sizeof(Control), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap of the layout's control block");
    control_ = new (p) Control{};
  }
  ~SharedControl() { ::munmap(control_, sizeof(Control)); }
  SharedControl(const SharedControl&) = delete;
  SharedControl& operator=(const SharedControl&) = delete;
  Control& get() const { return *control_; }

 private:
  Control* control_;
};

// SIGINT, SIGTERM or SIGHUP while a layout runs: the coordinator kills and reaps its ranks and
// removes their segment, then ends by the same signal (SignalGuard).
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler may only touch lock-free atomics");
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

extern "C" void note_stop_signal(int sig) { g_stop_signal.store(sig, std::memory_order_relaxed); }

class SignalGuard {
 public:
  SignalGuard() {
    g_stop_signal.store(0, std::memory_order_relaxed);
    struct sigaction action {};
    action.sa_handler = note_stop_signal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &action, &previous_[i]);
  }
  ~SignalGuard() { restore(); }
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;
  /// Puts the previous handlers back (also what a forked rank does first).
  void restore() noexcept {
    if (restored_) return;
    restored_ = true;
    for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &previous_[i], nullptr);
  }
  /// After the cleanup: if a stop signal came, ends this process by it.
  void reraise() noexcept {
    const int sig = g_stop_signal.load(std::memory_order_relaxed);
    if (sig == 0) return;
    restore();
    std::fflush(nullptr);
    ::raise(sig);
  }

 private:
  struct sigaction previous_[std::size(kStopSignals)] {};
  bool restored_ = false;
};

}  // namespace

void Reporter::line(std::string text) const {
  std::replace(text.begin(), text.end(), '\n', ' ');
  if (text.size() > 3000) text.resize(3000);
  text += '\n';
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the coordinator is gone: nothing to tell
    done += static_cast<size_t>(n);
  }
}

Groups make_groups(const std::string& segment, int rank, int world, Control& control) {
  try {
    Groups g;
    ShmOptions shm_options;
    shm_options.timeout = kGroupTimeout;
    // The loan patterns: a worker's two batches (2 x 385 KiB), a learner's 4 MiB of weights.
    shm_options.loan_bytes = size_t{8} << 20;  // (4 batches of 385 KiB)
    g.shm = Group(c10::make_intrusive<ProcessGroupShm>(segment, rank, world, shm_options));

    c10d::TCPStoreOptions store_options;
    store_options.numWorkers = world;
    store_options.waitWorkers = false;
    store_options.timeout = kGroupTimeout;
    c10::intrusive_ptr<c10d::Store> store;
    if (rank == 0) {
      store_options.port = 0;
      store_options.isServer = true;
      auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
      control.gloo_port.store(server->getPort(), std::memory_order_release);
      store = server;
    } else {
      const auto deadline = Clock::now() + kGroupTimeout;
      uint32_t port = 0;
      while ((port = control.gloo_port.load(std::memory_order_acquire)) == 0) {
        if (control.gave_up.load(std::memory_order_acquire) != 0) throw std::runtime_error("another rank gave up");
        if (Clock::now() > deadline) throw std::runtime_error("rank 0's TCPStore did not start within 60 s");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      store_options.port = static_cast<uint16_t>(port);
      store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
    }
    g.gloo = gloo_group_from_store(store, rank, world, kGroupTimeout);
    return g;
  } catch (...) {
    control.gave_up.store(1, std::memory_order_release);
    throw;
  }
}

void barrier(const Group& g) { g.backend().barrier()->wait(); }

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

int allowed_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return static_cast<int>(std::thread::hardware_concurrency());
  return CPU_COUNT(&set);
}

RanksResult run_ranks(const RankJob& job, std::chrono::seconds deadline_after) {
  RanksResult result;
  SharedControl control;
  SignalGuard signals;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::system_error(errno, std::generic_category(), "pipe for the ranks");
  const pid_t coordinator = ::getpid();
  std::vector<pid_t> pids;
  std::fflush(nullptr);
  for (int rank = 0; rank < job.world; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != coordinator) ::_exit(1);
      signals.restore();
      // A peer that died closes its gloo sockets: the next write must fail as an error the rank
      // reports, not end it with SIGPIPE.
      ::signal(SIGPIPE, SIG_IGN);
      ::close(fds[0]);
      const int rc = job.run_rank(rank, control.get(), Reporter(fds[1]));
      std::fflush(nullptr);
      // No atexit handlers or static destructors in a forked copy.
      ::_exit(rc);
    }
    if (pid < 0) {
      result.failures.push_back(std::string("fork of ") + job.rank_name(rank) + ": " + std::strerror(errno));
      break;
    }
    pids.push_back(pid);
  }
  ::close(fds[1]);
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);

  std::vector<int> status(pids.size(), -1);
  std::vector<bool> reaped(pids.size(), false), reported(static_cast<size_t>(job.world), false);
  std::string buffer;
  const auto deadline = Clock::now() + deadline_after;
  std::optional<Clock::time_point> kill_at;
  if (pids.size() != static_cast<size_t>(job.world)) kill_at = Clock::now();
  bool killed = false, timed_out = false;
  auto handle_line = [&](const std::string& line) {
    if (line.rfind("E ", 0) == 0) {
      int rank = -1;
      int consumed = 0;
      if (std::sscanf(line.c_str(), "E %d %n", &rank, &consumed) >= 1 && rank >= 0 && rank < job.world) {
        reported[static_cast<size_t>(rank)] = true;
        result.failures.push_back(job.rank_name(rank) + ": " + line.substr(static_cast<size_t>(consumed)));
        return;
      }
      result.failures.push_back("unreadable report from a rank: " + line);
      return;
    }
    result.reports.push_back(line);
  };
  auto drain = [&] {
    char chunk[4096];
    for (;;) {
      const ssize_t n = ::read(fds[0], chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      buffer.append(chunk, static_cast<size_t>(n));
    }
    for (size_t nl; (nl = buffer.find('\n')) != std::string::npos;) {
      handle_line(buffer.substr(0, nl));
      buffer.erase(0, nl + 1);
    }
  };
  for (;;) {
    pollfd pfd{fds[0], POLLIN, 0};
    ::poll(&pfd, 1, 50);
    drain();
    size_t alive = 0;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (reaped[i]) continue;
      int st = 0;
      const pid_t r = ::waitpid(pids[i], &st, WNOHANG);
      if (r == pids[i]) {
        reaped[i] = true;
        status[i] = st;
        if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0) && !kill_at) kill_at = Clock::now() + kFailureGrace;
      } else {
        ++alive;
      }
    }
    if (alive == 0) break;
    const auto now = Clock::now();
    const bool stopped = g_stop_signal.load(std::memory_order_relaxed) != 0;
    if (!killed && (stopped || now > deadline || (kill_at && now > *kill_at))) {
      timed_out = !stopped && now > deadline;
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!reaped[i]) ::kill(pids[i], SIGKILL);
      }
      killed = true;
    }
  }
  drain();
  ::close(fds[0]);
  if (timed_out) {
    result.failures.push_back("the layout ran past its deadline of " + std::to_string(deadline_after.count()) +
                              " s: every rank was killed");
  }
  // Ranks that ended without a word of their own come first: they are the likely cause of the
  // errors the others reported (a peer gone), unless the coordinator killed them.
  std::vector<std::string> silent, killed_by_us;
  for (size_t i = 0; i < pids.size(); ++i) {
    const int st = status[i];
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
    if (reported[i]) continue;  // its own message says why
    if (killed && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) {
      killed_by_us.push_back(job.rank_name(static_cast<int>(i)) + " was killed by the bench after the failure");
    } else {
      silent.push_back(job.rank_name(static_cast<int>(i)) + " " + describe_status(st));
    }
  }
  result.failures.insert(result.failures.begin(), silent.begin(), silent.end());
  result.failures.insert(result.failures.end(), killed_by_us.begin(), killed_by_us.end());
  // A layout whose ranks died leaves its segment behind; a clean one removed it already.
  try {
    remove_stale_segment(job.segment);
  } catch (const std::exception& e) {
    result.failures.push_back("segment " + job.segment + " left behind: " + e.what());
  }
  signals.reraise();
  return result;
}

}  // namespace tdshm::bench
