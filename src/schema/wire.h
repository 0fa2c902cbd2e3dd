#pragma once
// Internal: the byte-level tools of the schema codec. A little-endian writer that grows a
// vector, and a bounds-checked reader that throws tdshm::SchemaError (naming the field and
// its byte offset) instead of ever reading past its end. Both speak unsigned LEB128 and
// zigzag LEB128; the reader accepts only the minimal (canonical) encoding, so that every
// accepted input re-encodes to the same bytes.

#include "common/format.h"
#include "tdshm/errors.h"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tdshm::detail::wire {

/// Throws SchemaError whose message is "tdshm schema: " followed by the arguments streamed in
/// order. Pass integers as int/uint64_t, never as (u)int8_t (they would print as characters).
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  tdshm::detail::throw_streamed<SchemaError>("tdshm schema: ", args...);
}

/// The longest LEB128 encoding of a 64-bit value: ceil(64 / 7) bytes.
inline constexpr size_t kMaxLeb128Bytes = 10;

constexpr uint64_t zigzag_encode(int64_t v) noexcept {
  // C++20: >> of a negative value is arithmetic, and signed->unsigned conversion is modular.
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}

constexpr int64_t zigzag_decode(uint64_t u) noexcept {
  return static_cast<int64_t>((u >> 1) ^ (~(u & 1) + 1));
}

/// Appends little-endian fields to a growing buffer. Thread safety: one instance per thread.
class ByteWriter {
 public:
  void u8(uint8_t v) { buf_.push_back(v); }
  void u16(uint16_t v) { put_le(v, 2); }
  void u32(uint32_t v) { put_le(v, 4); }
  void u64(uint64_t v) { put_le(v, 8); }

  /// Unsigned LEB128, minimal length (1 to kMaxLeb128Bytes bytes).
  void uleb(uint64_t v) {
    do {
      auto byte = static_cast<uint8_t>(v & 0x7f);
      v >>= 7;
      if (v != 0) byte |= 0x80;
      buf_.push_back(byte);
    } while (v != 0);
  }

  /// Signed value as zigzag LEB128 (small magnitudes of either sign take few bytes).
  void sleb(int64_t v) { uleb(zigzag_encode(v)); }

  void bytes(std::string_view s) { buf_.insert(buf_.end(), s.begin(), s.end()); }

  /// A length-prefixed byte string: uleb(size) then the bytes.
  void str(std::string_view s) {
    uleb(s.size());
    bytes(s);
  }

  /// Overwrites 4 bytes already written at `offset` (used for the body length).
  void patch_u32(size_t offset, uint32_t v) {
    for (size_t i = 0; i < 4; ++i) buf_.at(offset + i) = static_cast<uint8_t>(v >> (8 * i));
  }

  size_t size() const noexcept { return buf_.size(); }
  std::span<const uint8_t> view() const noexcept { return buf_; }
  std::vector<uint8_t> take() && { return std::move(buf_); }

 private:
  void put_le(uint64_t v, size_t n) {
    for (size_t i = 0; i < n; ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }

  std::vector<uint8_t> buf_;
};

/// Reads little-endian fields from [begin, data.size()) of `data`, checking every read against
/// the end. Offsets in error messages are absolute in `data`. Thread safety: one instance per
/// thread; `data` must outlive the reader.
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> data, size_t begin) : data_(data), pos_(begin) {
    if (begin > data.size()) fail("internal: reader starts at byte ", begin, " past its end ", data.size());
  }

  size_t position() const noexcept { return pos_; }
  size_t remaining() const noexcept { return data_.size() - pos_; }

  /// Throws unless `n` more bytes are available for `field`.
  void need(uint64_t n, const char* field) const {
    if (n > remaining()) {
      fail(field, " at byte ", pos_, " needs ", n, " bytes but only ", remaining(), " remain (truncated or corrupt input)");
    }
  }

  uint8_t u8(const char* field) {
    need(1, field);
    return data_[pos_++];
  }
  uint16_t u16(const char* field) { return static_cast<uint16_t>(get_le(2, field)); }
  uint32_t u32(const char* field) { return static_cast<uint32_t>(get_le(4, field)); }
  uint64_t u64(const char* field) { return get_le(8, field); }

  /// Unsigned LEB128. Throws if it runs past the end, is longer than kMaxLeb128Bytes, does not
  /// fit in 64 bits, or is not minimal (ends in a 0x00 continuation byte).
  uint64_t uleb(const char* field) {
    const size_t at = pos_;
    uint64_t value = 0;
    for (size_t i = 0; i < kMaxLeb128Bytes; ++i) {
      const uint8_t byte = u8(field);
      const uint64_t bits = byte & 0x7f;
      if (i == kMaxLeb128Bytes - 1 && bits > 1) {
        fail(field, " at byte ", at, ": LEB128 value overflows 64 bits");
      }
      value |= bits << (7 * i);
      if ((byte & 0x80) == 0) {
        if (byte == 0 && i > 0) fail(field, " at byte ", at, ": LEB128 value is not minimally encoded");
        return value;
      }
    }
    fail(field, " at byte ", at, ": LEB128 value is longer than ", kMaxLeb128Bytes, " bytes");
  }

  int64_t sleb(const char* field) { return zigzag_decode(uleb(field)); }

  /// The next `n` bytes, as a view into `data`.
  std::string_view bytes(uint64_t n, const char* field) {
    need(n, field);
    std::string_view out(reinterpret_cast<const char*>(data_.data() + pos_), static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return out;
  }

  /// A length-prefixed byte string of at most `max_bytes` bytes.
  std::string_view str(const char* field, uint64_t max_bytes) {
    const size_t at = pos_;
    const uint64_t n = uleb(field);
    if (n > max_bytes) fail(field, " at byte ", at, " has length ", n, ", more than the limit of ", max_bytes, " bytes");
    if (n > remaining()) {
      fail(field, " at byte ", at, " has length ", n, " but only ", remaining(), " bytes remain (truncated or corrupt input)");
    }
    return bytes(n, field);
  }

 private:
  uint64_t get_le(size_t n, const char* field) {
    need(n, field);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(data_[pos_ + i]) << (8 * i);
    pos_ += n;
    return v;
  }

  std::span<const uint8_t> data_;
  size_t pos_;
};

}  // namespace tdshm::detail::wire
