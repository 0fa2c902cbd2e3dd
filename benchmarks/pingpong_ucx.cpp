// The "ucx-posix" transport of the ping-pong benchmark (pingpong_ucx.h): one ucx_perftest
// server and one client per round, pinned, their CSV line parsed.

#include "pingpong_ucx.h"

#include "common/loopback_port.h"

#include <sys/wait.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace tdshm::bench::detail {

namespace {

using Clock = std::chrono::steady_clock;

// A run's deadline beyond its own length: 64 MiB rows take seconds, startup ~0.1 s.
constexpr std::chrono::seconds kRunDeadline{120};
// The client cannot connect before the server listens: it is started again for this long.
constexpr std::chrono::seconds kConnectFor{5};

bool executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }


// A child process: spawned with `args` and UCX_TLS=posix,self; its stdout and stderr go to
// `out_fd` (or /dev/null when -1). Killed and reaped if still running when destroyed.
class Child {
 public:
  Child(const std::vector<std::string>& args, int out_fd) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "UCX_TLS=", 8) != 0) env.emplace_back(*e);
    }
    env.emplace_back("UCX_TLS=posix,self");  // UCX's shared-memory transport, as measured against
    std::vector<char*> argv, envp;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    if (out_fd >= 0) {
      posix_spawn_file_actions_adddup2(&actions, out_fd, 1);
      posix_spawn_file_actions_adddup2(&actions, out_fd, 2);
    } else {
      posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
      posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
    }
    const int rc = ::posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw std::runtime_error("cannot start " + args[0] + ": " + std::strerror(rc));
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  /// The wait status once it has exited, or -1 while it runs.
  int poll() {
    if (pid_ <= 0) return status_;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      status_ = status;
    }
    return status_;
  }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
};

// Reads what is in `fd` now (non-blocking).
void drain(int fd, std::string& into) {
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) return;
    into.append(buf, static_cast<size_t>(n));
  }
}

// The values of ucx_perftest -f -v: a header line that starts "iterations," and a line of numbers.
ExternalRound parse_csv(const std::string& output) {
  std::istringstream in(output);
  std::string line, header;
  while (std::getline(in, line)) {
    line.erase(0, line.find_first_not_of(' '));  // it pads the numbers
    if (line.rfind("iterations,", 0) == 0) {
      header = line;
      continue;
    }
    if (header.empty() || line.empty() || !std::isdigit(static_cast<unsigned char>(line[0]))) continue;
    std::istringstream names(header), values(line);
    std::string name, value;
    ExternalRound r{-1, -1};
    while (std::getline(names, name, ',') && std::getline(values, value, ',')) {
      if (name.find("percentile_lat") != std::string::npos) r.p50_us = std::strtod(value.c_str(), nullptr);
      if (name == "avg_lat") r.mean_us = std::strtod(value.c_str(), nullptr);
    }
    if (r.p50_us > 0 && r.mean_us > 0) return r;
  }
  throw std::runtime_error("ucx_perftest printed no latency line; its output: " + output.substr(0, 600));
}

class UcxPingPong final : public PingPong {
 public:
  UcxPingPong(std::string exe, std::vector<int> cpus) : exe_(std::move(exe)), cpus_(std::move(cpus)) {}

  void prepare(const Workload& workload) override {
    if (!workload.name.empty()) throw std::invalid_argument("ucx-posix measures plain messages (the size sweep)");
    bytes_ = workload.bytes;
  }
  void ping() override { throw std::logic_error("ucx-posix is measured by ucx_perftest"); }
  void pong() override { ping(); }
  // ucx_perftest checks nothing it moves; it is measured, not verified.
  bool verify() const override { return true; }
  bool single_process() const override { return true; }
  bool external() const override { return true; }

  ExternalRound external_round(int warmup, int iters) override {
    const int free = tdshm::detail::free_loopback_port();  // for the server's handshake (-p)
    if (free < 0) throw std::runtime_error(std::string("no free TCP port for ucx_perftest: ") + std::strerror(errno));
    const std::string port = std::to_string(free);
    std::vector<std::string> server{exe_, "-p", port};
    std::vector<std::string> client{exe_,  "127.0.0.1", "-p", port, "-t", "tag_lat", "-s", std::to_string(bytes_),
                                    "-n",  std::to_string(iters), "-w", std::to_string(warmup), "-f", "-v"};
    if (cpus_.size() >= 2) {
      server.insert(server.end(), {"-c", std::to_string(cpus_[1])});
      client.insert(client.end(), {"-c", std::to_string(cpus_[0])});
    }
    Child serving(server, -1);
    const auto connect_until = Clock::now() + kConnectFor;
    const auto end = Clock::now() + kRunDeadline;
    for (;;) {
      int pipe_fds[2];
      if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
      std::string output;
      int status = -1;
      {
        Child measuring(client, pipe_fds[1]);
        ::close(pipe_fds[1]);
        ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
        while ((status = measuring.poll()) < 0 && Clock::now() < end) {
          drain(pipe_fds[0], output);
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        drain(pipe_fds[0], output);
      }
      ::close(pipe_fds[0]);
      if (status < 0) throw std::runtime_error("ucx_perftest did not finish within " + std::to_string(kRunDeadline.count()) + " s");
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return parse_csv(output);
      // Most often the server was not listening yet: try again while it runs.
      if (serving.poll() >= 0 || Clock::now() > connect_until) {
        throw std::runtime_error("ucx_perftest failed (wait status " + std::to_string(status) +
                                 "): " + output.substr(0, 600));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

 private:
  std::string exe_;
  std::vector<int> cpus_;
  size_t bytes_ = 0;
};

}  // namespace

std::string find_ucx_perftest() {
  if (const char* set = std::getenv("TDSHM_UCX_PERFTEST"); set != nullptr && *set != '\0') {
    return executable(set) ? set : "";
  }
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/ucx_perftest";
    if (executable(candidate)) return candidate;
  }
  return "";
}

std::unique_ptr<PingPong> make_ucx_pingpong(std::vector<int> cpus) {
  std::string exe = find_ucx_perftest();
  if (exe.empty()) {
    throw std::runtime_error("ucx_perftest not found (Debian: apt-get install ucx-utils; or set TDSHM_UCX_PERFTEST)");
  }
  return std::make_unique<UcxPingPong>(std::move(exe), std::move(cpus));
}

}  // namespace tdshm::bench::detail
