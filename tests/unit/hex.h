// Hex strings of byte vectors, for the golden bytes of the codec tests (schema, pickle).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tdshm::test {

inline std::vector<uint8_t> from_hex(std::string_view hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

inline std::string to_hex(const std::vector<uint8_t>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t v : bytes) {
    out += kDigits[v >> 4];
    out += kDigits[v & 15];
  }
  return out;
}

}  // namespace tdshm::test
