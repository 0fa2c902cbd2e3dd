// Writing pickles: dumps(), protocol 4 byte for byte as CPython's C pickler writes it.

#include "pickle/pickle.h"

#include "pickle/pickle_internal.h"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace tdshm::pickle {

namespace {

using detail::bad_utf8_at;
using detail::fail;
namespace op = detail::op;

// CPython's framing constants (protocol 4's frames).
constexpr size_t kFrameHeaderBytes = 9;
constexpr size_t kFrameSizeMin = 4;
constexpr size_t kFrameSizeTarget = 64 * 1024;
constexpr size_t kBatchSize = 1000;

class Pickler {
 public:
  std::vector<uint8_t> run(const PyValue& value) {
    out_ = {op::PROTO, 4};
    save(value, 0);
    write1(op::STOP);
    commit_frame();
    return std::move(out_);
  }

 private:
  static constexpr size_t kNoFrame = std::numeric_limits<size_t>::max();

  void ensure_frame() {
    if (frame_start_ == kNoFrame) {
      frame_start_ = out_.size();
      out_.resize(out_.size() + kFrameHeaderBytes);
    }
  }
  // A frame of at least kFrameSizeMin bytes gets its FRAME header; a shorter one is written
  // bare (its reserved header bytes are dropped), as CPython does.
  void commit_frame() {
    if (frame_start_ == kNoFrame) return;
    const size_t len = out_.size() - frame_start_ - kFrameHeaderBytes;
    if (len >= kFrameSizeMin) {
      out_[frame_start_] = op::FRAME;
      for (size_t i = 0; i < 8; ++i) out_[frame_start_ + 1 + i] = static_cast<uint8_t>(uint64_t{len} >> (8 * i));
    } else {
      out_.erase(out_.begin() + static_cast<std::ptrdiff_t>(frame_start_),
                 out_.begin() + static_cast<std::ptrdiff_t>(frame_start_ + kFrameHeaderBytes));
    }
    frame_start_ = kNoFrame;
  }
  void write1(uint8_t b) {
    ensure_frame();
    out_.push_back(b);
  }
  void write(const uint8_t* data, size_t n) {
    ensure_frame();
    out_.insert(out_.end(), data, data + n);
  }
  void write_le(uint64_t v, size_t n) {
    uint8_t buf[8];
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<uint8_t>(v >> (8 * i));
    write(buf, n);
  }
  // A str or bytes payload: from kFrameSizeTarget bytes on, CPython ends the current frame and
  // writes header and payload outside any frame.
  void write_payload(const uint8_t* header, size_t header_len, std::string_view payload) {
    if (payload.size() >= kFrameSizeTarget) {
      commit_frame();
      out_.insert(out_.end(), header, header + header_len);
      out_.insert(out_.end(), payload.begin(), payload.end());
    } else {
      write(header, header_len);
      write(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    }
  }
  void sized_header(std::string_view payload, uint8_t op1, uint8_t op4, uint8_t op8) {
    uint8_t header[9];
    size_t header_len = 0;
    const uint64_t n = payload.size();
    if (n <= 0xff) {
      header[0] = op1;
      header[1] = static_cast<uint8_t>(n);
      header_len = 2;
    } else if (n <= 0xffffffffu) {
      header[0] = op4;
      for (size_t i = 0; i < 4; ++i) header[1 + i] = static_cast<uint8_t>(n >> (8 * i));
      header_len = 5;
    } else {
      header[0] = op8;
      for (size_t i = 0; i < 8; ++i) header[1 + i] = static_cast<uint8_t>(n >> (8 * i));
      header_len = 9;
    }
    write_payload(header, header_len, payload);
    write1(op::MEMOIZE);
  }

  void save_int(int64_t v) {
    if (v >= 0 && v <= 0xff) {
      write1(op::BININT1);
      write_le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v <= 0xffff) {
      write1(op::BININT2);
      write_le(static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      write1(op::BININT);
      write_le(static_cast<uint64_t>(v), 4);
    } else {
      // The shortest two's-complement little-endian form (what CPython's save_long writes).
      size_t n = 8;
      const auto u = static_cast<uint64_t>(v);
      while (n > 1) {
        const auto top = static_cast<uint8_t>(u >> (8 * (n - 1)));
        const bool next_sign = ((u >> (8 * (n - 1) - 1)) & 1) != 0;
        if ((top == 0x00 && !next_sign) || (top == 0xff && next_sign)) {
          --n;
        } else {
          break;
        }
      }
      write1(op::LONG1);
      write_le(n, 1);
      write_le(u, n);
    }
  }

  static void check_hashable(const PyValue& key, size_t depth) {
    if (depth > kDumpsMaxDepth) fail("dumps: a dict key is nested deeper than ", kDumpsMaxDepth, " levels");
    switch (key.kind()) {
      case PyKind::kList:
      case PyKind::kDict:
        fail("dumps: unhashable type '", type_name(key), "' as a dict key");
      case PyKind::kTuple:
        for (const auto& item : std::get<PyTuple>(key.v).items) check_hashable(item, depth + 1);
        return;
      default:
        return;
    }
  }

  void save(const PyValue& value, size_t depth) {
    if (depth > kDumpsMaxDepth) fail("dumps: the value is nested deeper than ", kDumpsMaxDepth, " levels");
    // CPython ends a frame once it holds kFrameSizeTarget bytes, at the start of an object.
    if (frame_start_ != kNoFrame && out_.size() - frame_start_ - kFrameHeaderBytes >= kFrameSizeTarget) commit_frame();
    switch (value.kind()) {
      case PyKind::kNone:
        write1(op::NONE);
        return;
      case PyKind::kBool:
        write1(std::get<bool>(value.v) ? op::NEWTRUE : op::NEWFALSE);
        return;
      case PyKind::kInt:
        save_int(std::get<int64_t>(value.v));
        return;
      case PyKind::kFloat: {
        const auto bits = std::bit_cast<uint64_t>(std::get<double>(value.v));
        uint8_t buf[9] = {op::BINFLOAT};
        for (size_t i = 0; i < 8; ++i) buf[1 + i] = static_cast<uint8_t>(bits >> (8 * (7 - i)));  // big-endian
        write(buf, sizeof buf);
        return;
      }
      case PyKind::kStr: {
        const auto& s = std::get<std::string>(value.v);
        if (const size_t at = bad_utf8_at(s); at != std::string_view::npos) {
          fail("dumps: str of ", s.size(), " bytes is not valid UTF-8 (byte ", at, ")");
        }
        sized_header(s, op::SHORT_BINUNICODE, op::BINUNICODE, op::BINUNICODE8);
        return;
      }
      case PyKind::kBytes:
        sized_header(std::get<PyBytes>(value.v).data, op::SHORT_BINBYTES, op::BINBYTES, op::BINBYTES8);
        return;
      case PyKind::kList: {
        const auto& items = std::get<PyList>(value.v).items;
        write1(op::EMPTY_LIST);
        write1(op::MEMOIZE);
        if (items.size() == 1) {
          save(items[0], depth + 1);
          write1(op::APPEND);
        } else if (items.size() > 1) {
          // Batches of kBatchSize, as batch_list_exact in Modules/_pickle.c.
          size_t total = 0;
          do {
            write1(op::MARK);
            for (size_t n = 0; n < kBatchSize && total < items.size(); ++n) save(items[total++], depth + 1);
            write1(op::APPENDS);
          } while (total < items.size());
        }
        return;
      }
      case PyKind::kTuple: {
        const auto& items = std::get<PyTuple>(value.v).items;
        if (items.empty()) {
          write1(op::EMPTY_TUPLE);
          return;
        }
        if (items.size() <= 3) {
          for (const auto& item : items) save(item, depth + 1);
          write1(static_cast<uint8_t>(op::TUPLE1 + items.size() - 1));
        } else {
          write1(op::MARK);
          for (const auto& item : items) save(item, depth + 1);
          write1(op::TUPLE);
        }
        write1(op::MEMOIZE);
        return;
      }
      case PyKind::kDict: {
        const auto& entries = std::get<PyDict>(value.v).entries;
        for (const auto& e : entries) check_hashable(e.key, depth + 1);
        write1(op::EMPTY_DICT);
        write1(op::MEMOIZE);
        if (entries.size() == 1) {
          save(entries[0].key, depth + 1);
          save(entries[0].value, depth + 1);
          write1(op::SETITEM);
        } else if (entries.size() > 1) {
          // Batches of kBatchSize, as batch_dict_exact in Modules/_pickle.c (which writes one
          // more, empty, batch when the size is a multiple of kBatchSize).
          size_t total = 0;
          size_t n = 0;
          do {
            write1(op::MARK);
            for (n = 0; n < kBatchSize && total < entries.size(); ++n, ++total) {
              save(entries[total].key, depth + 1);
              save(entries[total].value, depth + 1);
            }
            write1(op::SETITEMS);
          } while (n == kBatchSize);
        }
        return;
      }
      case PyKind::kClassRef: {
        const auto& ref = std::get<PyClassRef>(value.v);
        if (ref.module.empty() || ref.name.empty()) fail("dumps: class reference with an empty module or name");
        save(PyValue::str(ref.module), depth + 1);
        save(PyValue::str(ref.name), depth + 1);
        write1(op::STACK_GLOBAL);
        write1(op::MEMOIZE);
        return;
      }
    }
  }

  std::vector<uint8_t> out_;
  size_t frame_start_ = kNoFrame;
};

}  // namespace

std::vector<uint8_t> dumps(const PyValue& value) { return Pickler().run(value); }

}  // namespace tdshm::pickle
