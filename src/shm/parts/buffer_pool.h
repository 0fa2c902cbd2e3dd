#pragma once
// Process memory for messages that arrive before their receive ("unexpected", engine.h). A fresh
// allocation per early message is what made fan-in slow: a large block comes from mmap or from
// the top of the heap, which glibc hands back to the kernel when it is freed, so every early
// message paid the first touch of its pages again (14-30 us per 4 KiB page measured on the
// development VM; a 2-worker loader spent ~15 % of its samples in page faults). The pool keeps
// freed buffers, by power-of-two size class, and hands them out again with their pages resident.
// What it keeps idle is bounded (kept_limit); beyond that, buffers are freed.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <memory>
#include <vector>

namespace tdshm::shm {

class BufferPool {
 public:
  explicit BufferPool(uint64_t kept_limit) : kept_limit_(kept_limit) {}

  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    uint64_t capacity = 0;
    uint8_t* get() const noexcept { return data.get(); }
  };

  /// A buffer of at least `bytes` bytes (contents undefined).
  Buffer take(uint64_t bytes) {
    const unsigned cls = size_class(bytes);
    if (cls < free_.size() && !free_[cls].empty()) {
      Buffer b = std::move(free_[cls].back());
      free_[cls].pop_back();
      kept_ -= b.capacity;
      return b;
    }
    const uint64_t capacity = uint64_t{1} << cls;
    return {std::make_unique_for_overwrite<uint8_t[]>(capacity), capacity};
  }

  /// Returns a buffer from take() (an empty one is ignored).
  void give_back(Buffer b) {
    if (!b.data) return;
    if (kept_ + b.capacity > kept_limit_) return;  // freed here
    const unsigned cls = size_class(b.capacity);
    if (free_.size() <= cls) free_.resize(cls + 1);
    kept_ += b.capacity;
    free_[cls].push_back(std::move(b));
  }

  /// Bytes held idle in the pool.
  uint64_t kept() const noexcept { return kept_; }

 private:
  // Smallest class 4 KiB (a page): smaller messages share nothing and cost little.
  static unsigned size_class(uint64_t bytes) noexcept {
    return static_cast<unsigned>(std::bit_width(std::max<uint64_t>(bytes, 4096) - 1));
  }

  uint64_t kept_limit_;
  uint64_t kept_ = 0;
  std::vector<std::vector<Buffer>> free_;  // by class: buffers of 2^class bytes
};

}  // namespace tdshm::shm
