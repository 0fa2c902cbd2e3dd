// LazyStackedTensorDict's model (include/tdshm/lazy_stack.h), as tensordict's class of that name
// defines it: batch size with the stack dimension, members held not copied, indexing, keys
// shared by every member (sorted), member-wise equality, the dense form, and the errors; and a
// lazy stack nested inside a TensorDict (a Value of its own kind).
//
//   LazyStack.*
//   NestedLazyStack.*

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tdshm/errors.h"
#include "tdshm/lazy_stack.h"
#include "tdshm/schema.h"
#include "tdshm/tensordict.h"

namespace {

using namespace tdshm;

std::vector<std::string> strs(const std::vector<Key>& keys) {
  std::vector<std::string> out;
  for (const Key& k : keys) out.push_back(k.str());
  return out;
}

TensorDict member(double v) {
  return TensorDict({{"b", at::full({2, 3}, v)}, {{"n", "x"}, at::full({2}, v)}, {{"n", "y"}, at::full({2}, v)}}, {2});
}

TEST(LazyStack, BatchSizeIndexingAndMembersHeld) {
  const TensorDict m0 = member(0), m1 = member(1);
  const LazyStackedTensorDict s({m0, m1});
  EXPECT_EQ(s.batch_size(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(s.size(), 2u);
  EXPECT_TRUE(s[1].is_same(m1));
  EXPECT_TRUE(s[-2].is_same(m0));
  EXPECT_THROW(s[2], ShapeError);
  EXPECT_THROW(s[-3], ShapeError);
  m1.get("b").fill_(7);  // held, not copied
  EXPECT_TRUE(at::equal(s[1].get("b"), at::full({2, 3}, 7.0)));

  const LazyStackedTensorDict last({m0, m1, member(2)}, -1);
  EXPECT_EQ(last.stack_dim(), 1);
  EXPECT_EQ(last.batch_size(), (std::vector<int64_t>{2, 3}));
  EXPECT_THROW(LazyStackedTensorDict({m0}, 2), ShapeError);
  EXPECT_THROW(LazyStackedTensorDict({m0}, -3), ShapeError);
  EXPECT_THROW(LazyStackedTensorDict({m0, TensorDict({{"b", at::zeros({3})}}, {3})}), ShapeError);
  EXPECT_EQ(LazyStackedTensorDict({}).batch_size(), (std::vector<int64_t>{0}));
}

TEST(LazyStack, KeysAreTheOnesEveryMemberHasSorted) {
  TensorDict a = member(0), b = member(1);
  a.set("only_a", at::zeros({2}));
  b.set({"n", "z"}, at::zeros({2}));
  b.set("a", at::zeros({2}));
  const LazyStackedTensorDict s({a, b});
  EXPECT_EQ(strs(s.keys()), (std::vector<std::string>{"'b'", "'n'"}));
  EXPECT_EQ(strs(s.keys(true)), (std::vector<std::string>{"'b'", "'n'", "('n', 'x')", "('n', 'y')"}));
  EXPECT_EQ(strs(s.keys(true, true)), (std::vector<std::string>{"'b'", "('n', 'x')", "('n', 'y')"}));
  EXPECT_TRUE(LazyStackedTensorDict({}).keys().empty());
}

TEST(LazyStack, EqualityIsMemberWise) {
  const LazyStackedTensorDict s({member(0), member(1)});
  EXPECT_TRUE((s == LazyStackedTensorDict({member(0), member(1)})).all());
  EXPECT_FALSE((s == LazyStackedTensorDict({member(0), member(2)})).all());
  EXPECT_THROW(s == LazyStackedTensorDict({member(0)}), ShapeError);
}

TEST(LazyStack, DenseFormStacksEachLeaf) {
  const LazyStackedTensorDict s({member(0), member(1), member(2)}, 1);
  const TensorDict d = s.to_tensordict();
  EXPECT_EQ(d.batch_size(), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(at::equal(d.get({"n", "x"}), at::stack({at::full({2}, 0.0), at::full({2}, 1.0), at::full({2}, 2.0)}, 1)));
  EXPECT_EQ(d.get("b").sizes().vec(), (std::vector<int64_t>{2, 3, 3}));

  TensorDict other = member(1);
  other.set("extra", at::zeros({2}));
  EXPECT_THROW(LazyStackedTensorDict({member(0), other}).to_tensordict(), KeyError);
  const TensorDict wide({{"b", at::zeros({2, 4})}, {{"n", "x"}, at::zeros({2})}, {{"n", "y"}, at::zeros({2})}}, {2});
  EXPECT_THROW(LazyStackedTensorDict({member(0), wide}).to_tensordict(), ShapeError);
}

// consolidate(): one storage, member after member, each member's leaves in insertion order
// (tensordict's layout of a lazy stack: its members are the sub-tensordicts "0", "1", ...).
TEST(LazyStack, ConsolidateLaysOutMemberAfterMember) {
  TensorDict m1 = member(1);
  m1.set("extra", at::full({2}, 5, at::kLong));
  const LazyStackedTensorDict s({member(0), m1}, 1);
  EXPECT_FALSE(s.is_consolidated());
  EXPECT_THROW(s.consolidated_storage(), Error);
  const LazyStackedTensorDict c = s.consolidate();
  ASSERT_TRUE(c.is_consolidated());
  EXPECT_EQ(c.stack_dim(), 1);
  EXPECT_TRUE((c == s).all());
  const at::Tensor storage = c.consolidated_storage();
  // member 0: b (24 B), n.x (8), n.y (8); member 1: the same, then extra (16): 96 bytes.
  EXPECT_EQ(storage.numel(), 96);
  auto offset = [&](int64_t m, const Key& k) {
    return static_cast<uint8_t*>(c[m].get(k).data_ptr()) - static_cast<uint8_t*>(storage.data_ptr());
  };
  EXPECT_EQ(offset(0, "b"), 0);
  EXPECT_EQ(offset(0, Key({"n", "y"})), 32);
  EXPECT_EQ(offset(1, "b"), 40);
  EXPECT_EQ(offset(1, "extra"), 80);
  EXPECT_THROW(TensorDict(c[0]).set("new", at::zeros({2})), LockedError) << "the members are locked";
  EXPECT_TRUE(c.consolidate().consolidated_storage().is_same(storage)) << "consolidate() of a consolidated stack";
}

// ---------------------------------------------------------------------------------------------
// A lazy stack held at a key of a TensorDict

/// {"a": [2, 2, 4], "ls": stack of member(0), member(1) (batch [2, 2] along stack_dim 0), "z"}.
TensorDict nest(LazyStackedTensorDict s) {
  return TensorDict({{"z", at::zeros({2, 2})}, {"ls", Value(s)}, {"a", at::ones({2, 2, 4})}}, {2, 2});
}

TEST(NestedLazyStack, SetGetAndKind) {
  const LazyStackedTensorDict s({member(0), member(1)});
  const TensorDict td = nest(s);
  const Value v = td.get_value("ls");
  EXPECT_TRUE(v.is_lazy_stack());
  EXPECT_FALSE(v.is_tensordict() || v.is_tensor() || v.is_non_tensor());
  EXPECT_STREQ(v.kind_name(), "lazy stack");
  const LazyStackedTensorDict back = td.get_lazy_stack("ls");
  EXPECT_TRUE(back.tensordicts()[1].is_same(s.tensordicts()[1])) << "the members are held, not copied";
  EXPECT_THROW(td.get("ls"), TypeError);
  EXPECT_THROW(td.get_tensordict("ls"), TypeError);
  EXPECT_THROW(td.get_lazy_stack("a"), TypeError);
  EXPECT_THROW(td.get({"ls", "b"}), KeyError) << "a key does not go through a lazy stack";
  EXPECT_THROW(v.tensordict(), TypeError);
  // The stack's batch must start with the tensordict's.
  TensorDict small(std::vector<int64_t>{3});
  EXPECT_THROW(small.set("ls", Value(s)), ShapeError);
  // A stack holding the tensordict itself would make a cycle.
  TensorDict self(std::vector<int64_t>{2});
  EXPECT_THROW(self.set("loop", Value(LazyStackedTensorDict({self, self}))), KeyError);
}

TEST(NestedLazyStack, KeysAndLeavesInTransferOrder) {
  TensorDict m1 = member(1);
  m1.set("only1", at::zeros({2}));
  const TensorDict td = nest(LazyStackedTensorDict({member(0), m1}));
  EXPECT_EQ(strs(td.keys()), (std::vector<std::string>{"'z'", "'ls'", "'a'"}));
  // include_nested: the stack's own keys (those every member has) follow it.
  EXPECT_EQ(strs(td.keys(true)), (std::vector<std::string>{"'z'", "'ls'", "('ls', 'b')", "('ls', 'n')", "('ls', 'n', 'x')",
                                                          "('ls', 'n', 'y')", "'a'"}));
  EXPECT_EQ(strs(td.keys(true, true)),
            (std::vector<std::string>{"'z'", "('ls', 'b')", "('ls', 'n', 'x')", "('ls', 'n', 'y')", "'a'"}));
  // Transfer order: sorted keys, the stack member after member (member i under part "i").
  EXPECT_EQ(strs(td.sorted_leaf_keys()),
            (std::vector<std::string>{"'a'", "('ls', '0', 'b')", "('ls', '0', 'n', 'x')", "('ls', '0', 'n', 'y')",
                                      "('ls', '1', 'b')", "('ls', '1', 'n', 'x')", "('ls', '1', 'n', 'y')",
                                      "('ls', '1', 'only1')", "'z'"}));
}

TEST(NestedLazyStack, LeafWiseOperationsGoThroughTheMembers) {
  const TensorDict td = nest(LazyStackedTensorDict({member(0), member(1)}));
  const TensorDict c = td.clone();
  const LazyStackedTensorDict cs = c.get_lazy_stack("ls");
  EXPECT_FALSE(cs.tensordicts()[1].is_same(td.get_lazy_stack("ls").tensordicts()[1]));
  EXPECT_TRUE(at::equal(cs[1].get("b"), at::full({2, 3}, 1.0)));
  EXPECT_TRUE((c == td).all());
  EXPECT_TRUE(c.same_structure(td));
  cs[1].get("b").fill_(7);
  EXPECT_FALSE((c == td).all()) << "a member's leaf differs";
  EXPECT_FALSE(td.get_lazy_stack("ls")[1].get("b").eq(7).any().item<bool>()) << "clone copied the members' leaves";
  TensorDict m1 = member(1);
  m1.set("extra", at::zeros({2}));
  EXPECT_FALSE(nest(LazyStackedTensorDict({member(0), m1})).same_structure(td)) << "a member has another key";
  EXPECT_THROW(nest(LazyStackedTensorDict({member(0)})), ShapeError) << "batch [1, 2] under [2, 2]";
  const TensorDict two({{"ls", Value(LazyStackedTensorDict({member(0), member(1)}))}}, {});
  const TensorDict three({{"ls", Value(LazyStackedTensorDict({member(0), member(1), member(2)}))}}, {});
  EXPECT_FALSE(two.same_structure(three));
  EXPECT_THROW(two == three, ShapeError) << "member counts differ";
  // apply_ writes into the members in place.
  TensorDict w = nest(LazyStackedTensorDict({member(0), member(1)}));
  w.apply_([](const at::Tensor& t) { return t + 1; });
  EXPECT_TRUE(at::equal(w.get_lazy_stack("ls")[0].get({"n", "x"}), at::full({2}, 1.0)));
  EXPECT_TRUE(at::equal(w.get("a"), at::full({2, 2, 4}, 2.0)));
  // Locking the tensordict locks the members; unlocking unlocks them.
  w.lock_();
  EXPECT_THROW(TensorDict(w.get_lazy_stack("ls")[0]).set("new", at::zeros({2})), LockedError);
  w.unlock_();
  TensorDict(w.get_lazy_stack("ls")[0]).set("new", at::zeros({2}));
  EXPECT_NE(w.repr().find("LazyStackedTensorDict(batch_size=[2, 2], stack_dim=0)"), std::string::npos) << w.repr();
}

TEST(NestedLazyStack, ConsolidateLaysTheStackOutAsTensordictDoes) {
  TensorDict m1 = member(1);
  m1.set("only1", at::full({2}, 9.0));
  const TensorDict td = nest(LazyStackedTensorDict({member(0), m1}, 1));
  const TensorDict c = td.consolidate();
  ASSERT_TRUE(c.is_consolidated());
  EXPECT_TRUE((c == td).all());
  // Insertion order, depth first: z (16 B), then ls member after member (member 0: b 24, n.x 8,
  // n.y 8; member 1: the same and only1 8), then a (64): 168 bytes.
  const at::Tensor storage = c.consolidated_storage();
  EXPECT_EQ(storage.numel(), 168);
  const LazyStackedTensorDict ls = c.get_lazy_stack("ls");
  EXPECT_EQ(ls.stack_dim(), 1);
  EXPECT_EQ(ls.batch_size(), (std::vector<int64_t>{2, 2}));
  auto offset = [&](const at::Tensor& t) {
    return static_cast<uint8_t*>(t.data_ptr()) - static_cast<uint8_t*>(storage.data_ptr());
  };
  EXPECT_EQ(offset(c.get("z")), 0);
  EXPECT_EQ(offset(ls[0].get("b")), 16);
  EXPECT_EQ(offset(ls[1].get("b")), 56);
  EXPECT_EQ(offset(ls[1].get("only1")), 96);
  EXPECT_EQ(offset(c.get("a")), 104);
  // The schema marks the node a lazy stack: members "0", "1", the stack's batch size.
  const auto& node = std::get<std::shared_ptr<SchemaNode>>(c.schema().root.entries[1].value);
  EXPECT_EQ(node->lazy_stack_dim, std::optional<int64_t>(1));
  EXPECT_EQ(node->batch_size, (std::vector<int64_t>{2, 2}));
  ASSERT_EQ(node->entries.size(), 2u);
  EXPECT_EQ(node->entries[1].key, "1");
  // The stack dimension is part of the layout's fingerprint (a receiver stacked otherwise is
  // another schema), and a stack is not a tensordict of its members.
  EXPECT_NE(c.schema_fingerprint(), nest(LazyStackedTensorDict({member(0), m1}, 0)).consolidate().schema_fingerprint());
  Schema as_tensordict = c.schema();
  const auto plain = std::make_shared<SchemaNode>(*node);
  plain->lazy_stack_dim.reset();
  plain->batch_size = {2};
  as_tensordict.root.entries[1].value = plain;
  EXPECT_NE(schema_fingerprint(as_tensordict), c.schema_fingerprint());
  // Rebuilt from its storage and schema (as from a consolidated file), it is a stack again.
  const TensorDict back = TensorDict::from_consolidated(storage, c.schema());
  EXPECT_TRUE(back.get_value("ls").is_lazy_stack());
  EXPECT_TRUE((back == td).all());
  // A consolidated file carries it (its schema in version 2 of the encoding).
  const std::string path = testing::TempDir() + "tdshm_lazy_" + std::to_string(::getpid()) + ".td";
  (void)td.consolidate({.filename = path});
  const TensorDict from_file = TensorDict::from_consolidated_file(path);
  ::unlink(path.c_str());
  EXPECT_EQ(from_file.get_lazy_stack("ls").stack_dim(), 1);
  EXPECT_TRUE((from_file == td).all());
  // A lazy stack of lazy stacks is laid out the same way, one level down.
  const LazyStackedTensorDict outer({nest(LazyStackedTensorDict({member(0), m1}, 1))});
  const LazyStackedTensorDict co = outer.consolidate();
  EXPECT_EQ(co.consolidated_storage().numel(), 168);
  EXPECT_TRUE((co == outer).all());
}

}  // namespace
