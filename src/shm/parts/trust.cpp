// The files in /dev/shm and their checks: paths, segment names, opening without following
// links, and the owner and mode a file must have to be trusted (see the trust model in trust.h).

#include "shm/parts/trust.h"

#include <tdshm/process_group.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace tdshm {

void validate_segment_name(const std::string& name) {
  if (name.empty() || name.size() > 200) {
    throw SegmentError("segment name '" + name + "' must have 1 to 200 characters");
  }
  for (char c : name) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) {
      throw SegmentError("segment name '" + name + "' may only contain letters, digits, '.', '_' and '-'");
    }
  }
}

namespace shm {

namespace {

std::string uid_str(uid_t uid) { return std::to_string(static_cast<unsigned long>(uid)); }

}  // namespace

std::string segment_path(const std::string& name) { return std::string(kSegmentDir) + "/" + kSegmentFilePrefix + name; }
std::string lock_path(const std::string& name) { return segment_path(name) + ".lock"; }

SegmentError open_error(const std::string& path, const std::string& what, int err) {
  struct stat st {};
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  // (With fs.protected_symlinks, opening another user's link in /dev/shm fails with EACCES.)
  if (err == ELOOP || (exists && S_ISLNK(st.st_mode))) {
    const std::string owner = exists && st.st_uid != ::geteuid() ? " owned by uid " + uid_str(st.st_uid) : "";
    return SegmentError("the " + what + " '" + path + "' is a symbolic link" + owner +
                        "; tdshm never follows links there (someone may be redirecting it): remove the link, or use "
                        "another segment name");
  }
  if ((err == EACCES || err == EPERM) && exists && st.st_uid != ::geteuid()) {
    return SegmentError("the " + what + " '" + path + "' belongs to uid " + uid_str(st.st_uid) +
                        ", not to this process's uid " + uid_str(::geteuid()) +
                        ": refusing another user's file; remove it or use another segment name");
  }
  if (err == ENOSPC || err == EROFS || err == ENOENT) {
    return SegmentError("cannot create the " + what + " '" + path + "': " + std::strerror(err) + " (is " + kSegmentDir +
                        " a writable tmpfs?)");
  }
  return SegmentError("cannot open the " + what + " '" + path + "': " + std::strerror(err));
}

void check_owned(int fd, const std::string& path, const std::string& what, struct stat* out) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw SegmentError("cannot stat the " + what + " '" + path + "': " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {
    throw SegmentError("the " + what + " '" + path +
                       "' is not a regular file; refusing it: remove it or use another segment name");
  }
  if (st.st_uid != ::geteuid()) {
    throw SegmentError("the " + what + " '" + path + "' is owned by uid " + uid_str(st.st_uid) +
                       ", not by this process's uid " + uid_str(::geteuid()) +
                       ": refusing another user's file (it could read or forge this group's data); remove it or "
                       "use another segment name");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw SegmentError("the " + what + " '" + path + "' has mode " + mode +
                       ": group/other permission bits would let other users read or write it, and tdshm "
                       "creates its files 0600; refusing it: remove it or use another segment name");
  }
  if (out != nullptr) *out = st;
}

int open_segment(const std::string& name, struct stat& st) {
  const std::string path = segment_path(name);
  const int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return -1;
    throw open_error(path, "segment", errno);
  }
  try {
    check_owned(fd, path, "segment", &st);
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

}  // namespace shm
}  // namespace tdshm
