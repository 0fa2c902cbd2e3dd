#pragma once
// What every transport of the ping-pong benchmark is (pingpong.h describes the method): its entry
// in the table of transports (name, mode, description), the interface it implements (PingPong),
// the row it moves (Workload: a message of a size, or a TensorDict workload) and the byte pattern
// its payloads carry. The transports (pingpong_floors.h, pingpong_gloo.h, pingpong_shm.h,
// pingpong_td.h) sit above this file, the driver above them.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tdshm::bench::detail {

/// One transport as the tables, --transports and the JSON rows name it.
struct TransportInfo {
  const char* name;
  const char* mode;
  const char* what;
  bool sizes;  // measured in the size sweep (the default mode)
  bool td;     // measured in the TensorDict mode (--td)
};

// Table order, in each mode: the floors, the transport under test, the baseline, the ceiling.
inline constexpr TransportInfo kTransports[] = {
    {"spin", "spinning", "floor: sequence word on a shared cache line, peer spins; payload copied in and out", true, true},
    {"ring", "spinning", "floor: a ring of cache-line elements, sequence word inline (8 B moves one line); one message per leaf", true, true},
    {"futex", "blocking", "floor: the same, every wait sleeps in FUTEX_WAIT, every post calls FUTEX_WAKE", true, false},
    {"c10d-spin", "spinning", "floor through c10d: the spin floor's wire behind a c10d::ProcessGroup (send, recv, Work, wait)", true, false},
    {"shm", "spinning", "tdshm::ProcessGroupShm, waiters spin (default ShmOptions::spin, 250 us) then sleep on a futex", true, false},
    {"shm-blocking", "blocking", "tdshm::ProcessGroupShm with spin = 0 (waiters only sleep)", true, false},
    {"shm-loan", "spinning", "tdshm::ProcessGroupShm, loans sent by reference, received as views (no copy; docs/loans.md)", true, false},
    {"td-shm", "spinning", "TensorDict send/recv over tdshm::ProcessGroupShm (\"shm\") as a standalone Group", false, true},
    {"gloo", "tcp-loopback", "c10d::ProcessGroupGloo over TCP on 127.0.0.1", true, false},
    {"td-gloo", "tcp-loopback", "TensorDict send/recv over the same gloo group as a standalone Group", false, true},
    {"ucx-posix", "spinning", "UCX's ucx_perftest -t tag_lat, UCX_TLS=posix,self, pinned like the ranks (where installed)", true, false},
    {"memcpy", "single-process", "ceiling: one memcpy between two warm buffers in one process", true, true},
};

/// The transport called `name`. Throws std::invalid_argument for an unknown name.
const TransportInfo& transport_info(const std::string& name);
/// The names of the transports of the size sweep, or of the TensorDict mode (`td`), in table order.
std::vector<std::string> transport_names(bool td);

/// What one row of the table moves per one-way trip: a message of `bytes` (size mode), or a
/// TensorDict workload (--td), which the floors and the ceiling move as one message of `bytes`.
struct Workload {
  /// How the tensordict of a workload is made (see pingpong_td.cpp).
  enum class Tree {
    message,  ///< size mode: no tensordict
    seed,     ///< {("a","b"): 2 floats, "c": 2x3 floats, "_": 2x1x5 floats}, batch [2]
    uniform,  ///< `leaves` float leaves of `leaf_bytes` each, batch []
    memmap,   ///< one float leaf of `leaf_bytes` that maps `file` (both ranks map the same file)
    lazy_seed,  ///< a LazyStackedTensorDict of four seed trees (per leaf, the tags running on)
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
/// The messages a transport that sends one message per leaf moves for `workload`, in bytes: one
/// per leaf for per-leaf workloads, a single one of `bytes` otherwise (size mode, consolidated).
std::vector<size_t> leaf_messages(const Workload& workload);

/// Fills `p` with a byte pattern that depends on `seed`; has_pattern checks it.
void fill_pattern(uint8_t* p, size_t n, size_t seed) noexcept;
bool has_pattern(const uint8_t* p, size_t n, size_t seed) noexcept;

/// One round of a transport measured by another program: its one-way p50 and mean, in us.
struct ExternalRound {
  double p50_us = 0;
  double mean_us = 0;
};

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
  /// True for a transport that another program measures (UCX's ucx_perftest; it is also
  /// single_process(): rank 1 takes no part): the driver calls external_round() once per round
  /// instead of ping(), and gets no per-round-trip times.
  virtual bool external() const { return false; }
  /// `iters` round trips after `warmup` of the prepared row. Only when external().
  virtual ExternalRound external_round(int warmup, int iters);
};

}  // namespace tdshm::bench::detail
