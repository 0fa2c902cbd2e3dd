// The transport under test: tdshm::ProcessGroupShm, in its spinning and blocking-only modes.

#include "pingpong_shm.h"

#include <tdshm/process_group.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace tdshm::bench::detail {

std::chrono::microseconds default_shm_spin() { return ShmOptions{}.spin; }

c10::intrusive_ptr<c10d::ProcessGroup> make_shm_group(const std::string& name, int rank,
                                                      std::chrono::microseconds spin,
                                                      std::chrono::milliseconds timeout) {
  ShmOptions options;
  options.spin = spin;
  options.timeout = timeout;
  return c10::make_intrusive<ProcessGroupShm>(name, rank, 2, options);
}

namespace {

class LoanPingPong final : public PingPong {
 public:
  LoanPingPong(c10::intrusive_ptr<ProcessGroupShm> group) : group_(std::move(group)) {}

  void prepare(const Workload& workload) override {
    bytes_ = workload.bytes;
    out_.clear();
    sent_.reset();
    mine_ = at::Tensor();  // the previous row's loan goes back to the heap first
    mine_ = group_->loan({static_cast<int64_t>(bytes_)}, at::kByte);
    fill_pattern(mine_.data_ptr<uint8_t>(), bytes_, bytes_);
    out_ = {mine_};
    ok_ = true;
  }

  void ping() override {
    group_->send(out_, 1, kTag);  // completes once rank 1 dropped its view (before replying)
    check(group_->recv_view(1, kTag));
  }

  void pong() override {
    check(group_->recv_view(0, kTag));
    sent_ = group_->send(out_, 0, kTag);  // rank 0 drops its view before the next ping
  }

  bool verify() const override { return ok_; }

 private:
  static constexpr int kTag = 9;
  // The view holds the sender's pattern at its ends and middle (every byte: verify's echo of the
  // other transports reads them all, which would make this one size-dependent).
  void check(const at::Tensor& view) {
    const auto* p = view.data_ptr<uint8_t>();
    const uint8_t* want = mine_.data_ptr<uint8_t>();
    if (bytes_ != 0 && (p[0] != want[0] || p[bytes_ / 2] != want[bytes_ / 2] || p[bytes_ - 1] != want[bytes_ - 1])) {
      ok_ = false;
    }
  }

  c10::intrusive_ptr<ProcessGroupShm> group_;
  size_t bytes_ = 0;
  at::Tensor mine_;
  std::vector<at::Tensor> out_;  // {mine_}, as c10d takes it
  c10::intrusive_ptr<c10d::Work> sent_;
  bool ok_ = true;
};

}  // namespace

std::unique_ptr<PingPong> make_loan_pingpong(const std::string& name, int rank, size_t max_bytes,
                                             std::chrono::milliseconds timeout) {
  ShmOptions options;
  options.timeout = timeout;
  options.loan_bytes = std::max<size_t>(max_bytes, 4096) + 4096;
  return std::make_unique<LoanPingPong>(c10::make_intrusive<ProcessGroupShm>(name, rank, 2, options));
}

void remove_shm_segment(const std::string& name) noexcept {
  try {
    remove_stale_segment(name);
  } catch (...) {
    // A segment still in use by a live rank is not ours to remove; nothing else can be done.
  }
}

}  // namespace tdshm::bench::detail
