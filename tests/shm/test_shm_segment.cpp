// The segment's life and its failures: attaching with another world size, options or layout
// version; a rank held by a live process; invalid names and arguments; a header corrupted on
// purpose; a segment too large for /dev/shm; a leftover segment of dead ranks; a peer killed in
// the middle of a transfer.
//
// A scenario that could crash the attacher (a corrupted header) runs the attacher, and the rank it
// attaches to, in forked children: a crash is then a failure of the test, not of the binary.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"
#include "shm/reader/inspect.h"
#include "shm/segment/gc.h"
#include "shm/segment/segment.h"
#include "shm_test_support.h"

namespace tdshm::test {
namespace {

/// Rank `rank` of `size` constructing its group on a thread of this process (the constructor
/// waits for the other ranks); join() returns what the constructor threw.
class PendingRank {
 public:
  PendingRank(std::string name, int rank, int size, ShmOptions opts)
      : thread_([this, name = std::move(name), rank, size, opts] {
          try {
            group_ = std::make_unique<ProcessGroupShm>(name, rank, size, opts);
          } catch (...) {
            error_ = caught_current();
          }
        }) {}
  ~PendingRank() {
    if (thread_.joinable()) thread_.join();
  }
  PendingRank(const PendingRank&) = delete;
  PendingRank& operator=(const PendingRank&) = delete;

  /// Waits for the constructor to end (the fixture's watchdog bounds it).
  const Caught& join() {
    if (thread_.joinable()) thread_.join();
    return error_;
  }
  ProcessGroupShm* group() { return group_.get(); }
  /// Destroys the group (leaves).
  void leave() { group_.reset(); }

 private:
  std::unique_ptr<ProcessGroupShm> group_;
  Caught error_;
  std::thread thread_;
};

class ShmSegmentThreads : public ShmTest {};
class ShmSegmentProcs : public ShmTest {};

// ---------------------------------------------------------------------------------------------
// Attaching to a segment that does not fit

/// What an attacher does wrong, and how the header is edited before it comes.
struct Refusal {
  std::string what{};                                          // for messages
  std::function<void(shm::SegmentHeader&)> corrupt = nullptr;  // null: the header stays right
  int rank = 1;
  int size = 2;
  ShmOptions options = small_options();
  std::vector<std::string> needles{};  // the SegmentError's message mentions each of them
};

/// Rank 0 of 2 (a child) creates the segment and waits in its constructor. The header is
/// edited as `refusal` says; an attacher (another child) must get a SegmentError (no crash, no
/// hang) mentioning the needles. Then the header is put back, a proper rank 1 (a child) attaches,
/// and the two exchange messages: the failed attach harmed nothing.
void expect_refused(ShmTest& /*fixture*/, const std::string& name, const Refusal& refusal) {
  SCOPED_TRACE(refusal.what);
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  Child rank0([&] {
    ProcessGroupShm pg(name, 0, 2, opts);
    exchange(pg);
  });
  ASSERT_TRUE(wait_segment_ready(name, {0}, 10s)) << "rank 0 did not publish the segment; " << rank0.describe();

  std::array<std::byte, offsetof(shm::SegmentHeader, incarnation)> saved{};
  if (refusal.corrupt) {
    RawSegment seg(name);
    std::memcpy(saved.data(), seg.data(), saved.size());
    refusal.corrupt(seg.header());
  }
  Child attacher([&] {
    const Caught c =
        SHM_CHECK_THROWS(SegmentError, [&] { ProcessGroupShm pg(name, refusal.rank, refusal.size, refusal.options); });
    std::fprintf(stderr, "[%s] %s\n", refusal.what.c_str(), c.describe().c_str());
    for (const std::string& n : refusal.needles) {
      SHM_CHECK(contains_nocase(c.what, n), "the message does not mention \"" << n << "\": " << c.what);
    }
  });
  attacher.wait(15s);
  EXPECT_TRUE(attacher.ok()) << "attacher: " << attacher.describe();
  if (refusal.corrupt) {
    RawSegment seg(name);
    std::memcpy(seg.data(), saved.data(), saved.size());
  }

  Child rank1([&] {
    ProcessGroupShm pg(name, 1, 2, opts);
    exchange(pg);
  });
  std::vector<Child> both;
  both.push_back(std::move(rank0));
  both.push_back(std::move(rank1));
  wait_all(both, 30s);
  EXPECT_TRUE(both[0].ok()) << "rank 0: " << both[0].describe();
  EXPECT_TRUE(both[1].ok()) << "rank 1: " << both[1].describe();
}

TEST_F(ShmSegmentProcs, WorldSizeMismatchIsRefused) {
  expect_refused(*this, unique_name(), {.what = "size 3 attaching to a group of 2", .size = 3});
}

TEST_F(ShmSegmentProcs, SlotBytesMismatchIsRefused) {
  Refusal r{.what = "slot_bytes 8192 attaching to 4096"};
  r.options.slot_bytes = 8192;
  expect_refused(*this, unique_name(), r);
}

TEST_F(ShmSegmentProcs, RingEntriesMismatchIsRefused) {
  Refusal r{.what = "ring_entries 8 attaching to 4"};
  r.options.ring_entries = 8;
  expect_refused(*this, unique_name(), r);
}

TEST_F(ShmSegmentProcs, LayoutVersionMismatchIsRefused) {
  expect_refused(*this, unique_name(),
                 {.what = "layout_version patched to 99",
                  .corrupt = [](shm::SegmentHeader& h) { h.layout_version.store(99, std::memory_order_release); },
                  .needles = {"version"}});
}

TEST_F(ShmSegmentProcs, RankHeldByLiveProcessIsRefused) {
  expect_refused(*this, unique_name(), {.what = "rank 0 again while its holder lives", .rank = 0});
}

TEST_F(ShmSegmentThreads, RankHeldByLiveThreadPeerIsRefused) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  PendingRank rank0(name, 0, 2, opts);
  ASSERT_TRUE(wait_segment_ready(name, {0}, 10s));
  const Caught c = catch_any([&] { ProcessGroupShm again(name, 0, 2, opts); });
  EXPECT_TRUE(c.is<SegmentError>()) << c.describe();
  ProcessGroupShm rank1(name, 1, 2, opts);
  ASSERT_FALSE(rank0.join().threw) << rank0.join().describe();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { exchange(r == 0 ? *rank0.group() : rank1); }));
}

// ---------------------------------------------------------------------------------------------
// A header corrupted on purpose: the attacher must refuse it, never crash or hang.

TEST_F(ShmSegmentProcs, CorruptMagicIsRefused) {
  expect_refused(*this, unique_name(),
                 {.what = "garbage magic", .corrupt = [](shm::SegmentHeader& h) { h.magic = 0x0123456789abcdefull; }});
}

TEST_F(ShmSegmentProcs, AbsurdSegmentBytesIsRefused) {
  expect_refused(*this, unique_name(), {.what = "segment_bytes 2^62", .corrupt = [](shm::SegmentHeader& h) {
                                          h.segment_bytes = uint64_t{1} << 62;
                                        }});
}

TEST_F(ShmSegmentProcs, SegmentBytesBeyondTheFileIsRefused) {
  expect_refused(*this, unique_name(),
                 {.what = "segment_bytes one page more than the file",
                  .corrupt = [](shm::SegmentHeader& h) { h.segment_bytes += 4096; }});
}

TEST_F(ShmSegmentProcs, RingEntriesChangedInHeaderIsRefused) {
  // The attacher asks for what the header now says, so only the header's consistency with the
  // segment's real size can catch it (trusting it would reach past the end of the mapping).
  Refusal r{.what = "ring_entries 4 -> 64 in the header, attacher asks for 64",
            .corrupt = [](shm::SegmentHeader& h) { h.ring_entries = 64; }};
  r.options.ring_entries = 64;
  expect_refused(*this, unique_name(), r);
}

TEST_F(ShmSegmentProcs, HugeRingEntriesInHeaderIsRefused) {
  Refusal r{.what = "ring_entries 2^31 - 1 in the header, attacher asks for the same",
            .corrupt = [](shm::SegmentHeader& h) { h.ring_entries = 0x7fffffff; }};
  r.options.ring_entries = 0x7fffffff;
  expect_refused(*this, unique_name(), r);
}

TEST_F(ShmSegmentProcs, SlotBytesChangedInHeaderIsRefused) {
  Refusal r{.what = "slot_bytes 4096 -> 1 MiB in the header, attacher asks for the same",
            .corrupt = [](shm::SegmentHeader& h) { h.slot_bytes = 1 << 20; }};
  r.options.slot_bytes = 1 << 20;
  expect_refused(*this, unique_name(), r);
}

TEST_F(ShmSegmentProcs, WorldSizeChangedInHeaderIsRefused) {
  expect_refused(*this, unique_name(),
                 {.what = "world_size 2 -> 1000 in the header, attacher asks for 1000",
                  .corrupt = [](shm::SegmentHeader& h) { h.world_size = 1000; },
                  .size = 1000});
}

TEST_F(ShmSegmentProcs, CorruptOffsetsAreRefused) {
  // The offsets stored in the header disagree with the geometry of its sizes.
  expect_refused(*this, unique_name(), {.what = "rank_table_offset far out", .corrupt = [](shm::SegmentHeader& h) {
                                          h.rank_table_offset = uint64_t{1} << 40;
                                        }});
  expect_refused(*this, unique_name(), {.what = "rings_offset far out", .corrupt = [](shm::SegmentHeader& h) {
                                          h.rings_offset = uint64_t{1} << 40;
                                        }});
  expect_refused(
      *this, unique_name(),
      {.what = "entry_bytes smaller than an entry", .corrupt = [](shm::SegmentHeader& h) { h.entry_bytes = 64; }});
}

// ---------------------------------------------------------------------------------------------
// Names and arguments

const std::vector<std::string>& invalid_names() {
  static const std::vector<std::string> names = {"",         "a/b",       std::string(300, 'x'), std::string(201, 'y'),
                                                 "a b",      "../escape", "tab\there",           "caf\xc3\xa9",
                                                 "new\nline"};
  return names;
}

TEST_F(ShmSegmentThreads, InvalidNamesAreRefused) {
  EXPECT_NO_THROW(validate_segment_name(std::string(200, 'z')));
  EXPECT_NO_THROW(validate_segment_name("Az09._-"));
  const std::vector<std::string> before = shm_entries_of("");
  for (const std::string& name : invalid_names()) {
    SCOPED_TRACE("name \"" + name + "\" (" + std::to_string(name.size()) + " chars)");
    const Caught v = catch_any([&] { validate_segment_name(name); });
    EXPECT_TRUE(v.is<SegmentError>()) << "validate_segment_name: " << v.describe();
    const Caught c = catch_any([&] { ProcessGroupShm pg(name, 0, 1, small_options()); });
    EXPECT_TRUE(c.is<SegmentError>()) << "constructor: " << c.describe();
    const Caught r = catch_any([&] { remove_stale_segment(name); });
    EXPECT_TRUE(r.is<SegmentError>()) << "remove_stale_segment: " << r.describe();
  }
  EXPECT_EQ(shm_entries_of(""), before) << "a refused name created something in /dev/shm";
}

TEST_F(ShmSegmentThreads, InvalidRankOrSizeIsRefused) {
  const std::string name = unique_name();
  struct Case {
    int rank;
    int size;
  };
  for (const Case& c : {Case{-1, 2}, Case{2, 2}, Case{5, 2}, Case{0, 0}, Case{0, -1}, Case{-1, -1}}) {
    SCOPED_TRACE("rank " + std::to_string(c.rank) + " of " + std::to_string(c.size));
    const Caught e = catch_any([&] { ProcessGroupShm pg(name, c.rank, c.size, small_options()); });
    // The contract says invalid arguments are a SegmentError.
    EXPECT_TRUE(e.is<SegmentError>()) << e.describe();
  }
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

TEST_F(ShmSegmentThreads, InvalidOptionsAreRefused) {
  const std::string name = unique_name();
  ShmOptions zero_slot = small_options();
  zero_slot.slot_bytes = 0;
  ShmOptions zero_entries = small_options();
  zero_entries.ring_entries = 0;
  for (const auto& [what, opts] : {std::pair{"slot_bytes 0", zero_slot}, std::pair{"ring_entries 0", zero_entries}}) {
    SCOPED_TRACE(what);
    const Caught e = catch_any([&] { ProcessGroupShm pg(name, 0, 1, opts); });
    EXPECT_TRUE(e.is<SegmentError>()) << e.describe();
  }
}

// ---------------------------------------------------------------------------------------------
// Too large for /dev/shm

/// Bytes of the tmpfs at /dev/shm: total and free.
std::pair<uint64_t, uint64_t> dev_shm_space() {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return {0, 0};
  return {uint64_t{st.f_blocks} * st.f_frsize, uint64_t{st.f_bavail} * st.f_frsize};
}

TEST_F(ShmSegmentProcs, SegmentLargerThanDevShmIsRefused) {
  const auto [total, free_bytes] = dev_shm_space();
  ASSERT_GT(total, 0u) << "statvfs(/dev/shm) failed";
  // Twice the whole tmpfs (so that not even an attempt to reserve it can use up the host's
  // memory: the kernel refuses a fallocate larger than the file system at once).
  ShmOptions opts = small_options();
  opts.timeout = 3s;
  opts.slot_bytes = size_t{1} << 30;
  const uint64_t per_slot = 2 * opts.slot_bytes;  // one slot in each of the 2 ranks' arena regions
  opts.slots_per_rank = static_cast<uint32_t>(std::min<uint64_t>(2 * total / per_slot + 1, shm::kMaxSlotsPerRank));
  const uint64_t needed = shm_segment_bytes(2, opts);
  ASSERT_GT(needed, 2 * total);
  ASSERT_GT(needed, free_bytes);
  const std::string name = unique_name();
  Child attempt([&] {
    const auto start = Clock::now();
    const Caught c = SHM_CHECK_THROWS(SegmentError, [&] { ProcessGroupShm pg(name, 0, 2, opts); });
    std::fprintf(stderr, "[needs %llu bytes] %s\n", static_cast<unsigned long long>(needed), c.describe().c_str());
    // The size needed, in bytes or rounded to MiB or GiB.
    bool named = false;
    for (uint64_t shown : {needed, needed >> 20, needed >> 30, (needed + (1 << 20) - 1) >> 20,
                           (needed + (uint64_t{1} << 30) - 1) >> 30}) {
      named = named || c.what.find(std::to_string(shown)) != std::string::npos;
    }
    SHM_CHECK(named, "the message does not say how much is needed (" << needed << " bytes): " << c.what);
    SHM_CHECK(Clock::now() - start < 2s, "refusing took " << (Clock::now() - start).count() << " ns");
  });
  attempt.wait(20s);
  EXPECT_TRUE(attempt.ok()) << attempt.describe();
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

// A group whose processes were all killed leaves its segment behind, and a job with fresh names
// never replaces it: when /dev/shm is too small, the error counts what such stale segments hold
// and names `tdshm gc` (it removes nothing itself).
TEST_F(ShmSegmentProcs, TooLittleRoomNamesTheStaleSegmentsGcWouldRemove) {
  const std::string stale = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 5s;
  Child dies([&] {
    new ProcessGroupShm(stale, 0, 1, opts);  // never destroyed: the process ends as if killed
    ::_exit(0);
  });
  ASSERT_TRUE(dies.wait(20s)) << dies.describe();
  ASSERT_TRUE(shm::gc_decision(shm::inspect_segment(stale)).first) << "the segment of a dead group is not stale";
  const auto [total, free_bytes] = dev_shm_space();
  ASSERT_GT(total, 0u);
  ShmOptions huge = small_options();
  huge.timeout = 3s;
  huge.slot_bytes = size_t{1} << 30;
  huge.slots_per_rank = static_cast<uint32_t>(std::min<uint64_t>(total / huge.slot_bytes + 1, shm::kMaxSlotsPerRank));
  ASSERT_GT(shm_segment_bytes(2, huge), free_bytes);
  const std::string name = unique_name();
  const Caught c = catch_any([&] { ProcessGroupShm pg(name, 0, 2, huge); });
  EXPECT_TRUE(c.is<SegmentError>()) << c.describe();
  EXPECT_TRUE(contains_nocase(c.what, "stale tdshm segment") && contains_nocase(c.what, "tdshm gc")) << c.what;
  EXPECT_EQ(shm::inspect_segment(stale).status, shm::SegmentStatus::kValid) << "the error must not remove anything";
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
  EXPECT_TRUE(remove_stale_segment(stale));
  EXPECT_EQ(shm_entries_of(stale), std::vector<std::string>{});
}

TEST_F(ShmSegmentProcs, SegmentSizeOverflowIsRefused) {
  // world^2 * entries * slot overflows 64 bits: must not wrap to a small segment.
  ShmOptions opts = small_options();
  opts.timeout = 3s;
  opts.slot_bytes = size_t{1} << 40;
  opts.ring_entries = 1u << 31;
  const std::string name = unique_name();
  Child attempt([&] {
    const Caught c = SHM_CHECK_THROWS(SegmentError, [&] { ProcessGroupShm pg(name, 0, 1000, opts); });
    std::fprintf(stderr, "[overflow] %s\n", c.describe().c_str());
  });
  attempt.wait(20s);
  EXPECT_TRUE(attempt.ok()) << attempt.describe();
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

// ---------------------------------------------------------------------------------------------
// Leftover segments

/// Leaves the segment `name` behind: `ranks` children attach (all of a group of `size`, or fewer,
/// which then wait in the constructor) and are SIGKILLed.
void leave_stale_segment(const std::string& name, int ranks, int size) {
  ShmOptions opts = small_options();
  opts.timeout = 30s;
  Shared<std::atomic<int>> constructed;
  std::vector<Child> children;
  for (int r = 0; r < ranks; ++r) {
    children.emplace_back([&, r] {
      ProcessGroupShm pg(name, r, size, opts);
      constructed->fetch_add(1);
      for (;;) std::this_thread::sleep_for(1s);
    });
  }
  std::vector<int> live;
  for (int r = 0; r < ranks; ++r) live.push_back(r);
  const bool ready = wait_segment_ready(name, live, 10s);
  const auto deadline = Clock::now() + 10s;
  while (ranks == size && constructed->load() < ranks && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
  for (Child& c : children) c.kill();
  wait_all(children, 10s);
  ASSERT_TRUE(ready) << "the children did not attach";
  ASSERT_EQ(::access(segment_path(name).c_str(), F_OK), 0) << "no segment left behind to test with";
}

TEST_F(ShmSegmentProcs, StaleSegmentOfWaitingRankIsReplaced) {
  const std::string name = unique_name();
  leave_stale_segment(name, 1, 2);
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    exchange(pg);
  }));
}

TEST_F(ShmSegmentProcs, StaleSegmentOfCompleteGroupIsReplaced) {
  const std::string name = unique_name();
  leave_stale_segment(name, 2, 2);
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    exchange(pg);
  }));
}

TEST_F(ShmSegmentProcs, StaleSegmentWithOtherGeometryIsReplaced) {
  // Dead ranks of a 3-rank group with default slots: a new 2-rank group of small slots may use
  // the name.
  const std::string name = unique_name();
  leave_stale_segment(name, 3, 3);
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    exchange(pg);
  }));
}

TEST_F(ShmSegmentProcs, RemoveStaleSegmentRemovesDeadOnes) {
  const std::string name = unique_name();
  EXPECT_FALSE(remove_stale_segment(name)) << "nothing to remove yet";
  leave_stale_segment(name, 2, 2);
  EXPECT_TRUE(remove_stale_segment(name));
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
  EXPECT_FALSE(remove_stale_segment(name));
}

TEST_F(ShmSegmentThreads, RemoveStaleSegmentRefusesLiveOnes) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  {
    // Only rank 0 attached so far (waiting in its constructor): live.
    PendingRank rank0(name, 0, 2, opts);
    ASSERT_TRUE(wait_segment_ready(name, {0}, 10s));
    const Caught waiting = catch_any([&] { remove_stale_segment(name); });
    EXPECT_TRUE(waiting.is<SegmentError>()) << waiting.describe();
    ProcessGroupShm rank1(name, 1, 2, opts);
    ASSERT_FALSE(rank0.join().threw) << rank0.join().describe();
    // The complete group: live.
    const Caught complete = catch_any([&] { remove_stale_segment(name); });
    EXPECT_TRUE(complete.is<SegmentError>()) << complete.describe();
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { exchange(r == 0 ? *rank0.group() : rank1); }));
    rank0.leave();
  }
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{}) << "the last rank to leave removes the segment";
}

TEST_F(ShmSegmentThreads, LastRankToLeaveRemovesTheSegment) {
  const std::string name = unique_name();
  auto rank0 = std::make_unique<PendingRank>(name, 0, 2, small_options());
  auto rank1 = std::make_unique<ProcessGroupShm>(name, 1, 2, small_options());
  ASSERT_FALSE(rank0->join().threw) << rank0->join().describe();
  rank0->leave();
  EXPECT_EQ(::access(segment_path(name).c_str(), F_OK), 0) << "removed while rank 1 is still in the group";
  rank1.reset();
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

TEST_F(ShmSegmentThreads, ConstructorTimesOutWhenPeersNeverCome) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 300ms;
  const auto start = Clock::now();
  const Caught c = catch_any([&] { ProcessGroupShm pg(name, 0, 2, opts); });
  const auto elapsed = Clock::now() - start;
  EXPECT_TRUE(c.is<tdshm::Error>()) << c.describe();
  EXPECT_TRUE(c.is<TimeoutError>() || c.is<SegmentError>()) << c.describe();
  EXPECT_GE(elapsed, 250ms);
  EXPECT_LT(elapsed, 3s);
}

// ---------------------------------------------------------------------------------------------
// The rendezvous of the constructor

TEST_F(ShmSegmentProcs, RendezvousCompletesWhenAPeerAlreadyLeft) {
  // Rank 1 attaches and is stopped (SIGSTOP) before it sees the others. Ranks 0 and 2 attach,
  // complete their rendezvous, rank 0 sends rank 1 a message, rank 2 leaves at once. Rank 1,
  // continued, must complete its constructor (rank 2 did attach) and take the message.
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 15s;
  Child rank1([&] {
    ProcessGroupShm pg(name, 1, 3, opts);
    const at::Tensor got = at::zeros({4}, at::kInt);
    post_recv(pg, got, 0, 1)->wait();
    SHM_CHECK(got[3].item<int>() == 4, "wrong message");
    post_send(pg, got, 0, 2)->wait();
  });
  ASSERT_TRUE(wait_segment_ready(name, {1}, 10s)) << rank1.describe();
  ASSERT_TRUE(stop_outside_segment_lock(rank1.pid(), name, 10s)) << "rank 1 kept the lock file";
  Child rank2([&] { ProcessGroupShm pg(name, 2, 3, opts); });
  Child rank0([&] {
    ProcessGroupShm pg(name, 0, 3, opts);
    post_send(pg, at::arange(1, 5, at::kInt), 1, 1)->wait();
    const at::Tensor back = at::zeros({4}, at::kInt);
    post_recv(pg, back, 1, 2)->wait();
    SHM_CHECK(back[0].item<int>() == 1, "wrong reply");
  });
  rank2.wait(10s);
  EXPECT_TRUE(rank2.ok()) << "rank 2: " << rank2.describe();
  std::this_thread::sleep_for(50ms);  // rank 0 has sent its message by now, most likely
  ::kill(rank1.pid(), SIGCONT);
  std::vector<Child> rest;
  rest.push_back(std::move(rank0));
  rest.push_back(std::move(rank1));
  wait_all(rest, 30s);
  EXPECT_TRUE(rest[0].ok()) << "rank 0: " << rest[0].describe();
  EXPECT_TRUE(rest[1].ok()) << "rank 1: " << rest[1].describe();
}

// ---------------------------------------------------------------------------------------------
// A peer killed in the middle of a transfer

struct KillRecord {
  std::atomic<int64_t> kill_ns{0};            // when the victim raised SIGKILL (monotonic_ns)
  std::atomic<int> completed_before_kill{0};  // the transfer ended before the victim died
  std::atomic<int> old_group_gone{0};         // the survivor destroyed its first group
};

constexpr int64_t kMessageBytes = int64_t{1} << 20;  // 256 chunks of 4 KiB
constexpr auto kDetectionBound = 1500ms;             // "about a second": 100 ms checks, loaded host

ShmOptions kill_options() {
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  opts.peer_check_interval = 100ms;
  return opts;
}

/// The victim: once part of the transfer has happened, notes the time and SIGKILLs itself.
void victim(const std::string& name, bool victim_receives, KillRecord& record) {
  ProcessGroupShm pg(name, 1, 2, kill_options());
  const at::Tensor expected = pattern(at::kByte, kMessageBytes, 99);
  if (victim_receives) {
    const at::Tensor got = at::zeros({kMessageBytes}, at::kByte);
    auto work = post_recv(pg, got, 0, 1);
    const auto give_up = Clock::now() + 2s;
    // Progress until the first chunk has landed (or, if the transport stages whole messages,
    // until a little time has passed).
    const auto* first = got.data_ptr<uint8_t>();
    const auto* want = expected.data_ptr<uint8_t>();
    while (std::memcmp(first, want, 64) != 0 && Clock::now() < give_up) {
      if (work->isCompleted()) break;
    }
    if (work->isCompleted()) record.completed_before_kill.store(1);
  } else {
    auto work = post_send(pg, expected, 0, 1);
    (void)work->isCompleted();
    std::this_thread::sleep_for(20ms);
    if (work->isCompleted()) record.completed_before_kill.store(1);
  }
  record.kill_ns.store(monotonic_ns());
  ::raise(SIGKILL);
}

/// The survivor: its wait must fail with PeerLostError naming rank 1 within about a second of
/// the kill; then a new group of the same name works.
void survivor(const std::string& name, bool survivor_sends, KillRecord& record, const std::string& tag) {
  {
    ProcessGroupShm pg(name, 0, 2, kill_options());
    const at::Tensor buffer =
        survivor_sends ? pattern(at::kByte, kMessageBytes, 99) : at::zeros({kMessageBytes}, at::kByte);
    auto work = survivor_sends ? post_send(pg, buffer, 1, 1) : post_recv(pg, buffer, 1, 1);
    const Caught c = catch_any([&] { work->wait(); });
    const int64_t caught_ns = monotonic_ns();
    SHM_CHECK(record.completed_before_kill.load() == 0, "the transfer completed before the victim died");
    std::fprintf(stderr, "[%s] wait threw %s\n", tag.c_str(), c.describe().c_str());
    SHM_CHECK(c.is<PeerLostError>(), "Work::wait threw " << c.describe() << ", not a tdshm::PeerLostError");
    SHM_CHECK(contains_nocase(c.what, "rank 1") || contains_nocase(c.what, "peer 1"),
              "the message does not name the lost peer (rank 1): " << c.what);
    const int64_t kill_ns = record.kill_ns.load();
    SHM_CHECK(kill_ns != 0, "the victim did not record its death");
    const auto latency = std::chrono::nanoseconds(caught_ns - kill_ns);
    std::fprintf(stderr, "[%s] noticed %.0f ms after the kill\n", tag.c_str(),
                 std::chrono::duration<double, std::milli>(latency).count());
    SHM_CHECK(latency < kDetectionBound, "the death was noticed "
                                             << std::chrono::duration_cast<std::chrono::milliseconds>(latency).count()
                                             << " ms after the kill");
    // isCompleted() is true for a failed work, and the group still refuses to talk to rank 1.
    SHM_CHECK(work->isCompleted(), "a failed work is not completed");
  }
  record.old_group_gone.store(1);
  ProcessGroupShm pg(name, 0, 2, kill_options());
  exchange(pg);
}

/// A new rank 1, once the survivor has left its first group.
void successor(const std::string& name, KillRecord& record) {
  const auto give_up = Clock::now() + 20s;
  while (record.old_group_gone.load() == 0 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
  SHM_CHECK(record.old_group_gone.load() == 1, "the survivor never left its first group");
  ProcessGroupShm pg(name, 1, 2, kill_options());
  exchange(pg);
}

void peer_killed_mid_transfer(const std::string& name, bool victim_receives) {
  Shared<KillRecord> record;
  const std::string tag = victim_receives ? "receiver killed" : "sender killed";
  std::vector<Child> children;
  children.emplace_back([&] { survivor(name, victim_receives, *record, tag); });
  children.emplace_back([&] { victim(name, victim_receives, *record); });
  children.emplace_back([&] { successor(name, *record); });
  wait_all(children, 60s);
  EXPECT_TRUE(children[0].ok()) << "survivor (rank 0): " << children[0].describe();
  EXPECT_EQ(children[1].signal(), SIGKILL) << "victim (rank 1): " << children[1].describe();
  EXPECT_TRUE(children[2].ok()) << "successor (new rank 1): " << children[2].describe();
}

TEST_F(ShmSegmentProcs, ReceiverKilledMidTransferFailsTheSender) { peer_killed_mid_transfer(unique_name(), true); }

TEST_F(ShmSegmentProcs, SenderKilledMidTransferFailsTheReceiver) { peer_killed_mid_transfer(unique_name(), false); }

TEST_F(ShmSegmentProcs, PeerKilledWhileAnUnreapedChildOfTheWaiter) {
  // The survivor forked the victim itself and does not reap it while it waits: the dead victim is
  // a zombie (its pid and /proc entry remain) and must still count as dead. The victim sends and
  // the survivor receives: a sending victim writes what fits in the 4-entry ring and sleeps before
  // it dies, so the 256-chunk message cannot complete first (a receiving victim could take the
  // whole message within one progress call while the survivor streams it).
  const std::string name = unique_name();
  Shared<KillRecord> record;
  Child survivor_process([&] {
    pid_t victim_pid = ::fork();
    if (victim_pid == 0) {
      try {
        victim(name, /*victim_receives=*/false, *record);
      } catch (...) {
      }
      ::_exit(1);
    }
    SHM_CHECK(victim_pid > 0, "fork failed");
    // Do not reap the victim until the wait has failed.
    std::string failure;
    try {
      ProcessGroupShm pg(name, 0, 2, kill_options());
      const at::Tensor buffer = at::zeros({kMessageBytes}, at::kByte);
      auto work = post_recv(pg, buffer, 1, 1);
      const Caught c = catch_any([&] { work->wait(); });
      SHM_CHECK(record->completed_before_kill.load() == 0, "the transfer completed before the victim died");
      const auto latency = std::chrono::nanoseconds(monotonic_ns() - record->kill_ns.load());
      std::fprintf(stderr, "[zombie peer] wait threw %s, %.0f ms after the kill\n", c.describe().c_str(),
                   std::chrono::duration<double, std::milli>(latency).count());
      SHM_CHECK(c.is<PeerLostError>(), "Work::wait threw " << c.describe());
      SHM_CHECK(latency < kDetectionBound, "noticed " << latency.count() / 1000000 << " ms after the kill");
    } catch (...) {
      ::waitpid(victim_pid, nullptr, 0);
      throw;
    }
    ::waitpid(victim_pid, nullptr, 0);
  });
  survivor_process.wait(40s);
  EXPECT_TRUE(survivor_process.ok()) << survivor_process.describe();
  // The victim died without leaving and the survivor left: the segment may remain (nobody live),
  // and then it is stale.
  if (!shm_entries_of(name).empty()) {
    EXPECT_TRUE(remove_stale_segment(name));
  }
}

// ---------------------------------------------------------------------------------------------
// Incarnations: destroy -> construct under one name, in any interleaving

/// One round of a re-created group: rank 0 sends x = round to every rank, each answers x + rank.
/// A message of another round (another incarnation) would carry another x.
void checked_round(ProcessGroupShm& pg, int round) {
  const int rank = pg.getRank(), size = pg.getSize();
  const at::Tensor x = at::full({3}, static_cast<int64_t>(round), at::kLong);
  if (rank == 0) {
    for (int r = 1; r < size; ++r) post_send(pg, x, r, 5)->wait();
    for (int r = 1; r < size; ++r) {
      const at::Tensor got = at::zeros({3}, at::kLong);
      post_recv(pg, got, r, 6)->wait();
      SHM_CHECK(at::equal(got, x + r), "round " << round << ": rank " << r << " answered " << got);
    }
  } else {
    const at::Tensor got = at::zeros({3}, at::kLong);
    post_recv(pg, got, 0, 5)->wait();
    SHM_CHECK(at::equal(got, x), "round " << round << ": rank " << rank << " got " << got);
    post_send(pg, got + rank, 0, 6)->wait();
  }
}

void recreate_loop(const std::string& name, int world, int rounds) {
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, world, [&](int r) {
    std::mt19937 rng(static_cast<unsigned>(r * 7919 + 17));
    std::uniform_int_distribution<int> pause_us(0, 2000);
    auto pause = [&] { std::this_thread::sleep_for(std::chrono::microseconds(pause_us(rng))); };
    for (int round = 0; round < rounds; ++round) {
      pause();
      ProcessGroupShm pg(name, r, world, opts);
      pause();
      checked_round(pg, round);
      if (round % 2 == 0) pg.barrier()->wait();  // with and without a barrier before destroy
      pause();
    }
  }));
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{}) << "the last rank to leave removes the segment";
}

TEST_F(ShmSegmentProcs, RecreatedGroupOfTwoNeverSeesAnotherIncarnation) { recreate_loop(unique_name(), 2, 60); }

TEST_F(ShmSegmentProcs, RecreatedGroupOfFourNeverSeesAnotherIncarnation) { recreate_loop(unique_name(), 4, 25); }

// A process that announced itself as joining rank 1 (its JoinRecord in the lock file) and died
// before it could claim the slot (killed while it waited for the lock): rank 0's rendezvous
// fails at once naming rank 1, and the name then works for a complete group.
TEST_F(ShmSegmentProcs, ARankThatDiedWhileJoiningEndsTheRendezvousAtOnce) {
  const std::string name = unique_name();
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  const int lock = ::open((segment_path(name) + ".lock").c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  ASSERT_GE(lock, 0) << std::strerror(errno);
  shm::JoinRecord rec;
  rec.magic = shm::JoinRecord::kMagic;
  rec.pid = static_cast<uint32_t>(dead);
  rec.rank = 1;
  rec.start_time = 12345;
  ASSERT_EQ(::pwrite(lock, &rec, sizeof rec, static_cast<off_t>(shm::kJoinRecordsOffset + sizeof rec)),
            static_cast<ssize_t>(sizeof rec));
  ::close(lock);
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  Child rank0([&] {
    const auto start = Clock::now();
    const Caught c = catch_any([&] { ProcessGroupShm pg(name, 0, 2, opts); });
    SHM_CHECK(c.is<PeerLostError>(), "rank 0's rendezvous threw " << c.describe());
    SHM_CHECK(contains_nocase(c.what, "rank 1") && contains_nocase(c.what, "joining"), "unclear: " << c.what);
    SHM_CHECK(Clock::now() - start < 10s, "the dead joiner was noticed only at the timeout");
  });
  rank0.wait(30s);
  EXPECT_TRUE(rank0.ok()) << rank0.describe();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, opts);
    exchange(pg);
  }));
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

// A rank whose rendezvous timed out marks its slot abandoned: a peer still waiting in that
// rendezvous fails at once (RendezvousAbandonedError) instead of completing it with a member that
// is gone.
TEST_F(ShmSegmentThreads, APeerThatGaveUpEndsTheRendezvousAtOnce) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  const auto start = Clock::now();
  PendingRank rank1(name, 1, 3, opts);
  ASSERT_TRUE(wait_segment_ready(name, {1}, 10s));
  ShmOptions quick = small_options();
  quick.timeout = 200ms;
  const Caught gave_up = catch_any([&] { ProcessGroupShm pg(name, 0, 3, quick); });
  ASSERT_TRUE(gave_up.is<TimeoutError>()) << gave_up.describe();
  const Caught& c = rank1.join();
  // Typed, so that a caller can tell it from a death and construct the group again.
  EXPECT_TRUE(c.is<RendezvousAbandonedError>() && c.is<PeerLostError>()) << c.describe();
  EXPECT_TRUE(contains_nocase(c.what, "gave up")) << c.what;
  EXPECT_LT(Clock::now() - start, 10s);
  // And the name works again for a complete group.
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, opts);
    pg.barrier()->wait();
  }));
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

// A rank recorded by a process of another PID namespace (another container sharing /dev/shm):
// its pid means nothing here. The rendezvous refuses it with a SegmentError that says so (before
// this, each side took the other for dead, or waited), and nothing of it counts as dead: gc and
// remove_stale_segment keep the segment. The foreign rank is forged here (a live pid of this
// namespace, another namespace inode), so the test needs no privileges.
TEST_F(ShmSegmentProcs, ARankOfAnotherPidNamespaceIsRefusedAndNeverTakenForDead) {
  if (shm::self_process().pid_ns == 0) GTEST_SKIP() << "/proc/self/ns/pid is not readable here";
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  Child rank0([&] {
    const auto start = Clock::now();
    const Caught c = catch_any([&] { ProcessGroupShm pg(name, 0, 2, opts); });
    SHM_CHECK(c.is<SegmentError>(), "rank 0's rendezvous threw " << c.describe());
    SHM_CHECK(contains_nocase(c.what, "rank 1") && contains_nocase(c.what, "another PID namespace"),
              "unclear: " << c.what);
    SHM_CHECK(Clock::now() - start < 10s, "the foreign rank was noticed only at the timeout");
  });
  ASSERT_TRUE(wait_segment_ready(name, {0}, 10s));
  const shm::ProcessId me = shm::self_process();
  {
    RawSegment raw(name);
    shm::RankSlot& slot = raw.rank_slot(1);
    slot.pid = me.pid;  // a live process here, but the slot says it is another namespace's pid
    slot.start_time = me.start_time;
    slot.pid_ns = me.pid_ns ^ 0x5a5a;
    slot.state.store(shm::kRankLive, std::memory_order_release);
  }
  ASSERT_TRUE(rank0.wait(30s)) << rank0.describe();
  EXPECT_TRUE(rank0.ok()) << rank0.describe();
  // Rank 0 abandoned the incarnation; rank 1 cannot be proven dead from here.
  const shm::SegmentInfo info = shm::inspect_segment(name);
  ASSERT_EQ(info.ranks.size(), 2u);
  EXPECT_TRUE(info.ranks[1].foreign);
  EXPECT_TRUE(info.ranks[1].alive);
  EXPECT_FALSE(info.ranks[0].foreign);
  EXPECT_FALSE(shm::gc_decision(info).first) << shm::gc_decision(info).second;
  const Caught removal = catch_any([&] { remove_stale_segment(name); });
  EXPECT_TRUE(removal.is<SegmentError>()) << removal.describe();
  EXPECT_NE(shm_entries_of(name), std::vector<std::string>{});
  remove_shm_entries_of(name);
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

// The same with a real PID namespace, where the kernel allows one (root, or a container that
// permits unshare): rank 1 runs as pid 1 of a new namespace. Both ranks fail with the
// SegmentError, and the last to leave removes the segment.
TEST_F(ShmSegmentProcs, RanksInTwoRealPidNamespacesBothGetTheSegmentError) {
  if (shm::self_process().pid_ns == 0) GTEST_SKIP() << "/proc/self/ns/pid is not readable here";
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 20s;
  auto expect_refused = [&](int rank) {
    const Caught c = catch_any([&] { ProcessGroupShm pg(name, rank, 2, opts); });
    SHM_CHECK(c.is<SegmentError>(), "rank " << rank << " threw " << c.describe());
    SHM_CHECK(contains_nocase(c.what, "another PID namespace"), "unclear: " << c.what);
  };
  // The middle process makes the namespace; its child, pid 1 there, is rank 1. Exit 77: the
  // kernel refused the namespace.
  Child rank1([&] {
    if (::unshare(CLONE_NEWPID) != 0) ::_exit(77);
    const pid_t inner = ::fork();
    if (inner == 0) {
      int code = 0;
      try {
        expect_refused(1);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank 1 in the new PID namespace: %s\n", e.what());
        code = 1;
      }
      ::_exit(code);
    }
    SHM_CHECK(inner > 0, "fork in the new namespace failed: " << std::strerror(errno));
    int status = 0;
    SHM_CHECK(::waitpid(inner, &status, 0) == inner, "waitpid failed");
    SHM_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank 1 (in the new namespace) failed: status " << status);
  });
  // Rank 0 starts once rank 1 is there, or not at all when the namespace was refused.
  const auto until = Clock::now() + 10s;
  while (!rank1.poll() && Clock::now() < until && shm_entries_of(name).empty()) std::this_thread::sleep_for(1ms);
  if (rank1.exited() && !rank1.ok()) {
    const std::string why = rank1.describe();
    if (why.find("exited with 77") != std::string::npos) GTEST_SKIP() << "unshare(CLONE_NEWPID) is not permitted here";
    FAIL() << why;
  }
  Child rank0([&] { expect_refused(0); });
  EXPECT_TRUE(rank0.wait(30s)) << rank0.describe();
  EXPECT_TRUE(rank0.ok()) << rank0.describe();
  EXPECT_TRUE(rank1.wait(30s)) << rank1.describe();
  EXPECT_TRUE(rank1.ok()) << rank1.describe();
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{});
}

}  // namespace
}  // namespace tdshm::test
