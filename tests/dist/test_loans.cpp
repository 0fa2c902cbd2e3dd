// Loans and views through the tensordict API (tdshm::loan, TensorDict::recv_view; docs/loans.md),
// over real processes on both backends: over shm a loaned tree travels by reference and the
// receiver's views are the sender's bytes (the sender's isend completes only once they are
// dropped); over gloo a loan is an ordinary tensor and recv_view receives into fresh tensors.
// Per-leaf (tags, pseudo_rand, a nested key, the key check) and consolidated (schema check).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/process_group.h>
#include <tdshm/tensordict.h>

#include <string>
#include <thread>
#include <vector>

#include "dist/dist_support.h"

namespace tdshm::test {
namespace {

class TransferLoans : public DistTest, public ::testing::WithParamInterface<Method> {
 protected:
  void run_world(int world, const std::function<void(int, Flags&)>& scenario) {
    run_default_world(GetParam(), world, scenario, [](int, InitOptions& o) { o.shm.loan_bytes = size_t{1} << 20; });
  }
};

TensorDict batch_like() {
  return TensorDict({{"image", at::zeros({4, 3, 8, 8}, at::kByte)},
                     {"label", at::zeros({4}, at::kLong)},
                     {{"meta", "idx"}, at::zeros({4}, at::kLong)}},
                    {4});
}

void fill_batch(const TensorDict& td, int64_t seq) {
  td.get("image").copy_(at::arange(4 * 3 * 8 * 8, at::kInt).add(seq).remainder(251).to(at::kByte).reshape({4, 3, 8, 8}));
  td.get("label").copy_(at::arange(4, at::kLong).add(10 * seq));
  td.get({"meta", "idx"}).copy_(at::arange(4, at::kLong).add(100 * seq));
}

void check(const TensorDict& td, int64_t seq, const std::string& what) {
  const TensorDict want = batch_like();
  fill_batch(want, seq);
  for (const auto& key : want.sorted_leaf_keys()) {
    SHM_CHECK(at::equal(td.get(key), want.get(key)), what << ": key " << key.str() << " differs");
  }
  SHM_CHECK(td.batch_size() == std::vector<int64_t>({4}), what << ": batch size");
}

// Rank 1 loans a tree per leaf and one consolidated, fills and sends them several times (isend
// with return_early: the works complete once rank 0 dropped its views); rank 0 takes views, and
// once copies (recv into its own tree).
TEST_P(TransferLoans, ALoanedTreeTravelsAsViewsOrCopies) {
  const bool shm = GetParam() == Method::kShm;
  run_world(2, [&](int rank, Flags& flags) {
    if (rank == 1) {
      const TensorDict leaves = loan(batch_like(), {.dst = 0});
      const TensorDict whole = loan(batch_like(), {.dst = 0, .consolidated = true});
      SHM_CHECK(whole.is_consolidated(), "a consolidated loan is consolidated");
      for (int64_t seq = 0; seq < 3; ++seq) {
        fill_batch(leaves, seq);
        const Transfer t = leaves.isend({.dst = 0, .init_tag = seq, .pseudo_rand = seq == 2, .return_early = true});
        for (const auto& w : t.works) SHM_CHECK(w->wait(kGroupTimeout), "per-leaf send " << seq);
        fill_batch(whole, seq + 10);
        whole.send({.dst = 0, .consolidated = true});
      }
      fill_batch(leaves, 7);
      leaves.send({.dst = 0});  // received by copy
      // A view that is held: the send does not complete until rank 0 drops it (shm).
      fill_batch(leaves, 8);
      const Transfer held = leaves.isend({.dst = 0, .return_early = true});
      wait_until(flags.step[0], 1, "rank 0 holds its views", &flags.failed);
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      if (shm) {
        for (const auto& w : held.works) SHM_CHECK(!w->isCompleted(), "a send completed while its views were held");
      }
      for (const auto& w : held.works) SHM_CHECK(w->wait(kGroupTimeout), "held send");
      if (shm) SHM_CHECK(flags.step[1].load() == 1, "the send completed before rank 0 dropped its views");
    } else {
      const TensorDict like = batch_like();
      const TensorDict like_whole = batch_like().consolidate();
      for (int64_t seq = 0; seq < 3; ++seq) {
        {  // dropped before the next receive: the sender waits for these views to go
          const TensorDict v = like.recv_view({.src = 1, .init_tag = seq, .pseudo_rand = seq == 2});
          check(v, seq, "per-leaf view " + std::to_string(seq));
        }
        const TensorDict w = like_whole.recv_view({.src = 1, .consolidated = true});
        SHM_CHECK(w.is_consolidated(), "a consolidated view is consolidated");
        check(w, seq + 10, "consolidated view " + std::to_string(seq));
      }
      SHM_CHECK(at::equal(like.get("label"), at::zeros({4}, at::kLong)), "recv_view wrote into its template");
      TensorDict mine = batch_like();
      mine.recv({.src = 1});
      check(mine, 7, "copy of a loan");
      {
        const TensorDict v = like.recv_view({.src = 1});
        flags.step[0] = 1;
        std::this_thread::sleep_for(std::chrono::milliseconds(60));
        check(v, 8, "held view");
        flags.step[1] = 1;
        // Given back now, though `v` is still in scope (over gloo nothing is a view).
        SHM_CHECK(release_views(v) == (shm ? 3u : 0u), "release_views gave back the wrong number of loans");
        SHM_CHECK(release_views(v) == 0, "a second release_views gave something back");
      }
    }
  });
}

// A receiver whose keys differ gets recv's key error; one of another schema recv's SchemaError;
// the next transfer is in step.
TEST_P(TransferLoans, ViewsKeepRecvsChecks) {
  if (GetParam() != Method::kShm) GTEST_SKIP() << "over gloo recv_view is recv, whose checks TransferMismatch covers";
  run_world(2, [&](int rank, Flags&) {
    if (rank == 1) {
      const TensorDict leaves = loan(batch_like());
      fill_batch(leaves, 1);
      leaves.send({.dst = 0});
      const TensorDict whole = loan(batch_like(), {.consolidated = true});
      fill_batch(whole, 2);
      whole.send({.dst = 0, .consolidated = true});
      fill_batch(leaves, 3);
      leaves.send({.dst = 0});
    } else {
      TensorDict other = batch_like();
      other.erase("label");
      other.set("zlabel", at::zeros({4}, at::kLong));
      SHM_CHECK_THROWS(TransportError, [&] { other.recv_view({.src = 1}); }, {"key"});
      TensorDict wider = batch_like();
      wider.set("extra", at::zeros({4}));
      SHM_CHECK_THROWS(SchemaError, [&] { wider.consolidate().recv_view({.src = 1, .consolidated = true}); });
      check(batch_like().recv_view({.src = 1}), 3, "the transfer after two refused ones");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferLoans, ::testing::Values(Method::kShm, Method::kGlooFile), param_name);

}  // namespace
}  // namespace tdshm::test
