// The two processes of the ping-pong benchmark (pingpong_processes.h): the shared mapping made
// before fork, CPU pinning, rank 0's SIGCHLD reaper of rank 1, and the run's segments removed
// when a stop signal ends rank 0.

#include "pingpong_processes.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace tdshm::bench::detail {

namespace {

using Clock = std::chrono::steady_clock;

// ---- the child's end ----

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

// ---- the run's segments, removed on a stop signal ----

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

}  // namespace

// ---- the CPUs ----

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

// ---- the shared mapping ----

SharedMapping::SharedMapping(size_t bytes) : bytes_(bytes) {
  data_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (data_ == MAP_FAILED) {
    throw std::system_error(errno, std::generic_category(),
                            "mmap of " + std::to_string(bytes) + " shared bytes for the benchmark");
  }
}

SharedMapping::~SharedMapping() { ::munmap(data_, bytes_); }

// ---- ChildReaper ----

ChildReaper::ChildReaper() {
  struct sigaction action {};
  action.sa_handler = reap_child_on_sigchld;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  g_child_status.store(-1, std::memory_order_relaxed);
  if (::sigaction(SIGCHLD, &action, &previous_) != 0) {
    throw std::system_error(errno, std::generic_category(), "sigaction(SIGCHLD) for the benchmark's peer");
  }
}

void ChildReaper::watch(pid_t child) {
  g_child.store(child, std::memory_order_release);
  reap_child_on_sigchld(SIGCHLD);  // in case it ended before the store
}

void ChildReaper::restore() noexcept {
  if (!restored_) ::sigaction(SIGCHLD, &previous_, nullptr);
  restored_ = true;
  g_child.store(0, std::memory_order_release);
}

int ChildReaper::reap(pid_t child, std::chrono::milliseconds grace) const {
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

const std::atomic<int>* ChildReaper::child_status() noexcept { return &g_child_status; }

// ---- SegmentsRemovedOnSignal ----

SegmentsRemovedOnSignal::SegmentsRemovedOnSignal(const std::vector<std::string>& names) {
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

SegmentsRemovedOnSignal::~SegmentsRemovedOnSignal() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    if (installed_[i]) ::sigaction(kStopSignals[i], &g_stop_previous[i], nullptr);
  }
  g_cleanup_count.store(0, std::memory_order_release);
}

}  // namespace tdshm::bench::detail
