// The raw floors of the ping-pong benchmark (spin and futex ping-pong over the shared payload
// buffers), the spin floor behind c10d's API, the memcpy ceiling, and ping-pong over any c10d
// process group (pingpong_floors.h).

#include "pingpong_floors.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace tdshm::bench::detail {

namespace {

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

// ---- the floors ----

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
