// A creator killed in the middle of creating the segment (suite ShmSegmentRecovery): the ranks
// that were waiting to join its group fail at once with PeerLostError, and a group started
// afterwards under the name (a restarted job) forms on its first try, whichever of its ranks
// takes the lock first.
//
// The creator is a forked child that does what attach does up to the point where it is killed:
// it takes the lock file's flock, writes its creator record with `creating` set, leaves a
// segment file of zeros (or none) and then hangs, holding the lock, until it is SIGKILLed.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "shm/layout/segment_layout.h"
#include "shm/segment/segment.h"
#include "shm_test_support.h"

namespace tdshm::test {
namespace {

class ShmSegmentRecovery : public ShmTest {};

/// The body of the creator child: creates as attach does, up to before the header, and hangs.
void create_and_hang(const std::string& name, uint32_t rank, int64_t leftover_bytes, std::atomic<int>& ready) {
  const std::string lock_path = segment_path(name) + ".lock";
  const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  SHM_CHECK(lock >= 0, "cannot open " << lock_path << ": " << std::strerror(errno));
  SHM_CHECK(::flock(lock, LOCK_EX) == 0, "cannot lock " << lock_path << ": " << std::strerror(errno));
  const shm::ProcessId me = shm::self_process();
  const shm::CreatorRecord rec{shm::CreatorRecord::kMagic, me.pid, rank, me.start_time, 1, me.pid_ns};
  SHM_CHECK(::pwrite(lock, &rec, sizeof rec, 0) == static_cast<ssize_t>(sizeof rec), std::strerror(errno));
  if (leftover_bytes >= 0) {
    const int seg = ::open(segment_path(name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    SHM_CHECK(seg >= 0, "cannot create the segment: " << std::strerror(errno));
    SHM_CHECK(::ftruncate(seg, leftover_bytes) == 0, std::strerror(errno));
    ::close(seg);
  }
  ready.store(1);
  for (;;) std::this_thread::sleep_for(1s);
}

/// A creator of `name` as `rank`, killed (kill()) in the middle of creating it: the segment file
/// is `leftover_bytes` of zeros, or absent when that is negative.
class DyingCreator {
 public:
  DyingCreator(const std::string& name, uint32_t rank, int64_t leftover_bytes)
      : child_([&ready = *ready_, name, rank, leftover_bytes] { create_and_hang(name, rank, leftover_bytes, ready); }) {}

  /// Whether it holds the lock, with its record written and its leftover made, within `timeout`.
  bool wait_ready(Clock::duration timeout) {
    const auto until = Clock::now() + timeout;
    while (ready_->load() == 0 && !child_.poll() && Clock::now() < until) std::this_thread::sleep_for(1ms);
    return ready_->load() != 0 && !child_.exited();
  }
  /// SIGKILLs it and reaps it: its lock is dropped and its pid is free.
  void kill() {
    child_.kill();
    child_.wait(10s);
  }
  std::string describe() const { return child_.describe(); }

 private:
  Shared<std::atomic<int>> ready_;
  Child child_;
};

/// Whether, within `timeout`, the lock file of `name` shows `pid` joining as `rank` (its
/// JoinRecord): the process has announced itself and waits for the lock.
bool wait_joining(const std::string& name, uint32_t rank, pid_t pid, Clock::duration timeout) {
  const std::string path = segment_path(name) + ".lock";
  const auto until = Clock::now() + timeout;
  do {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      shm::JoinRecord rec;
      const off_t at = static_cast<off_t>(shm::kJoinRecordsOffset + uint64_t{rank} * sizeof rec);
      const bool joining = ::pread(fd, &rec, sizeof rec, at) == static_cast<ssize_t>(sizeof rec) &&
                           rec.magic == shm::JoinRecord::kMagic && rec.pid == static_cast<uint32_t>(pid);
      ::close(fd);
      if (joining) return true;
    }
    std::this_thread::sleep_for(1ms);
  } while (Clock::now() < until);
  return false;
}

/// The leftovers a creator may leave: no file, an empty one, a short one, one of full size.
std::vector<int64_t> leftover_sizes() {
  return {-1, 0, 100, static_cast<int64_t>(shm_segment_bytes(2, small_options()))};
}

// Rank 1 waits for the lock while rank 0 creates the segment; rank 0 is killed. Rank 1 was
// grouped with it: it replaces the leftover and its rendezvous fails at once with PeerLostError
// naming rank 0 (not at its timeout). Then a whole new group forms under the name.
TEST_F(ShmSegmentRecovery, ARankWaitingForAKilledCreatorFailsAtOnce) {
  for (const int64_t leftover : leftover_sizes()) {
    SCOPED_TRACE("leftover segment of " + std::to_string(leftover) + " bytes");
    const std::string name = unique_name();
    ShmOptions opts = small_options();
    opts.timeout = 20s;
    DyingCreator creator(name, 0, leftover);
    ASSERT_TRUE(creator.wait_ready(10s)) << creator.describe();
    Child rank1([&] {
      const auto start = Clock::now();
      const Caught c = catch_any([&] { ProcessGroupShm pg(name, 1, 2, opts); });
      SHM_CHECK(c.is<PeerLostError>(), "rank 1's rendezvous threw " << c.describe());
      SHM_CHECK(contains_nocase(c.what, "rank 0"), "the error does not name rank 0: " << c.what);
      SHM_CHECK(Clock::now() - start < 10s, "the dead creator was noticed only at the timeout");
    });
    const bool joining = wait_joining(name, 1, rank1.pid(), 10s);
    creator.kill();
    ASSERT_TRUE(joining) << "rank 1 never waited for the lock; " << rank1.describe();
    rank1.wait(30s);
    EXPECT_TRUE(rank1.ok()) << rank1.describe();
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
      ProcessGroupShm pg(name, r, 2, opts);
      exchange(pg);
    }));
    EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
  }
}

// The creator (rank 0 or 1) is killed and reaped; then a fresh pair starts under the name, as a
// restarted job does: together, or with the dead creator's rank last (so that the other rank
// takes the lock first). The fresh ranks were never grouped with the dead creator: the pair must
// form on its first try, at once, and exchange.
TEST_F(ShmSegmentRecovery, AFreshGroupFormsAtOnceAfterACreatorKilledMidCreation) {
  set_deadline(300s);
  ShmOptions opts = small_options();
  opts.timeout = 5s;  // a pair that fails waits this long
  for (const uint32_t creator_rank : {0u, 1u}) {
    for (const int64_t leftover : leftover_sizes()) {
      for (const bool creator_rank_last : {false, true}) {
        SCOPED_TRACE("creator rank " + std::to_string(creator_rank) + ", leftover segment of " +
                     std::to_string(leftover) + " bytes" + (creator_rank_last ? ", its fresh rank last" : ""));
        const std::string name = unique_name();
        DyingCreator creator(name, creator_rank, leftover);
        ASSERT_TRUE(creator.wait_ready(10s)) << creator.describe();
        creator.kill();
        SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
          if (creator_rank_last && r == static_cast<int>(creator_rank)) std::this_thread::sleep_for(100ms);
          const auto start = Clock::now();
          ProcessGroupShm pg(name, r, 2, opts);
          SHM_CHECK(Clock::now() - start < 3s, "rank " << r << " took " << (Clock::now() - start).count() << " ns to form");
          exchange(pg);
        }, 30s));
        EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
      }
    }
  }
}

}  // namespace
}  // namespace tdshm::test
