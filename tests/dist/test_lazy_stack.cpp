// LazyStackedTensorDict's transfers (include/tdshm/lazy_stack.h) between real processes on both
// backends: per-leaf send / isend / recv / irecv with tensordict's options, heterogeneous
// members, the tags running on from member to member (as tensordict's LazyStackedTensorDict sends them: each
// member's messages are those of a TensorDict transfer starting where the previous one ended),
// a subgroup, the refusals (a receiver of another structure), consolidated transfers; and every case
// of tensordict's distributed tests with a lazy stack, as the root or nested in a TensorDict.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/lazy_stack.h>
#include <tdshm/memmap.h>
#include <tdshm/tensordict.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "dist/dist_support.h"

namespace tdshm::test {
namespace {

class TransferLazyStack : public DistTest, public ::testing::WithParamInterface<Method> {
 protected:
  /// checked_wire = false: over gloo the ranks speak tensordict's exact wire (as to a Python peer).
  void run_world(int world, const std::function<void(int, Flags&)>& scenario, bool checked_wire = true) {
    run_default_world(GetParam(), world, scenario, [&](int, InitOptions& o) { o.checked_wire = checked_wire; });
  }
};

/// Three heterogeneous members of batch [2]: member m has "a" (float [2, m + 1]), member 1 also
/// "extra" (int64 [2]), every member ("n", "x") (double [2, 3]); values v + m (zeros: v = 0).
LazyStackedTensorDict hetero_stack(double v) {
  std::vector<TensorDict> members;
  for (int64_t m = 0; m < 3; ++m) {
    TensorDict td({{"a", at::full({2, m + 1}, v == 0 ? 0 : v + m)}, {{"n", "x"}, at::full({2, 3}, v == 0 ? 0 : v + m, at::kDouble)}},
                  {2});
    if (m == 1) td.set("extra", at::full({2}, v == 0 ? 0 : static_cast<int64_t>(v) * 10, at::kLong));
    members.push_back(td);
  }
  return LazyStackedTensorDict(std::move(members));
}

void check_stack(const LazyStackedTensorDict& s, double v, const std::string& what) {
  const LazyStackedTensorDict want = hetero_stack(v);
  for (size_t m = 0; m < want.size(); ++m) {
    for (const Key& k : want[static_cast<int64_t>(m)].sorted_leaf_keys()) {
      SHM_CHECK(at::equal(s[static_cast<int64_t>(m)].get(k), want[static_cast<int64_t>(m)].get(k)),
                what << ": member " << m << " key " << k.str() << " is " << s[static_cast<int64_t>(m)].get(k));
    }
  }
}

// send / recv and isend / irecv (return_early, return_premature), init_tag and pseudo_rand: the
// values land member by member and recv returns the tag of the last leaf of the last member.
TEST_P(TransferLazyStack, HeterogeneousMembersBothWays) {
  run_world(2, [&](int rank, Flags&) {
    if (rank == 0) {
      hetero_stack(1).send({.dst = 1});
      hetero_stack(2).send({.dst = 1, .init_tag = 40, .pseudo_rand = true});
      const Transfer t = hetero_stack(3).isend({.dst = 1, .init_tag = 7, .return_early = true});
      SHM_CHECK(t.has_works && t.works.size() == 7, "one work per leaf of every member: " << t.works.size());
      t.wait();
      LazyStackedTensorDict back = hetero_stack(0);
      const Transfer r = back.irecv({.src = 1, .return_premature = true});
      r.wait();
      check_stack(back, 4, "irecv(return_premature)");
    } else {
      LazyStackedTensorDict s = hetero_stack(0);
      SHM_CHECK(s.recv({.src = 0}) == 6, "7 leaves from init_tag 0: the last tag is 6");
      check_stack(s, 1, "recv");
      s.recv({.src = 0, .init_tag = 40, .pseudo_rand = true});
      check_stack(s, 2, "recv(pseudo_rand)");
      SHM_CHECK(s.recv({.src = 0, .init_tag = 7}) == 13);
      check_stack(s, 3, "recv after isend(return_early)");
      hetero_stack(4).send({.dst = 0});
    }
  });
}

// The tags run on from one member to the next, as tensordict's LazyStackedTensorDict sends a stack: a stack
// of [m0, m1] sent with init_tag 0 is the messages of m0 sent with init_tag 0 then of m1 sent
// with init_tag = m0's last tag + 1. Over gloo, speaking tensordict's exact wire, the receiver
// takes the members one by one with TensorDict::recv (the wire carries nothing else); over shm
// tdshm's key checks also name the member, so only a stack receives a stack (the refusal is the
// next test's).
TEST_P(TransferLazyStack, TagsRunOnFromMemberToMember) {
  const bool shm = GetParam() == Method::kShm;
  run_world(2, [&](int rank, Flags&) {
    const TensorDict m0({{"b", at::full({2}, 1.0)}, {"a", at::full({2}, 2.0)}}, {2});
    const TensorDict m1({{"c", at::full({2}, 3.0)}}, {2});
    if (rank == 0) {
      LazyStackedTensorDict({m0, m1}).send({.dst = 1, .init_tag = 5});
      if (!shm) {
        // The same messages, sent member by member.
        m0.send({.dst = 1, .init_tag = 5});
        m1.send({.dst = 1, .init_tag = 7});
      }
    } else {
      TensorDict r0({{"b", at::zeros({2})}, {"a", at::zeros({2})}}, {2});
      TensorDict r1({{"c", at::zeros({2})}}, {2});
      if (!shm) {
        SHM_CHECK(r0.recv({.src = 0, .init_tag = 5}) == 6);
        SHM_CHECK(r1.recv({.src = 0, .init_tag = 7}) == 7);
        SHM_CHECK((r0 == m0).all() && (r1 == m1).all(), "members received one by one");
        r0.get("a").zero_();
        r1.get("c").zero_();
      }
      LazyStackedTensorDict s({r0, r1});
      SHM_CHECK(s.recv({.src = 0, .init_tag = 5}) == 7);
      SHM_CHECK((s[0] == m0).all() && (s[1] == m1).all(), "the stack received as one");
    }
  }, /*checked_wire=*/false);
}

// A receiver whose stack has other members or keys: over shm the key checks refuse it
// (TransportError naming the leaf, the pair still in step for the next transfer).
TEST_P(TransferLazyStack, RefusalsKeepThePairInStep) {
  const bool shm = GetParam() == Method::kShm;
  run_world(2, [&](int rank, Flags&) {
    if (rank == 0) {
      if (shm) hetero_stack(1).send({.dst = 1});
      hetero_stack(2).send({.dst = 1});
    } else {
      LazyStackedTensorDict s = hetero_stack(0);
      if (shm) {
        // Members swapped: every leaf's key check names another member.
        LazyStackedTensorDict swapped({s[1], s[0], s[2]});
        SHM_CHECK_THROWS(Error, [&] { swapped.recv({.src = 0}); }, "key ('0', 'a')");
      }
      s.recv({.src = 0});
      check_stack(s, 2, "the transfer after the refusal");
    }
  });
}

// Consolidated transfers, as tensordict's: the sender consolidates (members "0", "1", ... of one
// storage) and sends the storage as one message; the receiver must be consolidated (Error before
// anything is received otherwise) with the sender's layout (SchemaError, the message drained, the
// pair in step).
TEST_P(TransferLazyStack, ConsolidatedTransfers) {
  run_world(2, [&](int rank, Flags&) {
    if (rank == 0) {
      hetero_stack(1).send({.dst = 1, .consolidated = true});
      const LazyStackedTensorDict c = hetero_stack(2).consolidate();
      SHM_CHECK(c.is_consolidated() && c.consolidate().consolidated_storage().is_same(c.consolidated_storage()));
      c.send({.dst = 1, .consolidated = true});
      hetero_stack(3).isend({.dst = 1, .consolidated = true}).wait();
    } else {
      LazyStackedTensorDict plain = hetero_stack(0);
      SHM_CHECK_THROWS(Error, [&] { plain.recv({.src = 0, .consolidated = true}); }, "consolidated receiver");
      LazyStackedTensorDict c = hetero_stack(0).consolidate();
      SHM_CHECK(c.recv({.src = 0, .consolidated = true}) == 0, "consolidated transfers use tag 0");
      check_stack(c, 1, "consolidated recv");
      // Another layout (members swapped): refused before a byte is written, the pair in step.
      LazyStackedTensorDict swapped = LazyStackedTensorDict({hetero_stack(0)[1], hetero_stack(0)[0], hetero_stack(0)[2]}).consolidate();
      SHM_CHECK_THROWS(SchemaError, [&] { swapped.recv({.src = 0, .consolidated = true}); }, "schema");
      const Transfer t = c.irecv({.src = 0, .return_premature = true, .consolidated = true});
      t.wait();
      check_stack(c, 3, "consolidated irecv after the refusal");
    }
  });
}

// init_remote / from_remote_init of a stack (tensordict's metadata: class LazyStackedTensorDict,
// stack_dim, members "0", "1", ...), a MemoryMappedTensor leaf in a member (by reference between
// two C++ ranks over shm, by value over gloo); then a TensorDict's init_remote refused by
// LazyStackedTensorDict::from_remote_init (SchemaError once it is all in: the pair stays in step).
TEST_P(TransferLazyStack, InitRemote) {
  run_world(2, [&](int rank, Flags&) {
    if (rank == 0) {
      LazyStackedTensorDict s = hetero_stack(1);
      TensorDict(s[0]).set("mm", MemoryMappedTensor::from_tensor(at::full({2, 4}, 7.0)));
      LazyStackedTensorDict(s.tensordicts(), 1).init_remote({.dst = 1});
      hetero_stack(2)[0].init_remote({.dst = 1});
      hetero_stack(3).send({.dst = 1});
    } else {
      const LazyStackedTensorDict got = LazyStackedTensorDict::from_remote_init({.src = 0});
      SHM_CHECK(got.size() == 3 && got.stack_dim() == 1, got.size() << " members, stack_dim " << got.stack_dim());
      check_stack(got, 1, "from_remote_init of a lazy stack");
      SHM_CHECK(at::equal(got[0].get("mm"), at::full({2, 4}, 7.0)), got[0].get("mm"));
      SHM_CHECK_THROWS(SchemaError, [] { (void)LazyStackedTensorDict::from_remote_init({.src = 0}); },
                       "sends a tensordict");
      LazyStackedTensorDict next = hetero_stack(0);
      next.recv({.src = 0});
      check_stack(next, 3, "the transfer after the refused from_remote_init");
    }
  });
}

/// {"z": [2], "ls": hetero_stack(v) along stack_dim (batch [2, 3] or [3, 2])}, batch [2] or [].
TensorDict nested_tree(double v, int64_t stack_dim = 1) {
  return TensorDict({{"z", at::full({2}, v)}, {"ls", Value(LazyStackedTensorDict(hetero_stack(v).tensordicts(), stack_dim))}},
                    stack_dim == 1 ? std::vector<int64_t>{2} : std::vector<int64_t>{});
}

void check_nested(const TensorDict& td, double v, const std::string& what) {
  SHM_CHECK(at::equal(td.get("z"), at::full({2}, v)), what << ": z is " << td.get("z"));
  const LazyStackedTensorDict ls = td.get_lazy_stack("ls");
  SHM_CHECK(ls.stack_dim() == 1 && ls.size() == 3, what << ": stack_dim " << ls.stack_dim() << ", " << ls.size() << " members");
  check_stack(ls, v, what);
}

// A lazy stack nested in a TensorDict, consolidated as tensordict lays it out (members "0", "1",
// ... of a node whose metadata names LazyStackedTensorDict): consolidated send / recv (another
// stack dimension is another layout: SchemaError, the pair in step) and init_remote. Then
// tensordict's broadcast of a lazy stack and init_remote(use_broadcast) of one, and a
// broadcast of the other kind refused on the receivers once it is all in (the group in step).
TEST_P(TransferLazyStack, NestedConsolidatedInitRemoteAndBroadcast) {
  const std::string memmap_file = file("nested_lazy.mm");
  run_world(3, [&](int rank, Flags&) {
    if (rank == 0) {
      nested_tree(1).send({.dst = 1, .consolidated = true});
      nested_tree(2).send({.dst = 1, .consolidated = true});
      const TensorDict with_file = nested_tree(3);
      TensorDict(with_file.get_lazy_stack("ls")[2]).set("mm", MemoryMappedTensor::from_tensor(at::full({2, 4}, 7.0), memmap_file));
      with_file.init_remote({.dst = 1});
    } else if (rank == 1) {
      TensorDict c = nested_tree(0).consolidate();
      SHM_CHECK(c.recv({.src = 0, .consolidated = true}) == 0, "consolidated transfers use tag 0");
      check_nested(c, 1, "consolidated recv of a nested lazy stack");
      TensorDict other_dim = nested_tree(0, 0).consolidate();
      SHM_CHECK_THROWS(SchemaError, [&] { other_dim.recv({.src = 0, .consolidated = true}); }, "schema");
      const TensorDict got = TensorDict::from_remote_init({.src = 0});
      check_nested(got, 3, "from_remote_init of a tree holding a lazy stack");
      const at::Tensor mm = got.get_lazy_stack("ls")[2].get("mm");
      SHM_CHECK(at::equal(mm, at::full({2, 4}, 7.0)), mm);
      // Between two C++ ranks over shm the file travels by reference, else its bytes.
      const auto info = MemoryMappedTensor::info(mm);
      SHM_CHECK((info && info->filename == memmap_file) == (GetParam() == Method::kShm), "mapped: " << bool(info));
      SHM_CHECK(got.is_locked(), "from_remote_init gives a locked tree");
    }
    // broadcast of a stack from rank 0: the source gets it consolidated, the others receive it.
    const LazyStackedTensorDict b = (rank == 0 ? LazyStackedTensorDict(hetero_stack(4).tensordicts(), 1)
                                               : LazyStackedTensorDict({}))
                                        .broadcast({.src = 0});
    SHM_CHECK(b.stack_dim() == 1 && (rank != 0 || b.is_consolidated()), "rank " << rank);
    check_stack(b, 4, "broadcast of a lazy stack");
    // init_remote(use_broadcast) from rank 2.
    if (rank == 2) {
      hetero_stack(5).init_remote({.use_broadcast = true});
    } else {
      check_stack(LazyStackedTensorDict::from_remote_init({.src = 2, .use_broadcast = true}), 5,
                  "from_remote_init(use_broadcast) of a lazy stack");
    }
    // The other kind: a tensordict where a stack is expected, and a stack where a tensordict is.
    if (rank == 0) {
      nested_tree(6).broadcast({.src = 0});
      SHM_CHECK_THROWS(SchemaError, [] { (void)TensorDict().broadcast({.src = 1}); }, "sends a LazyStackedTensorDict");
    } else if (rank == 1) {
      SHM_CHECK_THROWS(SchemaError, [] { (void)LazyStackedTensorDict({}).broadcast({.src = 0}); }, "sends a tensordict");
      hetero_stack(7).broadcast({.src = 1});
    } else {
      check_nested(TensorDict().broadcast({.src = 0}), 6, "broadcast of a tree holding a lazy stack");
      check_stack(LazyStackedTensorDict({}).broadcast({.src = 1}), 7, "the broadcast after the refusals");
    }
  });
}

// The stack keeps its leaf order between transfers; a member that gains a key (on both sides)
// is seen by the next transfer.
TEST_P(TransferLazyStack, AMemberThatGainsAKeyIsSeen) {
  run_world(2, [&](int rank, Flags&) {
    LazyStackedTensorDict s = rank == 0 ? hetero_stack(1) : hetero_stack(0);
    for (int round = 0; round < 2; ++round) {
      if (round == 1) TensorDict(s[2]).set("late", at::full({2}, rank == 0 ? 9.0 : 0.0));  // a handle: the member itself
      if (rank == 0) {
        SHM_CHECK(s.isend({.dst = 1}).last_tag == (round == 0 ? 6 : 7), "round " << round);
      } else {
        SHM_CHECK(s.recv({.src = 0}) == (round == 0 ? 6 : 7), "round " << round);
        check_stack(s, 1, "round " + std::to_string(round));
        if (round == 1) SHM_CHECK(at::equal(s[2].get("late"), at::full({2}, 9.0)), s[2].get("late"));
      }
    }
  });
}

// A subgroup: group_dst / group_src are ranks inside it.
TEST_P(TransferLazyStack, InASubgroup) {
  run_world(3, [&](int rank, Flags&) {
    const Group g = new_group({0, 2});
    if (rank == 2) hetero_stack(5).send({.group = g, .group_dst = 0});
    if (rank == 0) {
      LazyStackedTensorDict s = hetero_stack(0);
      s.recv({.group = g, .group_src = 1});
      check_stack(s, 5, "recv in a subgroup");
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The cases of tensordict 0.14's distributed tests with a lazy stack:
// TestSendLazyStackRoot / Nest, TestiSendLazyStackRoot / Nest (pseudo_rand, group None or
// [0, 1]) and TestiRecvLazyStackRoot / Nest (pseudo_rand, return_premature), with their trees:
// rank 1 sends ones, rank 0 receives into zeros and every leaf must be 1.

enum class Shape { kRoot, kNest };

at::Tensor filled(bool ones, std::vector<int64_t> shape) { return ones ? at::ones(shape) : at::zeros(shape); }

/// TestSend's / TestiSend's members: td1 as TestSend.make_td, td2 its clone with "c" [2, 3, 2]
/// and a new "g" [2, 1, 5].
LazyStackedTensorDict send_case_stack(bool ones) {
  TensorDict td1({{{"a", "b"}, filled(ones, {2})},
                  {"c", filled(ones, {2, 3})},
                  {{"d", "e", "f"}, MemoryMappedTensor::from_tensor(filled(ones, {2, 2}))}},
                 {2});
  td1.set("_", filled(ones, {2, 1, 5}));
  TensorDict td2 = td1.clone();
  td2.set("c", filled(ones, {2, 3, 2}));
  td2.set("g", filled(ones, {2, 1, 5}));
  return LazyStackedTensorDict({td1, td2}, 0);
}

/// TestiRecv's members: td2 is td1's clone with "c" [2, 3, 10] and "g" a copy of td1's "c".
LazyStackedTensorDict irecv_case_stack(bool ones) {
  TensorDict td1({{{"a", "b"}, filled(ones, {2})},
                  {"c", filled(ones, {2, 3})},
                  {"_", filled(ones, {2, 1, 5})},
                  {{"d", "e", "f"}, MemoryMappedTensor::from_tensor(filled(ones, {2, 2}))}},
                 {2});
  TensorDict td2 = td1.clone();
  td2.set("c", td2.get("c").unsqueeze(-1).expand({2, 3, 10}).contiguous());
  td2.set("g", td1.get("c").clone());
  return LazyStackedTensorDict({td1, td2}, 0);
}

/// The lazy stack as the root, or nested: TensorDict({key: stack}, [2, 2]).
struct CaseTree {
  std::optional<LazyStackedTensorDict> root;
  std::optional<TensorDict> nest;

  CaseTree(LazyStackedTensorDict stack, Shape shape, const char* key) {
    if (shape == Shape::kRoot) {
      root = std::move(stack);
    } else {
      nest = TensorDict({{key, Value(stack)}}, {2, 2});
    }
  }
  Transfer isend(const SendOptions& o) const { return root ? root->isend(o) : nest->isend(o); }
  void send(const SendOptions& o) const { root ? root->send(o) : nest->send(o); }
  Transfer irecv(const RecvOptions& o) { return root ? root->irecv(o) : nest->irecv(o); }
  int64_t recv(const RecvOptions& o) { return root ? root->recv(o) : nest->recv(o); }
  /// tensordict's `(td == 1).all()`.
  bool all_ones() const {
    if (nest) return (*nest == 1).all();
    return std::all_of(root->tensordicts().begin(), root->tensordicts().end(),
                       [](const TensorDict& m) { return (m == 1).all(); });
  }
};

TEST_P(TransferLazyStack, TensordictsDistributedTestCases) {
  run_world(2, [&](int rank, Flags&) {
    int case_no = 0;
    for (const Shape shape : {Shape::kRoot, Shape::kNest}) {
      const std::string shape_name = shape == Shape::kRoot ? "Root" : "Nest";
      for (const bool pseudo_rand : {true, false}) {
        // TestSendLazyStack* and TestiSendLazyStack*: group None, then [0, 1].
        for (const bool with_group : {false, true}) {
          const Group g = with_group ? new_group({0, 1}) : Group{};
          for (const bool isend : {false, true}) {
            const std::string what = std::string(isend ? "TestiSendLazyStack" : "TestSendLazyStack") + shape_name +
                                     " pseudo_rand=" + (pseudo_rand ? "True" : "False") + " group=" +
                                     (with_group ? "[0, 1]" : "None");
            ++case_no;
            if (rank == 1) {
              const CaseTree td(send_case_stack(true), shape, "ls");
              if (isend) {
                td.isend({.dst = 0, .group = g, .pseudo_rand = pseudo_rand}).wait();
              } else {
                td.send({.dst = 0, .group = g, .pseudo_rand = pseudo_rand});
              }
            } else {
              CaseTree td(send_case_stack(false), shape, "ls");
              td.recv({.src = 1, .group = g, .pseudo_rand = pseudo_rand});
              SHM_CHECK(td.all_ones(), what << ": a leaf is not 1");
            }
          }
        }
        // TestiRecvLazyStack*: return_premature true and false.
        for (const bool return_premature : {true, false}) {
          const std::string what = "TestiRecvLazyStack" + shape_name + " pseudo_rand=" + (pseudo_rand ? "True" : "False") +
                                   " return_premature=" + (return_premature ? "True" : "False");
          ++case_no;
          if (rank == 1) {
            CaseTree(irecv_case_stack(true), shape, "td").send({.dst = 0, .pseudo_rand = pseudo_rand});
          } else {
            CaseTree td(irecv_case_stack(false), shape, "td");
            const Transfer t = td.irecv({.src = 1, .pseudo_rand = pseudo_rand, .return_premature = return_premature});
            if (return_premature) {
              SHM_CHECK(t.has_works && t.works.size() == 9, what << ": " << t.works.size() << " works, 9 leaves");
              t.wait();
            }
            SHM_CHECK(td.all_ones(), what << ": a leaf is not 1");
          }
        }
      }
    }
    SHM_CHECK(case_no == 24, case_no << " cases");
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, TransferLazyStack, ::testing::Values(Method::kShm, Method::kGlooFile), param_name);

}  // namespace
}  // namespace tdshm::test
