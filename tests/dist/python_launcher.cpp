#include "dist/python_launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

extern char** environ;

namespace tdshm::test {
namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string request_line(const PythonRun& run) {
  std::string line = "{\"script\": " + json_string(run.script) + ", \"log\": " + json_string(run.log) + ", \"args\": [";
  for (size_t i = 0; i < run.args.size(); ++i) line += (i ? ", " : "") + json_string(run.args[i]);
  line += "], \"env\": {";
  bool first = true;
  for (const std::string& kv : run.env) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    line += (first ? "" : ", ") + json_string(kv.substr(0, eq)) + ": " + json_string(kv.substr(eq + 1));
    first = false;
  }
  return line + "}}\n";
}

/// One warm interpreter: its pid, the pipe its requests go into and the pipe its replies come from.
class Zygote {
 public:
  explicit Zygote(const std::string& python) {
    // Ranks the zygote forks are handed to this process when their middle process exits.
    if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
      throw std::runtime_error(std::string("prctl(PR_SET_CHILD_SUBREAPER) failed: ") + std::strerror(errno));
    }
    int to[2], from[2];
    if (::pipe2(to, O_CLOEXEC) != 0 || ::pipe2(from, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    std::string script = std::string(TDSHM_TEST_SCRIPTS_DIR) + "/zygote.py";
    std::vector<std::string> env = environment_with({"OMP_NUM_THREADS=1", "PYTHONDONTWRITEBYTECODE=1"});
    std::vector<char*> argv = {const_cast<char*>(python.c_str()), script.data(), nullptr};
    std::vector<char*> envp;
    for (std::string& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::dup2(to[0], STDIN_FILENO);
      ::dup2(from[1], STDOUT_FILENO);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no warm interpreter outlives the test binary
      ::execve(argv[0], argv.data(), envp.data());
      static const char msg[] = "execve of the python interpreter failed\n";
      (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    ::close(to[0]);
    ::close(from[1]);
    pid_ = pid;
    requests_ = to[1];
    replies_ = from[0];
    std::string ready;
    try {
      ready = read_line(std::chrono::seconds(120));
    } catch (const std::runtime_error& e) {
      ready = e.what();
    }
    if (ready != "ready") {
      stop();
      throw std::runtime_error(python + " " + script + " did not start: " + ready);
    }
  }

  ~Zygote() { stop(); }
  Zygote(const Zygote&) = delete;
  Zygote& operator=(const Zygote&) = delete;

  pid_t spawn(const PythonRun& run) {
    const std::string line = request_line(run);
    size_t off = 0;
    while (off < line.size()) {
      const ssize_t n = ::write(requests_, line.data() + off, line.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw std::runtime_error("the warm interpreter is gone (write failed)");
      off += static_cast<size_t>(n);
    }
    const std::string reply = read_line(std::chrono::seconds(120));
    char* end = nullptr;
    const long pid = std::strtol(reply.c_str(), &end, 10);
    if (reply.empty() || *end != '\0' || pid <= 0) {
      throw std::runtime_error("the warm interpreter could not start " + run.script + ": " + reply);
    }
    return static_cast<pid_t>(pid);
  }

 private:
  /// Closes its input (it exits at end of input) and reaps it, killing it after 2 s.
  void stop() {
    ::close(requests_);
    ::close(replies_);
    int status = 0;
    for (int i = 0; i < 2000; ++i) {
      if (::waitpid(pid_, &status, WNOHANG) != 0) return;
      ::usleep(1000);
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
  }

  /// One reply line, without its newline; throws when none comes within `timeout`.
  std::string read_line(std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) throw std::runtime_error("the warm interpreter did not answer within " + std::to_string(timeout.count()) + " s");
      pollfd p{replies_, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) continue;
      char buf[256];
      const ssize_t n = ::read(replies_, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw std::runtime_error("the warm interpreter exited (see the test's output for its error)");
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }

  pid_t pid_ = -1;
  int requests_ = -1;
  int replies_ = -1;
  std::string buffer_;
};

}  // namespace

std::vector<std::string> environment_with(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    bool overridden = false;
    for (const std::string& o : overrides) {
      const size_t eq = o.find('=');
      overridden = overridden || kv.compare(0, eq + 1, o, 0, eq + 1) == 0;
    }
    if (!overridden) env.push_back(kv);
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

Child start_python(const std::string& python, const PythonRun& run) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Zygote>> zygotes;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<Zygote>& z = zygotes[python];
  if (!z) z = std::make_unique<Zygote>(python);
  return Child::adopt(z->spawn(run));
}

}  // namespace tdshm::test
