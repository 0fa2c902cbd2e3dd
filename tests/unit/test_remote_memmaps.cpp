// The reference table of init_remote's memmap leaves (src/distributed/remote_memmaps.h): what a
// sender puts in it, what a receiver rebuilds, and every malformed table a peer could send,
// refused with a SchemaError before anything is mapped.
//
//   RemoteMemmaps.*   references found, encoded, decoded, storage ranges, rebuilt tree;
//                     hostile tables; a file this rank cannot map

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <filesystem>
#include <string>
#include <vector>

#include "distributed/remote_memmaps.h"
#include "tdshm/errors.h"
#include "tdshm/memmap.h"
#include "tdshm/tensordict.h"

namespace {

using namespace tdshm;
using namespace tdshm::detail;
// Beside sources that use tdshm::shm (one unity batch), whose MemmapReference is the layout's.
using tdshm::detail::MemmapReference;

class RemoteMemmaps : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tdshm-test-refs-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  /// {"x": float [4], "m": memmap int64 [4] of file "m.mm", "anon": anonymous memmap float [4]}.
  TensorDict tree() const {
    return TensorDict({{"x", at::arange(4, at::kFloat)},
                       {"m", MemoryMappedTensor::from_tensor(at::arange(10, 14, at::kLong), path("m.mm")).tensor()},
                       {"anon", MemoryMappedTensor::from_tensor(at::ones({4})).tensor()}},
                      {4});
  }

  std::string dir_;
};

TEST_F(RemoteMemmaps, FindsNamedLeavesAndRebuildsThemAsTheFile) {
  const TensorDict td = tree();
  const Schema schema = td.consolidate().schema();
  const std::vector<MemmapReference> refs = memmap_references(td, schema);
  ASSERT_EQ(refs.size(), 1u) << "only the named memmap: the anonymous one goes by value";
  EXPECT_EQ(refs[0].file, path("m.mm"));
  EXPECT_EQ(refs[0].offset, 0);
  EXPECT_TRUE(refs[0].writable);
  EXPECT_EQ(refs[0].stop - refs[0].start, 4u * sizeof(int64_t));

  const std::vector<MemmapReference> back = decode_references(encode_references(refs), schema);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].file, refs[0].file);
  EXPECT_EQ(back[0].start, refs[0].start);
  EXPECT_EQ(back[0].stop, refs[0].stop);

  // The storage messages: everything but the referenced leaf's bytes.
  const auto ranges = storage_ranges(schema.total_bytes, refs);
  uint64_t sent = 0;
  for (const auto& [from, to] : ranges) {
    EXPECT_TRUE(to <= refs[0].start || from >= refs[0].stop);
    sent += to - from;
  }
  EXPECT_EQ(sent, schema.total_bytes - (refs[0].stop - refs[0].start));

  // The receiver: the storage (its referenced bytes never written: zeros here) and the file.
  at::Tensor storage = td.consolidate().consolidated_storage().clone();
  storage.narrow(0, static_cast<int64_t>(refs[0].start), static_cast<int64_t>(refs[0].stop - refs[0].start)).zero_();
  const TensorDict r = rebuild_with_references(storage, schema, back, /*may_write=*/true);
  EXPECT_TRUE(at::equal(r.get("m"), at::arange(10, 14, at::kLong)));
  EXPECT_TRUE(at::equal(r.get("x"), at::arange(4, at::kFloat)));
  EXPECT_TRUE(at::equal(r.get("anon"), at::ones({4})));
  const auto info = MemoryMappedTensor::info(r.get("m"));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->filename, path("m.mm"));
  EXPECT_FALSE(r.is_consolidated());
  EXPECT_TRUE(r.is_locked());
  EXPECT_TRUE(r.get("x").is_alias_of(storage));
}

TEST_F(RemoteMemmaps, NoReferencesIsOneRangeAndTheConsolidatedTree) {
  const TensorDict td({{"x", at::arange(4, at::kFloat)}}, {4});
  const Schema schema = td.consolidate().schema();
  EXPECT_TRUE(memmap_references(td, schema).empty());
  const auto ranges = storage_ranges(schema.total_bytes, {});
  ASSERT_EQ(ranges.size(), 1u);
  EXPECT_EQ(ranges[0].second, schema.total_bytes);
  EXPECT_TRUE(decode_references(encode_references({}), schema).empty());
}

TEST_F(RemoteMemmaps, HostileTablesAreRefused) {
  const TensorDict td = tree();
  const Schema schema = td.consolidate().schema();
  const MemmapReference good = memmap_references(td, schema).at(0);
  auto refused = [&](std::vector<MemmapReference> refs, const std::string& what) {
    EXPECT_THROW(decode_references(encode_references(refs), schema), SchemaError) << what;
  };
  MemmapReference r = good;
  r.start += 8;
  refused({r}, "not the start of a leaf");
  r = good;
  r.stop += 8;
  refused({r}, "longer than its leaf");
  r = good;
  r.file = "relative/m.mm";
  refused({r}, "a relative path");
  r = good;
  r.file = std::string("/tmp/a\0b", 8);
  refused({r}, "a path with a NUL byte");
  r = good;
  r.offset = -8;
  refused({r}, "a negative offset");
  for (const char* path : {"/tmp/../etc/m.mm", "/tmp/./m.mm", "/tmp/x/..", "/."}) {
    r = good;
    r.file = path;
    refused({r}, std::string("a path with '.' or '..' parts: ") + path);
  }
  r = good;
  r.file = "/" + std::string(5000, 'a');
  refused({r}, "a path past 4096 bytes");
  refused({good, good}, "the same leaf twice");
  refused({good, good, good, good}, "more entries than leaves");

  const at::Tensor ok = encode_references({good});
  at::Tensor bad = ok.clone();
  bad.data_ptr<uint8_t>()[0] = 'X';
  EXPECT_THROW(decode_references(bad, schema), SchemaError) << "magic";
  EXPECT_THROW(decode_references(ok.narrow(0, 0, ok.numel() - 1).clone(), schema), SchemaError) << "truncated";
  EXPECT_THROW(decode_references(at::cat({ok, at::zeros({1}, at::kByte)}), schema), SchemaError) << "trailing bytes";
  EXPECT_THROW(decode_references(at::empty({0}, at::kByte), schema), SchemaError) << "empty";
}

TEST_F(RemoteMemmaps, AFileThisRankCannotMapIsAMemmapErrorNamingTheLeaf) {
  const TensorDict td = tree();
  const Schema schema = td.consolidate().schema();
  MemmapReference r = memmap_references(td, schema).at(0);
  r.file = path("gone.mm");
  const at::Tensor storage = td.consolidate().consolidated_storage();
  try {
    rebuild_with_references(storage, schema, {r}, /*may_write=*/false);
    ADD_FAILURE() << "no error";
  } catch (const MemmapError& e) {
    EXPECT_NE(std::string(e.what()).find("leaf 'm'"), std::string::npos) << e.what();
  }
}

// What a receiver maps for a peer's table (memmap/peer_file.h): no link followed at any level, a
// regular file owned by this user, never a FIFO or a device (refused at once, without blocking
// in open), writable only when the receiver asks. Each refusal is a MemmapError naming the leaf
// and saying why.
TEST_F(RemoteMemmaps, APeersFileIsMappedOnlyUnderTheRules) {
  const TensorDict td = tree();
  const Schema schema = td.consolidate().schema();
  const MemmapReference good = memmap_references(td, schema).at(0);
  const at::Tensor storage = td.consolidate().consolidated_storage();
  auto refused = [&](const std::string& file, const std::string& needle, const std::string& what) {
    MemmapReference r = good;
    r.file = file;
    const auto start = std::chrono::steady_clock::now();
    try {
      rebuild_with_references(storage, schema, {r}, /*may_write=*/false);
      ADD_FAILURE() << what << ": no error";
    } catch (const MemmapError& e) {
      EXPECT_NE(std::string(e.what()).find("leaf 'm'"), std::string::npos) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2)) << what << " took long";
  };
  // The good file's bytes at the same names, through links and as other kinds of files.
  ASSERT_EQ(::symlink(good.file.c_str(), path("link.mm").c_str()), 0);
  refused(path("link.mm"), "symbolic link", "a symbolic link to the file");
  ASSERT_EQ(::mkdir(path("real").c_str(), 0700), 0);
  std::filesystem::copy_file(good.file, path("real/m.mm"));
  ASSERT_EQ(::symlink(path("real").c_str(), path("linked").c_str()), 0);
  refused(path("linked/m.mm"), "'" + path("linked") + "' is a symbolic link", "a directory on the way is a link");
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  refused(path("fifo"), "a FIFO", "a FIFO nobody writes to");
  refused("/dev/zero", "a character device", "a device");
  refused(path("real"), "a directory", "a directory");
  refused(path("missing.mm"), "cannot open it", "a missing file");
  {
    std::ofstream(path("short.mm")) << "12";
    refused(path("short.mm"), "holds 2 bytes", "a file shorter than the leaf");
  }
  if (::geteuid() == 0) {  // a file of another user can only be made by root
    std::filesystem::copy_file(good.file, path("other.mm"));
    ASSERT_EQ(::chown(path("other.mm").c_str(), 65534, 65534), 0);
    refused(path("other.mm"), "owned by uid 65534", "another user's file");
  }
  // The same file through its own path maps, read-only unless the receiver asked to write.
  MemmapReference r = good;
  r.file = path("real/m.mm");
  ASSERT_TRUE(r.writable) << "the sender's memmap is writable";
  {
    const TensorDict got = rebuild_with_references(storage, schema, {r}, /*may_write=*/false);
    const auto info = MemoryMappedTensor::info(got.get("m"));
    ASSERT_TRUE(info.has_value());
    EXPECT_FALSE(info->writable) << "mapped writable though the receiver did not ask";
    EXPECT_TRUE(at::equal(got.get("m"), at::arange(10, 14, at::kLong)));
    got.get("m").fill_(7);  // private to this mapping
    const TensorDict again = rebuild_with_references(storage, schema, {r}, /*may_write=*/false);
    EXPECT_TRUE(at::equal(again.get("m"), at::arange(10, 14, at::kLong))) << "a read-only mapping wrote the file";
  }
  {
    const TensorDict got = rebuild_with_references(storage, schema, {r}, /*may_write=*/true);
    EXPECT_TRUE(MemoryMappedTensor::info(got.get("m"))->writable);
    got.get("m").fill_(9);
    const TensorDict again = rebuild_with_references(storage, schema, {r}, /*may_write=*/false);
    EXPECT_TRUE(at::equal(again.get("m"), at::full({4}, 9, at::kLong))) << "the receiver's write did not reach the file";
  }
  {
    MemmapReference ro = r;
    ro.writable = false;  // the sender's own mapping was read-only: never writable here
    const TensorDict got = rebuild_with_references(storage, schema, {ro}, /*may_write=*/true);
    EXPECT_FALSE(MemoryMappedTensor::info(got.get("m"))->writable);
  }
}

// The sender names its file by its canonical path: a memmap made through a linked directory is
// sent as the real file, which the receiver's rules accept.
TEST_F(RemoteMemmaps, TheSenderNamesTheCanonicalPath) {
  ASSERT_EQ(::mkdir(path("real").c_str(), 0700), 0);
  ASSERT_EQ(::symlink(path("real").c_str(), path("linked").c_str()), 0);
  const TensorDict td({{"m", MemoryMappedTensor::from_tensor(at::arange(4, at::kLong), path("linked/m.mm")).tensor()}},
                      {4});
  const Schema schema = td.consolidate().schema();
  const std::vector<MemmapReference> refs = memmap_references(td, schema);
  ASSERT_EQ(refs.size(), 1u);
  EXPECT_EQ(refs[0].file, std::filesystem::canonical(path("real/m.mm")).string());
  const TensorDict got =
      rebuild_with_references(td.consolidate().consolidated_storage(), schema, refs, /*may_write=*/false);
  EXPECT_TRUE(at::equal(got.get("m"), at::arange(4, at::kLong)));
}

}  // namespace
