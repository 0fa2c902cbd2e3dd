// The operator tools: the read-only segment reader and gc of src/shm/reader/inspect.h (suite ShmTools)
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
//    is alive and creating is kept. Locality probe files: a dead pid's removed, a live one's kept.
//  - Layout version 5 details of a live group of three forked ranks with messages in flight
//    (InFlightGroup: rank 0 -> 1 an inline 8 B, a 100 KiB and a 4 KiB message, rank 2 -> 1 one of
//    1000 B, none received yet): exact ring depth, messages and bytes per pair, and each rank's
//    arena slots in use per destination; after rank 1 has received them all, depth 0 and no slot
//    in use. A synthetic version 5 file: inconsistent head/tail, malformed entries, slot states
//    naming no rank, a file cut short or shrunk under the reader, geometry that disagrees.
//  - Layout version 4 ring details (per-pair depth, messages, bytes in flight) read from a
//    synthetic version 4 file, whatever this build's layout version is; any other version
//    reports "details not available".
//
// Names are unique per test (ShmTest::unique_name, the pid in it); every planted path is
// unlinked at the end of its test whatever happened (Plants); every wait has a deadline.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/board.h>
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

#include "process_group/shm_group_seam.h"
#include "shm/layout/segment_layout.h"
#include "shm/reader/inspect.h"
#include "shm/segment/gc.h"
#include "shm_test_support.h"

namespace tdshm::test {

using detail::ShmGroupSeam;
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

/// Entries and arena slots one message of `bytes` takes with slots of `slot_bytes`, sent into a
/// ring of `ring_entries` with room (segment_layout.h): up to kInlineBytes in its entry; a whole
/// message up to span_limit in a span (its entry and span_entries after it); else one entry per
/// chunk of up to slot_bytes, a chunk of up to kInlineBytes in its entry, a larger one in a slot.
struct Footprint {
  uint64_t entries = 0;
  uint64_t slots = 0;
};
Footprint footprint(uint64_t bytes, uint64_t slot_bytes, uint32_t ring_entries) {
  Footprint f;
  if (bytes > shm::kInlineBytes && bytes <= std::min(slot_bytes, shm::span_limit(ring_entries))) {
    f.entries = 1 + shm::span_entries(bytes);
    return f;
  }
  uint64_t left = bytes;
  do {
    const uint64_t chunk = std::min(left, slot_bytes);
    ++f.entries;
    if (chunk > shm::kInlineBytes) ++f.slots;
    left -= chunk;
  } while (left > 0);
  return f;
}

/// A group of three forked ranks of ProcessGroupShm on `name` with the default slot geometry
/// (64 KiB slots, 64 per rank, 64-entry rings) and messages in flight: rank 0 sends to rank 1
/// three messages of kBytes01 (8 B inline, 100 KiB in two slots, 4 KiB in one), rank 2 sends
/// rank 1 one of kBytes21; rank 1 receives them only in receive(). Every rank stays attached
/// until release(), so the segment can be inspected before and after the receives. Each wait has
/// a deadline; a group not released cleanly is killed and its segment removed by the destructor.
class InFlightGroup {
 public:
  static constexpr int kWorld = 3;
  static constexpr std::array<uint64_t, 3> kBytes01{8, 100 << 10, 4 << 10};
  static constexpr uint64_t kBytes21 = 1000;

  explicit InFlightGroup(const std::string& name) : name_(name) {
    ShmOptions opts = default_slot_options();
    opts.timeout = 30s;
    slot_bytes_ = opts.slot_bytes;
    slots_per_rank_ = opts.slots_per_rank;
    for (int r = 0; r < kWorld; ++r) {
      children_.emplace_back([this, r, name, opts] {
        ProcessGroupShm pg(name, r, kWorld, opts);
        auto message = [](uint64_t bytes, uint64_t seed) {
          return pattern(at::kFloat, static_cast<int64_t>(bytes / sizeof(float)), seed);
        };
        if (r == 0) {
          for (size_t i = 0; i < kBytes01.size(); ++i) {
            const at::Tensor t = message(kBytes01[i], i);
            SHM_CHECK(post_send(pg, t, 1, static_cast<int>(i + 1))->wait(), "isend " << i);
          }
        } else if (r == 2) {
          SHM_CHECK(post_send(pg, message(kBytes21, 9), 1, 9)->wait(), "isend");
        }
        state_->ready.fetch_add(1);
        const auto deadline = Clock::now() + 90s;
        if (r == 1) {
          // Nothing touches the group (no progress, no helper thread) until told to receive.
          while (!state_->receive.load() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
          SHM_CHECK(state_->receive.load(), "never told to receive");
          for (size_t i = 0; i < kBytes01.size(); ++i) {
            const at::Tensor want = message(kBytes01[i], i);
            const at::Tensor got = at::zeros_like(want);
            SHM_CHECK(post_recv(pg, got, 0, static_cast<int>(i + 1))->wait(), "recv " << i);
            SHM_CHECK(same_bytes(got, want), "wrong bytes in message " << i);
          }
          const at::Tensor want = message(kBytes21, 9);
          const at::Tensor got = at::zeros_like(want);
          SHM_CHECK(post_recv(pg, got, 2, 9)->wait(), "recv from rank 2");
          SHM_CHECK(same_bytes(got, want), "wrong bytes from rank 2");
          state_->received.store(true);
        }
        while (!state_->release.load() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
        SHM_CHECK(state_->release.load(), "never released");
      });
    }
    ready_ = wait_for([&] { return state_->ready.load() == kWorld; }, 30s);
  }
  ~InFlightGroup() {
    if (released_) return;
    for (Child& c : children_) c.kill();
    wait_all(children_, 10s);
    remove_shm_entries_of(name_);
  }
  InFlightGroup(const InFlightGroup&) = delete;
  InFlightGroup& operator=(const InFlightGroup&) = delete;

  bool ready() const { return ready_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint32_t slots_per_rank() const { return slots_per_rank_; }
  std::string describe() const {
    std::string out;
    for (const Child& c : children_) out += (out.empty() ? "" : "; ") + c.describe();
    return out;
  }
  /// Lets rank 1 receive every message; true once it has.
  bool receive() {
    state_->receive.store(true);
    return wait_for([&] { return state_->received.load(); }, 30s);
  }
  /// Lets every rank leave (the last removes the segment); true if all exited with 0.
  bool release() {
    state_->receive.store(true);  // (a rank 1 still waiting to receive may finish)
    state_->release.store(true);
    wait_all(children_, 30s);
    released_ = std::all_of(children_.begin(), children_.end(), [](const Child& c) { return c.ok(); });
    return released_;
  }

 private:
  struct State {
    std::atomic<int> ready{0};
    std::atomic<bool> receive{false};
    std::atomic<bool> received{false};
    std::atomic<bool> release{false};
  };
  /// Polls `done` until it holds, a child exits or the deadline passes.
  template <class Done>
  bool wait_for(Done done, Clock::duration timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!done() && Clock::now() < deadline) {
      bool exited = false;
      for (Child& c : children_) exited |= c.poll();
      if (exited) break;
      std::this_thread::sleep_for(2ms);
    }
    return done();
  }

  std::string name_;
  Shared<State> state_;
  std::vector<Child> children_;
  uint64_t slot_bytes_ = 0;
  uint32_t slots_per_rank_ = 0;
  bool ready_ = false;
  bool released_ = false;
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
  for (const shm::RankInfo& r : info.ranks) {  // C++ ranks with the default options offer both
    EXPECT_EQ(r.features, shm::kRankFeatureMemmapByReference | shm::kRankFeatureTdshmTransfers) << "rank " << r.rank;
    EXPECT_EQ(r.feature_names(), (std::vector<std::string>{"memmap_by_reference", "tdshm_transfers"}));
  }
  shm::RankInfo other;
  other.features = shm::kRankFeatureTdshmTransfers | (uint32_t{1} << 7);  // a bit a later build may set
  EXPECT_EQ(other.feature_names(), (std::vector<std::string>{"tdshm_transfers", "bit 7"}));
  ASSERT_TRUE(info.details.has_value());
  if (shm::kLayoutVersion >= 5) {
    // One ring per ordered pair; rank 1's message to rank 0 (64 bytes: inline, no slot) is in it.
    ASSERT_TRUE(info.details->available) << info.details->note;
    ASSERT_EQ(info.details->pairs.size(), 4u);
    const shm::PairInfo& p10 = info.details->pairs[2];
    EXPECT_EQ(p10.src, 1u);
    EXPECT_EQ(p10.dst, 0u);
    EXPECT_EQ(p10.head, 1u);
    EXPECT_EQ(p10.tail, 0u);
    EXPECT_EQ(p10.depth, 1u);
    EXPECT_EQ(p10.messages, 1u);
    EXPECT_EQ(p10.bytes_in_flight, 64u);
    EXPECT_TRUE(p10.note.empty()) << p10.note;
    ASSERT_EQ(info.details->arenas.size(), 2u);
    for (const shm::ArenaInfo& a : info.details->arenas) EXPECT_EQ(a.slots_taken, 0u) << "rank " << a.owner;
  } else if (!info.details->available) {
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

// The probe files of a world that was forming (process_group/locality.h): one whose pid no longer
// runs is removed (a dry run only says so), one of a live process is kept; neither is taken for a
// segment by the listing.
TEST_F(ShmTools, StaleLocalityProbesAreCollected) {
  Plants plants;
  const std::string stale =
      std::string("tdshm-probe.") + std::to_string(dead_pid()) + ".0123456789abcdef0123456789abcdef";
  const std::string live =
      std::string("tdshm-probe.") + std::to_string(::getpid()) + ".fedcba9876543210fedcba9876543210";
  for (const std::string& n : {stale, live}) {
    plants.add("/dev/shm/" + n);
    write_file("/dev/shm/" + n, {});
  }
  auto item_of = [](const std::vector<shm::GcItem>& items, const std::string& name) {
    return std::find_if(items.begin(), items.end(), [&](const shm::GcItem& i) { return i.name == name; });
  };
  const std::vector<shm::GcItem> dry = shm::collect_probes(true);
  ASSERT_NE(item_of(dry, stale), dry.end());
  EXPECT_TRUE(item_of(dry, stale)->removable) << item_of(dry, stale)->reason;
  EXPECT_FALSE(item_of(dry, stale)->removed_segment);
  EXPECT_TRUE(exists("/dev/shm/" + stale)) << "a dry run removed it";
  ASSERT_NE(item_of(dry, live), dry.end());
  EXPECT_FALSE(item_of(dry, live)->removable);
  EXPECT_NE(item_of(dry, live)->reason.find("which runs"), std::string::npos) << item_of(dry, live)->reason;
  const std::vector<shm::GcItem> done = shm::collect_probes(false);
  ASSERT_NE(item_of(done, stale), done.end());
  EXPECT_TRUE(item_of(done, stale)->removed_segment);
  EXPECT_FALSE(exists("/dev/shm/" + stale));
  EXPECT_TRUE(exists("/dev/shm/" + live)) << "a live process's probe was removed";
  for (const shm::SegmentInfo& info : shm::list_segments()) {
    EXPECT_EQ(info.name.find("probe"), std::string::npos) << "listed as a segment: " << info.name;
  }
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

/// The version 5 details of pair src -> dst, with a trace of every pair on failure.
const shm::PairInfo& pair_of(const shm::LayoutDetails& d, uint32_t world, uint32_t src, uint32_t dst) {
  const shm::PairInfo& p = d.pairs.at(size_t{src} * world + dst);
  EXPECT_EQ(p.src, src);
  EXPECT_EQ(p.dst, dst);
  return p;
}

std::vector<std::pair<uint32_t, uint64_t>> by_dst(std::initializer_list<std::pair<uint32_t, uint64_t>> l) { return l; }

TEST_F(ShmTools, LayoutVersion5DetailsOfMessagesInFlight) {
  if (shm::kLayoutVersion < 5) GTEST_SKIP() << "this build's layout is version " << shm::kLayoutVersion;
  set_deadline(150s);
  const std::string name = unique_name();
  InFlightGroup group(name);
  ASSERT_TRUE(group.ready()) << group.describe();
  constexpr uint32_t kWorld = InFlightGroup::kWorld;
  const uint64_t slot = group.slot_bytes();

  // What the layout says the messages take: 8 B inline is 1 entry and no slot, 100 KiB is 2
  // entries and 2 slots of 64 KiB, 4 KiB (past the span limit) 1 entry and 1 slot; rank 2's
  // 1000 B a span of 1 + 6 entries.
  uint64_t entries01 = 0, slots01 = 0, bytes01 = 0;
  for (const uint64_t bytes : InFlightGroup::kBytes01) {
    const Footprint f = footprint(bytes, slot, 64);
    entries01 += f.entries;
    slots01 += f.slots;
    bytes01 += bytes;
  }
  ASSERT_EQ(slot, uint64_t{64} << 10);
  ASSERT_EQ(entries01, 4u);
  ASSERT_EQ(slots01, 3u);
  ASSERT_EQ(bytes01, 8u + 102400u + 4096u);
  const Footprint f21 = footprint(InFlightGroup::kBytes21, slot, 64);
  ASSERT_EQ(f21.entries, 7u);
  ASSERT_EQ(f21.slots, 0u);

  const SegmentInfo info = shm::inspect_segment(name, {.details = true});
  EXPECT_EQ(info.status, SegmentStatus::kValid) << info.problem;
  ASSERT_TRUE(info.ranks_read);
  EXPECT_EQ(info.alive_ranks(), kWorld);
  ASSERT_TRUE(info.details.has_value());
  const shm::LayoutDetails& d = *info.details;
  EXPECT_EQ(d.layout_version, shm::kLayoutVersion);
  ASSERT_TRUE(d.available) << d.note;
  EXPECT_TRUE(d.note.empty()) << d.note;
  ASSERT_TRUE(d.rank_table_offset.has_value());
  EXPECT_EQ(*d.rank_table_offset, sizeof(shm::SegmentHeader));
  ASSERT_EQ(d.pairs.size(), size_t{kWorld} * kWorld);
  for (const shm::PairInfo& p : d.pairs) {
    SCOPED_TRACE(std::to_string(p.src) + "->" + std::to_string(p.dst));
    EXPECT_FALSE(p.inconsistent);
    EXPECT_TRUE(p.note.empty()) << p.note;
    if ((p.src == 0 || p.src == 2) && p.dst == 1) continue;
    EXPECT_EQ(p.head, 0u);
    EXPECT_EQ(p.depth, 0u);
  }
  const shm::PairInfo& p01 = pair_of(d, kWorld, 0, 1);
  EXPECT_EQ(p01.head, entries01);
  EXPECT_EQ(p01.tail, 0u);
  EXPECT_EQ(p01.depth, entries01);
  EXPECT_EQ(p01.messages, InFlightGroup::kBytes01.size());
  EXPECT_EQ(p01.bytes_in_flight, bytes01);
  const shm::PairInfo& p21 = pair_of(d, kWorld, 2, 1);
  EXPECT_EQ(p21.head, f21.entries);
  EXPECT_EQ(p21.depth, f21.entries);
  EXPECT_EQ(p21.messages, 1u);
  EXPECT_EQ(p21.bytes_in_flight, InFlightGroup::kBytes21);

  ASSERT_EQ(d.arenas.size(), size_t{kWorld});
  for (const shm::ArenaInfo& a : d.arenas) {
    EXPECT_TRUE(a.read) << a.note;
    EXPECT_EQ(a.slots, group.slots_per_rank());
    EXPECT_EQ(a.invalid_states, 0u);
    EXPECT_TRUE(a.note.empty()) << a.note;
  }
  EXPECT_EQ(d.arenas[0].owner, 0u);
  EXPECT_EQ(d.arenas[0].slots_taken, slots01);
  EXPECT_EQ(d.arenas[0].bytes_taken, slots01 * slot);
  EXPECT_EQ(d.arenas[0].taken_by_dst, by_dst({{1, slots01}}));
  EXPECT_EQ(d.arenas[1].slots_taken, 0u);
  EXPECT_TRUE(d.arenas[1].taken_by_dst.empty());
  EXPECT_EQ(d.arenas[2].slots_taken, f21.slots);
  EXPECT_EQ(d.arenas[2].bytes_taken, f21.slots * slot);
  EXPECT_TRUE(d.arenas[2].taken_by_dst.empty());
  ASSERT_EQ(d.counters.size(), size_t{kWorld});
  for (uint32_t r = 0; r < kWorld; ++r) EXPECT_EQ(d.counters[r].rank, r);

  // Rank 1 takes everything: the rings are empty and every slot is back.
  ASSERT_TRUE(group.receive()) << group.describe();
  const SegmentInfo after = shm::inspect_segment(name, {.details = true});
  ASSERT_TRUE(after.details.has_value() && after.details->available) << after.problem;
  const shm::LayoutDetails& e = *after.details;
  ASSERT_EQ(e.pairs.size(), size_t{kWorld} * kWorld);
  for (const shm::PairInfo& p : e.pairs) {
    SCOPED_TRACE(std::to_string(p.src) + "->" + std::to_string(p.dst));
    EXPECT_FALSE(p.inconsistent) << p.note;
    EXPECT_EQ(p.depth, 0u);
    EXPECT_EQ(p.head, p.tail);
    EXPECT_EQ(p.messages, 0u);
    EXPECT_EQ(p.bytes_in_flight, 0u);
  }
  EXPECT_EQ(pair_of(e, kWorld, 0, 1).tail, entries01);
  EXPECT_EQ(pair_of(e, kWorld, 2, 1).tail, f21.entries);
  ASSERT_EQ(e.arenas.size(), size_t{kWorld});
  for (const shm::ArenaInfo& a : e.arenas) {
    EXPECT_TRUE(a.read);
    EXPECT_EQ(a.slots_taken, 0u) << "rank " << a.owner;
    EXPECT_EQ(a.bytes_taken, 0u) << "rank " << a.owner;
    EXPECT_TRUE(a.taken_by_dst.empty()) << "rank " << a.owner;
  }

  EXPECT_TRUE(group.release()) << group.describe();
  EXPECT_EQ(shm::inspect_segment(name).status, SegmentStatus::kMissing) << "the last rank to leave removes it";
}

/// A version 5 segment of world 3, ring_entries 4, slot_bytes 100, slots_per_rank 3: entry 192 B,
/// ring 896 B, rings at 640, arena at 8704, region 448 B (a 64-byte slot table, slots of 128 B),
/// 10048 bytes. Rank 0 Live with a dead pid (wake_seq 5, 1 sleeper), ranks 1 and 2 Left.
///   0->1  head 6, tail 4: position 4 an inline first+last chunk of 8 B, position 5 a first chunk
///         of 100 B in slot 0 (2 messages, 108 bytes)
///   0->2  head 3, tail 9: inconsistent (tail > head)
///   1->0  head 20, tail 10: inconsistent (more than 4 entries)
///   1->2  head 3, tail 0: position 0 a 500 B chunk (more than a slot), position 1 names slot 7
///         (of 3), position 2 an inline chunk of 80 B: malformed; nothing counted
///   2->0  head 2, tail 1: position 1 not published (seq 0): taken meanwhile, not counted
///   arena of rank 0: slot 0 for rank 1, slot 1 for rank 2, slot 2 in state 77 (no rank);
///   rank 1: none; rank 2: slot 1 for rank 0.
constexpr uint64_t kV5Rings = 640, kV5RingBytes = 896, kV5Arena = 8704, kV5Region = 448, kV5Bytes = 10048;

std::vector<uint8_t> v5_segment(uint32_t dead) {
  std::vector<uint8_t> b = prefix(5, 256, kV5Bytes, 3);
  b.resize(kV5Bytes);
  put<uint32_t>(b, 28, 4);             // ring_entries
  put<uint64_t>(b, 32, 100);           // slot_bytes
  put<uint64_t>(b, 40, 256);           // rank_table_offset
  put<uint64_t>(b, 48, kV5Rings);      // rings_offset
  put<uint64_t>(b, 56, kV5RingBytes);  // ring_bytes
  put<uint64_t>(b, 64, 192);           // entry_bytes
  put<uint32_t>(b, 72, dead);          // creator_pid
  put<uint64_t>(b, 88, 0x5eed);        // incarnation
  put<uint64_t>(b, 96, kV5Arena);      // arena_offset
  put<uint64_t>(b, 104, kV5Region);    // region_bytes
  put<uint32_t>(b, 112, 3);            // slots_per_rank
  put<uint32_t>(b, 256 + 0, 1);        // rank 0: Live, pid dead
  put<uint32_t>(b, 256 + 4, dead);
  put<uint64_t>(b, 256 + 8, 12345);
  put<uint32_t>(b, 256 + 64, 5);  // wake_seq
  put<uint32_t>(b, 256 + 68, 1);  // sleepers
  for (int r = 1; r < 3; ++r) {
    put<uint32_t>(b, 256 + 128 * r, 2);  // Left
    put<uint32_t>(b, 256 + 128 * r + 4, dead);
  }
  auto ring = [](int src, int dst) { return kV5Rings + (uint64_t(src) * 3 + dst) * kV5RingBytes; };
  auto entry = [&](int src, int dst, uint64_t pos) { return ring(src, dst) + 128 + (pos % 4) * 192; };
  auto control = [&](int src, int dst, uint64_t head, uint64_t tail) {
    put<uint64_t>(b, ring(src, dst) + 0, head);
    put<uint64_t>(b, ring(src, dst) + 64, tail);
  };
  auto publish = [&](int src, int dst, uint64_t pos, uint32_t chunk, uint32_t flags, uint32_t slot) {
    put<uint64_t>(b, entry(src, dst, pos) + 0, pos + 1);  // seq
    put<uint32_t>(b, entry(src, dst, pos) + 32, chunk);
    put<uint32_t>(b, entry(src, dst, pos) + 36, flags);
    put<uint32_t>(b, entry(src, dst, pos) + 48, slot);
  };
  constexpr uint32_t kFirst = 1, kLast = 2, kInline = 64;
  control(0, 1, 6, 4);
  publish(0, 1, 4, 8, kFirst | kLast | kInline, 0);
  publish(0, 1, 5, 100, kFirst, 0);
  control(0, 2, 3, 9);
  control(1, 0, 20, 10);
  control(1, 2, 3, 0);
  publish(1, 2, 0, 500, kFirst | kLast, 1);
  publish(1, 2, 1, 50, kFirst | kLast, 7);
  publish(1, 2, 2, 80, kFirst | kLast | kInline, 0);
  control(2, 0, 2, 1);
  auto state = [&](int owner, int slot, uint32_t v) { put<uint32_t>(b, kV5Arena + owner * kV5Region + slot * 8, v); };
  state(0, 0, 2);
  state(0, 1, 3);
  state(0, 2, 77);
  state(2, 1, 1);
  return b;
}

// A receiving pass lands every message that has a posted receive, past the first one to complete,
// and leaves a message that has none in its ring (not copied into process memory before its
// recv): rank 1 sends tags 1, 2, 3 (4 KiB each, one slot each) before rank 0 posts anything;
// rank 0 posts tags 1 and 2 as one batch. The batch's own progress pass takes both (message 2
// is done without any wait or poll), and the ring still holds message 3, whole, until its recv.
TEST_F(ShmTools, ReceivingPassTakesEveryPostedMessageAndLeavesTheRest) {
  if (shm::kLayoutVersion < 5) GTEST_SKIP() << "this build's layout is version " << shm::kLayoutVersion;
  const std::string name = unique_name();
  struct State {
    std::atomic<bool> sent{false};
    std::atomic<bool> done{false};
  };
  Shared<State> state;
  constexpr int64_t kFloats = 1024;  // 4 KiB: a slot each (more than an entry's inline bytes)
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    ShmOptions opts = default_slot_options();
    opts.timeout = 30s;
    ProcessGroupShm pg(name, r, 2, opts);
    const auto deadline = Clock::now() + 40s;
    if (r == 1) {
      for (int tag = 1; tag <= 3; ++tag) {
        SHM_CHECK(post_send(pg, pattern(at::kFloat, kFloats, static_cast<uint64_t>(tag)), 0, tag)->wait(),
                  "send " << tag);
      }
      state->sent.store(true);
      while (!state->done.load() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
      SHM_CHECK(state->done.load(), "rank 0 never finished");
      return;
    }
    while (!state->sent.load() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
    SHM_CHECK(state->sent.load(), "rank 1 never sent");
    const std::vector<at::Tensor> got{at::zeros({kFloats}), at::zeros({kFloats})};
    const auto batch = ShmGroupSeam::recv_batch(pg, got, 1, {1, 2}, {MessageCheck{}, MessageCheck{}});
    SHM_CHECK(batch->message_succeeded(0), "message 1 did not land when its receive was posted");
    SHM_CHECK(batch->message_succeeded(1), "the pass stopped after message 1: message 2 is still in the ring");
    const SegmentInfo info = shm::inspect_segment(name, {.details = true});
    SHM_CHECK(info.details.has_value() && info.details->available, "no layout details: " << info.problem);
    const shm::PairInfo& p10 = info.details->pairs.at(2);  // rank 1 -> rank 0
    SHM_CHECK(p10.src == 1 && p10.dst == 0, "pair " << p10.src << "->" << p10.dst);
    SHM_CHECK(p10.depth == 1 && p10.messages == 1 && p10.bytes_in_flight == 4096,
              "message 3 is not (only) in the ring: depth " << p10.depth << ", messages " << p10.messages << ", "
                                                            << p10.bytes_in_flight << " bytes");
    SHM_CHECK(batch->wait(), "batch");
    const at::Tensor third = at::zeros({kFloats});
    SHM_CHECK(post_recv(pg, third, 1, 3)->wait(), "recv 3");
    SHM_CHECK(same_bytes(got[0], pattern(at::kFloat, kFloats, 1)) &&
                  same_bytes(got[1], pattern(at::kFloat, kFloats, 2)) &&
                  same_bytes(third, pattern(at::kFloat, kFloats, 3)),
              "wrong bytes");
    state->done.store(true);
  }));
}

// A waiter drains other sources into process memory (early messages) only when the rank it
// waits for is blocked too (asleep in tdshm), or after 20 ms: rank 2 runs (a busy loop in user
// code) for 5 ms before it sends what rank 0 waits for, and rank 1's three messages stay in the
// ring meanwhile. With the former rule (drain after 1 ms of sleeping, whoever runs) the ring was
// empty after the wait.
TEST_F(ShmTools, AWaiterLeavesOtherSourcesInTheRingWhileTheRankItWaitsForRuns) {
  if (shm::kLayoutVersion < 5) GTEST_SKIP() << "this build's layout is version " << shm::kLayoutVersion;
  const std::string name = unique_name();
  struct State {
    std::atomic<bool> sent{false};
    std::atomic<bool> waiting{false};
    std::atomic<bool> done{false};
  };
  Shared<State> state;
  constexpr int64_t kFloats = 1024;  // 4 KiB: a slot each
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) {
    ShmOptions opts = default_slot_options();
    opts.timeout = 30s;
    ProcessGroupShm pg(name, r, 3, opts);
    const auto deadline = Clock::now() + 40s;
    auto wait_for = [&](const std::atomic<bool>& flag, const char* what) {
      while (!flag.load() && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
      SHM_CHECK(flag.load(), what);
    };
    if (r == 1) {
      for (int tag = 1; tag <= 3; ++tag) {
        SHM_CHECK(post_send(pg, pattern(at::kFloat, kFloats, static_cast<uint64_t>(tag)), 0, tag)->wait(),
                  "send " << tag);
      }
      state->sent.store(true);
      wait_for(state->done, "rank 0 never finished");
      return;
    }
    if (r == 2) {
      wait_for(state->waiting, "rank 0 never waited");
      const auto until = Clock::now() + 5ms;
      while (Clock::now() < until) {
      }
      SHM_CHECK(post_send(pg, pattern(at::kFloat, kFloats, 9), 0, 9)->wait(), "send 9");
      wait_for(state->done, "rank 0 never finished");
      return;
    }
    wait_for(state->sent, "rank 1 never sent");
    const at::Tensor from2 = at::zeros({kFloats});
    auto work = post_recv(pg, from2, 2, 9);
    state->waiting.store(true);
    const auto start = Clock::now();
    SHM_CHECK(work->wait(), "recv from rank 2");
    const auto waited = Clock::now() - start;
    const SegmentInfo info = shm::inspect_segment(name, {.details = true});
    SHM_CHECK(info.details.has_value() && info.details->available, "no layout details: " << info.problem);
    const auto pair = std::find_if(info.details->pairs.begin(), info.details->pairs.end(),
                                   [](const shm::PairInfo& p) { return p.src == 1 && p.dst == 0; });
    SHM_CHECK(pair != info.details->pairs.end(), "no pair 1 -> 0");
    if (waited < 15ms) {
      SHM_CHECK(pair->depth == 3 && pair->messages == 3 && pair->bytes_in_flight == 3 * 4096,
                "rank 1's messages left the ring while rank 0 waited for a running rank 2: depth "
                    << pair->depth << ", messages " << pair->messages << ", " << pair->bytes_in_flight << " bytes");
    } else {
      std::fprintf(stderr, "[drain] the wait took %.1f ms (a loaded machine): the ring check is skipped\n",
                   std::chrono::duration<double, std::milli>(waited).count());
    }
    SHM_CHECK(same_bytes(from2, pattern(at::kFloat, kFloats, 9)), "wrong bytes from rank 2");
    for (int tag = 1; tag <= 3; ++tag) {
      const at::Tensor t = at::zeros({kFloats});
      SHM_CHECK(post_recv(pg, t, 1, tag)->wait(), "recv " << tag);
      SHM_CHECK(same_bytes(t, pattern(at::kFloat, kFloats, static_cast<uint64_t>(tag))), "wrong bytes, tag " << tag);
    }
    state->done.store(true);
  }));
}

TEST_F(ShmTools, LayoutVersion5DetailsOfASyntheticSegment) {
  if (shm::kLayoutVersion == 5) {
    // The numbers above are this build's geometry.
    const shm::SegmentGeometry g = shm::segment_geometry(3, 100, 4, 3, 0, 1, 0);
    ASSERT_EQ(g.rings_offset, kV5Rings);
    ASSERT_EQ(g.ring_bytes, kV5RingBytes);
    ASSERT_EQ(g.arena_offset, kV5Arena);
    ASSERT_EQ(g.region_bytes, kV5Region);
    ASSERT_EQ(g.segment_bytes, kV5Bytes);
  }
  Plants plants;
  const uint32_t dead = dead_pid();
  const std::string name = unique_name();
  plants.add(segment_path(name));
  const std::vector<uint8_t> bytes = v5_segment(dead);
  write_file(segment_path(name), bytes);

  const SegmentInfo info = shm::inspect_segment(name, {.details = true});
  EXPECT_EQ(info.status, shm::kLayoutVersion == 5 ? SegmentStatus::kValid : SegmentStatus::kOtherVersion)
      << info.problem;
  ASSERT_TRUE(info.details.has_value()) << shm::status_name(info.status) << ": " << info.problem;
  const shm::LayoutDetails& d = *info.details;
  EXPECT_EQ(d.layout_version, 5u);
  ASSERT_TRUE(d.available) << d.note;
  ASSERT_TRUE(d.rank_table_offset.has_value());
  EXPECT_EQ(*d.rank_table_offset, 256u);
  ASSERT_TRUE(info.ranks_read) << info.problem;
  ASSERT_EQ(info.ranks.size(), 3u);
  EXPECT_EQ(info.ranks[0].state_name(), "dead");
  EXPECT_EQ(info.ranks[2].state_name(), "left");
  ASSERT_EQ(d.counters.size(), 3u);
  EXPECT_EQ(d.counters[0].wake_seq, 5u);
  EXPECT_EQ(d.counters[0].sleepers, 1u);

  ASSERT_EQ(d.pairs.size(), 9u);
  const shm::PairInfo& p01 = pair_of(d, 3, 0, 1);
  EXPECT_EQ(p01.head, 6u);
  EXPECT_EQ(p01.tail, 4u);
  EXPECT_EQ(p01.depth, 2u);
  EXPECT_EQ(p01.messages, 2u);
  EXPECT_EQ(p01.bytes_in_flight, 108u);
  EXPECT_FALSE(p01.inconsistent);
  EXPECT_TRUE(p01.note.empty()) << p01.note;
  for (const auto& [src, dst] : {std::pair{0u, 2u}, std::pair{1u, 0u}}) {
    const shm::PairInfo& p = pair_of(d, 3, src, dst);
    SCOPED_TRACE(std::to_string(src) + "->" + std::to_string(dst));
    EXPECT_TRUE(p.inconsistent);
    EXPECT_EQ(p.depth, 0u);
    EXPECT_EQ(p.messages, 0u);
    EXPECT_EQ(p.bytes_in_flight, 0u);
    EXPECT_NE(p.note.find("inconsistent"), std::string::npos) << p.note;
  }
  EXPECT_NE(pair_of(d, 3, 0, 2).note.find("tail > head"), std::string::npos) << pair_of(d, 3, 0, 2).note;
  EXPECT_EQ(pair_of(d, 3, 1, 0).head, 20u);
  const shm::PairInfo& p12 = pair_of(d, 3, 1, 2);
  EXPECT_FALSE(p12.inconsistent);
  EXPECT_EQ(p12.depth, 3u);
  EXPECT_EQ(p12.messages, 0u);
  EXPECT_EQ(p12.bytes_in_flight, 0u);
  EXPECT_NE(p12.note.find("3 malformed entries"), std::string::npos) << p12.note;
  const shm::PairInfo& p20 = pair_of(d, 3, 2, 0);
  EXPECT_EQ(p20.depth, 1u);
  EXPECT_EQ(p20.messages, 0u);
  EXPECT_NE(p20.note.find("1 entries taken while read"), std::string::npos) << p20.note;
  EXPECT_NE(d.note.find("2 rings with inconsistent head and tail"), std::string::npos) << d.note;
  EXPECT_NE(d.note.find("3 malformed entries"), std::string::npos) << d.note;

  ASSERT_EQ(d.arenas.size(), 3u);
  EXPECT_EQ(d.arenas[0].slots, 3u);
  EXPECT_EQ(d.arenas[0].slots_taken, 3u);
  EXPECT_EQ(d.arenas[0].bytes_taken, 300u);
  EXPECT_EQ(d.arenas[0].taken_by_dst, by_dst({{1, 1}, {2, 1}}));
  EXPECT_EQ(d.arenas[0].invalid_states, 1u);
  EXPECT_NE(d.arenas[0].note.find("names no rank"), std::string::npos) << d.arenas[0].note;
  EXPECT_EQ(d.arenas[1].slots_taken, 0u);
  EXPECT_TRUE(d.arenas[1].note.empty());
  EXPECT_EQ(d.arenas[2].slots_taken, 1u);
  EXPECT_EQ(d.arenas[2].taken_by_dst, by_dst({{0, 1}}));
  EXPECT_NE(d.note.find("1 arena slots in a state that names no rank"), std::string::npos) << d.note;

  const int fd = ::open(segment_path(name).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::array<uint8_t, 256> header{};
  ASSERT_EQ(::pread(fd, header.data(), header.size(), 0), 256);
  // A file cut inside rank 1's region: the rings and rank 0's region are read, the rest is beyond
  // the end.
  const uint64_t cut_at = kV5Arena + kV5Region + 10;
  const shm::LayoutDetails cut = shm::read_layout_details(fd, cut_at, header.data(), header.size(), 5, 3, {});
  ASSERT_TRUE(cut.available) << cut.note;
  EXPECT_EQ(pair_of(cut, 3, 0, 1).bytes_in_flight, 108u);
  ASSERT_EQ(cut.arenas.size(), 3u);
  EXPECT_TRUE(cut.arenas[0].read);
  EXPECT_EQ(cut.arenas[0].slots_taken, 3u);
  for (int r = 1; r < 3; ++r) {
    EXPECT_FALSE(cut.arenas[r].read);
    EXPECT_NE(cut.arenas[r].note.find("beyond the end"), std::string::npos) << cut.arenas[r].note;
  }
  // Cut inside the rings: the later pairs are beyond the end.
  const shm::LayoutDetails cut2 =
      shm::read_layout_details(fd, kV5Rings + 2 * kV5RingBytes + 50, header.data(), header.size(), 5, 3, {});
  ASSERT_TRUE(cut2.available);
  EXPECT_EQ(pair_of(cut2, 3, 0, 1).messages, 2u);
  EXPECT_NE(pair_of(cut2, 3, 0, 2).note.find("beyond the end"), std::string::npos) << pair_of(cut2, 3, 0, 2).note;
  for (const shm::ArenaInfo& a : cut2.arenas) EXPECT_FALSE(a.read);
  // Limits: no ring and no arena with max_pairs 0; one region only with max_slots 3.
  const shm::LayoutDetails table_only =
      shm::read_layout_details(fd, kV5Bytes, header.data(), header.size(), 5, 3, {.max_pairs = 0});
  EXPECT_TRUE(table_only.available);
  EXPECT_TRUE(table_only.pairs.empty() && table_only.arenas.empty());
  EXPECT_EQ(table_only.counters.size(), 3u);
  const shm::LayoutDetails few =
      shm::read_layout_details(fd, kV5Bytes, header.data(), header.size(), 5, 3, {.max_slots = 3});
  ASSERT_EQ(few.arenas.size(), 3u);
  EXPECT_TRUE(few.arenas[0].read);
  EXPECT_FALSE(few.arenas[1].read);
  EXPECT_NE(few.note.find("regions partly read"), std::string::npos) << few.note;
  // Geometry that disagrees with its parameters is not used.
  for (const auto& [at, value] : {std::pair<size_t, uint64_t>{104, kV5Region + 64},
                                  {96, kV5Arena - 64},
                                  {16, kV5Bytes + 1},
                                  {48, kV5Rings + 64},
                                  {64, 128}}) {
    std::array<uint8_t, 256> bad = header;
    std::memcpy(bad.data() + at, &value, sizeof value);
    const shm::LayoutDetails wrong = shm::read_layout_details(fd, kV5Bytes, bad.data(), bad.size(), 5, 3, {});
    EXPECT_FALSE(wrong.available) << "field at " << at;
    EXPECT_TRUE(wrong.pairs.empty() && wrong.arenas.empty());
    EXPECT_FALSE(wrong.rank_table_offset.has_value());
  }
  for (const auto& [at, value] : {std::pair<size_t, uint32_t>{112, 0}, {112, (1u << 16) + 1}, {28, 0}}) {
    std::array<uint8_t, 256> bad = header;
    std::memcpy(bad.data() + at, &value, sizeof value);
    const shm::LayoutDetails wrong = shm::read_layout_details(fd, kV5Bytes, bad.data(), bad.size(), 5, 3, {});
    EXPECT_FALSE(wrong.available) << "field at " << at;
    EXPECT_NE(wrong.note.find("out of range"), std::string::npos) << wrong.note;
  }
  EXPECT_FALSE(shm::read_layout_details(fd, kV5Bytes, header.data(), 200, 5, 3, {}).available);
  ::close(fd);

  // The file shrinks under the reader: it is told the old size, its reads come back short.
  const std::string shrunk = unique_name();
  plants.add(segment_path(shrunk));
  write_file(segment_path(shrunk), bytes);
  const int sfd = ::open(segment_path(shrunk).c_str(), O_RDWR);
  ASSERT_GE(sfd, 0);
  ASSERT_EQ(::ftruncate(sfd, static_cast<off_t>(kV5Rings + kV5RingBytes + 300)), 0);
  const shm::LayoutDetails gone = shm::read_layout_details(sfd, kV5Bytes, header.data(), header.size(), 5, 3, {});
  ASSERT_TRUE(gone.available);
  ASSERT_EQ(gone.pairs.size(), 9u);
  EXPECT_EQ(pair_of(gone, 3, 0, 1).note, "entries beyond the end of the file");
  for (uint32_t i = 2; i < 9; ++i) EXPECT_NE(gone.pairs[i].note.find("beyond the end"), std::string::npos) << i;
  for (const shm::ArenaInfo& a : gone.arenas) EXPECT_FALSE(a.read);
  ASSERT_EQ(::ftruncate(sfd, 0), 0);
  const shm::LayoutDetails empty = shm::read_layout_details(sfd, kV5Bytes, header.data(), header.size(), 5, 3, {});
  EXPECT_TRUE(empty.counters.empty());
  for (const shm::PairInfo& p : empty.pairs) EXPECT_NE(p.note.find("beyond the end"), std::string::npos);
  ::close(sfd);
}

/// A version 4 segment of world 2, ring_entries 4, slot_bytes 64 (entry 192 B, ring 896 B, rings
/// at 512, 4096 bytes): rank 0 Live with a dead pid, rank 1 Left; ring 0->1 holds two published
/// entries (positions 4 and 5: a 64-byte and a 10-byte first chunk), ring 1->0 has head < tail.
std::vector<uint8_t> v4_segment(uint32_t dead) {
  std::vector<uint8_t> b = prefix(4, 256, 4096, 2);
  b.resize(4096);
  put<uint32_t>(b, 28, 4);         // ring_entries
  put<uint64_t>(b, 32, 64);        // slot_bytes
  put<uint64_t>(b, 40, 256);       // rank_table_offset
  put<uint64_t>(b, 48, 512);       // rings_offset
  put<uint64_t>(b, 56, 896);       // ring_bytes
  put<uint64_t>(b, 64, 192);       // entry_bytes
  put<uint32_t>(b, 72, dead);      // creator_pid
  put<uint64_t>(b, 88, 0xabcdef);  // incarnation
  put<uint32_t>(b, 256 + 0, 1);    // rank 0: Live, pid dead
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
  put<uint64_t>(b, r10 + 0, 3);  // head < tail: inconsistent
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
  const uint32_t unknown = shm::kLayoutVersion + 1;
  const shm::LayoutDetails other = shm::read_layout_details(fd, 4096, header.data(), header.size(), unknown, 2, {});
  EXPECT_FALSE(other.available);
  EXPECT_EQ(other.note, "details not available for layout version " + std::to_string(unknown));
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
    if (line.compare(0, name.size() + 1, name + " ") == 0 || has(line, " " + name + " ") ||
        has(line, " " + name + ":")) {
      return line;
    }
  }
  return {};
}

/// The whitespace-separated words of the first line of `out` whose first word is `first`, or none.
std::vector<std::string> row_words(const std::string& out, const std::string& first) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string word; words >> word;) w.push_back(word);
    if (!w.empty() && w[0] == first) return w;
  }
  return {};
}
using Words = std::vector<std::string>;

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
  EXPECT_TRUE(has(js.out, "\"name\": \"" + name + "\"") && has(js.out, "\"alive_ranks\": 2"))
      << js.describe("ls --json");
  EXPECT_EQ(js.out.front(), '{') << js.describe("ls --json");

  ToolRun in = run_tool({"inspect", name});
  EXPECT_EQ(in.rc, 0) << in.describe("inspect");
  for (const char* needle : {"status     in use (2 of 2 ranks alive", "layout version", "world size 2", "RANK", "live",
                             "OFFERS", "memmap_by_reference,tdshm_transfers", "gc         keeps: in use", "details"}) {
    EXPECT_TRUE(has(in.out, needle)) << "no '" << needle << "' in\n" << in.describe("inspect " + name);
  }
  ToolRun inj = run_tool({"inspect", "--json", name});
  EXPECT_EQ(inj.rc, 0) << inj.describe("inspect --json");
  EXPECT_TRUE(has(inj.out, "\"status\": \"valid\"") && has(inj.out, "\"details\": {") &&
              has(inj.out, "\"offers\": [\"memmap_by_reference\", \"tdshm_transfers\"]"))
      << inj.describe("inspect --json");
  if (shm::kLayoutVersion >= 5) {
    // The pair table (PAIR HEAD TAIL DEPTH MESSAGES BYTES): rank 1's 64-byte message to rank 0 is
    // in flight, inline (no arena slot).
    EXPECT_EQ(row_words(in.out, "1->0"), (Words{"1->0", "1", "0", "1", "1", "64"})) << in.describe("inspect");
    EXPECT_EQ(row_words(in.out, "0->1"), (Words{"0->1", "0", "0", "0", "0", "0"})) << in.describe("inspect");
    for (const char* needle : {"PAIR", "DEPTH", "MESSAGES", "arena of rank 0: 0 of 64 slots in use",
                               "arena of rank 1: 0 of 64 slots in use"}) {
      EXPECT_TRUE(has(in.out, needle)) << "no '" << needle << "' in\n" << in.describe("inspect " + name);
    }
    EXPECT_TRUE(has(inj.out,
                    "\"src\": 1, \"dst\": 0, \"head\": 1, \"tail\": 0, \"depth\": 1, \"messages\": 1, "
                    "\"bytes_in_flight\": 64") &&
                has(inj.out, "\"arenas\": [{\"owner\": 0, \"slots\": 64, \"slots_taken\": 0"))
        << inj.describe("inspect --json");
  }

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

// Boards show in `tdshm ls` (text and JSON) with what gc would do; inspect of a board's name says
// that it is one; a file name that is not UTF-8 comes out of --json as Python's surrogateescape
// reads it (valid UTF-8 as it is), so that the name can be found again.
TEST_F(ShmCli, LsShowsBoardsAndJsonNamesFindTheirFiles) {
  if (kTool[0] == '\0' || ::access(kTool, X_OK) != 0) GTEST_SKIP() << "the tdshm tool is not built";
  const std::string board_name = "b" + unique_name();
  {
    Board board = Board::create(board_name, TensorDict({{"w", at::zeros({16})}}, {}));
    const ToolRun ls = run_tool({"ls"});
    EXPECT_EQ(ls.rc, 0) << ls.err;
    const std::string row = line_of(ls.out, board_name);
    EXPECT_TRUE(has(row, "keeps it: its writer (pid " + std::to_string(::getpid()) + ") runs")) << ls.out;
    const ToolRun js = run_tool({"ls", "--json"});
    EXPECT_TRUE(has(js.out, "\"boards\": [")) << js.out;
    EXPECT_TRUE(has(js.out, "\"name\": \"" + board_name + "\"")) << js.out;
    EXPECT_TRUE(has(js.out, "\"stale\": false")) << js.out;
    const ToolRun in = run_tool({"inspect", board_name});
    EXPECT_EQ(in.rc, 1);
    EXPECT_TRUE(has(in.err, "a board of that name exists")) << in.err;
  }
  const std::string base = unique_name();
  const std::string odd = base + "-caf\xc3\xa9-\xff";
  const std::string path = segment_path(odd);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << path;
  ::close(fd);
  const ToolRun js = run_tool({"ls", "--json"});
  ::unlink(path.c_str());
  EXPECT_TRUE(has(js.out, "\"name\": \"" + base + "-caf\xc3\xa9-\\udcff\"")) << js.out;
  // A name tdshm never uses is an error in JSON too, for a program that reads stdout.
  for (const std::vector<std::string>& args : {std::vector<std::string>{"inspect", "--json", "bad name"},
                                               std::vector<std::string>{"gc", "--json", "bad name"}}) {
    const ToolRun bad = run_tool(args);
    EXPECT_EQ(bad.rc, 1) << args[0];
    EXPECT_TRUE(has(bad.out, "\"error\": \"segment name 'bad name' may only contain")) << args[0] << ": " << bad.out;
  }
}

// A live rank of another PID namespace: its pid means another process here, or none, so gc keeps
// the segment and says why, never that the rank "is alive".
TEST(ShmGcDecision, ARankOfAnotherPidNamespaceIsKeptAndSaidSo) {
  shm::SegmentInfo info;
  info.name_valid = true;
  info.status = shm::SegmentStatus::kValid;
  info.ranks_read = true;
  shm::RankInfo rank;
  rank.rank = 1;
  rank.pid = 399;
  rank.state = shm::kRankLive;
  rank.alive = true;
  rank.foreign = true;
  info.ranks.push_back(rank);
  const auto [removable, why] = shm::gc_decision(info);
  EXPECT_FALSE(removable);
  EXPECT_TRUE(has(why, "rank 1 (pid 399 there) runs in another PID namespace")) << why;
  info.ranks[0].foreign = false;
  EXPECT_TRUE(has(shm::gc_decision(info).second, "in use: rank 1 (pid 399) is alive"));
}

TEST_F(ShmCli, InspectShowsMessagesAndArenaSlotsInFlight) {
  if (kTool[0] == '\0' || ::access(kTool, X_OK) != 0) GTEST_SKIP() << "the tdshm tool is not built";
  if (shm::kLayoutVersion < 5) GTEST_SKIP() << "this build's layout is version " << shm::kLayoutVersion;
  set_deadline(150s);
  const std::string name = unique_name();
  InFlightGroup group(name);
  ASSERT_TRUE(group.ready()) << group.describe();

  // 0->1: 8 B inline + 100 KiB in 2 entries + 4 KiB = 4 entries, 3 messages, 106504 bytes, 3
  // slots of rank 0's arena (192 KiB) handed to rank 1; 2->1: 1000 B in a span, 1 + 6 entries,
  // no slot.
  ToolRun in = run_tool({"inspect", name});
  EXPECT_EQ(in.rc, 0) << in.describe("inspect");
  EXPECT_EQ(row_words(in.out, "0->1"), (Words{"0->1", "4", "0", "4", "3", "106504"})) << in.describe("inspect");
  EXPECT_EQ(row_words(in.out, "2->1"), (Words{"2->1", "7", "0", "7", "1", "1000"})) << in.describe("inspect");
  EXPECT_EQ(row_words(in.out, "1->0"), (Words{"1->0", "0", "0", "0", "0", "0"})) << in.describe("inspect");
  const std::string version_line = "layout version " + std::to_string(shm::kLayoutVersion) + " details";
  for (const char* needle :
       {version_line.c_str(), "slots_per_rank 64",
        "arena of rank 0: 3 of 64 slots in use, 192.0 KiB reserved (3 for rank 1)",
        "arena of rank 1: 0 of 64 slots in use\n", "arena of rank 2: 0 of 64 slots in use\n", "WAKE_SEQ"}) {
    EXPECT_TRUE(has(in.out, needle)) << "no '" << needle << "' in\n" << in.describe("inspect " + name);
  }
  EXPECT_FALSE(has(in.out, "note:")) << in.describe("inspect");
  ToolRun inj = run_tool({"inspect", "--json", name});
  EXPECT_EQ(inj.rc, 0) << inj.describe("inspect --json");
  for (const char* needle :
       {"\"src\": 0, \"dst\": 1, \"head\": 4, \"tail\": 0, \"depth\": 4, \"messages\": 3, \"bytes_in_flight\": "
        "106504, "
        "\"inconsistent\": false",
        "\"owner\": 0, \"slots\": 64, \"slots_taken\": 3, \"bytes_taken\": 196608, \"taken_by_dst\": [{\"dst\": 1, "
        "\"slots\": 3}], \"invalid_states\": 0, \"read\": true",
        "\"src\": 2, \"dst\": 1, \"head\": 7, \"tail\": 0, \"depth\": 7, \"messages\": 1, \"bytes_in_flight\": 1000",
        "\"owner\": 2, \"slots\": 64, \"slots_taken\": 0, \"bytes_taken\": 0"}) {
    EXPECT_TRUE(has(inj.out, needle)) << "no '" << needle << "' in\n" << inj.describe("inspect --json");
  }

  ASSERT_TRUE(group.receive()) << group.describe();
  in = run_tool({"inspect", name});
  EXPECT_EQ(in.rc, 0) << in.describe("inspect (received)");
  EXPECT_EQ(row_words(in.out, "0->1"), (Words{"0->1", "4", "4", "0", "0", "0"})) << in.describe("inspect (received)");
  EXPECT_EQ(row_words(in.out, "2->1"), (Words{"2->1", "7", "7", "0", "0", "0"})) << in.describe("inspect (received)");
  for (const char* needle : {"arena of rank 0: 0 of 64 slots in use\n", "arena of rank 2: 0 of 64 slots in use\n"}) {
    EXPECT_TRUE(has(in.out, needle)) << "no '" << needle << "' in\n" << in.describe("inspect (received)");
  }
  EXPECT_TRUE(group.release()) << group.describe();
}

}  // namespace
}  // namespace tdshm::test
