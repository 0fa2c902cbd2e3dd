#pragma once
// Small formatting helpers shared by the layers' error messages.

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace tdshm::detail {

/// "[2, 3]": a shape or batch size for messages.
inline std::string shape_str(c10::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

/// The first line of an error message: c10's errors append a backtrace after it.
inline std::string first_line(std::string message) {
  if (const size_t nl = message.find('\n'); nl != std::string::npos) message.resize(nl);
  return message;
}

/// Throws E with `prefix` followed by the arguments streamed in order: the layers' `fail(...)`.
/// Pass integers as int/uint64_t, never as (u)int8_t (they would print as characters).
template <class E, class... Args>
[[noreturn]] void throw_streamed(std::string_view prefix, const Args&... args) {
  std::ostringstream os;
  os << prefix;
  (os << ... << args);
  throw E(os.str());
}

}  // namespace tdshm::detail
