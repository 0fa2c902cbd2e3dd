#pragma once
// The point-to-point channel of one rank: its sends and receives over the segment's metadata
// rings and arena slots. It composes the small parts, each in its own header: the SPSC ring
// (ring.h), the slot arena (arena.h), the matching of receives with messages (matcher.h), the
// early-message buffers (buffer_pool.h), the entry checks (validate.h). Its code is split by
// side: channel.cpp (posting, sending, completing, failing), channel_receive.cpp (an entry
// validated and landed, matching, early messages, memmap references).
//
// It knows nothing of waiting, threads or liveness checks: ShmEngine (engine.h) owns it, calls
// it under its lock and decides when a peer is lost (fail_peer). Not thread-safe: every member
// but make_recvs is called with the owner's lock held; ShmOp::done is the only thing read
// without it.
//
// Protocol (one SPSC metadata ring per ordered pair of ranks, one slot region per rank, see
// segment_layout.h):
//  * A message is one or more entries: the first carries tag, total size, dtype and shape; each
//    carries up to slot_bytes of payload, inline in the entry when it fits in 72 bytes, else in
//    an arena slot of the sender handed to the receiver. The producer fills the slot and the
//    entry, then stores the entry's seq (release); the consumer polls that seq (acquire), copies
//    the payload out, frees the slot, then advances the ring's tail (release), which frees the
//    entry for the producer.
//  * A tree's leaves (post_sends / post_recvs) are posted under one lock and the receiver is
//    woken once; a receiver wakes a sleeping sender once a quarter of its room is back.
//  * A contiguous tensor that views a named MemoryMappedTensor is sent as a reference (file,
//    offset; kEntryReference): the receiver copies straight from the file into its tensor, or
//    nothing at all when its tensor maps the same bytes. An anonymous memmap goes by value.
//  * A receive whose message is already the next entry of its source's ring, whole, and that
//    nothing older may take first (an early message, a posted receive for the same messages),
//    lands as it is posted, without an op or the matcher (receive_now); every other receive is
//    posted and matched as below.
//  * A message that matches a posted recv is copied straight into the receiver's tensor. One that
//    matches nothing yet is copied into process memory ("unexpected", as in MPI) so that the
//    ring keeps moving: two ranks that both send before receiving cannot deadlock. Those copies
//    are bounded by ShmOptions::max_unexpected_bytes: a message that does not fit the budget
//    stays in the ring (its sender waits: back-pressure) until its recv is posted. A spinning
//    waiter makes no such copy for a source it posted nothing for (progress's drain_all): a data
//    loader's main rank takes each worker's batch straight from the slots.
//  * Every entry is read once into a local copy and validated (validate.h) before any of its
//    values is used: a peer that rewrites an entry after publishing it cannot move a copy out of
//    bounds. A malformed entry fails that pair's transfers (TransportError); the rings are never
//    reset (a ring belongs to one incarnation of the group, see segment_layout.h).
//  * A receive or a send that has not started can be withdrawn (a wait that timed out), so a
//    late message never lands in a receive its caller gave up on.
//  * Whoever makes progress possible for a rank (posts an entry to it, or frees an entry it
//    writes to) wakes it with waiter.h's wake(), which costs no system call while it spins.

#include <tdshm/process_group.h>

#include "shm/layout/validate.h"
#include "shm/p2p/loan_pool.h"
#include "shm/p2p/message_check.h"
#include "shm/parts/arena.h"
#include "shm/parts/buffer_pool.h"
#include "shm/parts/matcher.h"
#include "shm/parts/ring.h"
#include "shm/segment/segment.h"

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <array>
#include <atomic>
#include <deque>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace tdshm::detail {

/// One posted send or receive. Fields after `done` are written under the owner's lock before
/// `done` is stored (release); a thread that loads done == true (acquire) may read them.
struct ShmOp {
  enum class Kind { kSend, kRecv };
  // User-provided, so that make_shared's value-initialisation does not zero the whole op before
  // the member initialisers below run (a few hundred bytes per message).
  ShmOp() noexcept {}
  Kind kind = Kind::kSend;
  int peer = -1;  // destination of a send; source of a recv, -1 for any source
  int64_t tag = 0;
  bool control = false;        // a collective's message: matched apart from user tags
  MessageCheck check;          // what the transfer layer knows of the message (first entry's `check`)
  uint16_t sender_leaves = 0;  // recv failed on a leaf count: the message's (else 0)
  at::Tensor user;             // the caller's tensor
  at::Tensor staging;          // a strided `user`'s contiguous copy (send) or landing place (recv); else undefined
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  std::string reference;     // send of a named memmap: the MemmapReference payload sent instead of the bytes
  int64_t loan = -1;         // send of a loan: its allocation in this rank's loan heap (else -1)
  uint64_t loan_offset = 0;  //   and the offset of its bytes there
  bool view = false;         // recv_view: lands in a tensor of the message's shape and dtype (user),
                             //   the sender's bytes themselves when they are a loan
  uint64_t posted = 0;       // send: payload bytes written to the ring
  bool started = false;      // send: first entry written
  std::atomic<bool> done{false};
  std::exception_ptr error;
  int source = -1;           // recv: the rank the message came from
  std::string what() const;  // "recv from rank 1, tag 3" for messages
  /// The contiguous tensor whose bytes are `data`: the staging copy, or the caller's own tensor
  /// (no second reference to it: two reference-count operations fewer per message).
  const at::Tensor& contiguous() const noexcept { return staging.defined() ? staging : user; }
};

/// Ops of one call: a tree's leaves are few, so they stay inline (no allocation per transfer).
using OpList = c10::SmallVector<std::shared_ptr<ShmOp>, 4>;

/// Whether `op` completed (or failed). A null op is a send that completed when it was posted.
inline bool is_done(const std::shared_ptr<ShmOp>& op) noexcept {
  return !op || op->done.load(std::memory_order_acquire);  // pairs with the release store in finish
}

struct Incoming;
struct MessageHead;
enum class Mismatch;  // channel_internal.h

class ShmChannel {
 public:
  /// Over `segment`'s rings and arena regions, as `rank` of `size`. The segment outlives it.
  ShmChannel(shm::Segment& segment, int rank, int size, const ShmOptions& options);
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  /// Posts sends to `dst` (the same messages, in order) and moves as much as fits now; wakes
  /// `dst` once. Returns no ops at all when every send completed when posted, else one per
  /// tensor (null: that send is complete). Throws c10::Error for an invalid `dst`.
  OpList post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                    std::span<const MessageCheck> checks, bool control);
  /// One send (post_sends of one tensor without its lists: a ping-pong's path). Null when it
  /// completed as it was posted.
  std::shared_ptr<ShmOp> post_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                   bool control);
  /// Lands a receive from `src` (a valid peer) into `tensor` (contiguous, not a memory-mapped
  /// file) at once when its message is already the next entry of `src`'s ring, whole, and nothing
  /// may come first; true then. False, changing nothing, otherwise: post it (make_recvs,
  /// post_recvs), which handles every other case.
  bool receive_now(const at::Tensor& tensor, int src, int64_t tag, const MessageCheck& check, bool control);
  /// Lands the next entry of its source's ring in the posted receive `op` (from one source,
  /// contiguous) when that entry is its whole message and no older receive takes it first; true
  /// then (op is done). False, changing nothing, otherwise: a progress pass handles it.
  bool land_posted(const std::shared_ptr<ShmOp>& op);
  /// Checks the receiving tensors (TypeError: overlapping elements, a read-only mapping; c10::Error:
  /// an invalid `src`) and makes their ops. Touches no channel state: called without the lock.
  static OpList make_recvs(std::span<const at::Tensor> tensors, int src, int rank, int size,
                           std::span<const int64_t> tags, std::span<const MessageCheck> checks, bool control);
  /// A receive from `src` of whatever tensor comes (recv_view): it lands in a tensor of the
  /// message's shape and dtype, which is a view of the sender's bytes when they are a loan (no
  /// copy; the bytes go back when the view is dropped), else a fresh tensor.
  static std::shared_ptr<ShmOp> make_recv_view(int src, int rank, int size, int64_t tag, const MessageCheck& check);
  /// make_recvs of one tensor, without its list.
  static std::shared_ptr<ShmOp> make_recv(const at::Tensor& tensor, int src, int rank, int size, int64_t tag,
                                          const MessageCheck& check, bool control);
  /// Posts the receives made by make_recvs or make_recv (from `src`, -1: any) and lands messages
  /// that already arrived in them.
  void post_recvs(std::span<const std::shared_ptr<ShmOp>> ops, int src);

  /// One progress pass over every peer's rings; true if anything moved. Without `drain_all` a
  /// message that no posted receive takes stays in its ring while no receive from its source is
  /// posted (see start_message).
  bool progress(bool drain_all = true);
  /// Takes everything `src` has sent so far (it is gone: what it sent before is still good).
  void drain(int src);
  /// Takes `op` back (a wait gave up on it): it fails with `error` and never matches a later
  /// message. A send whose first entry is in the ring cannot be taken back and goes on.
  void withdraw(const std::shared_ptr<ShmOp>& op, const std::exception_ptr& error);

  /// Fails every pending op with `error` and every later post (the group is destroyed). False
  /// when it was closed already.
  bool close(const std::exception_ptr& error);
  bool closed() const noexcept { return static_cast<bool>(closed_); }
  /// Whether the segment's mapping is lost (a peer cut the file); the first time, every pending
  /// op fails and every peer counts as lost.
  bool check_poisoned() {
    if (poisoned_) return true;
    return segment_.poisoned() && poison();  // inline: every poll asks
  }
  /// Without the lock: whether a progress pass may find something new, an entry published in a
  /// source's ring or the mapping lost (a hint; the pass under the lock decides).
  bool incoming_hint() const noexcept;
  /// Under the lock: whether a progress pass has work beyond new entries: sends queued for room,
  /// a message in progress, an entry held back in its ring.
  bool busy() const noexcept;
  /// The error every transfer fails with now (closed, or the segment cut), else null.
  std::exception_ptr unusable();
  /// The error `peer`'s transfers fail with once it is lost, else null.
  const std::exception_ptr& peer_error(int peer) const noexcept { return peer_error_[static_cast<size_t>(peer)]; }
  /// `peer` is lost (or sent a malformed entry): its pending ops (and any-source receives, once
  /// no peer is left) fail with `error`; nothing more is read from or written to its rings.
  void fail_peer(int peer, std::exception_ptr error);
  /// Takes back the arena slots this rank handed to `peer`, which is gone (it reads nothing
  /// more); returns how many.
  uint32_t reclaim_slots(int peer);
  /// Takes back the loan tickets `peer` holds: only once its process is dead, since a rank that
  /// left its group may still read its views. Returns how many.
  uint32_t reclaim_loans(int peer);
  /// "; a message of N bytes from rank R waits in its ring ..." for every message held back by
  /// the early-message budget, and who holds this rank's loans (for a TimeoutError), else "".
  std::string held_messages() const;
  /// This rank's loan heap (loan_pool.h): shared with the loans it hands out.
  const std::shared_ptr<shm::LoanPool>& loans() const noexcept { return loans_; }

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
  using Matcher = shm::Matcher<ShmOp, Incoming>;

  // Sending (channel.cpp)
  void check_destination(int dst) const;
  bool send_whole(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check, bool control,
                  const std::string& reference);
  size_t send_batched(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                      std::span<const MessageCheck> checks, bool control);
  std::shared_ptr<ShmOp> queue_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                    bool control, std::string reference, bool& published);
  bool progress_sends(int dst, bool wake = true);
  bool progress_loans();
  // Whether `t`'s bytes may be a loan of this rank (then it goes by reference, not send_whole).
  bool is_lent(const at::Tensor& t) const { return loans_->ever_lent() && loans_->in_heap(t.data_ptr()); }
  // Where a send's tensor lies in this rank's loan heap (wholly inside one loan), else -1 (a copy).
  void bind_loan(ShmOp& op) const;
  bool write_entry(int dst, uint32_t flags, int64_t tag, const at::Tensor& whole, const uint8_t* chunk_data,
                   uint64_t offset, uint64_t chunk, MessageCheck check = {});
  bool post_recv(const std::shared_ptr<ShmOp>& op, int src);
  // Gives ticket `ticket` of `src`'s loan region back and wakes `src`.
  void give_back_loan(int src, uint32_t ticket);
  // Lands `msg`, a loan whose bytes are `lent` under ticket `ticket` of `src`, in `op` (matched):
  // a view of them (recv_view), or a copy, after which the ticket goes back at once.
  void land_loan(int src, const MessageHead& msg, uint32_t ticket, const uint8_t* lent,
                 const std::shared_ptr<ShmOp>& op);
  // A recv_view's tensor for `msg` (its shape and dtype, checked); false with op failed when they
  // make no tensor (a corrupt or unsupported message).
  [[gnu::noinline]] bool bind_view(const MessageHead& msg, const std::shared_ptr<ShmOp>& op);
  struct ViewShape {
    c10::SmallVector<int64_t, 8> sizes;
    c10::ScalarType dtype = c10::ScalarType::Byte;
  };
  static std::string view_shape(const MessageHead& msg, ViewShape& out);
  void finish(const std::shared_ptr<ShmOp>& op, std::exception_ptr error);
  // finish(op, nullptr), inline for a receive that needs nothing more (channel_internal.h).
  void complete(const std::shared_ptr<ShmOp>& op);
  void fail_pending(const std::exception_ptr& error);
  // check_poisoned found the mapping lost: fails everything (once). Returns true.
  bool poison();
  void fail_all(const std::exception_ptr& error);
  void wake_peer(int r) noexcept;
  const std::string& name() const noexcept { return segment_.params().name; }

  // Receiving (channel_receive.cpp)
  bool progress_receives(int src, bool drain_all);
  // The error of a malformed entry (or record) from `src`: "corrupted entry from <rank>: what".
  TransportError corrupted(int src, const std::string& what) const;
  // The chunk of `e`, the next entry of `src`'s ring: in the entry, in the entries after it (a
  // span the ring can hold), or in the sender's slot if that slot is handed to this rank (else
  // null: the entry is corrupt, or the slot was taken back). Inline: every entry read asks,
  // twice.
  const uint8_t* chunk_of(int src, const shm::EntryFields& e) const {
    const auto s = static_cast<size_t>(src);
    if (e.flags & shm::kEntryInline) return rx_[s].inline_bytes();
    if (shm::has_span(e.flags)) {
      // Bounded here: this runs before check_entry (which then refuses such an entry).
      return shm::span_fits(e.chunk_bytes, options_.ring_entries) ? rx_[s].span(e.chunk_bytes, span_stage_.data())
                                                                  : nullptr;
    }
    return shm::claimed_chunk(regions_[s], e.slot, static_cast<uint32_t>(rank_));
  }
  void entry_taken(int src, const shm::EntryFields& e);
  const uint8_t* whole_entry(int src, int64_t tag, bool control, shm::EntryFields& e);
  bool take_whole(int src, const shm::EntryFields& e, const uint8_t* payload, uint8_t* dst);
  void wake_sender_if_due(int src);
  Taken handle_entry(int src, const shm::EntryFields& e, const uint8_t* payload, const shm::EntryShape& shape,
                     ReceivePass& pass);
  // Lands the messages of a batch entry `e` (checked) from its records, resuming where a pass
  // before left it (batch_cursor_); kHeld when a record must stay in the ring.
  Taken handle_batch(int src, const shm::EntryFields& e, const uint8_t* records, ReceivePass& pass);
  // handle_entry's landing of a checked entry (a message's first or later chunk, not a loan) whose
  // payload is at `payload`; `ref`: the decoded reference of a kEntryReference entry, else null.
  Taken land_entry(int src, const shm::EntryFields& e, const uint8_t* payload, const shm::EntryShape& shape,
                   const shm::ReferenceFields* ref, ReceivePass& pass);
  // Out of line: inlined into handle_entry it made the common path's matcher call out of line
  // (+2 % instructions per small message).
  [[gnu::noinline]] Taken handle_loan(int src, const shm::EntryFields& e, const uint8_t* payload,
                                      const shm::EntryShape& shape, ReceivePass& pass);
  static MessageHead message_head(int src, const shm::EntryFields& e, const shm::EntryShape& shape);
  // `found`: the posted receive that takes the message (matcher_.find_posted), or none().
  bool start_message(int src, const MessageHead& head, Matcher::Found found, uint32_t chunk_bytes,
                     const ReceivePass& pass);
  void release_unexpected(Incoming& msg);
  std::exception_ptr resolve_reference(const ShmOp& op, const shm::ReferenceFields& ref) const;
  // Checks that `msg` fits `op` and binds its source (inline, channel_internal.h); on a mismatch
  // fails `op` with the error that says why (fail_match) and returns false.
  bool try_match(MessageHead& msg, const std::shared_ptr<ShmOp>& op);
  void fail_match(MessageHead& msg, const std::shared_ptr<ShmOp>& op, Mismatch why);

  // Set in the constructor, then only read.
  shm::Segment& segment_;
  int rank_;
  int size_;
  ShmOptions options_;
  std::vector<shm::RegionView> regions_;  // per rank: its arena region
  uint32_t wake_batch_ = 1;               // wake a source after this many entries (progress_receives)
  uint64_t span_limit_ = 0;               // the largest message sent in a span (shm::span_limit)

  std::vector<std::deque<std::shared_ptr<ShmOp>>> send_queues_;  // per destination, FIFO
  std::vector<shm::RingProducer> tx_;                            // per destination: its ring's producer end
  std::vector<shm::RingConsumer> rx_;                            // per source: its ring's consumer end
  shm::SlotAllocator slots_;                                     // this rank's own region
  std::shared_ptr<shm::LoanPool> loans_;                         // this rank's loan heap
  std::vector<shm::LoanRegionView> loan_regions_;                // per rank: its loan region
  struct Lent {
    std::shared_ptr<ShmOp> op;  // completes when the ticket comes back
    uint32_t ticket;
  };
  std::vector<Lent> lent_;                          // sends of loans whose receiver may still read the bytes
  std::vector<std::shared_ptr<Incoming>> current_;  // per source: message being received
  std::vector<std::shared_ptr<Incoming>> spare_;    // per source: a finished one, for reuse
  Matcher matcher_;                                 // unmatched receives and early messages
  std::vector<std::exception_ptr> peer_error_;      // per peer: set once it is lost
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
  // A batch's records, written here before they go into the ring in one piece (send_batched).
  std::array<uint8_t, shm::kSpanSendBytes> batch_stage_{};
  std::exception_ptr closed_;    // set by close(): the error of later posts
  std::exception_ptr poisoned_;  // set once the segment's mapping was lost (bus_guard.h)
};

}  // namespace tdshm::detail
