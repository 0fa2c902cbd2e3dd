// Simulated hosts (sim_hosts.h): a host process enters its namespaces, then forks an "init"
// (pid 1 of a new PID namespace, so that no rank's exit ends the namespace) that forks the ranks
// and waits for them. Failures travel to the parent as lines on one pipe every process inherits.

#include "sim_hosts.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

namespace tdshm::sim {

namespace {

/// One line to the parent (a write of at most PIPE_BUF bytes is not interleaved with others).
void report(int fd, std::string line) {
  if (line.size() > 4000) line.resize(4000);
  line.push_back('\n');
  (void)!::write(fd, line.data(), line.size());
}

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

/// Enters the namespaces of `view`; an error message, or empty.
std::string enter(HostView view) {
  if (view == HostView::kOwnShm) {
    if (::unshare(CLONE_NEWNS | CLONE_NEWUTS) != 0) return errno_text("unshare(CLONE_NEWNS | CLONE_NEWUTS)");
    // Mounts made here must not propagate back to the real /dev/shm.
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return errno_text("mount --make-rprivate /");
    if (::mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=512m,mode=1777") != 0) {
      return errno_text("mount tmpfs on /dev/shm");
    }
    if (::sethostname("node", 4) != 0) return errno_text("sethostname");
  } else if (view == HostView::kOwnPid) {
    if (::unshare(CLONE_NEWPID) != 0) return errno_text("unshare(CLONE_NEWPID)");  // for the children
  }
  return {};
}

/// What a host leaves in its private /dev/shm.
std::vector<std::string> left_in_dev_shm() {
  std::vector<std::string> out;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return {"(cannot list /dev/shm)"};
  while (const dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, "tdshm", 5) == 0 || std::strncmp(e->d_name, "pg-", 3) == 0) out.emplace_back(e->d_name);
  }
  ::closedir(dir);
  return out;
}

[[noreturn]] void run_rank(int rank, const std::function<void(int)>& body, int fd) {
  try {
    body(rank);
    ::_exit(0);
  } catch (const std::exception& e) {
    report(fd, "rank " + std::to_string(rank) + ": " + e.what());
  } catch (...) {
    report(fd, "rank " + std::to_string(rank) + ": threw a non-std exception");
  }
  ::_exit(1);
}

/// The host's init: forks the ranks, waits for them, checks what they left.
[[noreturn]] void run_init(size_t index, const SimHost& host, const std::function<void(int)>& body, int fd) {
  std::vector<pid_t> ranks;
  for (int rank : host.ranks) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      report(fd, "host " + std::to_string(index) + ": " + errno_text("fork"));
      ::_exit(1);
    }
    if (pid == 0) run_rank(rank, body, fd);
    ranks.push_back(pid);
  }
  bool failed = false;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int status = 0;
    while (::waitpid(ranks[i], &status, 0) < 0 && errno == EINTR) {
    }
    if (WIFSIGNALED(status)) {
      report(fd, "rank " + std::to_string(host.ranks[i]) + " was killed by signal " + std::to_string(WTERMSIG(status)));
    }
    failed |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (host.view == HostView::kOwnShm) {
    for (const std::string& name : left_in_dev_shm()) {
      report(fd, "host " + std::to_string(index) + ": '" + name + "' was left in its /dev/shm");
      failed = true;
    }
  }
  ::_exit(failed ? 1 : 0);
}

[[noreturn]] void run_host(size_t index, const SimHost& host, const std::function<void(int)>& body, int fd) {
  ::setpgid(0, 0);  // the parent kills the whole host at its deadline
  if (const std::string error = enter(host.view); !error.empty()) {
    report(fd, "host " + std::to_string(index) + ": " + error);
    ::_exit(1);
  }
  const pid_t init = ::fork();
  if (init < 0) {
    report(fd, "host " + std::to_string(index) + ": " + errno_text("fork"));
    ::_exit(1);
  }
  if (init == 0) run_init(index, host, body, fd);
  int status = 0;
  while (::waitpid(init, &status, 0) < 0 && errno == EINTR) {
  }
  ::_exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

}  // namespace

std::optional<std::string> sim_hosts_unavailable() {
  if (::geteuid() != 0) return "simulated hosts need root (unshare, mount)";
  int fds[2];
  if (::pipe(fds) != 0) return errno_text("pipe");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string error = enter(HostView::kOwnShm);
    if (error.empty()) error = enter(HostView::kOwnPid);
    if (!error.empty()) report(fds[1], error);
    ::_exit(error.empty() ? 0 : 1);
  }
  ::close(fds[1]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  char buf[512] = {};
  const ssize_t n = ::read(fds[0], buf, sizeof buf - 1);
  ::close(fds[0]);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return std::nullopt;
  return "simulated hosts cannot be made here: " + std::string(buf, n > 0 ? static_cast<size_t>(n) : 0);
}

std::vector<std::string> run_sim_hosts(const std::vector<SimHost>& hosts, const std::function<void(int)>& body,
                                       std::chrono::seconds deadline) {
  int fds[2];
  if (::pipe(fds) != 0) return {errno_text("pipe")};
  std::vector<pid_t> pids;
  for (size_t h = 0; h < hosts.size(); ++h) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      run_host(h, hosts[h], body, fds[1]);
    }
    if (pid > 0) pids.push_back(pid);
  }
  ::close(fds[1]);
  std::vector<std::string> failures;
  const auto until = std::chrono::steady_clock::now() + deadline;
  std::vector<bool> done(pids.size(), false);
  for (size_t left = pids.size(); left > 0;) {
    for (size_t h = 0; h < pids.size(); ++h) {
      if (done[h]) continue;
      int status = 0;
      if (::waitpid(pids[h], &status, WNOHANG) == pids[h]) {
        done[h] = true;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() >= until) {
      for (size_t h = 0; h < pids.size(); ++h) {
        if (done[h]) continue;
        ::killpg(pids[h], SIGKILL);
        ::waitpid(pids[h], nullptr, 0);
        failures.push_back("host " + std::to_string(h) + " overstayed the deadline of " +
                           std::to_string(deadline.count()) + " s and was killed");
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Every writer is gone (a killed host's ranks with it): read to the end.
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) failures.push_back(line);
  return failures;
}

}  // namespace tdshm::sim
