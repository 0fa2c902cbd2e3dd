#pragma once
// Internal: random names that no other process of this run, or of any run, picks by chance.

#include <array>
#include <cstdint>
#include <random>
#include <string>

namespace tdshm::detail {

/// 32 hex digits: 128 bits from std::random_device.
inline std::string random_hex128() {
  static constexpr std::array<char, 16> kHex = {'0', '1', '2', '3', '4', '5', '6', '7',
                                                '8', '9', 'a', 'b', 'c', 'd', 'e', 'f'};
  std::random_device device;
  std::string out;
  out.reserve(32);
  for (int i = 0; i < 4; ++i) {
    uint32_t word = device();
    for (int j = 0; j < 8; ++j) {
      out.push_back(kHex[word & 0xF]);
      word >>= 4;
    }
  }
  return out;
}

}  // namespace tdshm::detail
