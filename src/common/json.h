#pragma once
// JSON string literals for the tools' hand-written JSON Lines (tdshm bench, stress, ls/inspect).

#include <cstdio>
#include <string>
#include <string_view>

namespace tdshm::detail {

/// `s` as a JSON string literal: quote and backslash escaped, control characters as \n, \r, \t or
/// \u00XX; with `ascii_only` also the bytes from 0x7f up (names that need not be UTF-8).
inline std::string json_quote(std::string_view s, bool ascii_only = false) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || (ascii_only && c >= 0x7f)) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

}  // namespace tdshm::detail
