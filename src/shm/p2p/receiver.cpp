// The receiving side of one rank's channel (receiver.h; channel.h has the protocol): receives
// made and posted, a ring read, each entry validated and landed, a message matched with its
// receive (checks, size, dtype, shape), a message that came before its receive buffered
// (unexpected, pooled) or left in its ring.

#include "shm/p2p/receiver.h"

#include "common/copy.h"
#include "common/format.h"

#include <tdshm/memmap.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

namespace tdshm::detail {

ShmReceiver::ShmReceiver(ChannelCore& core, ByReference& by_reference)
    : core_(core),
      by_reference_(by_reference),
      // Up to 64 MiB of early-message buffers stay resident between messages.
      unexpected_pool_(std::min<uint64_t>(core.options().max_unexpected_bytes, uint64_t{64} << 20)) {
  const auto n = static_cast<size_t>(core.size());
  const auto me = static_cast<uint32_t>(core.rank());
  const ShmOptions& options = core.options();
  shm::Segment& segment = core.segment();
  const uint64_t incarnation = segment.incarnation();
  rx_.resize(n);
  for (uint32_t p = 0; p < static_cast<uint32_t>(n); ++p) {
    if (p == me) continue;
    rx_[p] = shm::RingConsumer(
        shm::RingView(segment.ring_memory(p, me), options.ring_entries, shm::ring_key(incarnation, p, me)));
  }
  current_.resize(n);
  spare_.resize(n);
  held_bytes_.assign(n, 0);
  consumed_since_wake_.assign(n, 0);
  freed_slot_since_wake_.assign(n, 0);
  batch_cursor_.assign(n, BatchCursor{});
  wake_batch_ = std::max<uint32_t>(1, std::min(options.slots_per_rank, options.ring_entries) / 4);
}

// ---------------------------------------------------------------------------------------------
// Making and posting receives

// Bytes land in place: a tensor whose elements share memory (an expanded view) cannot take them,
// nor can a read-only mapping. (A contiguous tensor's elements never overlap: the common case
// skips that check.)
static void check_receiving_tensor(const at::Tensor& tensor) {
  if (!tensor.is_contiguous() && tensor.numel() > 1 && at::has_internal_overlap(tensor) == at::MemOverlap::Yes) {
    throw TypeError("shm recv: the tensor's elements overlap in memory (an expanded or stride-0 view, strides " +
                    shape_str(tensor.strides()) +
                    "), so it cannot receive bytes in place; receive into a tensor "
                    "of its own (for instance t.contiguous() or t.clone())");
  }
  if (!MemoryMappedTensor::is_mapped(tensor)) return;
  if (auto info = MemoryMappedTensor::info(tensor); info && !info->writable) {
    throw TypeError("shm recv: the tensor is a read-only memory-mapped file ('" + info->filename +
                    "'), so it cannot receive bytes; open it writable or receive into another tensor");
  }
}

static void check_recv_source(int src, int rank, int size) {
  if (src < -1 || src >= size || src == rank) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "shm recv: source rank " + std::to_string(src) + " is invalid for rank " + std::to_string(rank) +
                         " of " + std::to_string(size));
  }
}

OpList ShmReceiver::make_recvs(std::span<const at::Tensor> tensors, int src, int rank, int size,
                               std::span<const int64_t> tags, std::span<const MessageCheck> checks, bool control) {
  TORCH_INTERNAL_ASSERT(tags.size() == tensors.size() && checks.size() == tensors.size());
  OpList ops;
  if (tensors.size() == 1) {
    ops.push_back(make_recv(tensors[0], src, rank, size, tags[0], checks[0], control));  // no array
    return ops;
  }
  check_recv_source(src, rank, size);
  for (const at::Tensor& tensor : tensors) check_receiving_tensor(tensor);  // all checked before anything is posted
  ops = make_recv_ops(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    init_op(*ops[i], src, tags[i], control, tensors[i]);
    ops[i]->check = checks[i];
  }
  return ops;
}

std::shared_ptr<ShmOp> ShmReceiver::make_recv(const at::Tensor& tensor, int src, int rank, int size, int64_t tag,
                                              const MessageCheck& check, bool control) {
  check_recv_source(src, rank, size);
  check_receiving_tensor(tensor);
  auto op = make_recv_op(src, tag, control, tensor);
  op->check = check;
  return op;
}

std::shared_ptr<ShmOp> ShmReceiver::make_recv_view(int src, int rank, int size, int64_t tag,
                                                   const MessageCheck& check) {
  check_recv_source(src, rank, size);
  auto op = new_op<RecvOp>();
  op->peer = src;
  op->tag = tag;
  op->check = check;
  op->view = true;
  return op;
}

bool ShmReceiver::post_recvs(std::span<const std::shared_ptr<ShmOp>> ops, int src) {
  bool posted = false;
  for (const auto& op : ops) posted |= post_recv(std::static_pointer_cast<RecvOp>(op), src);
  return posted;
}

// Matches `op` with a message drained earlier, or posts it. True if it was posted (the rings may
// hold its message).
bool ShmReceiver::post_recv(std::shared_ptr<RecvOp> op, int src) {
  if (core_.closed() || core_.poisoned()) {
    core_.finish(*op, core_.closed() ? core_.closed() : core_.poisoned());
    return false;
  }
  // Messages drained earlier (unexpected) are older than what is still in the rings: match them
  // first; otherwise post, then drain the rings, so a message already there lands in place.
  if (const std::shared_ptr<Incoming> keep = matcher_.take_early(src, op->tag, op->control)) {
    land_early(*keep, op);
    return false;
  }
  if (src >= 0 && core_.peer_error(src)) {
    core_.finish(*op, core_.peer_error(src));
    return false;
  }
  matcher_.post(std::move(op));
  return true;
}

// Lands the early message `keep` in the receive `op` that takes it: what arrived of it is copied
// over (the rest lands as it comes), or its reference is landed (by_reference.h).
void ShmReceiver::land_early(Incoming& keep, const std::shared_ptr<RecvOp>& op) {
  if (keep.loan || keep.reference) {  // always complete: one entry, whose reference `heap` kept
    Reference ref;
    const std::string problem = by_reference_.decode(keep, keep.heap.get(), keep.heap_bytes, ref);
    release_unexpected(keep);
    if (!try_match(keep, *op)) {
      // The receive failed with a clear error and the message is dropped (as MPI drops a
      // truncated one), so that what follows on this tag stays in step.
      by_reference_.drop(keep, ref);
    } else if (!problem.empty()) {
      core_.finish(*op, make_error<TransportError>(op->what() + ": " + (keep.loan ? "the sender's " : "") + problem));
    } else {
      by_reference_.land(keep, ref, *op);
    }
    return;
  }
  if (!try_match(keep, *op)) {
    if (!keep.complete) keep.discard = true;
    release_unexpected(keep);
    return;
  }
  if (keep.complete) {
    if (keep.total != 0) std::memcpy(op->data, keep.heap.get(), keep.total);
    release_unexpected(keep);
    core_.finish(*op, nullptr);
  } else {
    if (keep.received != 0) std::memcpy(op->data, keep.heap.get(), keep.received);
    release_unexpected(keep);
    keep.op = op;
  }
}

void ShmReceiver::withdraw(const std::shared_ptr<ShmOp>& op) {
  matcher_.withdraw(std::static_pointer_cast<RecvOp>(op));
  for (auto& msg : current_) {
    if (msg && msg->op == op) {
      msg->op.reset();
      msg->discard = true;  // the rest of it is drained and dropped
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Reading a ring

bool ShmReceiver::progress(int src, bool drain_all, std::exception_ptr& lost) {
  const auto s = static_cast<size_t>(src);
  if (core_.peer_error(src) && !current_[s]) {
    // A lost peer's ring was drained before it was declared lost, or it sent a malformed entry:
    // nothing more is read from it.
    return false;
  }
  shm::RingConsumer& ring = rx_[s];
  bool moved = false;
  ReceivePass pass{drain_all};
  for (;;) {
    shm::EntryFields fields;
    if (!ring.peek(fields)) break;  // read once: only this copy is used below
    // The chunk: in the entry, in its span, or in the sender's slot if that slot was handed to
    // this rank (else null, and handle_entry refuses the entry as corrupt).
    const bool in_slot = !shm::chunk_in_ring(fields.flags);
    const uint8_t* payload = chunk_of(src, fields);
    Taken taken;
    try {
      taken = fields.flags == shm::kEntryBatch ? handle_batch(src, fields, payload, pass)
                                               : handle_entry(src, fields, payload, ring.shape(), pass);
      // The sender's region is written only by the sender, and only in free slots: a slot that is
      // no longer handed to this rank after the copy was rewritten while it was read.
      if (taken == Taken::kYes && in_slot && chunk_of(src, fields) == nullptr) {
        throw core_.corrupted(src,
                              "arena slot " + std::to_string(fields.slot) + " was taken back while this rank read it");
      }
    } catch (const Error&) {
      // (A truncated segment reads as zeros, which an entry's checks see as corruption: the
      // channel makes the truncation the error every op gets.)
      lost = std::current_exception();
      return true;
    } catch (const std::bad_alloc&) {
      lost = make_error<TransportError>("out of memory receiving a message of " + std::to_string(fields.total_bytes) +
                                        " bytes from " + core_.segment().describe_rank(static_cast<uint32_t>(src)));
      return true;
    }
    if (taken == Taken::kHeld) break;  // over the unexpected budget: it waits in the ring
    entry_taken(src, fields);
    moved = true;
  }
  if (moved) wake_sender_if_due(src);
  return moved;
}

// `e`, the next entry of `src`'s ring, has landed: its slot goes back to the sender, then the entry
// (with its span).
void ShmReceiver::entry_taken(int src, const shm::EntryFields& e) {
  const auto s = static_cast<size_t>(src);
  const uint64_t span = shm::has_span(e.flags) ? shm::span_entries(e.chunk_bytes) : 0;
  if (!shm::chunk_in_ring(e.flags)) {
    shm::release_slot(core_.region(src), e.slot);
    freed_slot_since_wake_[s] = 1;
  }
  rx_[s].consume(span);
  consumed_since_wake_[s] += static_cast<uint32_t>(1 + span);
}

// After entries of `src` were taken. The sender may sleep waiting for room: wake it once a
// quarter of its room is back, or when its ring is empty after a slot came back, rather than for
// every entry (a producer woken per freed slot copies one chunk and sleeps again: with more ranks
// than cores, a data loader's workers thrashed so). A sender that waits for ring entries had the
// whole ring full, so a quarter of it comes back before the ring is empty: small messages that
// carry their bytes in the entry (a ping-pong) pay no wake-up (a fence and a read of the sender's
// line) per message.
void ShmReceiver::wake_sender_if_due(int src) {
  const auto s = static_cast<size_t>(src);
  if (consumed_since_wake_[s] >= wake_batch_ || (freed_slot_since_wake_[s] && rx_[s].empty())) {
    consumed_since_wake_[s] = 0;
    freed_slot_since_wake_[s] = 0;
    core_.wake_peer(src);
  }
}

// ---------------------------------------------------------------------------------------------
// Landing at once

// The next entry of `src`'s ring when it is a message that lands by itself: whole in that one
// entry, with `tag` and `control`, not a reference, valid (check_entry), its chunk readable; null
// otherwise (the general path handles every other case, and fails what must fail). `e` is the
// entry read once. Only when nothing of `src` is in progress and the pair and the group are usable.
const uint8_t* ShmReceiver::whole_entry(int src, int64_t tag, bool control, shm::EntryFields& e) {
  const auto s = static_cast<size_t>(src);
  if (core_.refused(src) || current_[s]) return nullptr;
  if (!rx_[s].peek(e)) return nullptr;  // (the common miss: asked first)
  constexpr uint32_t kWhole = shm::kEntryFirst | shm::kEntryLast;
  if ((e.flags & (kWhole | shm::kEntryReference | shm::kEntryLoan)) != kWhole || e.tag != tag ||
      ((e.flags & shm::kEntryControl) != 0) != control) {
    return nullptr;
  }
  if (!shm::check_entry(e, shm::RxProgress{}, core_.arena(), kMaxMessageBytes).empty()) return nullptr;
  return chunk_of(src, e);
}

// Copies the payload of `e` (whole_entry's) into `dst` and takes the entry, unless the slot was
// taken back while it was read or the mapping was lost: false then, with nothing taken (the
// general path reads the entry again and fails as it should).
bool ShmReceiver::take_whole(int src, const shm::EntryFields& e, const uint8_t* payload, uint8_t* dst) {
  if (e.chunk_bytes != 0) copy_bytes(dst, payload, e.chunk_bytes, e.total_bytes >= kStreamingMessageBytes);
  if (chunk_of(src, e) == nullptr || core_.check_poisoned()) return false;
  held_bytes_[static_cast<size_t>(src)] = 0;
  entry_taken(src, e);
  wake_sender_if_due(src);
  return true;
}

// A receive whose message is already the next entry of `src`'s ring, whole in that one entry,
// lands at once: no op, no matcher, no pass over the other rings (a receiver that runs behind
// its sender: a stream of small messages, a consolidated tensordict of one slot). Only when
// nothing may come first: no early message, no older posted receive that takes the same
// messages, no message of `src` in progress. Every other case, and anything the general path
// would fail (a corrupt entry, a mismatch, a lost mapping), returns false with nothing changed,
// and the receive is posted as usual, which handles it.
bool ShmReceiver::receive_now(const at::Tensor& tensor, int src, int64_t tag, const MessageCheck& check, bool control) {
  if (matcher_.early_count() != 0) return false;
  shm::EntryFields e;
  const uint8_t* payload = whole_entry(src, tag, control, e);
  if (payload == nullptr || matcher_.find_posted(src, tag, control) != matcher_.none()) return false;
  const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
  if (mismatch(message_head(src, e, rx_[static_cast<size_t>(src)].shape()), check, tensor, bytes) != Mismatch::kNone) {
    return false;
  }
  return take_whole(src, e, payload, static_cast<uint8_t*>(tensor.data_ptr()));
}

// The posted receive `op` (from one source) takes the next entry of its source's ring when that
// entry is its whole message and `op` is the receive the matcher would give it (the oldest that
// accepts it): what progress would do, without a pass over every ring and queue (a ping-pong's
// waiting rank, ShmEngine::wait). False, with nothing changed, in every other case.
bool ShmReceiver::land_posted(const std::shared_ptr<ShmOp>& op) {
  const int src = op->peer;
  if (src < 0 || op->kind != ShmOp::Kind::kRecv || op->as_recv().view || op->staging.defined() ||
      op->done.load(std::memory_order_relaxed)) {
    return false;
  }
  RecvOp& recv = op->as_recv();
  shm::EntryFields e;
  const uint8_t* payload = whole_entry(src, recv.tag, recv.control, e);
  if (payload == nullptr) return false;
  const auto found = matcher_.find_posted(src, recv.tag, recv.control);
  if (found == matcher_.none() || found->get() != &recv) return false;
  // A mismatch is left to the general path, which fails the receive with the error that says why.
  if (mismatch(message_head(src, e, rx_[static_cast<size_t>(src)].shape()), recv.check, recv.user, recv.bytes) !=
      Mismatch::kNone) {
    return false;
  }
  if (!take_whole(src, e, payload, recv.data)) return false;
  recv.source = src;
  matcher_.take_posted(found);
  core_.complete(recv);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Matching

void fail_match(ChannelCore& core, MessageHead& msg, RecvOp& op, Mismatch why) {
  const at::Tensor& t = op.contiguous();
  auto from = [&] { return op.peer < 0 ? " (from rank " + std::to_string(msg.src) + ")" : std::string(); };
  std::string problem;
  switch (why) {
    case Mismatch::kLeaves:
      op.sender_leaves = msg.check.leaves;  // published by finish's release of done
      core.finish(op,
                  make_error<TransportError>(op.what() + from() + ": the sender's tree has " +
                                             std::to_string(msg.check.leaves) + " leaves but this receiving tree has " +
                                             std::to_string(op.check.leaves) + "; nothing was written"));
      return;
    case Mismatch::kCheck:
      if (op.check.kind == MessageCheck::Kind::kSchema) {
        core.finish(op, make_error<SchemaError>(op.what() + from() + ": the sender's consolidated schema (hash " +
                                                hex32(msg.check.value) + ") differs from this tensordict's (hash " +
                                                hex32(op.check.value) +
                                                "): tensorclass names, keys, dtypes, shapes or "
                                                "layout differ; nothing was written"));
      } else {
        core.finish(op,
                    make_error<TransportError>(op.what() + from() +
                                               ": the sender's leaf at this position has another "
                                               "key (key hash " +
                                               hex32(msg.check.value) + ", this leaf's is " + hex32(op.check.value) +
                                               "): the two trees' keys differ; nothing was "
                                               "written"));
      }
      return;
    case Mismatch::kBytes:
      problem =
          "the message has " + std::to_string(msg.total) + " bytes but the tensor has " + std::to_string(op.bytes);
      break;
    case Mismatch::kDtype: {
      const auto dtype = static_cast<c10::ScalarType>(msg.dtype);
      problem = std::string("the message has dtype ") +
                (msg.dtype < static_cast<uint8_t>(c10::ScalarType::NumOptions) ? c10::toString(dtype) : "?") +
                " but the tensor has dtype " + c10::toString(t.scalar_type());
      break;
    }
    case Mismatch::kShape:
      if (msg.ndim == 1) msg.dims[0] = static_cast<int64_t>(msg.total / t.element_size());
      problem = "the message has shape " + shape_str(c10::IntArrayRef(msg.dims, msg.ndim)) +
                " but the tensor has shape " + shape_str(t.sizes());
      break;
    case Mismatch::kNone: break;
  }
  core.finish(op, make_error<TransportError>(op.what() + from() + ": " + problem));
}

// What the first entry `e` from `src` says of its message (the shape from the entry's third line,
// read only for 2 or more dimensions).
MessageHead ShmReceiver::message_head(int src, const shm::EntryFields& e, const shm::EntryShape& shape) {
  MessageHead h;
  h.src = src;
  h.tag = e.tag;
  h.control = (e.flags & shm::kEntryControl) != 0;
  h.reference = (e.flags & shm::kEntryReference) != 0;
  h.loan = (e.flags & shm::kEntryLoan) != 0;
  read_entry_check(e, h.check);
  h.total = e.total_bytes;
  h.dtype = e.dtype;
  h.ndim = e.ndim;
  if (e.ndim != shm::kShapeNotSent && e.ndim >= 2) std::memcpy(h.dims, shape.dims, e.ndim * sizeof(int64_t));
  return h;
}

// ---------------------------------------------------------------------------------------------
// Landing an entry

// Validates one entry (a copy of what another process wrote) and moves its payload.
ShmReceiver::Taken ShmReceiver::handle_entry(int src, const shm::EntryFields& e, const uint8_t* payload,
                                             const shm::EntryShape& shape, ReceivePass& pass) {
  const auto& cur = current_[static_cast<size_t>(src)];
  shm::RxProgress rx;
  if (cur) rx = {true, cur->control, cur->total, cur->received};
  if (std::string problem = shm::check_entry(e, rx, core_.arena(), kMaxMessageBytes); !problem.empty()) {
    throw core_.corrupted(src, problem);
  }
  if (payload == nullptr) {
    throw core_.corrupted(src, "arena slot " + std::to_string(e.slot) + " of the sender is not handed to this rank");
  }
  if (e.flags & (shm::kEntryReference | shm::kEntryLoan)) return land_reference(src, e, payload, shape, pass);
  return land_entry(src, e, payload, shape, pass);
}

ShmReceiver::Taken ShmReceiver::land_entry(int src, const shm::EntryFields& e, const uint8_t* payload,
                                           const shm::EntryShape& shape, ReceivePass& pass) {
  auto& cur = current_[static_cast<size_t>(src)];
  if (e.flags & shm::kEntryFirst) {
    MessageHead head = message_head(src, e, shape);
    const auto found = matcher_.find_posted(src, head.tag, head.control);
    if (found != matcher_.none() && (e.flags & shm::kEntryLast)) {
      // The common small message: whole in one entry, and its receive is posted. It lands at
      // once, without the record of a message in progress.
      held_bytes_[static_cast<size_t>(src)] = 0;
      std::shared_ptr<RecvOp> op = matcher_.take_posted(found);
      if (try_match(head, *op)) {  // else op failed on the mismatch and the message is dropped
        if (e.chunk_bytes != 0) copy_bytes(op->data, payload, e.chunk_bytes, e.total_bytes >= kStreamingMessageBytes);
        core_.complete(*op);
        pass.completed_posted = true;
      }
      return Taken::kYes;
    }
    if (!start_message(src, head, found, e.chunk_bytes, pass)) return Taken::kHeld;
  }
  Incoming& msg = *cur;
  // check_entry bounds the chunk by what is left of the message, whose size is the receive's
  // (try_match) or that of the buffer allocated for it.
  if (e.chunk_bytes != 0 && !msg.discard) {
    uint8_t* dst = msg.op ? msg.op->data + msg.received : msg.heap.get() + msg.received;
    // A message larger than the caches is written around them (see copy_bytes); the ring's
    // slots themselves stay cached for the next chunks.
    copy_bytes(dst, payload, e.chunk_bytes, msg.total >= kStreamingMessageBytes);
  }
  msg.received += e.chunk_bytes;
  if (e.flags & shm::kEntryLast) {
    msg.complete = true;
    auto done = std::move(cur);
    if (done->op) {
      core_.complete(*done->op);
      pass.completed_posted = true;
    }
    if (done->op || done->discard) {
      done->op.reset();
      if (done.use_count() == 1) spare_[static_cast<size_t>(src)] = std::move(done);  // reused by the next message
    }
  }
  return Taken::kYes;
}

// A reference (check_entry found it a whole message in one entry): a loan, whose bytes are in the
// sender's heap under a ticket handed to this rank, or a memory-mapped file. It lands in its posted
// receive (by_reference.h), or waits as an early message that keeps the reference, not the bytes.
ShmReceiver::Taken ShmReceiver::land_reference(int src, const shm::EntryFields& e, const uint8_t* payload,
                                               const shm::EntryShape& shape, ReceivePass& pass) {
  MessageHead head = message_head(src, e, shape);
  Reference ref;
  if (std::string problem = by_reference_.decode(head, payload, e.chunk_bytes, ref); !problem.empty()) {
    throw core_.corrupted(src, problem);
  }
  const auto found = matcher_.find_posted(src, head.tag, head.control);
  if (found != matcher_.none()) {
    held_bytes_[static_cast<size_t>(src)] = 0;
    std::shared_ptr<RecvOp> op = matcher_.take_posted(found);
    if (try_match(head, *op)) {
      by_reference_.land(head, ref, *op);
      pass.completed_posted = true;
    } else {
      by_reference_.drop(head, ref);  // op failed on the mismatch; the message is dropped
    }
    return Taken::kYes;
  }
  if (!start_message(src, head, found, e.chunk_bytes, pass)) return Taken::kHeld;
  auto done = std::move(current_[static_cast<size_t>(src)]);
  std::memcpy(done->heap.get(), payload, e.chunk_bytes);  // a loan's ticket stays out until a recv takes it
  done->received = done->total;
  done->complete = true;
  return Taken::kYes;
}

// Starts the message whose first entry is `e`: into the receive posted for it, or into process
// memory while the unexpected budget allows. Returns false, changing nothing, when it must stay in
// the ring (back-pressure).
bool ShmReceiver::start_message(int src, const MessageHead& head, Matcher::Found found, uint32_t chunk_bytes,
                                const ReceivePass& pass) {
  const auto s = static_cast<size_t>(src);
  const bool posted = found != matcher_.none();
  // Once a posted receive completed in this pass, the messages after it go on landing in their
  // posted receives, but one that has none stays in the ring: a waiter that now has what it
  // waited for returns instead of draining later messages into process memory ("unexpected", a
  // second copy) before their receives are posted. A waiter that still waits calls again.
  if (!posted && pass.completed_posted) return false;
  if (!posted && !pass.drain_all && !matcher_.waits_on(src)) {
    return false;  // nobody waits on this source yet: it stays in the ring for now (progress)
  }
  // An unexpected reference (a memmap's or a loan's) keeps the reference, not the bytes.
  const uint64_t need = posted ? 0 : head.reference || head.loan ? chunk_bytes : head.total;
  const uint64_t budget = core_.options().max_unexpected_bytes;
  if (!posted && need > budget - std::min<uint64_t>(unexpected_bytes_, budget)) {
    held_bytes_[s] = std::max<uint64_t>(need, 1);
    return false;
  }
  held_bytes_[s] = 0;
  auto& spare = spare_[s];
  auto msg = spare ? std::move(spare) : std::make_shared<Incoming>();
  *msg = Incoming{};
  static_cast<MessageHead&>(*msg) = head;
  if (posted) {
    std::shared_ptr<RecvOp> op = matcher_.take_posted(found);
    if (try_match(*msg, *op)) {
      msg->op = std::move(op);
    } else {
      msg->discard = true;  // that receive failed on a mismatch; the message is dropped
    }
    current_[s] = std::move(msg);
    return true;
  }
  msg->heap = unexpected_pool_.take(need);
  msg->heap_bytes = need;
  unexpected_bytes_ += need;
  current_[s] = msg;
  matcher_.add_early(msg);
  return true;
}

void ShmReceiver::release_unexpected(Incoming& msg) {
  unexpected_bytes_ -= std::min(unexpected_bytes_, msg.heap_bytes);
  unexpected_pool_.give_back(std::move(msg.heap));
  msg.heap = {};
  msg.heap_bytes = 0;
}

// ---------------------------------------------------------------------------------------------
// Failing

void ShmReceiver::fail_peer(int peer, const std::exception_ptr& error) {
  auto& cur = current_[static_cast<size_t>(peer)];
  if (cur) {
    if (cur->op) core_.finish(*cur->op, error);
    if (matcher_.remove_early(cur)) release_unexpected(*cur);  // nobody will ever finish it
    cur.reset();
  }
  held_bytes_[static_cast<size_t>(peer)] = 0;
  const bool someone_alive = core_.someone_alive();
  matcher_.drop_posted_if([&](const RecvOp& op) { return op.peer == peer || (op.peer < 0 && !someone_alive); },
                          [&](const std::shared_ptr<RecvOp>& op) { core_.finish(*op, error); });
}

void ShmReceiver::fail_all(const std::exception_ptr& error) {
  matcher_.clear([&](const std::shared_ptr<RecvOp>& op) { core_.finish(*op, error); });
  for (auto& msg : current_) {
    if (msg && msg->op) core_.finish(*msg->op, error);
    msg.reset();
  }
  unexpected_bytes_ = 0;
}

std::string ShmReceiver::held_messages() const {
  std::string held;
  const uint64_t budget = core_.options().max_unexpected_bytes;
  for (size_t p = 0; p < held_bytes_.size(); ++p) {
    if (held_bytes_[p] != 0) {
      held += "; a message of " + std::to_string(held_bytes_[p]) + " bytes from rank " + std::to_string(p) +
              " waits in its ring for its recv (early messages already hold " + std::to_string(unexpected_bytes_) +
              " bytes of ShmOptions::max_unexpected_bytes = " + std::to_string(budget) + ")";
    }
  }
  return held;
}

}  // namespace tdshm::detail
