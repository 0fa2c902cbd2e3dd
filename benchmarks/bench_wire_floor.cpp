// The per-leaf wire's own floor: what a tree of N leaves costs through tdshm's ring and arena
// primitives (shm/parts/ring.h, shm/parts/arena.h) with no engine around them: no ops, no matching, no
// locks, no checks beyond the slot's owner. Two forked processes ping-pong the tree, and each
// round runs three layouts side by side:
//
//   one-message  all N leaves' bytes as one message (one entry, one copy in and out): the spin
//                floor of `tdshm bench --td` at the same total bytes
//   slot-per-leaf one entry and one arena slot per leaf: the layout the engine uses
//   packed       one entry per leaf, consecutive leaves packed into the same slot
//
// It tells how far the goal "100 x 1 KiB <= 2x the spin floor" is from the wire itself: the
// engine can only add to these numbers.
//
//   build/benchmarks/tdshm_bench_wire_floor [--leaves N] [--leaf-bytes B] [--iters N] [--rounds R]

#include "shm/parts/arena.h"
#include "shm/parts/ring.h"
#include "shm/parts/spin.h"

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace tdshm::shm;
using Clock = std::chrono::steady_clock;

enum class Layout { kOneMessage, kSlotPerLeaf, kPacked };
constexpr Layout kLayouts[] = {Layout::kOneMessage, Layout::kSlotPerLeaf, Layout::kPacked};
const char* name(Layout l) {
  return l == Layout::kOneMessage ? "one-message" : l == Layout::kSlotPerLeaf ? "slot-per-leaf" : "packed";
}

struct Options {
  uint32_t leaves = 100;
  uint64_t leaf_bytes = 1024;
  int iters = 20000;
  int rounds = 5;
};

constexpr uint32_t kEntries = 128;
constexpr uint32_t kSlots = 64;
constexpr uint64_t kSlotBytes = uint64_t{64} << 10;
constexpr uint64_t kTableBytes = 4096;
constexpr uint64_t kRingBytes = sizeof(RingControl) + uint64_t{kEntries} * kEntryBytes;
constexpr uint64_t kRegionBytes = kTableBytes + uint64_t{kSlots} * kSlotBytes;
// This floor's own entry flag (not the engine's): the receiver keeps the slot, more leaves follow
// in it. The engine has no such flag: packing did not make it measurably faster (docs/benchmarks.md,
// "TensorDict").
constexpr uint32_t kMoreInSlot = 1u << 30;
// Both rings key their seq words alike (a fixed key: one incarnation).
constexpr uint64_t kRingKey = tdshm::shm::ring_key(0, 0, 1);

// Spins on `ready` with a deadline and a check that the peer lives: never hangs.
template <class Ready>
void spin_until(Ready ready, pid_t peer, int rank) {
  const auto end = Clock::now() + std::chrono::seconds(20);
  for (uint64_t spins = 1; !ready(); ++spins) {
    tdshm::detail::cpu_relax();
    if ((spins & 0x3fff) != 0) continue;
    const bool peer_gone = rank == 0 ? ::waitpid(peer, nullptr, WNOHANG) == peer : ::getppid() != peer;
    if (peer_gone) throw std::runtime_error("the other rank is gone");
    if (Clock::now() > end) throw std::runtime_error("timed out waiting for the other rank");
  }
}

class Rank {
 public:
  Rank(uint8_t* base, int rank, pid_t peer, const Options& o)
      : rank_(rank),
        peer_(peer),
        o_(o),
        tx_(RingView(base + (1 - rank) * kRingBytes, kEntries, kRingKey)),
        rx_(RingView(base + rank * kRingBytes, kEntries, kRingKey)),
        mine_(base + 2 * kRingBytes + rank * kRegionBytes, kSlots, kTableBytes, kSlotBytes),
        theirs_(base + 2 * kRingBytes + (1 - rank) * kRegionBytes, kSlots, kTableBytes, kSlotBytes),
        alloc_(mine_) {
    for (uint32_t i = 0; i < o.leaves; ++i) leaves_.emplace_back(o.leaf_bytes, static_cast<uint8_t>(i + 1));
  }

  void send(Layout layout) {
    const auto to = static_cast<uint32_t>(1 - rank_);
    if (layout == Layout::kOneMessage) {  // every leaf into slot 0 and on (a flat buffer), one entry
      constexpr uint32_t slot = 0;
      spin_until([&] { return mine_.state(slot).load(std::memory_order_acquire) == kSlotFree; }, peer_, rank_);
      mine_.state(slot).store(to + 1, std::memory_order_relaxed);
      uint8_t* dst = mine_.data(slot);
      for (const auto& leaf : leaves_) {
        std::memcpy(dst, leaf.data(), leaf.size());
        dst += leaf.size();
      }
      publish(0, slot, 0, o_.leaf_bytes * o_.leaves, 0);
      return;
    }
    uint32_t slot = 0;
    uint64_t used = kSlotBytes;  // no slot open yet
    for (uint32_t i = 0; i < o_.leaves; ++i) {
      const bool reuse = layout == Layout::kPacked && used + o_.leaf_bytes <= kSlotBytes;
      if (!reuse) {
        slot = take(to);
        used = 0;
      }
      std::memcpy(mine_.data(slot) + used, leaves_[i].data(), o_.leaf_bytes);
      const bool more = layout == Layout::kPacked && i + 1 < o_.leaves && used + 2 * o_.leaf_bytes <= kSlotBytes;
      publish(i, slot, used, o_.leaf_bytes, more ? kMoreInSlot : 0);
      used += (o_.leaf_bytes + kCacheLine - 1) / kCacheLine * kCacheLine;
    }
  }

  // Returns false if a tag or a byte is wrong.
  bool recv(Layout layout, bool verify) {
    const uint32_t messages = layout == Layout::kOneMessage ? 1 : o_.leaves;
    bool ok = true;
    for (uint32_t i = 0; i < messages; ++i) {
      EntryFields f;
      spin_until([&] { return rx_.peek(f); }, peer_, rank_);
      const uint8_t* chunk = claimed_chunk(theirs_, f.slot, static_cast<uint32_t>(rank_));
      if (chunk == nullptr || f.tag != i) throw std::runtime_error("entry " + std::to_string(i) + " is not what was sent");
      chunk += f.chunk_offset;  // (this floor keeps the offset in the slot there)
      if (layout == Layout::kOneMessage) {
        for (auto& leaf : leaves_) {
          std::memcpy(leaf.data(), chunk, leaf.size());
          chunk += leaf.size();
        }
      } else {
        std::memcpy(leaves_[i].data(), chunk, f.chunk_bytes);
      }
      if ((f.flags & kMoreInSlot) == 0) release_slot(theirs_, f.slot);
      rx_.consume();
    }
    if (verify) {
      for (uint32_t i = 0; i < o_.leaves; ++i) {
        ok &= std::all_of(leaves_[i].begin(), leaves_[i].end(), [&](uint8_t b) { return b == static_cast<uint8_t>(i + 1); });
      }
      if (!ok) std::fprintf(stderr, "tdshm_bench_wire_floor: rank %d received wrong bytes (%s)\n", rank_, name(layout));
    }
    return ok;
  }

 private:
  uint32_t take(uint32_t to) {
    std::optional<uint32_t> slot;
    spin_until([&] { return (slot = alloc_.take(to)).has_value(); }, peer_, rank_);
    return *slot;
  }
  void publish(uint32_t tag, uint32_t slot, uint64_t offset, uint64_t bytes, uint32_t more) {
    spin_until([&] { return tx_.has_room(); }, peer_, rank_);
    EntryHeader& e = tx_.entry();
    e.tag = tag;
    e.total_bytes = bytes;
    tx_.tail().chunk_offset = offset;
    e.chunk_bytes = static_cast<uint32_t>(bytes);
    // Without kEntryFirst: read_entry reads a first entry's offset as 0, and this floor keeps the
    // chunk's place in its slot there (nothing here checks entries).
    e.flags = kEntryLast | more;
    tx_.tail().slot = slot;
    tx_.publish();
  }

  int rank_;
  pid_t peer_;
  Options o_;
  RingProducer tx_;
  RingConsumer rx_;
  RegionView mine_, theirs_;
  SlotAllocator alloc_;
  std::vector<std::vector<uint8_t>> leaves_;
};

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);  // best effort: fewer CPUs than two just share
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (v == nullptr) throw std::invalid_argument("missing value after " + a);
    const long long n = std::atoll(v);
    ++i;
    if (a == "--leaves" && n >= 1 && n <= kEntries) o.leaves = static_cast<uint32_t>(n);
    else if (a == "--leaf-bytes" && n >= 1 && static_cast<uint64_t>(n) <= kSlotBytes) o.leaf_bytes = static_cast<uint64_t>(n);
    else if (a == "--iters" && n >= 1) o.iters = static_cast<int>(n);
    else if (a == "--rounds" && n >= 1) o.rounds = static_cast<int>(n);
    else throw std::invalid_argument("bad option " + a + " " + v + " (--leaves 1-128, --leaf-bytes 1-65536, --iters, --rounds)");
  }
  if (o.leaves * o.leaf_bytes > kSlots * kSlotBytes / 2) throw std::invalid_argument("the tree must fit half the arena");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdshm_bench_wire_floor: %s\n", e.what());
    return 2;
  }
  const uint64_t total = 2 * kRingBytes + 2 * kRegionBytes;
  void* map = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return 1;
  auto* base = static_cast<uint8_t*>(map);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) return 1;
  const int rank = child == 0 ? 1 : 0;
  pin(rank);
  std::vector<std::vector<double>> one_way(std::size(kLayouts));  // per layout, us
  bool ok = true;
  try {
    Rank r(base, rank, rank == 0 ? child : parent, o);
    const int per_round = std::max(1, o.iters / o.rounds), warmup = std::max(1, per_round / 10);
    for (int round = 0; round < o.rounds; ++round) {
      for (size_t l = 0; l < std::size(kLayouts); ++l) {
        const Layout layout = kLayouts[l];
        for (int it = 0; it < warmup + per_round; ++it) {
          const auto t0 = Clock::now();
          const bool verify = it + 1 == warmup + per_round;
          if (rank == 0) {
            r.send(layout);
            ok &= r.recv(layout, verify);
          } else {
            ok &= r.recv(layout, verify);
            r.send(layout);
          }
          if (it >= warmup) one_way[l].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 2);
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdshm_bench_wire_floor: rank %d: %s\n", rank, e.what());
    if (rank == 0) ::kill(child, SIGKILL);
    ok = false;
  }
  if (rank == 1) ::_exit(ok ? 0 : 1);
  int status = 0;
  ::waitpid(child, &status, 0);
  ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!ok) {
    std::fprintf(stderr, "tdshm_bench_wire_floor: failed (wrong bytes, or a rank failed)\n");
    return 1;
  }
  std::printf("%u leaves of %llu B, one-way, %d rounds interleaving the layouts (rank 0 and 1 pinned to CPUs 0 and 1)\n",
              o.leaves, static_cast<unsigned long long>(o.leaf_bytes), o.rounds);
  std::printf("%-14s %10s %10s %10s %14s\n", "layout", "p50 us", "p10 us", "p90 us", "p50/one-msg");
  double base_p50 = 0;
  for (size_t l = 0; l < std::size(kLayouts); ++l) {
    auto& v = one_way[l];
    std::sort(v.begin(), v.end());
    const double p50 = v[v.size() / 2];
    if (l == 0) base_p50 = p50;
    std::printf("%-14s %10.3f %10.3f %10.3f %13.2fx\n", name(kLayouts[l]), p50, v[v.size() / 10], v[v.size() * 9 / 10],
                p50 / base_p50);
  }
  return 0;
}
