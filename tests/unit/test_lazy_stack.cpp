// LazyStackedTensorDict's model (include/tdshm/lazy_stack.h), as tensordict's class of that name
// defines it: batch size with the stack dimension, members held not copied, indexing, keys
// shared by every member (sorted), member-wise equality, the dense form, and the errors.
//
//   LazyStack.*

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tdshm/errors.h"
#include "tdshm/lazy_stack.h"
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

}  // namespace
