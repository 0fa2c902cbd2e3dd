// The driver's side of the worker processes of `tdshm stress`: starting one (fork, then exec of
// this tool in its worker mode, or fork alone with --spawn fork) with its report pipe on fd 3 and
// its GO pipe on fd 0, reading the event lines it reports, reaping it, killing it when it hangs.

#include "stress_internal.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace tdshm::tools::stress {
namespace {

bool all_reaped(const std::vector<Proc>& ps) {
  return std::all_of(ps.begin(), ps.end(), [](const Proc& p) { return p.reaped; });
}

}  // namespace

Proc& Proc::operator=(Proc&& o) noexcept {
  if (this != &o) {
    release();
    rank = o.rank;
    pid = std::exchange(o.pid, -1);
    report_fd = std::exchange(o.report_fd, -1);
    ctl_fd = std::exchange(o.ctl_fd, -1);
    log = std::move(o.log);
    partial = std::move(o.partial);
    events = std::move(o.events);
    eof = o.eof;
    reaped = o.reaped;
    status = o.status;
    may_reap = o.may_reap;
    hang = o.hang;
  }
  return *this;
}

void Proc::release() noexcept {
  if (pid > 0 && !reaped) {
    ::kill(pid, SIGKILL);
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    reaped = true;
  }
  if (report_fd >= 0) ::close(report_fd);
  if (ctl_fd >= 0) ::close(ctl_fd);
  report_fd = ctl_fd = -1;
  pid = -1;
}

void Proc::read_some() {
  if (eof || report_fd < 0) return;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(report_fd, buf, sizeof buf);
    if (n > 0) {
      partial.append(buf, static_cast<size_t>(n));
      size_t pos = 0;
      while ((pos = partial.find('\n')) != std::string::npos) {
        events.push_back(parse_event(partial.substr(0, pos)));
        partial.erase(0, pos + 1);
      }
      continue;
    }
    if (n == 0) {
      eof = true;
      return;
    }
    if (errno == EINTR) continue;
    return;  // EAGAIN: nothing more for now
  }
}

bool Proc::try_reap() {
  if (reaped) return true;
  int st = 0;
  if (::waitpid(pid, &st, WNOHANG) == pid) {
    reaped = true;
    status = st;
  }
  return reaped;
}

void Proc::reap_blocking() {
  if (reaped) return;
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0) {
    if (errno != EINTR) return;
  }
  reaped = true;
  status = st;
}

bool Proc::exited_unreaped() const {
  siginfo_t si{};
  if (::waitid(P_PID, static_cast<id_t>(pid), &si, WEXITED | WNOHANG | WNOWAIT) != 0) return false;
  return si.si_pid == pid;
}

void Proc::go() {
  const char c = 'g';
  while (::write(ctl_fd, &c, 1) < 0 && errno == EINTR) {
  }
}

const Event* Proc::find(const std::string& tag) const {
  for (const Event& e : events) {
    if (e.tag == tag) return &e;
  }
  return nullptr;
}

std::string Proc::last_phase() const {
  std::string p = "(none reported)";
  for (const Event& e : events) {
    if (e.tag == "PHASE") p = e.text;
  }
  return p;
}

std::string Proc::describe_exit() const {
  if (!reaped) return "not reaped";
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with " + std::to_string(WEXITSTATUS(status));
}

Proc Driver::spawn(const WorkerSpec& w, const std::string& log_name) const {
  Proc p;
  p.rank = w.rank;
  p.log = (log_dir / log_name).string();
  int rep[2] = {-1, -1}, ctl[2] = {-1, -1};
  if (::pipe2(rep, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  if (::pipe2(ctl, O_CLOEXEC) != 0) {
    ::close(rep[0]);
    ::close(rep[1]);
    throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  }
  const int log_fd = ::open(p.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  std::vector<std::string> args = {exe,          "stress",       "--worker",
                                   w.mode,       "--scenario",   w.scenario.empty() ? "-" : w.scenario,
                                   "--rank",     std::to_string(w.rank),
                                   "--world",    std::to_string(w.world),
                                   "--name",     w.name,
                                   "--seed",     std::to_string(w.seed),
                                   "--cycles",   std::to_string(w.cycles)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    for (const int fd : {rep[0], rep[1], ctl[0], ctl[1], log_fd}) {
      if (fd >= 0) ::close(fd);
    }
    throw std::runtime_error(std::string("fork: ") + std::strerror(err));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no orphan if the driver dies
    if (::getppid() != parent) ::_exit(120);
    // fds 0-2 are open in the driver, so every pipe end is >= 3; fd 3 is set last.
    if (::dup2(ctl[0], 0) < 0) ::_exit(121);
    if (log_fd >= 0 && (::dup2(log_fd, 1) < 0 || ::dup2(log_fd, 2) < 0)) ::_exit(121);
    if (rep[1] == kReportFd) {
      ::fcntl(kReportFd, F_SETFD, 0);
    } else if (::dup2(rep[1], kReportFd) < 0) {
      ::_exit(121);
    }
    if (fork_only) {
      if (::close_range(kReportFd + 1, ~0U, 0) != 0) {
        for (int fd = kReportFd + 1; fd < 1024; ++fd) ::close(fd);
      }
      ::_exit(run_worker(w));
    }
    // The driver's own binary, even if a rebuild has replaced the file since it started.
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  ::close(rep[1]);
  ::close(ctl[0]);
  if (log_fd >= 0) ::close(log_fd);
  p.pid = pid;
  p.report_fd = rep[0];
  p.ctl_fd = ctl[1];
  ::fcntl(p.report_fd, F_SETFL, O_NONBLOCK);
  return p;
}

bool pump(std::vector<Proc>& ps, int64_t deadline, const std::function<bool()>& until) {
  for (;;) {
    for (Proc& p : ps) {
      p.read_some();
      if (p.may_reap && !p.reaped && p.try_reap()) p.read_some();
    }
    if (until()) return true;
    const int64_t left = deadline - now_ns();
    if (left <= 0) return false;
    std::vector<pollfd> fds;
    for (const Proc& p : ps) {
      if (!p.eof && p.report_fd >= 0) fds.push_back({p.report_fd, POLLIN, 0});
    }
    const int64_t wait = std::min<int64_t>(left, 2'000'000);  // reaping has no fd to poll on
    const timespec ts{static_cast<time_t>(wait / 1'000'000'000), static_cast<long>(wait % 1'000'000'000)};
    if (fds.empty()) {
      ::nanosleep(&ts, nullptr);
    } else {
      ::ppoll(fds.data(), fds.size(), &ts, nullptr);
    }
  }
}

void finish_all(std::vector<Proc>& ps, int64_t deadline) {
  for (Proc& p : ps) p.may_reap = true;
  pump(ps, deadline, [&] { return all_reaped(ps); });
  for (Proc& p : ps) {
    if (!p.reaped) {
      p.hang = true;
      ::kill(p.pid, SIGKILL);
      p.reap_blocking();
    }
  }
  pump(ps, now_ns() + 2'000'000'000, [&] {
    return std::all_of(ps.begin(), ps.end(), [](const Proc& p) { return p.eof; });
  });
}

}  // namespace tdshm::tools::stress
