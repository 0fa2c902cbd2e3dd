// Unit tests of TensorDict: keys and nesting, batch sizes, errors (each leaving the tensordict
// as it was), locking, the leaf-wise operations, updates and comparisons.

#include <tdshm/tensordict.h>

#include "tensordict/impl.h"

#include <ostream>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace tdshm {
// Readable keys in gtest failure messages (found by argument-dependent lookup).
[[maybe_unused]] static void PrintTo(const Key& key, std::ostream* os) { *os << key.str(); }
}  // namespace tdshm

namespace {

using tdshm::Key;
using tdshm::KeyError;
using tdshm::LockedError;
using tdshm::NonTensorData;
using tdshm::ShapeError;
using tdshm::TensorDict;
using tdshm::TypeError;
using tdshm::Value;

using Shape = std::vector<int64_t>;

// The seed tree of docs/semantics.md: {("a","b"): (2,), "c": (2,3), "_": (2,1,5)} with batch [2].
TensorDict seed() {
  return TensorDict({{{"a", "b"}, at::randn({2})}, {"c", at::randn({2, 3})}, {"_", at::ones({2, 1, 5})}}, {2});
}

// `actual` has the keys (in order), batch sizes and values that `expected` (a clone taken
// before a failing call) has.
void expect_same_contents(const TensorDict& actual, const TensorDict& expected) {
  ASSERT_EQ(actual.keys(true), expected.keys(true));
  EXPECT_EQ(actual.batch_size(), expected.batch_size());
  for (const auto& [key, value] : expected.items(true)) {
    Value got = actual.get_value(key);
    if (value.is_tensor()) {
      ASSERT_TRUE(got.is_tensor()) << key.str();
      EXPECT_EQ(got.tensor().sizes(), value.tensor().sizes()) << key.str();
      EXPECT_EQ(got.tensor().scalar_type(), value.tensor().scalar_type()) << key.str();
      EXPECT_TRUE(at::equal(got.tensor(), value.tensor())) << key.str();
    } else if (value.is_tensordict()) {
      ASSERT_TRUE(got.is_tensordict()) << key.str();
      EXPECT_EQ(got.tensordict().batch_size(), value.tensordict().batch_size()) << key.str();
    } else {
      ASSERT_TRUE(got.is_non_tensor()) << key.str();
      EXPECT_EQ(got.non_tensor(), value.non_tensor()) << key.str();
    }
  }
}

template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception of the expected type was thrown";
  return {};
}

// ---------------------------------------------------------------------------------------------
// Key

TEST(TensorDictKey, StrFormatsPlainAndNestedKeys) {
  EXPECT_EQ(Key("a").str(), "'a'");
  EXPECT_EQ(Key({"a", "b"}).str(), "('a', 'b')");
  EXPECT_EQ(Key({"a", "b", "c"}).str(), "('a', 'b', 'c')");
}

TEST(TensorDictKey, PartsAndNesting) {
  Key plain("a");
  EXPECT_EQ(plain.size(), 1u);
  EXPECT_FALSE(plain.is_nested());
  Key nested{"a", "b"};
  EXPECT_EQ(nested.size(), 2u);
  EXPECT_TRUE(nested.is_nested());
  EXPECT_EQ(nested.front(), "a");
  EXPECT_EQ(nested.back(), "b");
  EXPECT_EQ(nested.parts(), (std::vector<std::string>{"a", "b"}));
}

TEST(TensorDictKey, DotsAreNotSplit) {
  Key k("a.b");
  EXPECT_EQ(k.size(), 1u);
  EXPECT_EQ(k.front(), "a.b");
}

TEST(TensorDictKey, SlashAppendsAPart) {
  Key k = Key("a") / "b";
  EXPECT_EQ(k, (Key{"a", "b"}));
  EXPECT_EQ(k / "c", (Key{"a", "b", "c"}));
  EXPECT_EQ(Key("a").size(), 1u);  // the left operand is unchanged
  EXPECT_THROW(static_cast<void>(Key("a") / ""), KeyError);
}

TEST(TensorDictKey, ComparisonIsByParts) {
  EXPECT_EQ(Key("a"), Key(std::string("a")));
  EXPECT_EQ(Key("a"), Key(std::vector<std::string>{"a"}));
  EXPECT_NE(Key("a"), (Key{"a", "b"}));
  EXPECT_LT(Key("a"), (Key{"a", "b"}));
  EXPECT_LT((Key{"a", "b"}), Key("b"));
  EXPECT_LT(Key("Z"), Key("_"));
  EXPECT_LT(Key("_"), Key("a"));
  EXPECT_GT(Key("b"), Key("a"));
}

TEST(TensorDictKey, EmptyKeyOrPartIsAKeyError) {
  EXPECT_THROW(static_cast<void>(Key("")), KeyError);
  EXPECT_THROW(static_cast<void>(Key(std::string())), KeyError);
  EXPECT_THROW(static_cast<void>(Key(std::vector<std::string>{})), KeyError);
  EXPECT_THROW(static_cast<void>(Key({"a", ""})), KeyError);
  EXPECT_THROW(static_cast<void>(Key({"", "b"})), KeyError);
}

// ---------------------------------------------------------------------------------------------
// Construction, keys and access

TEST(TensorDictConstruct, SeedTreeCreatesIntermediateTensorDict) {
  TensorDict td = seed();
  EXPECT_EQ(td.batch_size(), (Shape{2}));
  EXPECT_EQ(td.batch_dims(), 1);
  EXPECT_FALSE(td.device().has_value());
  EXPECT_EQ(td.size(), 3u);
  EXPECT_FALSE(td.empty());
  ASSERT_TRUE(td.get_value("a").is_tensordict());
  TensorDict a = td.get_tensordict("a");
  EXPECT_EQ(a.batch_size(), (Shape{2}));
  EXPECT_EQ(a.size(), 1u);
  EXPECT_EQ(a.get("b").sizes(), (Shape{2}));
  EXPECT_EQ(td.get({"a", "b"}).sizes(), (Shape{2}));
  EXPECT_EQ(td.get("c").sizes(), (Shape{2, 3}));
  EXPECT_EQ(td.get("_").sizes(), (Shape{2, 1, 5}));
  EXPECT_TRUE(td.class_name().empty());
  EXPECT_FALSE(td.is_locked());
  EXPECT_FALSE(td.is_consolidated());
}

TEST(TensorDictConstruct, DefaultIsEmptyWithEmptyBatchSize) {
  TensorDict td;
  EXPECT_TRUE(td.empty());
  EXPECT_EQ(td.size(), 0u);
  EXPECT_TRUE(td.batch_size().empty());
  EXPECT_FALSE(td.device().has_value());
  EXPECT_TRUE(td.keys(true).empty());
}

TEST(TensorDictConstruct, FromVectorOfItems) {
  std::vector<TensorDict::Item> items;
  items.emplace_back(Key("x"), Value(at::zeros({3, 2})));
  items.emplace_back(Key({"n", "y"}), Value(at::ones({3})));
  TensorDict td(items, {3});
  EXPECT_EQ(td.keys(true), (std::vector<Key>{"x", "n", Key{"n", "y"}}));
  EXPECT_EQ(td.get_tensordict("n").batch_size(), (Shape{3}));
}

TEST(TensorDictKeys, InsertionOrder) {
  TensorDict td = seed();
  EXPECT_EQ(td.keys(), (std::vector<Key>{"a", "c", "_"}));
}

TEST(TensorDictKeys, NestedKeysFollowTheirParent) {
  TensorDict td = seed();
  EXPECT_EQ(td.keys(true), (std::vector<Key>{"a", Key{"a", "b"}, "c", "_"}));
}

TEST(TensorDictKeys, LeavesOnly) {
  TensorDict td = seed();
  EXPECT_EQ(td.keys(true, true), (std::vector<Key>{Key{"a", "b"}, "c", "_"}));
  EXPECT_EQ(td.keys(false, true), (std::vector<Key>{"c", "_"}));
}

TEST(TensorDictKeys, DeepNestingIsDepthFirst) {
  TensorDict td({{{"d", "e", "f"}, at::ones({2})}, {{"d", "g"}, at::ones({2})}, {"h", at::ones({2})}}, {2});
  EXPECT_EQ(td.keys(true),
            (std::vector<Key>{"d", Key{"d", "e"}, Key{"d", "e", "f"}, Key{"d", "g"}, "h"}));
  EXPECT_EQ(td.keys(true, true), (std::vector<Key>{Key{"d", "e", "f"}, Key{"d", "g"}, "h"}));
}

TEST(TensorDictKeys, ItemsMatchKeysAndValues) {
  TensorDict td = seed();
  td.set("s", "text");
  auto items = td.items(true);
  ASSERT_EQ(items.size(), 5u);
  std::vector<Key> keys;
  for (const auto& [k, v] : items) keys.push_back(k);
  EXPECT_EQ(keys, td.keys(true));
  EXPECT_TRUE(items[0].second.is_tensordict());
  EXPECT_TRUE(items[1].second.is_tensor());
  EXPECT_TRUE(items[1].second.tensor().is_same(td.get({"a", "b"})));
  EXPECT_TRUE(items[2].second.tensor().is_same(td.get("c")));
  EXPECT_TRUE(items[4].second.is_non_tensor());
  auto leaves = td.items(true, true);
  ASSERT_EQ(leaves.size(), 4u);
  EXPECT_EQ(leaves[0].first, (Key{"a", "b"}));
  EXPECT_EQ(leaves[3].first, Key("s"));
}

TEST(TensorDictKeys, SortedKeysUseByteOrder) {
  TensorDict td = seed();
  EXPECT_EQ(td.sorted_keys(), (std::vector<std::string>{"_", "a", "c"}));
  td.set("Z", at::zeros({2}));
  td.set("b", at::zeros({2}));
  // 'Z' (0x5A) < '_' (0x5F) < 'a' (0x61): Python's string order.
  EXPECT_EQ(td.sorted_keys(), (std::vector<std::string>{"Z", "_", "a", "b", "c"}));
  // Insertion order is untouched.
  EXPECT_EQ(td.keys(), (std::vector<Key>{"a", "c", "_", "Z", "b"}));
}

TEST(TensorDictKeys, SortedKeysCompareBytesNotLength) {
  TensorDict td;
  td.set("ab", 1);
  td.set("a", 2);
  td.set("B", 3);
  td.set("\xc3\xa9", 4);  // U+00E9: a multi-byte UTF-8 key sorts after every ASCII key
  td.set("z", 5);
  EXPECT_EQ(td.sorted_keys(), (std::vector<std::string>{"B", "a", "ab", "z", "\xc3\xa9"}));
}

TEST(TensorDictKeys, SortedLeafKeysIsTheTransferOrder) {
  TensorDict td = seed();
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{"_", Key{"a", "b"}, "c"}));
}

TEST(TensorDictKeys, SortedLeafKeysSortsEveryLevelAndSkipsNonTensors) {
  TensorDict td = seed();
  td.set({"a", "_"}, at::zeros({2}));
  td.set({"a", "A"}, at::zeros({2}));
  td.set({"a", "s"}, "not a tensor");
  td.set("n", 3);
  td.set({"Z", "y", "x"}, at::zeros({2}));
  td.set("empty", TensorDict(Shape{2}));
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{Key{"Z", "y", "x"}, "_", Key{"a", "A"}, Key{"a", "_"},
                                                     Key{"a", "b"}, "c"}));
}

// sorted_leaf_keys() is cached per tensordict until any tensordict's keys change: every kind of
// change, including one made through a nested tensordict's own handle, is seen at once.
TEST(TensorDictKeys, SortedLeafKeysFollowsEveryChange) {
  TensorDict td = seed();
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{"_", Key{"a", "b"}, "c"}));
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{"_", Key{"a", "b"}, "c"}));  // from the cache
  TensorDict nested = td.get_tensordict("a");
  nested.set("0", at::zeros({2}));  // through the child's own handle
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{"_", Key{"a", "0"}, Key{"a", "b"}, "c"}));
  td.erase("c");
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{"_", Key{"a", "0"}, Key{"a", "b"}}));
  td.set("_", TensorDict({{"x", at::zeros({2})}}, Shape{2}));  // a leaf replaced by a tensordict
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{Key{"_", "x"}, Key{"a", "0"}, Key{"a", "b"}}));
  td.set({"_", "x"}, "now a string");  // a leaf replaced by a non-tensor
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{Key{"a", "0"}, Key{"a", "b"}}));
  td.set({"a", "b"}, at::ones({2}));  // a tensor replaced by a tensor: same keys
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{Key{"a", "0"}, Key{"a", "b"}}));
  // A nested tensordict replaced by one built before the keys were last read: its keys were
  // never announced, the replacement must be (this returned the old keys from the cache).
  TensorDict other({{"y", at::zeros({2})}, {"z", at::zeros({2})}}, Shape{2});
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{Key{"a", "0"}, Key{"a", "b"}}));
  td.set("a", other);
  EXPECT_EQ(td.sorted_leaf_keys(), (std::vector<Key>{Key{"a", "y"}, Key{"a", "z"}}));
  EXPECT_EQ(td.get({"a", "y"}).numel(), 2);
}

// The transfers find each leaf by its position in the cached sorted leaves: the same tensor as
// get(key), in trees nested three deep, after an erase moved positions and after a leaf was
// replaced by another tensor (kept positions, new tensor).
TEST(TensorDictKeys, LeafTensorByPositionIsGetOfTheKey) {
  auto same_as_get = [](const TensorDict& td) {
    const auto sorted = tdshm::detail::sorted_leaves(td);
    ASSERT_EQ(sorted->path_begin.size(), sorted->keys.size() + 1);
    for (size_t i = 0; i < sorted->keys.size(); ++i) {
      EXPECT_TRUE(tdshm::detail::leaf_tensor(td, *sorted, i).is_same(td.get(sorted->keys[i]))) << sorted->keys[i].str();
    }
  };
  TensorDict td({{"z", at::zeros({2})}, {Key{"b", "y"}, at::ones({2})}, {Key{"b", "a", "q"}, at::zeros({2, 3})},
                 {Key{"b", "a", "c"}, at::full({2}, 7.0)}, {"m", "text"}, {"a", at::zeros({2}, at::kLong)}},
                Shape{2});
  EXPECT_EQ(td.sorted_leaf_keys(),
            (std::vector<Key>{"a", Key{"b", "a", "c"}, Key{"b", "a", "q"}, Key{"b", "y"}, "z"}));
  same_as_get(td);
  td.erase("z");
  td.get_tensordict({"b", "a"}).erase("c");  // positions move in a nested tensordict
  same_as_get(td);
  td.set({"b", "y"}, at::full({2}, 3.0));  // a new tensor at the same position
  same_as_get(td);
  EXPECT_EQ(tdshm::detail::leaf_tensor(td, *tdshm::detail::sorted_leaves(td), 2)[0].item<float>(), 3.0F);
}

TEST(TensorDictAccess, ContainsPlainAndNested) {
  TensorDict td = seed();
  EXPECT_TRUE(td.contains("a"));
  EXPECT_TRUE(td.contains({"a", "b"}));
  EXPECT_TRUE(td.contains("c"));
  EXPECT_FALSE(td.contains("b"));
  EXPECT_FALSE(td.contains({"a", "c"}));
  EXPECT_FALSE(td.contains({"x", "y"}));
  EXPECT_FALSE(td.contains("a.b"));
}

TEST(TensorDictAccess, GetValueReportsTheKind) {
  TensorDict td = seed();
  td.set("s", "hello");
  EXPECT_TRUE(td.get_value("c").is_tensor());
  EXPECT_TRUE(td.get_value("a").is_tensordict());
  EXPECT_TRUE(td.get_value("s").is_non_tensor());
  EXPECT_STREQ(td.get_value("c").kind_name(), "tensor");
  EXPECT_STREQ(td.get_value("a").kind_name(), "tensordict");
  EXPECT_STREQ(td.get_value("s").kind_name(), "non-tensor value");
  EXPECT_TRUE(td.get_value({"a", "b"}).tensor().is_same(td.get({"a", "b"})));
  EXPECT_THROW(static_cast<void>(td.get_value("c").tensordict()), TypeError);
  EXPECT_THROW(static_cast<void>(td.get_value("c").non_tensor()), TypeError);
  EXPECT_THROW(static_cast<void>(td.get_value("s").tensor()), TypeError);
}

TEST(TensorDictAccess, GetReturnsTheStoredTensor) {
  TensorDict td = seed();
  at::Tensor c = td.get("c");
  c.fill_(7);
  EXPECT_TRUE(at::equal(td.get("c"), at::full({2, 3}, 7.0)));
  at::Tensor t = at::arange(2);
  td.set("t", t);
  EXPECT_EQ(td.get("t").data_ptr(), t.data_ptr());
}

TEST(TensorDictAccess, GetOfTheWrongKindIsATypeError) {
  TensorDict td = seed();
  td.set("s", "hello");
  EXPECT_THROW(static_cast<void>(td.get("a")), TypeError);
  EXPECT_THROW(static_cast<void>(td.get("s")), TypeError);
  EXPECT_THROW(static_cast<void>(td.get_tensordict("c")), TypeError);
  EXPECT_THROW(static_cast<void>(td.get_tensordict("s")), TypeError);
  EXPECT_THROW(static_cast<void>(td.get_non_tensor("c")), TypeError);
  EXPECT_THROW(static_cast<void>(td.get_non_tensor("a")), TypeError);
}

TEST(TensorDictAccess, MissingKeyIsAKeyError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(static_cast<void>(td.get("missing")), KeyError);
  EXPECT_THROW(static_cast<void>(td.get({"a", "missing"})), KeyError);
  EXPECT_THROW(static_cast<void>(td.get({"missing", "b"})), KeyError);
  EXPECT_THROW(static_cast<void>(td.get_value("missing")), KeyError);
  EXPECT_THROW(static_cast<void>(td.get_tensordict("missing")), KeyError);
  EXPECT_THROW(static_cast<void>(td.get_non_tensor("missing")), KeyError);
  std::string msg = message_of<KeyError>([&] { static_cast<void>(td.get("missing")); });
  EXPECT_NE(msg.find("'missing'"), std::string::npos) << msg;
  expect_same_contents(td, before);
}

TEST(TensorDictAccess, EraseRemovesKeysAndSubtrees) {
  TensorDict td = seed();
  td.erase("c");
  EXPECT_EQ(td.keys(), (std::vector<Key>{"a", "_"}));
  td.erase({"a", "b"});
  EXPECT_TRUE(td.contains("a"));
  EXPECT_TRUE(td.get_tensordict("a").empty());
  td.set({"a", "x"}, at::zeros({2}));
  td.erase("a");
  EXPECT_EQ(td.keys(true), (std::vector<Key>{"_"}));
  // A key set again after erase goes to the end.
  td.set("c", at::zeros({2}));
  td.set("a", at::zeros({2}));
  EXPECT_EQ(td.keys(), (std::vector<Key>{"_", "c", "a"}));
  EXPECT_TRUE(td.get("a").defined());
}

TEST(TensorDictAccess, EraseOfAMissingKeyIsAKeyError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(td.erase("missing"), KeyError);
  EXPECT_THROW(td.erase({"a", "missing"}), KeyError);
  EXPECT_THROW(td.erase({"missing", "b"}), KeyError);
  EXPECT_THROW(td.erase({"c", "x"}), KeyError);
  expect_same_contents(td, before);
}

TEST(TensorDictAccess, SetReplacesAnExistingValueKeepingItsPosition) {
  TensorDict td = seed();
  at::Tensor old_c = td.get("c").clone();
  at::Tensor old_ref = td.get("c");
  td.set("c", at::zeros({2, 4}));
  EXPECT_EQ(td.keys(), (std::vector<Key>{"a", "c", "_"}));
  EXPECT_EQ(td.get("c").sizes(), (Shape{2, 4}));
  EXPECT_TRUE(at::equal(old_ref, old_c));  // replaced, not written into
  td.set("c", "now a string");
  EXPECT_EQ(td.keys(), (std::vector<Key>{"a", "c", "_"}));
  EXPECT_EQ(std::get<std::string>(td.get_non_tensor("c")), "now a string");
}

// ---------------------------------------------------------------------------------------------
// Handle semantics

TEST(TensorDictHandle, NestedHandleWritesAreSeenByTheParent) {
  TensorDict td = seed();
  TensorDict a = td.get_tensordict("a");
  a.set("x", at::zeros({2, 7}));
  EXPECT_TRUE(td.contains({"a", "x"}));
  EXPECT_EQ(td.get({"a", "x"}).sizes(), (Shape{2, 7}));
  EXPECT_TRUE(td.get_tensordict("a").is_same(a));
  td.set({"a", "y"}, 5);
  EXPECT_TRUE(a.contains("y"));
}

TEST(TensorDictHandle, CopyAliases) {
  TensorDict td = seed();
  TensorDict copy = td;  // NOLINT(performance-unnecessary-copy-initialization): the copy is the subject
  EXPECT_TRUE(copy.is_same(td));
  copy.set("new", at::zeros({2}));
  EXPECT_TRUE(td.contains("new"));
  td.erase("c");
  EXPECT_FALSE(copy.contains("c"));
}

TEST(TensorDictHandle, CloneDoesNotAlias) {
  TensorDict td = seed();
  td.set("s", "text");
  TensorDict cl = td.clone();
  EXPECT_FALSE(cl.is_same(td));
  EXPECT_FALSE(cl.get_tensordict("a").is_same(td.get_tensordict("a")));
  EXPECT_EQ(cl.keys(true), td.keys(true));
  EXPECT_EQ(cl.batch_size(), td.batch_size());
  EXPECT_EQ(cl.get_tensordict("a").batch_size(), td.get_tensordict("a").batch_size());
  for (const auto& k : td.keys(true, true)) {
    Value v = td.get_value(k);
    if (!v.is_tensor()) continue;
    EXPECT_NE(cl.get(k).data_ptr(), v.tensor().data_ptr()) << k.str();
    EXPECT_TRUE(at::equal(cl.get(k), v.tensor())) << k.str();
  }
  EXPECT_EQ(cl.get_non_tensor("s"), td.get_non_tensor("s"));

  TensorDict before = td.clone();
  cl.get({"a", "b"}).fill_(42);
  cl.get("c").zero_();
  cl.set("only_in_clone", at::zeros({2}));
  cl.get_tensordict("a").set("also", at::zeros({2}));
  cl.erase("_");
  expect_same_contents(td, before);
}

TEST(TensorDictHandle, CloneIsUnlockedAndKeepsClassName) {
  TensorDict td = seed();
  td.set_class_name("some.Class");
  td.lock_();
  TensorDict cl = td.clone();
  EXPECT_FALSE(cl.is_locked());
  EXPECT_FALSE(cl.get_tensordict("a").is_locked());
  EXPECT_EQ(cl.class_name(), "some.Class");
  cl.set("new", at::zeros({2}));
  EXPECT_FALSE(td.contains("new"));
}

// ---------------------------------------------------------------------------------------------
// Non-tensor values

TEST(TensorDictNonTensor, SetAndGetBackExactly) {
  TensorDict td(Shape{2});
  td.set("str", std::string("hello"));
  td.set("cstr", "world");
  td.set("int", 42);
  td.set("long", int64_t{1} << 40);
  td.set("neg", -3);
  td.set("dbl", 2.5);
  td.set("flt", 0.25f);
  td.set("yes", true);
  td.set("no", false);
  td.set({"nested", "s"}, "deep");

  ASSERT_TRUE(std::holds_alternative<std::string>(td.get_non_tensor("str")));
  EXPECT_EQ(std::get<std::string>(td.get_non_tensor("str")), "hello");
  // A string literal is a string, not a bool.
  ASSERT_TRUE(std::holds_alternative<std::string>(td.get_non_tensor("cstr")));
  EXPECT_EQ(std::get<std::string>(td.get_non_tensor("cstr")), "world");
  ASSERT_TRUE(std::holds_alternative<int64_t>(td.get_non_tensor("int")));
  EXPECT_EQ(std::get<int64_t>(td.get_non_tensor("int")), 42);
  EXPECT_EQ(std::get<int64_t>(td.get_non_tensor("long")), int64_t{1} << 40);
  EXPECT_EQ(std::get<int64_t>(td.get_non_tensor("neg")), -3);
  ASSERT_TRUE(std::holds_alternative<double>(td.get_non_tensor("dbl")));
  EXPECT_EQ(std::get<double>(td.get_non_tensor("dbl")), 2.5);
  ASSERT_TRUE(std::holds_alternative<double>(td.get_non_tensor("flt")));
  EXPECT_EQ(std::get<double>(td.get_non_tensor("flt")), 0.25);
  ASSERT_TRUE(std::holds_alternative<bool>(td.get_non_tensor("yes")));
  EXPECT_TRUE(std::get<bool>(td.get_non_tensor("yes")));
  ASSERT_TRUE(std::holds_alternative<bool>(td.get_non_tensor("no")));
  EXPECT_FALSE(std::get<bool>(td.get_non_tensor("no")));
  EXPECT_EQ(std::get<std::string>(td.get_non_tensor({"nested", "s"})), "deep");
  EXPECT_EQ(td.get_tensordict("nested").batch_size(), (Shape{2}));
}

TEST(TensorDictNonTensor, NonTensorDataValue) {
  TensorDict td;
  td.set("v", NonTensorData(std::string("x")));
  EXPECT_EQ(td.get_non_tensor("v"), NonTensorData(std::string("x")));
}

TEST(TensorDictNonTensor, NoBatchSizeCheck) {
  TensorDict td(Shape{2, 3});
  EXPECT_NO_THROW(td.set("s", "anything"));
  EXPECT_NO_THROW(td.set("i", 1));
}

TEST(TensorDictNonTensor, AllAndAnyIgnoreThem) {
  TensorDict td({{"t", at::ones({2})}, {"zero", 0}, {"f", false}, {"s", ""}}, {2});
  EXPECT_TRUE(td.all());
  TensorDict zeros({{"t", at::zeros({2})}, {"one", 1}, {"yes", true}, {"s", "x"}}, {2});
  EXPECT_FALSE(zeros.any());
  TensorDict only_non_tensors({{"zero", 0}, {"f", false}});
  EXPECT_TRUE(only_non_tensors.all());
  EXPECT_FALSE(only_non_tensors.any());
}

// ---------------------------------------------------------------------------------------------
// Batch size

TEST(TensorDictBatchSize, LeadingDimsMustMatch) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  std::string msg = message_of<ShapeError>([&] { td.set("c", at::zeros({3, 2})); });
  EXPECT_NE(msg.find("'c'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2]"), std::string::npos) << msg;
  expect_same_contents(td, before);

  EXPECT_THROW(td.set("new", at::zeros({3})), ShapeError);
  EXPECT_THROW(td.set("new", at::zeros(Shape{})), ShapeError);  // fewer dims than the batch size
  EXPECT_THROW(td.set({"a", "new"}, at::zeros({1})), ShapeError);
  EXPECT_THROW(td.set({"n", "m"}, at::zeros({5})), ShapeError);  // no intermediate left behind
  expect_same_contents(td, before);
}

TEST(TensorDictBatchSize, ConstructorChecksEveryItem) {
  EXPECT_THROW(TensorDict({{"x", at::zeros({2})}, {"y", at::zeros({3})}}, {2}), ShapeError);
  std::string msg = message_of<ShapeError>([] { TensorDict td({{{"p", "q"}, at::zeros({4, 1})}}, {2}); });
  EXPECT_NE(msg.find("('p', 'q')"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 1]"), std::string::npos) << msg;
}

TEST(TensorDictBatchSize, MultiDimensionalBatch) {
  TensorDict td(Shape{2, 3});
  td.set("x", at::zeros({2, 3}));
  td.set("y", at::zeros({2, 3, 4}));
  EXPECT_THROW(td.set("z", at::zeros({3, 2})), ShapeError);
  EXPECT_THROW(td.set("z", at::zeros({2})), ShapeError);
  td.set({"n", "w"}, at::zeros({2, 3, 1}));
  EXPECT_EQ(td.get_tensordict("n").batch_size(), (Shape{2, 3}));
}

TEST(TensorDictBatchSize, NestedTensorDictMustStartWithTheParentBatch) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  TensorDict wrong(Shape{3});
  std::string msg = message_of<ShapeError>([&] { td.set("n", wrong); });
  EXPECT_NE(msg.find("'n'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2]"), std::string::npos) << msg;
  EXPECT_THROW(td.set("n", TensorDict()), ShapeError);  // [] does not start with [2]
  EXPECT_THROW(td.set({"a", "n"}, TensorDict(Shape{1, 2})), ShapeError);
  expect_same_contents(td, before);

  TensorDict longer({{"x", at::zeros({2, 4})}}, {2, 4});
  td.set("n", longer);
  EXPECT_TRUE(td.get_tensordict("n").is_same(longer));
  EXPECT_EQ(td.get({"n", "x"}).sizes(), (Shape{2, 4}));
}

TEST(TensorDictBatchSize, EmptyBatchSizeAcceptsAnything) {
  TensorDict td;
  EXPECT_NO_THROW(td.set("scalar", at::tensor(1.0)));
  EXPECT_NO_THROW(td.set("vec", at::zeros({7})));
  EXPECT_NO_THROW(td.set("mat", at::zeros({3, 2})));
  EXPECT_NO_THROW(td.set("sub", TensorDict(Shape{5})));
  EXPECT_NO_THROW(td.set({"sub2", "x"}, at::zeros({9})));
  EXPECT_EQ(td.get_tensordict("sub2").batch_size(), Shape{});
  EXPECT_EQ(td.size(), 5u);
}

TEST(TensorDictBatchSize, ZeroSizedBatch) {
  TensorDict td(Shape{0});
  EXPECT_NO_THROW(td.set("x", at::zeros({0, 3})));
  EXPECT_THROW(td.set("y", at::zeros({1, 3})), ShapeError);
}

TEST(TensorDictBatchSize, NegativeDimensionIsAShapeError) {
  EXPECT_THROW(TensorDict(Shape{-1}), ShapeError);
  EXPECT_THROW(TensorDict(Shape{2, -3}), ShapeError);
  EXPECT_THROW(TensorDict({{"x", at::zeros({2})}}, {-2}), ShapeError);
}

// ---------------------------------------------------------------------------------------------
// Bad input: exact exception type, and the tensordict unchanged

TEST(TensorDictBadInput, EmptyKeyIsAKeyError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(td.set("", at::zeros({2})), KeyError);
  EXPECT_THROW(td.set(std::string(), at::zeros({2})), KeyError);
  EXPECT_THROW(static_cast<void>(td.get("")), KeyError);
  EXPECT_THROW(static_cast<void>(td.contains("")), KeyError);
  EXPECT_THROW(td.erase(""), KeyError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, EmptyKeyPartIsAKeyError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(td.set({"a", ""}, at::zeros({2})), KeyError);
  EXPECT_THROW(td.set({"", "a"}, at::zeros({2})), KeyError);
  EXPECT_THROW(static_cast<void>(td.get({"a", ""})), KeyError);
  EXPECT_THROW(td.set_({"a", ""}, at::zeros({2})), KeyError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, LeafUsedAsSubtreeIsAKeyError) {
  TensorDict td = seed();
  td.set("s", "text");
  TensorDict before = td.clone();
  EXPECT_THROW(td.set({"c", "x"}, at::zeros({2})), KeyError);
  EXPECT_THROW(td.set({"c", "x", "y"}, at::zeros({2})), KeyError);
  EXPECT_THROW(td.set({"s", "x"}, at::zeros({2})), KeyError);
  EXPECT_THROW(td.set({"a", "b", "x"}, at::zeros({2})), KeyError);
  EXPECT_THROW(static_cast<void>(td.get({"c", "x"})), KeyError);
  EXPECT_THROW(static_cast<void>(td.get_value({"a", "b", "x"})), KeyError);
  EXPECT_THROW(td.set_({"c", "x"}, at::zeros({2})), KeyError);
  std::string msg = message_of<KeyError>([&] { td.set({"c", "x"}, at::zeros({2})); });
  EXPECT_NE(msg.find("('c', 'x')"), std::string::npos) << msg;
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, SetOnLockedIsALockedError) {
  TensorDict td = seed();
  td.set("s", "text");
  td.lock_();
  TensorDict before = td.clone();
  EXPECT_THROW(td.set("new", at::zeros({2})), LockedError);
  EXPECT_THROW(td.set({"a", "new"}, at::zeros({2})), LockedError);
  EXPECT_THROW(td.set({"new", "deeper"}, at::zeros({2})), LockedError);
  EXPECT_THROW(td.get_tensordict("a").set("new", at::zeros({2})), LockedError);
  EXPECT_THROW(td.set("s", "other text"), LockedError);  // only tensor leaves are written in place
  EXPECT_THROW(td.set("c", "a string"), LockedError);
  EXPECT_THROW(td.set("a", TensorDict(Shape{2})), LockedError);
  EXPECT_THROW(td.erase("c"), LockedError);
  EXPECT_THROW(td.erase("a"), LockedError);
  EXPECT_THROW(td.erase({"a", "b"}), LockedError);
  EXPECT_THROW(td.get_tensordict("a").erase("b"), LockedError);
  expect_same_contents(td, before);
  EXPECT_TRUE(td.is_locked());
}

TEST(TensorDictBadInput, UpdateInPlaceWithAnUnknownKeyWritesNothing) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  // "c" is valid and listed before the unknown key: it must not be written either.
  TensorDict src({{"c", at::zeros({2, 3})}, {"unknown", at::zeros({2})}}, {2});
  std::string msg = message_of<KeyError>([&] { td.update_(src); });
  EXPECT_NE(msg.find("'unknown'"), std::string::npos) << msg;
  expect_same_contents(td, before);

  TensorDict nested_src({{"c", at::zeros({2, 3})}, {{"a", "unknown"}, at::zeros({2})}}, {2});
  EXPECT_THROW(td.update_(nested_src), KeyError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, UpdateInPlaceWithAShapeMismatchWritesNothing) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  TensorDict src({{"c", at::zeros({2, 3})}, {"_", at::zeros({2, 5})}}, {2});
  std::string msg = message_of<ShapeError>([&] { td.update_(src); });
  EXPECT_NE(msg.find("'_'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 1, 5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 5]"), std::string::npos) << msg;
  expect_same_contents(td, before);

  TensorDict nested_src({{"c", at::zeros({2, 3})}, {{"a", "b"}, at::zeros({2, 1})}}, {2});
  EXPECT_THROW(td.update_(nested_src), ShapeError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, UpdateInPlaceWithANonTensorIsATypeError) {
  TensorDict td = seed();
  td.set("s", "text");
  TensorDict before = td.clone();
  TensorDict src({{"c", at::zeros({2, 3})}, {"s", "other"}}, {2});
  EXPECT_THROW(td.update_(src), TypeError);
  expect_same_contents(td, before);
  // A tensor where the destination holds a non-tensor, and a tensordict where it holds a tensor.
  TensorDict src2({{"c", at::zeros({2, 3})}, {"s", at::zeros({2})}}, {2});
  EXPECT_THROW(td.update_(src2), TypeError);
  TensorDict src3({{"c", at::zeros({2, 3})}, {{"_", "x"}, at::zeros({2})}}, {2});
  EXPECT_THROW(td.update_(src3), TypeError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, SetInPlaceErrors) {
  TensorDict td = seed();
  td.set("s", "text");
  TensorDict before = td.clone();
  EXPECT_THROW(td.set_("s", at::zeros({2})), TypeError);
  EXPECT_THROW(td.set_("a", at::zeros({2})), TypeError);
  EXPECT_THROW(td.set_("missing", at::zeros({2})), KeyError);
  EXPECT_THROW(td.set_("c", at::zeros({2, 4})), ShapeError);
  EXPECT_THROW(td.set_("c", at::zeros({2, 3, 1})), ShapeError);
  EXPECT_THROW(td.set_("c", at::Tensor()), TypeError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, UndefinedTensorIsATypeError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(td.set("u", at::Tensor()), TypeError);
  EXPECT_THROW(td.set({"n", "u"}, at::Tensor()), TypeError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, TensorDictInsideItselfIsAKeyError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(td.set("self", td), KeyError);
  EXPECT_THROW(td.set({"a", "self"}, td), KeyError);
  EXPECT_THROW(td.set({"new", "self"}, td), KeyError);
  TensorDict a = td.get_tensordict("a");
  EXPECT_THROW(td.set({"a", "self"}, a), KeyError);
  expect_same_contents(td, before);
}

TEST(TensorDictBadInput, TensorDictInsideItsOwnDescendantIsAKeyError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  TensorDict a = td.get_tensordict("a");
  // Through the child's handle: the root would become its own grandchild.
  EXPECT_THROW(a.set("root", td), KeyError);
  EXPECT_THROW(a.set({"new", "root"}, td), KeyError);
  // Through update: the root inside its own child "a".
  TensorDict holder({{"root", td}}, {2});
  EXPECT_THROW(td.update(TensorDict({{"a", holder}}, {2})), KeyError);
  EXPECT_THROW(a.update(holder), KeyError);
  expect_same_contents(td, before);
  // The same tensordict in two places (no cycle) is allowed.
  TensorDict shared({{"x", at::zeros({2})}}, {2});
  td.set("p", shared);
  td.set({"a", "q"}, shared);
  EXPECT_TRUE(td.get_tensordict("p").is_same(td.get_tensordict({"a", "q"})));
}

// ---------------------------------------------------------------------------------------------
// Locking

TEST(TensorDictLock, LockedAllowsInPlaceWrites) {
  TensorDict td = seed();
  td.lock_();
  EXPECT_TRUE(td.is_locked());
  const void* c_ptr = td.get("c").data_ptr();

  td.set_("c", at::full({2, 3}, 3.0));
  EXPECT_TRUE(at::equal(td.get("c"), at::full({2, 3}, 3.0)));
  EXPECT_EQ(td.get("c").data_ptr(), c_ptr);

  td.set("c", at::full({2, 3}, 4.0));  // an existing tensor key: written in place
  EXPECT_EQ(td.get("c").data_ptr(), c_ptr);
  EXPECT_TRUE(at::equal(td.get("c"), at::full({2, 3}, 4.0)));

  const void* b_ptr = td.get({"a", "b"}).data_ptr();
  td.set({"a", "b"}, at::full({2}, 5.0));
  EXPECT_EQ(td.get({"a", "b"}).data_ptr(), b_ptr);
  EXPECT_TRUE(at::equal(td.get({"a", "b"}), at::full({2}, 5.0)));

  TensorDict src({{"c", at::full({2, 3}, 6.0)}, {{"a", "b"}, at::full({2}, 7.0)}}, {2});
  td.update_(src);
  EXPECT_EQ(td.get("c").data_ptr(), c_ptr);
  EXPECT_EQ(td.get({"a", "b"}).data_ptr(), b_ptr);
  EXPECT_TRUE(at::equal(td.get("c"), at::full({2, 3}, 6.0)));
  EXPECT_TRUE(at::equal(td.get({"a", "b"}), at::full({2}, 7.0)));
  EXPECT_EQ(td.keys(true), (std::vector<Key>{"a", Key{"a", "b"}, "c", "_"}));
}

TEST(TensorDictLock, LockedSetConvertsTheDtypeAndChecksTheShape) {
  TensorDict td = seed();
  td.lock_();
  td.set("c", at::ones({2, 3}, at::kInt));
  EXPECT_EQ(td.get("c").scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(td.get("c"), at::ones({2, 3})));
  TensorDict before = td.clone();
  EXPECT_THROW(td.set("c", at::zeros({2, 4})), ShapeError);
  expect_same_contents(td, before);
}

TEST(TensorDictLock, LocksNestedTensorDicts) {
  TensorDict td({{{"a", "b", "c"}, at::ones({2})}}, {2});
  td.lock_();
  EXPECT_TRUE(td.get_tensordict("a").is_locked());
  EXPECT_TRUE(td.get_tensordict({"a", "b"}).is_locked());
  EXPECT_THROW(td.get_tensordict({"a", "b"}).set("new", at::zeros({2})), LockedError);
}

TEST(TensorDictLock, NestedLockedThroughTheParentCannotBeUnlockedAlone) {
  TensorDict td = seed();
  td.lock_();
  TensorDict a = td.get_tensordict("a");
  EXPECT_THROW(a.unlock_(), LockedError);
  EXPECT_TRUE(a.is_locked());
  EXPECT_TRUE(td.is_locked());
  EXPECT_THROW(a.set("new", at::zeros({2})), LockedError);
}

TEST(TensorDictLock, UnlockingTheRootUnlocksChildren) {
  TensorDict td({{{"a", "b", "c"}, at::ones({2})}}, {2});
  td.lock_();
  td.unlock_();
  EXPECT_FALSE(td.is_locked());
  EXPECT_FALSE(td.get_tensordict("a").is_locked());
  EXPECT_FALSE(td.get_tensordict({"a", "b"}).is_locked());
  td.set("new", at::zeros({2}));
  td.set({"a", "new"}, at::zeros({2}));
  td.erase({"a", "b"});
  EXPECT_EQ(td.keys(true), (std::vector<Key>{"a", Key{"a", "new"}, "new"}));
}

TEST(TensorDictLock, LockAgainAfterUnlock) {
  TensorDict td = seed();
  td.lock_();
  td.unlock_();
  td.lock_();
  EXPECT_TRUE(td.is_locked());
  EXPECT_THROW(td.set("new", at::zeros({2})), LockedError);
  td.unlock_();
  EXPECT_NO_THROW(td.set("new", at::zeros({2})));
}

TEST(TensorDictLock, UnlockOfAnUnlockedTensorDictIsANoOp) {
  TensorDict td = seed();
  EXPECT_NO_THROW(td.unlock_());
  EXPECT_FALSE(td.is_locked());
}

TEST(TensorDictLock, ChildLockedDirectlyCanBeUnlocked) {
  TensorDict td = seed();
  TensorDict a = td.get_tensordict("a");
  a.lock_();
  EXPECT_TRUE(a.is_locked());
  EXPECT_FALSE(td.is_locked());
  EXPECT_THROW(td.set({"a", "new"}, at::zeros({2})), LockedError);
  td.set("new", at::zeros({2}));  // the parent is not locked
  a.unlock_();
  EXPECT_NO_THROW(td.set({"a", "new"}, at::zeros({2})));
}

// ---------------------------------------------------------------------------------------------
// clone, contiguous, expand

TEST(TensorDictExpand, SeedExampleExpandThenContiguous) {
  TensorDict td = TensorDict({{{"a", "b"}, at::ones({2})}, {"c", at::ones({2})}, {{"d", "e", "f"}, at::ones({2, 2})}},
                             {2})
                      .expand({1, 2})
                      .contiguous();
  EXPECT_EQ(td.batch_size(), (Shape{1, 2}));
  EXPECT_EQ(td.keys(), (std::vector<Key>{"a", "c", "d"}));
  EXPECT_EQ(td.get({"a", "b"}).sizes(), (Shape{1, 2}));
  EXPECT_EQ(td.get("c").sizes(), (Shape{1, 2}));
  EXPECT_EQ(td.get({"d", "e", "f"}).sizes(), (Shape{1, 2, 2}));
  EXPECT_EQ(td.get_tensordict("a").batch_size(), (Shape{1, 2}));
  EXPECT_EQ(td.get_tensordict({"d", "e"}).batch_size(), (Shape{1, 2}));
  for (const auto& k : td.keys(true, true)) {
    at::Tensor t = td.get(k);
    EXPECT_TRUE(t.is_contiguous()) << k.str();
    EXPECT_TRUE(at::equal(t, at::ones_like(t))) << k.str();
  }
}

TEST(TensorDictExpand, ExpandGivesViews) {
  TensorDict td = seed();
  TensorDict ex = td.expand({3, 2});
  EXPECT_EQ(ex.batch_size(), (Shape{3, 2}));
  EXPECT_EQ(td.batch_size(), (Shape{2}));
  at::Tensor c = ex.get("c");
  EXPECT_EQ(c.sizes(), (Shape{3, 2, 3}));
  EXPECT_EQ(c.stride(0), 0);
  EXPECT_EQ(c.data_ptr(), td.get("c").data_ptr());
  EXPECT_EQ(ex.get("_").sizes(), (Shape{3, 2, 1, 5}));
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::equal(c[i], td.get("c")));
  }

  TensorDict cont = ex.contiguous();
  EXPECT_TRUE(cont.get("c").is_contiguous());
  EXPECT_NE(cont.get("c").data_ptr(), td.get("c").data_ptr());
  EXPECT_EQ(cont.batch_size(), (Shape{3, 2}));
  EXPECT_TRUE(at::equal(cont.get("c"), c));
}

TEST(TensorDictExpand, SizeOneDimensionsMayGrow) {
  TensorDict td({{"x", at::arange(3).reshape({1, 3})}}, {1});
  TensorDict ex = td.expand({4});
  EXPECT_EQ(ex.batch_size(), (Shape{4}));
  EXPECT_EQ(ex.get("x").sizes(), (Shape{4, 3}));
}

TEST(TensorDictExpand, KeepsNonTensors) {
  TensorDict td = seed();
  td.set("s", "text");
  TensorDict ex = td.expand({1, 2});
  EXPECT_EQ(std::get<std::string>(ex.get_non_tensor("s")), "text");
}

TEST(TensorDictExpand, IncompatibleSizeIsAShapeError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(static_cast<void>(td.expand({3})), ShapeError);
  EXPECT_THROW(static_cast<void>(td.expand({2, 3})), ShapeError);
  EXPECT_THROW(static_cast<void>(td.expand({})), ShapeError);
  EXPECT_THROW(static_cast<void>(td.expand({-1, 2})), ShapeError);
  expect_same_contents(td, before);
}

TEST(TensorDictContiguous, MaterialisesNonContiguousLeaves) {
  at::Tensor base = at::arange(6, at::kFloat).reshape({3, 2});
  TensorDict td({{"t", base.t()}}, {2});  // a transposed view, shape [2, 3]
  ASSERT_FALSE(td.get("t").is_contiguous());
  TensorDict cont = td.contiguous();
  EXPECT_TRUE(cont.get("t").is_contiguous());
  EXPECT_TRUE(at::equal(cont.get("t"), base.t()));
  EXPECT_FALSE(cont.is_same(td));
}

// ---------------------------------------------------------------------------------------------
// apply, apply_, to

TEST(TensorDictApply, ReturnsANewTensorDict) {
  TensorDict td = seed();
  td.set("s", "kept");
  TensorDict before = td.clone();
  TensorDict doubled = td.apply([](const at::Tensor& t) { return t * 2; });
  EXPECT_FALSE(doubled.is_same(td));
  EXPECT_EQ(doubled.keys(true), td.keys(true));
  EXPECT_EQ(doubled.batch_size(), td.batch_size());
  for (const auto& k : td.keys(true, true)) {
    Value v = td.get_value(k);
    if (v.is_tensor()) {
      EXPECT_TRUE(at::allclose(doubled.get(k), v.tensor() * 2)) << k.str();
    }
  }
  EXPECT_EQ(std::get<std::string>(doubled.get_non_tensor("s")), "kept");
  expect_same_contents(td, before);
}

TEST(TensorDictApply, MayChangeTheDtype) {
  TensorDict td = seed();
  TensorDict ints = td.apply([](const at::Tensor& t) { return t.to(at::kInt); });
  EXPECT_EQ(ints.get("c").scalar_type(), at::kInt);
  EXPECT_EQ(ints.get({"a", "b"}).scalar_type(), at::kInt);
}

TEST(TensorDictApply, BreakingTheBatchSizeIsAShapeError) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  EXPECT_THROW(static_cast<void>(td.apply([](const at::Tensor& t) { return t.narrow(0, 0, 1); })), ShapeError);
  EXPECT_THROW(static_cast<void>(td.apply([](const at::Tensor& t) { return t.sum(); })), ShapeError);
  expect_same_contents(td, before);
}

TEST(TensorDictApply, InPlace) {
  TensorDict td = seed();
  td.set("s", "kept");
  TensorDict before = td.clone();
  const void* c_ptr = td.get("c").data_ptr();
  const void* b_ptr = td.get({"a", "b"}).data_ptr();
  TensorDict& ret = td.apply_([](const at::Tensor& t) { return t * 2; });
  EXPECT_TRUE(ret.is_same(td));
  EXPECT_EQ(td.get("c").data_ptr(), c_ptr);
  EXPECT_EQ(td.get({"a", "b"}).data_ptr(), b_ptr);
  EXPECT_TRUE(at::allclose(td.get("c"), before.get("c") * 2));
  EXPECT_TRUE(at::allclose(td.get({"a", "b"}), before.get({"a", "b"}) * 2));
  EXPECT_TRUE(at::allclose(td.get("_"), before.get("_") * 2));
  EXPECT_EQ(std::get<std::string>(td.get_non_tensor("s")), "kept");
}

TEST(TensorDictApply, InPlaceOnLocked) {
  TensorDict td = seed();
  td.lock_();
  EXPECT_NO_THROW(td.apply_([](const at::Tensor& t) { return at::zeros_like(t); }));
  EXPECT_FALSE(td.any());
}

TEST(TensorDictApply, InPlaceWithAWrongShapeWritesNothing) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  // Right shape for every leaf but "c" (keys(true, true) visits ("a", "b") before "c").
  auto fn = [](const at::Tensor& t) { return t.dim() == 2 ? at::zeros({2, 4}) : at::zeros_like(t); };
  EXPECT_THROW(td.apply_(fn), ShapeError);
  expect_same_contents(td, before);
}

TEST(TensorDictApply, InPlaceWhoseFunctionThrowsWritesNothing) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  auto fn = [](const at::Tensor& t) {
    if (t.dim() == 2) throw std::runtime_error("refused");
    return at::zeros_like(t);
  };
  EXPECT_THROW(td.apply_(fn), std::runtime_error);
  expect_same_contents(td, before);
}

TEST(TensorDictTo, SetsTheDevice) {
  TensorDict td = seed();
  TensorDict cpu = td.to(at::kCPU);
  ASSERT_TRUE(cpu.device().has_value());
  EXPECT_EQ(*cpu.device(), c10::Device(at::kCPU));
  ASSERT_TRUE(cpu.get_tensordict("a").device().has_value());
  EXPECT_EQ(*cpu.get_tensordict("a").device(), c10::Device(at::kCPU));
  EXPECT_EQ(cpu.get("c").device(), c10::Device(at::kCPU));
  EXPECT_FALSE(td.device().has_value());  // the source is unchanged
  EXPECT_EQ(cpu.keys(true), td.keys(true));
  EXPECT_TRUE(at::equal(cpu.get("c"), td.get("c")));
}

TEST(TensorDictTo, ConstructedWithADevice) {
  TensorDict td({{"x", at::zeros({2})}, {{"n", "y"}, at::zeros({2, 3})}}, {2}, c10::Device(at::kCPU));
  ASSERT_TRUE(td.device().has_value());
  EXPECT_EQ(*td.device(), c10::Device(at::kCPU));
  EXPECT_EQ(td.get("x").device(), c10::Device(at::kCPU));
  EXPECT_EQ(td.get({"n", "y"}).device(), c10::Device(at::kCPU));
  ASSERT_TRUE(td.get_tensordict("n").device().has_value());
  EXPECT_EQ(*td.get_tensordict("n").device(), c10::Device(at::kCPU));
  TensorDict empty(Shape{3}, c10::Device(at::kCPU));
  EXPECT_EQ(empty.device(), std::optional<c10::Device>(c10::Device(at::kCPU)));
}

// ---------------------------------------------------------------------------------------------
// update, update_

TEST(TensorDictUpdate, AddsMergesAndReplaces) {
  TensorDict td = seed();
  TensorDict a = td.get_tensordict("a");
  at::Tensor old_c = td.get("c");
  at::Tensor old_c_values = old_c.clone();
  at::Tensor old_b = td.get({"a", "b"});
  TensorDict other({{"c", at::zeros({2, 3})}, {{"a", "x"}, at::ones({2, 4})}, {"new", at::ones({2})}, {"s", "str"}},
                   {2});
  TensorDict& ret = td.update(other);
  EXPECT_TRUE(ret.is_same(td));
  EXPECT_EQ(td.keys(true), (std::vector<Key>{"a", Key{"a", "b"}, Key{"a", "x"}, "c", "_", "new", "s"}));
  // Nested tensordicts merge key by key: "a" is the same dictionary and keeps "b".
  EXPECT_TRUE(td.get_tensordict("a").is_same(a));
  EXPECT_TRUE(td.get({"a", "b"}).is_same(old_b));
  EXPECT_TRUE(at::equal(td.get({"a", "x"}), at::ones({2, 4})));
  // Values are replaced (set), not written into the old tensor.
  EXPECT_TRUE(at::equal(td.get("c"), at::zeros({2, 3})));
  EXPECT_TRUE(at::equal(old_c, old_c_values));
  EXPECT_TRUE(at::equal(td.get("new"), at::ones({2})));
  EXPECT_EQ(std::get<std::string>(td.get_non_tensor("s")), "str");
}

TEST(TensorDictUpdate, NewNestedTensorDictIsAdded) {
  TensorDict td = seed();
  TensorDict other({{{"n", "m"}, at::ones({2})}}, {2});
  td.update(other);
  EXPECT_TRUE(at::equal(td.get({"n", "m"}), at::ones({2})));
}

TEST(TensorDictUpdate, FailureWritesNothing) {
  TensorDict td = seed();
  TensorDict before = td.clone();
  TensorDict bad_shape({{"new", at::zeros({2})}, {"c", at::zeros({2, 3})}, {"wrong", at::zeros({3, 2})}}, {});
  EXPECT_THROW(td.update(bad_shape), ShapeError);
  expect_same_contents(td, before);
  // The merge into "a" fails: ("a", "x") does not start with a's batch size [2].
  TensorDict bad_nested({{"new", at::zeros({2})}, {{"a", "x"}, at::zeros({3})}}, {});
  EXPECT_THROW(td.update(bad_nested), ShapeError);
  expect_same_contents(td, before);
}

TEST(TensorDictUpdate, LockedRefusesNewKeysAndWritesNothing) {
  TensorDict td = seed();
  td.lock_();
  const void* c_ptr = td.get("c").data_ptr();
  td.update(TensorDict({{"c", at::zeros({2, 3})}}, {2}));  // existing key: in place
  EXPECT_EQ(td.get("c").data_ptr(), c_ptr);
  EXPECT_TRUE(at::equal(td.get("c"), at::zeros({2, 3})));
  TensorDict before = td.clone();
  TensorDict other({{"c", at::ones({2, 3})}, {"new", at::zeros({2})}}, {2});
  EXPECT_THROW(td.update(other), LockedError);
  expect_same_contents(td, before);
}

TEST(TensorDictUpdate, InPlaceWritesIntoExistingStorage) {
  TensorDict td = seed();
  const void* c_ptr = td.get("c").data_ptr();
  const void* b_ptr = td.get({"a", "b"}).data_ptr();
  const void* u_ptr = td.get("_").data_ptr();
  at::Tensor u_values = td.get("_").clone();
  TensorDict src({{"c", at::full({2, 3}, 9.0)}, {{"a", "b"}, at::full({2}, 8, at::kInt)}}, {2});
  TensorDict& ret = td.update_(src);
  EXPECT_TRUE(ret.is_same(td));
  EXPECT_EQ(td.get("c").data_ptr(), c_ptr);
  EXPECT_EQ(td.get({"a", "b"}).data_ptr(), b_ptr);
  EXPECT_EQ(td.get("_").data_ptr(), u_ptr);
  EXPECT_TRUE(at::equal(td.get("c"), at::full({2, 3}, 9.0)));
  EXPECT_EQ(td.get({"a", "b"}).scalar_type(), at::kFloat);  // converted as by copy_
  EXPECT_TRUE(at::equal(td.get({"a", "b"}), at::full({2}, 8.0)));
  EXPECT_TRUE(at::equal(td.get("_"), u_values));  // not in the source: untouched
  EXPECT_EQ(td.keys(true), (std::vector<Key>{"a", Key{"a", "b"}, "c", "_"}));
}

TEST(TensorDictUpdate, SetInPlace) {
  TensorDict td = seed();
  const void* ptr = td.get({"a", "b"}).data_ptr();
  td.set_({"a", "b"}, at::full({2}, 3.0));
  EXPECT_EQ(td.get({"a", "b"}).data_ptr(), ptr);
  EXPECT_TRUE(at::equal(td.get({"a", "b"}), at::full({2}, 3.0)));
}

// ---------------------------------------------------------------------------------------------
// Comparisons

TEST(TensorDictCompare, NotEqualScalar) {
  TensorDict zeros({{"x", at::zeros({2, 3})}, {{"n", "y"}, at::zeros({2})}}, {2});
  TensorDict ones({{"x", at::ones({2, 3})}, {{"n", "y"}, at::ones({2})}}, {2});
  EXPECT_FALSE((zeros != 0).all());
  EXPECT_TRUE((ones != 0).all());
  EXPECT_TRUE((ones == 1).all());
  EXPECT_FALSE((zeros == 1).any());
  EXPECT_TRUE((zeros == 0).all());
}

TEST(TensorDictCompare, ResultIsATensorDictOfBools) {
  TensorDict td = seed();
  td.set("s", "dropped or kept, but not compared");
  TensorDict r = td == 1;
  EXPECT_EQ(r.batch_size(), td.batch_size());
  for (const auto& k : td.keys(true, true)) {
    if (!td.get_value(k).is_tensor()) continue;
    ASSERT_TRUE(r.contains(k)) << k.str();
    EXPECT_EQ(r.get(k).scalar_type(), at::kBool) << k.str();
    EXPECT_EQ(r.get(k).sizes(), td.get(k).sizes()) << k.str();
  }
  EXPECT_TRUE(r.get("_").all().item<bool>());
}

TEST(TensorDictCompare, AnyAndAll) {
  TensorDict td({{"x", at::zeros({2, 3})}, {{"n", "y"}, at::zeros({2})}}, {2});
  EXPECT_FALSE(td.any());
  EXPECT_FALSE(td.all());
  td.get({"n", "y"})[1] = 1;
  EXPECT_TRUE(td.any());
  EXPECT_FALSE(td.all());
  td.apply_([](const at::Tensor& t) { return at::ones_like(t); });
  EXPECT_TRUE(td.all());
}

TEST(TensorDictCompare, EmptyTensorDict) {
  EXPECT_TRUE(TensorDict().all());
  EXPECT_FALSE(TensorDict().any());
  TensorDict nested_empty;
  nested_empty.set("n", TensorDict());
  EXPECT_TRUE(nested_empty.all());
  EXPECT_FALSE(nested_empty.any());
}

TEST(TensorDictCompare, OrderingComparisons) {
  TensorDict td({{"x", at::ones({2, 3})}, {{"n", "y"}, at::ones({2})}}, {2});
  EXPECT_TRUE(td.lt(2).all());
  EXPECT_FALSE(td.lt(1).any());
  EXPECT_TRUE(td.le(1).all());
  EXPECT_FALSE(td.le(0).any());
  EXPECT_TRUE(td.gt(0).all());
  EXPECT_FALSE(td.gt(1).any());
  EXPECT_TRUE(td.ge(1).all());
  EXPECT_FALSE(td.ge(2).any());
  EXPECT_TRUE(td.eq(1).all());
  EXPECT_FALSE(td.ne(1).any());
  td.set("x", at::arange(6, at::kFloat).reshape({2, 3}));
  TensorDict lt3 = td.lt(3);
  EXPECT_TRUE(at::equal(lt3.get("x"), at::arange(6).reshape({2, 3}).lt(3)));
}

TEST(TensorDictCompare, WithAnotherTensorDict) {
  TensorDict td = seed();
  TensorDict cl = td.clone();
  EXPECT_TRUE((td == cl).all());
  EXPECT_FALSE((td != cl).any());
  EXPECT_TRUE(td.eq(cl).all());
  EXPECT_FALSE(td.ne(cl).any());
  cl.get("c")[0][0] = cl.get("c")[0][0] + 1;
  EXPECT_FALSE((td == cl).all());
  EXPECT_TRUE((td != cl).any());
  TensorDict ne = td.ne(cl);
  EXPECT_EQ(ne.get("c").sum().item<int64_t>(), 1);
  EXPECT_FALSE(ne.get({"a", "b"}).any().item<bool>());
}

TEST(TensorDictCompare, MismatchedKeysAreAKeyError) {
  TensorDict td = seed();
  TensorDict extra = td.clone();
  extra.set("extra", at::zeros({2}));
  EXPECT_THROW(static_cast<void>(td == extra), KeyError);
  EXPECT_THROW(static_cast<void>(extra == td), KeyError);
  EXPECT_THROW(static_cast<void>(td.ne(extra)), KeyError);
  TensorDict missing_nested = td.clone();
  missing_nested.get_tensordict("a").erase("b");
  EXPECT_THROW(static_cast<void>(td.eq(missing_nested)), KeyError);
  EXPECT_THROW(static_cast<void>(missing_nested.eq(td)), KeyError);
}

TEST(TensorDictCompare, SameStructure) {
  TensorDict td = seed();
  EXPECT_TRUE(td.same_structure(td));
  EXPECT_TRUE(td.same_structure(td.clone()));
  // Values are not compared.
  EXPECT_TRUE(td.same_structure(td.apply([](const at::Tensor& t) { return t + 1; })));

  TensorDict other_dtype = td.clone();
  other_dtype.set("c", at::zeros({2, 3}, at::kDouble));
  EXPECT_FALSE(td.same_structure(other_dtype));

  TensorDict other_shape = td.clone();
  other_shape.set("c", at::zeros({2, 4}));
  EXPECT_FALSE(td.same_structure(other_shape));

  TensorDict other_key = td.clone();
  other_key.erase("c");
  other_key.set("d", at::zeros({2, 3}));
  EXPECT_FALSE(td.same_structure(other_key));

  TensorDict extra_key = td.clone();
  extra_key.set("d", at::zeros({2}));
  EXPECT_FALSE(td.same_structure(extra_key));
  EXPECT_FALSE(extra_key.same_structure(td));

  TensorDict other_nesting = td.clone();
  other_nesting.erase("a");
  other_nesting.set("a", at::zeros({2}));
  EXPECT_FALSE(td.same_structure(other_nesting));

  TensorDict deeper = td.clone();
  deeper.set({"a", "z"}, at::zeros({2}));
  EXPECT_FALSE(td.same_structure(deeper));

  TensorDict other_kind = td.clone();
  other_kind.erase("c");
  other_kind.set("c", "string");
  EXPECT_FALSE(td.same_structure(other_kind));

  TensorDict other_batch({{{"a", "b"}, at::zeros({2})}, {"c", at::zeros({2, 3})}, {"_", at::ones({2, 1, 5})}}, {});
  EXPECT_FALSE(td.same_structure(other_batch));
}

TEST(TensorDictAccess, ContainsIsFalseThroughALeafAndNeverThrows) {
  TensorDict td({{"c", at::ones({2})}, {{"a", "b"}, at::ones({2})}}, {2});
  EXPECT_TRUE(td.contains("c"));
  EXPECT_TRUE(td.contains({"a", "b"}));
  EXPECT_TRUE(td.contains("a"));
  EXPECT_FALSE(td.contains({"c", "x"}));
  EXPECT_FALSE(td.contains({"a", "b", "z"}));
  EXPECT_FALSE(td.contains({"nope", "b"}));
  EXPECT_THROW(td.get({"c", "x"}), tdshm::KeyError);
}

}  // namespace
