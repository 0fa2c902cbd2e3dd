// The Link between the two ranks, the raw floors (spin and futex ping-pong over a shared
// mapping), the memcpy ceiling, and ping-pong over any c10d process group.

#include "pingpong_internal.h"

#include "shm/spin.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace tdshm::bench::detail {

namespace {

using Clock = std::chrono::steady_clock;

using tdshm::detail::cpu_relax;  // shm/spin.h

// Non-private futex operations: the word lives in a MAP_SHARED mapping of two processes.
long futex_wait(uint32_t* word, uint32_t seen, std::chrono::nanoseconds timeout) noexcept {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
  return ::syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(uint32_t* word) noexcept { ::syscall(SYS_futex, word, FUTEX_WAKE, 1, nullptr, nullptr, 0); }

uint32_t load_acquire(uint32_t& word) noexcept {
  // Pairs with the release store in post_word / Link::sync / Link::abort of the other rank.
  return std::atomic_ref<uint32_t>(word).load(std::memory_order_acquire);
}

// A page-aligned, zeroed buffer. The floors and the ceiling copy between page-aligned buffers
// because glibc's memcpy (rep movsb on CPUs with FSRM) runs an order of magnitude slower when
// the destination is 1 to 16 bytes past the source modulo 4096: measured on an AMD EPYC (Zen 3)
// VM, 64 KiB at 2.8 GB/s instead of 46. Two std::vectors allocated one after the other land
// exactly there (16 bytes apart), which made the "ceiling" slower than the floors.
class PageBuffer {
 public:
  PageBuffer() = default;
  explicit PageBuffer(size_t bytes)
      : data_(static_cast<uint8_t*>(std::aligned_alloc(kPage, std::max(kPage, (bytes + kPage - 1) / kPage * kPage)))),
        bytes_(bytes) {
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(data_.get(), 0, bytes);  // faults every page in now, outside the timed loop
  }
  uint8_t* data() const noexcept { return data_.get(); }
  size_t size() const noexcept { return bytes_; }
  bool operator==(const PageBuffer& other) const noexcept {
    return bytes_ == other.bytes_ && std::memcmp(data(), other.data(), bytes_) == 0;
  }

 private:
  static constexpr size_t kPage = 4096;
  struct Free {
    void operator()(uint8_t* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t bytes_ = 0;
};

}  // namespace

// ---- the payload pattern ----

namespace {
uint8_t pattern_byte(size_t i, size_t seed) noexcept { return static_cast<uint8_t>((i * 131 + seed * 7 + 1) & 0xff); }
}  // namespace

void fill_pattern(uint8_t* p, size_t n, size_t seed) noexcept {
  for (size_t i = 0; i < n; ++i) p[i] = pattern_byte(i, seed);
}

bool has_pattern(const uint8_t* p, size_t n, size_t seed) noexcept {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != pattern_byte(i, seed)) return false;
  }
  return true;
}

// ---- Link ----

Link::Link(ControlBlock* block, int rank, pid_t peer, bool peer_on_own_cpu, const std::atomic<int>* peer_exit_status)
    : block_(block), rank_(rank), peer_(peer), peer_on_own_cpu_(peer_on_own_cpu), peer_exit_status_(peer_exit_status) {}

void Link::check_peer() {
  if (load_acquire(block_->aborted.value) != 0) {
    const std::string why = peer_error();
    throw PeerFailed("rank " + std::to_string(1 - rank_) + " gave up" + (why.empty() ? "" : ": " + why));
  }
  if (rank_ == 0) {
    const int status = peer_exit_status_ != nullptr ? peer_exit_status_->load(std::memory_order_acquire) : -1;
    if (status >= 0) {
      throw PeerFailed("rank 1 died (" +
                       (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                            : "exit code " + std::to_string(WEXITSTATUS(status))) +
                       ")");
    }
  } else if (::getppid() != peer_) {
    throw PeerFailed("rank 0 died");
  }
}

bool Link::sync(bool ok, std::chrono::milliseconds deadline) {
  ++generation_;
  // Two slots per rank, used by turns: the peer can be at most one sync ahead (it waits for this
  // rank at the next one), so it never overwrites the slot this rank is about to read.
  const unsigned slot = generation_ & 1u;
  const uint32_t mine = (generation_ << 1) | (ok ? 1u : 0u);
  // Release: what this rank wrote before (port, error message) is visible to the peer's
  // acquire load of this slot.
  std::atomic_ref<uint32_t>(block_->arrived[rank_][slot].value).store(mine, std::memory_order_release);
  futex_wake(&block_->arrived[rank_][slot].value);
  uint32_t* theirs = &block_->arrived[1 - rank_][slot].value;
  const auto end = Clock::now() + deadline;
  for (;;) {
    const uint32_t seen = load_acquire(*theirs);
    if ((seen >> 1) == generation_) return ok && (seen & 1u) != 0;
    check_peer();
    if (Clock::now() > end) throw PeerFailed("timed out waiting for the other rank at a synchronisation point");
    futex_wait(theirs, seen, std::chrono::milliseconds(20));
  }
}

void Link::set_error(const std::string& why) noexcept {
  char* dst = block_->error[rank_];
  const size_t n = std::min(why.size(), sizeof(block_->error[0]) - 1);
  std::memcpy(dst, why.data(), n);
  dst[n] = '\0';
}

void Link::abort(const std::string& why) noexcept {
  set_error(why);
  // Release: the message above is visible to a peer that sees aborted != 0.
  std::atomic_ref<uint32_t>(block_->aborted.value).store(1, std::memory_order_release);
  // Wake the peer wherever it sleeps, so it notices now rather than at its next timeout.
  for (SharedWord* w : {&block_->arrived[rank_][0], &block_->arrived[rank_][1], &block_->futex_seq[0],
                        &block_->futex_seq[1]}) {
    ::syscall(SYS_futex, &w->value, FUTEX_WAKE, 2, nullptr, nullptr, 0);
  }
}

std::string Link::peer_error() const {
  const char* src = block_->error[1 - rank_];
  return std::string(src, ::strnlen(src, sizeof(block_->error[0])));
}

// ---- waiting on a word ----

void wait_for_word(uint32_t& word, uint32_t expected, WaitMode mode, Link& link, std::chrono::milliseconds deadline) {
  if (mode == WaitMode::spin) {
    // Check the peer and the clock every 2^14 spins only: on the hot path a spin is one load.
    const bool yield = !link.peer_on_own_cpu();
    Clock::time_point end{};
    for (uint64_t spins = 1;; ++spins) {
      if (load_acquire(word) == expected) return;
      cpu_relax();
      if (yield && (spins & 63) == 0) ::sched_yield();
      if ((spins & ((1u << 14) - 1)) == 0) {
        if (spins == (1u << 14)) end = Clock::now() + deadline;
        link.check_peer();
        if (Clock::now() > end) throw PeerFailed("timed out in the spin floor");
      }
    }
  }
  const auto end = Clock::now() + deadline;
  for (;;) {
    const uint32_t seen = load_acquire(word);
    if (seen == expected) return;
    if (futex_wait(&word, seen, std::chrono::milliseconds(50)) == -1 && errno == ETIMEDOUT) {
      link.check_peer();
      if (Clock::now() > end) throw PeerFailed("timed out in the futex floor");
    }
  }
}

void post_word(uint32_t& word, uint32_t value, WaitMode mode) {
  // Release: the payload copied before this store is visible to the acquire load in the peer's
  // wait_for_word that sees `value`.
  std::atomic_ref<uint32_t>(word).store(value, std::memory_order_release);
  if (mode == WaitMode::futex) futex_wake(&word);
}

// ---- the floors ----

namespace {

// Rank 0 copies the message into payload[0] and bumps seq[0]; rank 1 waits for it, copies the
// message out into its own buffer, copies that into payload[1] and bumps seq[1]; rank 0 waits
// for it and copies the echo out. Each one-way trip is thus one copy in and one copy out, as in
// any shared-memory transport that owns its buffers.
class FloorPingPong final : public PingPong {
 public:
  FloorPingPong(Link& link, WaitMode mode, uint8_t* payload0, uint8_t* payload1)
      : link_(link), mode_(mode), out_(link.rank() == 0 ? payload0 : payload1),
        in_(link.rank() == 0 ? payload1 : payload0) {
    SharedWord* seq = mode == WaitMode::spin ? link.block().spin_seq : link.block().futex_seq;
    out_seq_ = &seq[link.rank()].value;
    in_seq_ = &seq[1 - link.rank()].value;
  }

  void prepare(const Workload& workload) override {
    const size_t bytes = workload.bytes;
    bytes_ = bytes;
    src_ = PageBuffer(bytes);
    fill_pattern(src_.data(), bytes, bytes);
    dst_ = PageBuffer(bytes);
  }

  void ping() override {
    std::memcpy(out_, src_.data(), bytes_);
    post_word(*out_seq_, ++seq_, mode_);
    wait_for_word(*in_seq_, seq_, mode_, link_);
    std::memcpy(dst_.data(), in_, bytes_);
  }

  void pong() override {
    wait_for_word(*in_seq_, ++seq_, mode_, link_);
    std::memcpy(dst_.data(), in_, bytes_);
    std::memcpy(out_, dst_.data(), bytes_);
    post_word(*out_seq_, seq_, mode_);
  }

  bool verify() const override { return src_ == dst_; }

 private:
  Link& link_;
  WaitMode mode_;
  uint8_t* out_;
  uint8_t* in_;
  uint32_t* out_seq_ = nullptr;
  uint32_t* in_seq_ = nullptr;
  uint32_t seq_ = 0;  // round trips so far; both ranks count the same
  size_t bytes_ = 0;
  PageBuffer src_, dst_;
};

// The spin floor behind c10d's API. Messages go in order (a ping-pong has one in flight each
// way), so tags are not matched; the sequence words are c10d_seq, apart from the spin floor's
// (each transport counts its own round trips from 0).
class SpinFloorGroup final : public c10d::ProcessGroup {
 public:
  SpinFloorGroup(Link& link, uint8_t* payload0, uint8_t* payload1, size_t capacity)
      : c10d::ProcessGroup(link.rank(), 2), link_(link), out_(link.rank() == 0 ? payload0 : payload1),
        in_(link.rank() == 0 ? payload1 : payload0), capacity_(capacity),
        out_seq_(&link.block().c10d_seq[link.rank()].value), in_seq_(&link.block().c10d_seq[1 - link.rank()].value) {}

  const std::string getBackendName() const override { return "c10d-spin"; }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int, int) override {
    const at::Tensor& t = tensors.at(0);
    const size_t bytes = t.nbytes();
    TORCH_CHECK(bytes <= capacity_, "c10d-spin: a message of ", bytes, " bytes does not fit the ", capacity_,
                "-byte payload buffer");
    std::memcpy(out_, t.data_ptr(), bytes);
    post_word(*out_seq_, ++sent_, WaitMode::spin);
    return c10::make_intrusive<DoneWork>();
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int, int) override {
    return c10::make_intrusive<RecvWork>(*this, tensors.at(0), ++posted_);
  }

 private:
  class DoneWork final : public c10d::Work {
   public:
    DoneWork() : c10d::Work(-1, c10d::OpType::SEND) {}
    bool isCompleted() override { return true; }
    bool isSuccess() const override { return true; }
    bool wait(std::chrono::milliseconds) override { return true; }
  };

  class RecvWork final : public c10d::Work {
   public:
    RecvWork(SpinFloorGroup& group, at::Tensor dst, uint32_t seq)
        : c10d::Work(-1, c10d::OpType::RECV), group_(group), dst_(std::move(dst)), seq_(seq) {}
    bool isCompleted() override { return done_; }
    bool isSuccess() const override { return done_; }
    bool wait(std::chrono::milliseconds) override {
      if (!done_) {
        wait_for_word(*group_.in_seq_, seq_, WaitMode::spin, group_.link_);
        std::memcpy(dst_.data_ptr(), group_.in_, dst_.nbytes());
        done_ = true;
      }
      return true;
    }

   private:
    SpinFloorGroup& group_;
    at::Tensor dst_;
    uint32_t seq_;
    bool done_ = false;
  };

  Link& link_;
  uint8_t* out_;
  uint8_t* in_;
  size_t capacity_;
  uint32_t* out_seq_;
  uint32_t* in_seq_;
  uint32_t sent_ = 0, posted_ = 0;
};

class MemcpyPingPong final : public PingPong {
 public:
  void prepare(const Workload& workload) override {
    const size_t bytes = workload.bytes;
    src_ = PageBuffer(bytes);
    fill_pattern(src_.data(), bytes, bytes);
    dst_ = PageBuffer(bytes);
  }
  void ping() override {
    std::memcpy(dst_.data(), src_.data(), src_.size());
    // The copy must happen now, not be folded into verify() or dropped.
    asm volatile("" : : "r"(dst_.data()) : "memory");
  }
  void pong() override {}
  bool verify() const override { return src_ == dst_; }
  bool single_process() const override { return true; }

 private:
  PageBuffer src_, dst_;
};

class C10dPingPong final : public PingPong {
 public:
  explicit C10dPingPong(c10::intrusive_ptr<c10d::ProcessGroup> group) : group_(std::move(group)) {}

  void prepare(const Workload& workload) override {
    const size_t bytes = workload.bytes;
    const auto n = static_cast<int64_t>(bytes);
    src_ = {at::empty({n}, at::kByte)};
    dst_ = {at::empty({n}, at::kByte)};
    fill_pattern(src_[0].data_ptr<uint8_t>(), bytes, bytes);
    std::memset(dst_[0].data_ptr<uint8_t>(), 0, bytes);
  }

  void ping() override {
    group_->send(src_, 1, kTag)->wait();
    group_->recv(dst_, 1, kTag)->wait();
  }

  void pong() override {
    group_->recv(dst_, 0, kTag)->wait();
    group_->send(dst_, 0, kTag)->wait();
  }

  bool verify() const override {
    return std::memcmp(src_[0].data_ptr(), dst_[0].data_ptr(), static_cast<size_t>(src_[0].numel())) == 0;
  }

 private:
  static constexpr int kTag = 7;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<at::Tensor> src_, dst_;
};

}  // namespace

std::unique_ptr<PingPong> make_floor_pingpong(Link& link, WaitMode mode, uint8_t* payload0, uint8_t* payload1) {
  return std::make_unique<FloorPingPong>(link, mode, payload0, payload1);
}

c10::intrusive_ptr<c10d::ProcessGroup> make_spin_floor_group(Link& link, uint8_t* payload0, uint8_t* payload1,
                                                             size_t capacity) {
  return c10::make_intrusive<SpinFloorGroup>(link, payload0, payload1, capacity);
}

std::unique_ptr<PingPong> make_memcpy_pingpong() { return std::make_unique<MemcpyPingPong>(); }

std::unique_ptr<PingPong> make_c10d_pingpong(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_unique<C10dPingPong>(std::move(group));
}

}  // namespace tdshm::bench::detail
