// The point-to-point channel's receiving side (see channel.h for the protocol): a ring read, each
// entry validated and landed, a message matched with its receive (checks, size, dtype, shape), a
// message that came before its receive buffered (unexpected, pooled), a memmap reference resolved.

#include "shm/p2p/channel_internal.h"

#include "common/copy.h"
#include "common/format.h"

#include <ATen/core/Tensor.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace tdshm::detail {

using shm::EntryHeader;

TransportError ShmChannel::corrupted(int src, const std::string& what) const {
  return TransportError("corrupted entry from " + segment_.describe_rank(static_cast<uint32_t>(src)) + ": " + what);
}

bool ShmChannel::progress_receives(int src, bool drain_all) {
  const auto s = static_cast<size_t>(src);
  if (peer_error_[s] && !current_[s]) {
    // A lost peer's ring was drained before it was declared lost, or it sent a malformed entry:
    // nothing more is read from it.
    return false;
  }
  const auto from = static_cast<uint32_t>(src);
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
        throw TransportError("corrupted entry from " + segment_.describe_rank(from) + ": arena slot " +
                             std::to_string(fields.slot) + " was taken back while this rank read it");
      }
    } catch (const Error&) {
      // A truncated segment reads as zeros once the bus guard has replaced its pages, which an
      // entry's checks see as corruption: the truncation is the error every op gets.
      if (check_poisoned()) return true;
      fail_peer(src, std::current_exception());
      return true;
    } catch (const std::bad_alloc&) {
      fail_peer(
          src, make_error<TransportError>("out of memory receiving a message of " + std::to_string(fields.total_bytes) +
                                          " bytes from " + segment_.describe_rank(from)));
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
void ShmChannel::entry_taken(int src, const shm::EntryFields& e) {
  const auto s = static_cast<size_t>(src);
  const uint64_t span = shm::has_span(e.flags) ? shm::span_entries(e.chunk_bytes) : 0;
  if (!shm::chunk_in_ring(e.flags)) {
    shm::release_slot(regions_[s], e.slot);
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
void ShmChannel::wake_sender_if_due(int src) {
  const auto s = static_cast<size_t>(src);
  if (consumed_since_wake_[s] >= wake_batch_ || (freed_slot_since_wake_[s] && rx_[s].empty())) {
    consumed_since_wake_[s] = 0;
    freed_slot_since_wake_[s] = 0;
    wake_peer(src);
  }
}

// The next entry of `src`'s ring when it is a message that lands by itself: whole in that one
// entry, with `tag` and `control`, not a reference, valid (check_entry), its chunk readable; null
// otherwise (the general path handles every other case, and fails what must fail). `e` is the
// entry read once. Only when nothing of `src` is in progress and the pair and the group are usable.
const uint8_t* ShmChannel::whole_entry(int src, int64_t tag, bool control, shm::EntryFields& e) {
  const auto s = static_cast<size_t>(src);
  if (closed_ || poisoned_ || peer_error_[s] || current_[s]) return nullptr;
  if (!rx_[s].peek(e)) return nullptr;  // (the common miss: asked first)
  constexpr uint32_t kWhole = shm::kEntryFirst | shm::kEntryLast;
  if ((e.flags & (kWhole | shm::kEntryReference | shm::kEntryLoan)) != kWhole || e.tag != tag ||
      ((e.flags & shm::kEntryControl) != 0) != control) {
    return nullptr;
  }
  const shm::ArenaShape arena{options_.slot_bytes, options_.slots_per_rank, options_.ring_entries};
  if (!shm::check_entry(e, shm::RxProgress{}, arena, kMaxMessageBytes).empty()) return nullptr;
  return chunk_of(src, e);
}

// Copies the payload of `e` (whole_entry's) into `dst` and takes the entry, unless the slot was
// taken back while it was read or the mapping was lost: false then, with nothing taken (the
// general path reads the entry again and fails as it should).
bool ShmChannel::take_whole(int src, const shm::EntryFields& e, const uint8_t* payload, uint8_t* dst) {
  if (e.chunk_bytes != 0) copy_bytes(dst, payload, e.chunk_bytes, e.total_bytes >= kStreamingMessageBytes);
  if (chunk_of(src, e) == nullptr || check_poisoned()) return false;
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
bool ShmChannel::receive_now(const at::Tensor& tensor, int src, int64_t tag, const MessageCheck& check, bool control) {
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
bool ShmChannel::land_posted(const std::shared_ptr<ShmOp>& op) {
  const int src = op->peer;
  if (src < 0 || op->kind != ShmOp::Kind::kRecv || op->view || op->staging.defined() ||
      op->done.load(std::memory_order_relaxed)) {
    return false;
  }
  shm::EntryFields e;
  const uint8_t* payload = whole_entry(src, op->tag, op->control, e);
  if (payload == nullptr) return false;
  const auto found = matcher_.find_posted(src, op->tag, op->control);
  if (found == matcher_.none() || *found != op) return false;
  // A mismatch is left to the general path, which fails the receive with the error that says why.
  if (mismatch(message_head(src, e, rx_[static_cast<size_t>(src)].shape()), op->check, op->user, op->bytes) !=
      Mismatch::kNone) {
    return false;
  }
  if (!take_whole(src, e, payload, op->data)) return false;
  op->source = src;
  matcher_.take_posted(found);
  complete(op);
  return true;
}

void ShmChannel::drain(int src) {
  while (progress_receives(src, /*drain_all=*/true)) {
  }
}

// try_match's failure (channel_internal.h): fails `op` with the error that says why `msg` does
// not fit it.
void ShmChannel::fail_match(MessageHead& msg, const std::shared_ptr<ShmOp>& op, Mismatch why) {
  const at::Tensor& t = op->contiguous();
  auto from = [&] { return op->peer < 0 ? " (from rank " + std::to_string(msg.src) + ")" : std::string(); };
  std::string problem;
  switch (why) {
    case Mismatch::kLeaves:
      op->sender_leaves = msg.check.leaves;  // published by finish's release of done
      finish(op, make_error<TransportError>(op->what() + from() + ": the sender's tree has " +
                                            std::to_string(msg.check.leaves) + " leaves but this receiving tree has " +
                                            std::to_string(op->check.leaves) + "; nothing was written"));
      return;
    case Mismatch::kCheck:
      if (op->check.kind == MessageCheck::Kind::kSchema) {
        finish(op, make_error<SchemaError>(op->what() + from() + ": the sender's consolidated schema (hash " +
                                           hex32(msg.check.value) + ") differs from this tensordict's (hash " +
                                           hex32(op->check.value) +
                                           "): tensorclass names, keys, dtypes, shapes or "
                                           "layout differ; nothing was written"));
      } else {
        finish(op, make_error<TransportError>(op->what() + from() +
                                              ": the sender's leaf at this position has another "
                                              "key (key hash " +
                                              hex32(msg.check.value) + ", this leaf's is " + hex32(op->check.value) +
                                              "): the two trees' keys differ; nothing was "
                                              "written"));
      }
      return;
    case Mismatch::kBytes:
      problem =
          "the message has " + std::to_string(msg.total) + " bytes but the tensor has " + std::to_string(op->bytes);
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
  finish(op, make_error<TransportError>(op->what() + from() + ": " + problem));
}

// What the first entry `e` from `src` says of its message (the shape from the entry's third line,
// read only for 2 or more dimensions).
MessageHead ShmChannel::message_head(int src, const shm::EntryFields& e, const shm::EntryShape& shape) {
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

// Validates one entry (a copy of what another process wrote) and moves its payload.
ShmChannel::Taken ShmChannel::handle_entry(int src, const shm::EntryFields& e, const uint8_t* payload,
                                           const shm::EntryShape& shape, ReceivePass& pass) {
  auto corrupt = [&](const std::string& what) { return corrupted(src, what); };
  auto& cur = current_[static_cast<size_t>(src)];
  shm::RxProgress rx;
  if (cur) rx = {true, cur->control, cur->total, cur->received};
  const shm::ArenaShape arena{options_.slot_bytes, options_.slots_per_rank, options_.ring_entries};
  if (std::string problem = shm::check_entry(e, rx, arena, kMaxMessageBytes); !problem.empty()) {
    throw corrupt(problem);
  }
  if (payload == nullptr) {
    throw corrupt("arena slot " + std::to_string(e.slot) + " of the sender is not handed to this rank");
  }
  const bool reference = (e.flags & shm::kEntryReference) != 0;
  shm::ReferenceFields ref;
  if (reference) {
    if (std::string problem = shm::check_reference(payload, e.chunk_bytes, e.total_bytes, ref); !problem.empty()) {
      throw corrupt(problem);
    }
  }
  if (e.flags & shm::kEntryLoan) return handle_loan(src, e, payload, shape, pass);
  return land_entry(src, e, payload, shape, reference ? &ref : nullptr, pass);
}

ShmChannel::Taken ShmChannel::land_entry(int src, const shm::EntryFields& e, const uint8_t* payload,
                                         const shm::EntryShape& shape, const shm::ReferenceFields* ref,
                                         ReceivePass& pass) {
  auto& cur = current_[static_cast<size_t>(src)];
  const bool reference = ref != nullptr;
  if (e.flags & shm::kEntryFirst) {
    MessageHead head = message_head(src, e, shape);
    const auto found = matcher_.find_posted(src, head.tag, head.control);
    if (found != matcher_.none() && (e.flags & shm::kEntryLast) && !reference) {
      // The common small message: whole in one entry, and its receive is posted. It lands at
      // once, without the record of a message in progress.
      held_bytes_[static_cast<size_t>(src)] = 0;
      std::shared_ptr<ShmOp> op = matcher_.take_posted(found);
      if (try_match(head, op)) {  // else op failed on the mismatch and the message is dropped
        if (e.chunk_bytes != 0) copy_bytes(op->data, payload, e.chunk_bytes, e.total_bytes >= kStreamingMessageBytes);
        complete(op);
        pass.completed_posted = true;
      }
      return Taken::kYes;
    }
    if (!start_message(src, head, found, e.chunk_bytes, pass)) return Taken::kHeld;
  }
  Incoming& msg = *cur;
  if (reference) {
    std::exception_ptr error;
    if (msg.op) {
      error = resolve_reference(*msg.op, *ref);
    } else if (!msg.discard) {
      std::memcpy(msg.heap.get(), payload, e.chunk_bytes);  // checked again when a recv takes it
    }
    msg.received = msg.total;
    msg.complete = true;
    auto done = std::move(cur);
    if (done->op) {
      finish(done->op, error);
      pass.completed_posted = true;
    }
    return Taken::kYes;
  }
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
      complete(done->op);
      pass.completed_posted = true;
    }
    if (done->op || done->discard) {
      done->op.reset();
      if (done.use_count() == 1) spare_[static_cast<size_t>(src)] = std::move(done);  // reused by the next message
    }
  }
  return Taken::kYes;
}

// A loan (check_entry found it a whole message in one entry): its bytes, in the sender's heap under
// a ticket handed to this rank, land in its posted receive (a view, or a copy after which the
// ticket goes back), or it waits as an early message that holds the reference, not the bytes.
ShmChannel::Taken ShmChannel::handle_loan(int src, const shm::EntryFields& e, const uint8_t* payload,
                                          const shm::EntryShape& shape, ReceivePass& pass) {
  shm::LoanReference ref;
  std::memcpy(&ref, payload, sizeof ref);
  const uint8_t* lent =
      shm::lent_bytes(loan_regions_[static_cast<size_t>(src)], ref, e.total_bytes, static_cast<uint32_t>(rank_));
  if (lent == nullptr) {
    throw TransportError("corrupted entry from " + segment_.describe_rank(static_cast<uint32_t>(src)) + ": loan of " +
                         std::to_string(e.total_bytes) + " bytes at offset " + std::to_string(ref.offset) +
                         " under ticket " + std::to_string(ref.ticket) + " is not lent to this rank");
  }
  MessageHead head = message_head(src, e, shape);
  const auto found = matcher_.find_posted(src, head.tag, head.control);
  if (found != matcher_.none()) {
    held_bytes_[static_cast<size_t>(src)] = 0;
    std::shared_ptr<ShmOp> op = matcher_.take_posted(found);
    if (try_match(head, op)) {
      land_loan(src, head, ref.ticket, lent, op);
      pass.completed_posted = true;
    } else {
      give_back_loan(src, ref.ticket);  // op failed on the mismatch; the message is dropped
    }
    return Taken::kYes;
  }
  if (!start_message(src, head, found, e.chunk_bytes, pass)) return Taken::kHeld;
  auto done = std::move(current_[static_cast<size_t>(src)]);
  std::memcpy(done->heap.get(), payload, sizeof ref);  // the ticket stays out until a recv takes it
  done->received = done->total;
  done->complete = true;
  return Taken::kYes;
}

void ShmChannel::land_loan(int src, const MessageHead& msg, uint32_t ticket, const uint8_t* lent,
                           const std::shared_ptr<ShmOp>& op) {
  const auto s = static_cast<size_t>(src);
  if (op->view) {
    try {
      ViewShape shape;
      view_shape(msg, shape);  // (checked by bind_view when the receive matched)
      // A view's elements must be aligned for its dtype: a forged offset would give a tensor
      // whose every access is misaligned.
      if (const size_t element = c10::elementSize(shape.dtype); reinterpret_cast<uintptr_t>(lent) % element != 0) {
        throw TransportError("the sender's loan of " + std::to_string(msg.total) + " bytes at heap offset " +
                             std::to_string(lent - loan_regions_[s].heap) + " is not aligned for " +
                             c10::toString(shape.dtype) + " (" + std::to_string(element) + " bytes)");
      }
      op->user = shm::view_of_loan(segment_.mapping(), loan_regions_[s], ticket,
                                   segment_.rank_slot(static_cast<uint32_t>(src)), lent, shape.sizes, shape.dtype);
    } catch (const std::exception& e) {
      give_back_loan(src, ticket);
      finish(op, make_error<TransportError>(op->what() + ": " + e.what()));
      return;
    }
    op->data = static_cast<uint8_t*>(op->user.data_ptr());
    complete(op);
    return;
  }
  if (msg.total != 0) copy_bytes(op->data, lent, msg.total, msg.total >= kStreamingMessageBytes);
  // The bytes were read only while the ticket named this rank: a sender that took it back (or
  // rewrote it) meanwhile may have rewritten them, and the copy may be torn (as for a slot).
  if (!shm::still_lent(loan_regions_[s], ticket, static_cast<uint32_t>(rank_))) {
    finish(op, make_error<TransportError>(op->what() + ": corrupted transfer from " +
                                          segment_.describe_rank(static_cast<uint32_t>(src)) + ": its loan (ticket " +
                                          std::to_string(ticket) + ") was taken back while this rank copied it"));
    return;  // not this rank's ticket any more: nothing to give back
  }
  give_back_loan(src, ticket);
  complete(op);
}

// The shape and dtype of the tensor `msg` holds, or why it makes none ("" when it does).
std::string ShmChannel::view_shape(const MessageHead& msg, ViewShape& out) {
  if (msg.dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions)) return "has no valid dtype";
  out.dtype = static_cast<c10::ScalarType>(msg.dtype);
  if (c10::isQIntType(out.dtype) || out.dtype == c10::ScalarType::Undefined) {
    return std::string("has dtype ") + c10::toString(out.dtype) + ", which a view cannot take";
  }
  const uint64_t element = c10::elementSize(out.dtype);
  if (msg.ndim == shm::kShapeNotSent) return "has more than 8 dimensions, whose shape is not sent";
  if (msg.total % element != 0) return "has a size that is not a whole number of elements";
  out.sizes.clear();
  if (msg.ndim == 1) {
    out.sizes.push_back(static_cast<int64_t>(msg.total / element));
  } else if (msg.ndim >= 2) {
    uint64_t numel = 1;
    for (uint8_t d = 0; d < msg.ndim; ++d) {
      if (msg.dims[d] < 0 || (msg.dims[d] != 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(msg.dims[d]))) {
        return "has an invalid shape";
      }
      numel *= static_cast<uint64_t>(msg.dims[d]);
      out.sizes.push_back(msg.dims[d]);
    }
    if (numel * element != msg.total) return "has a shape that does not match its size";
  } else if (msg.total != element) {
    return "has no dimensions but " + std::to_string(msg.total) + " bytes";
  }
  return {};
}

// A recv_view takes any tensor: the message's own checks still apply (another key, another
// schema), then its dtype and shape must make a tensor of its size. A message that is not a loan
// lands in a fresh tensor of that shape.
bool ShmChannel::bind_view(const MessageHead& msg, const std::shared_ptr<ShmOp>& op) {
  const MessageCheck& expect = op->check;
  if (expect.kind != MessageCheck::Kind::kNone && msg.check.kind == expect.kind) {
    MessageHead m = msg;
    if (msg.check.leaves != 0 && expect.leaves != 0 && msg.check.leaves != expect.leaves) {
      fail_match(m, op, Mismatch::kLeaves);
      return false;
    }
    if (msg.check.value != expect.value) {
      fail_match(m, op, Mismatch::kCheck);
      return false;
    }
  }
  ViewShape shape;
  if (const std::string why = view_shape(msg, shape); !why.empty()) {
    finish(op,
           make_error<TransportError>(op->what() + ": the message from rank " + std::to_string(msg.src) + " " + why));
    return false;
  }
  op->bytes = msg.total;
  if (!msg.loan) {  // (a loan's view is made where its bytes are: land_loan)
    try {
      op->user = at::empty(shape.sizes, at::TensorOptions().dtype(shape.dtype));
    } catch (const std::exception& e) {
      finish(op, make_error<TransportError>(op->what() + ": a tensor for the message from rank " +
                                            std::to_string(msg.src) + " cannot be allocated: " + e.what()));
      return false;
    }
    op->data = static_cast<uint8_t*>(op->user.data_ptr());
  }
  return true;
}

// Lands a reference message (validated by check_reference) in `op`: nothing to do when op's
// tensor maps the same bytes, else one copy from the file. Returns the error to fail op with.
// The file is the sender's choice: it is opened by the rules of memmap/peer_file.h (no link
// followed, a regular file of this user, read-only), and never read past its end; the bytes go
// into the receiver's own tensor.
std::exception_ptr ShmChannel::resolve_reference(const ShmOp& op, const shm::ReferenceFields& ref) const {
  if (op.bytes == 0) return nullptr;
  if (auto mine = MemoryMappedTensor::info(op.user);
      mine && mine->writable && op.user.is_contiguous() && static_cast<uint64_t>(mine->offset) == ref.offset &&
      (mine->filename == ref.path || peer_path(mine->filename) == ref.path)) {  // (a private mapping may differ)
    return nullptr;  // the receiver's tensor is the sender's bytes
  }
  auto fail = [&](const std::string& why) {
    return make_error<TransportError>(op.what() + ": the sender's memory-mapped file '" + ref.path + "': " + why);
  };
  std::string problem;
  const int fd = open_peer_file(ref.path, /*writable=*/false, problem);
  if (fd < 0) return fail(problem);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return fail(std::string("cannot stat it: ") + std::strerror(errno));
  }
  if (ref.offset + op.bytes > static_cast<uint64_t>(st.st_size)) {
    ::close(fd);
    return fail("the file has " + std::to_string(st.st_size) + " bytes, the message needs " +
                std::to_string(ref.offset + op.bytes));
  }
  uint64_t done = 0;
  while (done < op.bytes) {
    const ssize_t n = ::pread(fd, op.data + done, op.bytes - done, static_cast<off_t>(ref.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "the file is shorter than the message";
      ::close(fd);
      return fail("reading it: " + why);
    }
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return nullptr;
}

// Starts the message whose first entry is `e`: into the receive posted for it, or into process
// memory while the unexpected budget allows. Returns false, changing nothing, when it must stay in
// the ring (back-pressure).
bool ShmChannel::start_message(int src, const MessageHead& head, Matcher::Found found, uint32_t chunk_bytes,
                               const ReceivePass& pass) {
  const auto s = static_cast<size_t>(src);
  const bool reference = head.reference;
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
  const uint64_t need = posted ? 0 : reference || head.loan ? chunk_bytes : head.total;
  if (!posted &&
      need > options_.max_unexpected_bytes - std::min<uint64_t>(unexpected_bytes_, options_.max_unexpected_bytes)) {
    held_bytes_[s] = std::max<uint64_t>(need, 1);
    return false;
  }
  held_bytes_[s] = 0;
  auto& spare = spare_[s];
  auto msg = spare ? std::move(spare) : std::make_shared<Incoming>();
  *msg = Incoming{};
  static_cast<MessageHead&>(*msg) = head;
  if (posted) {
    std::shared_ptr<ShmOp> op = matcher_.take_posted(found);
    if (try_match(*msg, op)) {
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

void ShmChannel::release_unexpected(Incoming& msg) {
  unexpected_bytes_ -= std::min(unexpected_bytes_, msg.heap_bytes);
  unexpected_pool_.give_back(std::move(msg.heap));
  msg.heap = {};
  msg.heap_bytes = 0;
}

}  // namespace tdshm::detail
