// Batches (layout 10, segment_layout.h's BatchRecord): the small messages of one send_batch call
// travel as one ring entry. These tests check that they do (the inspected ring holds them in the
// entries the layout says), and that every way of receiving them behaves as for messages sent one
// by one: receives posted first, messages waiting in the ring, received one by one in order or
// in reverse, a mismatch and a failed key check among them, a receive of the second message only
// under a one-message early budget (the rest stays in the ring until received), and rings too
// small to hold a whole round (a batch waits for room, or the messages go one by one).
// Hostile batches are in test_shm_hostile.cpp, the record format in tests/unit.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "process_group/shm_group_seam.h"
#include "shm/layout/segment_layout.h"
#include "shm/reader/inspect.h"
#include "shm_test_support.h"

namespace tdshm::test {

using detail::ShmGroupSeam;
namespace {

/// The leaves of a round: 0-d, empty, 1-d with padding, 2- and 3-d, more than 8 dimensions, several
/// dtypes; a message of `large` bytes in the middle (past the span limit: it goes on its own and
/// splits the run in two batches).
std::vector<at::Tensor> batch_leaves(uint64_t seed, int64_t large) {
  return {pattern(at::kFloat, 2, seed),
          pattern(at::kFloat, 6, seed + 1).reshape({2, 3}),
          pattern(at::kFloat, 10, seed + 2).reshape({2, 1, 5}),
          pattern(at::kBool, 1, seed + 3).reshape({}),
          pattern(at::kLong, 0, seed + 4),
          pattern(at::kByte, 3, seed + 5),
          pattern(at::kDouble, 2, seed + 6).reshape({1, 1, 1, 1, 1, 1, 1, 1, 2}),  // no sizes sent
          pattern(at::kByte, large, seed + 7),
          pattern(at::kComplexFloat, 2, seed + 8),
          pattern(at::kShort, 5, seed + 9)};
}

std::vector<int> tags_from(int first, size_t n) {
  std::vector<int> tags(n);
  for (size_t i = 0; i < n; ++i) tags[i] = first + static_cast<int>(i);
  return tags;
}

/// Key checks as tdshm's per-leaf transfers give them (a hash per leaf, the leaf count).
std::vector<MessageCheck> key_checks(size_t n) {
  std::vector<MessageCheck> checks(n);
  for (size_t i = 0; i < n; ++i) {
    checks[i] = MessageCheck{MessageCheck::Kind::kKey, static_cast<uint32_t>(0x5000 + i), static_cast<uint16_t>(n)};
  }
  return checks;
}

/// The ring entries a send_batch of `leaves` takes, as the layout says a sender lays them out:
/// runs of two or more messages whose records fit span_limit as one batch entry and its span,
/// every other message as when sent alone (inline, a span, or slots).
uint64_t entries_of(const std::vector<at::Tensor>& leaves, const ShmOptions& opts) {
  const uint64_t limit = shm::span_limit(opts.ring_entries);
  auto record = [](const at::Tensor& t) {
    const uint8_t ndim = t.dim() <= 8 ? static_cast<uint8_t>(t.dim()) : shm::kShapeNotSent;
    return shm::batch_record_bytes(ndim, t.nbytes());
  };
  uint64_t entries = 0;
  for (size_t i = 0; i < leaves.size();) {
    size_t n = 0;
    uint64_t total = 0;
    while (i + n < leaves.size() && total + record(leaves[i + n]) <= limit) total += record(leaves[i + n++]);
    if (n >= 2) {
      entries += 1 + shm::span_entries(total);
      i += n;
      continue;
    }
    const uint64_t bytes = leaves[i++].nbytes();
    if (bytes <= shm::kInlineBytes) {
      entries += 1;
    } else if (bytes <= limit) {
      entries += 1 + shm::span_entries(bytes);
    } else {
      entries += (bytes + opts.slot_bytes - 1) / opts.slot_bytes;
    }
  }
  return entries;
}

/// The ring src -> dst of `name` as `tdshm inspect` reads it.
shm::PairInfo inspect_pair(const std::string& name, uint32_t world, uint32_t src, uint32_t dst) {
  const shm::SegmentInfo info = shm::inspect_segment(name, {.details = true});
  SHM_CHECK(info.details.has_value() && info.details->available, "no layout details: " << info.problem);
  SHM_CHECK(info.details->pairs.size() == size_t{world} * world, "pairs: " << info.details->pairs.size());
  return info.details->pairs[size_t{src} * world + dst];
}

/// Steps of the two ranks, each written by one rank only.
struct Steps {
  std::atomic<int> ready{0};  // rounds rank 1 is ready for
  std::atomic<int> sent{0};   // rounds rank 0 sent
};

void await_step(const std::atomic<int>& step, int at_least) {
  const auto give_up = Clock::now() + 20s;
  while (step.load() < at_least && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
  SHM_CHECK(step.load() >= at_least, "the peer never reached step " << at_least);
}

/// Scenario: rank 0 sends a round of batch_leaves with send_batch (key checks on) per step; rank
/// 1 receives round 0 with every receive posted first (recv_batch), round 1 one by one in order
/// once it waits in the ring (inspected: the entries the layout says, every message counted),
/// round 2 in reverse order, round 3 with one receive of the wrong size and one whose key check
/// differs (each fails with a TransportError, the others land).
void rounds_scenario(const std::string& name, int rank, const ShmOptions& opts, Steps& steps, bool inspect) {
  ProcessGroupShm pg(name, rank, 2, opts);
  constexpr int kRounds = 4;
  const int64_t large = 3000;
  auto leaves_of = [&](int round) { return batch_leaves(static_cast<uint64_t>(100 * round), large); };
  if (rank == 0) {
    for (int round = 0; round < kRounds; ++round) {
      await_step(steps.ready, round + 1);
      const auto leaves = leaves_of(round);
      auto work =
          ShmGroupSeam::send_batch(pg, leaves, 1, tags_from(100 * round, leaves.size()), key_checks(leaves.size()));
      steps.sent.store(round + 1);
      SHM_CHECK(!work || work->wait(), "round " << round << ": the batch's send");
    }
    return;
  }
  for (int round = 0; round < kRounds; ++round) {
    const auto want = leaves_of(round);
    std::vector<at::Tensor> got;
    for (const at::Tensor& t : want) got.push_back(at::zeros_like(t));
    const std::vector<int> tags = tags_from(100 * round, want.size());
    const std::vector<MessageCheck> checks = key_checks(want.size());
    auto recv_one = [&](size_t i, const at::Tensor& into, MessageCheck check) {
      return ShmGroupSeam::recv_batch(pg, std::span<const at::Tensor>(&into, 1), 0, {tags[i]}, {check});
    };
    if (round == 0) {
      auto work = ShmGroupSeam::recv_batch(pg, got, 0, tags, checks);
      steps.ready.store(1);
      SHM_CHECK(work->wait(), "round 0");
    } else {
      steps.ready.store(round + 1);
      await_step(steps.sent, round + 1);
      if (round == 1 && inspect) {
        const shm::PairInfo p = inspect_pair(name, 2, 0, 1);
        SHM_CHECK(p.depth == entries_of(want, opts),
                  "the ring holds " << p.depth << " entries, the layout says " << entries_of(want, opts));
        SHM_CHECK(p.messages == want.size(), "the ring holds " << p.messages << " messages");
      }
      std::vector<size_t> order(want.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = round == 2 ? order.size() - 1 - i : i;
      for (const size_t i : order) {
        if (round == 3 && i == 1) {  // a receive one element too large
          const at::Tensor wrong = at::zeros({7}, at::kFloat);
          const Caught c = catch_any([&] { recv_one(i, wrong, checks[i])->wait(); });
          SHM_CHECK(c.is<TransportError>() && c.what.find("bytes") != std::string::npos,
                    "a receive of the wrong size: " << c.describe());
          got[i] = want[i].clone();  // (nothing to compare)
          continue;
        }
        if (round == 3 && i == 5) {  // another key at this position
          MessageCheck other = checks[i];
          other.value ^= 1;
          const Caught c = catch_any([&] { recv_one(i, got[i], other)->wait(); });
          SHM_CHECK(c.is<TransportError>() && c.what.find("another key") != std::string::npos,
                    "a receive whose key check differs: " << c.describe());
          SHM_CHECK(same_bytes(got[i], at::zeros_like(want[i])), "a failed key check wrote bytes");
          got[i] = want[i].clone();
          continue;
        }
        SHM_CHECK(recv_one(i, got[i], checks[i])->wait(), "round " << round << ", message " << i);
      }
    }
    for (size_t i = 0; i < want.size(); ++i) {
      SHM_CHECK(same_bytes(got[i], want[i]), "round " << round << ", message " << i << " differs");
    }
  }
}

/// Scenario: with an early-message budget of one message, rank 1 posts a receive for the second
/// message of a batch of six only: the first is buffered, the second lands, the others stay in the
/// ring (the batch entry with them: the inspected ring still holds it whole); once the first is received
/// (its buffer freed), the others are received where the batch was left.
void budget_scenario(const std::string& name, int rank, ShmOptions opts, std::atomic<int>& step) {
  opts.max_unexpected_bytes = 16;
  ProcessGroupShm pg(name, rank, 2, opts);
  std::vector<at::Tensor> want;
  for (int i = 0; i < 6; ++i) want.push_back(pattern(at::kFloat, 4, static_cast<uint64_t>(40 + i)));
  if (rank == 0) {
    auto work =
        ShmGroupSeam::send_batch(pg, want, 1, tags_from(1, want.size()), std::vector<MessageCheck>(want.size()));
    SHM_CHECK(!work, "a batch of six 16-byte messages did not go into the ring at once");
    step.store(1);
    await_step(step, 2);
    return;
  }
  await_step(step, 1);
  const uint64_t batch_entries = entries_of(want, opts);
  SHM_CHECK(batch_entries == 1 + shm::span_entries(6 * shm::batch_record_bytes(1, 16)),
            "six small messages are not one batch here (" << batch_entries << " entries)");
  std::vector<at::Tensor> got;
  for (const at::Tensor& t : want) got.push_back(at::zeros_like(t));
  SHM_CHECK(post_recv(pg, got[1], 0, 2)->wait(), "the second message");
  const shm::PairInfo p = inspect_pair(name, 2, 0, 1);
  SHM_CHECK(p.depth == batch_entries && p.messages == want.size(),
            "the batch entry is not whole in the ring with four of its messages still to come (depth "
                << p.depth << ", " << p.messages << " messages)");
  for (const int i : {0, 2, 3, 4, 5}) SHM_CHECK(post_recv(pg, got[i], 0, i + 1)->wait(), "message " << i);
  for (size_t i = 0; i < want.size(); ++i) SHM_CHECK(same_bytes(got[i], want[i]), "message " << i << " differs");
  SHM_CHECK(inspect_pair(name, 2, 0, 1).depth == 0, "the ring is not empty after every message was received");
  step.store(2);
}

class ShmBatchThreads : public ShmTest {};
class ShmBatchProcs : public ShmTest {};

TEST_F(ShmBatchProcs, EveryWayOfReceivingABatch) {
  const std::string name = unique_name();
  Shared<Steps> steps;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) {
    rounds_scenario(name, r, default_slot_options(), *steps, /*inspect=*/true);
  }));
}

TEST_F(ShmBatchThreads, EveryWayOfReceivingABatch) {
  const std::string name = unique_name();
  Steps steps;
  SHM_EXPECT_RANKS_OK(run_ranks(
      Peers::kThreads, 2, [&](int r) { rounds_scenario(name, r, default_slot_options(), steps, /*inspect=*/true); }));
}

// A 4-entry ring: batches of at most 192 bytes, a round larger than the ring (the sender waits
// for room while its receiver has not posted anything yet), spans wrapping around the ring's end.
TEST_F(ShmBatchThreads, EveryWayOfReceivingABatchThroughASmallRing) {
  const std::string name = unique_name();
  Steps steps;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2,
                                [&](int r) { rounds_scenario(name, r, small_options(), steps, /*inspect=*/false); }));
}

TEST_F(ShmBatchProcs, AReceiveOfTheSecondMessageLeavesTheRestInTheRing) {
  const std::string name = unique_name();
  Shared<std::atomic<int>> step;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { budget_scenario(name, r, default_slot_options(), *step); }));
}

}  // namespace
}  // namespace tdshm::test
