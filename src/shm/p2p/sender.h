#pragma once
// The sending side of one rank's channel (channel.h has the protocol): sends posted to each
// destination, written into the metadata ring towards it, inline, in a span of entries or in an
// arena slot of this rank; a run of small messages as one batch entry (batch.cpp); a loan or a
// memory-mapped file by reference (by_reference.h). Called under the owner's lock.

#include "shm/layout/segment_layout.h"
#include "shm/p2p/by_reference.h"
#include "shm/p2p/channel_core.h"
#include "shm/p2p/op.h"
#include "shm/parts/arena.h"
#include "shm/parts/ring.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace tdshm::detail {

class ShmSender {
 public:
  ShmSender(ChannelCore& core, ByReference& by_reference);
  ShmSender(const ShmSender&) = delete;
  ShmSender& operator=(const ShmSender&) = delete;

  /// ShmChannel::post_sends: the same messages to `dst` (checked), moved as far as room allows;
  /// `dst` is woken once. No ops when every send completed as it was posted.
  OpList post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                    std::span<const MessageCheck> checks, bool control);
  /// ShmChannel::post_send: one send; null when it completed as it was posted.
  std::shared_ptr<ShmOp> post_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                   bool control);
  /// Moves the sends queued for `dst` as far as room allows; wakes `dst` when any moved (and
  /// `wake`). True if any did.
  bool progress(int dst, bool wake = true);
  /// Whether a send waits for room in the ring towards `dst`.
  bool busy(int dst) const noexcept { return !send_queues_[static_cast<size_t>(dst)].empty(); }
  /// Takes a send back (a wait gave up on it) unless its first entry is in the ring; true if it was.
  bool withdraw(const std::shared_ptr<ShmOp>& op);
  /// `peer` is lost: its queued sends fail with `error`.
  void fail_peer(int peer, const std::exception_ptr& error);
  /// Every queued send fails with `error`.
  void fail_all(const std::exception_ptr& error);
  /// Takes back the arena slots this rank handed to `peer` (gone); returns how many.
  uint32_t reclaim_slots(int peer) { return slots_.reclaim(static_cast<uint32_t>(peer)); }

 private:
  void check_destination(int dst) const;
  bool send_whole(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check, bool control,
                  const std::string& reference);
  size_t send_batched(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                      std::span<const MessageCheck> checks, bool control);  // batch.cpp
  std::shared_ptr<SendOp> queue_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                     bool control, std::string reference, bool& published);
  bool write_entry(int dst, uint32_t flags, int64_t tag, const at::Tensor& whole, const uint8_t* chunk_data,
                   uint64_t offset, uint64_t chunk, MessageCheck check = {});

  ChannelCore& core_;
  ByReference& by_reference_;
  uint64_t span_limit_ = 0;  // the largest message sent in a span (shm::span_limit)
  std::vector<std::deque<std::shared_ptr<SendOp>>> send_queues_;  // per destination, FIFO
  std::vector<shm::RingProducer> tx_;                             // per destination: its ring's producer end
  shm::SlotAllocator slots_;                                      // this rank's own region
  // A batch's records, written here before they go into the ring in one piece (send_batched).
  std::array<uint8_t, shm::kSpanSendBytes> batch_stage_{};
};

}  // namespace tdshm::detail
