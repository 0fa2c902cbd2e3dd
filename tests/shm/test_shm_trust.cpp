// The trust boundary of a segment: "trusted are the processes of the same user that joined the
// group". A segment or lock file that another user owns, or that has group or other permission
// bits, is refused with a SegmentError that says so (never joined, never truncated, never
// written); a symbolic link at either path is never followed; a truncated segment is detected at
// attach. And the other side of the same code: the leftovers of a creator killed in the middle
// of creating its segment are recognised and replaced.
//
// The second-user tests need root: an attacker is a forked child that drops to the user
// "nobody" and plants files in /dev/shm; the victim (a forked child, as root, or as nobody for
// the one test the other way round) then tries to form a group under that name. Without root
// they are skipped; the tests of the victim's own files with group/other bits, of truncation and
// of a killed creator run as any user.
//
// A refusal's message is checked for the refused file's path, the reason in trust.cpp's words
// ("owned by uid N", "mode 0644" and "group/other permission bits", "is a symbolic link") and
// what to do ("remove it", "remove the link"), and must not blame /dev/shm itself. Nothing the
// victim may touch changes: planted files and link targets keep their inode, mode, owner, size,
// times and bytes; a link to a missing path stays dangling; the victim's secret (which it would
// send if it ever joined) appears in no planted file; and the attacker, watching /dev/shm while
// the victim tries, can open none of the victim's files.
//
// Every path a test plants is unlinked at its end, whatever happened (PlantCleanup).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shm/layout/segment_layout.h"
#include "shm_test_support.h"

namespace tdshm::test {
namespace {

class ShmTrust : public ShmTest {};

// ---------------------------------------------------------------------------------------------
// Users

struct UserIds {
  uid_t uid = 0;
  gid_t gid = 0;
};

/// The uid and gid of "nobody", looked up in the parent (never after fork).
std::optional<UserIds> nobody_ids() {
  const passwd* pw = ::getpwnam("nobody");
  if (pw == nullptr) return std::nullopt;
  return UserIds{pw->pw_uid, pw->pw_gid};
}

/// In a forked child: drops every privilege and becomes `ids` for good.
void become(const UserIds& ids) {
  SHM_CHECK(::setgroups(0, nullptr) == 0, "setgroups(0, NULL): " << std::strerror(errno));
  SHM_CHECK(::setgid(ids.gid) == 0, "setgid(" << ids.gid << "): " << std::strerror(errno));
  SHM_CHECK(::setuid(ids.uid) == 0, "setuid(" << ids.uid << "): " << std::strerror(errno));
  SHM_CHECK(::geteuid() == ids.uid && ::getuid() == ids.uid && ::getegid() == ids.gid,
            "still euid " << ::geteuid() << ", egid " << ::getegid());
  SHM_CHECK(ids.uid == 0 || ::setuid(0) != 0, "could become root again");
}

/// Why the second-user tests cannot run here, or "" when they can: they need root and a user
/// "nobody" that a child can become.
std::string second_user_unavailable() {
  if (::geteuid() != 0) {
    return "the second-user tests run as root only (an attacker child drops to 'nobody'); euid is " +
           std::to_string(::geteuid());
  }
  const std::optional<UserIds> ids = nobody_ids();
  if (!ids) return "there is no user 'nobody' (getpwnam)";
  if (ids->uid == 0) return "'nobody' has uid 0";
  Child probe([&] { become(*ids); });
  probe.wait(20s);
  if (!probe.ok()) return "a child cannot become 'nobody': " + probe.describe();
  return "";
}

/// The uid of "nobody" (once SKIP_WITHOUT_SECOND_USER() has passed).
uid_t nobody_uid() { return nobody_ids().value().uid; }

#define SKIP_WITHOUT_SECOND_USER()                                         \
  do {                                                                     \
    const std::string trust_why_not_ = second_user_unavailable();          \
    if (!trust_why_not_.empty()) GTEST_SKIP() << trust_why_not_;           \
  } while (false)

// ---------------------------------------------------------------------------------------------
// Files

std::string lock_path_of(const std::string& name) { return segment_path(name) + ".lock"; }

/// A path in the temporary directory, unique to this test and `what` (it does not exist yet).
std::string temp_path(const std::string& name, const std::string& what) {
  return (std::filesystem::temp_directory_path() / ("tdshm-trust-" + name + "-" + what)).string();
}

/// Creates `path` (O_EXCL, never through a link) with `bytes` and exactly `mode`.
void create_file(const std::string& path, const std::string& bytes, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  SHM_CHECK(fd >= 0, "cannot create " << path << ": " << std::strerror(errno));
  const int chmod_rc = ::fchmod(fd, mode);  // the umask may have removed bits
  const int chmod_err = errno;
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  ::close(fd);
  SHM_CHECK(chmod_rc == 0, "fchmod " << path << ": " << std::strerror(chmod_err));
  SHM_CHECK(off == bytes.size(), "short write to " << path);
}

/// `size` bytes of a recognisable text, repeated.
std::string recognisable(const std::string& text, size_t size) {
  std::string out;
  out.reserve(size);
  while (out.size() < size) out += text;
  out.resize(size);
  return out;
}

/// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), as tdshm identifies a
/// process; 0 if unreadable.
uint64_t proc_start_time(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return 0;
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 > stat.size()) return 0;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && (rest >> field); ++i) {
    if (i == 22) return std::stoull(field);
  }
  return 0;
}

/// The bytes of a segment of `world` ranks with `opts` as its creator would leave them: a
/// complete header (published when `published`), zero rings, and `live_rank` (if >= 0) marked
/// live with the process (pid, start_time). A segment only an ownership or permission check can
/// tell from a real one.
std::string plausible_segment(int world, const ShmOptions& opts, bool published, int live_rank, uint32_t pid,
                              uint64_t start_time) {
  const shm::SegmentGeometry g =
      shm::segment_geometry(static_cast<uint32_t>(world), opts.slot_bytes, opts.ring_entries, opts.slots_per_rank,
                            opts.window_bytes, opts.loan_tickets, opts.loan_bytes);
  std::string bytes(g.segment_bytes, '\0');
  auto* h = new (bytes.data()) shm::SegmentHeader{};
  h->magic = shm::kSegmentMagic;
  h->header_bytes = sizeof(shm::SegmentHeader);
  h->segment_bytes = g.segment_bytes;
  h->world_size = static_cast<uint32_t>(world);
  h->ring_entries = opts.ring_entries;
  h->slot_bytes = opts.slot_bytes;
  h->rank_table_offset = g.rank_table_offset;
  h->rings_offset = g.rings_offset;
  h->ring_bytes = g.ring_bytes;
  h->entry_bytes = g.entry_bytes;
  h->arena_offset = g.arena_offset;
  h->region_bytes = g.region_bytes;
  h->slots_per_rank = opts.slots_per_rank;
  h->window_offset = g.window_offset;
  h->window_bytes = g.window_bytes;
  h->creator_pid = pid;
  h->creator_start_time = start_time;
  if (live_rank >= 0) {
    auto* slot = new (bytes.data() + g.rank_table_offset + static_cast<uint64_t>(live_rank) * sizeof(shm::RankSlot))
        shm::RankSlot{};
    slot->pid = pid;
    slot->start_time = start_time;
    slot->state.store(shm::kRankLive, std::memory_order_relaxed);
  }
  h->layout_version.store(published ? shm::kLayoutVersion : 0, std::memory_order_relaxed);
  return bytes;
}

/// What lstat and the content say about a path (never following a link).
struct FileState {
  bool exists = false;
  mode_t mode = 0;  // type and permission bits
  uid_t uid = 0;
  ino_t ino = 0;
  off_t size = 0;
  timespec mtime{};
  timespec ctime{};
  std::string content;  // a regular file's bytes, or a link's target
};

FileState file_state(const std::string& path) {
  FileState s;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return s;
  s.exists = true;
  s.mode = st.st_mode;
  s.uid = st.st_uid;
  s.ino = st.st_ino;
  s.size = st.st_size;
  s.mtime = st.st_mtim;
  s.ctime = st.st_ctim;
  if (S_ISLNK(st.st_mode)) {
    char target[4096];
    const ssize_t n = ::readlink(path.c_str(), target, sizeof(target));
    if (n > 0) s.content.assign(target, static_cast<size_t>(n));
  } else if (S_ISREG(st.st_mode)) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) {
      char buf[65536];
      for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof(buf));
        if (n <= 0) break;
        s.content.append(buf, static_cast<size_t>(n));
      }
      ::close(fd);
    }
  }
  return s;
}

/// "" when `after` is `before`, else what changed.
std::string changes(const FileState& before, const FileState& after) {
  std::ostringstream os;
  if (before.exists != after.exists) {
    os << (after.exists ? "was created" : "was removed");
    return os.str();
  }
  if (!before.exists) return "";
  if (before.ino != after.ino) os << "was replaced (inode " << before.ino << " -> " << after.ino << "); ";
  if (before.mode != after.mode) os << "mode " << std::oct << before.mode << " -> " << after.mode << std::dec << "; ";
  if (before.uid != after.uid) os << "owner " << before.uid << " -> " << after.uid << "; ";
  if (before.size != after.size) os << "size " << before.size << " -> " << after.size << "; ";
  if (before.mtime.tv_sec != after.mtime.tv_sec || before.mtime.tv_nsec != after.mtime.tv_nsec) os << "mtime changed; ";
  if (before.ctime.tv_sec != after.ctime.tv_sec || before.ctime.tv_nsec != after.ctime.tv_nsec) os << "ctime changed; ";
  if (before.content != after.content) os << (S_ISLNK(before.mode) ? "link target" : "content") << " changed; ";
  return os.str();
}

/// Unlinks every path it was given, and every /dev/shm entry of the segment name, when it goes
/// out of scope: nothing planted survives a test, failed or not.
class PlantCleanup {
 public:
  explicit PlantCleanup(std::string name, std::vector<std::string> paths = {})
      : name_(std::move(name)), paths_(std::move(paths)) {
    for (const std::string& p : paths_) ::unlink(p.c_str());  // nothing of an earlier run in the way
  }
  ~PlantCleanup() {
    for (const std::string& p : paths_) ::unlink(p.c_str());
    remove_shm_entries_of(name_);
  }
  PlantCleanup(const PlantCleanup&) = delete;
  PlantCleanup& operator=(const PlantCleanup&) = delete;

 private:
  std::string name_;
  std::vector<std::string> paths_;
};

// ---------------------------------------------------------------------------------------------
// A planter, a victim, and what must hold afterwards

/// 64 bytes the victim would send to rank 1 if it ever joined a group it must refuse: they must
/// never show up in a planted file.
const std::string& victim_secret() {
  static const std::string s = recognisable("VICTIM-SECRET-7f3a9c-", 64);
  return s;
}

/// What the victim's SegmentError must say: which file (its path), why (every needle, matched
/// case-insensitively), and what to do. The wording is trust.cpp's (open_error, check_owned).
struct Refusal {
  std::string why{};                   // for messages
  std::string path{};                  // the refused file: the message names it
  std::vector<std::string> needles{};  // the message contains all of them
};

/// `path` is owned by `owner`, not by the victim.
Refusal owned_by(const std::string& path, uid_t owner) {
  return {"owned by uid " + std::to_string(owner), path, {"owned by uid " + std::to_string(owner), "remove it"}};
}

/// `path` is the victim's but has group/other permission bits.
Refusal mode_refused(const std::string& path, mode_t mode) {
  char octal[8];
  std::snprintf(octal, sizeof(octal), "%04o", static_cast<unsigned>(mode));
  return {std::string("mode ") + octal, path, {std::string("mode ") + octal, "group/other permission bits", "remove it"}};
}

/// `path` is a symbolic link.
Refusal symlink_refused(const std::string& path) {
  return {"a symbolic link", path, {"is a symbolic link", "remove the link"}};
}

struct Handshake {
  std::atomic<int> planted{0};      // the planter has put everything in place
  std::atomic<int> victim_done{0};  // the victim's attempt is over: the planter may go
};

struct Scenario {
  std::string what{};
  /// The planter becomes "nobody" before planting (the attacker); otherwise it stays root (the
  /// victim's own misconfigured files, or root's files for a victim that is "nobody").
  bool planter_is_nobody = true;
  bool victim_is_nobody = false;
  /// Runs in the planter (after it changed user, if it does): creates the files. It may leave
  /// descriptors open (a held flock): the planter lives until the victim's attempt is over.
  std::function<void(const Handshake&)> plant = nullptr;
  Refusal refusal{};
  /// Paths whose state (lstat, content, link target, times) must be the same after the victim's
  /// attempt as after planting.
  std::vector<std::string> unchanged{};
  /// Paths that must still not exist after the victim's attempt.
  std::vector<std::string> absent{};
};

/// The victim: rank 0 of 2 under `name` must be refused with the SegmentError `sc.refusal`. If it joins, it sends its secret to rank 1 (to show where it goes) and fails.
void victim_attempt(const std::string& name, const Scenario& sc) {
  ShmOptions opts = small_options();
  opts.timeout = 2s;
  std::unique_ptr<ProcessGroupShm> pg;
  const Caught c = catch_any([&] { pg = std::make_unique<ProcessGroupShm>(name, 0, 2, opts); });
  if (pg) {
    const at::Tensor secret =
        at::from_blob(const_cast<char*>(victim_secret().data()), {static_cast<int64_t>(victim_secret().size())}, at::kByte)
            .clone();
    const Caught sent = catch_any([&] { post_send(*pg, secret, 1, 7); });
    pg.reset();
    SHM_CHECK(false, "the victim JOINED a group in a segment it must refuse (" << sc.what << "); sending its secret to "
                                                                                "rank 1: "
                                                                             << sent.describe());
  }
  std::fprintf(stderr, "[%s] victim: %s\n", sc.what.c_str(), c.describe().c_str());
  const Refusal& want = sc.refusal;
  SHM_CHECK(c.is<SegmentError>(), "expected a tdshm::SegmentError (" << want.path << ": " << want.why << "), got "
                                                                     << c.describe());
  SHM_CHECK(!contains_nocase(c.what, "mounted and writable"),
            "the message blames /dev/shm instead of saying the file is " << want.why << ": " << c.what);
  SHM_CHECK(contains_nocase(c.what, want.path), "the message does not name " << want.path << ": " << c.what);
  for (const std::string& n : want.needles) {
    SHM_CHECK(contains_nocase(c.what, n), "the message does not say \"" << n << "\" (" << want.why << "): " << c.what);
  }
}

/// While the victim tries: every entry of /dev/shm named after the segment that the planter does
/// not own must be closed to it (the victim's files are never readable by another user).
void attacker_watch(const std::string& name, const Handshake& hs) {
  const auto give_up = Clock::now() + 40s;
  const uid_t me = ::geteuid();
  while (hs.victim_done.load() == 0 && Clock::now() < give_up) {
    for (const std::string& entry : shm_entries_of(name)) {
      const std::string path = "/dev/shm/" + entry;
      struct stat st {};
      if (::lstat(path.c_str(), &st) != 0 || st.st_uid == me || !S_ISREG(st.st_mode)) continue;
      const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
      if (fd >= 0) {
        ::close(fd);
        SHM_CHECK(false, "the attacker (uid " << me << ") could open the victim's " << path << " (mode " << std::oct
                                              << (st.st_mode & 07777) << std::dec << ", owner " << st.st_uid << ")");
      }
    }
    std::this_thread::sleep_for(1ms);
  }
}

/// Plants, snapshots, lets the victim try, and checks that nothing planted changed, that nothing
/// absent appeared, and that the victim's secret reached no planted file.
void run_scenario(ShmTest& /*fixture*/, const std::string& name, const Scenario& sc) {
  SCOPED_TRACE(sc.what);
  const std::optional<UserIds> nobody = nobody_ids();
  if (sc.planter_is_nobody || sc.victim_is_nobody) {
    ASSERT_TRUE(nobody.has_value()) << "no user 'nobody'";
  }
  Shared<Handshake> hs;

  Child planter([&] {
    if (sc.planter_is_nobody) become(*nobody);
    sc.plant(*hs);
    hs->planted.store(1);
    if (sc.planter_is_nobody) {
      attacker_watch(name, *hs);
    } else {
      const auto give_up = Clock::now() + 40s;
      while (hs->victim_done.load() == 0 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
    }
  });
  const auto deadline = Clock::now() + 20s;
  while (hs->planted.load() == 0 && !planter.poll() && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(hs->planted.load(), 1) << "the planter did not plant: " << planter.describe();

  std::vector<FileState> before;
  for (const std::string& p : sc.unchanged) {
    before.push_back(file_state(p));
    ASSERT_TRUE(before.back().exists) << p << " was not planted";
  }
  for (const std::string& p : sc.absent) ASSERT_FALSE(file_state(p).exists) << p << " exists before the victim came";

  Child victim([&] {
    if (sc.victim_is_nobody) become(*nobody);
    victim_attempt(name, sc);
  });
  victim.wait(30s);
  hs->victim_done.store(1);
  planter.wait(20s);
  EXPECT_TRUE(victim.ok()) << "victim (" << (sc.victim_is_nobody ? "nobody" : "root") << "): " << victim.describe();
  EXPECT_EQ(victim.signal(), 0) << "the victim crashed: " << victim.describe();
  EXPECT_TRUE(planter.ok()) << "planter (" << (sc.planter_is_nobody ? "nobody" : "root") << "): " << planter.describe();

  for (size_t i = 0; i < sc.unchanged.size(); ++i) {
    const FileState after = file_state(sc.unchanged[i]);
    EXPECT_EQ(changes(before[i], after), "") << sc.unchanged[i] << " was touched by the victim's attempt";
    if (S_ISREG(after.mode)) {
      EXPECT_EQ(after.content.find(victim_secret()), std::string::npos)
          << "the victim's secret reached " << sc.unchanged[i];
    }
  }
  for (const std::string& p : sc.absent) {
    EXPECT_FALSE(file_state(p).exists) << p << " (the target of a planted symbolic link) was created";
  }
}

/// The segment's size with the victim's options (2 ranks): plausible for a planted file.
size_t victim_segment_bytes() { return shm_segment_bytes(2, small_options()); }

/// Writes a published header of 2 ranks with the victim's options whose rank 1 is the calling
/// process (alive), at `path` with `mode`: only an ownership or permission check can refuse it.
void plant_live_looking_segment(const std::string& path, mode_t mode) {
  const auto pid = static_cast<uint32_t>(::getpid());
  const uint64_t start = proc_start_time(static_cast<pid_t>(pid));
  SHM_CHECK(start != 0, "cannot read this process's start time");
  create_file(path, plausible_segment(2, small_options(), true, 1, pid, start), mode);
}

// ---------------------------------------------------------------------------------------------
// 1a. A segment planted by another user

TEST_F(ShmTrust, PlantedSegmentOfAnotherUserIsRefused) {
  SKIP_WITHOUT_SECOND_USER();
  const std::string name = unique_name();
  const std::string seg = segment_path(name);
  PlantCleanup cleanup(name, {seg});
  run_scenario(*this, name,
               {.what = "segment planted by nobody, mode 0666, full of a pattern",
                .plant = [&](const Handshake&) { create_file(seg, recognisable("ATTACKER-PLANTED", victim_segment_bytes()), 0666); },
                .refusal = owned_by(seg, nobody_uid()),
                .unchanged = {seg}});
}

TEST_F(ShmTrust, PlantedSegmentWithValidHeaderOfAnotherUserIsRefused) {
  // A header that passes every check of the layout, a live rank 1 (the attacker itself) and mode
  // 0600: only the ownership check can refuse it; joining would hand the victim's messages over.
  SKIP_WITHOUT_SECOND_USER();
  const std::string name = unique_name();
  const std::string seg = segment_path(name);
  PlantCleanup cleanup(name, {seg});
  run_scenario(*this, name,
               {.what = "segment planted by nobody, mode 0600, valid header, attacker live as rank 1",
                .plant = [&](const Handshake&) { plant_live_looking_segment(seg, 0600); },
                .refusal = owned_by(seg, nobody_uid()),
                .unchanged = {seg}});
}

// ---------------------------------------------------------------------------------------------
// 1b. A lock file planted by another user

TEST_F(ShmTrust, PlantedLockFileOfAnotherUserIsRefused) {
  SKIP_WITHOUT_SECOND_USER();
  const std::string name = unique_name();
  const std::string lock = lock_path_of(name);
  PlantCleanup cleanup(name, {lock});
  run_scenario(*this, name,
               {.what = "lock file planted by nobody, mode 0600, no segment",
                .plant = [&](const Handshake&) { create_file(lock, recognisable("ATTACKER-LOCK-", 100), 0600); },
                .refusal = owned_by(lock, nobody_uid()),
                .unchanged = {lock}});
}

TEST_F(ShmTrust, PlantedLockFileHeldByAnotherUserIsRefused) {
  // The attacker also holds the flock: the victim must refuse the file, not wait for the lock.
  SKIP_WITHOUT_SECOND_USER();
  const std::string name = unique_name();
  const std::string lock = lock_path_of(name);
  PlantCleanup cleanup(name, {lock});
  run_scenario(*this, name,
               {.what = "lock file planted and flocked by nobody, mode 0600, no segment",
                .plant =
                    [&](const Handshake&) {
                      create_file(lock, recognisable("ATTACKER-LOCK-", 100), 0600);
                      const int fd = ::open(lock.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
                      SHM_CHECK(fd >= 0, "cannot open " << lock << ": " << std::strerror(errno));
                      SHM_CHECK(::flock(fd, LOCK_EX | LOCK_NB) == 0, "cannot flock " << lock << ": " << std::strerror(errno));
                      // fd stays open (and locked) until the planter exits.
                    },
                .refusal = owned_by(lock, nobody_uid()),
                .unchanged = {lock}});
}

// ---------------------------------------------------------------------------------------------
// 1c. Symbolic links planted by another user at the segment path and the lock path

/// A file of the victim (root, 0600) elsewhere, which a planted link points to: a published
/// header whose ranks are all dead, so an implementation that followed the link would take it for
/// a stale segment to replace.
std::string make_victim_file(const std::string& name) {
  const std::string path = temp_path(name, "victim-file");
  ::unlink(path.c_str());
  create_file(path, plausible_segment(2, small_options(), true, -1, 0, 0), 0600);
  return path;
}

void link_scenario(ShmTest& fixture, const std::string& name, bool at_lock, bool target_exists) {
  const std::string link = at_lock ? lock_path_of(name) : segment_path(name);
  const std::string target = target_exists ? temp_path(name, "victim-file") : temp_path(name, "absent");
  PlantCleanup cleanup(name, {link, target});
  if (target_exists) {
    make_victim_file(name);
  }
  Scenario sc{.what = std::string("symbolic link at the ") + (at_lock ? "lock" : "segment") + " path to " +
                      (target_exists ? "a file of the victim" : "a path that does not exist"),
              .plant =
                  [&](const Handshake&) {
                    SHM_CHECK(::symlink(target.c_str(), link.c_str()) == 0,
                              "symlink " << link << " -> " << target << ": " << std::strerror(errno));
                  },
              .refusal = symlink_refused(link),
              .unchanged = {link}};
  if (target_exists) {
    sc.unchanged.push_back(target);
  } else {
    sc.absent.push_back(target);
  }
  run_scenario(fixture, name, sc);
}

TEST_F(ShmTrust, SymlinkAtSegmentPathToVictimFileIsNotFollowed) {
  SKIP_WITHOUT_SECOND_USER();
  link_scenario(*this, unique_name(), /*at_lock=*/false, /*target_exists=*/true);
}

TEST_F(ShmTrust, SymlinkAtSegmentPathToMissingPathIsNotFollowed) {
  SKIP_WITHOUT_SECOND_USER();
  link_scenario(*this, unique_name(), /*at_lock=*/false, /*target_exists=*/false);
}

TEST_F(ShmTrust, SymlinkAtLockPathToVictimFileIsNotFollowed) {
  SKIP_WITHOUT_SECOND_USER();
  link_scenario(*this, unique_name(), /*at_lock=*/true, /*target_exists=*/true);
}

TEST_F(ShmTrust, SymlinkAtLockPathToMissingPathIsNotFollowed) {
  SKIP_WITHOUT_SECOND_USER();
  link_scenario(*this, unique_name(), /*at_lock=*/true, /*target_exists=*/false);
}

// ---------------------------------------------------------------------------------------------
// 1d. The victim's own files with group or other permission bits (no second user needed: the
// planter is a child of the same user)

void own_file_with_mode(ShmTest& fixture, const std::string& name, bool lock_file, mode_t mode) {
  const std::string path = lock_file ? lock_path_of(name) : segment_path(name);
  PlantCleanup cleanup(name, {path});
  char octal[8];
  std::snprintf(octal, sizeof(octal), "%04o", static_cast<unsigned>(mode));
  run_scenario(fixture, name,
               {.what = std::string(lock_file ? "lock file" : "segment") + " of the victim's own user, mode " + octal +
                        (lock_file ? ", no segment" : ", valid header, a live rank 1 of the same user"),
                .planter_is_nobody = false,
                .plant =
                    [&, mode](const Handshake&) {
                      if (lock_file) {
                        create_file(path, "", mode);
                      } else {
                        plant_live_looking_segment(path, mode);
                      }
                    },
                .refusal = mode_refused(path, mode),
                .unchanged = {path}});
}

TEST_F(ShmTrust, OwnSegmentWithOtherPermissionBitsIsRefused) {
  own_file_with_mode(*this, unique_name(), /*lock_file=*/false, 0644);
}

TEST_F(ShmTrust, OwnSegmentWithGroupPermissionBitsIsRefused) {
  own_file_with_mode(*this, unique_name(), /*lock_file=*/false, 0660);
}

TEST_F(ShmTrust, OwnLockFileWithOtherPermissionBitsIsRefused) {
  own_file_with_mode(*this, unique_name(), /*lock_file=*/true, 0644);
}

// ---------------------------------------------------------------------------------------------
// The other way round: an unprivileged victim and a segment of root

TEST_F(ShmTrust, SegmentOfRootIsRefusedByUnprivilegedVictim) {
  // root's segment, mode 0666 (so that "nobody" can open it at all), valid header, root's planter
  // live as rank 1: the victim "nobody" must refuse it too (it is not its user's).
  SKIP_WITHOUT_SECOND_USER();
  const std::string name = unique_name();
  const std::string seg = segment_path(name);
  PlantCleanup cleanup(name, {seg});
  run_scenario(*this, name,
               {.what = "segment of root, mode 0666, valid header, victim is nobody",
                .planter_is_nobody = false,
                .victim_is_nobody = true,
                .plant = [&](const Handshake&) { plant_live_looking_segment(seg, 0666); },
                .refusal = owned_by(seg, 0),
                .unchanged = {seg}});
}

// ---------------------------------------------------------------------------------------------
// 2. Same user: a segment truncated under a live group is detected at attach (no SIGBUS)

void truncated_at_attach(const std::string& name, off_t (*new_size)(off_t full)) {
  PlantCleanup cleanup(name);
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  Child rank0([&] { ProcessGroupShm pg(name, 0, 2, opts); });
  ASSERT_TRUE(wait_segment_ready(name, {0}, 10s)) << "rank 0 did not publish the segment; " << rank0.describe();
  const std::string path = segment_path(name);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << std::strerror(errno);
  const off_t full = st.st_size;
  const off_t size = new_size(full);
  ASSERT_EQ(::truncate(path.c_str(), size), 0) << "truncate " << path << ": " << std::strerror(errno);
  std::fprintf(stderr, "[truncated] %s: %lld -> %lld bytes\n", path.c_str(), static_cast<long long>(full),
               static_cast<long long>(size));

  Child rank1([&] {
    ShmOptions o = opts;
    o.timeout = 3s;
    const Caught c = SHM_CHECK_THROWS(SegmentError, [&] { ProcessGroupShm pg(name, 1, 2, o); });
    std::fprintf(stderr, "[truncated] rank 1: %s\n", c.describe().c_str());
    // It says what disagrees: the header's size and the file's.
    SHM_CHECK(c.what.find(std::to_string(full)) != std::string::npos &&
                  c.what.find(std::to_string(size)) != std::string::npos,
              "the message does not give the header's size (" << full << ") and the file's (" << size << "): " << c.what);
  });
  rank1.wait(20s);
  EXPECT_EQ(rank1.signal(), 0) << "the attacher crashed (SIGBUS?): " << rank1.describe();
  EXPECT_TRUE(rank1.ok()) << "rank 1: " << rank1.describe();
  rank0.kill();  // it may have died of the truncation itself; either way it is done
  rank0.wait(10s);
}

TEST_F(ShmTrust, SegmentTruncatedToHalfIsRefusedAtAttach) {
  truncated_at_attach(unique_name(), [](off_t full) { return full / 2; });
}

TEST_F(ShmTrust, SegmentTruncatedToItsHeaderIsRefusedAtAttach) {
  // The header survives; the rank table and the rings are gone.
  truncated_at_attach(unique_name(), [](off_t) { return static_cast<off_t>(sizeof(shm::SegmentHeader)); });
}

// ---------------------------------------------------------------------------------------------
// 3. The leftovers of a creator killed in the middle of creating its segment are replaced

/// One message each way between ranks 0 and 1 (a chunked one): the group works.
void exchange_once(ProcessGroupShm& pg) {
  const int peer = 1 - pg.getRank();
  const int64_t bytes = 3 * static_cast<int64_t>(pg.options().slot_bytes) + 5;
  const at::Tensor mine = pattern(at::kFloat, bytes / 4, static_cast<uint64_t>(pg.getRank() + 1));
  const at::Tensor expected = pattern(at::kFloat, bytes / 4, static_cast<uint64_t>(peer + 1));
  const at::Tensor got = at::zeros({bytes / 4}, at::kFloat);
  auto s = post_send(pg, mine, peer, 5);
  auto r = post_recv(pg, got, peer, 5);
  s->wait();
  r->wait();
  SHM_CHECK(same_bytes(got, expected), "rank " << pg.getRank() << " received wrong bytes");
}

/// `leftover` is the content of /dev/shm/tdshm.<name> (ours, 0600), with our unlocked lock file
/// (0600) beside it, as a creator SIGKILLed mid-creation leaves them. A group of 2 processes must
/// form under that name and exchange, and leave nothing behind.
void replaces_leftover(const std::string& name, const std::string& what, const std::string& leftover) {
  SCOPED_TRACE(what);
  PlantCleanup cleanup(name);
  create_file(segment_path(name), leftover, 0600);
  create_file(lock_path_of(name), "", 0600);
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    exchange_once(pg);
  }));
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{}) << "left behind after the group left";
}

/// The pid of a process that has exited (and been reaped).
uint32_t dead_pid() {
  Child gone([] {});
  gone.wait(10s);
  return static_cast<uint32_t>(gone.pid());
}

TEST_F(ShmTrust, CreatorKilledLeavingZeroedSegmentIsReplaced) {
  replaces_leftover(unique_name(), "full size, all zeros (no header yet)",
                    std::string(shm_segment_bytes(2, small_options()), '\0'));
}

TEST_F(ShmTrust, CreatorKilledLeavingEmptyFileIsReplaced) {
  replaces_leftover(unique_name(), "size 0 (killed before ftruncate)", std::string());
}

TEST_F(ShmTrust, CreatorKilledBeforePublishingVersionIsReplaced) {
  const uint32_t pid = dead_pid();
  replaces_leftover(unique_name(), "header with magic, layout_version 0, creator dead",
                    plausible_segment(2, small_options(), /*published=*/false, -1, pid, 1));
}

}  // namespace
}  // namespace tdshm::test
