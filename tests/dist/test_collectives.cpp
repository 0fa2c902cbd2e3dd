// The TensorDict / tensorclass collectives (reduce, all_reduce, all_gather, scatter: tensordict
// 0.14's TensorDictBase methods) over real processes, on gloo (file://, tcp://) and shm.
//
// Every scenario runs in forked ranks (run_ranks with Peers::kProcesses) that join a default
// group, play their part and meet at the end (finish). Each rank can build every rank's tree
// (values are a function of rank, leaf and salt), so what a rank receives is checked against a
// reference computed in that one process. Every wait has a deadline (kGroupTimeout, the groups'
// own timeout, the fixture's watchdog); rendezvous points are unique to the test.
//
//   DistCollectives/ReduceAndAllReduceEveryOp  SUM, MIN, MAX, PRODUCT on float and int leaves,
//                                              nested keys, odd sizes, a non-contiguous leaf;
//                                              worlds of 2 and 3 (and 4 on gloo over file://)
//   DistCollectives/AsyncHandles               async_op / return_premature: what is returned
//   DistCollectives/AsyncAllReduceInterleavedWithPointToPoint
//                                              an async all_reduce, then sends and receives
//                                              the peer needs or sends around its all_reduce
//   DistCollectives/AllGatherOfDifferentTrees  keys, shapes, dtypes, batch sizes, non-tensors
//   DistCollectives/Scatter                    the source's list, one per rank
//   DistCollectives/Subgroup                   all four over new_group({2, 0}) of a world of 3
//   DistCollectives/TensorClass                the forwarding methods
//   DistCollectives/Errors                     typed errors before any communication

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dist/dist_support.h"

namespace tdshm::test {

TDSHM_TENSORCLASS(CollRecord, "tdshm.test.coll.Record", obs, action);

namespace {

using Op = c10d::ReduceOp::RedOpType;

const char* op_name(Op op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    default:
      return "?";
  }
}

// ---------------------------------------------------------------------------------------------
// Trees and references

/// Values of leaf `salt` on rank `rank`: v_i = ((7 i + 3 rank + salt) % 5) - 2, in [-2, 2]
/// (halved for floating types), so sums and products over 4 ranks are exact in every dtype.
at::Tensor values_of(int rank, int salt, at::ScalarType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  at::Tensor v = (at::arange(n, at::kLong) * 7 + 3 * rank + salt).remainder(5) - 2;
  if (at::isFloatingType(dtype)) return (v.to(at::kDouble) / 2).to(dtype).reshape(shape);
  return v.to(dtype).reshape(shape);
}

/// The tree the reductions run on, batch size [2]: nested keys at three levels, float and int
/// leaves of odd sizes, a non-contiguous leaf ("Z", a transposed view) and a non-tensor value.
/// Insertion order ("obs", ("nest", "x"), "_", ...) differs from sorted order ("Z", "_", ...).
TensorDict reduce_tree(int rank) {
  TensorDict td(std::vector<int64_t>{2});
  td.set("obs", values_of(rank, 0, at::kFloat, {2, 3}));
  td.set({"nest", "x"}, values_of(rank, 1, at::kLong, {2, 5}));
  td.set("_", values_of(rank, 2, at::kDouble, {2, 1}));
  td.set({"nest", "deep", "y"}, values_of(rank, 3, at::kInt, {2, 7}));
  td.set("Z", values_of(rank, 4, at::kFloat, {3, 2}).t());
  td.set("name", "rank " + std::to_string(rank));
  return td;
}
constexpr size_t kReduceLeaves = 5;

at::Tensor combine(const at::Tensor& a, const at::Tensor& b, Op op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return a + b;
    case c10d::ReduceOp::PRODUCT:
      return a * b;
    case c10d::ReduceOp::MIN:
      return at::minimum(a, b);
    default:
      return at::maximum(a, b);
  }
}

/// reduce_tree's leaves reduced with `op` over `ranks`, computed here.
TensorDict reference(const std::vector<int>& ranks, Op op) {
  TensorDict ref = reduce_tree(ranks[0]).contiguous();
  for (size_t i = 1; i < ranks.size(); ++i) {
    const TensorDict other = reduce_tree(ranks[i]);
    for (const Key& k : ref.sorted_leaf_keys()) ref.set_(k, combine(ref.get(k), other.get(k), op));
  }
  return ref;
}
std::vector<int> all_ranks(int world) {
  std::vector<int> r;
  for (int i = 0; i < world; ++i) r.push_back(i);
  return r;
}

/// Every tensor leaf of `want` is in `got` with the same dtype, shape and values, and no other.
void check_leaves(const TensorDict& got, const TensorDict& want, const std::string& what) {
  const std::vector<Key> keys = want.sorted_leaf_keys();
  SHM_CHECK(got.sorted_leaf_keys() == keys, what << ": other keys");
  for (const Key& k : keys) {
    const at::Tensor g = got.get(k), w = want.get(k);
    SHM_CHECK(g.scalar_type() == w.scalar_type() && g.sizes() == w.sizes(),
              what << ": " << k.str() << " is " << g.scalar_type() << " " << g.sizes() << ", expected " << w.scalar_type()
                   << " " << w.sizes());
    SHM_CHECK(at::equal(g, w), what << ": " << k.str() << " = " << g.flatten().slice(0, 0, 8) << ", expected "
                                    << w.flatten().slice(0, 0, 8));
  }
}

/// The tree of rank `r` for all_gather and scatter: batch size [r + 1]; keys, dtypes and
/// non-tensor values that depend on r (an int16 leaf on odd r only).
TensorDict gather_tree(int r) {
  TensorDict td(std::vector<int64_t>{r + 1});
  td.set("value", values_of(r, 0, at::kFloat, {r + 1, 3}));
  td.set({"n", "id"}, at::full({r + 1}, r, at::kLong));
  if (r % 2 == 1) td.set("odd", values_of(r, 1, at::kShort, {r + 1, 5}));
  td.set("label", "tree " + std::to_string(r));
  td.set({"n", "ratio"}, 0.5 * r);
  return td;
}

void check_gathered(const TensorDict& got, int r, const std::string& what) {
  SHM_CHECK(got.is_consolidated(), what << ": not consolidated");
  SHM_CHECK(got.class_name().empty(), what << ": class_name '" << got.class_name() << "'");
  SHM_CHECK(got.batch_size() == std::vector<int64_t>{r + 1}, what << ": batch size " << got.batch_size().size());
  check_leaves(got, gather_tree(r), what);
  SHM_CHECK(got.get_non_tensor("label") == NonTensorData(std::string("tree " + std::to_string(r))), what << ": label");
  SHM_CHECK(got.get_non_tensor({"n", "ratio"}) == NonTensorData(0.5 * r), what << ": ratio");
}

// ---------------------------------------------------------------------------------------------
// The fixture

class DistCollectives : public DistTest, public ::testing::WithParamInterface<Method> {
 protected:
  /// Runs scenario(rank) in `world` forked ranks of a default group of the test's method.
  void run_world(int world, const std::function<void(int)>& scenario) {
    const Rendezvous rv = rendezvous(GetParam());
    Shared<Flags> flags;
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, world, counting_failures(*flags, [&](int rank) {
      init_process_group(backend_of(GetParam()), init_options(rv, rank, world));
      scenario(rank);
      finish(*flags, world);
    })));
  }
};

// ---------------------------------------------------------------------------------------------
// Reductions

TEST_P(DistCollectives, ReduceAndAllReduceEveryOp) {
  std::vector<int> worlds{2, 3};
  if (GetParam() == Method::kGlooFile) worlds.push_back(4);
  for (const int world : worlds) {
    run_world(world, [world](int rank) {
      const std::vector<Op> ops = {c10d::ReduceOp::SUM, c10d::ReduceOp::MIN, c10d::ReduceOp::MAX,
                                   c10d::ReduceOp::PRODUCT};
      for (size_t i = 0; i < ops.size(); ++i) {
        const std::string what = std::string(op_name(ops[i])) + ", world " + std::to_string(world);
        const TensorDict want = reference(all_ranks(world), ops[i]);
        // all_reduce: in place on every rank (the non-contiguous leaf too), returns nothing.
        TensorDict td = reduce_tree(rank);
        const at::Tensor z = td.get("Z");
        const Transfer t = td.all_reduce({.op = ops[i]});
        SHM_CHECK(!t.has_works && t.works.empty() && !t.last_tag, what << ": all_reduce returned something");
        check_leaves(td, want, "all_reduce " + what);
        SHM_CHECK(td.get("Z").is_same(z) && !z.is_contiguous(), what << ": the leaf was replaced");
        SHM_CHECK(td.get_non_tensor("name") == NonTensorData("rank " + std::to_string(rank)), what);
        // reduce: into rank dst only.
        const int dst = static_cast<int>(i) % world;
        TensorDict rd = reduce_tree(rank);
        const Transfer r = rd.reduce({.dst = dst, .op = ops[i]});
        SHM_CHECK(!r.has_works && r.works.empty(), what << ": reduce returned something");
        if (rank == dst) check_leaves(rd, want, "reduce to " + std::to_string(dst) + ", " + what);
      }
    });
  }
}

TEST_P(DistCollectives, AsyncHandles) {
  run_world(3, [](int rank) {
    const std::vector<int> ranks = all_ranks(3);
    // all_reduce(async_op): one Work per leaf, not waited.
    TensorDict a = reduce_tree(rank);
    const Transfer t = a.all_reduce({.async_op = true});
    SHM_CHECK(t.has_works && t.works.size() == kReduceLeaves, "all_reduce(async_op): " << t.works.size() << " works");
    for (const WorkPtr& w : t.works) SHM_CHECK(w && w->wait(kGroupTimeout));
    check_leaves(a, reference(ranks, c10d::ReduceOp::SUM), "all_reduce(async_op)");
    // reduce(async_op, return_premature): the works.
    TensorDict b = reduce_tree(rank);
    const Transfer p = b.reduce({.dst = 2, .op = c10d::ReduceOp::MAX, .async_op = true, .return_premature = true});
    SHM_CHECK(p.has_works && p.works.size() == kReduceLeaves, "reduce(return_premature): " << p.works.size() << " works");
    p.wait();
    if (rank == 2) check_leaves(b, reference(ranks, c10d::ReduceOp::MAX), "reduce(return_premature)");
    // reduce(async_op) alone waits and returns nothing; return_premature alone is ignored.
    for (const bool async_op : {true, false}) {
      TensorDict c = reduce_tree(rank);
      const Transfer q = c.reduce({.dst = 1, .async_op = async_op, .return_premature = !async_op});
      SHM_CHECK(!q.has_works && q.works.empty(), "reduce(async_op " << async_op << ") returned works");
      if (rank == 1) check_leaves(c, reference(ranks, c10d::ReduceOp::SUM), "reduce(async_op)");
    }
  });
}

// The program that deadlocked while collectives ran in their caller's thread: rank 0 starts an
// all_reduce and sends rank 1 the tree rank 1 receives before its all_reduce; rank 1 then sends
// back, after its all_reduce, what rank 0 waits for before it waits on the all_reduce.
TEST_P(DistCollectives, AsyncAllReduceInterleavedWithPointToPoint) {
  run_world(2, [](int rank) {
    const std::vector<int> ranks = all_ranks(2);
    TensorDict a = reduce_tree(rank);
    TensorDict msg = reduce_tree(7);
    if (rank == 0) {
      const Transfer t = a.all_reduce({.async_op = true});
      msg.send({.dst = 1});
      TensorDict back = reduce_tree(0);
      back.recv({.src = 1});
      check_leaves(back, reduce_tree(9), "the tree sent back after the all_reduce");
      t.wait();
    } else {
      TensorDict got = reduce_tree(1);
      got.recv({.src = 0});
      check_leaves(got, msg, "the tree sent after the all_reduce was started");
      a.all_reduce({});
      reduce_tree(9).send({.dst = 0});
    }
    check_leaves(a, reference(ranks, c10d::ReduceOp::SUM), "all_reduce(async_op) around point-to-point");
  });
}

// ---------------------------------------------------------------------------------------------
// all_gather and scatter

TEST_P(DistCollectives, AllGatherOfDifferentTrees) {
  for (const int world : {2, 3}) {
    run_world(world, [world](int rank) {
      // Rank 1 gives a consolidated tree (gathered without a copy), the others plain ones.
      const TensorDict mine = rank == 1 ? gather_tree(rank).consolidate() : gather_tree(rank);
      const std::vector<TensorDict> all = mine.all_gather({});
      SHM_CHECK(all.size() == static_cast<size_t>(world), all.size() << " tensordicts");
      for (int r = 0; r < world; ++r) check_gathered(all[r], r, "rank " + std::to_string(rank) + " from " + std::to_string(r));
      // This rank's entry is a copy received like the others.
      SHM_CHECK(all[rank].consolidated_storage().data_ptr() != mine.consolidate().consolidated_storage().data_ptr());
      // An empty tensordict takes part too.
      const std::vector<TensorDict> empty = TensorDict().all_gather({});
      SHM_CHECK(empty.size() == static_cast<size_t>(world) && empty[0].sorted_leaf_keys().empty());
    });
  }
}

TEST_P(DistCollectives, Scatter) {
  for (const auto& [world, src] : {std::pair{3, 1}, std::pair{2, 0}}) {
    run_world(world, [world = world, src = src](int rank) {
      // Group rank r gets gather_tree(world - 1 - r); a non-source's list is ignored.
      std::vector<TensorDict> list;
      for (int r = 0; r < world; ++r) list.push_back(gather_tree(world - 1 - r));
      if (rank != src) list.resize(1);
      const TensorDict got = TensorDict().scatter({.src = src, .tensordicts = list, .device = c10::Device("cpu")});
      check_gathered(got, world - 1 - rank, "rank " + std::to_string(rank));
      // Without tensordicts on the non-sources (Python's None), from a list of tensorclass
      // tensordicts: what arrives is a plain tensordict.
      std::optional<std::vector<TensorDict>> only_src;
      if (rank == src) {
        only_src.emplace();
        for (int r = 0; r < world; ++r) only_src->push_back(TensorDict(gather_tree(r)).set_class_name("tdshm.test.coll.X"));
      }
      check_gathered(TensorDict().scatter({.src = src, .tensordicts = only_src}), rank, "scatter without a list");
      // Empty tensordicts (every storage empty: no storage message at all).
      const TensorDict none = TensorDict().scatter({.src = src, .tensordicts = std::vector<TensorDict>(world, TensorDict())});
      SHM_CHECK(none.is_consolidated() && none.sorted_leaf_keys().empty(), "scatter of empty tensordicts");
    });
  }
}

// ---------------------------------------------------------------------------------------------
// A subgroup

// World of 3, sub = new_group({2, 0}): group rank 0 is global rank 2. dst and src are global
// ranks; all_gather's results come in group rank order; rank 1 is not a member.
TEST_P(DistCollectives, Subgroup) {
  run_world(3, [](int rank) {
    const Group sub = new_group({2, 0});
    if (rank == 1) {
      SHM_CHECK(!sub.defined());
      TensorDict td = reduce_tree(rank);
      const Group outside = Group::not_a_member();
      SHM_CHECK_THROWS(Error, [&] { td.all_reduce({.group = outside}); }, "not a member");
      SHM_CHECK_THROWS(Error, [&] { td.reduce({.dst = 0, .group = outside}); }, "not a member");
      SHM_CHECK_THROWS(Error, [&] { td.all_gather({.group = outside}); }, "not a member");
      SHM_CHECK_THROWS(Error, [&] { td.scatter({.src = 0, .group = outside}); }, "not a member");
      return;
    }
    const std::vector<int> members{2, 0};
    TensorDict a = reduce_tree(rank);
    a.all_reduce({.op = c10d::ReduceOp::PRODUCT, .group = sub});
    check_leaves(a, reference(members, c10d::ReduceOp::PRODUCT), "all_reduce over the subgroup");
    TensorDict r = reduce_tree(rank);
    r.reduce({.dst = 0, .op = c10d::ReduceOp::MIN, .group = sub});
    if (rank == 0) check_leaves(r, reference(members, c10d::ReduceOp::MIN), "reduce over the subgroup to global 0");
    SHM_CHECK_THROWS(Error, [&] { r.reduce({.dst = 1, .group = sub}); }, "`dst` = 1", "not a rank of the group",
                     "global ranks: 2, 0");
    const std::vector<TensorDict> all = gather_tree(rank).all_gather({.group = sub});
    SHM_CHECK(all.size() == 2);
    check_gathered(all[0], 2, "all_gather over the subgroup, group rank 0");
    check_gathered(all[1], 0, "all_gather over the subgroup, group rank 1");
    std::optional<std::vector<TensorDict>> list;
    if (rank == 2) list = std::vector<TensorDict>{gather_tree(5), gather_tree(6)};
    const TensorDict got = TensorDict().scatter({.src = 2, .tensordicts = list, .group = sub});
    check_gathered(got, rank == 2 ? 5 : 6, "scatter over the subgroup");
  });
}

// ---------------------------------------------------------------------------------------------
// tensorclass

CollRecord record(int rank) {
  return CollRecord({{"obs", values_of(rank, 0, at::kFloat, {3, 4})}, {"action", values_of(rank, 1, at::kLong, {3})}},
                    {3});
}

TEST_P(DistCollectives, TensorClass) {
  run_world(2, [](int rank) {
    CollRecord a = record(rank);
    a.all_reduce({});
    SHM_CHECK(at::equal(a.obs(), record(0).obs() + record(1).obs()) &&
              at::equal(a.action(), record(0).action() + record(1).action()));
    CollRecord b = record(rank);
    const Transfer t = b.reduce({.dst = 1, .op = c10d::ReduceOp::MAX, .async_op = true, .return_premature = true});
    SHM_CHECK(t.has_works && t.works.size() == 2);
    t.wait();
    if (rank == 1) SHM_CHECK(at::equal(b.obs(), at::maximum(record(0).obs(), record(1).obs())));
    // all_gather and scatter return plain tensordicts (tensordict's _FALLBACK_METHOD_FROM_TD_NOWRAP).
    const std::vector<TensorDict> all = record(rank).all_gather({});
    SHM_CHECK(all.size() == 2);
    for (int r = 0; r < 2; ++r) {
      SHM_CHECK(all[r].class_name().empty(), "class_name '" << all[r].class_name() << "'");
      check_leaves(all[r], record(r).tensordict(), "tensorclass all_gather from " + std::to_string(r));
    }
    std::optional<std::vector<TensorDict>> list;
    if (rank == 0) list = std::vector<TensorDict>{record(5).tensordict(), record(6).tensordict()};
    const TensorDict got = record(rank).scatter({.src = 0, .tensordicts = list});
    SHM_CHECK(got.class_name().empty(), "class_name '" << got.class_name() << "'");
    check_leaves(got, record(5 + rank).tensordict(), "tensorclass scatter");
  });
}

// ---------------------------------------------------------------------------------------------
// Errors

// World of 2: every refused call posts nothing, so the ranks are still in step afterwards.
TEST_P(DistCollectives, Errors) {
  run_world(2, [this](int rank) {
    TensorDict td = reduce_tree(rank);
    // dst / src: global ranks of the group.
    for (const int bad : {2, -1}) {
      SHM_CHECK_THROWS(Error, [&] { td.reduce({.dst = bad}); }, "reduce: `dst` = " + std::to_string(bad),
                       "not a rank of the group (its global ranks: 0, 1)");
      SHM_CHECK_THROWS(Error, [&] { td.scatter({.src = bad}); }, "scatter: `src` = " + std::to_string(bad),
                       "not a rank of the group");
    }
    // scatter's list on the source: given, one per rank.
    if (rank == 0) {
      SHM_CHECK_THROWS(Error, [&] { td.scatter({.src = 0}); }, "`tensordicts` must be given on the source rank (src = 0)");
      for (const size_t n : {size_t{0}, size_t{1}, size_t{3}}) {
        SHM_CHECK_THROWS(Error, [&] { td.scatter({.src = 0, .tensordicts = std::vector<TensorDict>(n, td)}); },
                         "holds " + std::to_string(n) + " tensordicts but the group has 2 ranks");
      }
    }
    // Leaves that cannot take the result in place, named by key, before any leaf is reduced.
    TensorDict expanded = reduce_tree(rank);
    expanded.set({"nest", "wide"}, at::ones({1, 4}).expand({2, 4}));
    SHM_CHECK_THROWS(TypeError, [&] { expanded.all_reduce({}); }, "all_reduce of key ('nest', 'wide')", "overlap");
    SHM_CHECK_THROWS(TypeError, [&] { expanded.reduce({.dst = 0}); }, "reduce of key ('nest', 'wide')", "overlap");
    TensorDict meta = reduce_tree(rank);
    meta.set("m", at::empty({2, 3}, at::TensorOptions().device(at::kMeta)));
    SHM_CHECK_THROWS(TypeError, [&] { meta.all_reduce({}); }, "all_reduce of key 'm'", "only CPU tensors");
    SHM_CHECK_THROWS(TypeError, [&] { meta.reduce({.dst = 1}); }, "reduce of key 'm'", "only CPU tensors");
    // Nothing was posted: the ranks are in step.
    TensorDict ok = reduce_tree(rank);
    ok.all_reduce({});
    check_leaves(ok, reference(all_ranks(2), c10d::ReduceOp::SUM), "all_reduce after the refused calls");
    // A reduction the backend refuses (gloo has no AVG) fails as a TransportError naming the
    // first leaf, on every rank, and leaves the ranks in step.
    if (GetParam() != Method::kShm) {
      TensorDict avg = reduce_tree(rank);
      SHM_CHECK_THROWS(TransportError, [&] { avg.all_reduce({.op = c10d::ReduceOp::AVG}); }, "all_reduce of key 'obs'");
      SHM_CHECK_THROWS(TransportError, [&] { avg.reduce({.dst = 0, .op = c10d::ReduceOp::AVG}); }, "reduce of key 'Z'");
      TensorDict again = reduce_tree(rank);
      again.all_reduce({.op = c10d::ReduceOp::MAX});
      check_leaves(again, reference(all_ranks(2), c10d::ReduceOp::MAX), "all_reduce after the refused AVG");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, DistCollectives,
                         ::testing::Values(Method::kGlooFile, Method::kGlooTcp, Method::kShm), param_name);

}  // namespace
}  // namespace tdshm::test
