// What a receiver opens for a file a peer named (peer_file.h).

#include "memmap/peer_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace tdshm::detail {

namespace {

class PeerFd {
 public:
  explicit PeerFd(int fd) noexcept : fd_(fd) {}
  PeerFd(const PeerFd&) = delete;
  PeerFd& operator=(const PeerFd&) = delete;
  ~PeerFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const noexcept { return fd_; }
  int release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

const char* file_kind(mode_t mode) noexcept {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// The components of `path` ('.' and '..' refused, empty ones from "//" skipped); false with
// `problem` set when it names no file that way.
bool split_peer_path(const std::string& path, std::vector<std::string>& parts, std::string& problem) {
  if (path.empty() || path.front() != '/') {
    problem = "the path is not absolute";
    return false;
  }
  if (path.find('\0') != std::string::npos) {
    problem = "the path holds a NUL byte";
    return false;
  }
  for (size_t at = 1; at <= path.size();) {
    const size_t end = std::min(path.find('/', at), path.size());
    std::string part = path.substr(at, end - at);
    if (part == "." || part == "..") {
      problem = "the path has '.' or '..' parts";
      return false;
    }
    if (!part.empty()) parts.push_back(std::move(part));
    at = end + 1;
  }
  if (parts.empty()) {
    problem = "the path names no file";
    return false;
  }
  return true;
}

// The directory that holds the last of `parts`, walked from '/' one component at a time, no link
// followed (an O_PATH descriptor), or -1 with `problem` set.
int open_peer_dir(const std::vector<std::string>& parts, std::string& problem) {
  PeerFd dir(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0) {
    problem = std::string("cannot open '/': ") + std::strerror(errno);
    return -1;
  }
  std::string walked;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    walked += "/" + parts[i];
    // O_PATH | O_NOFOLLOW opens a link itself rather than its target: fstat tells.
    const int next = ::openat(dir.get(), parts[i].c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) {
      problem = "cannot open its directory '" + walked + "': " + std::strerror(errno);
      return -1;
    }
    dir.reset(next);
    struct stat st {};
    if (::fstat(dir.get(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      problem = "its directory '" + walked + "' is " + (S_ISLNK(st.st_mode) ? "a symbolic link" : "not a directory");
      return -1;
    }
  }
  return dir.release();
}

}  // namespace

int open_peer_file(const std::string& path, bool writable, std::string& problem) noexcept {
  try {
    std::vector<std::string> parts;
    if (!split_peer_path(path, parts, problem)) return -1;
    PeerFd dir(open_peer_dir(parts, problem));
    if (dir.get() < 0) return -1;
    // Refused from its lstat before it is opened: opening a FIFO or a device may block or act.
    const std::string& name = parts.back();
    struct stat before {};
    if (::fstatat(dir.get(), name.c_str(), &before, AT_SYMLINK_NOFOLLOW) != 0) {
      problem = std::string("cannot open it: ") + std::strerror(errno);
      return -1;
    }
    if (!S_ISREG(before.st_mode)) {
      problem = std::string("it is ") + file_kind(before.st_mode) + ", not a regular file";
      return -1;
    }
    if (before.st_uid != ::geteuid()) {
      problem = "it is owned by uid " + std::to_string(before.st_uid) + ", not by this process's user (uid " +
                std::to_string(::geteuid()) + ")";
      return -1;
    }
    PeerFd fd(::openat(dir.get(), name.c_str(),
                       (writable ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    if (fd.get() < 0) {
      problem = std::string("cannot open it") + (writable ? " for writing: " : ": ") + std::strerror(errno);
      return -1;
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0 || st.st_dev != before.st_dev || st.st_ino != before.st_ino ||
        !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
      problem = "it was replaced while it was opened";
      return -1;
    }
    return fd.release();
  } catch (const std::exception& e) {  // (allocation)
    problem = e.what();
    return -1;
  }
}

std::string peer_path(const std::string& path) {
  std::unique_ptr<char, decltype(&std::free)> real(::realpath(path.c_str(), nullptr), &std::free);
  return real ? std::string(real.get()) : path;
}

}  // namespace tdshm::detail
