// pseudo_rand: tensordict's _int_generator without Python. tensordict draws a transfer's tags
// from numpy (default_rng(seed).bytes(8), big-endian, mod 10000), and a peer running tensordict
// must see the same tags, so every step below reproduces numpy's arithmetic exactly:
// SeedSequence (entropy pool and generate_state), PCG64 seeding, one 64-bit draw.
// Everything is computed on the stack: a tag costs a few dozen multiplications, no allocation.

#include <tdshm/distributed.h>
#include <tdshm/errors.h>

#include <array>
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

// SeedSequence's hash state never sees the data: it runs through the same values for every
// seed. They are computed here at compile time, so a tag has no serial chain of multiplications
// through the hash state, only the data's own.
template <size_t N>
constexpr std::array<uint32_t, N> hash_states(uint32_t init, uint32_t mult) {
  std::array<uint32_t, N> states{};
  states[0] = init;
  for (size_t i = 1; i < N; ++i) states[i] = states[i - 1] * mult;
  return states;
}
// mix_entropy hashes 16 values: the 4 pool words, then one per ordered pair of pool slots.
constexpr size_t kMixHashes = kPoolSize + kPoolSize * (kPoolSize - 1);
constexpr auto kHashA = hash_states<kMixHashes + 1>(kInitA, kMultA);
// PCG64 asks generate_state for 4 uint64, which it draws as 8 uint32.
constexpr size_t kStateWords = 8;
constexpr auto kHashB = hash_states<kStateWords + 1>(kInitB, kMultB);

// The n-th hashing of a sequence (numpy's hashmix, and each word of generate_state, are the same
// step with their own constants): xor with the hash state, multiply by the next one, fold the
// high half into the low.
template <size_t N>
uint32_t hash_step(uint32_t value, const std::array<uint32_t, N>& states, size_t n) {
  value ^= states[n];
  value *= states[n + 1];
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
  size_t n = 0;
  // The loops are unrolled (as -O2 alone does not) so that the pool lives in registers and every
  // table index is a constant: that made a tag about 2.5x cheaper (benchmarks/bench_pseudo_rand).
  // Unused slots hash a zero word, exactly like numpy's padding: the high word of a seed below
  // 2^32 contributes the same as no word at all.
#pragma GCC unroll 4
  for (size_t i = 0; i < kPoolSize; ++i) pool[i] = hash_step(words[i], kHashA, n++);
#pragma GCC unroll 4
  for (size_t src = 0; src < kPoolSize; ++src) {
#pragma GCC unroll 4
    for (size_t dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) pool[dst] = mix(pool[dst], hash_step(pool[src], kHashA, n++));
    }
  }
}

// PCG64 (numpy's): a 128-bit LCG with the XSL-RR output.
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
  uint64_t s[kStateWords / 2];
#pragma GCC unroll 8
  for (size_t i = 0; i < kStateWords; ++i) {
    const uint32_t v = hash_step(pool[i % kPoolSize], kHashB, i);
    if (i % 2 == 0) {
      s[i / 2] = v;
    } else {
      s[i / 2] |= static_cast<uint64_t>(v) << 32;
    }
  }
  const u128 initstate = (static_cast<u128>(s[0]) << 64) | s[1];
  const u128 initseq = (static_cast<u128>(s[2]) << 64) | s[3];
  // numpy's pcg_setseq_128_srandom_r: the stream sets the (odd) increment, and the initial state
  // enters between two steps from zero.
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
    throw Error("transfer_tags: " + std::to_string(n) + " tags from init_tag " + std::to_string(init_tag) +
                " go past INT64_MAX; use a smaller init_tag");
  }
  for (size_t i = 0; i < n; ++i) tags.push_back(init_tag + static_cast<int64_t>(i));
  return tags;
}

}  // namespace tdshm
