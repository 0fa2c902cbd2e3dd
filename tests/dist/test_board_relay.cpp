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

#include <thread>

#include "dist/dist_support.h"

namespace tdshm::test {
namespace {

class BoardRelayTest : public DistTest {};

TensorDict tree(int64_t n, double v) {
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
      auto board = tdshm::Board::create(writer_board, tree(kFloats, 0), {.readers = 2});
      {
        auto relay = tdshm::BoardRelay::sender(writer_board, g, {1});
        wait_until(f.step[0], 1, "the reader on the other host opened its board", &f.failed);
        for (int v = 1; v <= kVersions; ++v) board.publish(tree(kFloats, v));  // at full speed
        wait_until(f.step[1], 1, "the other host saw the last version", &f.failed);
        SHM_CHECK(relay.error().empty(), "the sender failed: " << relay.error());
        SHM_CHECK(relay.count() >= 1 && relay.count() <= static_cast<uint64_t>(kVersions),
                  "versions sent: " << relay.count());
        SHM_CHECK_THROWS(Error, [&] { (void)tdshm::BoardRelay::sender(writer_board, g, {0}); }, "another rank");
        std::fprintf(stderr, "[relay] %llu of %d versions sent (newest only)\n",
                     static_cast<unsigned long long>(relay.count()), kVersions);
      }  // the sender stops and tells the receiver
      f.step[3].store(1);
    } else if (rank == 1) {
      auto relay = tdshm::BoardRelay::receiver(host_board, tree(kFloats, 0), g, 0, {.readers = 2});
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

}  // namespace
}  // namespace tdshm::test
