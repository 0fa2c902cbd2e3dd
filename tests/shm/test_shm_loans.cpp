// Loans and views (ProcessGroupShm::loan, irecv_view / recv_view; src/shm/p2p/loan_pool.h): a send of
// a loan posts a reference and completes only once the receiver no longer reads the bytes; a
// receiver copies them once or takes a view that gives them back when dropped; a receiver that
// keeps views makes the sender wait (TimeoutError naming the holder), never lose data; a dead
// receiver's tickets come back, a dead sender's bytes stay readable in the views; a forged
// reference is refused. Ranks are threads (also under TSan) and forked processes.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "process_group/shm_group_seam.h"
#include "shm/layout/segment_layout.h"
#include "shm/parts/waiter.h"
#include "shm/reader/inspect.h"
#include "shm_test_support.h"

namespace tdshm::test {

using detail::ShmGroupSeam;
namespace {

class ShmLoan : public ShmTest {};

ShmOptions loan_options(size_t loan_bytes = size_t{256} << 10, uint32_t tickets = 16) {
  ShmOptions o = small_options();
  o.loan_bytes = loan_bytes;
  o.loan_tickets = tickets;
  return o;
}

/// Flags the two ranks of a scenario share (threads or forked processes alike).
struct Flags {
  std::atomic<int> step{0};
  std::atomic<int> dropped{0};
};

void wait_step(const Flags& f, int at_least) {
  const auto deadline = Clock::now() + 10s;
  while (f.step.load() < at_least) {
    SHM_CHECK(Clock::now() < deadline, "the peer never reached step " << at_least);
    std::this_thread::sleep_for(1ms);
  }
}

at::Tensor filled_loan(ProcessGroupShm& pg, int64_t n, uint64_t seed) {
  at::Tensor t = pg.loan({n}, at::kFloat);
  SHM_CHECK(t.defined() && t.is_contiguous() && t.numel() == n, "loan of " << n << " floats");
  SHM_CHECK(pg.is_loan(t) && pg.is_loan(t.narrow(0, 1, n / 2)), "a loan and its contiguous parts are loans");
  t.copy_(pattern(at::kFloat, n, seed));
  return t;
}

// Rank 0 sends a loan to rank 1, which copies it into its own tensor; the send completes only once
// the copy is done. Then the same with the message arriving before its receive (an early loan),
// and a receive of the wrong size, which fails while the loan still comes back.
void copy_scenario(const std::string& name, int rank, Flags& f) {
  ProcessGroupShm pg(name, rank, 2, loan_options());
  constexpr int64_t n = 10000;
  if (rank == 0) {
    at::Tensor loan = filled_loan(pg, n, 1);
    auto work = post_send(pg, loan, 1, 7);
    std::this_thread::sleep_for(50ms);
    SHM_CHECK(!work->isCompleted(), "a loan's send completed before its receiver took it");
    f.step = 1;  // rank 1 may receive now
    SHM_CHECK(work->wait(), "send");
    // Early: the message waits in the ring as a reference until rank 1 posts its receive.
    at::Tensor second = filled_loan(pg, n, 2);
    auto early = post_send(pg, second, 1, 8);
    f.step = 2;
    SHM_CHECK(early->wait(), "early send");
    // A receive of another size fails; the loan still comes back (its send completes).
    auto wrong = post_send(pg, second, 1, 9);
    SHM_CHECK(wrong->wait(), "mismatched send");
    // A strided part of a loan travels by value.
    at::Tensor strided = second.as_strided({n / 2}, {2});
    SHM_CHECK(!pg.is_loan(strided), "a strided view is not sent by reference");
    SHM_CHECK(post_send(pg, strided, 1, 10)->wait(), "strided send");
  } else {
    wait_step(f, 1);
    at::Tensor mine = at::zeros({n});
    SHM_CHECK(post_recv(pg, mine, 0, 7)->wait(), "recv");
    SHM_CHECK(same_bytes(mine, pattern(at::kFloat, n, 1)), "the copy differs from the loan");
    wait_step(f, 2);
    std::this_thread::sleep_for(20ms);  // the early message is in the ring (or drained)
    at::Tensor second = at::zeros({n});
    SHM_CHECK(post_recv(pg, second, 0, 8)->wait(), "recv of the early loan");
    SHM_CHECK(same_bytes(second, pattern(at::kFloat, n, 2)), "the early loan's copy differs");
    at::Tensor small = at::zeros({n - 1});
    SHM_CHECK_THROWS(TransportError, [&] { post_recv(pg, small, 0, 9)->wait(); }, {"bytes"});
    at::Tensor half = at::zeros({n / 2});
    SHM_CHECK(post_recv(pg, half, 0, 10)->wait(), "recv of the strided part");
    SHM_CHECK(same_bytes(half, pattern(at::kFloat, n, 2).as_strided({n / 2}, {2}).contiguous()), "strided part");
  }
}

TEST_F(ShmLoan, ALoanIsCopiedOnceAndItsSendCompletesAfterTheCopy) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { copy_scenario(name, r, *flags); }));
}

TEST_F(ShmLoan, ALoanIsCopiedOnceBetweenProcesses) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) { copy_scenario(name, r, *flags); }));
}

// Rank 1 takes views: the send completes only when the view is dropped; views of ordinary
// messages are fresh tensors of the sender's shape and dtype; a view outlives the group, and
// while its process runs the sender never takes its loan back (the send fails with
// PeerLostError once rank 1 left, but the bytes stay lent until the view is dropped).
void view_scenario(const std::string& name, int rank, Flags& f) {
  ShmOptions o = loan_options();
  o.timeout = 2s;
  auto pg = std::make_unique<ProcessGroupShm>(name, rank, 2, o);
  constexpr int64_t n = 4096;
  if (rank == 0) {
    at::Tensor loan = filled_loan(*pg, n, 3);
    auto work = post_send(*pg, loan, 1, 1);
    wait_step(f, 1);  // rank 1 holds its view
    std::this_thread::sleep_for(30ms);
    SHM_CHECK(!work->isCompleted(), "the send completed while the receiver held its view");
    SHM_CHECK(work->wait(), "send");
    SHM_CHECK(f.dropped.load() == 1, "the send completed before the view was dropped");
    // An ordinary 2-D int tensor, and a loan reshaped to 2-D (its shape travels).
    SHM_CHECK(post_send(*pg, at::arange(12, at::kInt).reshape({3, 4}), 1, 2)->wait(), "ordinary send");
    at::Tensor grid = pg->loan({8, 16}, at::kDouble);
    grid.copy_(at::arange(128, at::kDouble).reshape({8, 16}));
    auto grid_sent = post_send(*pg, grid, 1, 3);  // rank 1 keeps its view past its group
    // An empty loan, and one of 9 dimensions (whose shape a ring entry does not carry): the
    // receiver's view fails, and the loan still comes back (the send completes).
    SHM_CHECK(post_send(*pg, pg->loan({0, 4}, at::kBFloat16), 1, 4)->wait(), "empty loan");
    SHM_CHECK(post_send(*pg, pg->loan({1, 1, 1, 1, 1, 1, 1, 1, 2}, at::kBool), 1, 5)->wait(), "9-D loan");
    wait_step(f, 3);  // rank 1 destroyed its group, and holds its view of `grid`
    SHM_CHECK_THROWS(PeerLostError, [&] { grid_sent->wait(); }, {"rank 1"});
    grid_sent.reset();
    grid = at::Tensor();
    loan = at::Tensor();  // this rank's loans are all dropped now (with the Work that held the first)
    work.reset();
    const int64_t whole = static_cast<int64_t>(pg->options().loan_bytes);
    SHM_CHECK_THROWS(TimeoutError, [&] { pg->loan({whole}, at::kByte); }, {"rank 1 holds 1 loan"});
    f.step = 4;
    wait_step(f, 5);  // rank 1 dropped its view
    SHM_CHECK(pg->loan({whole}, at::kByte).defined(), "the whole heap once the view was dropped");
  } else {
    {
      at::Tensor view = pg->recv_view(0, 1);
      f.step = 1;
      SHM_CHECK(view.scalar_type() == at::kFloat && view.sizes() == at::IntArrayRef({n}), "view's dtype or shape");
      std::this_thread::sleep_for(60ms);
      SHM_CHECK(same_bytes(view, pattern(at::kFloat, n, 3)), "the view differs from the loan");
      f.dropped = 1;
    }  // dropped: the ticket goes back
    at::Tensor ordinary = pg->recv_view(0, 2);
    SHM_CHECK(ordinary.scalar_type() == at::kInt && ordinary.sizes() == at::IntArrayRef({3, 4}) &&
                  at::equal(ordinary, at::arange(12, at::kInt).reshape({3, 4})),
              "view of an ordinary message");
    at::Tensor grid = pg->recv_view(0, 3);
    SHM_CHECK(grid.scalar_type() == at::kDouble && grid.sizes() == at::IntArrayRef({8, 16}) &&
                  at::equal(grid, at::arange(128, at::kDouble).reshape({8, 16})),
              "view of a 2-D loan");
    const at::Tensor empty = pg->recv_view(0, 4);
    SHM_CHECK(empty.numel() == 0 && empty.sizes() == at::IntArrayRef({0, 4}) && empty.scalar_type() == at::kBFloat16,
              "view of an empty loan: " << empty.sizes());
    SHM_CHECK_THROWS(TransportError, [&] { pg->recv_view(0, 5); }, {"more than 8 dimensions"});
    f.step = 2;
    pg.reset();  // the group goes; the view keeps the mapping
    f.step = 3;
    wait_step(f, 4);
    SHM_CHECK(at::equal(grid, at::arange(128, at::kDouble).reshape({8, 16})), "the view after its group was destroyed");
    grid = at::Tensor();
    f.step = 5;
  }
}

TEST_F(ShmLoan, AViewHoldsTheLoanUntilDroppedAndOutlivesTheGroup) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { view_scenario(name, r, *flags); }));
}

TEST_F(ShmLoan, AViewHoldsTheLoanUntilDroppedBetweenProcesses) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) { view_scenario(name, r, *flags); }));
}

// A tree's views in one call (ShmGroupSeam::recv_views): loans and an ordinary tensor
// arrive in order as views or fresh tensors, the loans come back when the views are dropped;
// a message whose key check differs fails its receive alone (the batch's wait throws it, the
// other messages arrive); bad arguments are refused before anything is posted.
void view_batch_scenario(const std::string& name, int rank, Flags& f) {
  ProcessGroupShm pg(name, rank, 2, loan_options());
  constexpr int64_t n = 64;
  const MessageCheck theirs{MessageCheck::Kind::kKey, 0x1234, 3};
  if (rank == 0) {
    at::Tensor a = filled_loan(pg, n, 5);
    at::Tensor b = pg.loan({2, 2}, at::kDouble);
    b.copy_(at::arange(4, at::kDouble).reshape({2, 2}));
    auto sent_a = post_send(pg, a, 1, 1);
    SHM_CHECK(post_send(pg, at::arange(12, at::kInt).reshape({3, 4}), 1, 2)->wait(), "ordinary send");
    auto sent_b = post_send(pg, b, 1, 3);
    SHM_CHECK(sent_a->wait() && sent_b->wait(), "the loans' sends");
    SHM_CHECK(f.dropped.load() == 1, "a loan's send completed before its view was dropped");
    std::vector<at::Tensor> one{at::full({4}, 7.0f)}, two{at::full({4}, 8.0f)}, three{at::full({4}, 9.0f)};
    SHM_CHECK(pg.send(one, 1, 4)->wait(), "send 4");
    SHM_CHECK(ShmGroupSeam::send(pg, two[0], 1, 5, theirs)->wait(), "send 5");
    SHM_CHECK(pg.send(three, 1, 6)->wait(), "send 6");
  } else {
    SHM_CHECK_THROWS(c10::Error,
                     [&] {
                       ShmGroupSeam::recv_views(pg, 0, {1, 2}, {MessageCheck{}});
                     },
                     {"2 tags and 1 checks"});
    SHM_CHECK_THROWS(c10::Error, [&] { ShmGroupSeam::recv_views(pg, -1, {1}, {MessageCheck{}}); }, {"source rank"});
    {
      auto work = ShmGroupSeam::recv_views(pg, 0, {1, 2, 3}, {MessageCheck{}, MessageCheck{}, MessageCheck{}});
      SHM_CHECK(work->wait(), "the batch of views");
      const std::vector<at::Tensor> got = work->result();
      SHM_CHECK(got.size() == 3, "one tensor per message, got " << got.size());
      SHM_CHECK(got[0].scalar_type() == at::kFloat && got[0].sizes() == at::IntArrayRef({n}) &&
                    same_bytes(got[0], pattern(at::kFloat, n, 5)),
                "the first loan's view");
      SHM_CHECK(at::equal(got[1], at::arange(12, at::kInt).reshape({3, 4})), "the ordinary message");
      SHM_CHECK(at::equal(got[2], at::arange(4, at::kDouble).reshape({2, 2})), "the second loan's view");
      f.dropped = 1;
    }  // the views are dropped: both loans go back
    auto work = ShmGroupSeam::recv_views(
        pg, 0, {4, 5, 6}, {MessageCheck{}, MessageCheck{MessageCheck::Kind::kKey, 0x9999, 3}, MessageCheck{}});
    SHM_CHECK_THROWS(TransportError, [&] { work->wait(); }, {"key"});
    const auto messages = work->messages();
    SHM_CHECK(messages.size() == 3, "three messages");
    SHM_CHECK(messages[0]->wait() && at::equal(messages[0]->result().at(0), at::full({4}, 7.0f)), "message 4");
    SHM_CHECK_THROWS(TransportError, [&] { messages[1]->wait(); }, {"key"});
    SHM_CHECK(messages[2]->wait() && at::equal(messages[2]->result().at(0), at::full({4}, 9.0f)), "message 6");
  }
}

TEST_F(ShmLoan, ATreesViewsArriveInOneBatch) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { view_batch_scenario(name, r, *flags); }));
}

// A receiver that keeps its views: a new loan waits for room and times out naming the holder; a
// send waits for a ticket. Nothing is overwritten: the views still read the first bytes.
void back_pressure_scenario(const std::string& name, int rank, Flags& f) {
  ShmOptions o = loan_options(size_t{64} << 10, 2);
  o.timeout = 600ms;
  ProcessGroupShm pg(name, rank, 2, o);
  constexpr int64_t n = 6000;  // 24000 bytes: two fit the 64 KiB heap, three do not
  if (rank == 0) {
    SHM_CHECK_THROWS(SegmentError, [&] { pg.loan({int64_t{1} << 20}, at::kFloat); }, {"loan heap"});
    SHM_CHECK_THROWS(ShapeError, [&] { pg.loan({-1}, at::kFloat); }, {"negative"});
    auto a = filled_loan(pg, n, 4);
    auto b = filled_loan(pg, n, 5);
    auto wa = post_send(pg, a, 1, 1);
    auto wb = post_send(pg, b, 1, 2);
    wait_step(f, 1);  // rank 1 holds views of both
    a = at::Tensor();
    b = at::Tensor();  // dropped here, but rank 1 still reads them
    const Caught c = SHM_CHECK_THROWS(TimeoutError, [&] { pg.loan({n}, at::kFloat); }, {"rank 1 holds 2 loans"});
    (void)c;
    // `tdshm inspect` reads the same: two of rank 0's tickets are out, both held by rank 1.
    const shm::SegmentInfo info = shm::inspect_segment(name, {.details = true});
    SHM_CHECK(info.details && info.details->loans.size() == 2, "inspect: no loan tables");
    const shm::ArenaInfo& mine = info.details->loans[0];
    SHM_CHECK(mine.read && mine.slots == 2 && mine.slots_taken == 2 && mine.taken_by_dst.size() == 1 &&
                  mine.taken_by_dst[0] == std::make_pair(uint32_t{1}, uint64_t{2}),
              "inspect: rank 0's loans: " << mine.slots_taken << " of " << mine.slots << " out");
    SHM_CHECK(info.details->loans[1].slots_taken == 0, "inspect: rank 1 lent nothing");
    f.step = 2;  // rank 1 checks its views, then drops them
    SHM_CHECK(wa->wait() && wb->wait(), "sends");
    wa.reset();  // a send's Work holds its tensor, and so its loan
    wb.reset();
    at::Tensor again = pg.loan({2 * n}, at::kFloat);  // the whole room is back
    SHM_CHECK(again.defined(), "loan after the views were dropped");
  } else {
    at::Tensor va = pg.recv_view(0, 1);
    at::Tensor vb = pg.recv_view(0, 2);
    f.step = 1;
    wait_step(f, 2);
    SHM_CHECK(same_bytes(va, pattern(at::kFloat, n, 4)) && same_bytes(vb, pattern(at::kFloat, n, 5)),
              "a held view was overwritten");
  }
}

TEST_F(ShmLoan, AReceiverThatKeepsItsViewsMakesTheSenderWaitNeverOverwrites) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { back_pressure_scenario(name, r, *flags); }));
}

// One ticket: a second send of a loan waits until the first comes back, then goes.
void ticket_scenario(const std::string& name, int rank, Flags& f) {
  ProcessGroupShm pg(name, rank, 2, loan_options(size_t{64} << 10, 1));
  if (rank == 0) {
    auto a = filled_loan(pg, 100, 6);
    auto w1 = post_send(pg, a, 1, 1);
    auto w2 = post_send(pg, a, 1, 2);
    wait_step(f, 1);
    std::this_thread::sleep_for(30ms);
    SHM_CHECK(!w2->isCompleted(), "a send went without a ticket");
    f.step = 2;
    SHM_CHECK(w1->wait() && w2->wait(), "sends");
  } else {
    at::Tensor v1 = pg.recv_view(0, 1);
    f.step = 1;
    wait_step(f, 2);
    SHM_CHECK(same_bytes(v1, pattern(at::kFloat, 100, 6)), "first view");
    // Given back explicitly while v1 is still referenced: the second send gets its ticket.
    SHM_CHECK(release_view(v1), "release_view of a view");
    SHM_CHECK(!release_view(v1) && !release_view(at::zeros({3})) && !release_view(at::Tensor()),
              "release_view: a second time, an ordinary tensor, an undefined one");
    at::Tensor v2 = pg.recv_view(0, 2);
    SHM_CHECK(same_bytes(v2, pattern(at::kFloat, 100, 6)), "second view");
  }
}

TEST_F(ShmLoan, ASendWaitsForAFreeTicket) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { ticket_scenario(name, r, *flags); }));
}

// A receiver killed while it holds a view: the sender's send fails with PeerLostError and the
// loan's room comes back.
// try_loan: a loan while there is room; an undefined tensor, at once and without waiting, when
// the heap is full (a receiver holds its view) or the tensor can never fit; a bad shape is a
// ShapeError; room comes back once the view is dropped.
TEST_F(ShmLoan, TryLoanSaysNoRoomWithoutWaiting) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) {
    ProcessGroupShm pg(name, r, 2, loan_options(size_t{64} << 10));
    if (r == 1) {
      {
        at::Tensor view = pg.recv_view(0, 1);
        flags->step = 1;
        wait_step(*flags, 2);
      }  // dropped: the sender's loan comes back
      flags->step = 3;
      return;
    }
    at::Tensor loan = filled_loan(pg, 16000, 7);  // 64000 of the 65536 bytes
    auto work = post_send(pg, loan, 1, 1);
    loan = at::Tensor();
    wait_step(*flags, 1);
    const auto start = Clock::now();
    SHM_CHECK(!pg.try_loan({1024}, at::kFloat).defined(), "room while the receiver holds the heap");
    SHM_CHECK(!pg.try_loan({1 << 20}, at::kFloat).defined(), "a loan larger than the heap");
    SHM_CHECK(Clock::now() - start < 1s, "try_loan waited");
    SHM_CHECK_THROWS(ShapeError, [&] { (void)pg.try_loan({-1}, at::kFloat); }, "negative");
    flags->step = 2;
    wait_step(*flags, 3);
    work->wait();
    work.reset();  // a send's Work holds its loan's bytes until dropped
    at::Tensor again;
    for (int i = 0; i < 1000 && !again.defined(); ++i) {
      again = pg.try_loan({1024}, at::kFloat);
      if (!again.defined()) std::this_thread::sleep_for(1ms);
    }
    SHM_CHECK(again.defined() && pg.is_loan(again), "no room after the view was dropped");
  }));
}

TEST_F(ShmLoan, AReceiverKilledWhileHoldingAViewGivesTheLoanBack) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  Child receiver([&] {
    ProcessGroupShm pg(name, 1, 2, loan_options(size_t{64} << 10));
    at::Tensor view = pg.recv_view(0, 1);
    flags->step = 1;
    std::this_thread::sleep_for(60s);  // killed
  });
  Child sender([&] {
    ProcessGroupShm pg(name, 0, 2, loan_options(size_t{64} << 10));
    {
      at::Tensor loan = filled_loan(pg, 16000, 7);  // 64000 of the 65536 bytes
      auto work = post_send(pg, loan, 1, 1);
      wait_step(*flags, 1);
      flags->step = 2;  // the parent kills the receiver
      SHM_CHECK_THROWS(PeerLostError, [&] { work->wait(); }, {"rank 1"});
    }
    SHM_CHECK(pg.loan({16000}, at::kFloat).defined(), "the loan's room after its receiver died");
  });
  wait_step(*flags, 2);
  receiver.kill();
  EXPECT_TRUE(sender.wait(20s)) << sender.describe();
  EXPECT_TRUE(sender.ok()) << sender.describe();
  receiver.wait(5s);
}

// A sender that dies while the receiver holds a view: the view still reads the bytes.
TEST_F(ShmLoan, AViewStaysReadableAfterItsSenderDied) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  Child sender([&] {
    ProcessGroupShm pg(name, 0, 2, loan_options());
    at::Tensor loan = filled_loan(pg, 1000, 8);
    auto work = post_send(pg, loan, 1, 1);
    wait_step(*flags, 1);
    ::_exit(0);  // dies without leaving the group
  });
  Child receiver([&] {
    ProcessGroupShm pg(name, 1, 2, loan_options());
    at::Tensor view = pg.recv_view(0, 1);
    flags->step = 1;
    std::this_thread::sleep_for(200ms);  // the sender is gone by now
    SHM_CHECK(same_bytes(view, pattern(at::kFloat, 1000, 8)), "the view after its sender died");
  });
  EXPECT_TRUE(sender.wait(20s)) << sender.describe();
  EXPECT_TRUE(receiver.wait(20s)) << receiver.describe();
  EXPECT_TRUE(receiver.ok()) << receiver.describe();
}

// A forged loan entry (a ticket not handed to the receiver, an offset past the heap) fails the
// receive with a TransportError; nothing is read.
TEST_F(ShmLoan, AForgedLoanReferenceIsRefused) {
  const std::string name = unique_name();
  Shared<Flags> flags;
  Child victim([&] {
    ProcessGroupShm pg(name, 0, 2, loan_options());
    at::Tensor t = at::zeros({16}, at::kByte);
    SHM_CHECK_THROWS(TransportError, [&] { post_recv(pg, t, 1, 5)->wait(); }, {"not lent to this rank"});
    flags->step = 1;
  });
  Child hostile([&] {
    ProcessGroupShm pg(name, 1, 2, loan_options());
    RawSegment seg(name);
    const shm::SegmentHeader& h = seg.header();
    const auto g = shm::segment_geometry(h.world_size, h.slot_bytes, h.ring_entries, h.slots_per_rank, h.window_bytes,
                                         h.loan_tickets, h.loan_bytes);
    std::byte* ring = seg.data() + g.rings_offset + (uint64_t{1} * h.world_size + 0) * g.ring_bytes;
    auto* e = reinterpret_cast<shm::EntryHeader*>(ring + sizeof(shm::RingControl));
    e->tag = 5;
    e->total_bytes = 16;
    e->chunk_bytes = sizeof(shm::LoanReference);
    e->flags = shm::kEntryFirst | shm::kEntryLast | shm::kEntryInline | shm::kEntryLoan;
    e->dtype = static_cast<uint8_t>(at::kByte);
    e->ndim = 1;
    const shm::LoanReference ref{h.loan_bytes - 8, 0, 0};  // ticket 0 is free, the bytes run past the heap
    std::memcpy(reinterpret_cast<std::byte*>(e) + sizeof(shm::EntryHeader), &ref, sizeof ref);
    e->seq.store(shm::seq_word(shm::ring_key(h.incarnation, 1, 0), 0), std::memory_order_release);
    reinterpret_cast<shm::RingControl*>(ring)->head.store(1, std::memory_order_release);
    shm::wake(seg.rank_slot(0));
    wait_step(*flags, 1);
  });
  EXPECT_TRUE(victim.wait(20s)) << victim.describe();
  EXPECT_TRUE(victim.ok()) << victim.describe();
  EXPECT_TRUE(hostile.wait(20s)) << hostile.describe();
}

}  // namespace
}  // namespace tdshm::test
