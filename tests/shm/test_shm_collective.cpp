// Collectives of ProcessGroupShm (broadcast, barrier, and the ones it refuses) and the behaviour
// of its Work handles: completion, wait with a timeout, the group's deadline, futures, and the
// TransportError of a message that does not fit the tensor it lands in.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "shm_test_support.h"

namespace tdshm::test {
namespace {

class ShmCollectiveThreads : public ShmTest {};
class ShmCollectiveProcs : public ShmTest {};
class ShmWorkThreads : public ShmTest {};

// ---------------------------------------------------------------------------------------------
// Broadcast

/// Scenario (3 ranks): broadcasts from rank 0 and from rank 2, back to back, of a small and a
/// chunked tensor, contiguous and not (non-roots receive into strided or transposed views).
void broadcast_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 3, opts);
  const auto slot = static_cast<int64_t>(opts.slot_bytes);
  int round = 0;
  for (int root : {0, 2, 2, 0, 1}) {
    for (auto [dtype, numel] : {std::pair{at::kFloat, int64_t{2}}, std::pair{at::kByte, 3 * slot + 7},
                                std::pair{at::kDouble, (3 * slot + 7) / 8 + 1}}) {
      ++round;
      const at::Tensor values = pattern(dtype, numel, static_cast<uint64_t>(round * 31 + root));
      const Layout layout = rank % 2 == 0 ? Layout::kContiguous : Layout::kStrided;
      const at::Tensor t = rank == root ? with_layout(values, layout) : blank_like(values, layout);
      std::vector<at::Tensor> v{t};
      c10d::BroadcastOptions bopts;
      bopts.rootRank = root;
      pg.broadcast(v, bopts)->wait();
      SHM_CHECK(same_bytes(t, values), "broadcast " << round << " from rank " << root << " of " << numel << " "
                                                    << c10::toString(dtype) << " differs on rank " << rank);
    }
  }
  // 2-D, transposed at the root and at the receivers.
  const at::Tensor values = pattern(at::kInt, 37 * 29, 4242).reshape({37, 29});
  const at::Tensor t = rank == 2 ? with_layout(values, Layout::kTransposed) : blank_like(values, Layout::kTransposed);
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions bopts;
  bopts.rootRank = 2;
  pg.broadcast(v, bopts)->wait();
  SHM_CHECK(same_bytes(t, values), "transposed broadcast differs on rank " << rank);
}

TEST_F(ShmCollectiveThreads, BroadcastFromAnyRoot) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) { broadcast_scenario(name, r, small_options()); }));
}

TEST_F(ShmCollectiveProcs, BroadcastFromAnyRoot) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) { broadcast_scenario(name, r, small_options()); }));
}

TEST_F(ShmCollectiveThreads, BroadcastBlockingOnly) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) { broadcast_scenario(name, r, small_options(0us)); }));
}

// ---------------------------------------------------------------------------------------------
// Barrier

constexpr int kBarrierRounds = 6;
constexpr int kBarrierRanks = 3;
constexpr auto kLateBy = 150ms;

struct BarrierTimes {
  std::atomic<int64_t> enter[kBarrierRounds][kBarrierRanks];
  std::atomic<int64_t> leave[kBarrierRounds][kBarrierRanks];
};

/// Scenario: in round k, rank k % 3 comes late; every rank notes when it entered and left.
void barrier_scenario(const std::string& name, int rank, const ShmOptions& opts, BarrierTimes& times) {
  ProcessGroupShm pg(name, rank, kBarrierRanks, opts);
  for (int round = 0; round < kBarrierRounds; ++round) {
    if (round % kBarrierRanks == rank) std::this_thread::sleep_for(kLateBy);
    times.enter[round][rank].store(monotonic_ns());
    pg.barrier()->wait();
    times.leave[round][rank].store(monotonic_ns());
  }
}

void expect_barriers_held(const BarrierTimes& times) {
  for (int round = 0; round < kBarrierRounds; ++round) {
    int64_t last_enter = 0;
    int64_t first_leave = INT64_MAX;
    for (int r = 0; r < kBarrierRanks; ++r) {
      ASSERT_NE(times.enter[round][r].load(), 0) << "round " << round << " rank " << r << " never entered";
      ASSERT_NE(times.leave[round][r].load(), 0) << "round " << round << " rank " << r << " never left";
      last_enter = std::max(last_enter, times.enter[round][r].load());
      first_leave = std::min(first_leave, times.leave[round][r].load());
    }
    EXPECT_GE(first_leave, last_enter) << "round " << round << ": a rank left the barrier "
                                       << (last_enter - first_leave) / 1000 << " us before the late rank "
                                       << round % kBarrierRanks << " entered it";
  }
}

TEST_F(ShmCollectiveThreads, BarrierHoldsEveryoneUntilTheLastArrives) {
  const std::string name = unique_name();
  Shared<BarrierTimes> times;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, kBarrierRanks, [&](int r) { barrier_scenario(name, r, small_options(), *times); }));
  expect_barriers_held(*times);
}

TEST_F(ShmCollectiveProcs, BarrierHoldsEveryoneUntilTheLastArrives) {
  const std::string name = unique_name();
  Shared<BarrierTimes> times;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, kBarrierRanks, [&](int r) { barrier_scenario(name, r, small_options(), *times); }));
  expect_barriers_held(*times);
}

TEST_F(ShmCollectiveProcs, BarrierBlockingOnly) {
  const std::string name = unique_name();
  Shared<BarrierTimes> times;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, kBarrierRanks,
                                [&](int r) { barrier_scenario(name, r, small_options(0us), *times); }));
  expect_barriers_held(*times);
}

TEST_F(ShmCollectiveThreads, BarrierAndP2PInterleave) {
  // A barrier between point-to-point messages must not be confused with them (nor they with it).
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    for (int i = 0; i < 20; ++i) {
      const at::Tensor values = pattern(at::kByte, i % 2 == 0 ? 8 : 3 * 4096 + 1, static_cast<uint64_t>(i));
      if (r == 0) {
        auto s = post_send(pg, values, 1, 0);
        pg.barrier()->wait();
        s->wait();
      } else {
        pg.barrier()->wait();
        const at::Tensor got = at::zeros_like(values);
        post_recv(pg, got, 0, 0)->wait();
        SHM_CHECK(same_bytes(got, values), "message " << i << " differs");
      }
    }
  }));
}

TEST_F(ShmCollectiveThreads, SingleRankGroup) {
  const std::string name = unique_name();
  ProcessGroupShm pg(name, 0, 1, small_options());
  EXPECT_EQ(pg.getRank(), 0);
  EXPECT_EQ(pg.getSize(), 1);
  EXPECT_EQ(pg.getBackendName(), "shm");
  EXPECT_EQ(pg.segment_name(), name);
  EXPECT_EQ(pg.options().slot_bytes, 4096u);
  EXPECT_TRUE(pg.barrier()->wait());
  const at::Tensor t = at::arange(10, at::kFloat);
  std::vector<at::Tensor> v{t};
  EXPECT_TRUE(pg.broadcast(v)->wait());
  EXPECT_TRUE(at::equal(t, at::arange(10, at::kFloat)));
}

// ---------------------------------------------------------------------------------------------
// Collectives the backend refuses

TEST_F(ShmCollectiveThreads, UnsupportedCollectivesSayShm) {
  const std::string name = unique_name();
  ProcessGroupShm pg(name, 0, 1, small_options());
  at::Tensor t = at::ones({4});
  at::Tensor out = at::zeros({4});
  std::vector<at::Tensor> ts{t};
  std::vector<at::Tensor> outs{out};
  std::vector<std::vector<at::Tensor>> nested{{out}};
  std::vector<int64_t> splits;
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"allreduce", [&] { pg.allreduce(ts); }},
      {"allreduce_coalesced", [&] { pg.allreduce_coalesced(ts); }},
      {"reduce", [&] { pg.reduce(ts); }},
      {"allgather", [&] { pg.allgather(nested, ts); }},
      {"_allgather_base", [&] { pg._allgather_base(out, t); }},
      {"allgather_coalesced", [&] { pg.allgather_coalesced(nested, ts); }},
      {"gather", [&] { pg.gather(nested, ts); }},
      {"scatter", [&] { pg.scatter(outs, nested); }},
      {"reduce_scatter", [&] { pg.reduce_scatter(outs, nested); }},
      {"_reduce_scatter_base", [&] { pg._reduce_scatter_base(out, t); }},
      {"alltoall_base", [&] { pg.alltoall_base(out, t, splits, splits); }},
      {"alltoall", [&] { pg.alltoall(outs, ts); }},
  };
  for (const auto& [what, call] : calls) {
    SCOPED_TRACE(what);
    const Caught c = catch_any(call);
    EXPECT_TRUE(c.is<c10::Error>()) << c.describe();
    EXPECT_TRUE(contains_nocase(c.what, "shm")) << c.describe();
  }
  // The group still works.
  EXPECT_TRUE(pg.barrier()->wait());
}

// ---------------------------------------------------------------------------------------------
// Work

TEST_F(ShmWorkThreads, IsCompletedBecomesTrueWithoutWait) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    const at::Tensor values = pattern(at::kByte, 3 * 4096 + 7, 12);
    const at::Tensor t = r == 0 ? values.clone() : at::zeros_like(values);
    if (r == 1) std::this_thread::sleep_for(50ms);
    auto work = r == 0 ? post_send(pg, t, 1, 3) : post_recv(pg, t, 0, 3);
    const auto give_up = Clock::now() + 5s;
    while (!work->isCompleted()) {
      SHM_CHECK(Clock::now() < give_up, "isCompleted() still false after 5 s on rank " << r);
    }
    SHM_CHECK(work->isSuccess(), "completed without success on rank " << r);
    SHM_CHECK(work->wait(), "wait() after completion returned false");
    SHM_CHECK(same_bytes(t, values), "rank " << r << " ends with wrong bytes");
  }));
}

// A wait that times out withdraws its recv: the work is completed with the TimeoutError, and the
// peer's next message goes to the next recv posted for it, never into the abandoned tensor.
TEST_F(ShmWorkThreads, WaitWithTimeoutThrowsTimeoutErrorAndWithdrawsTheRecv) {
  const std::string name = unique_name();
  std::atomic<bool> timed_out{false}, rank0_done{false};
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    if (r == 1) {
      // Sends nothing until rank 0's wait has timed out, then one message on the same tag.
      ProcessGroupShm pg(name, 1, 2, small_options());
      const auto give_up = Clock::now() + 20s;
      while (!timed_out.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      post_send(pg, at::full({4}, 7.0f), 0, 9)->wait();
      while (!rank0_done.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      return;
    }
    const at::Tensor abandoned = at::zeros({4}, at::kFloat);
    ProcessGroupShm pg(name, 0, 2, small_options());
    auto work = post_recv(pg, abandoned, 1, 9);
    const auto start = Clock::now();
    const Caught c = catch_any([&] { work->wait(200ms); });
    const auto elapsed = Clock::now() - start;
    SHM_CHECK(c.is<TimeoutError>(), "wait(200 ms) threw " << c.describe());
    SHM_CHECK(elapsed >= 195ms, "wait(200 ms) gave up after " << elapsed.count() / 1000 << " us");
    SHM_CHECK(elapsed < 1200ms, "wait(200 ms) took " << elapsed.count() / 1000000 << " ms");
    SHM_CHECK(work->isCompleted(), "a withdrawn recv is not completed");
    SHM_CHECK(!work->isSuccess(), "a withdrawn recv reports success");
    const Caught again = catch_any([&] { work->wait(50ms); });
    SHM_CHECK(again.is<TimeoutError>(), "waiting again on the withdrawn recv threw " << again.describe());
    timed_out.store(true);
    const at::Tensor fresh = at::zeros({4}, at::kFloat);
    post_recv(pg, fresh, 1, 9)->wait();
    rank0_done.store(true);
    SHM_CHECK(at::equal(fresh, at::full({4}, 7.0f)), "the next recv got " << fresh);
    SHM_CHECK(at::equal(abandoned, at::zeros({4})), "the withdrawn recv's tensor was written: " << abandoned);
  }));
}

// A recv still pending when its group is destroyed completes with a tdshm error.
TEST_F(ShmWorkThreads, PendingRecvFailsWhenTheGroupIsDestroyed) {
  const std::string name = unique_name();
  std::atomic<bool> rank0_done{false};
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    if (r == 1) {
      ProcessGroupShm pg(name, 1, 2, small_options());
      const auto give_up = Clock::now() + 20s;
      while (!rank0_done.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      return;
    }
    c10::intrusive_ptr<c10d::Work> work;
    const at::Tensor t = at::zeros({4}, at::kFloat);
    {
      ProcessGroupShm pg(name, 0, 2, small_options());
      work = post_recv(pg, t, 1, 9);
      SHM_CHECK(!work->isCompleted(), "the recv completed with nothing sent");
    }
    rank0_done.store(true);
    SHM_CHECK(work->isCompleted(), "a pending work of a destroyed group is not completed");
    const Caught after = catch_any([&] { work->wait(); });
    SHM_CHECK(after.is<tdshm::Error>(), "wait() on a work of a destroyed group threw " << after.describe());
  }));
}

TEST_F(ShmWorkThreads, WaitEndsAtTheGroupTimeout) {
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 500ms;
  std::atomic<bool> rank0_done{false};
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, opts);
    if (r == 1) {
      const auto give_up = Clock::now() + 20s;
      while (!rank0_done.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      return;
    }
    const at::Tensor t = at::zeros({4}, at::kFloat);
    auto work = post_recv(pg, t, 1, 9);
    const auto start = Clock::now();
    const Caught c = catch_any([&] { work->wait(); });
    const auto elapsed = Clock::now() - start;
    rank0_done.store(true);
    SHM_CHECK(c.is<TimeoutError>(), "wait() threw " << c.describe());
    SHM_CHECK(elapsed >= 450ms && elapsed < 2s, "wait() gave up after " << elapsed.count() / 1000000 << " ms");
  }));
}

TEST_F(ShmWorkThreads, FuturesCompleteWithoutWait) {
  // Both ends only wait on futures: the helper thread of getFuture() must move the chunks.
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    for (int64_t bytes : {int64_t{8}, int64_t{16 * 4096 + 3}}) {
      const at::Tensor values = pattern(at::kByte, bytes, static_cast<uint64_t>(bytes));
      const at::Tensor t = r == 0 ? values.clone() : at::zeros_like(values);
      if (r == 0) std::this_thread::sleep_for(100ms);  // the receiver's future waits first
      auto work = r == 0 ? post_send(pg, t, 1, 4) : post_recv(pg, t, 0, 4);
      auto future = work->getFuture();
      SHM_CHECK(future, "getFuture() returned null");
      future->wait();
      SHM_CHECK(!future->hasError(), "the future of rank " << r << " failed: " << future->tryRetrieveErrorMessage());
      SHM_CHECK(work->isCompleted(), "the future completed before its work");
      SHM_CHECK(same_bytes(t, values), "rank " << r << " ends with wrong bytes (" << bytes << ")");
    }
  }));
}

// The helper thread of getFuture() survives callbacks that throw and callbacks that destroy the
// group: nothing escapes it, nothing aborts.
TEST_F(ShmWorkThreads, FutureCallbacksMayThrowOrDestroyTheGroup) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    auto pg = std::make_unique<ProcessGroupShm>(name, r, 2, small_options());
    if (r == 1) {
      std::this_thread::sleep_for(100ms);  // rank 0's futures wait first
      post_send(*pg, at::full({2}, 1.0f), 0, 4)->wait();
      post_send(*pg, at::full({2}, 2.0f), 0, 5)->wait();
      return;
    }
    const at::Tensor a = at::zeros({2}), b = at::zeros({2});
    auto first = post_recv(*pg, a, 1, 4)->getFuture();
    first->addCallback([](c10::ivalue::Future&) { throw std::runtime_error("a user callback failed"); });
    std::atomic<bool> destroyed{false};
    auto second = post_recv(*pg, b, 1, 5)->getFuture();
    second->addCallback([&](c10::ivalue::Future&) {
      pg.reset();  // on the helper thread itself
      destroyed.store(true);
    });
    const auto give_up = Clock::now() + 20s;
    while (!destroyed.load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
    SHM_CHECK(destroyed.load(), "the second callback never ran");
    SHM_CHECK(first->completed() && !first->hasError(), "the first future: " << first->tryRetrieveErrorMessage());
    SHM_CHECK(at::equal(a, at::full({2}, 1.0f)) && at::equal(b, at::full({2}, 2.0f)), "received " << a << b);
  }));
}

// A recv into a tensor whose elements overlap is refused when posted (TypeError), so the message
// meant for it stays for the next recv: the pair stays in step.
TEST_F(ShmWorkThreads, RecvIntoAnExpandedTensorIsRefusedAndThePairStaysInStep) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    if (r == 1) {
      post_send(pg, at::full({4}, 1.0f), 0, 3)->wait();
      post_send(pg, at::full({4}, 2.0f), 0, 3)->wait();
      return;
    }
    const at::Tensor expanded = at::zeros({1}).expand({4});
    const Caught c = catch_any([&] { post_recv(pg, expanded, 1, 3); });
    SHM_CHECK(c.is<TypeError>(), "recv into an expanded tensor threw " << c.describe());
    SHM_CHECK(contains_nocase(c.what, "overlap"), "the message does not say why: " << c.what);
    for (float want : {1.0f, 2.0f}) {
      const at::Tensor t = at::zeros({4});
      post_recv(pg, t, 1, 3)->wait();
      SHM_CHECK(at::equal(t, at::full({4}, want)), "expected " << want << ", got " << t);
    }
  }));
}

TEST_F(ShmWorkThreads, AnySourceReportsTheSender) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) {
    ProcessGroupShm pg(name, r, 3, small_options());
    if (r == 0) {
      for (int sender : {2, 1}) {
        const at::Tensor t = at::zeros({1}, at::kLong);
        std::vector<at::Tensor> v{t};
        auto work = pg.recvAnysource(v, 8);
        work->wait();
        SHM_CHECK(work->sourceRank() == sender, "sourceRank() " << work->sourceRank() << ", sent by " << sender);
        SHM_CHECK(t.item<int64_t>() == sender * 11, "value " << t.item<int64_t>());
      }
    } else {
      // Rank 2 first, then rank 1 once rank 2's message is surely in.
      if (r == 1) std::this_thread::sleep_for(200ms);
      post_send(pg, at::full({1}, r * 11, at::kLong), 0, 8)->wait();
    }
  }));
}

// ---------------------------------------------------------------------------------------------
// Messages that do not fit

/// Rank 0 sends `sent`; rank 1 receives into `into`: a TransportError naming `needles`. The bad
/// message is dropped: the next receive on the same tag gets the next message on it, and one on
/// another tag works too.
void expect_mismatch(const std::string& name, const at::Tensor& sent, const at::Tensor& into,
                     const std::vector<std::string>& needles) {
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, small_options());
    if (r == 0) {
      // The outcome of the send itself is not specified (a small send completes on its own).
      const Caught c = catch_any([&] { post_send(pg, sent, 1, 1)->wait(); });
      if (c.threw) std::fprintf(stderr, "[mismatch] the sender got %s\n", c.describe().c_str());
      post_send(pg, at::full({3}, 5, at::kInt), 1, 1)->wait();
      post_send(pg, at::full({2}, 7, at::kLong), 1, 2)->wait();
    } else {
      const Caught c = SHM_CHECK_THROWS(TransportError, [&] { post_recv(pg, into, 0, 1)->wait(); });
      std::fprintf(stderr, "[mismatch] %s\n", c.describe().c_str());
      for (const std::string& n : needles) {
        SHM_CHECK(c.what.find(n) != std::string::npos, "the message does not mention " << n << ": " << c.what);
      }
      const at::Tensor same_tag = at::zeros({3}, at::kInt);
      post_recv(pg, same_tag, 0, 1)->wait();
      SHM_CHECK(same_tag[2].item<int32_t>() == 5, "the message after the dropped one is wrong");
      const at::Tensor next = at::zeros({2}, at::kLong);
      post_recv(pg, next, 0, 2)->wait();
      SHM_CHECK(next[1].item<int64_t>() == 7, "the next message is wrong");
    }
  }));
}

TEST_F(ShmWorkThreads, SizeMismatchIsTransportError) {
  expect_mismatch(unique_name(), at::ones({100}, at::kByte), at::zeros({64}, at::kByte), {"100", "64"});
}

TEST_F(ShmWorkThreads, SmallerMessageThanTensorIsTransportError) {
  expect_mismatch(unique_name(), at::ones({64}, at::kByte), at::zeros({100}, at::kByte), {"100", "64"});
}

TEST_F(ShmWorkThreads, EmptyMessageIntoNonEmptyTensorIsTransportError) {
  expect_mismatch(unique_name(), at::ones({0}, at::kByte), at::zeros({1}, at::kByte), {});
}

TEST_F(ShmWorkThreads, DtypeMismatchWithEqualBytesIsTransportError) {
  expect_mismatch(unique_name(), at::ones({4}, at::kFloat), at::zeros({4}, at::kInt), {});
}

TEST_F(ShmWorkThreads, ShapeMismatchWithEqualBytesIsTransportError) {
  expect_mismatch(unique_name(), at::ones({2, 4}, at::kFloat), at::zeros({4, 2}, at::kFloat), {});
}

}  // namespace
}  // namespace tdshm::test
