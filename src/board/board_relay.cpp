// A board across hosts (include/tdshm/board_relay.h). On the wire, per version and receiver, with
// kRelayTag: an int64 [1] frame (1: a version follows; 0: the sender stopped), then the tree's
// consolidated bytes. The receiver receives them straight into a free buffer of its board
// (Board::begin) and commits it.

#include "tdshm/board_relay.h"

#include <tdshm/errors.h>

#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace tdshm {
namespace detail {

class BoardRelayState {
 public:
  static constexpr int kRelayTag = 0x7b0a;

  ~BoardRelayState() { stop(); }

  void start_sender(const std::string& name, Group group, std::vector<int> receivers, BoardOptions options) {
    if (receivers.empty()) throw Error("tdshm::BoardRelay::sender: no receivers");
    for (int r : receivers) {
      if (r < 0 || r >= group.size() || r == group.rank()) {
        throw Error("tdshm::BoardRelay::sender: receiver " + std::to_string(r) + " is not another rank of the group");
      }
    }
    board_ = std::make_unique<Board>(Board::open(name, options));
    group_ = std::move(group);
    thread_ = std::thread([this, receivers = std::move(receivers)] { run([&] { send_loop(receivers); }); });
  }

  void start_receiver(const std::string& name, const TensorDict& like, Group group, int src, BoardOptions options) {
    if (src < 0 || src >= group.size() || src == group.rank()) {
      throw Error("tdshm::BoardRelay::receiver: source " + std::to_string(src) + " is not another rank of the group");
    }
    board_ = std::make_unique<Board>(Board::create(name, like, options));
    group_ = std::move(group);
    thread_ = std::thread([this, src] { run([&] { receive_loop(src); }); });
  }

  void stop() noexcept {
    stopping_.store(true);
    {
      std::lock_guard lk(mu_);
      if (pending_) {
        try {
          pending_->abort();  // a receiver waiting for its sender
        } catch (...) {
        }
      }
    }
    if (thread_.joinable()) thread_.join();
    board_.reset();
  }

  uint64_t count() const noexcept { return count_.load(); }
  bool stopped() const noexcept { return stopped_.load(); }
  std::string error() const {
    std::lock_guard lk(mu_);
    return error_;
  }
  uint64_t wait_count(uint64_t n, std::chrono::milliseconds timeout) const {
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, timeout, [&] { return count_.load() >= n || stopped_.load(); });
    return count_.load();
  }

 private:
  template <class F>
  void run(F&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      std::lock_guard lk(mu_);
      if (!stopping_.load()) error_ = e.what();
    }
    std::lock_guard lk(mu_);
    stopped_.store(true);
    cv_.notify_all();
  }

  // One message to or from group rank `peer`, waited for; a receive can be aborted by stop().
  void transfer(bool send, const at::Tensor& t, int peer) {
    std::vector<at::Tensor> one{t};
    c10::intrusive_ptr<c10d::Work> work =
        send ? group_.backend().send(one, peer, kRelayTag) : group_.backend().recv(one, peer, kRelayTag);
    {
      std::lock_guard lk(mu_);
      pending_ = work;
    }
    if (stopping_.load() && !send) work->abort();
    try {
      work->wait();
    } catch (...) {
      std::lock_guard lk(mu_);
      pending_.reset();
      throw;
    }
    std::lock_guard lk(mu_);
    pending_.reset();
  }

  void counted() {
    std::lock_guard lk(mu_);
    count_.fetch_add(1);
    cv_.notify_all();
  }

  void send_loop(const std::vector<int>& receivers) {
    const at::Tensor go = at::tensor(std::vector<int64_t>{1}, at::kLong);
    uint64_t last = 0;
    std::string lost;  // the board's writer died: the receivers end too, then error() says why
    while (!stopping_.load()) {
      try {
        last = board_->wait_newer(last, std::chrono::milliseconds(100));
      } catch (const TimeoutError&) {
        continue;
      } catch (const PeerLostError& e) {
        lost = e.what();
        break;
      }
      // The newest version, pinned while it is on the wire (a newer one may be it already).
      const TensorDict view = board_->view();
      const at::Tensor bytes = view.consolidated_storage();
      for (int r : receivers) {
        transfer(true, go, r);
        transfer(true, bytes, r);
      }
      counted();
    }
    const at::Tensor end = at::zeros({1}, at::kLong);
    for (int r : receivers) transfer(true, end, r);
    if (!lost.empty()) throw PeerLostError(lost);
  }

  void receive_loop(int src) {
    while (true) {
      const at::Tensor frame = at::zeros({1}, at::kLong);
      transfer(false, frame, src);
      const int64_t kind = frame.data_ptr<int64_t>()[0];
      if (kind == 0) return;  // the sender stopped
      if (kind != 1) throw TransportError("tdshm::BoardRelay: the sender sent frame " + std::to_string(kind));
      TensorDict slot = board_->begin();
      transfer(false, slot.consolidated_storage(), src);  // straight into a free buffer
      board_->commit();
      counted();
    }
  }

  std::unique_ptr<Board> board_;
  Group group_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};
  std::atomic<uint64_t> count_{0};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  c10::intrusive_ptr<c10d::Work> pending_;
  std::string error_;
};

}  // namespace detail

BoardRelay::BoardRelay(std::unique_ptr<detail::BoardRelayState> state) : state_(std::move(state)) {}
BoardRelay::BoardRelay(BoardRelay&&) noexcept = default;
BoardRelay& BoardRelay::operator=(BoardRelay&&) noexcept = default;
BoardRelay::~BoardRelay() = default;

BoardRelay BoardRelay::sender(const std::string& name, Group group, std::vector<int> receivers, BoardOptions options) {
  auto s = std::make_unique<detail::BoardRelayState>();
  s->start_sender(name, std::move(group), std::move(receivers), options);
  return BoardRelay(std::move(s));
}

BoardRelay BoardRelay::receiver(const std::string& name, const TensorDict& like, Group group, int src,
                                BoardOptions options) {
  auto s = std::make_unique<detail::BoardRelayState>();
  s->start_receiver(name, like, std::move(group), src, options);
  return BoardRelay(std::move(s));
}

uint64_t BoardRelay::count() const noexcept { return state_->count(); }
bool BoardRelay::stopped() const noexcept { return state_->stopped(); }
std::string BoardRelay::error() const { return state_->error(); }
uint64_t BoardRelay::wait_count(uint64_t n, std::chrono::milliseconds timeout) const {
  return state_->wait_count(n, timeout);
}

}  // namespace tdshm
