#pragma once
// A stable 64-bit hash of a canonical byte stream, the same in every process and build: FNV-1a 64,
// finished with the MurmurHash3 fmix64 mixer so that a change in the last bytes still reaches
// every output bit. Used for schema fingerprints and the key hashes of layout descriptors.

#include <cstdint>
#include <string_view>

namespace tdshm::detail {

class StableHasher {
 public:
  void byte(uint8_t b) {
    h_ ^= b;
    h_ *= 0x100000001b3ull;
  }
  /// Little-endian, whatever the host.
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) byte(static_cast<uint8_t>(v >> (8 * i)));
  }
  /// Length (u64), then the bytes: ("a", "b") and ("ab") hash apart.
  void str(std::string_view s) {
    u64(s.size());
    for (char c : s) byte(static_cast<uint8_t>(c));
  }
  uint64_t finish() const {
    uint64_t k = h_;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
  }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace tdshm::detail
