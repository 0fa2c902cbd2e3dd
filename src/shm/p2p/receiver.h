#pragma once
// The receiving side of one rank's channel (channel.h has the protocol): receives posted and
// matched with the messages read from each source's ring; a message that comes before its
// receive kept in process memory (unexpected, within a budget) or left in its ring; a receive
// whose message is already next in its ring landed at once. What arrives by reference goes
// through by_reference.h. Called under the owner's lock, but make_recvs (no state).

#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"
#include "shm/p2p/by_reference.h"
#include "shm/p2p/channel_core.h"
#include "shm/p2p/message.h"
#include "shm/p2p/op.h"
#include "shm/parts/buffer_pool.h"
#include "shm/parts/matcher.h"
#include "shm/parts/ring.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <vector>

namespace tdshm::detail {

class ShmReceiver {
 public:
  ShmReceiver(ChannelCore& core, ByReference& by_reference);
  ShmReceiver(const ShmReceiver&) = delete;
  ShmReceiver& operator=(const ShmReceiver&) = delete;

  /// ShmChannel::make_recvs, make_recv, make_recv_view: checked ops, no channel state touched.
  static OpList make_recvs(std::span<const at::Tensor> tensors, int src, int rank, int size,
                           std::span<const int64_t> tags, std::span<const MessageCheck> checks, bool control);
  static std::shared_ptr<ShmOp> make_recv(const at::Tensor& tensor, int src, int rank, int size, int64_t tag,
                                          const MessageCheck& check, bool control);
  static std::shared_ptr<ShmOp> make_recv_view(int src, int rank, int size, int64_t tag, const MessageCheck& check);
  /// ShmChannel::receive_now and land_posted.
  bool receive_now(const at::Tensor& tensor, int src, int64_t tag, const MessageCheck& check, bool control);
  bool land_posted(const std::shared_ptr<ShmOp>& op);
  /// Matches each op with a message drained earlier, or posts it; true if any was posted (the
  /// rings may hold its message: the caller reads them).
  bool post_recvs(std::span<const std::shared_ptr<ShmOp>> ops, int src);

  /// One pass over `src`'s ring (see ShmChannel::progress for `drain_all`); true if anything moved.
  /// A malformed entry (or memory running out) sets `lost` to the error `src`'s transfers fail
  /// with: the caller fails the pair (ShmChannel::fail_peer).
  bool progress(int src, bool drain_all, std::exception_ptr& lost);
  /// Without the lock: whether `src`'s ring may hold a new entry (a hint).
  bool ready_hint(int src) const noexcept { return rx_[static_cast<size_t>(src)].ready_hint(); }
  /// Whether a message of `src` is in progress or held back in its ring.
  bool busy(int src) const noexcept {
    const auto s = static_cast<size_t>(src);
    return current_[s] || held_bytes_[s] != 0;
  }
  /// Takes a receive back (a wait gave up on it): it never matches a later message.
  void withdraw(const std::shared_ptr<ShmOp>& op);
  /// `peer` is lost: the receive of its message in progress and the receives posted for it (and
  /// any-source ones, once nobody is left) fail with `error`.
  void fail_peer(int peer, const std::exception_ptr& error);
  /// Every posted receive and message in progress fails with `error`.
  void fail_all(const std::exception_ptr& error);
  /// "; a message of N bytes from rank R waits in its ring ..." for each held back, else "".
  std::string held_messages() const;

 private:
  // What one progress pass over a source's ring carries from entry to entry.
  struct ReceivePass {
    // Without it, a message that no posted receive can take stays in its ring while no receive
    // from its source is posted at all (see start_message): a spinning waiter does not copy
    // other peers' messages into process memory just before their receives are posted. Passes
    // that precede a sleep, polls and the helper thread drain everything, so two ranks that both
    // send first still cannot deadlock.
    bool drain_all = true;
    // A posted receive completed in this pass: a message with no receive posted stays in the ring.
    bool completed_posted = false;
  };
  enum class Taken { kYes, kHeld };  // kHeld: the entry stays in the ring (over the unexpected budget)
  using Matcher = shm::Matcher<RecvOp, Incoming>;

  bool post_recv(std::shared_ptr<RecvOp> op, int src);
  void land_early(Incoming& keep, const std::shared_ptr<RecvOp>& op);
  // The chunk of `e`, the next entry of `src`'s ring: in the entry, in the entries after it (a
  // span the ring can hold), or in the sender's slot if that slot is handed to this rank (else
  // null: the entry is corrupt, or the slot was taken back). Inline: every entry read asks,
  // twice.
  const uint8_t* chunk_of(int src, const shm::EntryFields& e) const {
    const auto s = static_cast<size_t>(src);
    if (e.flags & shm::kEntryInline) return rx_[s].inline_bytes();
    if (shm::has_span(e.flags)) {
      // Bounded here: this runs before check_entry (which then refuses such an entry).
      return shm::span_fits(e.chunk_bytes, core_.options().ring_entries)
                 ? rx_[s].span(e.chunk_bytes, span_stage_.data())
                 : nullptr;
    }
    return shm::claimed_chunk(core_.region(src), e.slot, static_cast<uint32_t>(core_.rank()));
  }
  void entry_taken(int src, const shm::EntryFields& e);
  const uint8_t* whole_entry(int src, int64_t tag, bool control, shm::EntryFields& e);
  bool take_whole(int src, const shm::EntryFields& e, const uint8_t* payload, uint8_t* dst);
  void wake_sender_if_due(int src);
  Taken handle_entry(int src, const shm::EntryFields& e, const uint8_t* payload, const shm::EntryShape& shape,
                     ReceivePass& pass);
  // Lands the messages of a batch entry `e` (checked) from its records, resuming where a pass
  // before left it (batch_cursor_); kHeld when a record must stay in the ring (batch.cpp).
  Taken handle_batch(int src, const shm::EntryFields& e, const uint8_t* records, ReceivePass& pass);
  // handle_entry's landing of a checked entry by value (a message's first or later chunk) whose
  // payload is at `payload`.
  Taken land_entry(int src, const shm::EntryFields& e, const uint8_t* payload, const shm::EntryShape& shape,
                   ReceivePass& pass);
  // handle_entry's landing of a checked reference entry (a loan or a memory-mapped file).
  // Out of line: inlined into handle_entry it made the common path's matcher call out of line
  // (+2 % instructions per small message).
  [[gnu::noinline]] Taken land_reference(int src, const shm::EntryFields& e, const uint8_t* payload,
                                         const shm::EntryShape& shape, ReceivePass& pass);
  static MessageHead message_head(int src, const shm::EntryFields& e, const shm::EntryShape& shape);
  // `found`: the posted receive that takes the message (matcher_.find_posted), or none().
  bool start_message(int src, const MessageHead& head, Matcher::Found found, uint32_t chunk_bytes,
                     const ReceivePass& pass);
  void release_unexpected(Incoming& msg);
  // Checks that `msg` fits `op` and binds its source; on a mismatch fails `op` with the error that
  // says why and returns false.
  bool try_match(MessageHead& msg, RecvOp& op) {
    op.source = msg.src;
    if (op.view) return by_reference_.bind_view(msg, op);
    const Mismatch why = mismatch(msg, op.check, op.contiguous(), op.bytes);
    if (why == Mismatch::kNone) return true;
    fail_match(core_, msg, op, why);
    return false;
  }

  ChannelCore& core_;
  ByReference& by_reference_;
  uint32_t wake_batch_ = 1;                         // wake a source after this many entries (progress)
  std::vector<shm::RingConsumer> rx_;               // per source: its ring's consumer end
  std::vector<std::shared_ptr<Incoming>> current_;  // per source: message being received
  std::vector<std::shared_ptr<Incoming>> spare_;    // per source: a finished one, for reuse
  Matcher matcher_;                                 // unmatched receives and early messages
  std::vector<uint64_t> held_bytes_;            // per source: size of a first entry left in the ring (budget), else 0
  std::vector<uint32_t> consumed_since_wake_;   // per source: entries taken since it was last woken
  std::vector<uint8_t> freed_slot_since_wake_;  // per source: 1 once one of its slots was freed since then
  // Per source: how far the batch entry at its ring's head was taken (handle_batch): the byte
  // offset of its next record and the records taken; zeros when no batch was begun.
  struct BatchCursor {
    uint64_t offset = 0;
    uint32_t records = 0;
  };
  std::vector<BatchCursor> batch_cursor_;
  uint64_t unexpected_bytes_ = 0;    // process memory held by unexpected messages
  shm::BufferPool unexpected_pool_;  // their buffers, kept for reuse (buffer_pool.h)
  // A received span that wraps around its ring's end, copied out in one piece (chunk_of).
  mutable std::array<uint8_t, shm::kMaxSpanBytes> span_stage_{};
};

}  // namespace tdshm::detail
