// Process identity from /proc: pid, start time and PID namespace, and whether a process runs.

#include "shm/parts/process_identity.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tdshm::shm {

namespace {

// Plain open/read and hand parsing, no iostreams: they take the locale's locks, which a child
// forked from a multi-threaded program (a data loader's worker) may find held forever.
uint64_t read_start_time(uint32_t pid) {
  char path[32];
  std::snprintf(path, sizeof path, "/proc/%u/stat", pid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[1024];
  size_t len = 0;
  for (ssize_t n; len < sizeof buf - 1 && (n = ::read(fd, buf + len, sizeof buf - 1 - len)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    len += static_cast<size_t>(n);
  }
  ::close(fd);
  buf[len] = '\0';
  // Field 2 (comm) may hold spaces and parentheses: fields resume after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return 0;
  ++p;
  for (int field = 3; field <= 22; ++field) {
    while (*p == ' ') ++p;
    if (*p == '\0') return 0;
    // Field 3 is the state: a zombie (Z) or dead (X) process has exited, though its parent has
    // not reaped it yet; it counts as gone.
    if (field == 3 && (*p == 'Z' || *p == 'X')) return 0;
    if (field == 22) return std::strtoull(p, nullptr, 10);
    while (*p != ' ' && *p != '\0') ++p;
  }
  return 0;
}

// The inode of this process's PID namespace (the same for all its threads; a fork keeps it), 0 if
// /proc does not say.
uint32_t read_pid_namespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint32_t>(st.st_ino);  // namespace inodes are 32-bit (proc_inum)
}

}  // namespace

ProcessId self_process() {
  static const ProcessId id{static_cast<uint32_t>(::getpid()), read_start_time(static_cast<uint32_t>(::getpid())),
                            read_pid_namespace()};
  // A forked child has another pid, and may be in another PID namespace (its parent unshared
  // one): recompute then.
  if (id.pid != static_cast<uint32_t>(::getpid())) {
    return {static_cast<uint32_t>(::getpid()), read_start_time(static_cast<uint32_t>(::getpid())),
            read_pid_namespace()};
  }
  return id;
}

bool foreign_pid_namespace(const ProcessId& id) {
  const uint32_t mine = self_process().pid_ns;
  return id.pid_ns != 0 && mine != 0 && id.pid_ns != mine;
}

bool process_alive(const ProcessId& id) {
  if (foreign_pid_namespace(id)) return true;  // cannot be checked from here: never taken for dead
  if (id.pid == 0) return false;
  if (::kill(static_cast<pid_t>(id.pid), 0) != 0 && errno == ESRCH) return false;
  const uint64_t start = read_start_time(id.pid);
  if (start == 0) return false;  // gone between the two checks, or a zombie being reaped
  return start == id.start_time;
}

bool alive_or_self(const ProcessId& id) {
  if (id.pid == self_process().pid && !foreign_pid_namespace(id)) return true;
  return process_alive(id);
}

}  // namespace tdshm::shm
