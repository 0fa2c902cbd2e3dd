// The point-to-point channel's sending side and its failure state (see channel.h for the
// protocol): posting, writing entries, completing and withdrawing ops, failing them.

#include "shm/p2p/channel_internal.h"

#include "common/format.h"
#include "common/log.h"
#include "shm/parts/waiter.h"

#include <tdshm/memmap.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace tdshm::detail {

using shm::EntryHeader;

std::string ShmOp::what() const {
  std::string s = kind == Kind::kSend
                      ? "send to rank " + std::to_string(peer)
                      : (peer < 0 ? std::string("recv from any rank") : "recv from rank " + std::to_string(peer));
  return s + (control ? ", collective " : ", tag ") + std::to_string(tag) + " (" + std::to_string(bytes) + " bytes)";
}

ShmChannel::ShmChannel(shm::Segment& segment, int rank, int size, const ShmOptions& options)
    : segment_(segment),
      rank_(rank),
      size_(size),
      options_(options),
      // Up to 64 MiB of early-message buffers stay resident between messages.
      unexpected_pool_(std::min<uint64_t>(options.max_unexpected_bytes, uint64_t{64} << 20)) {
  const auto n = static_cast<size_t>(size);
  const auto& g = segment_.geometry();
  const auto me = static_cast<uint32_t>(rank);
  send_queues_.resize(n);
  tx_.resize(n);
  rx_.resize(n);
  regions_.resize(n);
  const uint64_t incarnation = segment_.incarnation();
  for (uint32_t p = 0; p < static_cast<uint32_t>(size); ++p) {
    regions_[p] = shm::RegionView(segment_.region_memory(p), options.slots_per_rank, g.slot_table_bytes, g.slot_stride);
    if (p == me) continue;
    tx_[p] = shm::RingProducer(
        shm::RingView(segment_.ring_memory(me, p), options.ring_entries, shm::ring_key(incarnation, me, p)));
    rx_[p] = shm::RingConsumer(
        shm::RingView(segment_.ring_memory(p, me), options.ring_entries, shm::ring_key(incarnation, p, me)));
  }
  slots_ = shm::SlotAllocator(regions_[me]);
  loans_ = std::make_shared<shm::LoanPool>(segment_, me);
  loan_regions_.resize(n);
  for (uint32_t p = 0; p < static_cast<uint32_t>(size); ++p) loan_regions_[p] = shm::LoanRegionView::of(segment_, p);
  current_.resize(n);
  spare_.resize(n);
  peer_error_.resize(n);
  held_bytes_.assign(n, 0);
  consumed_since_wake_.assign(n, 0);
  freed_slot_since_wake_.assign(n, 0);
  batch_cursor_.assign(n, BatchCursor{});
  wake_batch_ = std::max<uint32_t>(1, std::min(options.slots_per_rank, options.ring_entries) / 4);
  span_limit_ = shm::span_limit(options.ring_entries);
}

void ShmChannel::wake_peer(int r) noexcept { shm::wake(segment_.rank_slot(static_cast<uint32_t>(r))); }

// ---------------------------------------------------------------------------------------------
// Posting

void ShmChannel::check_destination(int dst) const {
  if (dst < 0 || dst >= size_ || dst == rank_) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "shm send: destination rank " + std::to_string(dst) + " is invalid for rank " +
                         std::to_string(rank_) + " of " + std::to_string(size_));
  }
}

// The common small send: nothing queued before it, one entry, room in the ring (and a slot when
// it does not fit inline). Published before any allocation (the peer may be spinning on it), it
// needs no op at all. False, changing nothing, for any other send. `reference`: memmap_reference's.
bool ShmChannel::send_whole(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check, bool control,
                            const std::string& reference) {
  const auto peer = static_cast<size_t>(dst);
  if (closed_ || poisoned_ || peer_error_[peer] || !send_queues_[peer].empty() || !tensor.is_contiguous()) return false;
  const uint64_t bytes =
      reference.empty() ? static_cast<uint64_t>(tensor.numel()) * tensor.element_size() : reference.size();
  if (bytes > options_.slot_bytes || !tx_[peer].has_room()) return false;
  const uint32_t flags = shm::kEntryFirst | shm::kEntryLast | (control ? uint32_t{shm::kEntryControl} : 0u) |
                         (reference.empty() ? 0u : uint32_t{shm::kEntryReference}) | check_flag(check);
  const auto* data = reference.empty() ? static_cast<const uint8_t*>(tensor.data_ptr())
                                       : reinterpret_cast<const uint8_t*>(reference.data());
  return write_entry(dst, flags, tag, tensor, data, 0, bytes, check);
}

// A send that send_whole could not publish: an op, queued behind the sends before it and moved
// as far as room allows (`published` is set when an entry went out), or failed at once when the
// group or `dst` is unusable. A strided tensor is snapshotted now.
std::shared_ptr<ShmOp> ShmChannel::queue_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                              bool control, std::string reference, bool& published) {
  const auto peer = static_cast<size_t>(dst);
  auto op = make_op(ShmOp::Kind::kSend, dst, tag, control, tensor);
  op->reference = std::move(reference);
  op->check = check;
  bind_loan(*op);
  if (closed_ || poisoned_ || peer_error_[peer]) {
    finish(op, closed_ ? closed_ : poisoned_ ? poisoned_ : peer_error_[peer]);
    return op;
  }
  send_queues_[peer].push_back(op);
  published |= progress_sends(dst, /*wake=*/false);
  return op;
}

std::shared_ptr<ShmOp> ShmChannel::post_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                             bool control) {
  check_destination(dst);
  std::string reference = memmap_reference(tensor, options_.slot_bytes);
  // A loan goes by reference (queue_send), never by value through send_whole.
  bool published = !is_lent(tensor) && send_whole(tensor, dst, tag, check, control, reference);
  std::shared_ptr<ShmOp> op;
  // Published: done, unless the mapping was lost meanwhile (queue_send then fails the op).
  if (!published || check_poisoned())
    op = queue_send(tensor, dst, tag, check, control, std::move(reference), published);
  if (published) wake_peer(dst);
  return op;
}

OpList ShmChannel::post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                              std::span<const MessageCheck> checks, bool control) {
  check_destination(dst);
  TORCH_INTERNAL_ASSERT(tags.size() == tensors.size() && checks.size() == tensors.size());
  // Sized only once an op is needed: a batch that completes at once returns no ops.
  OpList ops;
  bool published = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (const size_t n = send_batched(tensors.subspan(i), dst, tags.subspan(i), checks.subspan(i), control); n != 0) {
      published = true;
      if (check_poisoned()) {  // the mapping was lost meanwhile: queue_send fails their ops
        ops.resize(tensors.size());
        for (size_t j = i; j < i + n; ++j)
          ops[j] = queue_send(tensors[j], dst, tags[j], checks[j], control, {}, published);
      }
      i += n - 1;
      continue;
    }
    std::string reference = memmap_reference(tensors[i], options_.slot_bytes);
    if (!is_lent(tensors[i]) && send_whole(tensors[i], dst, tags[i], checks[i], control, reference)) {
      published = true;
      if (!check_poisoned()) continue;  // else: queue_send fails its op with the poison error
    }
    ops.resize(tensors.size());
    ops[i] = queue_send(tensors[i], dst, tags[i], checks[i], control, std::move(reference), published);
  }
  if (published) wake_peer(dst);  // one wake-up for the whole batch
  return ops;
}

// Bytes land in place: a tensor whose elements share memory (an expanded view) cannot take them,
// nor can a read-only mapping. (A contiguous tensor's elements never overlap: the common case
// skips that check.)
static void check_receiving(const at::Tensor& tensor) {
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

static void check_source(int src, int rank, int size) {
  if (src < -1 || src >= size || src == rank) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "shm recv: source rank " + std::to_string(src) + " is invalid for rank " + std::to_string(rank) +
                         " of " + std::to_string(size));
  }
}

OpList ShmChannel::make_recvs(std::span<const at::Tensor> tensors, int src, int rank, int size,
                              std::span<const int64_t> tags, std::span<const MessageCheck> checks, bool control) {
  TORCH_INTERNAL_ASSERT(tags.size() == tensors.size() && checks.size() == tensors.size());
  OpList ops;
  if (tensors.size() == 1) {
    ops.push_back(make_recv(tensors[0], src, rank, size, tags[0], checks[0], control));  // no array
    return ops;
  }
  check_source(src, rank, size);
  for (const at::Tensor& tensor : tensors) check_receiving(tensor);  // all checked before anything is posted
  ops = make_ops(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    init_op(ops[i].get(), ShmOp::Kind::kRecv, src, tags[i], control, tensors[i]);
    ops[i]->check = checks[i];
  }
  return ops;
}

std::shared_ptr<ShmOp> ShmChannel::make_recv(const at::Tensor& tensor, int src, int rank, int size, int64_t tag,
                                             const MessageCheck& check, bool control) {
  check_source(src, rank, size);
  check_receiving(tensor);
  auto op = make_op(ShmOp::Kind::kRecv, src, tag, control, tensor);
  op->check = check;
  return op;
}

std::shared_ptr<ShmOp> ShmChannel::make_recv_view(int src, int rank, int size, int64_t tag, const MessageCheck& check) {
  check_source(src, rank, size);
  auto op = new_op();
  op->kind = ShmOp::Kind::kRecv;
  op->peer = src;
  op->tag = tag;
  op->check = check;
  op->view = true;
  return op;
}

void ShmChannel::bind_loan(ShmOp& op) const {
  if (op.staging.defined() || !loans_->in_heap(op.data)) return;
  if (auto place = loans_->find(op.data, op.bytes)) {
    op.loan = static_cast<int64_t>(place->allocation);
    op.loan_offset = place->offset;
  }
}

void ShmChannel::post_recvs(std::span<const std::shared_ptr<ShmOp>> ops, int src) {
  bool posted = false;
  for (const auto& op : ops) posted |= post_recv(op, src);
  if (!posted) return;
  // A message already in a ring lands in place. A receive from one source needs only that
  // source's ring read (the other rings and queued sends move in the waits).
  if (src >= 0 && !check_poisoned()) {
    progress_receives(src, /*drain_all=*/false);
  } else {
    progress(/*drain_all=*/false);
  }
}

// Matches `op` with a message drained earlier, or posts it. True if it was posted (the rings may
// hold its message).
bool ShmChannel::post_recv(const std::shared_ptr<ShmOp>& op, int src) {
  const int64_t tag = op->tag;
  const bool control = op->control;
  if (closed_ || poisoned_) {
    finish(op, closed_ ? closed_ : poisoned_);
    return false;
  }
  // Messages drained earlier (unexpected) are older than what is still in the rings: match them
  // first; otherwise post, then drain the rings, so a message already there lands in place.
  if (const std::shared_ptr<Incoming> keep = matcher_.take_early(src, tag, control)) {
    shm::LoanReference loan{};
    const uint8_t* lent = nullptr;
    if (keep->loan) {  // the bytes stayed in the sender's heap, under its ticket
      std::memcpy(&loan, keep->heap.get(), sizeof loan);
      lent = shm::lent_bytes(loan_regions_[static_cast<size_t>(keep->src)], loan, keep->total,
                             static_cast<uint32_t>(rank_));
    }
    if (!try_match(*keep, op)) {
      // The receive failed with a clear error and the message is dropped (as MPI drops a
      // truncated one), so that what follows on this tag stays in step.
      if (!keep->complete) keep->discard = true;
      if (lent != nullptr) give_back_loan(keep->src, loan.ticket);
      release_unexpected(*keep);
      return false;
    }
    if (keep->loan) {
      release_unexpected(*keep);
      if (lent == nullptr) {
        finish(op, make_error<TransportError>(op->what() + ": the sender's loan (ticket " +
                                              std::to_string(loan.ticket) + ") is no longer lent to this rank"));
      } else {
        land_loan(keep->src, *keep, loan.ticket, lent, op);
      }
    } else if (keep->reference) {  // always complete: one entry, checked when it arrived
      shm::ReferenceFields ref;
      const std::string problem = shm::check_reference(keep->heap.get(), keep->heap_bytes, keep->total, ref);
      auto error =
          problem.empty() ? resolve_reference(*op, ref) : make_error<TransportError>(op->what() + ": " + problem);
      release_unexpected(*keep);
      finish(op, error);
    } else if (keep->complete) {
      if (keep->total != 0) std::memcpy(op->data, keep->heap.get(), keep->total);
      release_unexpected(*keep);
      finish(op, nullptr);
    } else {
      if (keep->received != 0) std::memcpy(op->data, keep->heap.get(), keep->received);
      release_unexpected(*keep);
      keep->op = op;
    }
    return false;
  }
  if (src >= 0 && peer_error_[static_cast<size_t>(src)]) {
    finish(op, peer_error_[static_cast<size_t>(src)]);
    return false;
  }
  matcher_.post(op);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Progress

bool ShmChannel::progress(bool drain_all) {
  if (closed_ || check_poisoned()) return false;
  bool moved = false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    moved |= progress_receives(p, drain_all);
    moved |= progress_sends(p);
  }
  if (!lent_.empty()) moved |= progress_loans();
  return moved;
}

// Sends of loans complete when their receiver gives the ticket back (after its copy, or when its
// last view is dropped), or when the owner takes it back from a rank that is gone.
bool ShmChannel::progress_loans() {
  bool moved = false;
  std::erase_if(lent_, [&](const Lent& l) {
    if (!loans_->ticket_free(l.ticket)) return false;
    loans_->ticket_returned(l.ticket);
    finish(l.op, nullptr);  // (a no-op for one that failed already: its peer was lost)
    moved = true;
    return true;
  });
  return moved;
}

bool ShmChannel::incoming_hint() const noexcept {
  if (segment_.poisoned()) return true;
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && rx_[static_cast<size_t>(p)].ready_hint()) return true;
  }
  return false;
}

bool ShmChannel::busy() const noexcept {
  for (int p = 0; p < size_; ++p) {
    const auto i = static_cast<size_t>(p);
    if (!send_queues_[i].empty() || current_[i] || held_bytes_[i] != 0) return true;
  }
  return !lent_.empty();
}

bool ShmChannel::progress_sends(int dst, bool wake) {
  auto& queue = send_queues_[static_cast<size_t>(dst)];
  if (queue.empty()) return false;
  const uint64_t slot = options_.slot_bytes;
  bool moved = false;
  while (!queue.empty()) {
    ShmOp& op = *queue.front();
    if (!tx_[static_cast<size_t>(dst)].has_room()) break;
    uint32_t flags = op.control ? uint32_t{shm::kEntryControl} : 0u;
    uint64_t chunk;
    bool written;
    if (op.loan >= 0) {  // a reference to the bytes in this rank's loan heap, under a ticket
      const auto ticket = loans_->take_ticket(static_cast<uint32_t>(dst), static_cast<uint64_t>(op.loan));
      if (!ticket) break;  // every ticket is out: a receiver gives one back
      const shm::LoanReference ref{op.loan_offset, *ticket, 0};
      flags |= shm::kEntryFirst | shm::kEntryLast | shm::kEntryLoan | check_flag(op.check);
      write_entry(dst, flags, op.tag, op.contiguous(), reinterpret_cast<const uint8_t*>(&ref), 0, sizeof ref, op.check);
      op.started = true;
      moved = true;
      lent_.push_back({queue.front(), *ticket});
      queue.pop_front();
      continue;
    }
    if (!op.reference.empty()) {  // the whole message in one entry, whatever the tensor's size
      chunk = op.bytes;
      flags |= shm::kEntryFirst | shm::kEntryLast | shm::kEntryReference | check_flag(op.check);
      written = write_entry(dst, flags, op.tag, op.contiguous(), reinterpret_cast<const uint8_t*>(op.reference.data()),
                            0, op.reference.size(), op.check);
    } else {
      chunk = std::min(slot, op.bytes - op.posted);
      if (!op.started) flags |= shm::kEntryFirst | check_flag(op.check);
      if (op.posted + chunk == op.bytes) flags |= shm::kEntryLast;
      written = write_entry(dst, flags, op.tag, op.contiguous(), op.data + op.posted, op.posted, chunk, op.check);
    }
    if (!written) break;  // every arena slot of this rank is in flight: a receiver frees one
    op.posted += chunk;
    op.started = true;
    moved = true;
    if (flags & shm::kEntryLast) {
      auto done = queue.front();
      queue.pop_front();
      finish(done, nullptr);
    }
  }
  if (moved && wake) wake_peer(dst);
  return moved;
}

// Fills the next entry of the ring towards `dst` (which has room) and publishes it (seq stored
// last): the chunk inline when it fits; a whole message up to the span limit in the entries after
// it when the ring has room for them (its receiver then reads no slot); else in an arena slot.
// False, changing nothing, when the chunk needs a slot and none is free.
bool ShmChannel::write_entry(int dst, uint32_t flags, int64_t tag, const at::Tensor& whole, const uint8_t* chunk_data,
                             uint64_t offset, uint64_t chunk, MessageCheck check) {
  const auto to = static_cast<uint32_t>(dst);
  shm::RingProducer& ring = tx_[to];
  uint8_t* payload = nullptr;
  uint32_t slot = 0;
  uint64_t span = 0;
  constexpr uint32_t kWhole = shm::kEntryFirst | shm::kEntryLast;
  if (chunk <= shm::kInlineBytes) {
    flags |= shm::kEntryInline;
    payload = ring.inline_bytes();
  } else if ((flags & (kWhole | shm::kEntryReference)) == kWhole && chunk <= span_limit_ &&
             ring.has_room(1 + shm::span_entries(chunk))) {
    flags |= shm::kEntrySpan;
    span = shm::span_entries(chunk);
  } else {
    const auto taken = slots_.take(to);
    if (!taken) return false;
    slot = *taken;
    payload = slots_.data(slot);
  }
  EntryHeader& e = ring.entry();
  if (flags & shm::kEntryFirst) {
    e.tag = tag;
    e.total_bytes = static_cast<uint64_t>(whole.numel()) * whole.element_size();
    e.dtype = static_cast<uint8_t>(whole.scalar_type());
    const auto sizes = whole.sizes();
    e.ndim = sizes.size() <= shm::kMaxDims ? static_cast<uint8_t>(sizes.size()) : shm::kShapeNotSent;
    if (e.ndim != shm::kShapeNotSent && e.ndim >= 2) std::copy(sizes.begin(), sizes.end(), ring.shape().dims);
  }
  e.check = (flags & shm::kEntryFirst) ? check.value : 0;
  e.leaves = (flags & shm::kEntryFirst) && check.kind == MessageCheck::Kind::kKey ? check.leaves : 0;
  e.flags = flags;
  e.chunk_bytes = static_cast<uint32_t>(chunk);  // slot_bytes <= 2^30
  // The tail's fields only where the entry has them: a whole small message writes line 0 alone.
  if (!(flags & shm::kEntryFirst)) ring.tail().chunk_offset = offset;
  if (!shm::chunk_in_ring(flags)) ring.tail().slot = slot;
  if (span != 0) {
    ring.write_span(chunk_data, chunk);
  } else if (chunk != 0) {
    std::memcpy(payload, chunk_data, chunk);
  }
  ring.publish(span);
  return true;
}

void ShmChannel::finish(const std::shared_ptr<ShmOp>& op, std::exception_ptr error) {
  if (op->done.load(std::memory_order_relaxed)) return;
  // Bytes that went through a mapping the file no longer backs may be zeros: never a success.
  if (!error && segment_.poisoned()) {
    error = poisoned_ ? poisoned_
                      : make_error<TransportError>(op->what() + ": the segment file of '" + name() +
                                                   "' was truncated by another process while mapped");
  }
  if (!error && op->kind == ShmOp::Kind::kRecv && op->staging.defined()) {
    try {
      op->user.copy_(op->staging);  // a non-contiguous destination gets the staged bytes
    } catch (const std::exception& e) {
      error = make_error<TransportError>(op->what() + ": copying into the strided tensor: " + e.what());
    }
  }
  op->error = std::move(error);
  op->done.store(true, std::memory_order_release);  // pairs with acquire loads of done in waiters
}

// Takes `op` back (its wait gave up). A send whose first entry is already in the ring cannot be
// taken back (its receiver expects the rest) and goes on.
void ShmChannel::withdraw(const std::shared_ptr<ShmOp>& op, const std::exception_ptr& error) {
  if (!op || op->done.load(std::memory_order_relaxed)) return;
  if (op->kind == ShmOp::Kind::kRecv) {
    matcher_.withdraw(op);
    for (auto& msg : current_) {
      if (msg && msg->op == op) {
        msg->op.reset();
        msg->discard = true;  // the rest of it is drained and dropped
      }
    }
  } else {
    if (op->started) return;
    std::erase(send_queues_[static_cast<size_t>(op->peer)], op);
  }
  finish(op, error);
}

// ---------------------------------------------------------------------------------------------
// Failing

void ShmChannel::fail_peer(int peer, std::exception_ptr error) {
  auto& slot = peer_error_[static_cast<size_t>(peer)];
  if (!slot) slot = error;
  auto& queue = send_queues_[static_cast<size_t>(peer)];
  for (auto& op : queue) finish(op, slot);
  queue.clear();
  // Its loans' tickets stay counted until they are free (reclaim_loans takes them back).
  for (auto& l : lent_) {
    if (l.op->peer == peer) finish(l.op, slot);
  }
  auto& cur = current_[static_cast<size_t>(peer)];
  if (cur) {
    if (cur->op) finish(cur->op, slot);
    if (matcher_.remove_early(cur)) release_unexpected(*cur);  // nobody will ever finish it
    cur.reset();
  }
  held_bytes_[static_cast<size_t>(peer)] = 0;
  bool someone_alive = false;
  for (int p = 0; p < size_; ++p) someone_alive |= (p != rank_ && !peer_error_[static_cast<size_t>(p)]);
  matcher_.drop_posted_if([&](const ShmOp& op) { return op.peer == peer || (op.peer < 0 && !someone_alive); },
                          [&](const std::shared_ptr<ShmOp>& op) { finish(op, slot); });
  // The rings with `peer` are not reset: they belong to this incarnation only, and `peer` (if it
  // still runs) may still be writing to them. Nothing more is read from or written to them.
}

uint32_t ShmChannel::reclaim_slots(int peer) { return slots_.reclaim(static_cast<uint32_t>(peer)); }

uint32_t ShmChannel::reclaim_loans(int peer) {
  const uint32_t n = loans_->reclaim(static_cast<uint32_t>(peer));
  progress_loans();  // their allocations are free again once their tensors are gone
  return n;
}

void ShmChannel::give_back_loan(int src, uint32_t ticket) {
  shm::give_back(loan_regions_[static_cast<size_t>(src)], ticket, segment_.rank_slot(static_cast<uint32_t>(src)));
}

// Once the segment's mapping is lost (a peer truncated the file), every transfer fails.
bool ShmChannel::poison() {
  poisoned_ = make_error<TransportError>("the segment file of '" + name() +
                                         "' was truncated by another process while in use: this group's shared "
                                         "memory is gone and all of its transfers fail; construct the group again");
  log().error("segment '{}' was truncated under its mapping: the group's transfers fail", name());
  fail_all(poisoned_);
  return true;
}

// Fails every op pending in the channel with `error` (the group was destroyed, or its segment cut).
void ShmChannel::fail_pending(const std::exception_ptr& error) {
  for (auto& q : send_queues_) {
    for (auto& op : q) finish(op, error);
    q.clear();
  }
  matcher_.clear([&](const std::shared_ptr<ShmOp>& op) { finish(op, error); });
  for (auto& l : lent_) finish(l.op, error);
  for (auto& msg : current_) {
    if (msg && msg->op) finish(msg->op, error);
    msg.reset();
  }
  unexpected_bytes_ = 0;
}

// fail_pending, and every peer is lost with `error`: nothing more moves in this group.
void ShmChannel::fail_all(const std::exception_ptr& error) {
  fail_pending(error);
  for (auto& p : peer_error_) {
    if (!p) p = error;
  }
}

bool ShmChannel::close(const std::exception_ptr& error) {
  if (closed_) return false;
  closed_ = error;
  fail_pending(closed_);
  return true;
}

std::exception_ptr ShmChannel::unusable() {
  if (closed_) return closed_;
  return check_poisoned() ? poisoned_ : nullptr;
}

std::string ShmChannel::held_messages() const {
  std::string held;
  if (!lent_.empty()) held += "; " + loans_->holders();
  for (size_t p = 0; p < held_bytes_.size(); ++p) {
    if (held_bytes_[p] != 0) {
      held += "; a message of " + std::to_string(held_bytes_[p]) + " bytes from rank " + std::to_string(p) +
              " waits in its ring for its recv (early messages already hold " + std::to_string(unexpected_bytes_) +
              " bytes of ShmOptions::max_unexpected_bytes = " + std::to_string(options_.max_unexpected_bytes) + ")";
    }
  }
  return held;
}

}  // namespace tdshm::detail
