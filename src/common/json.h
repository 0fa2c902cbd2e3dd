#pragma once
// JSON string literals for the tools' hand-written JSON Lines (tdshm bench, stress, ls/inspect).

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace tdshm::detail {

/// The length of the valid UTF-8 sequence at s[i] (2-4 bytes), or 0 when there is none there.
inline size_t utf8_sequence(std::string_view s, size_t i) {
  const auto at = [&](size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0u; };
  const unsigned c = at(i);
  size_t n = 0;
  unsigned lo = 0x80, hi = 0xbf;  // the second byte's range (no overlong forms, surrogates or > U+10FFFF)
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (at(i + k) < 0x80 || at(i + k) > 0xbf) return 0;
  }
  return n;
}

/// `s` as a JSON string literal: quote and backslash escaped, control characters as \n, \r, \t or
/// \u00XX. With `bytes` (names that need not be UTF-8: file names), valid UTF-8 passes as it is
/// and every other byte from 0x80 up is \udcXX, Python's surrogateescape: json.loads then
/// os.fsencode gives the name's bytes back.
inline std::string json_quote(std::string_view s, bool bytes = false) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else if (bytes && c >= 0x80) {
          if (const size_t n = utf8_sequence(s, i); n > 0) {
            out.append(s.substr(i, n));
            i += n - 1;
          } else {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\udc%02x", static_cast<unsigned>(c));
            out += buf;
          }
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace tdshm::detail
