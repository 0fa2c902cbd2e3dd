// The point-to-point channel's batches (layout 10, segment_layout.h's BatchRecord): a run of
// small whole messages posted together to one peer goes as one ring entry (send_batched), and
// the receiver lands its records one by one as the messages they stand for (handle_batch).

#include "shm/p2p/receiver.h"
#include "shm/p2p/sender.h"

#include <tdshm/memmap.h>

#include <ATen/core/Tensor.h>

#include <cstring>

namespace tdshm::detail {

using shm::EntryHeader;

// A run of small whole messages from tensors[0] on, posted together to `dst`, goes as one batch
// entry (segment_layout.h's BatchRecord) when nothing is queued before it and the ring has room
// for it: two or more contiguous tensors by value (no loan, no mapped file), their records within
// span_limit_. Published before any allocation, as send_whole's. Returns how many messages it
// published (0: none, with nothing changed).
size_t ShmSender::send_batched(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                               std::span<const MessageCheck> checks, bool control) {
  const auto peer = static_cast<size_t>(dst);
  if (tensors.size() < 2 || core_.refused(dst) || !send_queues_[peer].empty()) return 0;
  auto ndim_of = [](const at::Tensor& t) {
    return t.dim() <= static_cast<int64_t>(shm::kMaxDims) ? static_cast<uint8_t>(t.dim()) : shm::kShapeNotSent;
  };
  size_t n = 0;
  uint64_t total = 0;
  for (; n < tensors.size(); ++n) {
    const at::Tensor& t = tensors[n];
    if (!t.is_contiguous() || by_reference_.is_lent(t) || MemoryMappedTensor::is_mapped(t)) break;
    const uint64_t record = shm::batch_record_bytes(ndim_of(t), static_cast<uint64_t>(t.numel()) * t.element_size());
    if (record > span_limit_ - total) break;  // (total <= span_limit_)
    total += record;
  }
  if (n < 2 || !tx_[peer].has_room(1 + shm::span_entries(total))) return 0;
  uint8_t* at = batch_stage_.data();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    shm::BatchRecord r{};
    r.tag = tags[i];
    r.bytes = static_cast<uint32_t>(t.numel() * t.element_size());  // within span_limit_
    r.flags = (control ? uint32_t{shm::kEntryControl} : 0u) | check_flag(checks[i]);
    r.dtype = static_cast<uint8_t>(t.scalar_type());
    r.ndim = ndim_of(t);
    r.leaves = checks[i].kind == MessageCheck::Kind::kKey ? checks[i].leaves : 0;
    r.check = checks[i].value;
    std::memcpy(at, &r, sizeof r);
    at += sizeof r;
    if (r.ndim >= 2 && r.ndim != shm::kShapeNotSent) {
      const auto sizes = t.sizes();
      std::memcpy(at, sizes.data(), sizes.size() * sizeof(int64_t));
      at += sizes.size() * sizeof(int64_t);
    }
    if (r.bytes != 0) std::memcpy(at, t.data_ptr(), r.bytes);
    const uint32_t padded = (r.bytes + 7) / 8 * 8;
    std::memset(at + r.bytes, 0, padded - r.bytes);
    at += padded;
  }
  shm::RingProducer& ring = tx_[peer];
  EntryHeader& e = ring.entry();
  e.tag = 0;
  e.total_bytes = total;
  e.chunk_bytes = static_cast<uint32_t>(total);
  e.flags = shm::kEntryBatch;
  e.dtype = 0;
  e.ndim = 0;
  e.leaves = static_cast<uint16_t>(n);
  e.check = 0;
  ring.write_span(batch_stage_.data(), total);
  ring.publish(shm::span_entries(total));
  return n;
}

// The records of a batch are read one at a time (read once, checked, then landed as the whole
// message each stands for); one that must stay in the ring (start_message) leaves the cursor on
// it, and the entry is taken once its last record is.
ShmReceiver::Taken ShmReceiver::handle_batch(int src, const shm::EntryFields& e, const uint8_t* records,
                                             ReceivePass& pass) {
  auto corrupt = [&](const std::string& what) { return core_.corrupted(src, what); };
  // (No message is in progress between two records: each is whole.)
  if (std::string problem = shm::check_entry(e, shm::RxProgress{current_[static_cast<size_t>(src)] != nullptr},
                                             core_.arena(), kMaxMessageBytes);
      !problem.empty()) {
    throw corrupt(problem);
  }
  BatchCursor& cursor = batch_cursor_[static_cast<size_t>(src)];
  // Every line of the records asked for at once: read record by record, each line would be
  // fetched only once the record before it has landed.
  for (uint64_t at = cursor.offset; at < e.chunk_bytes; at += shm::kCacheLine) __builtin_prefetch(records + at);
  while (cursor.offset < e.chunk_bytes) {
    shm::EntryFields record;
    shm::EntryShape shape;
    uint64_t next = cursor.offset, payload_at = 0;
    if (std::string problem = shm::read_batch_record(records, e.chunk_bytes, next, record, shape, payload_at);
        !problem.empty()) {
      throw corrupt("batch: " + problem);
    }
    if (cursor.records == e.leaves) throw corrupt("a batch of more records than its " + std::to_string(e.leaves));
    if (land_entry(src, record, records + payload_at, shape, pass) == Taken::kHeld) return Taken::kHeld;
    cursor.offset = next;
    ++cursor.records;
  }
  if (cursor.records != e.leaves) {
    throw corrupt("a batch of " + std::to_string(cursor.records) + " records that says " + std::to_string(e.leaves));
  }
  cursor = BatchCursor{};
  return Taken::kYes;
}

}  // namespace tdshm::detail
