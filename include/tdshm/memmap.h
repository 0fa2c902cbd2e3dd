#pragma once
/// \file
/// MemoryMappedTensor: a CPU tensor backed by a shared mapping (MAP_SHARED) of a file.
///
/// Writes by any process that maps the same file are seen by all of them, including a parent
/// and child after fork(). The mapping lives as long as any tensor viewing it: the storage's
/// deleter unmaps it, so views, slices and copies of the handle keep it alive.
///
/// Without a filename the file is anonymous: it is created in /dev/shm when /dev/shm has room
/// for it (else in $TMPDIR, else /tmp) and unlinked at once, so nothing is left behind even if
/// the process dies; its descriptor stays open while mapped (filename() is empty then).
///
/// Files are sized with posix_fallocate when created, so a full filesystem is a MemmapError at
/// creation, not a SIGBUS on first touch. Zero-byte tensors create the file but map nothing; they
/// are still recognised by info().
///
/// Thread safety: the static functions may be called from any thread; a MemoryMappedTensor is as
/// thread-safe as the at::Tensor it holds (concurrent reads are fine; writes need the caller's
/// synchronisation, across threads and processes alike).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace tdshm {

/// How a file is opened by MemoryMappedTensor::from_filename.
enum class MemmapMode {
  kReadWrite,  ///< writes go to the file and are seen by every process mapping it
  kReadOnly,   ///< the file is opened read-only; writes stay private to this process (copy-on-write)
};

/// Where a memory-mapped tensor's bytes live, as recovered from any tensor viewing the mapping.
struct MemmapInfo {
  std::string filename;      ///< absolute path of the file; empty for an anonymous mapping
  int64_t offset = 0;        ///< byte offset in the file of the tensor's first element
  /// Bytes of the file that the mapping covers, from the mapping's start, which is the file
  /// offset of the tensor's storage (`offset` minus storage_offset() * itemsize()).
  int64_t file_bytes = 0;
  bool writable = false;     ///< MemmapMode::kReadWrite
  int fd = -1;               ///< open descriptor of an anonymous mapping, else -1
};

/// A CPU tensor whose bytes are a shared mapping of a file. Copyable handle, like at::Tensor.
class MemoryMappedTensor {
 public:
  /// Copies `t` (any dtype, any strides; CPU) into a new file of exactly its byte size, or an
  /// anonymous one when `filename` is empty. An existing file is truncated and replaced.
  /// Throws MemmapError if the file cannot be created, sized or mapped (for instance no space);
  /// TypeError if `t` is undefined, quantized, or not a dense CPU tensor.
  static MemoryMappedTensor from_tensor(const at::Tensor& t, const std::string& filename = {});

  /// Maps `dtype` x `shape` (contiguous) at byte `offset` of an existing file. `offset` needs
  /// no alignment (the mapping starts at the page below it). Throws MemmapError if the file is
  /// missing or not a regular file, smaller than offset + numel * itemsize, not writable with
  /// kReadWrite, or if `offset` or a size is negative.
  static MemoryMappedTensor from_filename(const std::string& path, c10::ScalarType dtype,
                                          at::IntArrayRef shape, int64_t offset = 0,
                                          MemmapMode mode = MemmapMode::kReadWrite);

  /// New file (or anonymous when `filename` is empty) of numel * itemsize bytes, contents
  /// unspecified (empty), zero (zeros), one (ones) or `value` (full). An existing file is
  /// truncated and replaced. Throws MemmapError if the file cannot be created, sized or mapped,
  /// or if a size is negative.
  static MemoryMappedTensor empty(at::IntArrayRef shape, c10::ScalarType dtype = c10::ScalarType::Float,
                                  const std::string& filename = {});
  static MemoryMappedTensor zeros(at::IntArrayRef shape, c10::ScalarType dtype = c10::ScalarType::Float,
                                  const std::string& filename = {});
  static MemoryMappedTensor ones(at::IntArrayRef shape, c10::ScalarType dtype = c10::ScalarType::Float,
                                 const std::string& filename = {});
  static MemoryMappedTensor full(at::IntArrayRef shape, const at::Scalar& value,
                                 c10::ScalarType dtype = c10::ScalarType::Float,
                                 const std::string& filename = {});

  /// Wraps a tensor that views a tdshm mapping (for instance a TensorDict leaf that was set
  /// from a MemoryMappedTensor). Throws TypeError if `t` is not backed by such a mapping.
  static MemoryMappedTensor from_mapped(const at::Tensor& t);

  /// Where the bytes of `t` live, if `t` views a tdshm mapping; std::nullopt otherwise.
  static std::optional<MemmapInfo> info(const at::Tensor& t);
  /// Whether `t` views a tdshm mapping (what info() answers, without building its result: a
  /// few instructions, asked of every tensor a transfer sends or receives).
  static bool is_mapped(const at::Tensor& t) noexcept;

  /// The tensor (shares the mapping).
  const at::Tensor& tensor() const noexcept { return tensor_; }
  operator const at::Tensor&() const noexcept { return tensor_; }  // NOLINT: implicit by design
  const at::Tensor* operator->() const noexcept { return &tensor_; }

  /// The file's absolute path; empty for an anonymous mapping.
  std::string filename() const;
  /// Byte offset in the file of the first element.
  int64_t offset() const;

 private:
  explicit MemoryMappedTensor(at::Tensor t) : tensor_(std::move(t)) {}
  at::Tensor tensor_;
};

}  // namespace tdshm
