// Point-to-point transfers of ProcessGroupShm: every dtype and awkward sizes around the slot size,
// non-contiguous sources and destinations, tag matching (out of order, FIFO per tag, any source),
// many small messages, ping-pong, a slow receiver, two ranks sending 256 MiB to each other at once,
// and blocking-only waits (spin = 0).
//
// Each scenario is a function of the rank; the tests run it with ranks as threads (ShmP2PThreads,
// also under TSan) and as forked processes (ShmP2PProcs).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/memmap.h>
#include <tdshm/process_group.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "process_group/shm_group_seam.h"
#include "shm_test_support.h"

namespace tdshm::test {

using detail::ShmGroupSeam;
namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kUnderTsan = true;
#else
constexpr bool kUnderTsan = false;
#endif

void send_wait(ProcessGroupShm& pg, const at::Tensor& t, int dst, int tag) { post_send(pg, t, dst, tag)->wait(); }

void recv_wait(ProcessGroupShm& pg, const at::Tensor& t, int src, int tag) { post_recv(pg, t, src, tag)->wait(); }

const std::vector<at::ScalarType>& all_dtypes() {
  static const std::vector<at::ScalarType> dtypes = {
      at::kFloat, at::kDouble, at::kHalf,  at::kBFloat16, at::kChar,         at::kShort,
      at::kInt,   at::kLong,   at::kByte,  at::kBool,     at::kComplexFloat, at::kComplexDouble};
  return dtypes;
}

/// Element counts whose byte sizes sit on the chunking edges: 0, 1, slot-1, slot, slot+1 and
/// 3*slot+7 bytes for 1-byte dtypes; the nearest whole elements for wider ones.
std::vector<int64_t> edge_numels(at::ScalarType dtype, size_t slot) {
  const auto e = static_cast<int64_t>(c10::elementSize(dtype));
  const auto s = static_cast<int64_t>(slot);
  std::vector<int64_t> n = e == 1 ? std::vector<int64_t>{0, 1, s - 1, s, s + 1, 3 * s + 7}
                                  : std::vector<int64_t>{0, 1, s / e - 1, s / e, s / e + 1, (3 * s + 7) / e + 1};
  n.erase(std::unique(n.begin(), n.end()), n.end());
  return n;
}

std::string describe_case(at::ScalarType dtype, const at::Tensor& values, Layout src, Layout dst, int tag) {
  std::ostringstream os;
  os << "tag " << tag << ": " << c10::toString(dtype) << " shape " << values.sizes() << " (" << values.nbytes()
     << " bytes), " << layout_name(src) << " -> " << layout_name(dst);
  return os.str();
}

/// Rank 0 sends `values` laid out as `src` to rank 1, which receives into `dst` layout, checks,
/// and sends what it received (in its layout) back; rank 0 receives that into `dst` layout too.
void echo_case(ProcessGroupShm& pg, const at::Tensor& values, Layout src, Layout dst, int tag) {
  const std::string what = describe_case(values.scalar_type(), values, src, dst, tag);
  if (pg.getRank() == 0) {
    const at::Tensor source = with_layout(values, src);
    send_wait(pg, source, 1, tag);
    const at::Tensor back = blank_like(values, dst);
    recv_wait(pg, back, 1, tag);
    SHM_CHECK(same_bytes(back, values), "echo differs, " << what);
    SHM_CHECK(same_bytes(source, values), "the source changed, " << what);
  } else {
    const at::Tensor received = blank_like(values, dst);
    recv_wait(pg, received, 0, tag);
    SHM_CHECK(same_bytes(received, values), "received bytes differ, " << what);
    send_wait(pg, received, 0, tag);
  }
}

/// Scenario: every dtype x every edge size x {contiguous, strided} source x {contiguous,
/// strided} destination, then 2-D transposed views across several slots.
void round_trip_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 2, opts);
  int tag = 0;
  for (at::ScalarType dtype : all_dtypes()) {
    for (int64_t numel : edge_numels(dtype, opts.slot_bytes)) {
      for (Layout src : {Layout::kContiguous, Layout::kStrided}) {
        for (Layout dst : {Layout::kContiguous, Layout::kStrided}) {
          ++tag;
          echo_case(pg, pattern(dtype, numel, static_cast<uint64_t>(tag)), src, dst, tag);
        }
      }
    }
  }
  // 37 x 53 elements: 3.8 slots of doubles, 0.5 of bytes; transposed at either end or both.
  for (at::ScalarType dtype : {at::kDouble, at::kByte, at::kComplexFloat}) {
    const at::Tensor values = pattern(dtype, 37 * 53, static_cast<uint64_t>(1000 + tag)).reshape({37, 53});
    for (auto [src, dst] : {std::pair{Layout::kTransposed, Layout::kTransposed},
                            std::pair{Layout::kTransposed, Layout::kContiguous},
                            std::pair{Layout::kContiguous, Layout::kTransposed}}) {
      ++tag;
      echo_case(pg, values, src, dst, tag);
    }
  }
}

/// Scenario: conjugate and negative views (whose values are their memory with the bit applied) sent
/// alone, as a batch and from a loan arrive with their values, into a tensor and as a view.
void resolved_views_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 2, opts);
  const at::Tensor small = at::arange(6, at::kFloat).to(at::kComplexFloat) * c10::complex<float>(1, 2);
  const at::Tensor large = at::arange(20000, at::kDouble).to(at::kComplexDouble) + c10::complex<double>(0, 3);
  const at::Tensor neg = at::arange(10, at::kFloat) + 1;
  const std::vector<at::Tensor> want = {small.conj(), large.conj(), -neg, small.conj(), -neg, small.conj()};
  if (rank == 0) {
    const at::Tensor n = neg._neg_view();
    SHM_CHECK(n.is_neg() && small.conj().is_conj(), "views with their bits set");
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    works.push_back(post_send(pg, small.conj(), 1, 1));
    works.push_back(post_send(pg, large.conj(), 1, 2));
    works.push_back(post_send(pg, n, 1, 3));
    const std::vector<at::Tensor> batch = {small.conj(), n};
    if (auto w = ShmGroupSeam::send_batch(pg, batch, 1, {4, 5}, std::vector<MessageCheck>(2))) works.push_back(w);
    at::Tensor loan = pg.loan({6}, at::kComplexFloat);
    loan.copy_(small);
    works.push_back(post_send(pg, loan.conj(), 1, 6));
    for (auto& w : works) w->wait();
  } else {
    for (int tag = 1; tag <= 6; ++tag) {
      const at::Tensor& expected = want[static_cast<size_t>(tag - 1)];
      const at::Tensor got =
          tag % 2 == 0 ? pg.recv_view(0, tag) : at::zeros_like(expected.resolve_conj().resolve_neg());
      if (tag % 2 == 1) recv_wait(pg, got, 0, tag);
      SHM_CHECK(at::equal(got, expected.resolve_conj().resolve_neg()),
                "tag " << tag << " arrived without its view's bit");
    }
  }
}

/// Scenario: rank 0 sends tags 1, 2, 3 (4, 1 and 2 slots) without waiting in between; rank 1
/// receives 3, then 1, then 2.
void out_of_order_tags_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 2, opts);
  const int64_t s = static_cast<int64_t>(opts.slot_bytes);
  const std::vector<int64_t> bytes = {3 * s + 7, 100, 2 * s};  // of tags 1, 2, 3
  auto values = [&](int tag) { return pattern(at::kByte, bytes[static_cast<size_t>(tag - 1)], 77 + static_cast<uint64_t>(tag)); };
  for (int round = 0; round < 3; ++round) {
    if (rank == 0) {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int tag = 1; tag <= 3; ++tag) works.push_back(post_send(pg, values(tag), 1, tag));
      for (auto& w : works) w->wait();
    } else {
      for (int tag : {3, 1, 2}) {
        const at::Tensor got = at::zeros({bytes[static_cast<size_t>(tag - 1)]}, at::kByte);
        recv_wait(pg, got, 0, tag);
        SHM_CHECK(same_bytes(got, values(tag)), "round " << round << ", tag " << tag << " has wrong bytes");
      }
    }
  }
}

/// Bytes of message `seq` of the FIFO scenario: every third one spans 4 slots.
int64_t fifo_bytes(int seq, const ShmOptions& opts) {
  return seq % 3 == 0 ? 3 * static_cast<int64_t>(opts.slot_bytes) + 7 : 16;
}

/// Scenario: 50 messages with one tag, posted back to back, received in order (each message's
/// bytes are a function of its sequence number). Then the same with the receiver late, so that
/// all of them wait in its process first.
void same_tag_fifo_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 2, opts);
  constexpr int kMessages = 50;
  constexpr int kTag = 7;
  for (int round = 0; round < 2; ++round) {
    const bool late_receiver = round == 1;
    auto values = [&](int seq) {
      return pattern(at::kByte, fifo_bytes(seq, opts), static_cast<uint64_t>(round * 1000 + seq));
    };
    if (rank == 0) {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int seq = 0; seq < kMessages; ++seq) works.push_back(post_send(pg, values(seq), 1, kTag));
      for (auto& w : works) w->wait();
    } else {
      if (late_receiver) std::this_thread::sleep_for(100ms);
      for (int seq = 0; seq < kMessages; ++seq) {
        const at::Tensor got = at::zeros({fifo_bytes(seq, opts)}, at::kByte);
        recv_wait(pg, got, 0, kTag);
        SHM_CHECK(same_bytes(got, values(seq)), "round " << round << ": message " << seq << " is not the "
                                                          << seq << "th sent with tag " << kTag);
      }
    }
  }
}

/// Scenario (3 ranks): ranks 1 and 2 each send 50 messages with one tag to rank 0, which takes
/// them with recvAnysource. Each message holds [sender, seq, ...] and, for the large size, a
/// pattern of (sender, seq). Per sender the order must be kept, and sourceRank() must name it.
void any_source_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 3, opts);
  constexpr int kPerSender = 50;
  // 16 bytes, then 3 slots + 8 bytes (int64 elements).
  const std::vector<int64_t> numels = {2, (3 * static_cast<int64_t>(opts.slot_bytes) + 8) / 8};
  for (size_t phase = 0; phase < numels.size(); ++phase) {
    const int tag = 5 + static_cast<int>(phase);
    const int64_t numel = numels[phase];
    auto message = [&](int sender, int seq) {
      at::Tensor t = pattern(at::kLong, numel, static_cast<uint64_t>(sender * 100000 + seq * 10 + tag));
      t[0] = sender;
      t[1] = seq;
      return t;
    };
    if (rank == 0) {
      std::vector<int> next_seq(3, 0);
      for (int i = 0; i < 2 * kPerSender; ++i) {
        const at::Tensor got = at::zeros({numel}, at::kLong);
        std::vector<at::Tensor> v{got};
        auto work = pg.recvAnysource(v, tag);
        work->wait();
        const int src = work->sourceRank();
        const int64_t sender = got[0].item<int64_t>();
        const int64_t seq = got[1].item<int64_t>();
        SHM_CHECK(src == 1 || src == 2, "sourceRank() is " << src);
        SHM_CHECK(sender == src, "sourceRank() says " << src << " but the message is from " << sender);
        SHM_CHECK(seq == next_seq[static_cast<size_t>(src)],
                  "from rank " << src << " message " << seq << " came when " << next_seq[static_cast<size_t>(src)]
                               << " was due");
        SHM_CHECK(same_bytes(got, message(src, static_cast<int>(seq))), "message " << seq << " of rank " << src
                                                                                   << " has wrong bytes");
        ++next_seq[static_cast<size_t>(src)];
      }
    } else {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int seq = 0; seq < kPerSender; ++seq) works.push_back(post_send(pg, message(rank, seq), 0, tag));
      for (auto& w : works) w->wait();
    }
  }
}

/// Scenario: `count` messages of 8 bytes from rank 0 to rank 1, one by one.
void many_small_scenario(const std::string& name, int rank, const ShmOptions& opts, int count) {
  ProcessGroupShm pg(name, rank, 2, opts);
  const at::Tensor t = at::zeros({1}, at::kLong);
  auto* value = t.data_ptr<int64_t>();
  for (int i = 0; i < count; ++i) {
    if (rank == 0) {
      *value = i * 3 + 1;
      send_wait(pg, t, 1, 3);
    } else {
      *value = -1;
      recv_wait(pg, t, 0, 3);
      SHM_CHECK(*value == i * 3 + 1, "message " << i << " carries " << *value);
    }
  }
}

/// Scenario: `count` exchanges of 8 bytes: rank 0 sends i, rank 1 answers i + 1.
void ping_pong_scenario(const std::string& name, int rank, const ShmOptions& opts, int count) {
  ProcessGroupShm pg(name, rank, 2, opts);
  const at::Tensor t = at::zeros({1}, at::kLong);
  auto* value = t.data_ptr<int64_t>();
  for (int i = 0; i < count; ++i) {
    if (rank == 0) {
      *value = 2 * i;
      send_wait(pg, t, 1, 0);
      *value = -1;
      recv_wait(pg, t, 1, 0);
      SHM_CHECK(*value == 2 * i + 1, "pong " << i << " carries " << *value);
    } else {
      *value = -1;
      recv_wait(pg, t, 0, 0);
      SHM_CHECK(*value == 2 * i, "ping " << i << " carries " << *value);
      *value += 1;
      send_wait(pg, t, 0, 0);
    }
  }
}

/// Scenario: rank 0 posts 200 messages of 3 slots at once; rank 1 sleeps 1 ms before each
/// receive. Every message must arrive whole and in order (checksums of the bytes).
void slow_receiver_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 2, opts);
  constexpr int kMessages = 200;
  const int64_t bytes = 3 * static_cast<int64_t>(opts.slot_bytes);
  auto values = [&](int i) { return pattern(at::kByte, bytes, 5000 + static_cast<uint64_t>(i)); };
  if (rank == 0) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int i = 0; i < kMessages; ++i) works.push_back(post_send(pg, values(i), 1, 11));
    for (auto& w : works) w->wait();
  } else {
    for (int i = 0; i < kMessages; ++i) {
      std::this_thread::sleep_for(1ms);
      const at::Tensor got = at::zeros({bytes}, at::kByte);
      recv_wait(pg, got, 0, 11);
      SHM_CHECK(checksum(got) == checksum(values(i)), "message " << i << " has another checksum than the one sent");
    }
  }
}

/// Scenario: both ranks send a message larger than the whole arena and wait for the send to
/// complete before they post the receive (a blocking send each way). Each rank's send can only
/// finish if the other drains it into process memory as an early message while it waits for its
/// own send (the waiter drains sources nobody waits on once it has slept a while): the documented
/// "both send before they receive never deadlock" guarantee, with blocking sends.
void blocking_sends_both_ways_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 2, opts);
  const int peer = 1 - rank;
  const int64_t bytes = 4 * static_cast<int64_t>(opts.slot_bytes) * opts.slots_per_rank + 123;
  auto values = [&](int from, int round) { return pattern(at::kByte, bytes, 900 + static_cast<uint64_t>(from * 10 + round)); };
  for (int round = 0; round < 3; ++round) {
    post_send(pg, values(rank, round), peer, 21)->wait();
    const at::Tensor got = at::zeros({bytes}, at::kByte);
    recv_wait(pg, got, peer, 21);
    SHM_CHECK(checksum(got) == checksum(values(peer, round)),
              "round " << round << ": the message from rank " << peer << " has another checksum than the one sent");
  }
}

/// Scenario: both ranks send 256 MiB to each other at the same time (send, then recv, then wait
/// on both): nothing may deadlock, and the bytes must arrive.
void bidirectional_large_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  constexpr int64_t kElements = int64_t{64} << 20;  // int32: 256 MiB
  ProcessGroupShm pg(name, rank, 2, opts);
  const int peer = 1 - rank;
  auto expected_at = [](int from, int64_t i) { return static_cast<int32_t>(i * 7 + from * 1000003); };
  const at::Tensor out = at::arange(kElements, at::kInt).mul_(7).add_(rank * 1000003);
  const at::Tensor in = at::zeros({kElements}, at::kInt);
  const auto start = Clock::now();
  auto send_work = post_send(pg, out, peer, 1);
  auto recv_work = post_recv(pg, in, peer, 1);
  send_work->wait();
  recv_work->wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto* got = in.data_ptr<int32_t>();
  for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{4095}, int64_t{4096}, int64_t{65537}, kElements / 2 + 3,
                    kElements - 1}) {
    SHM_CHECK(got[i] == expected_at(peer, i), "element " << i << " is " << got[i]);
  }
  // The sum of the received values, computed as the sender's values would give it.
  const int64_t sum = in.sum(at::kLong).item<int64_t>();
  const int64_t expected = out.sub(rank * 1000003).add_(peer * 1000003).sum(at::kLong).item<int64_t>();
  SHM_CHECK(sum == expected, "sum of the received values " << sum << ", expected " << expected);
  std::fprintf(stderr, "[rank %d] 256 MiB each way in %.2f s\n", rank, seconds);
}

/// Scenario: rank 0 sends what fits in the ring (two small messages and one of 2 slots), waits
/// for the sends, and leaves. Rank 1 only then receives: the messages are still delivered (they
/// were complete sends), and a further recv from the departed rank fails with PeerLostError at
/// once rather than at the group's timeout.
void left_sender_scenario(const std::string& name, int rank, const ShmOptions& opts, std::atomic<int>& sender_left) {
  const std::vector<int64_t> bytes = {8, 2 * static_cast<int64_t>(opts.slot_bytes), 100};
  auto values = [&](size_t i) { return pattern(at::kByte, bytes[i], 300 + i); };
  if (rank == 0) {
    {
      ProcessGroupShm pg(name, 0, 2, opts);
      for (size_t i = 0; i < bytes.size(); ++i) post_send(pg, values(i), 1, static_cast<int>(i))->wait();
    }
    sender_left.store(1);
    return;
  }
  ProcessGroupShm pg(name, 1, 2, opts);
  const auto give_up = Clock::now() + 10s;
  while (sender_left.load() == 0 && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
  SHM_CHECK(sender_left.load() == 1, "rank 0 did not leave");
  // Longer than the liveness check interval: rank 1 may well have noticed the departure first.
  std::this_thread::sleep_for(3 * opts.peer_check_interval);
  for (size_t i = 0; i < bytes.size(); ++i) {
    const at::Tensor got = at::zeros({bytes[i]}, at::kByte);
    recv_wait(pg, got, 0, static_cast<int>(i));
    SHM_CHECK(same_bytes(got, values(i)), "message " << i << " of the departed sender differs");
  }
  const auto start = Clock::now();
  const Caught c = catch_any([&] { recv_wait(pg, at::zeros({8}, at::kByte), 0, 7); });
  SHM_CHECK(c.is<PeerLostError>(), "a recv from a departed rank threw " << c.describe());
  SHM_CHECK(Clock::now() - start < opts.timeout / 2, "the recv from a departed rank failed only at the timeout");
}

/// Scenario (threads): receives whose messages already wait in the ring when they are posted
/// (rank 0 says so through `sent`). Such a Work is complete as returned and answers like any
/// other: wait, result (the receiving tensor itself), sourceRank, its future. A waiting message
/// that does not fit the receive fails it with the usual TransportError, and the pair goes on.
void waiting_message_scenario(const std::string& name, int rank, const ShmOptions& opts, std::atomic<int>& sent) {
  ProcessGroupShm pg(name, rank, 2, opts);
  const std::vector<int64_t> bytes = {8, 1000, 2 * static_cast<int64_t>(opts.slot_bytes)};
  auto values = [&](size_t i) { return pattern(at::kByte, bytes[i], 500 + i); };
  auto wait_for = [&](int n) {
    const auto give_up = Clock::now() + 10s;
    while (sent.load() < n && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
    SHM_CHECK(sent.load() >= n, "rank 0 did not send message " << n);
  };
  if (rank == 0) {
    for (size_t i = 0; i < bytes.size(); ++i) {
      send_wait(pg, values(i), 1, 3);
      sent.store(static_cast<int>(i) + 1);
    }
    send_wait(pg, pattern(at::kFloat, 10, 9), 1, 4);
    sent.store(10);
    send_wait(pg, pattern(at::kFloat, 10, 10), 1, 4);
    return;
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    wait_for(static_cast<int>(i) + 1);
    const at::Tensor got = at::zeros({bytes[i]}, at::kByte);
    std::vector<at::Tensor> tensors{got};
    auto work = pg.recv(tensors, 0, 3);
    if (i < 2) {  // whole in one entry: complete as posted (the last one needs its other entries)
      SHM_CHECK(work->isCompleted(), "message " << i << " waited in the ring but its recv is not complete");
    }
    SHM_CHECK(work->wait(), "message " << i);
    SHM_CHECK(same_bytes(got, values(i)), "message " << i << " differs");
    SHM_CHECK(work->isSuccess() && work->sourceRank() == 0, "message " << i);
    const auto result = work->result();
    SHM_CHECK(result.size() == 1 && result[0].data_ptr() == got.data_ptr(), "result() is not the receiving tensor");
    auto future = work->getFuture();
    SHM_CHECK(future->completed() && !future->hasError(), "the future of message " << i);
  }
  wait_for(10);
  const at::Tensor wrong = at::zeros({11}, at::kFloat);
  std::vector<at::Tensor> tensors{wrong};
  auto work = pg.recv(tensors, 0, 4);
  const Caught c = catch_any([&] { work->wait(); });
  SHM_CHECK(c.is<TransportError>() && contains_nocase(c.what, "the message has 40 bytes but the tensor has 44"),
            "a mismatched waiting message gave " << c.describe());
  const at::Tensor next = at::zeros({10}, at::kFloat);
  recv_wait(pg, next, 0, 4);
  SHM_CHECK(same_bytes(next, pattern(at::kFloat, 10, 10)), "the message after the mismatch differs");
}

// Receives' Works are reused once their callers dropped them (RecvWorkPool): a reused Work must
// answer only for its new receive (tensor, source, error, future), a Work still held must keep
// answering for its own, and a large receive's tensor must not be kept once its Work is gone.
void reused_works_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 2, opts);
  constexpr int kSmall = 8;
  const int64_t large = 128 * 1024;  // past the pool's 64 KiB
  auto value = [](int i) { return pattern(at::kInt, 4, 700 + i); };
  if (rank == 0) {
    for (int i = 0; i < kSmall; ++i) send_wait(pg, value(i), 1, 5);
    for (int b = 0; b < 2; ++b) {
      for (int j = 0; j < 3; ++j) send_wait(pg, value(10 * b + j), 1, 20 + j);
    }
    send_wait(pg, value(30), 1, 23);
    send_wait(pg, pattern(at::kFloat, 10, 9), 1, 6);  // meets a receive of the wrong size
    send_wait(pg, pattern(at::kFloat, 10, 10), 1, 6);
    send_wait(pg, pattern(at::kByte, large, 11), 1, 7);
    return;
  }
  auto recv = [&](const at::Tensor& t, int tag) {
    std::vector<at::Tensor> tensors{t};
    return pg.recv(tensors, 0, tag);
  };
  const at::Tensor held_tensor = at::zeros({4}, at::kInt);
  auto held = recv(held_tensor, 5);
  SHM_CHECK(held->wait(), "message 0");
  const auto held_future = held->getFuture();
  c10d::Work* previous = nullptr;
  bool reused = false;
  for (int i = 1; i < kSmall; ++i) {
    const at::Tensor got = at::zeros({4}, at::kInt);
    auto work = recv(got, 5);
    SHM_CHECK(work.get() != held.get(), "a Work its caller still holds was handed out again");
    reused |= work.get() == previous;
    previous = work.get();
    SHM_CHECK(work->wait() && work->isSuccess() && !work->exception() && work->sourceRank() == 0, "message " << i);
    SHM_CHECK(same_bytes(got, value(i)), "message " << i << " differs");
    const auto result = work->result();
    SHM_CHECK(result.size() == 1 && result[0].data_ptr() == got.data_ptr(), "message " << i << ": result() is not its tensor");
    const auto future = work->getFuture();
    SHM_CHECK(future->completed() && !future->hasError(), "message " << i << ": its future");
    const auto values = future->value().toTensorVector();
    SHM_CHECK(values.size() == 1 && values[0].data_ptr() == got.data_ptr(), "message " << i << ": the future's tensor");
  }
  SHM_CHECK(reused, "no receive's Work was reused (ProcessGroupShm keeps them for that)");
  // The Work held from the start still answers for message 0.
  SHM_CHECK(held->isSuccess() && held->sourceRank() == 0 && held->result().at(0).data_ptr() == held_tensor.data_ptr(),
            "the held Work no longer answers for its receive");
  SHM_CHECK(held_future->value().toTensorVector().at(0).data_ptr() == held_tensor.data_ptr(), "the held Work's future");
  SHM_CHECK(same_bytes(held_tensor, value(0)), "message 0 differs");
  for (int b = 0; b < 2; ++b) {  // batches (recv_batch) share the kept Works
    std::vector<at::Tensor> leaves{at::zeros({4}, at::kInt), at::zeros({4}, at::kInt), at::zeros({4}, at::kInt)};
    auto work = ShmGroupSeam::recv_batch(pg, leaves, 0, {20, 21, 22}, std::vector<MessageCheck>(3));
    SHM_CHECK(work->wait() && work->isSuccess(), "batch " << b);
    const auto messages = work->messages();
    SHM_CHECK(messages.size() == 3, "batch " << b << " has " << messages.size() << " messages");
    for (int j = 0; j < 3; ++j) {
      SHM_CHECK(messages[j]->isSuccess() && same_bytes(leaves[j], value(10 * b + j)), "batch " << b << ", message " << j);
    }
  }
  {
    const at::Tensor single = at::zeros({4}, at::kInt);
    auto work = recv(single, 23);
    SHM_CHECK(work->wait() && same_bytes(single, value(30)) && work->result().at(0).data_ptr() == single.data_ptr(),
              "the receive after the batches");
    auto* as_batch = dynamic_cast<detail::BatchWork*>(work.get());  // every Work of the group is one
    SHM_CHECK(as_batch != nullptr, "a receive's Work is not the group's own");
    const Caught c = catch_any([&] { as_batch->messages(); });
    SHM_CHECK(c.is<TypeError>(), "a single receive's Work (maybe a batch's, reused) answered as a batch: " << c.describe());
  }
  {  // a failed receive's Work, once dropped, passes nothing of its failure on
    auto failed = recv(at::zeros({11}, at::kFloat), 6);
    const Caught c = catch_any([&] { failed->wait(); });
    SHM_CHECK(c.is<TransportError>(), "a receive of the wrong size gave " << c.describe());
  }
  const at::Tensor next = at::zeros({10}, at::kFloat);
  auto after = recv(next, 6);
  SHM_CHECK(after->wait() && after->isSuccess() && !after->exception(), "the receive after a failed one");
  SHM_CHECK(same_bytes(next, pattern(at::kFloat, 10, 10)), "the message after the mismatch differs");
  after.reset();
  at::Tensor big = at::zeros({large}, at::kByte);
  recv(big, 7)->wait();
  SHM_CHECK(same_bytes(big, pattern(at::kByte, large, 11)), "the large message differs");
  SHM_CHECK(big.use_count() == 1, "a large receive's tensor is still referenced (" << big.use_count()
                                                                                  << ") after its Work was dropped");
}

// Two threads of rank 0 receive from ranks 1 and 2 at once, dropping every Work: the Works they
// share must never be handed to both (TSan runs this).
void pool_threads_scenario(const std::string& name, int rank, const ShmOptions& opts) {
  ProcessGroupShm pg(name, rank, 3, opts);
  constexpr int kMessages = 2000;
  if (rank != 0) {
    for (int i = 0; i < kMessages; ++i) send_wait(pg, at::full({2}, rank * 100000 + i, at::kLong), 0, 1);
    return;
  }
  auto receive_from = [&](int src) {
    for (int i = 0; i < kMessages; ++i) {
      const at::Tensor got = at::zeros({2}, at::kLong);
      std::vector<at::Tensor> tensors{got};
      auto work = pg.recv(tensors, src, 1);
      SHM_CHECK(work->wait() && work->sourceRank() == src, "message " << i << " from " << src);
      SHM_CHECK(work->result().at(0).data_ptr() == got.data_ptr(), "message " << i << " from " << src << ": result()");
      SHM_CHECK(got[0].item<int64_t>() == src * 100000 + i && got[1].item<int64_t>() == src * 100000 + i,
                "message " << i << " from " << src << " differs");
    }
  };
  std::string failure;
  std::thread other([&] {
    try {
      receive_from(2);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  receive_from(1);
  other.join();
  SHM_CHECK(failure.empty(), failure);
}

class ShmP2PThreads : public ShmTest {};
class ShmP2PProcs : public ShmTest {};

TEST_F(ShmP2PThreads, AReceiveWhoseMessageWaitsCompletesAsPosted) {
  const std::string name = unique_name();
  std::atomic<int> sent{0};
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { waiting_message_scenario(name, r, small_options(), sent); }));
}

TEST_F(ShmP2PThreads, DroppedReceiveWorksAreReusedForNewReceivesOnly) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { reused_works_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PThreads, TwoReceivingThreadsNeverShareAWork) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) { pool_threads_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PThreads, RoundTripEveryDtypeSizeAndLayout) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { round_trip_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PProcs, RoundTripEveryDtypeSizeAndLayout) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) { round_trip_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PProcs, ConjugateAndNegativeViewsArriveWithTheirValues) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { resolved_views_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PThreads, RoundTripBlockingOnly) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { round_trip_scenario(name, r, small_options(0us)); }));
}

TEST_F(ShmP2PProcs, RoundTripBlockingOnly) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { round_trip_scenario(name, r, small_options(0us)); }));
}

TEST_F(ShmP2PThreads, RoundTripDefaultSlots) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { round_trip_scenario(name, r, default_slot_options()); }));
}

TEST_F(ShmP2PThreads, OutOfOrderTags) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { out_of_order_tags_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PProcs, OutOfOrderTags) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { out_of_order_tags_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PThreads, SameTagIsFifo) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { same_tag_fifo_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PProcs, SameTagIsFifo) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { same_tag_fifo_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PThreads, AnySourceKeepsPerSenderOrder) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 3, [&](int r) { any_source_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PProcs, AnySourceKeepsPerSenderOrder) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 3, [&](int r) { any_source_scenario(name, r, small_options()); }));
}

// 10^5 messages of 8 bytes "in a few seconds": the bound is loose (2 shared cores), the time is
// printed. Under TSan a tenth of them, with no time bound.
constexpr int kManySmall = kUnderTsan ? 10'000 : 100'000;
constexpr int kPingPongs = kUnderTsan ? 1'000 : 10'000;
constexpr auto kManySmallBound = 20s;

void expect_quick(Clock::time_point start, const char* what, int count) {
  const auto elapsed = Clock::now() - start;
  std::fprintf(stderr, "%s: %d in %.2f s\n", what, count, std::chrono::duration<double>(elapsed).count());
  if (!kUnderTsan) {
    EXPECT_LT(elapsed, kManySmallBound) << what;
  }
}

TEST_F(ShmP2PThreads, ManySmallMessages) {
  const std::string name = unique_name();
  const auto start = Clock::now();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { many_small_scenario(name, r, small_options(), kManySmall); }));
  expect_quick(start, "one-way 8-byte messages (threads)", kManySmall);
}

TEST_F(ShmP2PProcs, ManySmallMessages) {
  const std::string name = unique_name();
  const auto start = Clock::now();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { many_small_scenario(name, r, small_options(), kManySmall); }));
  expect_quick(start, "one-way 8-byte messages (processes)", kManySmall);
}

TEST_F(ShmP2PThreads, PingPong) {
  const std::string name = unique_name();
  const auto start = Clock::now();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { ping_pong_scenario(name, r, small_options(), kPingPongs); }));
  expect_quick(start, "ping-pongs (threads)", kPingPongs);
}

TEST_F(ShmP2PProcs, PingPong) {
  const std::string name = unique_name();
  const auto start = Clock::now();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { ping_pong_scenario(name, r, small_options(), kPingPongs); }));
  expect_quick(start, "ping-pongs (processes)", kPingPongs);
}

TEST_F(ShmP2PThreads, PingPongBlockingOnly) {
  const std::string name = unique_name();
  const auto start = Clock::now();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { ping_pong_scenario(name, r, small_options(0us), kPingPongs); }));
  expect_quick(start, "ping-pongs, spin 0 (threads)", kPingPongs);
}

TEST_F(ShmP2PProcs, PingPongBlockingOnly) {
  const std::string name = unique_name();
  const auto start = Clock::now();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { ping_pong_scenario(name, r, small_options(0us), kPingPongs); }));
  expect_quick(start, "ping-pongs, spin 0 (processes)", kPingPongs);
}

TEST_F(ShmP2PThreads, SlowReceiverLosesNothing) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { slow_receiver_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PProcs, SlowReceiverLosesNothing) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { slow_receiver_scenario(name, r, small_options()); }));
}

TEST_F(ShmP2PThreads, MessagesOfADepartedSenderAreDelivered) {
  const std::string name = unique_name();
  Shared<std::atomic<int>> sender_left;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kThreads, 2, [&](int r) { left_sender_scenario(name, r, small_options(), *sender_left); }));
}

TEST_F(ShmP2PProcs, MessagesOfADepartedSenderAreDelivered) {
  const std::string name = unique_name();
  Shared<std::atomic<int>> sender_left;
  SHM_EXPECT_RANKS_OK(
      run_ranks(Peers::kProcesses, 2, [&](int r) { left_sender_scenario(name, r, small_options(), *sender_left); }));
}

// ---------------------------------------------------------------------------------------------
// MemoryMappedTensors travel by reference

/// Rank 0 sends views of a named memmap (file `file`) and an anonymous one; rank 1 receives them.
/// A named one is one entry whatever its size (the send completes at once with a 4-entry ring of
/// 4 KiB slots) and its bytes are read from the file when it is received (rank 0 writes 2s after
/// sending 1s: rank 1 sees 2s). A receiver that maps the same bytes copies nothing (it succeeds
/// after the file is unlinked, which a copy could not); a plain receiver then fails clearly.
void memmap_reference_scenario(const std::string& name, int r, const std::string& file) {
  ProcessGroupShm pg(name, r, 2, small_options());
  constexpr int64_t n = 16384;  // 64 KiB of floats: 4x the ring's capacity
  if (r == 0) {
    auto mm = MemoryMappedTensor::full({n}, 1.0, at::kFloat, file);
    auto w = post_send(pg, mm.tensor(), 1, 3);
    SHM_CHECK(w->isCompleted(), "a named memmap is sent as one reference entry");
    w->wait();
    mm->fill_(2.0);
    send_wait(pg, MemoryMappedTensor::full({n}, 5.0, at::kFloat).tensor(), 1, 5);  // anonymous: by value
    send_wait(pg, mm->narrow(0, 100, 50), 1, 6);                                   // a view at an offset
    send_wait(pg, mm.tensor(), 1, 8);
    send_wait(pg, mm.tensor(), 1, 9);
    send_wait(pg, at::ones({1}), 1, 4);
    recv_wait(pg, at::zeros({1}), 1, 7);  // rank 1 is done: the file may go
  } else {
    recv_wait(pg, at::zeros({1}), 0, 4);  // everything else is in (unexpected) by now
    auto plain = at::zeros({n});
    recv_wait(pg, plain, 0, 3);
    SHM_CHECK(plain.eq(2.0).all().item<bool>(), "the file is read when the message is received");
    auto anon = at::zeros({n});
    recv_wait(pg, anon, 0, 5);
    SHM_CHECK(anon.eq(5.0).all().item<bool>(), "an anonymous memmap arrives by value");
    auto slice = at::zeros({50});
    recv_wait(pg, slice, 0, 6);
    SHM_CHECK(slice.eq(2.0).all().item<bool>(), "a view at an offset");
    auto mine = MemoryMappedTensor::from_filename(file, at::kFloat, {n});
    SHM_CHECK(::unlink(file.c_str()) == 0, "unlink " << file);
    recv_wait(pg, mine.tensor(), 0, 8);
    SHM_CHECK(mine->eq(2.0).all().item<bool>(), "the receiver's own mapping");
    SHM_CHECK_THROWS(TransportError, [&] { recv_wait(pg, at::zeros({n}), 0, 9); }, "cannot open", file);
    send_wait(pg, at::ones({1}), 0, 7);
  }
}

TEST_F(ShmP2PThreads, MemmapTravelsByReference) {
  const std::string name = unique_name();
  const std::string file = segment_path(name) + ".memmap";
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kThreads, 2, [&](int r) { memmap_reference_scenario(name, r, file); }));
}

TEST_F(ShmP2PProcs, MemmapTravelsByReference) {
  const std::string name = unique_name();
  const std::string file = segment_path(name) + ".memmap";
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int r) { memmap_reference_scenario(name, r, file); }));
}

TEST_F(ShmP2PProcs, BlockingSendsBothWaysLargerThanTheArena) {
  for (const auto spin : {50us, 0us}) {
    const std::string name = unique_name();
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2,
                                  [&](int r) { blocking_sends_both_ways_scenario(name, r, small_options(spin)); }));
  }
}

TEST_F(ShmP2PProcs, Bidirectional256MiBAtOnce) {
  set_deadline(240s);
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(
      Peers::kProcesses, 2, [&](int r) { bidirectional_large_scenario(name, r, default_slot_options()); }, 180s));
}

}  // namespace
}  // namespace tdshm::test
