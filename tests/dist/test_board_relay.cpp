// A board across hosts (include/tdshm/board_relay.h), in a gloo world over TCP of three real
// processes standing for two hosts: rank 0 holds the writer's board and the relay sender; rank 1
// the relay receiver and its host's board; rank 2 a reader of that board, checking every element
// of every version it reads (none torn, none going back) until it sees the writer's last one.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/board.h>
#include <tdshm/board_relay.h>
#include <tdshm/distributed.h>
#include <tdshm/errors.h>

#include <csignal>
#include <filesystem>
#include <thread>

#include "dist/dist_support.h"

namespace tdshm::test {
namespace {

class BoardRelayTest : public DistTest {};

TensorDict relay_tree(int64_t n, double v) {
  return TensorDict({{"w", at::full({n}, v)}, {{"b", "bias"}, at::full({16}, v)}}, {});
}

TEST_F(BoardRelayTest, AnotherHostsBoardFollowsTheWritersNewestVersion) {
  set_deadline(120s);
  const std::string writer_board = "b" + unique_name(), host_board = "b" + unique_name();
  constexpr int64_t kFloats = 64 * 1024;  // 256 KiB a version
  constexpr int kVersions = 300;
  run_default_world(Method::kGlooTcp, 3, [&](int rank, Flags& f) {
    const Group g = default_group();
    if (rank == 0) {
      auto board = tdshm::Board::create(writer_board, relay_tree(kFloats, 0), {.readers = 2});
      {
        auto relay = tdshm::BoardRelay::sender(writer_board, g, {1});
        wait_until(f.step[0], 1, "the reader on the other host opened its board", &f.failed);
        for (int v = 1; v <= kVersions; ++v) board.publish(relay_tree(kFloats, v));  // at full speed
        wait_until(f.step[1], 1, "the other host saw the last version", &f.failed);
        SHM_CHECK(relay.error().empty(), "the sender failed: " << relay.error());
        SHM_CHECK(relay.count() >= 1 && relay.count() <= static_cast<uint64_t>(kVersions),
                  "versions sent: " << relay.count());
        SHM_CHECK_THROWS(
            Error, [&] { (void)tdshm::BoardRelay::sender(writer_board, g, {0}); }, "another rank");
        std::fprintf(stderr, "[relay] %llu of %d versions sent (newest only)\n",
                     static_cast<unsigned long long>(relay.count()), kVersions);
      }  // the sender stops and tells the receiver
      f.step[3].store(1);
    } else if (rank == 1) {
      auto relay = tdshm::BoardRelay::receiver(host_board, relay_tree(kFloats, 0), g, 0, {.readers = 2});
      f.step[2].store(1);
      wait_until(f.step[3], 1, "the sender stopped", &f.failed);
      relay.wait_count(UINT64_MAX, std::chrono::seconds(10));
      SHM_CHECK(relay.stopped(), "the receiver did not stop when its sender did");
      SHM_CHECK(relay.error().empty(), "an orderly stop is no error: " << relay.error());
      SHM_CHECK(relay.count() >= 1, "nothing received");
    } else {
      wait_until(f.step[2], 1, "this host's board", &f.failed);
      auto board = tdshm::Board::open(host_board, {.timeout = 20s});
      f.step[0].store(1);
      TensorDict mine = board.like();
      uint64_t seen = 0;
      double last = 0;
      int64_t reads = 0;
      while (last < kVersions) {
        seen = board.wait_newer(seen, std::chrono::seconds(20));
        seen = board.read(mine);
        const double v = mine.get("w")[0].item<double>();
        SHM_CHECK(at::all(mine.get("w") == v).item<bool>() && at::all(mine.get(Key("b") / "bias") == v).item<bool>(),
                  "a torn version on the other host: w[0] = " << v);
        SHM_CHECK(v >= last, "the other host's board went back from " << last << " to " << v);
        last = v;
        ++reads;
      }
      SHM_CHECK(reads >= 1, "no read");
      f.step[1].store(1);
    }
  });
}

// The writer's host dies (SIGKILL) mid-stream: the other host's receiver stops with the group's
// error, and its board keeps the last version it had, whole, for its readers.
TEST_F(BoardRelayTest, AReceiverWhoseSenderDiedStopsWithAnErrorAndKeepsItsBoard) {
  set_deadline(120s);
  const std::string writer_board = "b" + unique_name(), host_board = "b" + unique_name();
  const Rendezvous rv = rendezvous(Method::kGlooTcp);
  Shared<Flags> flags;
  Child receiver([&] {
    init_process_group("gloo", init_options(rv, 0, 2));  // rank 0 serves the store: it stays
    auto relay = tdshm::BoardRelay::receiver(host_board, relay_tree(1024, 0), default_group(), 1, {.readers = 2});
    flags->step[0].store(1);
    SHM_CHECK(relay.wait_count(3, std::chrono::seconds(20)) >= 3, "fewer than 3 versions arrived");
    flags->step[1].store(1);  // the sender's host dies now
    const auto start = Clock::now();
    relay.wait_count(UINT64_MAX, std::chrono::seconds(30));
    SHM_CHECK(relay.stopped(), "the receiver did not stop when its sender died");
    SHM_CHECK(!relay.error().empty(), "a sender that died is an error");
    std::fprintf(stderr, "[relay] the receiver stopped %.2f s after the sender's death: %s\n",
                 std::chrono::duration<double>(Clock::now() - start).count(), relay.error().c_str());
    auto reader = tdshm::Board::open(host_board);
    TensorDict mine = reader.like();
    SHM_CHECK(reader.read(mine) == relay.count(), "the board's last version is the last received");
    const double v = mine.get("w")[0].item<double>();
    SHM_CHECK(v >= 1 && at::all(mine.get("w") == v).item<bool>(), "the last version is whole: w[0] = " << v);
  });
  Child sender([&] {
    init_process_group("gloo", init_options(rv, 1, 2));
    auto board = tdshm::Board::create(writer_board, relay_tree(1024, 0), {.readers = 2});
    auto relay = tdshm::BoardRelay::sender(writer_board, default_group(), {0});
    wait_until(flags->step[0], 1, "the receiver");
    for (int v = 1; flags->step[1].load() == 0; ++v) {
      board.publish(relay_tree(1024, v));
      std::this_thread::sleep_for(1ms);
    }
    ::raise(SIGKILL);
  });
  ASSERT_TRUE(sender.wait(60s));
  EXPECT_EQ(sender.signal(), SIGKILL) << sender.describe();
  ASSERT_TRUE(receiver.wait(60s));
  EXPECT_TRUE(receiver.ok()) << receiver.describe();
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/tdshm-board." + host_board)) << "the receiver's board outlived it";
  std::filesystem::remove("/dev/shm/tdshm-board." + writer_board);  // a killed writer's board (replaced by the next)
}

// The writer dies (the relay's sender lives): the sender's wait ends at once, it tells its
// receivers to stop and stops with an error that says so; each receiver stops without one and its
// host's board keeps the last version it had.
TEST_F(BoardRelayTest, ASenderWhoseWriterDiedStopsItsReceiversAndSaysWhy) {
  set_deadline(120s);
  const std::string writer_board = "b" + unique_name(), host_board = "b" + unique_name();
  const Rendezvous rv = rendezvous(Method::kGlooTcp);
  Shared<Flags> flags;
  Child writer([&] {
    auto board = tdshm::Board::create(writer_board, relay_tree(1024, 0), {.readers = 2});
    for (int v = 1; flags->step[1].load() == 0; ++v) {
      board.publish(relay_tree(1024, v));
      std::this_thread::sleep_for(1ms);
    }
    ::raise(SIGKILL);
  });
  Child receiver([&] {
    init_process_group("gloo", init_options(rv, 0, 2));
    auto relay = tdshm::BoardRelay::receiver(host_board, relay_tree(1024, 0), default_group(), 1, {.readers = 2});
    flags->step[0].store(1);
    SHM_CHECK(relay.wait_count(3, std::chrono::seconds(20)) >= 3, "fewer than 3 versions arrived");
    flags->step[1].store(1);  // the writer dies now
    relay.wait_count(UINT64_MAX, std::chrono::seconds(30));
    SHM_CHECK(relay.stopped(), "the receiver did not stop when the writer died");
    SHM_CHECK(relay.error().empty(), "told to stop, not an error: " << relay.error());
    auto reader = tdshm::Board::open(host_board);
    TensorDict mine = reader.like();
    SHM_CHECK(reader.read(mine) == relay.count(), "the board's last version is the last received");
    flags->step[2].store(1);
  });
  Child sender([&] {
    init_process_group("gloo", init_options(rv, 1, 2));
    auto relay = tdshm::BoardRelay::sender(writer_board, default_group(), {0}, {.timeout = std::chrono::seconds(20)});
    const auto start = Clock::now();
    relay.wait_count(UINT64_MAX, std::chrono::seconds(60));
    SHM_CHECK(relay.stopped(), "the sender did not stop when its writer died");
    SHM_CHECK(relay.error().find("died at version") != std::string::npos, "error(): " << relay.error());
    SHM_CHECK(Clock::now() - start < std::chrono::seconds(60), "stopped late");
    wait_until(flags->step[2], 1, "the receiver's checks");  // rank 0 serves the store until then
  });
  ASSERT_TRUE(writer.wait(60s));
  EXPECT_EQ(writer.signal(), SIGKILL) << writer.describe();
  ASSERT_TRUE(receiver.wait(60s));
  EXPECT_TRUE(receiver.ok()) << receiver.describe();
  ASSERT_TRUE(sender.wait(60s));
  EXPECT_TRUE(sender.ok()) << sender.describe();
  // The sender was the dead writer's last reader: it removed the writer's board.
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/tdshm-board." + writer_board));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/tdshm-board." + host_board));
}

}  // namespace
}  // namespace tdshm::test
