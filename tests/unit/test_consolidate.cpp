// Consolidation: byte-exact layout, views into one storage, write-through, schema, files.

#include <tdshm/memmap.h>
#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace {

using tdshm::TensorDict;

TDSHM_TENSORCLASS(ConsolidatePoint, "tdshm.test.ConsolidatePoint", pos, vel);

const uint8_t* data_of(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

const tdshm::SchemaTensor& leaf_schema(const tdshm::SchemaNode& node, const std::string& key) {
  for (const auto& e : node.entries) {
    if (e.key == key) return std::get<tdshm::SchemaTensor>(e.value);
  }
  throw std::runtime_error("no schema leaf " + key);
}

const tdshm::SchemaNode& child_schema(const tdshm::SchemaNode& node, const std::string& key) {
  for (const auto& e : node.entries) {
    if (e.key == key) return *std::get<std::shared_ptr<tdshm::SchemaNode>>(e.value);
  }
  throw std::runtime_error("no schema child " + key);
}

// A unique scratch directory, removed even when the test fails.
class ConsolidateFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tdshm-consolidate-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

TEST(Consolidate, ByteExactLayoutOfTheIssueExample) {
  TensorDict td({{{"a", "b"}, at::ones({2})}, {"c", at::ones({2, 3})}}, {2});
  TensorDict c = td.consolidate();

  ASSERT_TRUE(c.is_consolidated());
  EXPECT_TRUE(c.is_locked());
  at::Tensor storage = c.consolidated_storage();
  EXPECT_EQ(storage.scalar_type(), at::kByte);
  EXPECT_EQ(storage.dim(), 1);
  EXPECT_EQ(storage.numel(), 32);
  EXPECT_EQ(c.schema().total_bytes, 32u);

  const auto& ab = leaf_schema(child_schema(c.schema().root, "a"), "b");
  EXPECT_EQ(ab.start, 0u);
  EXPECT_EQ(ab.stop, 8u);
  EXPECT_EQ(ab.pad, 0u);
  const auto& cc = leaf_schema(c.schema().root, "c");
  EXPECT_EQ(cc.start, 8u);
  EXPECT_EQ(cc.stop, 32u);
  EXPECT_EQ(cc.dtype, at::kFloat);
  EXPECT_EQ(cc.shape, (std::vector<int64_t>{2, 3}));

  // Leaves are views of the storage at exactly those offsets.
  EXPECT_EQ(data_of(c.get({"a", "b"})), data_of(storage) + 0);
  EXPECT_EQ(data_of(c.get("c")), data_of(storage) + 8);
  EXPECT_TRUE(c.get("c").is_alias_of(storage));
  // And the bytes are the float32 ones.
  const float one = 1.0f;
  for (int i = 0; i < 8; ++i) EXPECT_EQ(std::memcmp(data_of(storage) + 4 * i, &one, 4), 0) << i;
  EXPECT_TRUE((c == 1).all());
  // The source is untouched and unconsolidated.
  EXPECT_FALSE(td.is_consolidated());
  EXPECT_FALSE(td.is_locked());
}

TEST(Consolidate, MixedDtypesNestedWithZeroPadding) {
  TensorDict td({{{"n", "x"}, at::arange(3, at::kDouble)},
                 {{"n", "y"}, at::tensor({int8_t{-1}, int8_t{2}, int8_t{3}}, at::kChar)},
                 {"flag", at::tensor({1, 0}).to(at::kBool)},
                 {"note", "hello"}},
                {});
  TensorDict c = td.consolidate();
  const auto& root = c.schema().root;
  const auto& n = child_schema(root, "n");
  const auto& x = leaf_schema(n, "x");
  const auto& y = leaf_schema(n, "y");
  const auto& flag = leaf_schema(root, "flag");
  EXPECT_EQ(std::tie(x.start, x.stop, x.pad), std::make_tuple(uint64_t{0}, uint64_t{24}, uint32_t{0}));
  EXPECT_EQ(std::tie(y.start, y.stop, y.pad), std::make_tuple(uint64_t{24}, uint64_t{27}, uint32_t{5}));
  EXPECT_EQ(std::tie(flag.start, flag.stop, flag.pad), std::make_tuple(uint64_t{32}, uint64_t{34}, uint32_t{6}));
  EXPECT_EQ(c.schema().total_bytes, 40u);

  const uint8_t* s = data_of(c.consolidated_storage());
  for (int i = 27; i < 32; ++i) EXPECT_EQ(s[i], 0) << "pad byte " << i;
  for (int i = 34; i < 40; ++i) EXPECT_EQ(s[i], 0) << "pad byte " << i;
  EXPECT_EQ(static_cast<int8_t>(s[24]), -1);
  EXPECT_EQ(s[32], 1);
  EXPECT_EQ(s[33], 0);

  EXPECT_TRUE(c.get({"n", "x"}).equal(at::arange(3, at::kDouble)));
  EXPECT_TRUE(c.get({"n", "y"}).equal(td.get({"n", "y"})));
  EXPECT_TRUE(c.get("flag").equal(td.get("flag")));
  EXPECT_EQ(std::get<std::string>(c.get_non_tensor("note")), "hello");
  EXPECT_EQ(std::get<std::string>(std::get<tdshm::NonTensorData>(root.entries.back().value)), "hello");
  // Insertion order, not sorted order, is the layout order.
  EXPECT_EQ(c.keys(), (std::vector<tdshm::Key>{"n", "flag", "note"}));
}

TEST(Consolidate, NonContiguousExpandedAndZeroSizedLeaves) {
  at::Tensor t = at::arange(6, at::kFloat).reshape({2, 3}).t();  // non-contiguous
  TensorDict td({{"t", t}, {"e", at::ones({1}).expand({3})}, {"z", at::empty({0}, at::kLong)}}, {});
  TensorDict c = td.consolidate();
  EXPECT_TRUE(c.get("t").equal(t));
  EXPECT_TRUE(c.get("t").is_contiguous());
  EXPECT_TRUE(c.get("e").equal(at::ones({3})));
  EXPECT_EQ(c.get("z").numel(), 0);
  EXPECT_EQ(c.schema().total_bytes, 24u + 16u);  // 6 floats, 3 floats + 4 pad, nothing
}

TEST(Consolidate, SixteenByteDtypeAtAnOffsetThatIsOnlyEightAligned) {
  TensorDict td({{"b", at::ones({1}, at::kChar)}, {"z", at::full({2}, c10::complex<double>(1.5, -2.0))}}, {});
  TensorDict c = td.consolidate();
  EXPECT_EQ(leaf_schema(c.schema().root, "z").start, 8u);
  EXPECT_TRUE(c.get("z").equal(td.get("z")));
  EXPECT_EQ(data_of(c.get("z")), data_of(c.consolidated_storage()) + 8);
}

TEST(Consolidate, UpdateWritesThroughIntoTheStorage) {
  TensorDict c = TensorDict({{{"a", "b"}, at::zeros({2})}, {"c", at::zeros({2, 3})}}, {2}).consolidate();
  TensorDict fresh({{{"a", "b"}, at::full({2}, 7.0)}, {"c", at::full({2, 3}, 3.0)}}, {2});
  const void* before = c.get("c").data_ptr();
  c.update_(fresh);
  EXPECT_EQ(c.get("c").data_ptr(), before);
  float stored = 0;
  std::memcpy(&stored, data_of(c.consolidated_storage()) + 8, 4);
  EXPECT_EQ(stored, 3.0f);
  std::memcpy(&stored, data_of(c.consolidated_storage()), 4);
  EXPECT_EQ(stored, 7.0f);
  c.set_("c", at::full({2, 3}, 5.0));
  std::memcpy(&stored, data_of(c.consolidated_storage()) + 28, 4);
  EXPECT_EQ(stored, 5.0f);
}

TEST(Consolidate, LockedRefusesNewKeysAndUnlockDropsTheConsolidation) {
  TensorDict c = TensorDict({{"x", at::ones({2})}}, {2}).consolidate();
  EXPECT_THROW(c.set("y", at::ones({2})), tdshm::LockedError);
  EXPECT_THROW(c.erase("x"), tdshm::LockedError);
  EXPECT_TRUE(c.is_consolidated());
  c.unlock_();
  EXPECT_FALSE(c.is_consolidated());
  EXPECT_THROW(c.consolidated_storage(), tdshm::Error);
  c.set("y", at::ones({2}));
  EXPECT_TRUE(c.contains("y"));
}

TEST(Consolidate, AlreadyConsolidatedIsReturnedWithoutCopy) {
  TensorDict c = TensorDict({{"x", at::ones({4})}}, {}).consolidate();
  TensorDict again = c.consolidate();
  EXPECT_TRUE(again.is_same(c));
  EXPECT_EQ(again.consolidated_storage().data_ptr(), c.consolidated_storage().data_ptr());
}

TEST(Consolidate, RebuildFromStorageAndSchema) {
  TensorDict src({{{"a", "b"}, at::randn({2})}, {"c", at::randn({2, 3})}, {"s", "text"}, {"k", int64_t{7}}}, {2});
  TensorDict c = src.consolidate();
  TensorDict copy_of_storage = TensorDict::from_consolidated(c.consolidated_storage().clone(), c.schema());
  EXPECT_TRUE(copy_of_storage.is_consolidated());
  EXPECT_TRUE(copy_of_storage.same_structure(src));
  EXPECT_TRUE((copy_of_storage == src).all());
  EXPECT_EQ(copy_of_storage.schema_fingerprint(), c.schema_fingerprint());
  EXPECT_EQ(std::get<int64_t>(copy_of_storage.get_non_tensor("k")), 7);
  EXPECT_EQ(copy_of_storage.batch_size(), (std::vector<int64_t>{2}));
}

TEST(Consolidate, RebuildRejectsAStorageThatIsTooSmallOrNotBytes) {
  TensorDict c = TensorDict({{"x", at::ones({4})}}, {}).consolidate();
  EXPECT_THROW(TensorDict::from_consolidated(at::zeros({8}, at::kByte), c.schema()), tdshm::SchemaError);
  EXPECT_THROW(TensorDict::from_consolidated(at::zeros({16}, at::kFloat), c.schema()), tdshm::SchemaError);
  tdshm::Schema bad = c.schema();
  std::get<tdshm::SchemaTensor>(bad.root.entries[0].value).shape = {5};  // 20 bytes != [0, 16)
  EXPECT_THROW(TensorDict::from_consolidated(at::zeros({16}, at::kByte), bad), tdshm::SchemaError);
}

TEST(Consolidate, FingerprintFollowsTheLayout) {
  auto fp = [](TensorDict td) { return td.consolidate().schema_fingerprint(); };
  const uint64_t base = fp(TensorDict({{"x", at::ones({4})}, {"y", at::ones({2}, at::kLong)}}, {}));
  EXPECT_EQ(base, fp(TensorDict({{"x", at::zeros({4})}, {"y", at::zeros({2}, at::kLong)}}, {})));
  EXPECT_NE(base, fp(TensorDict({{"x", at::ones({4})}, {"z", at::ones({2}, at::kLong)}}, {})));
  EXPECT_NE(base, fp(TensorDict({{"x", at::ones({4}, at::kInt)}, {"y", at::ones({2}, at::kLong)}}, {})));
  EXPECT_NE(base, fp(TensorDict({{"x", at::ones({2, 2})}, {"y", at::ones({2}, at::kLong)}}, {})));
  EXPECT_NE(base, fp(TensorDict({{"y", at::ones({2}, at::kLong)}, {"x", at::ones({4})}}, {})));
}

TEST(Consolidate, EmptyTensorDict) {
  TensorDict c = TensorDict().consolidate();
  EXPECT_TRUE(c.is_consolidated());
  EXPECT_EQ(c.consolidated_storage().numel(), 0);
  EXPECT_EQ(c.schema().total_bytes, 0u);
}

TEST(Consolidate, TensorclassNameTravelsInTheSchema) {
  ConsolidatePoint p({{"pos", at::ones({3, 2})}, {"vel", at::zeros({3, 2})}}, {3});
  ConsolidatePoint c = p.consolidate();
  EXPECT_TRUE(c.is_consolidated());
  EXPECT_EQ(c.tensordict().schema().root.class_name, "tdshm.test.ConsolidatePoint");
  TensorDict rebuilt = TensorDict::from_consolidated(c.tensordict().consolidated_storage(), c.tensordict().schema());
  auto any = tdshm::make_tensorclass(rebuilt);
  ASSERT_NE(dynamic_cast<ConsolidatePoint*>(any.get()), nullptr);
  EXPECT_TRUE(static_cast<ConsolidatePoint&>(*any).pos().equal(at::ones({3, 2})));
}

TEST_F(ConsolidateFiles, StorageInAFileAndRebuildFromTheFileAlone) {
  const std::string file = path("td.bin");
  TensorDict src({{{"a", "b"}, at::arange(2, at::kFloat)}, {"c", at::ones({2, 3}, at::kDouble)}, {"tag", "v1"}}, {2});
  TensorDict c = src.consolidate({.filename = file});
  ASSERT_TRUE(c.is_consolidated());
  auto info = tdshm::MemoryMappedTensor::info(c.consolidated_storage());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->filename, file);
  EXPECT_EQ(info->offset, 0);

  TensorDict back = TensorDict::from_consolidated_file(file);
  EXPECT_TRUE(back.is_consolidated());
  EXPECT_TRUE(back.same_structure(src));
  EXPECT_TRUE((back == src).all());
  EXPECT_EQ(std::get<std::string>(back.get_non_tensor("tag")), "v1");
  EXPECT_EQ(back.schema_fingerprint(), c.schema_fingerprint());

  // Both map the same file: a write through one is seen by the other.
  c.set_("c", at::full({2, 3}, 9.0, at::kDouble));
  EXPECT_TRUE((back.get("c") == 9).all().item<bool>());
}

TEST_F(ConsolidateFiles, FileErrorsAreTyped) {
  EXPECT_THROW(TensorDict::from_consolidated_file(path("missing.bin")), tdshm::MemmapError);
  {
    std::ofstream(path("tiny.bin")) << "12345";
  }
  EXPECT_THROW(TensorDict::from_consolidated_file(path("tiny.bin")), tdshm::MemmapError);

  const std::string file = path("td.bin");
  TensorDict({{"x", at::ones({4})}}, {}).consolidate({.filename = file});
  const auto size = std::filesystem::file_size(file);
  auto patch = [&](const std::string& out, uint64_t at, char value) {
    std::filesystem::copy_file(file, out);
    std::fstream f(out, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(value);
  };
  patch(path("magic.bin"), size - 1, 'X');  // trailer magic
  EXPECT_THROW(TensorDict::from_consolidated_file(path("magic.bin")), tdshm::SchemaError);
  patch(path("schema.bin"), 16 + 6, '\x7f');  // a byte inside the encoded schema
  EXPECT_THROW(TensorDict::from_consolidated_file(path("schema.bin")), tdshm::SchemaError);
  patch(path("length.bin"), size - 24, '\x01');  // schema length
  EXPECT_THROW(TensorDict::from_consolidated_file(path("length.bin")), tdshm::SchemaError);
  std::filesystem::copy_file(file, path("cut.bin"));
  std::filesystem::resize_file(path("cut.bin"), size - 3);
  EXPECT_THROW(TensorDict::from_consolidated_file(path("cut.bin")), tdshm::Error);
}

}  // namespace
