#pragma once
// Internals of the ping-pong benchmark (see pingpong.h for the method): the control block both
// ranks share, the Link that synchronises them through it, and the interface every transport
// implements. Each transport lives in its own file so that heavy headers (gloo, the shm
// transport) are compiled once:
//   pingpong.cpp         options, driver, statistics, table, JSON, goals
//   pingpong_floors.cpp  spin and futex floors, memcpy ceiling, ping-pong over any c10d group
//   pingpong_gloo.cpp    c10d::ProcessGroupGloo on 127.0.0.1
//   pingpong_shm.cpp     tdshm::ProcessGroupShm
//   pingpong_td.cpp      TensorDict workloads (--td): their trees, the ping-pong of
//                        TensorDict::send/recv over any c10d group, the memmap workloads' files

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

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
///   ...    (page aligned) payload buffers of the floors: [0] rank 0 -> 1, [1] rank 1 -> 0
struct ControlBlock {
  SharedWord arrived[2][2];
  SharedWord aborted;
  SharedWord spin_seq[2];
  SharedWord futex_seq[2];
  SharedWord gloo_port;
  SharedWord c10d_seq[2];
  char error[2][1024];
};
static_assert(offsetof(ControlBlock, aborted) == 256 && offsetof(ControlBlock, spin_seq) == 320 &&
                  offsetof(ControlBlock, futex_seq) == 448 && offsetof(ControlBlock, gloo_port) == 576 &&
                  offsetof(ControlBlock, c10d_seq) == 640 && offsetof(ControlBlock, error) == 768,
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

 private:
  ControlBlock* block_;
  int rank_;
  pid_t peer_;
  bool peer_on_own_cpu_;
  const std::atomic<int>* peer_exit_status_;
  uint32_t generation_ = 0;
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

/// What one row of the table moves per one-way trip: a message of `bytes` (size mode), or a
/// TensorDict workload (--td), which the floors and the ceiling move as one message of `bytes`.
struct Workload {
  /// How the tensordict of a workload is made (see pingpong_td.cpp).
  enum class Tree {
    message,  ///< size mode: no tensordict
    seed,     ///< {("a","b"): 2 floats, "c": 2x3 floats, "_": 2x1x5 floats}, batch [2]
    uniform,  ///< `leaves` float leaves of `leaf_bytes` each, batch []
    memmap,   ///< one float leaf of `leaf_bytes` that maps `file` (both ranks map the same file)
  };
  std::string name;  ///< "" in size mode
  Tree tree = Tree::message;
  int leaves = 1;
  size_t leaf_bytes = 0;      ///< uniform and memmap
  bool consolidated = false;  ///< send/recv(consolidated=True) between consolidated tensordicts
  size_t bytes = 0;           ///< payload bytes of one one-way trip (all the leaves)
  std::string file;           ///< memmap: absolute path of the file, set by the driver
};

/// A plain message of `bytes` (size mode).
Workload message_workload(size_t bytes);
/// The TD workloads, in table order.
const std::vector<Workload>& td_workloads();

/// Fills `p` with a byte pattern that depends on `seed`; has_pattern checks it.
void fill_pattern(uint8_t* p, size_t n, size_t seed) noexcept;
bool has_pattern(const uint8_t* p, size_t n, size_t seed) noexcept;

/// One transport of the benchmark, built in both ranks (only in rank 0 for single-process ones).
class PingPong {
 public:
  virtual ~PingPong() = default;
  /// Makes the buffers (or tensordicts) for one row: no communication.
  virtual void prepare(const Workload& workload) = 0;
  /// Rank 0: one round trip (send, then receive the echo). Single-process: one copy.
  virtual void ping() = 0;
  /// Rank 1: receives one message and sends it back.
  virtual void pong() = 0;
  /// Rank 0, after the last ping of a size: the last echo equals what was sent.
  virtual bool verify() const = 0;
  /// True for the memcpy ceiling: no peer, the time of ping() is a one-way time.
  virtual bool single_process() const { return false; }
};

std::unique_ptr<PingPong> make_floor_pingpong(Link& link, WaitMode mode, uint8_t* payload0, uint8_t* payload1);
/// The spin floor's wire behind c10d's API: a two-rank c10d::ProcessGroup whose send copies the
/// tensor into the payload buffer and bumps a sequence word, and whose recv's Work spins on that
/// word and copies out. What any ProcessGroup pays for c10d's calls and Work objects on top of
/// the spin floor (messages must fit the payload buffers, as the floor's do).
c10::intrusive_ptr<c10d::ProcessGroup> make_spin_floor_group(Link& link, uint8_t* payload0, uint8_t* payload1,
                                                             size_t capacity);
std::unique_ptr<PingPong> make_memcpy_pingpong();
/// Ping-pong with send/recv of a uint8 tensor over a two-rank c10d group; rank 1 receives into
/// its buffer and sends that buffer back.
std::unique_ptr<PingPong> make_c10d_pingpong(c10::intrusive_ptr<c10d::ProcessGroup> group);

/// c10d::ProcessGroupGloo over TCP on 127.0.0.1 with a TCPStore served by rank 0 on a free port.
/// Calls link.sync() exactly once on both ranks, whatever fails.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(Link& link, std::chrono::milliseconds timeout);

/// ShmOptions::spin by default (what users get; the bench's spinning mode uses it).
std::chrono::microseconds default_shm_spin();
/// tdshm::ProcessGroupShm on segment `name`; `spin` is ShmOptions::spin (0: blocking only).
c10::intrusive_ptr<c10d::ProcessGroup> make_shm_group(const std::string& name, int rank,
                                                      std::chrono::microseconds spin,
                                                      std::chrono::milliseconds timeout);
/// Removes segment `name` if it was left behind (all its ranks dead). Never throws.
void remove_shm_segment(const std::string& name) noexcept;

/// Ping-pong of TensorDict::send / recv over a two-rank c10d group, wrapped as a standalone
/// tdshm::Group (peers addressed with group_dst / group_src). Rank 0 sends its tensordict and
/// receives the echo into a second one; rank 1 receives into its tensordict and sends it back.
/// verify() checks the echo's leaves against the pattern rank 0 sent.
std::unique_ptr<PingPong> make_td_pingpong(c10::intrusive_ptr<c10d::ProcessGroup> group, int rank);

/// Why a memmap workload's file of `file_bytes` cannot be made in directory `dir` now (free
/// space of its filesystem), or why the row would run short of memory (`memory_bytes`: the file
/// plus the buffers of the floors at that size, against MemAvailable); "" if there is room.
std::string no_room_for(const std::string& dir, uint64_t file_bytes, uint64_t memory_bytes);

/// The file of a memmap workload, owned by rank 0: created holding the pattern of leaf 0, and
/// unlinked by the destructor, or by SIGINT / SIGTERM / SIGHUP while it exists (the handler
/// then re-raises the signal with its default action; the previous handlers are put back when
/// the file is removed). Move-only; at most one exists at a time.
class WorkloadFile {
 public:
  WorkloadFile() = default;
  /// Creates `path` (absolute, must not exist) of `bytes`. Throws MemmapError / runtime_error.
  WorkloadFile(const std::string& path, size_t bytes);
  ~WorkloadFile();
  WorkloadFile(WorkloadFile&& other) noexcept;
  WorkloadFile& operator=(WorkloadFile&& other) noexcept;
  WorkloadFile(const WorkloadFile&) = delete;
  WorkloadFile& operator=(const WorkloadFile&) = delete;
  const std::string& path() const noexcept { return path_; }

 private:
  void remove() noexcept;
  std::string path_;
};

}  // namespace tdshm::bench::detail
