// pseudo_rand: tensordict's _int_generator without Python. tensordict draws a transfer's tags
// from numpy (default_rng(seed).bytes(8), big-endian, mod 10000), and a peer running tensordict
// must see the same tags, so every step below reproduces numpy's arithmetic exactly:
// SeedSequence (entropy pool and generate_state), PCG64 seeding, one 64-bit draw.
// Everything is computed on the stack: a tag costs a few dozen multiplications, no allocation.

#include <tdshm/distributed.h>
#include <tdshm/errors.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace tdshm {
namespace {

// numpy's SeedSequence constants (bit_generator.pyx). Its hash state wraps at 32 bits, as
// numpy's uint32 arithmetic does.
constexpr uint32_t kInitA = 0x43b0d7e5U;
constexpr uint32_t kMultA = 0x931e8875U;
constexpr uint32_t kInitB = 0x8b51f9ddU;
constexpr uint32_t kMultB = 0x58f38dedU;
constexpr uint32_t kMixMultL = 0xca01f9ddU;
constexpr uint32_t kMixMultR = 0x4973f715U;
constexpr unsigned kXShift = 16;
constexpr size_t kPoolSize = 4;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  return value ^ (value >> kXShift);
}

uint32_t mix(uint32_t x, uint32_t y) {
  const uint32_t r = kMixMultL * x - kMixMultR * y;
  return r ^ (r >> kXShift);
}

// The pool of SeedSequence(entropy=seed). numpy splits the entropy into 32-bit words, least
// significant first, and a non-negative int64 needs at most two (0 is one word, 0). With at most
// two words the pool (four) always has room, so numpy's loop that mixes in words beyond the pool
// never runs here.
void seed_pool(uint64_t seed, uint32_t (&pool)[kPoolSize]) {
  const uint32_t words[kPoolSize] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                                     0, 0};
  uint32_t hash_const = kInitA;
  // Unused slots hash a zero word, exactly like numpy's padding: the high word of a seed below
  // 2^32 contributes the same as no word at all.
  for (size_t i = 0; i < kPoolSize; ++i) pool[i] = hashmix(words[i], hash_const);
  for (size_t src = 0; src < kPoolSize; ++src) {
    for (size_t dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hash_const));
    }
  }
}

// PCG64 (numpy's pcg64.h): a 128-bit LCG with the XSL-RR output.
// __extension__: -Wpedantic (an error under -Werror) rejects the GNU 128-bit type otherwise.
__extension__ typedef unsigned __int128 u128;
constexpr u128 kPcgMult = (static_cast<u128>(0x2360ED051FC65DA4ULL) << 64) | 0x4385DF649FCCF645ULL;

struct Pcg64 {
  u128 state = 0;
  u128 inc = 0;

  void step() { state = state * kPcgMult + inc; }

  // numpy outputs the state after the step (not before, as some PCG variants do).
  uint64_t next64() {
    step();
    const auto hi = static_cast<uint64_t>(state >> 64);
    const auto lo = static_cast<uint64_t>(state);
    return std::rotr(hi ^ lo, static_cast<int>(state >> 122));
  }
};

// PCG64(SeedSequence(seed)): generate_state(4, uint64) is eight uint32 words paired little-endian,
// the first two uint64 the initial state (high half first), the last two the stream.
Pcg64 seeded_pcg64(uint64_t seed) {
  uint32_t pool[kPoolSize];
  seed_pool(seed, pool);
  uint64_t s[4];
  uint32_t hash_const = kInitB;
  for (size_t i = 0; i < 2 * 4; ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    v ^= v >> kXShift;
    if (i % 2 == 0) {
      s[i / 2] = v;
    } else {
      s[i / 2] |= static_cast<uint64_t>(v) << 32;
    }
  }
  const u128 initstate = (static_cast<u128>(s[0]) << 64) | s[1];
  const u128 initseq = (static_cast<u128>(s[2]) << 64) | s[3];
  Pcg64 rng;
  rng.inc = (initseq << 1) | 1;
  rng.step();
  rng.state += initstate;
  rng.step();
  return rng;
}

}  // namespace

int64_t pseudo_rand_tag(int64_t seed) {
  if (seed < 0) {
    throw Error("pseudo_rand_tag: seed must be >= 0 (numpy's SeedSequence rejects negative "
                "entropy), got " + std::to_string(seed));
  }
  // bytes(8) is two full-range uint32 draws, which numpy takes as the low then the high half of
  // one 64-bit output and writes little-endian: the eight bytes are that output in little-endian
  // order. Reading them big-endian is a byte swap (std::byteswap is C++23).
  const uint64_t draw = seeded_pcg64(static_cast<uint64_t>(seed)).next64();
  return static_cast<int64_t>(__builtin_bswap64(draw) % 10000);
}

std::vector<int64_t> transfer_tags(int64_t init_tag, size_t n, bool pseudo_rand) {
  std::vector<int64_t> tags;
  if (n == 0) return tags;
  tags.reserve(n);
  if (pseudo_rand) {
    // Each tag is below 10000, so only the first seed can be out of range (negative).
    int64_t tag = pseudo_rand_tag(init_tag);
    tags.push_back(tag);
    for (size_t i = 1; i < n; ++i) {
      tag = pseudo_rand_tag(tag + 1);
      tags.push_back(tag);
    }
    return tags;
  }
  // Python's integers do not overflow; ours would, so a range past int64 is refused. The
  // headroom INT64_MAX - init_tag always fits in uint64, where modular subtraction computes it.
  const uint64_t headroom =
      static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - static_cast<uint64_t>(init_tag);
  if (n - 1 > headroom) {
    throw Error("transfer_tags: init_tag " + std::to_string(init_tag) + " + " + std::to_string(n - 1) +
                " leaves overflows int64; use a smaller init_tag");
  }
  for (size_t i = 0; i < n; ++i) tags.push_back(init_tag + static_cast<int64_t>(i));
  return tags;
}

}  // namespace tdshm
