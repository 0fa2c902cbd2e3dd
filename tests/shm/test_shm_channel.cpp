// The point-to-point channel (src/shm/p2p/channel.h) on its own: two ShmChannels, ranks 0 and 1 of
// one segment, driven by hand from one thread. No engine, no waiting, no helper thread: every
// step is a call of the test, so each behaviour (landing in place, early messages, tag order,
// chunking and back-pressure, the early-message budget, withdrawal, a lost peer, closing, bad
// arguments) is checked in a fixed order.

#include <c10/util/Exception.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shm/p2p/channel.h"
#include "shm/segment/segment.h"
#include "shm/shm_test_support.h"

namespace tdshm::test {
namespace {

using detail::is_done;
using detail::OpList;
using detail::ShmChannel;

/// Ranks 0 and 1 of a fresh segment, each with its channel.
class ShmChannelTest : public ShmTest {
 protected:
  void open(const ShmOptions& options) {
    options_ = options;
    const shm::SegmentParams params{unique_name(),          2,
                                    options.slot_bytes,     options.ring_entries,
                                    options.slots_per_rank, options.window_bytes,
                                    options.loan_tickets,   options.loan_bytes};
    const auto deadline = Clock::now() + 10s;
    for (uint32_t r = 0; r < 2; ++r) {
      segments_[r] = shm::Segment::attach(params, r, deadline);
      channels_[r].emplace(*segments_[r], static_cast<int>(r), 2, options);
    }
  }
  void TearDown() override {
    for (auto& c : channels_) c.reset();
    for (auto& s : segments_) s.reset();
    ShmTest::TearDown();
  }

  ShmChannel& ch(int r) { return *channels_[static_cast<size_t>(r)]; }

  OpList send(int from, const at::Tensor& t, int64_t tag) {
    const std::array<at::Tensor, 1> tensors{t};
    const std::array<int64_t, 1> tags{tag};
    const std::array<MessageCheck, 1> checks{};
    return ch(from).post_sends(tensors, 1 - from, tags, checks, false);
  }
  std::shared_ptr<detail::ShmOp> recv(int at, const at::Tensor& t, int64_t tag, int src) {
    const std::array<at::Tensor, 1> tensors{t};
    const std::array<int64_t, 1> tags{tag};
    const std::array<MessageCheck, 1> checks{};
    OpList ops = ShmChannel::make_recvs(tensors, src, at, 2, tags, checks, false);
    ch(at).post_recvs(ops, src);
    return ops[0];
  }
  /// Progress on both sides until `done()` or 10,000 passes.
  template <typename Done>
  bool pump(Done&& done) {
    for (int i = 0; i < 10000 && !done(); ++i) {
      ch(1).progress();
      ch(0).progress();
    }
    return done();
  }

  /// Rank 0 sends `want` with `tag`; rank 1 receives it into a fresh tensor: it must arrive.
  void expect_delivered(const at::Tensor& want, int64_t tag);

  ShmOptions options_;
  std::array<std::unique_ptr<shm::Segment>, 2> segments_;
  std::array<std::optional<ShmChannel>, 2> channels_;
};

/// What a done op failed with (nothing when it succeeded).
Caught failure(const std::shared_ptr<detail::ShmOp>& op) {
  return catch_any([&] {
    if (op && op->error) std::rethrow_exception(op->error);
  });
}

void expect_ok(const std::shared_ptr<detail::ShmOp>& op) {
  ASSERT_TRUE(is_done(op));
  if (op && op->error) FAIL() << "the op failed: " << failure(op).describe();
}

void ShmChannelTest::expect_delivered(const at::Tensor& want, int64_t tag) {
  send(0, want, tag);
  const at::Tensor got = at::zeros_like(want);
  auto op = recv(1, got, tag, 0);
  ASSERT_TRUE(pump([&] { return is_done(op); }));
  expect_ok(op);
  EXPECT_TRUE(same_bytes(got, want));
}

TEST_F(ShmChannelTest, ARecvPostedFirstTakesTheMessageInPlace) {
  open(small_options());
  const at::Tensor want = pattern(at::kFloat, 100, 1);
  const at::Tensor got = at::zeros({100}, at::kFloat);
  auto op = recv(1, got, 7, 0);
  EXPECT_FALSE(is_done(op));
  // A small message with room in the ring is published at once and needs no op.
  EXPECT_TRUE(send(0, want, 7).empty());
  EXPECT_TRUE(ch(1).progress());
  expect_ok(op);
  EXPECT_EQ(op->as_recv().source, 0);
  EXPECT_TRUE(same_bytes(got, want));
}

TEST_F(ShmChannelTest, AnEarlyMessageWaitsForItsRecv) {
  open(small_options());
  const at::Tensor want = pattern(at::kLong, 33, 2);
  EXPECT_TRUE(send(0, want, 3).empty());
  EXPECT_TRUE(ch(1).progress(/*drain_all=*/true));  // taken out of the ring into process memory
  const at::Tensor got = at::zeros({33}, at::kLong);
  auto op = recv(1, got, 3, /*src=*/-1);
  expect_ok(op);  // matched when posted
  EXPECT_EQ(op->as_recv().source, 0);
  EXPECT_TRUE(same_bytes(got, want));
}

TEST_F(ShmChannelTest, TagsMatchWhateverTheOrderOfTheRecvs) {
  open(small_options());
  const at::Tensor a = pattern(at::kInt, 10, 3), b = pattern(at::kInt, 10, 4);
  send(0, a, 1);
  send(0, b, 2);
  const at::Tensor got_b = at::zeros({10}, at::kInt), got_a = at::zeros({10}, at::kInt);
  auto op_b = recv(1, got_b, 2, 0);
  auto op_a = recv(1, got_a, 1, 0);
  ASSERT_TRUE(pump([&] { return is_done(op_a) && is_done(op_b); }));
  expect_ok(op_a);
  expect_ok(op_b);
  EXPECT_TRUE(same_bytes(got_a, a));
  EXPECT_TRUE(same_bytes(got_b, b));
}

TEST_F(ShmChannelTest, SameTagMessagesArriveInOrder) {
  open(small_options());
  std::vector<at::Tensor> sent, got;
  std::vector<std::shared_ptr<detail::ShmOp>> ops;
  for (int i = 0; i < 3; ++i) {  // 3 < ring_entries: all fit
    sent.push_back(pattern(at::kShort, 20, 10 + static_cast<uint64_t>(i)));
    send(0, sent.back(), 5);
  }
  for (int i = 0; i < 3; ++i) {
    got.push_back(at::zeros({20}, at::kShort));
    ops.push_back(recv(1, got.back(), 5, 0));
  }
  ASSERT_TRUE(pump([&] { return is_done(ops[0]) && is_done(ops[1]) && is_done(ops[2]); }));
  for (int i = 0; i < 3; ++i) {
    expect_ok(ops[static_cast<size_t>(i)]);
    EXPECT_TRUE(same_bytes(got[static_cast<size_t>(i)], sent[static_cast<size_t>(i)])) << "message " << i;
  }
}

TEST_F(ShmChannelTest, ALargeMessageMovesInChunksAsTheReceiverTakesThem) {
  ShmOptions o = small_options();  // 4 KiB slots, 4-entry rings
  open(o);
  const int64_t numel = 64 * 1024;  // 256 KiB of floats: many times the ring and the slots
  const at::Tensor want = pattern(at::kFloat, numel, 5);
  const at::Tensor got = at::zeros({numel}, at::kFloat);
  OpList sends = send(0, want, 9);
  ASSERT_EQ(sends.size(), 1u);
  EXPECT_FALSE(is_done(sends[0])) << "the whole message cannot fit the ring and the slots at once";
  auto op = recv(1, got, 9, 0);
  ASSERT_TRUE(pump([&] { return is_done(op) && is_done(sends[0]); }));
  expect_ok(op);
  expect_ok(sends[0]);
  EXPECT_TRUE(same_bytes(got, want));
}

TEST_F(ShmChannelTest, AStridedSendIsSnapshotAtPostTime) {
  open(small_options());
  const at::Tensor base = pattern(at::kDouble, 40, 6);
  const at::Tensor strided = base.slice(0, 0, 40, 2);  // every other element
  ASSERT_FALSE(strided.is_contiguous());
  const at::Tensor want = strided.clone();
  OpList sends = send(0, strided, 4);
  base.fill_(-1.0);  // after the post: must not reach the receiver
  const at::Tensor got = at::zeros({20}, at::kDouble);
  auto op = recv(1, got, 4, 0);
  ASSERT_TRUE(pump([&] { return is_done(op); }));
  expect_ok(op);
  EXPECT_TRUE(same_bytes(got, want));
}

TEST_F(ShmChannelTest, TheEarlyMessageBudgetHoldsAMessageInItsRing) {
  ShmOptions o = small_options();
  o.max_unexpected_bytes = 1024;
  open(o);
  const at::Tensor want = pattern(at::kByte, 3000, 7);  // fits one 4 KiB slot, over the budget
  EXPECT_TRUE(send(0, want, 1).empty());
  ch(1).progress(/*drain_all=*/true);
  const std::string held = ch(1).held_messages();
  EXPECT_NE(held.find("3000 bytes from rank 0"), std::string::npos) << held;
  EXPECT_NE(held.find("max_unexpected_bytes = 1024"), std::string::npos) << held;
  const at::Tensor got = at::zeros({3000}, at::kByte);
  auto op = recv(1, got, 1, 0);
  ASSERT_TRUE(pump([&] { return is_done(op); }));
  expect_ok(op);
  EXPECT_TRUE(same_bytes(got, want));
  EXPECT_EQ(ch(1).held_messages(), "");
}

TEST_F(ShmChannelTest, AWithdrawnRecvFailsAndNeverTakesALaterMessage) {
  open(small_options());
  const at::Tensor first = at::zeros({8}, at::kFloat);
  auto op = recv(1, first, 2, 0);
  const auto error = std::make_exception_ptr(TimeoutError("gave up"));
  ch(1).withdraw(op, error);
  ASSERT_TRUE(is_done(op));
  EXPECT_TRUE(failure(op).is<TimeoutError>());
  // The next message on the tag goes to the next recv, never into the withdrawn one.
  expect_delivered(pattern(at::kFloat, 8, 8), 2);
  EXPECT_TRUE(at::equal(first, at::zeros({8}, at::kFloat))) << "the withdrawn recv's tensor was written";
}

TEST_F(ShmChannelTest, AMismatchedRecvFailsWithATransportError) {
  open(small_options());
  send(0, pattern(at::kFloat, 10, 9), 6);
  const at::Tensor wrong_size = at::zeros({11}, at::kFloat);
  auto op = recv(1, wrong_size, 6, 0);
  ASSERT_TRUE(pump([&] { return is_done(op); }));
  const Caught c = failure(op);
  EXPECT_TRUE(c.is<TransportError>()) << c.describe();
  EXPECT_TRUE(contains_nocase(c.what, "the message has 40 bytes but the tensor has 44")) << c.what;
  // The channel goes on: the next message on the pair arrives.
  expect_delivered(pattern(at::kFloat, 10, 10), 6);
}

TEST_F(ShmChannelTest, ALostPeerFailsItsPendingOps) {
  open(small_options());
  auto op = recv(1, at::zeros({4}, at::kFloat), 1, 0);
  ch(1).fail_peer(0, std::make_exception_ptr(PeerLostError("rank 0 is gone")));
  ASSERT_TRUE(is_done(op));
  EXPECT_TRUE(failure(op).is<PeerLostError>());
  // A later send to the lost peer fails at once with the same error.
  OpList sends = send(1, pattern(at::kFloat, 4, 11), 1);
  ASSERT_EQ(sends.size(), 1u);
  ASSERT_TRUE(is_done(sends[0]));
  EXPECT_TRUE(failure(sends[0]).is<PeerLostError>());
}

TEST_F(ShmChannelTest, CloseFailsPendingAndLaterOps) {
  open(small_options());
  auto pending = recv(1, at::zeros({4}, at::kFloat), 1, 0);
  EXPECT_TRUE(ch(1).close(std::make_exception_ptr(TransportError("destroyed"))));
  EXPECT_FALSE(ch(1).close(std::make_exception_ptr(TransportError("again"))));
  EXPECT_TRUE(ch(1).closed());
  ASSERT_TRUE(is_done(pending));
  EXPECT_TRUE(failure(pending).is<TransportError>());
  auto later = recv(1, at::zeros({4}, at::kFloat), 1, 0);
  ASSERT_TRUE(is_done(later));
  const Caught c = failure(later);
  EXPECT_TRUE(c.is<TransportError>());
  EXPECT_TRUE(contains_nocase(c.what, "destroyed")) << c.what;
  EXPECT_TRUE(ch(1).unusable() != nullptr);
}

TEST_F(ShmChannelTest, BadArgumentsAreRefused) {
  open(small_options());
  const std::array<at::Tensor, 1> tensors{at::zeros({4}, at::kFloat)};
  const std::array<int64_t, 1> tags{0};
  const std::array<MessageCheck, 1> checks{};
  for (const int dst : {-1, 0, 2}) {  // 0 is the sender itself
    SHM_CHECK_THROWS(
        c10::Error, [&] { ch(0).post_sends(tensors, dst, tags, checks, false); }, "destination rank");
  }
  // A receiving tensor whose elements overlap (expanded) cannot be written.
  const std::array<at::Tensor, 1> overlapping{at::zeros({1}, at::kFloat).expand({4})};
  SHM_CHECK_THROWS(TypeError, [&] { ShmChannel::make_recvs(overlapping, 0, 1, 2, tags, checks, false); });
}

// ---- A receive whose message is already waiting (receive_now) -----------------------------------

TEST_F(ShmChannelTest, AWaitingWholeMessageLandsAtOnceWithoutAnOp) {
  open(small_options());  // 4 KiB slots: 3000 bytes go through a slot, 40 bytes inline
  for (const int64_t n : {int64_t{10}, int64_t{750}}) {
    const at::Tensor want = pattern(at::kFloat, n, 20 + static_cast<uint64_t>(n));
    EXPECT_EQ(ch(0).post_send(want, 1, 4, {}, false), nullptr) << "published when posted";
    const at::Tensor got = at::zeros({n}, at::kFloat);
    EXPECT_TRUE(ch(1).receive_now(got, 0, 4, {}, false));
    EXPECT_TRUE(same_bytes(got, want));
    EXPECT_FALSE(ch(1).receive_now(at::zeros({n}, at::kFloat), 0, 4, {}, false)) << "the ring is empty now";
  }
  // The slot went back to the sender: every slot can carry a message again, in order.
  for (int64_t i = 0; i < static_cast<int64_t>(options_.slots_per_rank) + 2; ++i) {
    const at::Tensor want = pattern(at::kFloat, 750, 40 + static_cast<uint64_t>(i));
    ASSERT_EQ(ch(0).post_send(want, 1, 5, {}, false), nullptr) << "message " << i;
    const at::Tensor got = at::zeros({750}, at::kFloat);
    ASSERT_TRUE(ch(1).receive_now(got, 0, 5, {}, false)) << "message " << i;
    EXPECT_TRUE(same_bytes(got, want)) << "message " << i;
  }
}

TEST_F(ShmChannelTest, AWaitingMessageYieldsToWhatMustComeFirst) {
  open(small_options());
  const at::Tensor a = pattern(at::kInt, 6, 1), b = pattern(at::kInt, 6, 2);
  // An older posted receive of the same tag takes the first message: the new one may not.
  const at::Tensor got_a = at::zeros({6}, at::kInt);
  auto older = recv(1, got_a, 3, 0);
  ch(0).post_send(a, 1, 3, {}, false);
  EXPECT_FALSE(ch(1).receive_now(at::zeros({6}, at::kInt), 0, 3, {}, false));
  ASSERT_TRUE(pump([&] { return is_done(older); }));
  expect_ok(older);
  EXPECT_TRUE(same_bytes(got_a, a));
  // An early message (drained into process memory) is older than the ring's next one.
  ch(0).post_send(a, 1, 3, {}, false);
  ch(1).progress(/*drain_all=*/true);
  ch(0).post_send(b, 1, 3, {}, false);
  EXPECT_FALSE(ch(1).receive_now(at::zeros({6}, at::kInt), 0, 3, {}, false));
  const at::Tensor first = at::zeros({6}, at::kInt), second = at::zeros({6}, at::kInt);
  auto op1 = recv(1, first, 3, 0);
  auto op2 = recv(1, second, 3, 0);
  ASSERT_TRUE(pump([&] { return is_done(op1) && is_done(op2); }));
  EXPECT_TRUE(same_bytes(first, a));
  EXPECT_TRUE(same_bytes(second, b));
  // Another tag, a collective's message, a mismatched tensor, a message in several entries:
  // nothing lands, nothing is consumed, and the receive posted as usual gets what it should.
  ch(0).post_send(a, 1, 9, {}, false);
  EXPECT_FALSE(ch(1).receive_now(at::zeros({6}, at::kInt), 0, 8, {}, false));
  EXPECT_FALSE(ch(1).receive_now(at::zeros({6}, at::kInt), 0, 9, {}, /*control=*/true));
  EXPECT_FALSE(ch(1).receive_now(at::zeros({7}, at::kInt), 0, 9, {}, false));
  EXPECT_FALSE(ch(1).receive_now(at::zeros({6}, at::kFloat), 0, 9, {}, false));
  EXPECT_FALSE(ch(1).receive_now(at::zeros({2, 3}, at::kInt), 0, 9, {}, false)) << "another shape";
  const at::Tensor wrong = at::zeros({7}, at::kInt);
  auto failed = recv(1, wrong, 9, 0);
  ASSERT_TRUE(pump([&] { return is_done(failed); }));
  EXPECT_TRUE(failure(failed).is<TransportError>()) << "the general path reports the mismatch";
  const at::Tensor big = pattern(at::kFloat, 4096, 3);  // 16 KiB: four 4 KiB entries
  auto sends = ch(0).post_send(big, 1, 2, {}, false);
  EXPECT_FALSE(ch(1).receive_now(at::zeros({4096}, at::kFloat), 0, 2, {}, false));
  const at::Tensor got_big = at::zeros({4096}, at::kFloat);
  auto op_big = recv(1, got_big, 2, 0);
  ASSERT_TRUE(pump([&] { return is_done(op_big) && is_done(sends); }));
  expect_ok(op_big);
  EXPECT_TRUE(same_bytes(got_big, big));
}

TEST_F(ShmChannelTest, AWaitingMessageWithAKeyCheckLandsOnlyOnTheSameKey) {
  open(small_options());
  const MessageCheck key{MessageCheck::Kind::kKey, 0xabcd, 3};
  const at::Tensor want = pattern(at::kDouble, 5, 4);
  ch(0).post_send(want, 1, 1, key, false);
  const MessageCheck other{MessageCheck::Kind::kKey, 0xabce, 3};
  EXPECT_FALSE(ch(1).receive_now(at::zeros({5}, at::kDouble), 0, 1, other, false));
  const at::Tensor got = at::zeros({5}, at::kDouble);
  EXPECT_TRUE(ch(1).receive_now(got, 0, 1, key, false));
  EXPECT_TRUE(same_bytes(got, want));
}

TEST_F(ShmChannelTest, APostedRecvLandsByItselfOnlyWhenTheMatcherWouldGiveItTheMessage) {
  open(small_options());  // 4 KiB slots: 750 floats go through a slot, 6 ints inline
  // Posted before its message (a ping-pong's wait): nothing to take yet, then it lands, whole.
  const at::Tensor a = pattern(at::kInt, 6, 11);
  const at::Tensor got_a = at::zeros({6}, at::kInt);
  auto op = recv(1, got_a, 3, 0);
  EXPECT_FALSE(ch(1).land_posted(op)) << "the ring is empty";
  EXPECT_FALSE(is_done(op));
  ch(0).post_send(a, 1, 3, {}, false);
  ASSERT_TRUE(ch(1).land_posted(op));
  expect_ok(op);
  EXPECT_EQ(op->as_recv().source, 0);
  EXPECT_TRUE(same_bytes(got_a, a));
  EXPECT_FALSE(ch(1).land_posted(op)) << "done already";
  // Through a slot, more messages than there are slots: each slot goes back to the sender.
  for (int64_t i = 0; i < static_cast<int64_t>(options_.slots_per_rank) + 2; ++i) {
    const at::Tensor want = pattern(at::kFloat, 750, 60 + static_cast<uint64_t>(i));
    const at::Tensor got = at::zeros({750}, at::kFloat);
    auto slot_op = recv(1, got, 4, 0);
    ASSERT_EQ(ch(0).post_send(want, 1, 4, {}, false), nullptr) << "message " << i;
    ASSERT_TRUE(ch(1).land_posted(slot_op)) << "message " << i;
    EXPECT_TRUE(same_bytes(got, want)) << "message " << i;
  }
  // An older any-source receive of the tag comes first: the newer one does not take it.
  const at::Tensor b = pattern(at::kInt, 6, 12), c = pattern(at::kInt, 6, 13);
  const at::Tensor got_any = at::zeros({6}, at::kInt), got_mine = at::zeros({6}, at::kInt);
  auto any = recv(1, got_any, 5, -1);
  auto mine = recv(1, got_mine, 5, 0);
  ch(0).post_send(b, 1, 5, {}, false);
  EXPECT_FALSE(ch(1).land_posted(mine));
  EXPECT_FALSE(is_done(any));
  ASSERT_TRUE(pump([&] { return is_done(any); }));
  EXPECT_TRUE(same_bytes(got_any, b));
  EXPECT_FALSE(is_done(mine));
  ch(0).post_send(c, 1, 5, {}, false);
  ASSERT_TRUE(ch(1).land_posted(mine));
  EXPECT_TRUE(same_bytes(got_mine, c));
  // Another tag, a mismatch, a strided receive (staged), several entries: nothing lands or is
  // consumed, and the general path gives each receive what it should (the mismatch its error).
  const at::Tensor wrong = at::zeros({7}, at::kInt);
  auto failed = recv(1, wrong, 6, 0);
  auto other_tag = recv(1, at::zeros({6}, at::kInt), 7, 0);
  ch(0).post_send(a, 1, 6, {}, false);
  EXPECT_FALSE(ch(1).land_posted(other_tag)) << "another tag";
  EXPECT_FALSE(ch(1).land_posted(failed)) << "another size";
  ASSERT_TRUE(pump([&] { return is_done(failed); }));
  EXPECT_TRUE(failure(failed).is<TransportError>()) << "the general path reports the mismatch";
  const at::Tensor strided = at::zeros({6, 2}, at::kInt).select(1, 0);
  auto staged = recv(1, strided, 7, 0);
  ch(0).post_send(a, 1, 7, {}, false);
  ch(0).post_send(b, 1, 7, {}, false);
  EXPECT_FALSE(ch(1).land_posted(staged)) << "a strided receive lands through its staging tensor";
  ASSERT_TRUE(pump([&] { return is_done(other_tag) && is_done(staged); }));
  EXPECT_TRUE(same_bytes(strided.contiguous(), b));
  const at::Tensor big = pattern(at::kFloat, 4096, 14);  // 16 KiB: four entries
  const at::Tensor got_big = at::zeros({4096}, at::kFloat);
  auto op_big = recv(1, got_big, 8, 0);
  auto sends = ch(0).post_send(big, 1, 8, {}, false);
  EXPECT_FALSE(ch(1).land_posted(op_big)) << "a message of several entries";
  ASSERT_TRUE(pump([&] { return is_done(op_big) && is_done(sends); }));
  EXPECT_TRUE(same_bytes(got_big, big));
}

TEST_F(ShmChannelTest, NothingLandsAtOnceFromALostPeerOrOnAClosedChannel) {
  open(small_options());
  ch(0).post_send(pattern(at::kFloat, 4, 5), 1, 1, {}, false);
  ch(1).fail_peer(0, std::make_exception_ptr(PeerLostError("rank 0 is gone")));
  EXPECT_FALSE(ch(1).receive_now(at::zeros({4}, at::kFloat), 0, 1, {}, false));
  EXPECT_TRUE(ch(0).close(std::make_exception_ptr(TransportError("destroyed"))));
  auto op = ch(0).post_send(pattern(at::kFloat, 4, 6), 1, 1, {}, false);
  ASSERT_TRUE(is_done(op));
  EXPECT_TRUE(failure(op).is<TransportError>());
  SHM_CHECK_THROWS(
      c10::Error, [&] { ch(0).post_send(at::zeros({4}, at::kFloat), 0, 1, {}, false); }, "destination rank");
}

}  // namespace
}  // namespace tdshm::test
