// The versioned board (include/tdshm/board.h): the writer's publish and the readers' pins,
// copies and waits (the file and its state: board_state.h; creating and opening: board_file.cpp).
//
// Protocol: `latest` holds (version << 8 | buffer). The writer picks a buffer that is neither the
// latest nor pinned by a live reader, stamps it "writing", writes, stamps it with the version and
// publishes it (seq_cst). A view pins the latest buffer (seq_cst) and checks `latest` again: the
// writer's check of the pins then sees the pin (a Dekker pair), so it never writes a pinned
// buffer. A copy pins the same way while it copies; where it cannot (the writer, or a reader
// whose pins all hold views) it reads as a seqlock reader does (stamp, bytes, fence, stamp).

#include "board/board_state.h"

#include "shm/parts/futex.h"
#include "shm/parts/spin.h"
#include "tensordict/impl.h"

#include <ATen/ops/zeros.h>

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace tdshm {

using detail::BoardState;

namespace detail {

namespace {
std::atomic<uint32_t> g_forks{0};
void count_fork_in_child() noexcept { g_forks.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint32_t board_file::fork_generation() noexcept {
  static const bool registered = [] { return ::pthread_atfork(nullptr, nullptr, &count_fork_in_child) == 0; }();
  (void)registered;
  return g_forks.load(std::memory_order_relaxed);
}

std::chrono::steady_clock::time_point board_file::deadline_after(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point now = Clock::now();
  // Past a century (timedelta.max, say) the sum overflows the clock's nanoseconds: forever.
  if (timeout > std::chrono::hours(24 * 365 * 100)) return Clock::time_point::max();
  return now + timeout;
}

// A buffer the writer may write: neither the latest nor pinned by a live reader (one always
// exists: see BoardState).
uint32_t BoardState::free_buffer(const char* what) {
  if (!writer)
    throw Error(std::string("tdshm::Board::") + what +
                ": this Board is a reader (Board::open); the writer made it with create");
  if (open_buffer >= 0) throw Error(std::string("tdshm::Board::") + what + ": a begin() is open; commit() it first");
  const uint64_t latest = header->latest.load(std::memory_order_relaxed);  // only this writer stores it
  // The lowest free buffer: without views the writer alternates between two, so the board's bytes
  // stay in the caches (a round robin over all 2 x readers + 2 let them fall out of a 32 MiB L3
  // with 4 MiB trees, and readers' copies took 1.5x as long). Copies pin, so none is overtaken.
  for (uint32_t c = 0; c < header->buffers; ++c) {
    if (latest != 0 && c == (latest & 0xff)) continue;
    if (!pinned(c)) {
      head(c).stamp.store(kWriting, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);  // the stamp before any byte (copy readers)
      return c;
    }
  }
  throw Error(std::string("tdshm::Board::") + what + ": every buffer is held (a reader broke the protocol)");
}

// Publishes buffer `chosen`, written since free_buffer, as the next version.
uint64_t BoardState::publish_buffer(uint32_t chosen) {
  const uint64_t version = next_version++;
  head(chosen).stamp.store(version, std::memory_order_release);
  header->latest.store(version << 8 | chosen, std::memory_order_seq_cst);
  header->wake.store(static_cast<uint32_t>(version), std::memory_order_seq_cst);
  if (header->sleepers.load(std::memory_order_seq_cst) != 0) shm::futex_wake_all(header->wake);
  return version;
}

// Claims one of this reader's pins that holds nothing (a claim names no buffer, so threads of one
// reader never share a pin); nullptr for the writer and when every pin holds a view.
std::atomic<uint32_t>* BoardState::free_pin() {
  if (mine == nullptr) return nullptr;
  for (auto& p : mine->pins) {
    uint32_t expected = 0;
    if (p.compare_exchange_strong(expected, kPinClaimed, std::memory_order_acquire)) return &p;
  }
  return nullptr;
}

// Pins the newest version's buffer with `pin` (claimed by free_pin) and returns (version << 8 |
// buffer); 0 before the first version. The writer writes no buffer pinned so: it publishes and
// then reads the pins, this stores the pin and then reads `latest` again (both seq_cst).
uint64_t BoardState::pin_latest(std::atomic<uint32_t>& pin, const char* what) {
  uint64_t latest = 0;
  for (;;) {
    latest = header->latest.load(std::memory_order_seq_cst);
    if (latest == 0) return 0;
    const uint32_t b = static_cast<uint32_t>(latest & 0xff);
    if (b >= header->buffers) {
      throw TransportError(std::string("tdshm::Board::") + what + ": the board names buffer " + std::to_string(b));
    }
    pin.store(b + 1, std::memory_order_seq_cst);
    if (header->latest.load(std::memory_order_seq_cst) == latest) break;
  }
  const uint32_t b = static_cast<uint32_t>(latest & 0xff);
  if (head(b).stamp.load(std::memory_order_acquire) != latest >> 8) {
    throw TransportError(std::string("tdshm::Board::") + what + ": buffer " + std::to_string(b) +
                         " does not hold the version published");
  }
  return latest;
}

// The newest version's bytes as one uint8 tensor, pinned by one of this reader's pins until the
// tensor (and every view of it) is dropped (Board::view, view_leaves).
at::Tensor BoardState::pin_newest(const std::shared_ptr<BoardState>& self) {
  if (mine == nullptr) throw Error("tdshm::Board::view: the writer has no reader slot; views are for readers");
  std::atomic<uint32_t>* pin = free_pin();
  if (pin == nullptr) {
    throw Error("tdshm::Board::view: this reader holds " + std::to_string(Board::kPinsPerReader) +
                " versions as views already; drop one (or copy with read())");
  }
  PinRelease release{pin};
  const uint64_t latest = pin_latest(*pin, "view");
  if (latest == 0) throw Error("tdshm::Board::view: nothing published yet (wait_newer(0, ...) first)");
  const uint32_t b = static_cast<uint32_t>(latest & 0xff);
  // One storage over the buffer's bytes: the pin goes when the last view of it is dropped.
  at::Tensor storage = at::from_blob(
      bytes(b), {static_cast<int64_t>(header->tree_bytes)},
      [keep = self, pin](void*) {
        if (!keep->inherited()) pin->store(0, std::memory_order_release);  // a forked child's copy: the parent's pin
      },
      at::TensorOptions().dtype(at::kByte));
  release.pin = nullptr;  // the storage's deleter frees it now
  return storage;
}

}  // namespace detail

uint64_t Board::publish(const TensorDict& td) {
  BoardState& s = state("publish");
  s.check_process("publish");
  s.check_tree(td, "publish");
  const std::lock_guard one_at_a_time(s.writing);
  const uint32_t chosen = s.free_buffer("publish");
  for (const detail::Leaf& l : s.leaves) s.copy_leaf(chosen, l, td.get(l.key), /*to_tree=*/false);
  return s.publish_buffer(chosen);
}

TensorDict Board::begin() {
  BoardState& s = state("begin");
  s.check_process("begin");
  const std::lock_guard one_at_a_time(s.writing);
  const uint32_t chosen = s.free_buffer("begin");
  s.open_buffer = static_cast<int64_t>(chosen);
  auto keep = state_;  // the mapping lives as long as the tree
  at::Tensor storage = at::from_blob(
      s.bytes(chosen), {static_cast<int64_t>(s.header->tree_bytes)}, [keep](void*) {},
      at::TensorOptions().dtype(at::kByte));
  return TensorDict::from_consolidated(storage, s.schema);
}

uint64_t Board::commit() {
  BoardState& s = state("commit");
  s.check_process("commit");
  const std::lock_guard one_at_a_time(s.writing);
  if (s.open_buffer < 0) throw Error("tdshm::Board::commit: no begin() is open");
  const auto chosen = static_cast<uint32_t>(s.open_buffer);
  s.open_buffer = -1;
  return s.publish_buffer(chosen);
}

uint64_t Board::version() const { return state("version").header->latest.load(std::memory_order_acquire) >> 8; }

uint64_t Board::read(TensorDict& td) {
  BoardState& s = state("read");
  s.check_process("read");
  s.check_tree(td, "read");
  if (std::atomic<uint32_t>* pin = s.free_pin()) {
    const detail::PinRelease release{pin};
    const uint64_t latest = s.pin_latest(*pin, "read");
    if (latest == 0) return 0;
    const auto b = static_cast<uint32_t>(latest & 0xff);
    for (const detail::Leaf& l : s.leaves) s.copy_leaf(b, l, td.get(l.key), /*to_tree=*/true);
    return latest >> 8;
  }
  for (;;) {
    const uint64_t latest = s.header->latest.load(std::memory_order_acquire);
    if (latest == 0) return 0;
    const uint32_t b = static_cast<uint32_t>(latest & 0xff);
    const uint64_t version = latest >> 8;
    if (b >= s.header->buffers) throw TransportError("tdshm::Board::read: the board names buffer " + std::to_string(b));
    detail::BufferHead& head = s.head(b);
    if (head.stamp.load(std::memory_order_acquire) != version) continue;  // rewritten meanwhile: newer exists
    for (const detail::Leaf& l : s.leaves) s.copy_leaf(b, l, td.get(l.key), /*to_tree=*/true);
    std::atomic_thread_fence(std::memory_order_acquire);  // the bytes before the stamp's second read
    if (head.stamp.load(std::memory_order_relaxed) == version) return version;
  }
}

// (The schema was validated against tree_bytes, the pinned storage's size, when the board was
// made or opened.)
TensorDict Board::view() {
  state("view").check_process("view");
  return detail::from_checked_consolidated(state_->pin_newest(state_), state_->schema, state_->fingerprint);
}

std::vector<std::pair<Key, at::Tensor>> Board::view_leaves() {
  state("view").check_process("view");
  const at::Tensor storage = state_->pin_newest(state_);
  std::vector<std::pair<Key, at::Tensor>> out;
  out.reserve(state_->leaves.size());
  for (const detail::Leaf& l : state_->leaves) {
    out.emplace_back(l.key, detail::view_into(storage, l.tensor.start, l.tensor.dtype, l.tensor.shape));
  }
  return out;
}

uint64_t Board::wait_newer(uint64_t version, std::chrono::milliseconds timeout) {
  BoardState& s = state("wait_newer");
  s.check_process("wait_newer");
  const auto until = detail::deadline_after(timeout);
  // A version due soon is seen at once; one that is not costs spin of a CPU, then nothing.
  // (In microseconds: a timeout of milliseconds::max does not fit the clock's nanoseconds.)
  const auto spin_for =
      std::max(std::chrono::microseconds(0),
               std::min(s.spin, std::chrono::duration_cast<std::chrono::microseconds>(
                                    std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(1)))));
  const auto spin_until = std::chrono::steady_clock::now() + spin_for;
  for (uint32_t i = 0;; ++i) {
    if (const uint64_t v = this->version(); v > version) return v;
    detail::cpu_relax();
    if ((i & 63) == 63 &&
        (std::chrono::steady_clock::now() >= spin_until || s.header->closed.load(std::memory_order_relaxed) != 0)) {
      break;  // the checks below say why there is nothing newer to wait for
    }
  }
  for (;;) {
    const uint64_t now_version = this->version();
    if (now_version > version) return now_version;
    // Closed or dead before timed out: a reader that polls (timeout 0) is told there is no writer.
    if (!s.writer && s.header->closed.load(std::memory_order_seq_cst) != 0) {
      throw PeerLostError("tdshm::Board::wait_newer: the writer of board '" + s.name + "' closed it at version " +
                          std::to_string(now_version) + ": no newer version will come; Board::open the name again " +
                          "for its next writer's");
    }
    if (!s.writer && !s.writer_alive()) {
      // Its file gets no newer version: a new writer of the name makes a new one.
      throw PeerLostError("tdshm::Board::wait_newer: the writer of board '" + s.name + "' (pid " +
                          std::to_string(s.header->writer_pid) + ") died at version " + std::to_string(now_version) +
                          ": no newer version will come; Board::open the name again for its next writer's");
    }
    const auto left = until - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero()) {
      throw TimeoutError("tdshm::Board::wait_newer: no version newer than " + std::to_string(version) + " within " +
                         std::to_string(timeout.count()) + " ms");
    }
    s.header->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t word = s.header->wake.load(std::memory_order_seq_cst);
    if (this->version() <= version && s.header->closed.load(std::memory_order_seq_cst) == 0) {
      shm::futex_wait(s.header->wake, word, std::min<std::chrono::nanoseconds>(left, std::chrono::milliseconds(100)));
    }
    s.header->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

TensorDict Board::like() const {
  const BoardState& s = state("like");
  TensorDict zeros =
      TensorDict::from_consolidated(at::zeros({static_cast<int64_t>(s.header->tree_bytes)}, at::kByte), s.schema)
          .clone();
  zeros.unlock_();
  return zeros;
}

const std::string& Board::name() const noexcept {
  static const std::string none;
  return state_ ? state_->name : none;
}
bool Board::is_writer() const noexcept { return state_ && state_->writer; }
bool Board::is_closed() const noexcept { return !state_; }

BoardState& Board::state(const char* what) const {
  if (!state_) throw Error(std::string("tdshm::Board::") + what + ": the board was closed (or moved from)");
  return *state_;
}

void Board::close() noexcept { Board gone(std::move(*this)); }

}  // namespace tdshm
