// MemoryMappedTensor: tensors whose storage is an mmap of a file.
//
// How it fits together:
//   * Every tensor made here sits on a c10::Storage whose DataPtr carries a `Mapping` context and
//     `release_mapping` as its deleter. Views, slices and copies of the handle share that
//     storage, so the mapping lives until the last of them is gone, and `info()` recognises any
//     of them by comparing the storage's deleter with `release_mapping`.
//   * mmap offsets must be page aligned: a mapping starts at the page floor of the requested
//     offset and the DataPtr points `offset % page` bytes into it. `Mapping::data_offset` is the
//     file offset of the DataPtr's first byte, so a view's file offset is data_offset plus its
//     storage offset in bytes.
//   * Zero-byte tensors cannot be mapped (mmap of length 0 is EINVAL); they get a DataPtr with no
//     data but the same context and deleter, so they are still recognised.
//   * New files are sized with posix_fallocate so that running out of space is an error here,
//     not a SIGBUS on first touch.
//
// Only the ATen headers this file needs are included (no <ATen/ATen.h>): compile time matters.

#include "tdshm/memmap.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <system_error>
#include <utility>
#include <vector>

#include "common/log.h"
#include "memmap/peer_file.h"
#include "tdshm/errors.h"

namespace tdshm {
namespace {

/// Context of one mapping; owned by the DataPtr of the storage that views it.
struct Mapping {
  void* base = nullptr;     // what mmap returned (page aligned); nullptr for a zero-byte tensor
  size_t length = 0;        // bytes passed to mmap
  int fd = -1;              // kept open for an anonymous file only
  std::string filename;     // absolute path; empty when anonymous
  int64_t data_offset = 0;  // file offset of the DataPtr's first byte
  int64_t nbytes = 0;       // bytes of the storage
  bool writable = false;    // MAP_SHARED over a file opened for writing
};

/// The storage deleter: unmaps, closes the anonymous file's descriptor. Never throws.
void release_mapping(void* ctx) noexcept {
  auto* m = static_cast<Mapping*>(ctx);
  if (m->base != nullptr && ::munmap(m->base, m->length) != 0) {
    const int err = errno;
    try {
      detail::log().debug("munmap of {} bytes failed: errno {}", m->length, err);
    } catch (...) {  // logging must not escape a deleter
    }
  }
  if (m->fd >= 0) {
    ::close(m->fd);
  }
  delete m;
}

/// Move-only owner of a file descriptor.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) noexcept : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~FileDescriptor() { reset(); }

  int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset() noexcept {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

 private:
  int fd_ = -1;
};

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string quoted(const std::string& path) { return "'" + path + "'"; }

int64_t page_size() {
  static const int64_t size = ::sysconf(_SC_PAGESIZE);
  return size;
}

/// The absolute form of `path`, so that the name means the same file from any working directory.
std::string absolute_path(const std::string& path) {
  std::error_code ec;
  auto abs = std::filesystem::absolute(path, ec);
  return ec ? path : abs.lexically_normal().string();
}

void check_dtype(c10::ScalarType dtype, const char* where) {
  if (dtype == c10::ScalarType::Undefined || c10::isQIntType(dtype)) {
    throw TypeError(std::string("MemoryMappedTensor::") + where + ": dtype " + c10::toString(dtype) +
                    " cannot be memory-mapped; use a plain numeric or bool dtype");
  }
}

/// numel * itemsize of a contiguous `shape`, checked for negative sizes and overflow.
int64_t byte_size(at::IntArrayRef shape, c10::ScalarType dtype, const char* where) {
  int64_t numel = 1;
  for (const int64_t dim : shape) {
    if (dim < 0) {
      throw MemmapError(std::string("MemoryMappedTensor::") + where + ": shape " + c10::str(shape) +
                        " has a negative size; every size must be >= 0");
    }
    if (__builtin_mul_overflow(numel, dim, &numel)) {
      throw MemmapError(std::string("MemoryMappedTensor::") + where + ": shape " + c10::str(shape) +
                        " has more elements than fit in int64");
    }
  }
  int64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(dtype)), &nbytes)) {
    throw MemmapError(std::string("MemoryMappedTensor::") + where + ": shape " + c10::str(shape) +
                      " of " + c10::toString(dtype) + " has more bytes than fit in int64");
  }
  return nbytes;
}

/// Gives the file `nbytes` of real blocks (so a full filesystem fails here, not with a SIGBUS
/// later). `path` is only for messages.
void reserve(int fd, int64_t nbytes, const std::string& path) {
  if (nbytes == 0) {
    return;
  }
  int rc = 0;
  do {
    rc = ::posix_fallocate(fd, 0, nbytes);
  } while (rc == EINTR);
  if (rc == EOPNOTSUPP || rc == EINVAL) {
    // The filesystem cannot preallocate: a sparse file is the best it offers.
    rc = ::ftruncate(fd, nbytes) == 0 ? 0 : errno;
  }
  if (rc != 0) {
    throw MemmapError("MemoryMappedTensor: cannot reserve " + std::to_string(nbytes) + " bytes for " +
                      quoted(path) + ": " + errno_text(rc) +
                      "; free space on that filesystem or choose a file elsewhere");
  }
}

/// A new file of `nbytes` for writing. Named: created (or truncated) at `filename`. Anonymous:
/// made with mkstemp in /dev/shm when it has room, else $TMPDIR, else /tmp, and unlinked at once.
FileDescriptor create_file(const std::string& filename, int64_t nbytes) {
  if (!filename.empty()) {
    FileDescriptor fd(::open(filename.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (fd.get() < 0) {
      const int err = errno;
      throw MemmapError("MemoryMappedTensor: cannot create " + quoted(filename) + ": " + errno_text(err) +
                        "; check that its directory exists and is writable");
    }
    try {
      reserve(fd.get(), nbytes, filename);
    } catch (...) {
      ::unlink(filename.c_str());  // do not leave a truncated, half-sized file behind
      throw;
    }
    return fd;
  }

  std::vector<std::string> dirs;
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) == 0 &&
      static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize >= static_cast<unsigned long long>(nbytes)) {
    dirs.emplace_back("/dev/shm");
  }
  if (const char* tmpdir = std::getenv("TMPDIR"); tmpdir != nullptr && *tmpdir != '\0') {
    dirs.emplace_back(tmpdir);
  }
  dirs.emplace_back("/tmp");

  std::string tried;
  for (const std::string& dir : dirs) {
    std::string name = dir + "/tdshm-mm-XXXXXX";
    FileDescriptor fd(::mkostemp(name.data(), O_CLOEXEC));
    if (fd.get() < 0) {
      const int err = errno;
      tried += (tried.empty() ? "" : ", ") + quoted(dir) + " (" + errno_text(err) + ")";
      continue;
    }
    ::unlink(name.c_str());  // anonymous from now on: nothing to clean up, even after a crash
    reserve(fd.get(), nbytes, name + " (anonymous)");
    return fd;
  }
  throw MemmapError("MemoryMappedTensor: cannot create an anonymous file in " + tried +
                    "; set TMPDIR to a writable directory");
}

/// Maps `nbytes` at file offset `offset` of `fd` and wraps them in a contiguous tensor.
/// `keep_fd`: the descriptor moves into the mapping (anonymous files); otherwise it is closed.
at::Tensor map_file(FileDescriptor fd, bool keep_fd, const std::string& filename, bool writable,
                    c10::ScalarType dtype, at::IntArrayRef shape, int64_t offset, int64_t nbytes,
                    const std::string& name_for_errors) {
  auto mapping = std::make_unique<Mapping>();
  mapping->filename = filename;
  mapping->data_offset = offset;
  mapping->nbytes = nbytes;
  mapping->writable = writable;

  void* data = nullptr;
  if (nbytes > 0) {
    const int64_t aligned = offset - offset % page_size();
    const auto length = static_cast<size_t>(offset - aligned + nbytes);
    // kReadOnly maps MAP_PRIVATE but still with PROT_WRITE: writes to the tensor are then
    // copy-on-write, private to this process, instead of a segmentation fault.
    void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, writable ? MAP_SHARED : MAP_PRIVATE, fd.get(),
                        static_cast<off_t>(aligned));
    if (base == MAP_FAILED) {
      const int err = errno;
      throw MemmapError("MemoryMappedTensor: cannot map " + std::to_string(nbytes) + " bytes at offset " +
                        std::to_string(offset) + " of " + quoted(name_for_errors) + ": " + errno_text(err) +
                        "; check the address-space and memory limits (ulimit -v, vm.max_map_count)");
    }
    mapping->base = base;
    mapping->length = length;
    data = static_cast<char*>(base) + (offset - aligned);
  }
  if (keep_fd) {
    mapping->fd = fd.release();
  }

  // From here the DataPtr owns the mapping, whatever throws.
  c10::DataPtr data_ptr(data, mapping.release(), &release_mapping, c10::Device(c10::DeviceType::CPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes), std::move(data_ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                          caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  detail::log().debug("mapped {} bytes at offset {} of '{}'", nbytes, offset, name_for_errors);
  return t;
}

/// A new writable mapping of numel * itemsize bytes in a new file.
at::Tensor create_mapping(at::IntArrayRef shape, c10::ScalarType dtype, const std::string& filename,
                          const char* where) {
  check_dtype(dtype, where);
  const int64_t nbytes = byte_size(shape, dtype, where);
  FileDescriptor fd = create_file(filename, nbytes);
  const bool anonymous = filename.empty();
  return map_file(std::move(fd), /*keep_fd=*/anonymous, anonymous ? std::string() : absolute_path(filename),
                  /*writable=*/true, dtype, shape, /*offset=*/0, nbytes, anonymous ? "(anonymous)" : filename);
}

}  // namespace

MemoryMappedTensor MemoryMappedTensor::from_tensor(const at::Tensor& t, const std::string& filename) {
  if (!t.defined()) {
    throw TypeError("MemoryMappedTensor::from_tensor: the tensor is undefined; pass a CPU tensor");
  }
  if (!t.device().is_cpu() || t.layout() != c10::kStrided || t.is_quantized()) {
    throw TypeError("MemoryMappedTensor::from_tensor: only dense CPU tensors can be memory-mapped, got " +
                    c10::str(t.device()) + " " + c10::str(t.layout()) + " " + c10::toString(t.scalar_type()) +
                    "; move it with .cpu() (or .to_dense()) first");
  }
  MemoryMappedTensor mm(create_mapping(t.sizes(), t.scalar_type(), filename, "from_tensor"));
  const c10::NoGradGuard no_grad;  // the copy is data, not part of any graph
  mm.tensor_.copy_(t);             // any strides: copy_ writes the destination in row-major order
  return mm;
}

MemoryMappedTensor MemoryMappedTensor::from_filename(const std::string& path, c10::ScalarType dtype,
                                                     at::IntArrayRef shape, int64_t offset, MemmapMode mode) {
  check_dtype(dtype, "from_filename");
  const int64_t nbytes = byte_size(shape, dtype, "from_filename");
  if (offset < 0) {
    throw MemmapError("MemoryMappedTensor::from_filename: negative offset " + std::to_string(offset) + " into " +
                      quoted(path) + "; offsets count bytes from the start of the file");
  }
  int64_t end = 0;
  if (__builtin_add_overflow(offset, nbytes, &end)) {
    throw MemmapError("MemoryMappedTensor::from_filename: offset " + std::to_string(offset) + " + " +
                      std::to_string(nbytes) + " bytes overflows for " + quoted(path));
  }

  const bool writable = mode == MemmapMode::kReadWrite;
  FileDescriptor fd(::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    std::string hint = "; check the path";
    if (err == EACCES || err == EPERM || err == EROFS || err == ETXTBSY || err == EISDIR) {
      hint = writable ? "; it cannot be opened for writing: open it with MemmapMode::kReadOnly or fix its permissions"
                      : "; check its permissions";
    }
    throw MemmapError("MemoryMappedTensor::from_filename: cannot open " + quoted(path) +
                      (writable ? " for reading and writing: " : " for reading: ") + errno_text(err) + hint);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    const int err = errno;
    throw MemmapError("MemoryMappedTensor::from_filename: cannot stat " + quoted(path) + ": " + errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    throw MemmapError("MemoryMappedTensor::from_filename: " + quoted(path) +
                      " is not a regular file; only regular files can be memory-mapped");
  }
  if (st.st_size < end) {
    throw MemmapError("MemoryMappedTensor::from_filename: " + quoted(path) + " holds " +
                      std::to_string(st.st_size) + " bytes, but " + std::to_string(nbytes) + " bytes (" +
                      c10::str(shape) + " x " + c10::toString(dtype) + ") at offset " + std::to_string(offset) +
                      " need " + std::to_string(end) + "; check the dtype, shape and offset");
  }
  return MemoryMappedTensor(map_file(std::move(fd), /*keep_fd=*/false, absolute_path(path), writable, dtype, shape,
                                     offset, nbytes, path));
}

MemoryMappedTensor MemoryMappedTensor::empty(at::IntArrayRef shape, c10::ScalarType dtype,
                                             const std::string& filename) {
  return MemoryMappedTensor(create_mapping(shape, dtype, filename, "empty"));
}

MemoryMappedTensor MemoryMappedTensor::zeros(at::IntArrayRef shape, c10::ScalarType dtype,
                                             const std::string& filename) {
  // A freshly created (or truncated) file reads as zeros, and zero bits are the value zero of
  // every dtype: no fill needed, and untouched pages stay unallocated in memory.
  return MemoryMappedTensor(create_mapping(shape, dtype, filename, "zeros"));
}

MemoryMappedTensor MemoryMappedTensor::ones(at::IntArrayRef shape, c10::ScalarType dtype,
                                            const std::string& filename) {
  return full(shape, 1, dtype, filename);
}

MemoryMappedTensor MemoryMappedTensor::full(at::IntArrayRef shape, const at::Scalar& value, c10::ScalarType dtype,
                                            const std::string& filename) {
  MemoryMappedTensor mm(create_mapping(shape, dtype, filename, "full"));
  mm.tensor_.fill_(value);
  return mm;
}

MemoryMappedTensor MemoryMappedTensor::from_mapped(const at::Tensor& t) {
  if (!info(t)) {
    throw TypeError(
        "MemoryMappedTensor::from_mapped: the tensor is not backed by a tdshm memory-mapped file; "
        "copy it into one with MemoryMappedTensor::from_tensor");
  }
  return MemoryMappedTensor(t);
}

std::optional<MemmapInfo> MemoryMappedTensor::info(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return std::nullopt;
  }
  const c10::Storage& storage = t.storage();
  const auto* mapping = storage.data_ptr().cast_context<Mapping>(&release_mapping);
  if (mapping == nullptr) {
    return std::nullopt;
  }
  MemmapInfo out;
  out.filename = mapping->filename;
  out.offset = mapping->data_offset + t.storage_offset() * static_cast<int64_t>(t.itemsize());
  out.file_bytes = mapping->nbytes;
  out.writable = mapping->writable;
  out.fd = mapping->fd;
  return out;
}

bool MemoryMappedTensor::is_mapped(const at::Tensor& t) noexcept {
  if (!t.defined()) return false;
  // Without the (virtual) has_storage() and storage()'s checks: a tensor whose storage may not be
  // accessed (sparse, nested) has a null one here.
  const c10::Storage& storage = t.unsafeGetTensorImpl()->unsafe_storage();
  return storage && storage.data_ptr().get_deleter() == &release_mapping;
}

std::string MemoryMappedTensor::filename() const {
  auto i = info(tensor_);
  return i ? i->filename : std::string();
}

int64_t MemoryMappedTensor::offset() const {
  auto i = info(tensor_);
  return i ? i->offset : 0;
}

namespace detail {

at::Tensor map_peer_file(const std::string& path, c10::ScalarType dtype, c10::IntArrayRef shape, int64_t offset,
                         bool writable) {
  check_dtype(dtype, "from a peer's file");
  const int64_t nbytes = byte_size(shape, dtype, "from a peer's file");
  int64_t end = 0;
  if (offset < 0 || __builtin_add_overflow(offset, nbytes, &end)) {
    throw MemmapError("the peer's file " + quoted(path) + ": offset " + std::to_string(offset) + " is out of range");
  }
  std::string problem;
  FileDescriptor fd(open_peer_file(path, writable, problem));
  if (fd.get() < 0) throw MemmapError("the peer's file " + quoted(path) + ": " + problem);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || st.st_size < end) {
    throw MemmapError("the peer's file " + quoted(path) + " holds " + std::to_string(st.st_size) + " bytes, but " +
                      std::to_string(end) + " are needed");
  }
  return map_file(std::move(fd), /*keep_fd=*/false, path, writable, dtype, shape, offset, nbytes, path);
}

}  // namespace detail

}  // namespace tdshm
