#pragma once
// Small formatting helpers shared by the layers' error messages.

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

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

}  // namespace tdshm::detail
