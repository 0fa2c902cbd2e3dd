#pragma once
// What the files of the pickle codec share: the error helper, the opcodes and the UTF-8 rule.
// pickle_value.cpp holds the value types, pickle_writer.cpp dumps(), pickle_reader.h,
// pickle_reader.cpp and pickle_reader_graph.cpp loads(). Private to src/pickle.

#include "common/format.h"
#include "tdshm/errors.h"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

namespace tdshm::pickle::detail {

static_assert(std::numeric_limits<double>::is_iec559 && sizeof(double) == 8, "BINFLOAT is IEEE-754 binary64");

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  tdshm::detail::throw_streamed<SchemaError>("tdshm pickle: ", args...);
}

// --- opcodes (CPython's pickle protocol) ---------------------------------------------------------
namespace op {
constexpr uint8_t MARK = '(', STOP = '.', POP = '0', POP_MARK = '1', DUP = '2', BININT = 'J', BININT1 = 'K',
                  BININT2 = 'M', NONE = 'N', BINUNICODE = 'X', APPEND = 'a', DICT = 'd', EMPTY_DICT = '}',
                  APPENDS = 'e', BINGET = 'h', LONG_BINGET = 'j', LIST = 'l', EMPTY_LIST = ']', BINPUT = 'q',
                  LONG_BINPUT = 'r', SETITEM = 's', TUPLE = 't', EMPTY_TUPLE = ')', SETITEMS = 'u', BINFLOAT = 'G',
                  GLOBAL = 'c', BINBYTES = 'B', SHORT_BINBYTES = 'C';
constexpr uint8_t PROTO = 0x80, TUPLE1 = 0x85, TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88, NEWFALSE = 0x89,
                  LONG1 = 0x8a, LONG4 = 0x8b, SHORT_BINUNICODE = 0x8c, BINUNICODE8 = 0x8d, BINBYTES8 = 0x8e,
                  STACK_GLOBAL = 0x93, MEMOIZE = 0x94, FRAME = 0x95;
}  // namespace op

// UTF-8 as Python's "surrogatepass" handler reads and writes it: well-formed UTF-8 where the
// encoded surrogates U+D800..U+DFFF are also allowed. Returns the offset of the first bad byte,
// or npos.
inline size_t bad_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xbf;  // range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;  // no overlong forms; 0xed (surrogates) is allowed in full
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;  // nothing above U+10FFFF
    } else {
      return i;
    }
    if (n - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace tdshm::pickle::detail
