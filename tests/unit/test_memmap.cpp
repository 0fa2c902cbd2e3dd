// Tests of MemoryMappedTensor: round trips through files, offsets, lifetime of the mapping,
// sharing across fork(), read-only copy-on-write, and the errors callers can act on.
//
// Every test works in its own directory (mkdtemp under /dev/shm, else /tmp), removed in TearDown.
// Fork tests keep the child to raw pointer loads and stores (no ATen calls that could start
// thread pools), and the parent waits with a deadline and kills a child that overstays.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tdshm/errors.h"
#include "tdshm/memmap.h"

namespace {

using tdshm::MemmapError;
using tdshm::MemmapMode;
using tdshm::MemoryMappedTensor;

namespace fs = std::filesystem;

/// The whole content of a file (also of /proc files, whose size is not known in advance).
std::vector<char> read_bytes(const std::string& path) {
  std::vector<char> out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  ::close(fd);
  return out;
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The bytes of `t` in row-major order.
std::vector<char> tensor_bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const char*>(c.data_ptr());
  return {p, p + c.nbytes()};
}

std::string read_text(const std::string& path) {
  const std::vector<char> bytes = read_bytes(path);
  return {bytes.begin(), bytes.end()};
}

/// Target of /proc/self/fd/<fd>, or "" if the descriptor is not open.
std::string fd_target(int fd) {
  std::error_code ec;
  auto target = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
  return ec ? std::string() : target.string();
}

/// Waits for `pid` to exit, at most `timeout`; kills it if it overstays. Returns its exit code,
/// 128 + signal if it was killed by a signal, or -1 on timeout.
int wait_for_child(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (r < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

/// Expects `fn` to throw E whose message names `path`.
template <typename E, typename Fn>
void expect_error_naming(Fn&& fn, const std::string& path) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception naming " << path;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << "message: " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

at::Tensor sample(c10::ScalarType dtype, at::IntArrayRef shape) {
  const at::Tensor base = at::arange(c10::multiply_integers(shape), at::kLong).reshape(shape);
  if (dtype == at::kBool) return (base % 3 == 0);
  if (dtype == at::kChar) return (base - 7).to(dtype);
  if (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16) {
    return (base.to(at::kDouble) * 0.5 - 3.25).to(dtype);
  }
  return base.to(dtype);
}

class MemmapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* root : {"/dev/shm", "/tmp"}) {
      std::string tmpl = std::string(root) + "/tdshm-test-mm-XXXXXX";
      if (::mkdtemp(tmpl.data()) != nullptr) {
        dir_ = tmpl;
        break;
      }
    }
    ASSERT_FALSE(dir_.empty()) << "cannot create a temporary directory";
  }
  void TearDown() override {
    if (!dir_.empty()) {
      std::error_code ec;
      fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
      fs::remove_all(dir_, ec);
    }
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
};

using MemmapFromTensor = MemmapTest;
using MemmapFromFilename = MemmapTest;
using MemmapFactories = MemmapTest;
using MemmapLifetime = MemmapTest;
using MemmapFork = MemmapTest;
using MemmapErrors = MemmapTest;
using MemmapZeroSize = MemmapTest;

// ---------------------------------------------------------------------------------------------
// from_tensor

TEST_F(MemmapFromTensor, RoundTripsEveryDtype) {
  const std::vector<c10::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kChar,     at::kByte,
                                               at::kBool,  at::kLong,   at::kInt,      at::kShort,
                                               at::kHalf,  at::kBFloat16, at::kComplexFloat};
  for (const auto dtype : dtypes) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor src = sample(dtype, {2, 3, 4});
    const std::string file = path(std::string("t_") + c10::toString(dtype) + ".bin");
    const auto mm = MemoryMappedTensor::from_tensor(src, file);

    EXPECT_EQ(mm->scalar_type(), dtype);
    EXPECT_EQ(mm->sizes(), src.sizes());
    EXPECT_TRUE(mm->is_contiguous());
    EXPECT_TRUE(mm->equal(src));
    EXPECT_EQ(mm.filename(), file);
    EXPECT_EQ(mm.offset(), 0);
    EXPECT_EQ(fs::file_size(file), src.nbytes());
    EXPECT_EQ(read_bytes(file), tensor_bytes(src));  // the bytes really are in the file

    const auto info = MemoryMappedTensor::info(mm);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->filename, file);
    EXPECT_EQ(info->offset, 0);
    EXPECT_EQ(info->file_bytes, static_cast<int64_t>(src.nbytes()));
    EXPECT_TRUE(info->writable);
    EXPECT_EQ(info->fd, -1);

    const auto again = MemoryMappedTensor::from_filename(file, dtype, src.sizes());
    EXPECT_TRUE(again->equal(src));
  }
}

TEST_F(MemmapFromTensor, NonContiguousSourceIsWrittenRowMajor) {
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  const std::vector<at::Tensor> sources = {base.t(), base.slice(1, 1, 6, 2), base.expand({2, 4, 6}),
                                           base.flip({0})};
  for (size_t i = 0; i < sources.size(); ++i) {
    SCOPED_TRACE(i);
    const at::Tensor& src = sources[i];
    const std::string file = path("nc_" + std::to_string(i) + ".bin");
    const auto mm = MemoryMappedTensor::from_tensor(src, file);
    EXPECT_TRUE(mm->is_contiguous());
    EXPECT_EQ(mm->sizes(), src.sizes());
    EXPECT_TRUE(mm->equal(src));
    EXPECT_EQ(read_bytes(file), tensor_bytes(src));
    EXPECT_EQ(fs::file_size(file), static_cast<uintmax_t>(src.numel()) * sizeof(float));
  }
}

TEST_F(MemmapFromTensor, ZeroDimTensor) {
  const at::Tensor src = at::scalar_tensor(2.5, at::kDouble);
  const auto mm = MemoryMappedTensor::from_tensor(src, path("scalar.bin"));
  EXPECT_EQ(mm->dim(), 0);
  EXPECT_EQ(mm->item<double>(), 2.5);
  EXPECT_EQ(fs::file_size(path("scalar.bin")), sizeof(double));
}

TEST_F(MemmapFromTensor, ReplacesAnExistingFile) {
  const std::string file = path("old.bin");
  write_bytes(file, std::vector<char>(1000, 'x'));
  const at::Tensor src = at::arange(4, at::kInt);
  const auto mm = MemoryMappedTensor::from_tensor(src, file);
  EXPECT_EQ(fs::file_size(file), 16u);
  EXPECT_EQ(read_bytes(file), tensor_bytes(src));
}

TEST_F(MemmapFromTensor, CopiesDataNotGraph) {
  const at::Tensor src = at::ones({3}, at::kFloat).requires_grad_();
  const auto mm = MemoryMappedTensor::from_tensor(src, path("grad.bin"));
  EXPECT_FALSE(mm->requires_grad());
  EXPECT_TRUE(mm->equal(src.detach()));
}

TEST_F(MemmapFromTensor, AnonymousRoundTrip) {
  const at::Tensor src = sample(at::kLong, {5, 7});
  const auto mm = MemoryMappedTensor::from_tensor(src);
  EXPECT_TRUE(mm->equal(src));
  EXPECT_EQ(mm.filename(), "");
  const auto info = MemoryMappedTensor::info(mm);
  ASSERT_TRUE(info.has_value());
  EXPECT_GE(info->fd, 0);
  EXPECT_EQ(info->file_bytes, static_cast<int64_t>(src.nbytes()));
}

TEST_F(MemmapFromTensor, WritesThroughTheTensorReachTheFile) {
  const std::string file = path("w.bin");
  const auto mm = MemoryMappedTensor::from_tensor(at::zeros({8}, at::kFloat), file);
  mm->fill_(4.0);
  EXPECT_EQ(read_bytes(file), tensor_bytes(at::full({8}, 4.0, at::kFloat)));
}

// ---------------------------------------------------------------------------------------------
// from_filename

TEST_F(MemmapFromFilename, ReadsWhatFromTensorWrote) {
  const std::string file = path("a.bin");
  const at::Tensor src = sample(at::kFloat, {3, 4, 5});
  MemoryMappedTensor::from_tensor(src, file);

  const auto same = MemoryMappedTensor::from_filename(file, at::kFloat, {3, 4, 5});
  EXPECT_TRUE(same->equal(src));
  EXPECT_EQ(same.filename(), file);
  EXPECT_EQ(same.offset(), 0);

  const auto flat = MemoryMappedTensor::from_filename(file, at::kFloat, {60});
  EXPECT_TRUE(flat->equal(src.reshape({60})));

  const auto prefix = MemoryMappedTensor::from_filename(file, at::kFloat, {2, 5});  // less than the file
  EXPECT_TRUE(prefix->equal(src.reshape({60}).slice(0, 0, 10).reshape({2, 5})));
}

TEST_F(MemmapFromFilename, UnalignedOffset) {
  const std::string file = path("big.bin");
  const at::Tensor src = at::arange(3000, at::kInt);  // 12000 bytes: almost three pages
  MemoryMappedTensor::from_tensor(src, file);

  // 4116 is past the first page and not page aligned.
  const int64_t first = 1029;
  const auto mm = MemoryMappedTensor::from_filename(file, at::kInt, {10, 10}, first * 4);
  EXPECT_TRUE(mm->equal(src.slice(0, first, first + 100).reshape({10, 10})));
  EXPECT_EQ(mm.offset(), first * 4);
  EXPECT_EQ(MemoryMappedTensor::info(mm)->file_bytes, 400);

  // A byte offset that is not even a multiple of anything.
  const auto bytes = MemoryMappedTensor::from_filename(file, at::kByte, {7}, 4099);
  const std::vector<char> all = tensor_bytes(src);
  ASSERT_EQ(std::memcmp(bytes->data_ptr(), all.data() + 4099, 7), 0);
  EXPECT_EQ(bytes.offset(), 4099);

  // Writes through the unaligned view land at the right place in the file.
  mm->select(0, 0).select(0, 0).fill_(-5);
  const auto check = MemoryMappedTensor::from_filename(file, at::kInt, {3000});
  EXPECT_EQ(check->select(0, first).item<int>(), -5);
  EXPECT_EQ(check->select(0, first - 1).item<int>(), first - 1);
  EXPECT_EQ(check->select(0, first + 1).item<int>(), first + 1);

  // Read-only mode with an unaligned offset too.
  const auto ro = MemoryMappedTensor::from_filename(file, at::kInt, {3}, (first + 1) * 4, MemmapMode::kReadOnly);
  EXPECT_TRUE(ro->equal(src.slice(0, first + 1, first + 4)));
}

TEST_F(MemmapFromFilename, SecondMappingSeesWrites) {
  const std::string file = path("shared.bin");
  const auto a = MemoryMappedTensor::from_tensor(at::zeros({8}, at::kFloat), file);
  const auto b = MemoryMappedTensor::from_filename(file, at::kFloat, {8});
  ASSERT_NE(a->data_ptr(), b->data_ptr());  // two independent mappings

  a->data_ptr<float>()[3] = 7.0F;
  EXPECT_EQ(b->data_ptr<float>()[3], 7.0F);

  b->slice(0, 4, 8).fill_(2.0);
  EXPECT_TRUE(a->slice(0, 4, 8).equal(at::full({4}, 2.0, at::kFloat)));
}

TEST_F(MemmapFromFilename, ReadOnlyWritesStayPrivate) {
  const std::string file = path("ro.bin");
  const at::Tensor src = at::arange(16, at::kFloat);
  MemoryMappedTensor::from_tensor(src, file);
  const std::vector<char> before = read_bytes(file);

  const auto ro = MemoryMappedTensor::from_filename(file, at::kFloat, {16}, 0, MemmapMode::kReadOnly);
  const auto info = MemoryMappedTensor::info(ro);
  ASSERT_TRUE(info.has_value());
  EXPECT_FALSE(info->writable);
  EXPECT_EQ(info->filename, file);
  EXPECT_TRUE(ro->equal(src));

  ro->fill_(-1.0);  // copy-on-write: allowed, private
  EXPECT_TRUE(ro->equal(at::full({16}, -1.0, at::kFloat)));

  EXPECT_EQ(read_bytes(file), before);
  const auto fresh = MemoryMappedTensor::from_filename(file, at::kFloat, {16});
  EXPECT_TRUE(fresh->equal(src));
}

TEST_F(MemmapFromFilename, ReadOnlyDoesNotNeedAWritableFile) {
  const std::string file = path("ro400.bin");
  MemoryMappedTensor::from_tensor(at::arange(4, at::kLong), file);
  fs::permissions(file, fs::perms::owner_read, fs::perm_options::replace);
  const auto ro = MemoryMappedTensor::from_filename(file, at::kLong, {4}, 0, MemmapMode::kReadOnly);
  EXPECT_TRUE(ro->equal(at::arange(4, at::kLong)));
}

// ---------------------------------------------------------------------------------------------
// empty / zeros / ones / full

TEST_F(MemmapFactories, NamedValues) {
  const auto e = MemoryMappedTensor::empty({2, 3}, at::kFloat, path("e.bin"));
  EXPECT_EQ(e->sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(e->scalar_type(), at::kFloat);
  EXPECT_EQ(fs::file_size(path("e.bin")), 24u);
  EXPECT_EQ(e.filename(), path("e.bin"));

  const auto z = MemoryMappedTensor::zeros({5}, at::kLong, path("z.bin"));
  EXPECT_TRUE(z->equal(at::zeros({5}, at::kLong)));
  EXPECT_EQ(fs::file_size(path("z.bin")), 40u);

  const auto o = MemoryMappedTensor::ones({4}, at::kBool, path("o.bin"));
  EXPECT_TRUE(o->equal(at::ones({4}, at::kBool)));

  const auto f = MemoryMappedTensor::full({3, 2}, 2.5, at::kDouble, path("f.bin"));
  EXPECT_TRUE(f->equal(at::full({3, 2}, 2.5, at::kDouble)));

  const auto i = MemoryMappedTensor::full({6}, 7, at::kInt, path("i.bin"));
  EXPECT_TRUE(i->equal(at::full({6}, 7, at::kInt)));

  const auto dflt = MemoryMappedTensor::ones({2}, c10::ScalarType::Float, path("d.bin"));
  EXPECT_EQ(dflt->scalar_type(), at::kFloat);

  // The values are in the files, not only in this process's view.
  EXPECT_EQ(read_bytes(path("f.bin")), tensor_bytes(at::full({3, 2}, 2.5, at::kDouble)));
  EXPECT_EQ(read_bytes(path("o.bin")), tensor_bytes(at::ones({4}, at::kBool)));
}

TEST_F(MemmapFactories, ZerosOverAnExistingFileReadsZero) {
  const std::string file = path("dirty.bin");
  write_bytes(file, std::vector<char>(256, static_cast<char>(0xff)));
  const auto z = MemoryMappedTensor::zeros({16}, at::kFloat, file);
  EXPECT_TRUE(z->equal(at::zeros({16}, at::kFloat)));
  EXPECT_EQ(fs::file_size(file), 64u);
}

TEST_F(MemmapFactories, AnonymousFilesAreUnlinked) {
  const std::vector<MemoryMappedTensor> all = {
      MemoryMappedTensor::empty({3}),
      MemoryMappedTensor::zeros({3}, at::kInt),
      MemoryMappedTensor::ones({3}, at::kDouble),
      MemoryMappedTensor::full({3}, -2, at::kShort),
  };
  EXPECT_TRUE(all[1]->equal(at::zeros({3}, at::kInt)));
  EXPECT_TRUE(all[2]->equal(at::ones({3}, at::kDouble)));
  EXPECT_TRUE(all[3]->equal(at::full({3}, -2, at::kShort)));
  for (const auto& mm : all) {
    EXPECT_EQ(mm.filename(), "");
    const auto info = MemoryMappedTensor::info(mm);
    ASSERT_TRUE(info.has_value());
    EXPECT_TRUE(info->filename.empty());
    ASSERT_GE(info->fd, 0);
    EXPECT_TRUE(info->writable);

    struct stat st {};
    ASSERT_EQ(::fstat(info->fd, &st), 0);
    EXPECT_EQ(st.st_nlink, 0u);  // no name left in any directory
    EXPECT_EQ(st.st_size, static_cast<off_t>(mm->nbytes()));

    const std::string target = fd_target(info->fd);
    EXPECT_NE(target.find("tdshm-mm-"), std::string::npos) << target;
    const std::string deleted = " (deleted)";
    ASSERT_GT(target.size(), deleted.size());
    EXPECT_EQ(target.substr(target.size() - deleted.size()), deleted);
    EXPECT_FALSE(fs::exists(target.substr(0, target.size() - deleted.size())));
  }
}

TEST_F(MemmapFactories, AnonymousDescriptorClosesWithTheLastView) {
  int fd = -1;
  std::string target;
  at::Tensor view;
  {
    const auto mm = MemoryMappedTensor::zeros({4});
    fd = MemoryMappedTensor::info(mm)->fd;
    target = fd_target(fd);
    view = mm->slice(0, 1, 3);
  }
  EXPECT_EQ(fd_target(fd), target);  // the view keeps it open
  ASSERT_EQ(MemoryMappedTensor::info(view)->fd, fd);
  view.fill_(1.0);
  view.reset();
  EXPECT_NE(fd_target(fd), target);
}

// ---------------------------------------------------------------------------------------------
// lifetime, views, info, from_mapped

TEST_F(MemmapLifetime, SliceOutlivesTheHandle) {
  const std::string file = path("slice.bin");
  at::Tensor slice;
  {
    const auto mm = MemoryMappedTensor::from_tensor(at::arange(10, at::kFloat), file);
    slice = mm->slice(0, 3, 8);
  }
  EXPECT_TRUE(slice.equal(at::arange(3, 8, at::kFloat)));
  slice.data_ptr<float>()[0] = 42.0F;
  slice.select(0, 4).fill_(-1.0);

  const auto info = MemoryMappedTensor::info(slice);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 12);
  EXPECT_EQ(info->filename, file);
  EXPECT_EQ(info->file_bytes, 40);

  const auto check = MemoryMappedTensor::from_filename(file, at::kFloat, {10});
  EXPECT_EQ(check->select(0, 3).item<float>(), 42.0F);
  EXPECT_EQ(check->select(0, 7).item<float>(), -1.0F);
  EXPECT_EQ(check->select(0, 8).item<float>(), 8.0F);
}

TEST_F(MemmapLifetime, DeleterUnmapsWhenTheLastViewDies) {
  const std::string file = path("unmap.bin");
  at::Tensor view;
  {
    const auto mm = MemoryMappedTensor::ones({4096}, at::kFloat, file);
    view = mm->slice(0, 100, 200);
  }
  EXPECT_NE(read_text("/proc/self/maps").find(file), std::string::npos);
  view.reset();
  EXPECT_EQ(read_text("/proc/self/maps").find(file), std::string::npos);
}

TEST_F(MemmapLifetime, InfoOnViews) {
  const std::string file = path("views.bin");
  const auto mm = MemoryMappedTensor::from_tensor(at::arange(20, at::kFloat).reshape({4, 5}), file);
  EXPECT_EQ(MemoryMappedTensor::info(mm->select(0, 2))->offset, 40);
  EXPECT_EQ(MemoryMappedTensor::info(mm->select(1, 2))->offset, 8);
  EXPECT_EQ(MemoryMappedTensor::info(mm->t())->offset, 0);
  EXPECT_EQ(MemoryMappedTensor::info(mm->view({20}).slice(0, 7))->offset, 28);
  EXPECT_EQ(MemoryMappedTensor::info(mm->view(at::kByte).view({80}).slice(0, 5))->offset, 5);

  // Views of a mapping that starts at a non-zero offset add to it.
  const auto off = MemoryMappedTensor::from_filename(file, at::kFloat, {3, 5}, 20);
  EXPECT_EQ(MemoryMappedTensor::info(off->select(0, 1))->offset, 40);
  EXPECT_TRUE(off->select(0, 1).equal(mm->select(0, 2)));
}

TEST_F(MemmapLifetime, PlainTensorsAreNotMapped) {
  EXPECT_FALSE(MemoryMappedTensor::info(at::ones({3})).has_value());
  EXPECT_FALSE(MemoryMappedTensor::info(at::Tensor()).has_value());
  EXPECT_FALSE(MemoryMappedTensor::info(at::empty({0})).has_value());
  const auto mm = MemoryMappedTensor::ones({3}, at::kFloat, path("p.bin"));
  EXPECT_FALSE(MemoryMappedTensor::info(mm->clone()).has_value());  // a copy leaves the file

  EXPECT_THROW(MemoryMappedTensor::from_mapped(at::ones({3})), tdshm::TypeError);
  EXPECT_THROW(MemoryMappedTensor::from_mapped(at::Tensor()), tdshm::TypeError);
}

TEST_F(MemmapLifetime, FromMappedWrapsAView) {
  const std::string file = path("fm.bin");
  at::Tensor slice;
  {
    const auto mm = MemoryMappedTensor::from_tensor(at::arange(10, at::kDouble), file);
    slice = mm->slice(0, 3, 6);
  }
  const auto back = MemoryMappedTensor::from_mapped(slice);
  EXPECT_EQ(back.filename(), file);
  EXPECT_EQ(back.offset(), 24);
  EXPECT_TRUE(back->equal(at::arange(3, 6, at::kDouble)));
  EXPECT_TRUE(back->is_same(slice));
}

TEST_F(MemmapLifetime, HandleCopiesShareTheMapping) {
  const auto a = MemoryMappedTensor::zeros({4}, at::kInt, path("copy.bin"));
  const MemoryMappedTensor b = a;  // NOLINT(performance-unnecessary-copy-initialization): the point
  b->fill_(3);
  const at::Tensor& as_tensor = a;
  EXPECT_TRUE(as_tensor.equal(at::full({4}, 3, at::kInt)));
  EXPECT_EQ(a.tensor().data_ptr(), b.tensor().data_ptr());
}

// ---------------------------------------------------------------------------------------------
// fork

TEST_F(MemmapFork, ChildWritesParentSees) {
  const auto mm = MemoryMappedTensor::zeros({64}, at::kInt, path("fork1.bin"));
  auto* data = mm->data_ptr<int32_t>();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    for (int32_t i = 0; i < 64; ++i) data[i] = i * i;
    ::_exit(0);
  }
  ASSERT_EQ(wait_for_child(pid), 0);
  for (int32_t i = 0; i < 64; ++i) ASSERT_EQ(data[i], i * i) << i;
  EXPECT_TRUE(mm->equal(at::arange(64, at::kInt) * at::arange(64, at::kInt)));
  // And the file has them: another mapping reads the same.
  const auto again = MemoryMappedTensor::from_filename(path("fork1.bin"), at::kInt, {64});
  EXPECT_TRUE(again->equal(mm));
}

TEST_F(MemmapFork, ParentWritesChildSees) {
  const auto mm = MemoryMappedTensor::zeros({64}, at::kLong, path("fork2.bin"));
  auto* data = mm->data_ptr<int64_t>();
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(go[1]);
    char byte = 0;
    if (::read(go[0], &byte, 1) != 1) ::_exit(2);  // the parent writes the values first
    for (int64_t i = 0; i < 64; ++i) {
      if (data[i] != 1000 + i) ::_exit(1);
    }
    ::_exit(0);
  }
  ::close(go[0]);
  for (int64_t i = 0; i < 64; ++i) data[i] = 1000 + i;
  const char byte = 1;
  ASSERT_EQ(::write(go[1], &byte, 1), 1);
  ::close(go[1]);
  EXPECT_EQ(wait_for_child(pid), 0) << "1: the child saw other values; 2: it was not told to look";
}

TEST_F(MemmapFork, AnonymousMappingIsSharedWithChild) {
  const auto mm = MemoryMappedTensor::zeros({16}, at::kFloat);
  auto* data = mm->data_ptr<float>();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    for (int i = 0; i < 16; ++i) data[i] = static_cast<float>(i) + 0.5F;
    ::_exit(0);
  }
  ASSERT_EQ(wait_for_child(pid), 0);
  EXPECT_TRUE(mm->equal(at::arange(16, at::kFloat) + 0.5));
}

// ---------------------------------------------------------------------------------------------
// errors

TEST_F(MemmapErrors, MissingFile) {
  const std::string file = path("missing.bin");
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(file, at::kFloat, {4}); }, file);
  expect_error_naming<MemmapError>(
      [&] { MemoryMappedTensor::from_filename(file, at::kFloat, {4}, 0, MemmapMode::kReadOnly); }, file);
  EXPECT_FALSE(fs::exists(file));  // opening does not create
}

TEST_F(MemmapErrors, FileTooSmall) {
  const std::string file = path("small.bin");
  write_bytes(file, std::vector<char>(15, 'a'));
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(file, at::kFloat, {4}); }, file);
  try {
    MemoryMappedTensor::from_filename(file, at::kFloat, {4});
  } catch (const MemmapError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("15"), std::string::npos) << what;  // what the file holds
    EXPECT_NE(what.find("16"), std::string::npos) << what;  // what was needed
  }
  // The file is untouched by the failed attempt.
  EXPECT_EQ(fs::file_size(file), 15u);
}

TEST_F(MemmapErrors, OffsetPastTheEnd) {
  const std::string file = path("sixteen.bin");
  write_bytes(file, std::vector<char>(16, 'a'));
  EXPECT_NO_THROW(MemoryMappedTensor::from_filename(file, at::kFloat, {4}, 0));
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(file, at::kFloat, {4}, 4); }, file);
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(file, at::kFloat, {1}, 13); }, file);
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(file, at::kFloat, {0}, 17); }, file);
  expect_error_naming<MemmapError>(
      [&] { MemoryMappedTensor::from_filename(file, at::kByte, {1}, 16, MemmapMode::kReadOnly); }, file);
}

TEST_F(MemmapErrors, NegativeOffsetOrSize) {
  const std::string file = path("neg.bin");
  write_bytes(file, std::vector<char>(64, 'a'));
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(file, at::kFloat, {4}, -4); }, file);
  EXPECT_THROW(MemoryMappedTensor::from_filename(file, at::kFloat, {-1}), MemmapError);
  EXPECT_THROW(MemoryMappedTensor::from_filename(file, at::kFloat, {2, -3}), MemmapError);
  EXPECT_THROW(MemoryMappedTensor::empty({2, -3}, at::kFloat, path("neg2.bin")), MemmapError);
  EXPECT_THROW(MemoryMappedTensor::zeros({-1}), MemmapError);
  EXPECT_FALSE(fs::exists(path("neg2.bin")));
}

TEST_F(MemmapErrors, OverflowingSize) {
  const std::string file = path("huge.bin");
  write_bytes(file, std::vector<char>(8, 'a'));
  const int64_t big = int64_t{1} << 40;
  EXPECT_THROW(MemoryMappedTensor::from_filename(file, at::kDouble, {big, big}), MemmapError);
  EXPECT_THROW(MemoryMappedTensor::from_filename(file, at::kByte, {1}, INT64_MAX), MemmapError);
}

TEST_F(MemmapErrors, DirectoryIsNotAFile) {
  // Holds even as root: a directory cannot be opened for writing by anyone.
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(dir_, at::kByte, {1}); }, dir_);
  expect_error_naming<MemmapError>(
      [&] { MemoryMappedTensor::from_filename(dir_, at::kByte, {0}, 0, MemmapMode::kReadOnly); }, dir_);
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::zeros({2}, at::kFloat, dir_); }, dir_);
}

TEST_F(MemmapErrors, NotWritableFile) {
  const std::string file = path("readonly.bin");
  MemoryMappedTensor::from_tensor(at::arange(4, at::kInt), file);
  fs::permissions(file, fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read,
                  fs::perm_options::replace);

  if (::geteuid() != 0) {
    expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_filename(file, at::kInt, {4}); }, file);
    return;
  }
  // Root opens anything: check as an unprivileged user in a child. The child only opens and
  // throws (no mapping, no ATen kernels) and reports through its exit code.
  fs::permissions(dir_, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec,
                  fs::perm_options::replace);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(77);
    try {
      MemoryMappedTensor::from_filename(file, at::kInt, {4});
    } catch (const MemmapError& e) {
      ::_exit(std::string(e.what()).find(file) != std::string::npos ? 0 : 3);
    } catch (...) {
      ::_exit(4);
    }
    ::_exit(5);
  }
  const int code = wait_for_child(pid);
  if (code == 77) GTEST_SKIP() << "cannot drop privileges here to test a non-writable file";
  EXPECT_EQ(code, 0) << "3: message without the path; 4: wrong exception; 5: no exception";
}

TEST_F(MemmapErrors, MissingDirectory) {
  const std::string file = path("no/such/dir/x.bin");
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::from_tensor(at::ones({3}), file); }, file);
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::empty({3}, at::kFloat, file); }, file);
  expect_error_naming<MemmapError>([&] { MemoryMappedTensor::full({3}, 1, at::kFloat, file); }, file);
  EXPECT_FALSE(fs::exists(path("no")));
}

TEST_F(MemmapErrors, UnmappableDtypeOrTensor) {
  EXPECT_THROW(MemoryMappedTensor::empty({2}, c10::ScalarType::QInt8, path("q.bin")), tdshm::TypeError);
  EXPECT_THROW(MemoryMappedTensor::from_tensor(at::Tensor(), path("u.bin")), tdshm::TypeError);
  EXPECT_THROW(MemoryMappedTensor::from_tensor(at::ones({2, 2}).to_sparse(), path("s.bin")), tdshm::TypeError);
}

// ---------------------------------------------------------------------------------------------
// zero-byte tensors

TEST_F(MemmapZeroSize, NamedFromTensor) {
  const std::string file = path("zero.bin");
  const auto mm = MemoryMappedTensor::from_tensor(at::empty({0, 3}, at::kFloat), file);
  EXPECT_EQ(mm->sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(mm->scalar_type(), at::kFloat);
  EXPECT_TRUE(fs::exists(file));
  EXPECT_EQ(fs::file_size(file), 0u);
  const auto info = MemoryMappedTensor::info(mm);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->filename, file);
  EXPECT_EQ(info->offset, 0);
  EXPECT_EQ(info->file_bytes, 0);
  EXPECT_EQ(mm.filename(), file);

  const auto again = MemoryMappedTensor::from_filename(file, at::kFloat, {0, 5});
  EXPECT_EQ(again->numel(), 0);
  EXPECT_TRUE(MemoryMappedTensor::info(again).has_value());
  EXPECT_TRUE(MemoryMappedTensor::info(again->slice(1, 2)).has_value());
}

TEST_F(MemmapZeroSize, Anonymous) {
  const auto mm = MemoryMappedTensor::zeros({0});
  EXPECT_EQ(mm->numel(), 0);
  const auto info = MemoryMappedTensor::info(mm);
  ASSERT_TRUE(info.has_value());
  EXPECT_GE(info->fd, 0);
  EXPECT_TRUE(info->filename.empty());
  EXPECT_EQ(MemoryMappedTensor::full({2, 0}, 3.0).tensor().numel(), 0);
}

TEST_F(MemmapZeroSize, AtTheEndOfAFile) {
  const std::string file = path("end.bin");
  write_bytes(file, std::vector<char>(10, 'a'));
  const auto mm = MemoryMappedTensor::from_filename(file, at::kDouble, {0}, 10);
  EXPECT_EQ(mm.offset(), 10);
}

}  // namespace
