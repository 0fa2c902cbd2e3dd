#pragma once
// The lowest layer of the ping-pong benchmark (pingpong.h describes the method): the control
// block both ranks share through a mapping made before fork, the Link that synchronises them
// through it and notices a peer that died or gave up (PeerFailed), and the waits on a sequence
// word (WaitMode) that the floors and the spin floor behind c10d use. Everything else of the
// benchmark sits above this file; it uses none of it.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tdshm::bench::detail {

// A fixed line size (STYLE habit 7): 64 bytes on every x86-64 and most arm64 parts.
inline constexpr size_t kCacheLine = 64;

/// One 32-bit word alone on its cache line, written by one rank and read by the other through
/// std::atomic_ref; its address is also a (non-private) futex word.
struct alignas(kCacheLine) SharedWord {
  uint32_t value;
  char pad[kCacheLine - sizeof(uint32_t)];
};
static_assert(sizeof(SharedWord) == kCacheLine, "one word per cache line: no false sharing between the ranks");
static_assert(std::is_trivially_copyable_v<SharedWord> && std::is_standard_layout_v<SharedWord>,
              "SharedWord lives in a mapping both processes use");
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free, "futex words must be lock-free atomics");

/// The start of the MAP_SHARED anonymous mapping made before fork (all zero at first):
///
///   +0     arrived[rank][2]        Link::sync: (generation << 1) | ok, written by `rank` into
///                                  slot generation % 2
///   +256   aborted                 1 once a rank gave up (its message is in `error`)
///   +320   spin_seq[0..1]          spin floor: [0] rank 0 -> 1, [1] rank 1 -> 0
///   +448   futex_seq[0..1]         futex floor, same roles
///   +576   gloo_port               TCPStore port chosen by rank 0
///   +640   c10d_seq[0..1]          the spin floor through c10d (c10d-spin), same roles
///   +768   error[2][1024]          last error message of each rank, NUL-terminated
///   +2816  cpu[2]                  unpinned runs: the CPU each rank last ran on, plus one (0: not
///                                  known yet), written when it changes (Link::publish_cpu)
///   ...    (page aligned) payload buffers of the floors: [0] rank 0 -> 1, [1] rank 1 -> 0
struct ControlBlock {
  SharedWord arrived[2][2];
  SharedWord aborted;
  SharedWord spin_seq[2];
  SharedWord futex_seq[2];
  SharedWord gloo_port;
  SharedWord c10d_seq[2];
  char error[2][1024];
  SharedWord cpu[2];
};
static_assert(offsetof(ControlBlock, aborted) == 256 && offsetof(ControlBlock, spin_seq) == 320 &&
                  offsetof(ControlBlock, futex_seq) == 448 && offsetof(ControlBlock, gloo_port) == 576 &&
                  offsetof(ControlBlock, c10d_seq) == 640 && offsetof(ControlBlock, error) == 768 &&
                  offsetof(ControlBlock, cpu) == 2816,
              "ControlBlock layout as drawn above");
static_assert(std::is_trivially_copyable_v<ControlBlock> && std::is_standard_layout_v<ControlBlock>,
              "ControlBlock lives in a mapping both processes use");

/// The other rank died or gave up; what() says which and why.
class PeerFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Process-local view of the control block for one rank.
class Link {
 public:
  /// `peer` is the other process (rank 0: the forked child; rank 1: the parent). On rank 0,
  /// `peer_exit_status` is the child's wait status once it has been reaped (-1 before).
  Link(ControlBlock* block, int rank, pid_t peer, bool peer_on_own_cpu,
       const std::atomic<int>* peer_exit_status = nullptr);

  int rank() const noexcept { return rank_; }
  ControlBlock& block() noexcept { return *block_; }
  /// False when both ranks may share one CPU: spinning waiters must then yield.
  bool peer_on_own_cpu() const noexcept { return peer_on_own_cpu_; }

  /// Both ranks call it the same number of times: waits for the peer's matching call and
  /// returns true if both passed ok. Throws PeerFailed if the peer died or aborted, or after
  /// the deadline.
  bool sync(bool ok, std::chrono::milliseconds deadline = std::chrono::seconds(120));
  /// Records `why` as this rank's error, tells the peer that this rank gives up, wakes it.
  void abort(const std::string& why) noexcept;
  /// Throws PeerFailed if the peer aborted or died.
  void check_peer();
  /// The peer's last recorded error message ("" if none).
  std::string peer_error() const;
  /// Records this rank's error message without aborting (the peer reads it after a sync).
  void set_error(const std::string& why) noexcept;
  /// Records the CPU this rank runs on, writing the shared word only when it changed (so that
  /// a rank that stays put adds no cache-line traffic to what is measured).
  void publish_cpu() noexcept;
  /// True if this rank now runs on the CPU the peer last published.
  bool on_peer_cpu() const noexcept;

 private:
  ControlBlock* block_;
  int rank_;
  pid_t peer_;
  bool peer_on_own_cpu_;
  const std::atomic<int>* peer_exit_status_;
  uint32_t generation_ = 0;
  uint32_t published_cpu_ = 0;  // what publish_cpu last wrote (CPU + 1)
};

/// How a floor waits for its sequence word.
enum class WaitMode { spin, futex };

/// Waits until `word` holds `expected`: spinning (mode spin) or sleeping in FUTEX_WAIT (mode
/// futex). Checks the peer and the deadline now and then; throws PeerFailed.
void wait_for_word(uint32_t& word, uint32_t expected, WaitMode mode, Link& link,
                   std::chrono::milliseconds deadline = std::chrono::seconds(120));
/// Stores `value` into `word` with release order (pairs with wait_for_word's acquire load);
/// in mode futex also wakes the one waiter.
void post_word(uint32_t& word, uint32_t value, WaitMode mode);

}  // namespace tdshm::bench::detail
