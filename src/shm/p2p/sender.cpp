// The sending side of one rank's channel (sender.h; channel.h has the protocol): posting,
// queueing for room, writing entries.

#include "shm/p2p/sender.h"

#include "shm/p2p/message.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace tdshm::detail {

using shm::EntryHeader;

ShmSender::ShmSender(ChannelCore& core, ByReference& by_reference)
    : core_(core), by_reference_(by_reference), span_limit_(shm::span_limit(core.options().ring_entries)) {
  const auto n = static_cast<size_t>(core.size());
  const auto me = static_cast<uint32_t>(core.rank());
  shm::Segment& segment = core.segment();
  const uint64_t incarnation = segment.incarnation();
  send_queues_.resize(n);
  tx_.resize(n);
  for (uint32_t p = 0; p < static_cast<uint32_t>(n); ++p) {
    if (p == me) continue;
    tx_[p] = shm::RingProducer(
        shm::RingView(segment.ring_memory(me, p), core.options().ring_entries, shm::ring_key(incarnation, me, p)));
  }
  slots_ = shm::SlotAllocator(core.region(core.rank()));
}

void ShmSender::check_destination(int dst) const {
  if (dst < 0 || dst >= core_.size() || dst == core_.rank()) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "shm send: destination rank " + std::to_string(dst) + " is invalid for rank " +
                         std::to_string(core_.rank()) + " of " + std::to_string(core_.size()));
  }
}

// The common small send: nothing queued before it, one entry, room in the ring (and a slot when
// it does not fit inline). Published before any allocation (the peer may be spinning on it), it
// needs no op at all. False, changing nothing, for any other send. `reference`: memmap_reference's.
bool ShmSender::send_whole(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check, bool control,
                           const std::string& reference) {
  const auto peer = static_cast<size_t>(dst);
  if (core_.refused(dst) || !send_queues_[peer].empty() || !tensor.is_contiguous()) return false;
  const uint64_t bytes =
      reference.empty() ? static_cast<uint64_t>(tensor.numel()) * tensor.element_size() : reference.size();
  if (bytes > core_.options().slot_bytes || !tx_[peer].has_room()) return false;
  const uint32_t flags = shm::kEntryFirst | shm::kEntryLast | (control ? uint32_t{shm::kEntryControl} : 0u) |
                         (reference.empty() ? 0u : uint32_t{shm::kEntryReference}) | check_flag(check);
  const auto* data = reference.empty() ? static_cast<const uint8_t*>(tensor.data_ptr())
                                       : reinterpret_cast<const uint8_t*>(reference.data());
  return write_entry(dst, flags, tag, tensor, data, 0, bytes, check);
}

// A send that send_whole could not publish: an op, queued behind the sends before it and moved
// as far as room allows (`published` is set when an entry went out), or failed at once when the
// group or `dst` is unusable. A strided tensor is snapshotted now.
std::shared_ptr<SendOp> ShmSender::queue_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                              bool control, std::string reference, bool& published) {
  auto op = make_send_op(dst, tag, control, tensor);
  op->reference = std::move(reference);
  op->check = check;
  by_reference_.bind_loan(*op);
  if (core_.refused(dst)) {
    core_.finish(*op, core_.refusal(dst));
    return op;
  }
  send_queues_[static_cast<size_t>(dst)].push_back(op);
  published |= progress(dst, /*wake=*/false);
  return op;
}

std::shared_ptr<ShmOp> ShmSender::post_send(const at::Tensor& tensor, int dst, int64_t tag, const MessageCheck& check,
                                            bool control) {
  check_destination(dst);
  std::string reference = ByReference::memmap_reference(tensor, core_.options().slot_bytes);
  // A loan goes by reference (queue_send), never by value through send_whole.
  bool published = !by_reference_.is_lent(tensor) && send_whole(tensor, dst, tag, check, control, reference);
  std::shared_ptr<ShmOp> op;
  // Published: done, unless the mapping was lost meanwhile (queue_send then fails the op).
  if (!published || core_.check_poisoned())
    op = queue_send(tensor, dst, tag, check, control, std::move(reference), published);
  if (published) core_.wake_peer(dst);
  return op;
}

OpList ShmSender::post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                             std::span<const MessageCheck> checks, bool control) {
  check_destination(dst);
  TORCH_INTERNAL_ASSERT(tags.size() == tensors.size() && checks.size() == tensors.size());
  // Sized only once an op is needed: a batch that completes at once returns no ops.
  OpList ops;
  bool published = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (const size_t n = send_batched(tensors.subspan(i), dst, tags.subspan(i), checks.subspan(i), control); n != 0) {
      published = true;
      if (core_.check_poisoned()) {  // the mapping was lost meanwhile: queue_send fails their ops
        ops.resize(tensors.size());
        for (size_t j = i; j < i + n; ++j)
          ops[j] = queue_send(tensors[j], dst, tags[j], checks[j], control, {}, published);
      }
      i += n - 1;
      continue;
    }
    std::string reference = ByReference::memmap_reference(tensors[i], core_.options().slot_bytes);
    if (!by_reference_.is_lent(tensors[i]) && send_whole(tensors[i], dst, tags[i], checks[i], control, reference)) {
      published = true;
      if (!core_.check_poisoned()) continue;  // else: queue_send fails its op with the poison error
    }
    ops.resize(tensors.size());
    ops[i] = queue_send(tensors[i], dst, tags[i], checks[i], control, std::move(reference), published);
  }
  if (published) core_.wake_peer(dst);  // one wake-up for the whole batch
  return ops;
}

bool ShmSender::progress(int dst, bool wake) {
  auto& queue = send_queues_[static_cast<size_t>(dst)];
  if (queue.empty()) return false;
  const uint64_t slot = core_.options().slot_bytes;
  bool moved = false;
  while (!queue.empty()) {
    SendOp& op = *queue.front();
    if (!tx_[static_cast<size_t>(dst)].has_room()) break;
    uint32_t flags = op.control ? uint32_t{shm::kEntryControl} : 0u;
    uint64_t chunk;
    bool written;
    if (op.loan >= 0) {  // a reference to the bytes in this rank's loan heap, under a ticket
      const auto ref = by_reference_.lend(dst, queue.front());
      if (!ref) break;  // every ticket is out: a receiver gives one back
      flags |= shm::kEntryFirst | shm::kEntryLast | shm::kEntryLoan | check_flag(op.check);
      write_entry(dst, flags, op.tag, op.contiguous(), reinterpret_cast<const uint8_t*>(&*ref), 0, sizeof *ref,
                  op.check);
      op.started = true;
      moved = true;
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
      core_.finish(*done, nullptr);
    }
  }
  if (moved && wake) core_.wake_peer(dst);
  return moved;
}

// Fills the next entry of the ring towards `dst` (which has room) and publishes it (seq stored
// last): the chunk inline when it fits; a whole message up to the span limit in the entries after
// it when the ring has room for them (its receiver then reads no slot); else in an arena slot.
// False, changing nothing, when the chunk needs a slot and none is free.
bool ShmSender::write_entry(int dst, uint32_t flags, int64_t tag, const at::Tensor& whole, const uint8_t* chunk_data,
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

bool ShmSender::withdraw(const std::shared_ptr<ShmOp>& op) {
  if (op->as_send().started) return false;
  std::erase(send_queues_[static_cast<size_t>(op->peer)], op);
  return true;
}

void ShmSender::fail_peer(int peer, const std::exception_ptr& error) {
  auto& queue = send_queues_[static_cast<size_t>(peer)];
  for (auto& op : queue) core_.finish(*op, error);
  queue.clear();
}

void ShmSender::fail_all(const std::exception_ptr& error) {
  for (auto& q : send_queues_) {
    for (auto& op : q) core_.finish(*op, error);
    q.clear();
  }
}

}  // namespace tdshm::detail
