#pragma once
// The point-to-point channel of one rank: its sends and receives over the segment's metadata
// rings and arena slots. It is split the way its data flows, each part over its own state:
//  * the sender (sender.h): sends queued per destination, entries written into the rings;
//  * the receiver (receiver.h): rings read, entries validated and landed, receives matched,
//    early messages kept;
//  * the by-reference part (by_reference.h): loans, views and memory-mapped files, which both
//    sides reach through one hook each;
//  * what they share (channel_core.h): the segment, this rank's place, the failure state, and
//    how an op completes (op.h).
// This class owns the four and routes each call to its side; what spans both sides (progress,
// a lost peer, close, a lost mapping) is decided here.
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

#include "shm/p2p/by_reference.h"
#include "shm/p2p/channel_core.h"
#include "shm/p2p/loan_pool.h"
#include "shm/p2p/message_check.h"
#include "shm/p2p/op.h"
#include "shm/p2p/receiver.h"
#include "shm/p2p/sender.h"
#include "shm/segment/segment.h"

#include <ATen/core/Tensor.h>

#include <exception>
#include <memory>
#include <span>
#include <string>

namespace tdshm::detail {

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
                    std::span<const MessageCheck> checks, bool control) {
    return sender_.post_sends(tensors, dst, tags, checks, control);
  }
  /// One send (post_sends of one tensor without its lists: a ping-pong's path). Null when it
  /// completed as it was posted.
  std::shared_ptr<ShmOp> post_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                   bool control) {
    return sender_.post_send(tensor, dst, tag, check, control);
  }
  /// Lands a receive from `src` (a valid peer) into `tensor` (contiguous, not a memory-mapped
  /// file) at once when its message is already the next entry of `src`'s ring, whole, and nothing
  /// may come first; true then. False, changing nothing, otherwise: post it (make_recvs,
  /// post_recvs), which handles every other case.
  bool receive_now(const at::Tensor& tensor, int src, int64_t tag, const MessageCheck& check, bool control) {
    return receiver_.receive_now(tensor, src, tag, check, control);
  }
  /// Lands the next entry of its source's ring in the posted receive `op` (from one source,
  /// contiguous) when that entry is its whole message and no older receive takes it first; true
  /// then (op is done). False, changing nothing, otherwise: a progress pass handles it.
  bool land_posted(const std::shared_ptr<ShmOp>& op) { return receiver_.land_posted(op); }
  /// Checks the receiving tensors (TypeError: overlapping elements, a read-only mapping; c10::Error:
  /// an invalid `src`) and makes their ops. Touches no channel state: called without the lock.
  static OpList make_recvs(std::span<const at::Tensor> tensors, int src, int rank, int size,
                           std::span<const int64_t> tags, std::span<const MessageCheck> checks, bool control) {
    return ShmReceiver::make_recvs(tensors, src, rank, size, tags, checks, control);
  }
  /// A receive from `src` of whatever tensor comes (recv_view): it lands in a tensor of the
  /// message's shape and dtype, which is a view of the sender's bytes when they are a loan (no
  /// copy; the bytes go back when the view is dropped), else a fresh tensor.
  static std::shared_ptr<ShmOp> make_recv_view(int src, int rank, int size, int64_t tag, const MessageCheck& check) {
    return ShmReceiver::make_recv_view(src, rank, size, tag, check);
  }
  /// make_recvs of one tensor, without its list.
  static std::shared_ptr<ShmOp> make_recv(const at::Tensor& tensor, int src, int rank, int size, int64_t tag,
                                          const MessageCheck& check, bool control) {
    return ShmReceiver::make_recv(tensor, src, rank, size, tag, check, control);
  }
  /// Posts the receives made by make_recvs or make_recv (from `src`, -1: any) and lands messages
  /// that already arrived in them.
  void post_recvs(std::span<const std::shared_ptr<ShmOp>> ops, int src);

  /// One progress pass over every peer's rings; true if anything moved. Without `drain_all` a
  /// message that no posted receive takes stays in its ring while no receive from its source is
  /// posted (see ShmReceiver::start_message).
  bool progress(bool drain_all = true);
  /// Takes everything `src` has sent so far (it is gone: what it sent before is still good).
  void drain(int src);
  /// Takes `op` back (a wait gave up on it): it fails with `error` and never matches a later
  /// message. A send whose first entry is in the ring cannot be taken back and goes on.
  void withdraw(const std::shared_ptr<ShmOp>& op, const std::exception_ptr& error);

  /// Fails every pending op with `error` and every later post (the group is destroyed). False
  /// when it was closed already.
  bool close(const std::exception_ptr& error);
  bool closed() const noexcept { return static_cast<bool>(core_.closed()); }
  /// Whether the segment's mapping is lost (a peer cut the file); the first time, every pending
  /// op fails and every peer counts as lost.
  bool check_poisoned() {
    if (poison_failed_) return true;
    return core_.check_poisoned() && fail_poisoned();  // inline: every poll asks
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
  const std::exception_ptr& peer_error(int peer) const noexcept { return core_.peer_error(peer); }
  /// `peer` is lost (or sent a malformed entry): its pending ops (and any-source receives, once
  /// no peer is left) fail with `error`; nothing more is read from or written to its rings.
  void fail_peer(int peer, std::exception_ptr error);
  /// Takes back the arena slots this rank handed to `peer`, which is gone (it reads nothing
  /// more); returns how many.
  uint32_t reclaim_slots(int peer) { return sender_.reclaim_slots(peer); }
  /// Takes back the loan tickets `peer` holds: only once its process is dead, since a rank that
  /// left its group may still read its views. Returns how many.
  uint32_t reclaim_loans(int peer) { return by_reference_.reclaim(peer); }
  /// "; a message of N bytes from rank R waits in its ring ..." for every message held back by
  /// the early-message budget, and who holds this rank's loans (for a TimeoutError), else "".
  std::string held_messages() const { return by_reference_.holders() + receiver_.held_messages(); }
  /// This rank's loan heap (loan_pool.h): shared with the loans it hands out.
  const std::shared_ptr<shm::LoanPool>& loans() const noexcept { return by_reference_.loans(); }

 private:
  // One pass over `src`'s ring; a malformed entry fails the pair (or, when the mapping is lost,
  // everything). Inline: every progress pass calls it once per peer.
  bool receive_from(int src, bool drain_all) {
    std::exception_ptr lost;
    const bool moved = receiver_.progress(src, drain_all, lost);
    if (lost) [[unlikely]]
      lose_to(src, std::move(lost));
    return moved;
  }
  // receive_from's failure: the mapping's loss when it is lost, else `src`'s.
  void lose_to(int src, std::exception_ptr error);
  // check_poisoned found the mapping lost: fails everything (once). Returns true.
  bool fail_poisoned();
  void fail_pending(const std::exception_ptr& error);

  ChannelCore core_;
  ByReference by_reference_;
  ShmSender sender_;
  ShmReceiver receiver_;
  bool poison_failed_ = false;  // fail_poisoned ran
};

}  // namespace tdshm::detail
