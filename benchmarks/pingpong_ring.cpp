// The ring floor of the ping-pong benchmark (pingpong_ring.h): a single-producer,
// single-consumer ring of cache-line elements per direction, flag inline.

#include "pingpong_ring.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cstring>
#include <vector>

namespace tdshm::bench::detail {

namespace {

// Writes messages into one direction's ring.
class RingProducer {
 public:
  RingProducer(RingDirection& ring, Link& link) : ring_(ring), link_(link) {}

  void send(const uint8_t* p, size_t bytes) {
    size_t off = 0;
    do {
      const size_t n = std::min(RingLine::kPayload, bytes - off);
      RingLine& line = claim();
      if (n == RingLine::kPayload) {
        std::memcpy(line.payload, p + off, RingLine::kPayload);  // a constant size: inlined moves
      } else {
        std::memcpy(line.payload, p + off, n);
      }
      // Release: the payload above is visible to the consumer's acquire load that sees this seq.
      std::atomic_ref<uint32_t>(line.seq).store(static_cast<uint32_t>(++pos_), std::memory_order_release);
      off += n;
    } while (off < bytes);
  }

 private:
  // The next line, once the consumer has left it: the consumer's position is read only when
  // the ring looks full from what was last read of it.
  RingLine& claim() {
    for (uint64_t spins = 1; pos_ - consumed_ >= RingDirection::kLines; ++spins) {
      const uint32_t seen = std::atomic_ref<uint32_t>(ring_.consumed.value).load(std::memory_order_acquire);
      consumed_ = pos_ - static_cast<uint32_t>(static_cast<uint32_t>(pos_) - seen);
      if ((spins & 63) == 0) idle(spins);
    }
    return ring_.lines[pos_ % RingDirection::kLines];
  }

  // A full ring's wait, now and then: as wait_for_word's (yield where the ranks share a CPU,
  // check the peer and a deadline).
  void idle(uint64_t spins) {
    if (!link_.peer_on_own_cpu()) ::sched_yield();
    if ((spins & ((1u << 14) - 1)) == 0) {
      if (spins == (1u << 14)) end_ = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      link_.check_peer();
      if (std::chrono::steady_clock::now() > end_) throw PeerFailed("timed out in the ring floor (ring full)");
    }
  }

  RingDirection& ring_;
  Link& link_;
  uint64_t pos_ = 0;       // lines written
  uint64_t consumed_ = 0;  // lines the consumer had consumed when last read
  std::chrono::steady_clock::time_point end_{};
};

// Reads messages out of one direction's ring.
class RingConsumer {
 public:
  RingConsumer(RingDirection& ring, Link& link) : ring_(ring), link_(link) {}

  void recv(uint8_t* p, size_t bytes) {
    size_t off = 0;
    do {
      const size_t n = std::min(RingLine::kPayload, bytes - off);
      RingLine& line = ring_.lines[pos_ % RingDirection::kLines];
      wait_for_word(line.seq, static_cast<uint32_t>(pos_ + 1), WaitMode::spin, link_);
      if (n == RingLine::kPayload) {
        std::memcpy(p + off, line.payload, RingLine::kPayload);
      } else {
        std::memcpy(p + off, line.payload, n);
      }
      ++pos_;
      if (pos_ % (RingDirection::kLines / 4) == 0) {
        // Release: the lines read above may be overwritten once the producer sees this.
        std::atomic_ref<uint32_t>(ring_.consumed.value).store(static_cast<uint32_t>(pos_), std::memory_order_release);
      }
      off += n;
    } while (off < bytes);
  }

 private:
  RingDirection& ring_;
  Link& link_;
  uint64_t pos_ = 0;  // lines read
};

// Rank 0 sends the row's messages (one per leaf) and receives them back; rank 1 receives them
// all into one buffer and sends that buffer back, message by message.
class RingPingPong final : public PingPong {
 public:
  RingPingPong(Link& link, RingDirection* rings)
      : out_(rings[link.rank()], link), in_(rings[1 - link.rank()], link) {}

  void prepare(const Workload& workload) override {
    messages_ = leaf_messages(workload);
    size_t total = 0;
    for (const size_t m : messages_) total += m;
    src_.assign(total, 0);
    fill_pattern(src_.data(), total, total);
    dst_.assign(total, 0);
  }

  void ping() override {
    send_all(src_.data());
    recv_all(dst_.data());
  }

  void pong() override {
    recv_all(dst_.data());
    send_all(dst_.data());
  }

  bool verify() const override { return src_ == dst_; }

 private:
  void send_all(const uint8_t* p) {
    for (const size_t m : messages_) {
      out_.send(p, m);
      p += m;
    }
  }
  void recv_all(uint8_t* p) {
    for (const size_t m : messages_) {
      in_.recv(p, m);
      p += m;
    }
  }

  RingProducer out_;
  RingConsumer in_;
  std::vector<size_t> messages_;
  std::vector<uint8_t> src_, dst_;
};

}  // namespace

std::unique_ptr<PingPong> make_ring_pingpong(Link& link, RingDirection* rings) {
  return std::make_unique<RingPingPong>(link, rings);
}

}  // namespace tdshm::bench::detail
