// `tdshm gc` for boards (board_gc.h): a board whose writer is gone and that no live reader has open.

#include "board/board_gc.h"

#include "board/board_state.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

namespace tdshm::detail {
namespace {

constexpr const char* kBoardPrefix = "tdshm-board.";

// A writer holds its new board's lock from the moment it made the file (O_EXCL, then flock:
// microseconds apart) until the header is ready; one killed meanwhile leaves a file with no ready
// header (up to the size of its buffers) that nobody opens. Such a file is left over when its lock
// is free and it has not changed for this long.
constexpr time_t kUnfinishedAge = 5;

// Why the unfinished board open at `fd` is kept, or "" when its creator is gone. `locked`: this
// process holds the file's lock.
std::string unfinished_in_use(int fd, const struct stat& st, bool locked) {
  if (!locked) {
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) return "being created (its writer holds the lock)";
    (void)::flock(fd, LOCK_UN);
  }
  if (std::time(nullptr) - st.st_mtime < kUnfinishedAge) return "being created (changed in the last seconds)";
  return "";
}

// Why the board open at `fd` (checked as this user's, 0600) is in use, or "" when its writer is
// gone and no reader runs, or it is a board whose writer died before its header was ready. Read
// through a read-only mapping of its header and reader slots.
std::string in_use(int fd, const struct stat& st, bool locked) {
  const uint64_t table = kHeaderBytes + uint64_t{kMaxReaders} * sizeof(ReaderSlot);
  const size_t bytes = static_cast<size_t>(std::min<uint64_t>(table, static_cast<uint64_t>(st.st_size)));
  if (bytes < kHeaderBytes) return unfinished_in_use(fd, st, locked);
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return std::string("cannot map it: ") + std::strerror(errno);
  std::string why;
  const auto& h = *static_cast<const BoardHeader*>(p);
  if (h.ready.load(std::memory_order_acquire) != 1 && (h.magic == 0 || h.magic == kBoardMagic)) {
    why = unfinished_in_use(fd, st, locked);
  } else if (h.magic != kBoardMagic || h.layout != kBoardLayout || h.readers == 0 || h.readers > kMaxReaders ||
             kHeaderBytes + uint64_t{h.readers} * sizeof(ReaderSlot) > bytes) {
    why = "not a board of this layout";
  } else {
    why = in_use_by(h, reinterpret_cast<const ReaderSlot*>(static_cast<const uint8_t*>(p) + kHeaderBytes));
  }
  ::munmap(p, bytes);
  return why;
}

// Whether the header at `fd` says ready.
bool ready(int fd) {
  BoardHeader h{};
  return ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h) && h.ready.load() == 1;
}

BoardGcItem decide(const std::string& name, bool dry_run) {
  BoardGcItem item;
  item.name = name;
  const std::string path = std::string(shm::kSegmentDir) + "/" + kBoardPrefix + name;
  // Another user's board is that user's to remove, in use or not (its file may not even open).
  const auto another_users = [&](const struct stat& owned) {
    if (!S_ISREG(owned.st_mode) || owned.st_uid == ::geteuid()) return false;
    item.reason = "another user's board (uid " + std::to_string(owned.st_uid) + "): only its owner's gc removes it";
    return true;
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    struct stat owned {};
    if (err != ENOENT && ::lstat(path.c_str(), &owned) == 0 && another_users(owned)) return item;
    item.reason = err == ENOENT ? "gone meanwhile" : std::string("cannot open it: ") + std::strerror(err);
    return item;
  }
  struct stat st {};
  bool unfinished = false;
  if (::fstat(fd, &st) == 0 && another_users(st)) {
    ::close(fd);
    return item;
  }
  try {
    shm::check_owned(fd, path, "board", &st);  // this user's regular file, 0600
    item.reason = in_use(fd, st, /*locked=*/false);
    unfinished = st.st_size < static_cast<off_t>(kHeaderBytes) || !ready(fd);
  } catch (const std::exception& e) {
    item.reason = e.what();
  }
  ::close(fd);
  if (!item.reason.empty()) return item;
  item.removable = true;
  item.reason = unfinished ? "its writer died while it made the board" : "its writer is gone and no reader has it open";
  if (dry_run) return item;
  try {
    struct stat locked {};
    const int held = open_locked(path, locked);
    if (held < 0) {
      item.reason = "replaced or removed meanwhile";
      item.removable = false;
      return item;
    }
    // Once more under the lock: a writer may have replaced the file, or a reader opened it.
    const std::string now = locked.st_ino == st.st_ino && locked.st_dev == st.st_dev
                                ? in_use(held, locked, /*locked=*/true)
                                : "replaced meanwhile";
    if (now.empty()) {
      item.removed = ::unlink(path.c_str()) == 0;
      if (!item.removed) item.error = std::string("cannot remove it: ") + std::strerror(errno);
    } else {
      item.removable = false;
      item.reason = "kept at removal: " + now;
    }
    ::close(held);
  } catch (const std::exception& e) {
    item.error = e.what();
  }
  return item;
}

}  // namespace

std::vector<BoardGcItem> collect_stale_boards(bool dry_run, const std::vector<std::string>& only) {
  std::vector<std::string> names = only;
  if (DIR* dir = only.empty() ? ::opendir(shm::kSegmentDir) : nullptr) {
    while (const dirent* e = ::readdir(dir)) {
      const std::string entry = e->d_name;
      if (entry.rfind(kBoardPrefix, 0) == 0 && entry.size() > std::strlen(kBoardPrefix)) {
        names.push_back(entry.substr(std::strlen(kBoardPrefix)));
      }
    }
    ::closedir(dir);
  }
  std::sort(names.begin(), names.end());
  std::vector<BoardGcItem> items;
  for (const std::string& name : names) items.push_back(decide(name, dry_run));
  return items;
}

}  // namespace tdshm::detail
