// The versioned board (include/tdshm/board.h) between real processes: readers never see a torn
// version while the writer publishes at full speed (every element of a version holds its number);
// views hold their version until dropped; wait_newer wakes and times out; a reader that dies holds
// nothing; trees that differ are SchemaErrors naming the key; names, live writers, links; nothing
// left in /dev/shm.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/board.h>
#include <tdshm/errors.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "board/board_gc.h"
#include "shm_test_support.h"

namespace tdshm::test {
namespace {

class Board : public ShmTest {
 protected:
  std::string board_name() { return "b" + unique_name(); }
  static std::string path(const std::string& name) { return "/dev/shm/tdshm-board." + name; }
};

/// {"w": float [n], ("n", "step"): int64 [4]}, every element `v`.
TensorDict weights(int64_t n, double v) {
  return TensorDict({{"w", at::full({n}, v)}, {{"n", "step"}, at::full({4}, static_cast<int64_t>(v), at::kLong)}}, {});
}

/// Whether every element of `td` holds `v`.
bool holds(const TensorDict& td, uint64_t v) {
  return at::all(td.get("w") == static_cast<double>(v)).item<bool>() &&
         at::all(td.get(Key("n") / "step") == static_cast<int64_t>(v)).item<bool>();
}

/// Writes version `v` into `td` (every element `v`) and publishes it as that version.
void publish_version(tdshm::Board& board, TensorDict& td, uint64_t v) {
  td.get("w").fill_(static_cast<double>(v));
  td.get(Key("n") / "step").fill_(static_cast<int64_t>(v));
  SHM_CHECK(board.publish(td) == v, "publish returned another version");
}

struct Counts {
  std::atomic<int> writer_done{0};
  std::atomic<int> readers_ready{0};
  std::atomic<int64_t> reads{0};
  std::atomic<int64_t> views{0};
  std::atomic<int64_t> torn{0};
  std::atomic<int64_t> backwards{0};
};

// The writer publishes 1 MiB versions as fast as it can; two readers copy the newest and take
// views of it, checking every element against the version the board named, and that versions
// never go back.
TEST_F(Board, ReadersNeverSeeATornVersionWhileTheWriterRuns) {
  set_deadline(120s);
  const std::string name = board_name();
  constexpr int64_t kFloats = 256 * 1024;
  Shared<Counts> counts;
  std::vector<Child> children;
  children.emplace_back([&] {
    auto board = tdshm::Board::create(name, weights(kFloats, 0), {.readers = 4});
    const auto start = Clock::now();
    while (counts->readers_ready.load() < 2) {
      SHM_CHECK(Clock::now() - start < 30s, "the readers never opened the board");
      std::this_thread::sleep_for(1ms);
    }
    TensorDict td = weights(kFloats, 0);
    for (uint64_t v = 1; v <= 3000; ++v) {
      publish_version(board, td, v);
    }
    counts->writer_done.store(1);
    while (counts->readers_ready.load() < 4) std::this_thread::sleep_for(1ms);  // readers done
  });
  for (int r = 0; r < 2; ++r) {
    children.emplace_back([&, r] {
      auto board = tdshm::Board::open(name, {.timeout = 20s});
      counts->readers_ready.fetch_add(1);
      TensorDict mine = board.like();
      uint64_t last = 0;
      while (counts->writer_done.load() == 0) {
        const uint64_t v = board.read(mine);
        if (v == 0) continue;
        if (v < last) counts->backwards.fetch_add(1);
        last = v;
        if (!holds(mine, v)) counts->torn.fetch_add(1);
        counts->reads.fetch_add(1);
        if (r == 1) {
          const TensorDict view = board.view();
          const uint64_t at = static_cast<uint64_t>(view.get(Key("n") / "step")[0].item<int64_t>());
          if (at < last) counts->backwards.fetch_add(1);
          std::this_thread::sleep_for(200us);  // held while the writer goes on
          if (!holds(view, at)) counts->torn.fetch_add(1);
          counts->views.fetch_add(1);
        }
      }
      counts->readers_ready.fetch_add(1);
    });
  }
  ASSERT_TRUE(wait_all(children, 100s));
  for (const Child& c : children) EXPECT_TRUE(c.ok()) << c.describe();
  std::fprintf(stderr, "[board] %lld copies, %lld views checked element by element\n",
               static_cast<long long>(counts->reads.load()), static_cast<long long>(counts->views.load()));
  EXPECT_EQ(counts->torn.load(), 0);
  EXPECT_EQ(counts->backwards.load(), 0);
  EXPECT_GT(counts->reads.load(), 0);
  EXPECT_GT(counts->views.load(), 0);
  EXPECT_FALSE(std::filesystem::exists(path(name))) << "the board outlived its writer";
}

// A copy pins the version it reads as a view does: threads of one reader copy and view at once
// while the writer publishes at full speed, each copy and each view checked element by element
// (a writer that ignores the pins fails it: 1,149 torn in one run); a copy gives its pin back, so
// afterwards the reader still holds kPinsPerReader views, and a read while both pins hold views
// copies without one.
TEST_F(Board, ThreadsOfOneReaderCopyAndViewWithoutSharingAPin) {
  set_deadline(120s);
  const std::string name = board_name();
  constexpr int64_t kFloats = 64 * 1024;
  Shared<Counts> counts;
  // The writer is a child; the reader is this process, whose threads start after the fork.
  Child writer([&] {
    auto board = tdshm::Board::create(name, weights(kFloats, 0), {.readers = 1});
    TensorDict td = weights(kFloats, 0);
    const auto give_up = Clock::now() + 90s;  // the reader failed: end anyway
    uint64_t v = 0;
    while (counts->writer_done.load() == 0 && Clock::now() < give_up) publish_version(board, td, ++v);
  });
  struct Done {  // the writer stops however the reader ends
    Counts& c;
    ~Done() { c.writer_done.store(1); }
  } done{*counts};
  auto board = tdshm::Board::open(name, {.timeout = 20s});
  ASSERT_GT(board.wait_newer(0, std::chrono::milliseconds(20000)), 0u);
  std::atomic<int64_t> torn{0}, copies{0}, views{0};
  auto copier = [&] {
    TensorDict mine = board.like();
    for (int i = 0; i < 3000; ++i) {
      const uint64_t v = board.read(mine);
      if (!holds(mine, v)) torn.fetch_add(1);
      copies.fetch_add(1);
    }
  };
  auto viewer = [&] {
    for (int i = 0; i < 3000; ++i) {
      const TensorDict view = board.view();  // one pin; the copier's is the other
      const auto at = static_cast<uint64_t>(view.get(Key("n") / "step")[0].item<int64_t>());
      if (!holds(view, at)) torn.fetch_add(1);
      views.fetch_add(1);
    }
  };
  std::thread a(copier), b(viewer);
  a.join();
  b.join();
  EXPECT_EQ(torn.load(), 0) << "a copy or a view was torn";
  EXPECT_EQ(copies.load(), 3000);
  EXPECT_EQ(views.load(), 3000);
  {
    const TensorDict first = board.view();
    const TensorDict second = board.view();  // every pin came back
    TensorDict mine = board.like();
    for (int i = 0; i < 200; ++i) {
      const uint64_t v = board.read(mine);  // no pin left: copied as a seqlock reader does
      EXPECT_TRUE(holds(mine, v)) << "a copy made without a pin was torn";
    }
    EXPECT_TRUE(holds(first, static_cast<uint64_t>(first.get(Key("n") / "step")[0].item<int64_t>())))
        << "a held view changed";
  }
  counts->writer_done.store(1);
  ASSERT_TRUE(writer.wait(30s));
  EXPECT_TRUE(writer.ok()) << writer.describe();
  EXPECT_FALSE(std::filesystem::exists(path(name))) << "the board outlived its writer";
}

// The kill loop: while the writer publishes small versions at full speed and two readers read
// 10^6 versions between them (copies and views, every element checked), readers that open the
// board, pin a version (a view) and are killed mid-read come and go every few milliseconds. No
// read is torn, the writer never stops (a dead reader's pins are taken back), and the killed
// readers' slots are taken over (more readers are killed than the board has slots).
TEST_F(Board, NoTornVersionInAMillionReadsUnderTheKillLoop) {
  set_deadline(240s);
  const std::string name = board_name();
  constexpr int64_t kFloats = 1024;  // 4 KiB a version: 10^6 checked reads take seconds
  constexpr int64_t kReadsEach = 500000;
  constexpr uint32_t kSlots = 4;  // 2 checkers + 2 for the readers killed in a loop
  Shared<Counts> counts;
  Shared<std::atomic<int64_t>> published;
  std::vector<Child> children;
  children.emplace_back([&] {
    auto board = tdshm::Board::create(name, weights(kFloats, 0), {.readers = kSlots});
    TensorDict td = weights(kFloats, 0);
    uint64_t v = 0;
    while (counts->writer_done.load() == 0) {
      ++v;
      publish_version(board, td, v);
      published->store(static_cast<int64_t>(v));
    }
    while (counts->readers_ready.load() < 4) std::this_thread::sleep_for(1ms);  // checkers done
  });
  for (int r = 0; r < 2; ++r) {
    children.emplace_back([&, r] {
      auto board = tdshm::Board::open(name, {.timeout = 20s});
      counts->readers_ready.fetch_add(1);
      TensorDict mine = board.like();
      uint64_t last = 0;
      for (int64_t i = 0; i < kReadsEach; ++i) {
        uint64_t v = 0;
        if (r == 0 || i % 2 == 0) {
          v = board.read(mine);
          if (v != 0 && !holds(mine, v)) counts->torn.fetch_add(1);
        } else if (board.version() != 0) {
          const TensorDict view = board.view();
          v = static_cast<uint64_t>(view.get(Key("n") / "step")[0].item<int64_t>());
          if (!holds(view, v)) counts->torn.fetch_add(1);
        }
        if (v < last) counts->backwards.fetch_add(1);
        last = std::max(last, v);
        counts->reads.fetch_add(1);
      }
      counts->readers_ready.fetch_add(1);
    });
  }
  // The kill loop: a reader that pins a version and reads, killed a few milliseconds in.
  int64_t killed = 0;
  while (counts->readers_ready.load() < 4) {
    Child doomed([&] {
      auto board = tdshm::Board::open(name, {.timeout = 20s});
      TensorDict mine = board.like();
      while (board.version() == 0) std::this_thread::sleep_for(100us);
      const TensorDict a = board.view();
      const TensorDict b = board.view();  // every pin this slot has
      while (true) (void)board.read(mine);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(2 + killed % 7));
    doomed.kill();
    ASSERT_TRUE(doomed.wait(10s));
    ++killed;
  }
  counts->writer_done.store(1);
  ASSERT_TRUE(wait_all(children, 60s));
  for (const Child& c : children) EXPECT_TRUE(c.ok()) << c.describe();
  std::fprintf(stderr, "[board] %lld reads checked element by element, %lld versions published, %lld readers killed\n",
               static_cast<long long>(counts->reads.load()), static_cast<long long>(published->load()),
               static_cast<long long>(killed));
  EXPECT_EQ(counts->torn.load(), 0);
  EXPECT_EQ(counts->backwards.load(), 0);
  EXPECT_GE(counts->reads.load(), 2 * kReadsEach);
  EXPECT_GT(killed, static_cast<int64_t>(kSlots)) << "fewer readers killed than slots: no slot was taken over";
  EXPECT_GT(published->load(), 1000);
  EXPECT_FALSE(std::filesystem::exists(path(name))) << "the board outlived its writer";
}

// begin() / commit(): the writer writes a version in place; readers see it only once committed,
// whole; publish() and a second begin() wait for the commit (Error), a reader cannot begin.
TEST_F(Board, AVersionWrittenInPlaceIsSeenOnlyOnceCommitted) {
  set_deadline(60s);
  const std::string name = board_name();
  auto writer = tdshm::Board::create(name, weights(64, 0), {.readers = 1});
  auto reader = tdshm::Board::open(name);
  EXPECT_THROW((void)reader.begin(), Error);
  EXPECT_THROW((void)writer.commit(), Error) << "nothing begun";
  EXPECT_EQ(writer.publish(weights(64, 1)), 1u);
  for (uint64_t v = 2; v <= 20; ++v) {
    TensorDict slot = writer.begin();
    EXPECT_THROW((void)writer.publish(weights(64, 9)), Error);
    EXPECT_THROW((void)writer.begin(), Error);
    slot.get("w").fill_(static_cast<double>(v));
    TensorDict mine = reader.like();
    EXPECT_EQ(reader.read(mine), v - 1) << "a version not committed is not visible";
    EXPECT_TRUE(holds(mine, v - 1));
    slot.get(Key("n") / "step").fill_(static_cast<int64_t>(v));
    EXPECT_EQ(writer.commit(), v);
    EXPECT_EQ(reader.read(mine), v);
    EXPECT_TRUE(holds(mine, v));
    EXPECT_TRUE(holds(reader.view(), v));
  }
}

// view_leaves: the newest version's leaves in key order, views of the board that hold its pin
// until the last of them is dropped (a held one keeps its version while the writer goes on).
TEST_F(Board, ViewLeavesHoldTheirVersionUntilTheLastIsDropped) {
  set_deadline(60s);
  const std::string name = board_name();
  auto writer = tdshm::Board::create(name, weights(64, 0), {.readers = 1});
  auto reader = tdshm::Board::open(name);
  EXPECT_THROW((void)reader.view_leaves(), Error) << "nothing published yet";
  EXPECT_THROW((void)writer.view_leaves(), Error) << "the writer has no reader slot";
  writer.publish(weights(64, 1));
  std::vector<std::pair<Key, at::Tensor>> leaves = reader.view_leaves();
  ASSERT_EQ(leaves.size(), 2u);
  EXPECT_EQ(leaves[0].first, Key("n") / "step") << "sorted: n before w";
  EXPECT_EQ(leaves[1].first, Key("w"));
  EXPECT_TRUE(at::equal(leaves[0].second, at::full({4}, 1, at::kLong)));
  EXPECT_TRUE(at::equal(leaves[1].second, at::full({64}, 1.0f)));
  at::Tensor kept = leaves[1].second;
  leaves.clear();
  for (int v = 2; v <= 20; ++v) writer.publish(weights(64, v));  // around the held buffer
  EXPECT_TRUE(at::all(kept == 1.0f).item<bool>()) << "a held leaf keeps its version";
  const TensorDict second = reader.view();
  EXPECT_TRUE(holds(second, 20));
  EXPECT_THROW((void)reader.view_leaves(), Error) << "two pins held: the kept leaf's and the view's";
  kept = at::Tensor();
  EXPECT_EQ(reader.view_leaves().size(), 2u) << "the pin came back with the last leaf";
}

// Trees whose tensors are not contiguous are published and read element by element (a
// contiguous one is a memcpy); the elements a strided destination skips are left alone.
TEST_F(Board, StridedTreesArePublishedAndReadElementByElement) {
  set_deadline(60s);
  const std::string name = board_name();
  auto writer = tdshm::Board::create(name, weights(64, 0), {.readers = 1});
  auto reader = tdshm::Board::open(name);
  const at::Tensor w = at::arange(128, at::kFloat).slice(0, 0, 128, 2);  // 0, 2, ..., 126
  const at::Tensor step = at::arange(8, at::kLong).slice(0, 1, 8, 2);    // 1, 3, 5, 7
  ASSERT_FALSE(w.is_contiguous());
  EXPECT_EQ(writer.publish(TensorDict({{"w", w}, {{"n", "step"}, step}}, {})), 1u);
  TensorDict mine = reader.like();
  EXPECT_EQ(reader.read(mine), 1u);
  EXPECT_TRUE(at::equal(mine.get("w"), w.contiguous()));
  EXPECT_TRUE(at::equal(mine.get(Key("n") / "step"), step.contiguous()));
  const at::Tensor base = at::full({128}, -1.0f);
  TensorDict into({{"w", base.slice(0, 1, 128, 2)}, {{"n", "step"}, at::zeros({4}, at::kLong)}}, {});
  EXPECT_EQ(reader.read(into), 1u);
  EXPECT_TRUE(at::equal(base.slice(0, 1, 128, 2), w));
  EXPECT_TRUE(at::all(base.slice(0, 0, 128, 2) == -1.0f).item<bool>()) << "the elements between stay";
}

// wait_newer sleeps until a publish wakes it, and throws TimeoutError when none comes.
TEST_F(Board, WaitNewerWakesOnPublishAndTimesOut) {
  set_deadline(60s);
  const std::string name = board_name();
  Shared<Counts> counts;
  std::vector<Child> children;
  children.emplace_back([&] {
    auto board = tdshm::Board::create(name, weights(8, 0), {.readers = 1});
    while (counts->readers_ready.load() < 1) std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(100ms);
    board.publish(weights(8, 7));
    while (counts->readers_ready.load() < 2) std::this_thread::sleep_for(1ms);
  });
  children.emplace_back([&] {
    auto board = tdshm::Board::open(name);
    SHM_CHECK_THROWS(
        Error, [&] { (void)board.view(); }, "nothing published");
    TensorDict mine = board.like();
    SHM_CHECK(board.read(mine) == 0, "read before the first publish");
    counts->readers_ready.fetch_add(1);
    const auto start = Clock::now();
    SHM_CHECK(board.wait_newer(0, 10s) == 1, "the first version");
    SHM_CHECK(Clock::now() - start < 5s, "woken late");
    SHM_CHECK(board.read(mine) == 1 && holds(mine, 7), "the value published");
    const auto before = Clock::now();
    SHM_CHECK_THROWS(
        TimeoutError, [&] { (void)board.wait_newer(1, 50ms); }, "newer than 1");
    SHM_CHECK(Clock::now() - before >= 50ms, "the timeout was not kept");
    counts->readers_ready.fetch_add(1);
  });
  ASSERT_TRUE(wait_all(children, 30s));
  for (const Child& c : children) EXPECT_TRUE(c.ok()) << c.describe();
}

// A reader holds at most two versions as views; each is kept (the writer writes elsewhere) until
// dropped. A reader killed while it holds views holds nothing: the writer goes on, and a new
// reader takes its slot.
TEST_F(Board, ViewsHoldTheirVersionAndADeadReaderHoldsNothing) {
  set_deadline(60s);
  const std::string name = board_name();
  Shared<Counts> counts;
  std::vector<Child> children;
  children.emplace_back([&] {
    auto board = tdshm::Board::create(name, weights(1024, 0), {.readers = 1});
    board.publish(weights(1024, 1));
    while (counts->readers_ready.load() < 1) std::this_thread::sleep_for(1ms);
    for (int v = 2; v <= 20; ++v) board.publish(weights(1024, v));  // around the held buffers
    counts->writer_done.store(1);
    while (counts->readers_ready.load() < 2) std::this_thread::sleep_for(1ms);
    // The reader that held two views dies: its buffers and its slot come back.
    while (counts->readers_ready.load() < 3) std::this_thread::sleep_for(1ms);
    for (int v = 21; v <= 60; ++v) board.publish(weights(1024, v));
    counts->writer_done.store(2);
    while (counts->readers_ready.load() < 4) std::this_thread::sleep_for(1ms);
  });
  {
    Child reader([&] {
      auto board = tdshm::Board::open(name);
      SHM_CHECK(board.wait_newer(0, 10s) >= 1, "the first version");
      const TensorDict first = board.view();
      const uint64_t held = static_cast<uint64_t>(first.get("w")[0].item<double>());
      counts->readers_ready.fetch_add(1);
      while (counts->writer_done.load() < 1) std::this_thread::sleep_for(1ms);
      SHM_CHECK(holds(first, held), "a view changed while held");
      const TensorDict second = board.view();
      SHM_CHECK(holds(second, 20), "the newest version as a view");
      SHM_CHECK_THROWS(
          Error, [&] { (void)board.view(); }, "drop one");
      counts->readers_ready.fetch_add(1);
      ::raise(SIGKILL);  // holding both
    });
    ASSERT_TRUE(reader.wait(30s));
    EXPECT_EQ(reader.signal(), SIGKILL) << reader.describe();
  }
  children.emplace_back([&] {
    auto board = tdshm::Board::open(name);  // the dead reader's slot (the only one)
    counts->readers_ready.fetch_add(1);
    while (counts->writer_done.load() < 2) std::this_thread::sleep_for(1ms);
    TensorDict mine = board.like();
    SHM_CHECK(board.read(mine) == 60 && holds(mine, 60), "the newest version after the dead reader");
    counts->readers_ready.fetch_add(1);
  });
  ASSERT_TRUE(wait_all(children, 40s));
  for (const Child& c : children) EXPECT_TRUE(c.ok()) << c.describe();
  EXPECT_FALSE(std::filesystem::exists(path(name)));
}

// Trees that differ from the board's, bad names, a second writer, a link in the board's place.
TEST_F(Board, DifferentTreesNamesAndFilesAreRefused) {
  set_deadline(60s);
  const std::string name = board_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 1, [&](int) {
    auto board = tdshm::Board::create(name, weights(16, 0), {.readers = 2});
    SHM_CHECK_THROWS(
        SegmentError, [&] { (void)tdshm::Board::create(name, weights(16, 0)); }, "live writer");
    SHM_CHECK_THROWS(
        SchemaError, [&] { board.publish(weights(17, 1)); }, "leaf 'w'", "[17]");
    TensorDict extra = weights(16, 1);
    extra.set("x", at::ones({2}));
    SHM_CHECK_THROWS(
        SchemaError, [&] { board.publish(extra); }, "leaf 'x'");
    SHM_CHECK_THROWS(
        SchemaError,
        [&] {
          board.publish(TensorDict({{"w", at::ones({16})}}, {}));
        },
        "('n', 'step')");
    board.publish(weights(16, 3));
    auto reader = tdshm::Board::open(name);
    TensorDict wrong({{"w", at::zeros({16}, at::kDouble)}, {{"n", "step"}, at::zeros({4}, at::kLong)}}, {});
    SHM_CHECK_THROWS(
        SchemaError, [&] { (void)reader.read(wrong); }, "leaf 'w'", "Double");
    SHM_CHECK_THROWS(
        Error, [&] { reader.publish(weights(16, 1)); }, "reader");
    SHM_CHECK_THROWS(
        SegmentError, [&] { (void)tdshm::Board::create("../x", weights(1, 0)); }, "name");
    SHM_CHECK_THROWS(
        TimeoutError, [&] { (void)tdshm::Board::open(name + "-none", {.timeout = 20ms}); }, "no board");
    // A symbolic link where a board should be is never followed.
    const std::string link_name = name + "-link";
    std::filesystem::create_symlink(path(name), path(link_name));
    SHM_CHECK_THROWS(
        SegmentError, [&] { (void)tdshm::Board::open(link_name, {.timeout = 20ms}); }, "board");
    std::filesystem::remove(path(link_name));
  }));
  EXPECT_FALSE(std::filesystem::exists(path(name)));
}

// A writer killed leaves its board; the next writer of the name replaces it.
TEST_F(Board, ABoardLeftByADeadWriterIsReplaced) {
  set_deadline(60s);
  const std::string name = board_name();
  {
    Child writer([&] {
      auto board = tdshm::Board::create(name, weights(4, 0));
      board.publish(weights(4, 1));
      ::raise(SIGKILL);
    });
    ASSERT_TRUE(writer.wait(20s));
  }
  ASSERT_TRUE(std::filesystem::exists(path(name)));
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 1, [&](int) {
    auto board = tdshm::Board::create(name, weights(8, 0));
    SHM_CHECK(board.version() == 0, "a fresh board");
    SHM_CHECK(board.publish(weights(8, 2)) == 1, "its first version");
  }));
  EXPECT_FALSE(std::filesystem::exists(path(name)));
}

// The writer's Board destroyed (its process goes on) ends the waits of its readers' threads at
// once, asleep or not, with PeerLostError: no newer version can come to its file. The versions
// it published stay readable through the readers' own mappings.
TEST_F(Board, ClosingTheWriterEndsTheWaitsOfReaderThreads) {
  set_deadline(60s);
  const std::string name = board_name();
  std::optional<tdshm::Board> writer(tdshm::Board::create(name, weights(4, 0), {.readers = 2}));
  auto sleeper = tdshm::Board::open(name, {.spin = std::chrono::microseconds(0)});
  auto spinner = tdshm::Board::open(name, {.spin = std::chrono::microseconds(20'000'000)});
  writer->publish(weights(4, 1));
  std::atomic<int> waiting{0};
  std::vector<std::string> said(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      tdshm::Board& b = t == 0 ? sleeper : spinner;
      waiting.fetch_add(1);
      try {
        (void)b.wait_newer(1, 30s);
        said[t] = "returned";
      } catch (const PeerLostError& e) {
        said[t] = e.what();
      } catch (const std::exception& e) {
        said[t] = std::string("another error: ") + e.what();
      }
    });
  }
  while (waiting.load() < 2) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);  // the sleeper is asleep on the futex by now, most likely
  const auto start = Clock::now();
  writer.reset();
  for (auto& t : threads) t.join();
  EXPECT_LT(Clock::now() - start, 2s);
  for (const std::string& s : said) EXPECT_NE(s.find("closed it at version 1"), std::string::npos) << s;
  TensorDict mine = sleeper.like();
  EXPECT_EQ(sleeper.read(mine), 1u);
  EXPECT_TRUE(holds(mine, 1));
  EXPECT_FALSE(std::filesystem::exists(path(name)));
}

// A writer that dies ends its readers' waits (PeerLostError naming it, not a timeout: no newer
// version can come to its file), and the last of them removes the board's file, once its views
// are gone too. A reader of the dead writer's board never removes the board of a new writer that
// replaced it meanwhile.
TEST_F(Board, ADeadWritersReadersAreToldAndTheLastRemovesItsFile) {
  set_deadline(90s);
  struct Steps {
    std::atomic<int> opened{0};
    std::atomic<int> go{0};
  };
  Shared<Steps> steps;
  const std::string name = board_name();
  // Writer 1 publishes version 1 and is killed once both readers opened.
  Child writer1([&] {
    auto board = tdshm::Board::create(name, weights(4, 0), {.readers = 2});
    board.publish(weights(4, 1));
    while (steps->opened.load() < 2) std::this_thread::sleep_for(1ms);
    ::raise(SIGKILL);
  });
  std::optional<tdshm::Board> a(tdshm::Board::open(name, {.timeout = 20s}));
  std::optional<tdshm::Board> b(tdshm::Board::open(name, {.timeout = 20s}));
  ASSERT_EQ(a->wait_newer(0, 20s), 1u);
  steps->opened.store(2);
  ASSERT_TRUE(writer1.wait(20s));
  const auto start = Clock::now();
  try {
    (void)a->wait_newer(1, 30s);
    ADD_FAILURE() << "wait_newer returned after the writer died";
  } catch (const PeerLostError& e) {
    EXPECT_LT(Clock::now() - start, 2s);
    EXPECT_NE(std::string(e.what()).find("(pid " + std::to_string(writer1.pid()) + ") died at version 1"),
              std::string::npos)
        << e.what();
  }
  TensorDict mine = b->like();
  EXPECT_EQ(b->read(mine), 1u);  // the last version stays readable
  EXPECT_TRUE(holds(mine, 1));
  a.reset();
  EXPECT_TRUE(std::filesystem::exists(path(name))) << "removed while a reader still had it open";

  // Writer 2 replaces the board while reader b still has the old one: b leaving removes nothing.
  Child writer2([&] {
    auto board = tdshm::Board::create(name, weights(8, 0));
    board.publish(weights(8, 2));
    steps->go.store(1);
    while (steps->go.load() < 2) std::this_thread::sleep_for(1ms);
  });
  const auto until = Clock::now() + 20s;
  while (steps->go.load() < 1 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(steps->go.load(), 1) << writer2.describe();
  b.reset();
  ASSERT_TRUE(std::filesystem::exists(path(name))) << "the old board's reader removed the new board";
  {
    auto c = tdshm::Board::open(name, {.timeout = 5s});
    TensorDict got = c.like();
    EXPECT_EQ(c.read(got), 1u);
    EXPECT_EQ(got.get("w").numel(), 8);
    EXPECT_TRUE(at::all(got.get("w") == 2.0).item<bool>());
  }
  steps->go.store(2);
  ASSERT_TRUE(writer2.wait(20s));
  EXPECT_TRUE(writer2.ok()) << writer2.describe();
  EXPECT_FALSE(std::filesystem::exists(path(name)));

  // Writer 3 is killed while its one reader holds a view: the file goes with the view.
  steps->opened.store(0);
  Child writer3([&] {
    auto board = tdshm::Board::create(name, weights(4, 0));
    board.publish(weights(4, 3));
    while (steps->opened.load() < 1) std::this_thread::sleep_for(1ms);
    ::raise(SIGKILL);
  });
  std::optional<tdshm::Board> d(tdshm::Board::open(name, {.timeout = 20s}));
  ASSERT_EQ(d->wait_newer(0, 20s), 1u);
  std::optional<TensorDict> held(d->view());
  steps->opened.store(1);
  ASSERT_TRUE(writer3.wait(20s));
  d.reset();
  EXPECT_TRUE(std::filesystem::exists(path(name)));
  EXPECT_TRUE(holds(*held, 3));
  held.reset();
  EXPECT_FALSE(std::filesystem::exists(path(name)));
}

// `tdshm gc` for boards: it removes a board whose writer is gone and that no live reader has open
// (a writer killed with no reader), and keeps one whose writer runs, one a live reader still has
// open, and files that are no board or not this user's 0600 file.
TEST_F(Board, GcRemovesOnlyTheBoardsOfDeadWritersThatNoReaderHasOpen) {
  set_deadline(60s);
  const std::string stale = board_name(), read = board_name(), live = board_name(), junk = board_name(),
                    open_mode = board_name();
  for (const std::string* name : {&stale, &read}) {
    Child writer([&] {
      auto board = tdshm::Board::create(*name, weights(4, 0));
      board.publish(weights(4, 1));
      ::raise(SIGKILL);
    });
    ASSERT_TRUE(writer.wait(20s));
  }
  auto reader = tdshm::Board::open(read, {.timeout = 5s});  // the dead writer's board, held
  auto writer = tdshm::Board::create(live, weights(4, 0));
  for (const auto& [name, mode] : {std::pair{junk, 0600}, std::pair{open_mode, 0644}}) {
    const int fd = ::open(path(name).c_str(), O_RDWR | O_CREAT | O_EXCL, mode);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fchmod(fd, static_cast<mode_t>(mode)), 0);
    const std::string text(4096, 'x');  // as long as a board's header, and no board
    ASSERT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
    ::close(fd);
  }
  const std::vector<std::string> names{stale, read, live, junk, open_mode};
  auto decided = [&](bool dry_run) {
    std::map<std::string, detail::BoardGcItem> by_name;
    for (detail::BoardGcItem& item : detail::collect_stale_boards(dry_run, names)) by_name[item.name] = item;
    return by_name;
  };
  auto items = decided(/*dry_run=*/true);
  ASSERT_EQ(items.size(), names.size());
  EXPECT_TRUE(items[stale].removable) << items[stale].reason;
  EXPECT_NE(items[stale].reason.find("no reader has it open"), std::string::npos) << items[stale].reason;
  EXPECT_FALSE(items[stale].removed);
  EXPECT_FALSE(items[read].removable);
  EXPECT_NE(items[read].reason.find("reader pid " + std::to_string(::getpid())), std::string::npos)
      << items[read].reason;
  EXPECT_FALSE(items[live].removable);
  EXPECT_NE(items[live].reason.find("runs"), std::string::npos) << items[live].reason;
  EXPECT_FALSE(items[junk].removable);
  EXPECT_NE(items[junk].reason.find("not a board"), std::string::npos) << items[junk].reason;
  EXPECT_FALSE(items[open_mode].removable) << items[open_mode].reason;
  for (const std::string& name : names)
    EXPECT_TRUE(std::filesystem::exists(path(name))) << "a dry run removed " << name;

  items = decided(/*dry_run=*/false);
  EXPECT_TRUE(items[stale].removed) << items[stale].reason << items[stale].error;
  EXPECT_FALSE(std::filesystem::exists(path(stale)));
  for (const std::string& name : {read, live, junk, open_mode}) {
    EXPECT_FALSE(items[name].removed) << name;
    EXPECT_TRUE(std::filesystem::exists(path(name))) << name;
  }
  std::filesystem::remove(path(junk));
  std::filesystem::remove(path(open_mode));
  TensorDict mine = reader.like();
  EXPECT_EQ(reader.read(mine), 1u);  // the kept board still reads
}

// Every leaf starts at a multiple of 64 in the board, as torch's allocator places a tensor: a
// complex128 leaf after a bool one sat at 8 mod 16 (consolidate's packing), and torch's complex
// kernels crashed on its views and on like().
TEST_F(Board, LeavesOfEveryDtypeAreAlignedAsTorchPlacesThem) {
  set_deadline(60s);
  const std::string name = board_name();
  const TensorDict tree({{"a", at::ones({3}, at::kBool)},
                         {"b", at::full({3}, c10::complex<double>(1, 2), at::kComplexDouble)},
                         {"c", at::full({5}, 0.5, at::kHalf)},
                         {{"n", "d"}, at::full({1}, 7, at::kLong)}},
                        {});
  auto writer = tdshm::Board::create(name, tree, {.readers = 1});
  auto reader = tdshm::Board::open(name);
  EXPECT_EQ(writer.publish(tree), 1u);
  const TensorDict view = reader.view();
  for (const Key& k : view.keys(/*include_nested=*/true, /*leaves_only=*/true)) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(view.get(k).data_ptr()) % 64, 0u) << k.str();
  }
  EXPECT_TRUE(at::equal(view.get("b") * 2, tree.get("b") * 2));
  TensorDict mine = reader.like();
  EXPECT_EQ(reader.read(mine), 1u);
  for (const Key& k : tree.keys(true, true)) EXPECT_TRUE(at::equal(mine.get(k), tree.get(k))) << k.str();
}

// A leaf that is not a dense CPU tensor is a TypeError naming it (its data pointer is no host
// memory); a conjugate or negative view is published and read as its values, not its bytes.
TEST_F(Board, DeviceAndLazyViewsAreRefusedOrResolved) {
  set_deadline(60s);
  const std::string name = board_name();
  const at::Tensor z = at::tensor({c10::complex<float>(1, 2), c10::complex<float>(3, -4)});
  const TensorDict like({{"z", z}, {"r", at::ones({2})}}, {});
  auto writer = tdshm::Board::create(name, like, {.readers = 1});
  auto reader = tdshm::Board::open(name);
  try {
    writer.publish(TensorDict({{"z", z}, {"r", at::ones({2}, at::device(at::kMeta))}}, {}));
    ADD_FAILURE() << "a meta tensor was published";
  } catch (const TypeError& e) {
    EXPECT_NE(std::string(e.what()).find("leaf 'r' is a tensor on meta"), std::string::npos) << e.what();
  }
  const at::Tensor r = at::tensor({1.0f, 2.0f});
  ASSERT_TRUE(z.conj().is_conj());
  ASSERT_TRUE(at::_neg_view(r).is_neg());
  EXPECT_EQ(writer.publish(TensorDict({{"z", z.conj()}, {"r", at::_neg_view(r)}}, {})), 1u);
  TensorDict mine = reader.like();
  EXPECT_EQ(reader.read(mine), 1u);
  EXPECT_TRUE(at::equal(mine.get("z"), z.conj().resolve_conj()));
  EXPECT_TRUE(at::equal(mine.get("r"), -r));
  const at::Tensor into_z = at::zeros({2}, at::kComplexFloat).conj();
  const at::Tensor into_r = at::_neg_view(at::zeros({2}));
  TensorDict into({{"z", into_z}, {"r", into_r}}, {});
  EXPECT_EQ(reader.read(into), 1u);
  EXPECT_TRUE(at::equal(into_z.resolve_conj(), z.conj().resolve_conj())) << "a conjugate destination reads its values";
  EXPECT_TRUE(at::equal(into_r.resolve_neg(), -r));
}

// A child forked from a process that holds a board never acts for it: dropping its copies of the
// writer, a reader and a view neither closes the board, frees the parent's slot or pin, nor
// removes the file, and using them is an Error that says to open the board in the child.
TEST_F(Board, AForkedChildNeverActsForItsParentsBoard) {
  set_deadline(60s);
  const std::string name = board_name();
  std::optional<tdshm::Board> writer(tdshm::Board::create(name, weights(64, 0), {.readers = 1}));
  std::optional<tdshm::Board> reader(tdshm::Board::open(name));
  publish_version(*writer, *std::make_unique<TensorDict>(weights(64, 0)), 1);
  std::optional<TensorDict> view(reader->view());
  Child child([&] {
    TensorDict mine = weights(64, 0);
    bool refused = false;
    try {
      (void)reader->read(mine);
    } catch (const Error& e) {
      refused = std::string(e.what()).find("forked from") != std::string::npos;
    }
    SHM_CHECK(refused, "the child read through its parent's reader");
    try {
      writer->publish(weights(64, 9));
      SHM_CHECK(false, "the child published as its parent's writer");
    } catch (const Error&) {
    }
    view.reset();
    reader.reset();
    writer.reset();
  });
  ASSERT_TRUE(child.wait(20s));
  ASSERT_TRUE(child.ok()) << child.describe();
  EXPECT_TRUE(std::filesystem::exists(path(name)));
  TensorDict td = weights(64, 0);
  for (uint64_t v = 2; v <= 20; ++v) publish_version(*writer, td, v);  // around the held buffer
  EXPECT_TRUE(holds(*view, 1)) << "the parent's pin was freed by the child";
  EXPECT_EQ(reader->wait_newer(1, 0ms), 20u) << "the board was closed by the child";
  EXPECT_THROW((void)tdshm::Board::open(name, {.timeout = 100ms}), SegmentError) << "the parent's slot was freed";
}

// Threads of one writer publish one at a time: every version is whole and numbered once.
TEST_F(Board, ThreadsOfOneWriterPublishOneAtATime) {
  set_deadline(120s);
  const std::string name = board_name();
  auto writer = tdshm::Board::create(name, weights(4096, 0), {.readers = 1});
  auto reader = tdshm::Board::open(name);
  constexpr int kEach = 2000;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        writer.publish(weights(4096, static_cast<double>(t * kEach + i + 1)));
      }
      done.fetch_add(1);
    });
  }
  int64_t torn = 0, reads = 0;
  TensorDict mine = reader.like();
  while (done.load() < 2) {
    if (reader.read(mine) == 0) continue;
    ++reads;
    const double first = mine.get("w")[0].item<double>();
    torn += !at::all(mine.get("w") == first).item<bool>() ||
            !at::all(mine.get(Key("n") / "step") == static_cast<int64_t>(first)).item<bool>();
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(writer.version(), 2u * kEach) << "versions were lost";
  EXPECT_EQ(torn, 0) << "of " << reads << " reads";
}

// A timeout past what the clock holds (milliseconds::max as "forever") waits, not times out at
// once; a reader that polls (timeout 0) a closed board is told it is closed.
TEST_F(Board, EndlessTimeoutsWaitAndAPollerIsToldOfTheClose) {
  set_deadline(60s);
  const std::string name = board_name();
  std::optional<tdshm::Board> writer(tdshm::Board::create(name, weights(4, 0), {.readers = 1}));
  auto reader = tdshm::Board::open(name, {.timeout = std::chrono::milliseconds::max()});
  std::thread later([&] {
    std::this_thread::sleep_for(50ms);
    writer->publish(weights(4, 1));
  });
  EXPECT_EQ(reader.wait_newer(0, std::chrono::milliseconds::max()), 1u);
  later.join();
  EXPECT_THROW((void)reader.wait_newer(1, 0ms), TimeoutError);
  writer.reset();
  EXPECT_THROW((void)reader.wait_newer(1, 0ms), PeerLostError);
}

// A file under a board's name that holds no board and that no writer is making (another file,
// or one a writer killed while making it left) is a SegmentError at open, not a wait for the
// whole timeout; one that changed in the last seconds is waited for, as a board being made.
TEST_F(Board, OpenSaysAtOnceWhenNoBoardIsComing) {
  set_deadline(60s);
  const std::string other = board_name(), unfinished = board_name(), fresh = board_name();
  for (const std::string* name : {&other, &unfinished, &fresh}) {
    const int fd = ::open(path(*name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    const std::string text(4096, name == &other ? 'x' : '\0');
    ASSERT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
    if (name == &unfinished) {
      const timespec long_ago[2] = {{::time(nullptr) - 60, 0}, {::time(nullptr) - 60, 0}};
      ASSERT_EQ(::futimens(fd, long_ago), 0);
    }
    ::close(fd);
  }
  for (const auto& [name, says] : {std::pair{other, "is not a board"}, std::pair{unfinished, "holds no board"}}) {
    const auto start = Clock::now();
    try {
      (void)tdshm::Board::open(name, {.timeout = 20s});
      ADD_FAILURE() << name << " opened";
    } catch (const SegmentError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - start, 5s);
  }
  EXPECT_THROW((void)tdshm::Board::open(fresh, {.timeout = 200ms}), TimeoutError);
  for (const std::string& name : {other, unfinished, fresh}) std::filesystem::remove(path(name));
}

// close() is the destructor's work now: the writer's readers are told, and a closed Board (or one
// moved from) is an Error to use, not a crash.
TEST_F(Board, AClosedBoardIsAnErrorToUseAndItsReadersAreTold) {
  set_deadline(60s);
  const std::string name = board_name();
  auto writer = tdshm::Board::create(name, weights(4, 0), {.readers = 1});
  auto reader = tdshm::Board::open(name);
  writer.publish(weights(4, 1));
  writer.close();
  EXPECT_TRUE(writer.is_closed());
  EXPECT_FALSE(writer.is_writer());
  EXPECT_THROW((void)writer.publish(weights(4, 2)), Error);
  EXPECT_THROW((void)writer.version(), Error);
  EXPECT_THROW((void)reader.wait_newer(1, 10s), PeerLostError);
  tdshm::Board moved = std::move(reader);
  EXPECT_THROW((void)reader.view(), Error);  // NOLINT(bugprone-use-after-move): what it guards
  EXPECT_TRUE(holds(moved.view(), 1));
  moved.close();
  moved.close();
  EXPECT_FALSE(std::filesystem::exists(path(name)));
}

// A writer killed while it made its board (sizing the file, before the header was ready) leaves a
// file nobody opens: gc removes it once its lock is free and it has not changed for 5 s, and keeps
// one whose lock is held or that changed just now.
TEST_F(Board, GcRemovesTheFileOfAWriterKilledWhileItMadeTheBoard) {
  set_deadline(60s);
  const std::string old_file = board_name(), fresh = board_name(), locked = board_name();
  std::vector<int> fds;
  for (const std::string* name : {&old_file, &fresh, &locked}) {
    const int fd = ::open(path(*name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);  // zeros: no header yet
    if (name != &fresh) {
      const timespec long_ago[2] = {{::time(nullptr) - 60, 0}, {::time(nullptr) - 60, 0}};
      ASSERT_EQ(::futimens(fd, long_ago), 0);
    }
    fds.push_back(fd);
  }
  ASSERT_EQ(::flock(fds[2], LOCK_EX), 0);  // as its creator holds it
  std::map<std::string, detail::BoardGcItem> items;
  for (detail::BoardGcItem& item : detail::collect_stale_boards(false, {old_file, fresh, locked})) {
    items[item.name] = item;
  }
  EXPECT_TRUE(items[old_file].removed) << items[old_file].reason << items[old_file].error;
  EXPECT_NE(items[old_file].reason.find("died while it made"), std::string::npos) << items[old_file].reason;
  EXPECT_FALSE(std::filesystem::exists(path(old_file)));
  EXPECT_FALSE(items[fresh].removable) << items[fresh].reason;
  EXPECT_FALSE(items[locked].removable) << items[locked].reason;
  EXPECT_NE(items[locked].reason.find("holds the lock"), std::string::npos) << items[locked].reason;
  for (const int fd : fds) ::close(fd);
  std::filesystem::remove(path(fresh));
  std::filesystem::remove(path(locked));
}

// Another user's board is kept whatever its state, and gc says whose it is (it used to repeat
// Board::open's advice to remove the file). Root makes a file another uid owns; others skip.
TEST_F(Board, GcKeepsAnotherUsersBoardAndSaysWhose) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a file another uid owns";
  const std::string name = board_name();
  const int fd = ::open(path(name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchown(fd, 65534, 65534), 0);
  ::close(fd);
  const std::vector<detail::BoardGcItem> items = detail::collect_stale_boards(false, {name});
  ASSERT_EQ(items.size(), 1u);
  EXPECT_FALSE(items[0].removable);
  EXPECT_NE(items[0].reason.find("another user's board (uid 65534)"), std::string::npos) << items[0].reason;
  EXPECT_TRUE(std::filesystem::exists(path(name)));
  std::filesystem::remove(path(name));
}

}  // namespace
}  // namespace tdshm::test
