// TensorDict::gather_and_stack between real processes on both backends: every rank's tree lands
// in dst's own, entry by entry along its first batch dimension, in rank order without dst's own
// (tensordict's semantics); in a subgroup; a dst whose batch does not fit refuses and tells the
// others; a group with a rank that does not run tdshm's transfers (what a Python rank says:
// ShmOptions::tdshm_transfers off over shm, no checked wire over gloo) is refused everywhere
// before any message. After each refusal the next transfer is in step.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/tensordict.h>

#include <string>
#include <vector>

#include "dist/dist_support.h"

namespace tdshm::test {
namespace {

class TransferGatherAndStack : public DistTest, public ::testing::WithParamInterface<Method> {
 protected:
  void run_world(int world, const std::function<void(int, Flags&)>& scenario,
                 const std::function<void(int, InitOptions&)>& adjust = {}) {
    run_default_world(GetParam(), world, scenario, adjust);
  }
};

/// A tree of batch [2] ({("a", "b"): float [2], "c": int64 [2, 3]}) holding v.
TensorDict rank_tree(double v) {
  return TensorDict({{{"a", "b"}, at::full({2}, v)}, {"c", at::full({2, 3}, static_cast<int64_t>(v), at::kLong)}}, {2});
}

/// dst's tree: n entries of rank_tree(0) along a first batch dimension.
TensorDict stacked(int64_t n) {
  return TensorDict({{{"a", "b"}, at::zeros({n, 2})}, {"c", at::zeros({n, 2, 3}, at::kLong)}}, {n, 2});
}

TEST_P(TransferGatherAndStack, EveryRankLandsInItsEntry) {
  run_world(4, [&](int rank, Flags&) {
    for (const int dst : {0, 2}) {
      if (rank == dst) {
        TensorDict mine = stacked(3);
        mine.get("c").fill_(-1);
        const std::optional<TensorDict> out = mine.gather_and_stack({.dst = dst});
        SHM_CHECK(out && out->is_same(mine), "dst returns its own tensordict");
        int64_t j = 0;
        for (int r = 0; r < 4; ++r) {
          if (r == dst) continue;
          const double v = 10 * dst + r + 1;
          SHM_CHECK(at::equal(mine.get({"a", "b"})[j], at::full({2}, v)) &&
                        at::equal(mine.get("c")[j], at::full({2, 3}, static_cast<int64_t>(v), at::kLong)),
                    "dst " << dst << " entry " << j << " (rank " << r << "): " << mine.get({"a", "b"})[j]);
          ++j;
        }
      } else {
        TensorDict t = rank_tree(10 * dst + rank + 1);
        SHM_CHECK(!t.gather_and_stack({.dst = dst}).has_value(), "a non-dst rank returns nothing");
      }
    }
  });
}

TEST_P(TransferGatherAndStack, InASubgroup) {
  run_world(4, [&](int rank, Flags&) {
    const Group g = new_group({0, 2, 3});
    if (rank == 1) return;
    SHM_CHECK_THROWS(
        Error, [&] { rank_tree(0).gather_and_stack({.group = g}); }, "exactly one");
    SHM_CHECK_THROWS(
        Error, [&] { rank_tree(0).gather_and_stack({.dst = 3, .group = g, .group_dst = 2}); }, "exactly one");
    SHM_CHECK_THROWS(
        Error, [&] { rank_tree(0).gather_and_stack({.group = g, .group_dst = 3}); }, "not a rank");
    // Global rank 3 is group rank 2: named both ways.
    for (const bool by_group_rank : {false, true}) {
      const GatherAndStackOptions o = by_group_rank ? GatherAndStackOptions{.group = g, .group_dst = 2}
                                                    : GatherAndStackOptions{.dst = 3, .group = g};
      if (rank == 3) {
        TensorDict mine = stacked(2);
        mine.gather_and_stack(o);
        SHM_CHECK(at::equal(mine.get({"a", "b"})[0], at::full({2}, 1.0)) &&
                      at::equal(mine.get({"a", "b"})[1], at::full({2}, 3.0)),
                  mine.get({"a", "b"}));
      } else {
        rank_tree(rank + 1).gather_and_stack(o);
      }
    }
  });
}

TEST_P(TransferGatherAndStack, ADstThatDoesNotFitRefusesAndTellsTheOthers) {
  run_world(3, [&](int rank, Flags&) {
    if (rank == 0) {
      TensorDict wrong = stacked(3);  // the group has 3 ranks: 2 entries
      SHM_CHECK_THROWS(ShapeError, [&] { wrong.gather_and_stack({.dst = 0}); }, "group size - 1");
      TensorDict right = stacked(2);
      right.gather_and_stack({.dst = 0});
      SHM_CHECK(at::equal(right.get({"a", "b"})[1], at::full({2}, 2.0)), right.get({"a", "b"}));
    } else {
      TensorDict t = rank_tree(rank);
      SHM_CHECK_THROWS(Error, [&] { t.gather_and_stack({.dst = 0}); }, "refused");
      t.gather_and_stack({.dst = 0});
    }
  });
}

TEST_P(TransferGatherAndStack, AGroupWithANonTdshmRankIsRefusedEverywhere) {
  const bool shm = GetParam() == Method::kShm;
  run_world(
      3,
      [&](int rank, Flags&) {
        TensorDict t = rank == 0 ? stacked(2) : rank_tree(rank);
        SHM_CHECK_THROWS(Error, [&] { t.gather_and_stack({.dst = 0}); }, "Python");
        // Nothing was sent: the next transfer between two ranks is in step.
        if (rank == 1) rank_tree(5).send({.dst = 0});
        if (rank == 0) {
          TensorDict r = rank_tree(0);
          r.recv({.src = 1});
          SHM_CHECK((r == rank_tree(5)).all(), r.get({"a", "b"}));
        }
      },
      [&](int rank, InitOptions& o) {
        // Rank 2 says what a Python rank says.
        if (rank != 2) return;
        if (shm)
          o.shm.tdshm_transfers = false;
        else
          o.checked_wire = false;
      });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferGatherAndStack, ::testing::Values(Method::kShm, Method::kGlooFile), param_name);

}  // namespace
}  // namespace tdshm::test
