// The operator tools: the read-only segment reader and gc of src/shm/inspect.h (suite ShmTools)
// and the `tdshm ls`, `tdshm inspect NAME` and `tdshm gc` commands of the built tool, run as
// processes (suite ShmCli; skipped when the tool was not built).
//
//  - A live group of two forked ranks is listed with 2 attached, 2 alive ranks, and gc (dry run or
//    not) keeps it, saying it is in use.
//  - A group whose ranks were SIGKILLed is listed with dead ranks; gc --dry-run reports it without
//    removing anything; gc removes the segment and its lock file.
//  - Planted files: random bytes, a header cut short, zeros, another layout version, a corrupt
//    header, mode 0644, another uid's (as root), a symbolic link (to a file of ours, and dangling),
//    a FIFO: each is reported with its status, nothing crashes or blocks, and gc keeps them all
//    (it removes only what it proves stale: see inspect.h). An interrupted creation (zeros and a
//    lock record of a dead creator) and a lock file alone are removed; a lock file whose creator
//    is alive and creating is kept.
//  - Layout version 4 ring details (per-pair depth, messages, bytes in flight) read from a
//    synthetic version 4 file, whatever this build's layout version is; any other version
//    reports "details not available".
//
// Names are unique per test (ShmTest::unique_name, the pid in it); every planted path is
// unlinked at the end of its test whatever happened (Plants); every wait has a deadline.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shm/inspect.h"
#include "shm/segment_layout.h"
#include "shm_test_support.h"

namespace tdshm::test {
namespace {

using shm::SegmentInfo;
using shm::SegmentStatus;

class ShmTools : public ShmTest {};
class ShmCli : public ShmTest {};

std::string lock_path_of(const std::string& name) { return segment_path(name) + ".lock"; }

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

/// Unlinks every added path at scope exit.
struct Plants {
  std::vector<std::string> paths;
  ~Plants() {
    for (const std::string& p : paths) ::unlink(p.c_str());
  }
  void add(const std::string& p) { paths.push_back(p); }
};

/// Writes `bytes` to a new file at `path` with `mode` (exactly: fchmod after the umask).
void write_file(const std::string& path, const std::vector<uint8_t>& bytes, mode_t mode = 0600) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  ASSERT_EQ(::fchmod(fd, mode), 0);
  if (!bytes.empty()) {
    ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  }
  ::close(fd);
}

template <class T>
void put(std::vector<uint8_t>& b, size_t at, T v) {
  if (b.size() < at + sizeof v) b.resize(at + sizeof v);
  std::memcpy(b.data() + at, &v, sizeof v);
}

template <class T>
T get(const std::vector<uint8_t>& b, size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}

/// The header prefix every layout version shares.
std::vector<uint8_t> prefix(uint32_t version, uint32_t header_bytes, uint64_t segment_bytes, uint32_t world) {
  std::vector<uint8_t> b(256, 0);
  put<uint64_t>(b, 0, shm::kSegmentMagic);
  put<uint32_t>(b, 8, version);
  put<uint32_t>(b, 12, header_bytes);
  put<uint64_t>(b, 16, segment_bytes);
  put<uint32_t>(b, 24, world);
  return b;
}

std::optional<SegmentInfo> find_listed(const std::vector<SegmentInfo>& infos, const std::string& name) {
  for (const SegmentInfo& i : infos) {
    if (i.name == name) return i;
  }
  return std::nullopt;
}

std::optional<shm::GcItem> find_item(const std::vector<shm::GcItem>& items, const std::string& name) {
  for (const shm::GcItem& i : items) {
    if (i.name == name) return i;
  }
  return std::nullopt;
}

/// A dead process's identity: a child that exited and was reaped.
uint32_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return static_cast<uint32_t>(pid);
}

/// A group of two forked ranks of ProcessGroupShm on `name`: constructed (both attached and
/// through the rendezvous) by the constructor; released (both leave, the last removes the
/// segment) by release(); SIGKILLed by kill(). Rank 1 isends one message to rank 0, which rank 0
/// receives only when released: a message in flight while the group is inspected.
class TwoRanks {
 public:
  explicit TwoRanks(const std::string& name) {
    ShmOptions opts = small_options();
    opts.timeout = 30s;
    for (int r = 0; r < 2; ++r) {
      children_.emplace_back([this, r, name, opts] {
        ProcessGroupShm pg(name, r, 2, opts);
        at::Tensor t = r == 1 ? at::arange(16, at::kFloat) : at::zeros({16}, at::kFloat);
        c10::intrusive_ptr<c10d::Work> sent;
        if (r == 1) {
          sent = post_send(pg, t, 0, 7);
          SHM_CHECK(sent->wait(), "isend");
        }
        state_->ready.fetch_add(1);
        const auto deadline = Clock::now() + 60s;
        while (!state_->release.load() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
        SHM_CHECK(state_->release.load(), "never released");
        if (r == 0) {
          SHM_CHECK(post_recv(pg, t, 1, 7)->wait(), "recv");
          SHM_CHECK(t.equal(at::arange(16, at::kFloat)), "wrong data");
          state_->received.store(true);
        } else {
          // The sender stays until its message is taken.
          while (!state_->received.load() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
          SHM_CHECK(state_->received.load(), "rank 0 never received");
        }
      });
    }
    const auto deadline = Clock::now() + 20s;
    while (state_->ready.load() < 2 && Clock::now() < deadline) {
      for (Child& c : children_) c.poll();
      if (children_[0].exited() || children_[1].exited()) break;
      std::this_thread::sleep_for(2ms);
    }
    ready_ = state_->ready.load() == 2;
  }
  bool ready() const { return ready_; }
  std::string describe() const { return children_[0].describe() + "; " + children_[1].describe(); }
  /// Lets both ranks finish; true if both exited with 0.
  bool release() {
    state_->release.store(true);
    wait_all(children_, 20s);
    return children_[0].ok() && children_[1].ok();
  }
  void kill() {
    for (Child& c : children_) c.kill();
    wait_all(children_, 10s);
  }

 private:
  struct State {
    std::atomic<int> ready{0};
    std::atomic<bool> release{false};
    std::atomic<bool> received{false};
  };
  Shared<State> state_;
  std::vector<Child> children_;
  bool ready_ = false;
};

// ---------------------------------------------------------------------------------------------
// The reader and gc (library)

TEST_F(ShmTools, LiveGroupIsListedAndNeverCollected) {
  const std::string name = unique_name();
  TwoRanks group(name);
  ASSERT_TRUE(group.ready()) << group.describe();

  const std::optional<SegmentInfo> listed = find_listed(shm::list_segments(), name);
  ASSERT_TRUE(listed.has_value()) << "not listed";
  EXPECT_EQ(listed->status, SegmentStatus::kValid) << listed->problem;
  EXPECT_EQ(listed->layout_version, shm::kLayoutVersion);
  EXPECT_EQ(listed->world_size, 2u);
  ASSERT_TRUE(listed->ranks_read);
  EXPECT_EQ(listed->attached_ranks(), 2u);
  EXPECT_EQ(listed->alive_ranks(), 2u);
  for (const shm::RankInfo& r : listed->ranks) {
    EXPECT_EQ(r.state_name(), "live");
    EXPECT_NE(r.pid, 0u);
  }
  EXPECT_TRUE(listed->header_read);
  EXPECT_TRUE(listed->creator_alive);
  EXPECT_TRUE(listed->lock.present);
  EXPECT_FALSE(listed->lock.refused) << listed->lock.problem;
  ASSERT_TRUE(listed->lock.creator.has_value());
  EXPECT_FALSE(listed->lock.creating);
  EXPECT_GE(listed->age_seconds, 0);
  EXPECT_FALSE(listed->details.has_value()) << "details only when asked for";

  const SegmentInfo info = shm::inspect_segment(name, {.details = true});
  EXPECT_EQ(info.status, SegmentStatus::kValid);
  EXPECT_EQ(info.alive_ranks(), 2u);
  ASSERT_TRUE(info.details.has_value());
  if (info.details->available) {
    // Layout version 4: one ring per ordered pair; rank 1's message to rank 0 was published.
    ASSERT_EQ(info.details->pairs.size(), 4u);
    const shm::PairInfo& p10 = info.details->pairs[2];
    EXPECT_EQ(p10.src, 1u);
    EXPECT_EQ(p10.dst, 0u);
    EXPECT_GE(p10.head, 1u);
    EXPECT_TRUE(p10.note.empty()) << p10.note;
    EXPECT_LE(p10.depth, 4u);
  } else {
    EXPECT_NE(info.details->note.find("layout version " + std::to_string(shm::kLayoutVersion)), std::string::npos)
        << info.details->note;
  }

  EXPECT_FALSE(shm::gc_decision(info).first);
  for (bool dry : {true, false}) {
    const std::vector<shm::GcItem> items = shm::collect_garbage({.dry_run = dry, .names = {name}});
    ASSERT_EQ(items.size(), 1u);
    EXPECT_FALSE(items[0].removable) << items[0].reason;
    EXPECT_NE(items[0].reason.find("in use"), std::string::npos) << items[0].reason;
    EXPECT_FALSE(items[0].removed_segment || items[0].removed_lock);
    EXPECT_TRUE(items[0].error.empty()) << items[0].error;
    EXPECT_TRUE(exists(segment_path(name))) << "gc (dry run " << dry << ") removed a live group's segment";
    EXPECT_TRUE(exists(lock_path_of(name)));
  }
  // A dry run over everything lists it as kept too.
  const std::optional<shm::GcItem> all = find_item(shm::collect_garbage({.dry_run = true, .names = {}}), name);
  ASSERT_TRUE(all.has_value());
  EXPECT_FALSE(all->removable) << all->reason;

  EXPECT_TRUE(group.release()) << group.describe();
  EXPECT_EQ(shm::inspect_segment(name).status, SegmentStatus::kMissing) << "the last rank to leave removes it";
}

TEST_F(ShmTools, KilledGroupIsStaleAndCollected) {
  const std::string name = unique_name();
  {
    TwoRanks group(name);
    ASSERT_TRUE(group.ready()) << group.describe();
    group.kill();
  }
  ASSERT_TRUE(exists(segment_path(name)));
  ASSERT_TRUE(exists(lock_path_of(name)));

  const std::optional<SegmentInfo> listed = find_listed(shm::list_segments(), name);
  ASSERT_TRUE(listed.has_value());
  EXPECT_EQ(listed->status, SegmentStatus::kValid) << listed->problem;
  ASSERT_TRUE(listed->ranks_read);
  EXPECT_EQ(listed->attached_ranks(), 2u);
  EXPECT_EQ(listed->alive_ranks(), 0u);
  for (const shm::RankInfo& r : listed->ranks) EXPECT_EQ(r.state_name(), "dead");
  EXPECT_FALSE(listed->creator_alive);

  // The dry run reports it and removes nothing.
  const std::vector<shm::GcItem> dry = shm::collect_garbage({.dry_run = true, .names = {name}});
  ASSERT_EQ(dry.size(), 1u);
  EXPECT_TRUE(dry[0].removable) << dry[0].reason;
  EXPECT_NE(dry[0].reason.find("no live rank"), std::string::npos) << dry[0].reason;
  EXPECT_FALSE(dry[0].removed_segment || dry[0].removed_lock);
  EXPECT_TRUE(exists(segment_path(name)));
  EXPECT_TRUE(exists(lock_path_of(name)));
  const std::optional<shm::GcItem> all = find_item(shm::collect_garbage({.dry_run = true, .names = {}}), name);
  ASSERT_TRUE(all.has_value());
  EXPECT_TRUE(all->removable) << all->reason;

  const std::vector<shm::GcItem> done = shm::collect_garbage({.dry_run = false, .names = {name}});
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].removable) << done[0].reason;
  EXPECT_TRUE(done[0].removed_segment);
  EXPECT_TRUE(done[0].removed_lock);
  EXPECT_TRUE(done[0].error.empty()) << done[0].error;
  EXPECT_FALSE(exists(segment_path(name)));
  EXPECT_FALSE(exists(lock_path_of(name)));
  EXPECT_EQ(shm::inspect_segment(name).status, SegmentStatus::kMissing);
}

TEST_F(ShmTools, PlantedFilesAreReportedAndKept) {
  Plants plants;
  struct Plant {
    std::string name;
    SegmentStatus status;
    std::string needle;  // in the problem
  };
  std::vector<Plant> expected;
  auto plant = [&](const std::vector<uint8_t>& bytes, mode_t mode, SegmentStatus status, std::string needle) {
    const std::string name = unique_name();
    plants.add(segment_path(name));
    write_file(segment_path(name), bytes, mode);
    expected.push_back({name, status, std::move(needle)});
    return name;
  };

  std::mt19937_64 rng(42);
  std::vector<uint8_t> random(4096);
  for (uint8_t& b : random) b = static_cast<uint8_t>(rng());
  random[0] ^= 0xff;  // never the magic
  plant(random, 0600, SegmentStatus::kNotTdshm, "no tdshm magic");
  plant({1, 2, 3}, 0600, SegmentStatus::kNotTdshm, "3 bytes");
  plant({}, 0600, SegmentStatus::kIncomplete, "empty");
  plant(std::vector<uint8_t>(8192, 0), 0600, SegmentStatus::kIncomplete, "zeros");
  std::vector<uint8_t> cut = prefix(shm::kLayoutVersion, 256, 1 << 20, 2);
  cut.resize(100);
  plant(cut, 0600, SegmentStatus::kTruncated, "shorter than its header");
  plant(prefix(99, 256, 4096, 2), 0600, SegmentStatus::kOtherVersion, "layout version 99");
  std::vector<uint8_t> v0 = prefix(0, 256, 4096, 2);
  v0.resize(4096);
  plant(v0, 0600, SegmentStatus::kIncomplete, "layout version 0");
  std::vector<uint8_t> corrupt = prefix(shm::kLayoutVersion, 256, 4096, 0);  // world size 0
  corrupt.resize(4096);
  plant(corrupt, 0600, SegmentStatus::kCorrupt, "world size");
  plant(prefix(99, 256, 4096, 1u << 30), 0600, SegmentStatus::kCorrupt, "world size");
  plant(random, 0644, SegmentStatus::kRefused, "mode 0644");

  // Another uid's file (needs root to make one).
  const passwd* nobody = ::getpwnam("nobody");
  if (::geteuid() == 0 && nobody != nullptr) {
    const std::string name = plant(v0, 0600, SegmentStatus::kRefused, "owned by uid " + std::to_string(nobody->pw_uid));
    ASSERT_EQ(::chown(segment_path(name).c_str(), nobody->pw_uid, nobody->pw_gid), 0) << std::strerror(errno);
  }
  // Symbolic links: to a file of ours (following it would read a tdshm-looking header) and dangling.
  const std::string target = segment_path(expected[5].name);  // the other-version header
  for (const std::string& to : {target, std::string("/dev/shm/tdshm-no-such-file")}) {
    const std::string name = unique_name();
    plants.add(segment_path(name));
    ASSERT_EQ(::symlink(to.c_str(), segment_path(name).c_str()), 0) << std::strerror(errno);
    expected.push_back({name, SegmentStatus::kRefused, "symbolic link"});
  }
  // A FIFO: never opened in a way that blocks.
  {
    const std::string name = unique_name();
    plants.add(segment_path(name));
    ASSERT_EQ(::mkfifo(segment_path(name).c_str(), 0600), 0) << std::strerror(errno);
    expected.push_back({name, SegmentStatus::kRefused, "not a regular file"});
  }

  std::vector<std::pair<std::string, struct stat>> before;
  for (const Plant& p : expected) {
    struct stat st {};
    ASSERT_EQ(::lstat(segment_path(p.name).c_str(), &st), 0);
    before.emplace_back(p.name, st);
  }

  const std::vector<SegmentInfo> listed = shm::list_segments({.details = true});
  for (const Plant& p : expected) {
    SCOPED_TRACE(p.name + " (expected " + shm::status_name(p.status) + ")");
    const std::optional<SegmentInfo> l = find_listed(listed, p.name);
    ASSERT_TRUE(l.has_value()) << "not listed";
    EXPECT_EQ(shm::status_name(l->status), std::string(shm::status_name(p.status))) << l->problem;
    EXPECT_NE(l->problem.find(p.needle), std::string::npos) << l->problem;
    EXPECT_FALSE(l->ranks_read);
    const SegmentInfo i = shm::inspect_segment(p.name, {.details = true});
    EXPECT_EQ(i.status, p.status) << i.problem;
    const auto [removable, reason] = shm::gc_decision(i);
    EXPECT_FALSE(removable) << reason;
    EXPECT_FALSE(reason.empty());
    if (p.status == SegmentStatus::kOtherVersion) {
      ASSERT_TRUE(i.details.has_value());
      EXPECT_FALSE(i.details->available);
      EXPECT_NE(i.details->note.find("details not available for layout version 99"), std::string::npos)
          << i.details->note;
    }
  }

  std::vector<std::string> names;
  for (const Plant& p : expected) names.push_back(p.name);
  const std::vector<shm::GcItem> items = shm::collect_garbage({.dry_run = false, .names = names});
  ASSERT_EQ(items.size(), expected.size());
  for (const shm::GcItem& item : items) {
    EXPECT_FALSE(item.removable) << item.name << ": " << item.reason;
    EXPECT_FALSE(item.removed_segment || item.removed_lock) << item.name;
    EXPECT_TRUE(item.error.empty()) << item.name << ": " << item.error;
    EXPECT_FALSE(exists(lock_path_of(item.name))) << item.name << ": gc left a lock file";
  }
  // Nothing was touched: the same inode, size, mode and times.
  for (const auto& [name, st] : before) {
    struct stat now {};
    ASSERT_EQ(::lstat(segment_path(name).c_str(), &now), 0) << name << " was removed";
    EXPECT_EQ(now.st_ino, st.st_ino) << name;
    EXPECT_EQ(now.st_size, st.st_size) << name;
    EXPECT_EQ(now.st_mode, st.st_mode) << name;
    EXPECT_EQ(now.st_mtim.tv_sec, st.st_mtim.tv_sec) << name;
    EXPECT_EQ(now.st_mtim.tv_nsec, st.st_mtim.tv_nsec) << name;
  }
  EXPECT_FALSE(exists("/dev/shm/tdshm-no-such-file")) << "a dangling link was followed";
}

TEST_F(ShmTools, InterruptedCreationAndLockFilesAlone) {
  Plants plants;
  const uint32_t dead = dead_pid();
  auto creator_record = [](uint32_t pid, uint64_t start_time, uint32_t creating) {
    std::vector<uint8_t> b(sizeof(shm::CreatorRecord), 0);
    const shm::CreatorRecord rec{shm::CreatorRecord::kMagic, pid, 0, start_time, creating, 0};
    std::memcpy(b.data(), &rec, sizeof rec);
    return b;
  };
  // A creation interrupted: zeros, and the lock file says its creator (dead) was creating it.
  const std::string interrupted = unique_name();
  plants.add(segment_path(interrupted));
  plants.add(lock_path_of(interrupted));
  write_file(segment_path(interrupted), std::vector<uint8_t>(8192, 0));
  write_file(lock_path_of(interrupted), creator_record(dead, 12345, 1));
  // A lock file alone, its creator dead.
  const std::string orphan = unique_name();
  plants.add(lock_path_of(orphan));
  write_file(lock_path_of(orphan), creator_record(dead, 12345, 0));
  // A lock file alone whose creator (this process) is creating: kept.
  const std::string creating = unique_name();
  plants.add(lock_path_of(creating));
  std::string stat_line;
  {
    std::ifstream in("/proc/self/stat");
    std::getline(in, stat_line);
  }
  std::istringstream fields(stat_line.substr(stat_line.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i) fields >> field;  // field 22: start time
  write_file(lock_path_of(creating), creator_record(static_cast<uint32_t>(::getpid()), std::stoull(field), 1));
  // A lock file alone that is another user's file's mode: refused, kept.
  const std::string open_lock = unique_name();
  plants.add(lock_path_of(open_lock));
  write_file(lock_path_of(open_lock), creator_record(dead, 12345, 0), 0644);

  const std::vector<SegmentInfo> listed = shm::list_segments();
  const auto l_interrupted = find_listed(listed, interrupted);
  ASSERT_TRUE(l_interrupted.has_value());
  EXPECT_EQ(l_interrupted->status, SegmentStatus::kIncomplete) << l_interrupted->problem;
  ASSERT_TRUE(l_interrupted->lock.creator.has_value());
  EXPECT_FALSE(l_interrupted->lock.creator->alive);
  EXPECT_TRUE(l_interrupted->lock.creating);
  for (const std::string& n : {orphan, creating, open_lock}) {
    const auto l = find_listed(listed, n);
    ASSERT_TRUE(l.has_value()) << n << " (a lock file alone) is not listed";
    EXPECT_EQ(l->status, SegmentStatus::kLockOnly) << n;
  }
  EXPECT_TRUE(find_listed(listed, creating)->lock.creator->alive);
  EXPECT_TRUE(find_listed(listed, open_lock)->lock.refused);

  const std::vector<std::string> names{interrupted, orphan, creating, open_lock};
  const std::vector<shm::GcItem> dry = shm::collect_garbage({.dry_run = true, .names = names});
  ASSERT_EQ(dry.size(), 4u);
  EXPECT_TRUE(dry[0].removable) << dry[0].reason;
  EXPECT_TRUE(dry[1].removable) << dry[1].reason;
  EXPECT_FALSE(dry[2].removable) << dry[2].reason;
  EXPECT_NE(dry[2].reason.find("being created"), std::string::npos) << dry[2].reason;
  EXPECT_FALSE(dry[3].removable) << dry[3].reason;
  EXPECT_TRUE(exists(segment_path(interrupted)) && exists(lock_path_of(interrupted)) && exists(lock_path_of(orphan)));

  const std::vector<shm::GcItem> done = shm::collect_garbage({.dry_run = false, .names = names});
  ASSERT_EQ(done.size(), 4u);
  EXPECT_TRUE(done[0].removed_segment && done[0].removed_lock) << done[0].reason << done[0].error;
  EXPECT_FALSE(done[1].removed_segment);
  EXPECT_TRUE(done[1].removed_lock) << done[1].reason << done[1].error;
  EXPECT_FALSE(exists(segment_path(interrupted)));
  EXPECT_FALSE(exists(lock_path_of(interrupted)));
  EXPECT_FALSE(exists(lock_path_of(orphan)));
  EXPECT_TRUE(exists(lock_path_of(creating)));
  EXPECT_TRUE(exists(lock_path_of(open_lock)));
  for (const shm::GcItem& item : done) EXPECT_TRUE(item.error.empty()) << item.name << ": " << item.error;
}

/// A version 4 segment of world 2, ring_entries 4, slot_bytes 64 (entry 192 B, ring 896 B, rings
/// at 512, 4096 bytes): rank 0 Live with a dead pid, rank 1 Left; ring 0->1 holds two published
/// entries (positions 4 and 5: a 64-byte and a 10-byte first chunk), ring 1->0 has head < tail.
std::vector<uint8_t> v4_segment(uint32_t dead) {
  std::vector<uint8_t> b = prefix(4, 256, 4096, 2);
  b.resize(4096);
  put<uint32_t>(b, 28, 4);       // ring_entries
  put<uint64_t>(b, 32, 64);      // slot_bytes
  put<uint64_t>(b, 40, 256);     // rank_table_offset
  put<uint64_t>(b, 48, 512);     // rings_offset
  put<uint64_t>(b, 56, 896);     // ring_bytes
  put<uint64_t>(b, 64, 192);     // entry_bytes
  put<uint32_t>(b, 72, dead);    // creator_pid
  put<uint64_t>(b, 88, 0xabcdef);  // incarnation
  put<uint32_t>(b, 256 + 0, 1);  // rank 0: Live, pid dead
  put<uint32_t>(b, 256 + 4, dead);
  put<uint64_t>(b, 256 + 8, 12345);
  put<uint32_t>(b, 256 + 64, 17);  // wake_seq
  put<uint32_t>(b, 384 + 0, 2);    // rank 1: Left
  put<uint32_t>(b, 384 + 4, dead);
  const size_t r01 = 512 + 1 * 896, r10 = 512 + 2 * 896;
  put<uint64_t>(b, r01 + 0, 6);   // head
  put<uint64_t>(b, r01 + 64, 4);  // tail
  // Position 4 -> entry 0, position 5 -> entry 1: seq = position + 1, chunk_bytes, flags.
  put<uint64_t>(b, r01 + 128 + 0 * 192 + 0, 5);
  put<uint32_t>(b, r01 + 128 + 0 * 192 + 32, 64);
  put<uint32_t>(b, r01 + 128 + 0 * 192 + 36, 3);
  put<uint64_t>(b, r01 + 128 + 1 * 192 + 0, 6);
  put<uint32_t>(b, r01 + 128 + 1 * 192 + 32, 10);
  put<uint32_t>(b, r01 + 128 + 1 * 192 + 36, 1);
  put<uint64_t>(b, r10 + 0, 3);   // head < tail: inconsistent
  put<uint64_t>(b, r10 + 64, 9);
  return b;
}

TEST_F(ShmTools, LayoutVersion4Details) {
  Plants plants;
  const uint32_t dead = dead_pid();
  const std::string name = unique_name();
  plants.add(segment_path(name));
  write_file(segment_path(name), v4_segment(dead));

  const SegmentInfo info = shm::inspect_segment(name, {.details = true});
  ASSERT_TRUE(info.details.has_value()) << shm::status_name(info.status) << ": " << info.problem;
  const shm::LayoutDetails& d = *info.details;
  EXPECT_EQ(d.layout_version, 4u);
  ASSERT_TRUE(d.available) << d.note;
  ASSERT_EQ(d.pairs.size(), 4u);
  EXPECT_EQ(d.pairs[0].depth, 0u);
  EXPECT_TRUE(d.pairs[0].note.empty());
  const shm::PairInfo& p01 = d.pairs[1];
  EXPECT_EQ(p01.src, 0u);
  EXPECT_EQ(p01.dst, 1u);
  EXPECT_EQ(p01.head, 6u);
  EXPECT_EQ(p01.tail, 4u);
  EXPECT_EQ(p01.depth, 2u);
  EXPECT_EQ(p01.messages, 2u);
  EXPECT_EQ(p01.bytes_in_flight, 74u);
  EXPECT_TRUE(p01.note.empty()) << p01.note;
  EXPECT_NE(d.pairs[2].note.find("disagree"), std::string::npos) << d.pairs[2].note;
  ASSERT_EQ(d.counters.size(), 2u);
  EXPECT_EQ(d.counters[0].wake_seq, 17u);
  EXPECT_TRUE(d.arenas.empty());

  // Its ranks (one dead, one left), through version 4's rank table whatever this build's version.
  ASSERT_TRUE(info.ranks_read) << info.problem;
  ASSERT_EQ(info.ranks.size(), 2u);
  EXPECT_EQ(info.ranks[0].state_name(), "dead");
  EXPECT_EQ(info.ranks[0].pid, dead);
  EXPECT_EQ(info.ranks[1].state_name(), "left");
  EXPECT_EQ(info.alive_ranks(), 0u);
  ASSERT_TRUE(info.details->rank_table_offset.has_value());
  EXPECT_EQ(*info.details->rank_table_offset, 256u);
  const auto [removable, reason] = shm::gc_decision(info);
  if (shm::kLayoutVersion == 4) {
    EXPECT_EQ(info.status, SegmentStatus::kValid) << info.problem;
    EXPECT_TRUE(removable) << reason;  // this build's version, no live rank: stale
  } else {
    // Another version: listed with its ranks too (without details asked for), never collected.
    EXPECT_EQ(info.status, SegmentStatus::kOtherVersion) << info.problem;
    EXPECT_FALSE(removable);
    EXPECT_NE(reason.find("no live rank"), std::string::npos) << reason;
    const std::optional<SegmentInfo> listed = find_listed(shm::list_segments(), name);
    ASSERT_TRUE(listed.has_value());
    EXPECT_TRUE(listed->ranks_read);
    EXPECT_FALSE(listed->details.has_value());
    const std::vector<shm::GcItem> done = shm::collect_garbage({.dry_run = false, .names = {name}});
    ASSERT_EQ(done.size(), 1u);
    EXPECT_FALSE(done[0].removable || done[0].removed_segment);
    EXPECT_TRUE(exists(segment_path(name)));
  }

  // The same header over a file cut after the first ring: the rest is beyond the end, no fault.
  const int fd = ::open(segment_path(name).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::array<uint8_t, 256> header{};
  ASSERT_EQ(::pread(fd, header.data(), header.size(), 0), 256);
  const shm::LayoutDetails cut = shm::read_layout_details(fd, 512 + 896 + 100, header.data(), header.size(), 4, 2, {});
  EXPECT_TRUE(cut.available);
  ASSERT_EQ(cut.pairs.size(), 4u);
  EXPECT_TRUE(cut.pairs[0].note.empty());
  EXPECT_NE(cut.pairs[2].note.find("beyond the end"), std::string::npos) << cut.pairs[2].note;
  // Geometry that disagrees with its parameters is not used.
  std::array<uint8_t, 256> bad = header;
  const uint64_t ring_bytes = 897;
  std::memcpy(bad.data() + 56, &ring_bytes, sizeof ring_bytes);
  const shm::LayoutDetails wrong = shm::read_layout_details(fd, 4096, bad.data(), bad.size(), 4, 2, {});
  EXPECT_FALSE(wrong.available);
  EXPECT_TRUE(wrong.pairs.empty());
  // Any other version: not available, and says so.
  const shm::LayoutDetails other = shm::read_layout_details(fd, 4096, header.data(), header.size(), 7, 2, {});
  EXPECT_FALSE(other.available);
  EXPECT_EQ(other.note, "details not available for layout version 7");
  ::close(fd);
}

// ---------------------------------------------------------------------------------------------
// The commands of the built tool

#ifdef TDSHM_TOOL_PATH
constexpr const char* kTool = TDSHM_TOOL_PATH;
#else
constexpr const char* kTool = "";
#endif

struct ToolRun {
  int rc = -1;  // exit code, or 128 + signal
  std::string out;
  std::string err;
  std::string describe(const std::string& args) const {
    return "tdshm " + args + " -> " + std::to_string(rc) + "\n--- stdout\n" + out + "--- stderr\n" + err;
  }
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// Runs the tool with `args` (stdout and stderr to files), killing it after `timeout`.
ToolRun run_tool(const std::vector<std::string>& args, Clock::duration timeout = 30s) {
  static std::atomic<int> counter{0};
  const std::string stem = "/tmp/tdshm-cli-test-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
  const std::string out_path = stem + ".out", err_path = stem + ".err";
  std::vector<std::string> argv_s{kTool};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0 || err < 0) ::_exit(126);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execv(kTool, argv.data());
    ::_exit(127);
  }
  ToolRun run;
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(5ms);
  }
  run.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  run.out = slurp(out_path);
  run.err = slurp(err_path);
  ::unlink(out_path.c_str());
  ::unlink(err_path.c_str());
  return run;
}

bool has(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

/// The line of `tdshm ls` (or gc) output that names `name`, or "".
std::string line_of(const std::string& out, const std::string& name) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, name.size() + 1, name + " ") == 0 || has(line, " " + name + " ") || has(line, " " + name + ":")) {
      return line;
    }
  }
  return {};
}

TEST_F(ShmCli, LsInspectGcOnLiveThenKilledGroup) {
  if (kTool[0] == '\0' || ::access(kTool, X_OK) != 0) GTEST_SKIP() << "the tdshm tool is not built";
  set_deadline(180s);
  const ToolRun help = run_tool({"help"});
  ASSERT_TRUE(has(help.out, "inspect")) << kTool << " has no ls/inspect/gc: an old build? rebuild tdshm_cli\n"
                                        << help.describe("help");
  Plants plants;
  const std::string garbage = unique_name();
  plants.add(segment_path(garbage));
  write_file(segment_path(garbage), std::vector<uint8_t>(100, 0x5a));

  const std::string name = unique_name();
  TwoRanks group(name);
  ASSERT_TRUE(group.ready()) << group.describe();

  ToolRun ls = run_tool({"ls"});
  EXPECT_EQ(ls.rc, 0) << ls.describe("ls");
  EXPECT_TRUE(has(ls.out, "NAME") && has(ls.out, "ATT/ALIVE")) << ls.describe("ls");
  std::string row = line_of(ls.out, name);
  EXPECT_TRUE(has(row, "2/2") && has(row, "in use")) << "row: " << row << "\n" << ls.describe("ls");
  row = line_of(ls.out, garbage);
  EXPECT_TRUE(has(row, "not-tdshm")) << "row: " << row << "\n" << ls.describe("ls");

  ToolRun js = run_tool({"ls", "--json"});
  EXPECT_EQ(js.rc, 0) << js.describe("ls --json");
  EXPECT_TRUE(has(js.out, "\"name\": \"" + name + "\"") && has(js.out, "\"alive_ranks\": 2")) << js.describe("ls --json");
  EXPECT_EQ(js.out.front(), '{') << js.describe("ls --json");

  ToolRun in = run_tool({"inspect", name});
  EXPECT_EQ(in.rc, 0) << in.describe("inspect");
  for (const char* needle : {"status     in use (2 of 2 ranks alive", "layout version", "world size 2", "RANK", "live",
                             "gc         keeps: in use", "details"}) {
    EXPECT_TRUE(has(in.out, needle)) << "no '" << needle << "' in\n" << in.describe("inspect " + name);
  }
  ToolRun inj = run_tool({"inspect", "--json", name});
  EXPECT_EQ(inj.rc, 0) << inj.describe("inspect --json");
  EXPECT_TRUE(has(inj.out, "\"status\": \"valid\"") && has(inj.out, "\"details\": {")) << inj.describe("inspect --json");

  ToolRun dry = run_tool({"gc", "--dry-run"});
  EXPECT_EQ(dry.rc, 0) << dry.describe("gc --dry-run");
  row = line_of(dry.out, name);
  EXPECT_TRUE(has(row, "would keep") && has(row, "in use")) << "row: " << row << "\n" << dry.describe("gc --dry-run");
  row = line_of(dry.out, garbage);
  EXPECT_TRUE(has(row, "would keep")) << "row: " << row << "\n" << dry.describe("gc --dry-run");
  ToolRun gc = run_tool({"gc", name, garbage});
  EXPECT_EQ(gc.rc, 0) << gc.describe("gc NAME GARBAGE");
  EXPECT_TRUE(has(line_of(gc.out, name), "kept")) << gc.describe("gc NAME");
  EXPECT_TRUE(exists(segment_path(name)) && exists(segment_path(garbage)));

  group.kill();
  ls = run_tool({"ls"});
  row = line_of(ls.out, name);
  EXPECT_TRUE(has(row, "2/0") && has(row, "stale")) << "row: " << row << "\n" << ls.describe("ls");
  in = run_tool({"inspect", name});
  EXPECT_EQ(in.rc, 0) << in.describe("inspect");
  EXPECT_TRUE(has(in.out, "dead") && has(in.out, "would remove")) << in.describe("inspect");

  dry = run_tool({"gc", "--dry-run", name});
  EXPECT_EQ(dry.rc, 0) << dry.describe("gc --dry-run NAME");
  EXPECT_TRUE(has(line_of(dry.out, name), "would remove")) << dry.describe("gc --dry-run NAME");
  EXPECT_TRUE(exists(segment_path(name)) && exists(lock_path_of(name))) << "the dry run removed something";

  gc = run_tool({"gc", name, garbage});
  EXPECT_EQ(gc.rc, 0) << gc.describe("gc NAME GARBAGE");
  row = line_of(gc.out, name);
  EXPECT_TRUE(has(row, "removed") && has(row, ".lock")) << "row: " << row << "\n" << gc.describe("gc NAME");
  EXPECT_TRUE(has(line_of(gc.out, garbage), "kept")) << gc.describe("gc NAME GARBAGE");
  EXPECT_FALSE(exists(segment_path(name)));
  EXPECT_FALSE(exists(lock_path_of(name)));
  EXPECT_TRUE(exists(segment_path(garbage)));

  in = run_tool({"inspect", name});
  EXPECT_EQ(in.rc, 1) << in.describe("inspect (removed)");
  in = run_tool({"inspect", garbage});
  EXPECT_EQ(in.rc, 3) << in.describe("inspect GARBAGE");
  EXPECT_TRUE(has(in.out, "not-tdshm")) << in.describe("inspect GARBAGE");
  in = run_tool({"inspect", "bad/name"});
  EXPECT_EQ(in.rc, 1) << in.describe("inspect bad/name");
  EXPECT_EQ(run_tool({"inspect"}).rc, 2);
  EXPECT_EQ(run_tool({"gc", "--bogus"}).rc, 2);
  EXPECT_EQ(run_tool({"ls", "extra"}).rc, 2);
}

}  // namespace
}  // namespace tdshm::test
