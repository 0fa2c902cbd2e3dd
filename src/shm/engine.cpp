// The shared-memory transport's engine (see engine.h for the protocol).

#include "shm/engine_internal.h"

#include "common/format.h"
#include "common/log.h"

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
  std::string s = kind == Kind::kSend ? "send to rank " + std::to_string(peer)
                                      : (peer < 0 ? std::string("recv from any rank") : "recv from rank " + std::to_string(peer));
  return s + (control ? ", collective " : ", tag ") + std::to_string(tag) + " (" + std::to_string(bytes) + " bytes)";
}

ShmEngine::ShmEngine(const std::string& name, int rank, int size, const ShmOptions& options)
    : name_(name),
      rank_(rank),
      size_(size),
      options_(options),
      // Up to 64 MiB of early-message buffers stay resident between messages.
      unexpected_pool_(std::min<uint64_t>(options.max_unexpected_bytes, uint64_t{64} << 20)),
      spin_budget_(options.spin) {
  if (size < 1) throw SegmentError("world size " + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size) {
    throw SegmentError("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(size) + ")");
  }
  if (options.timeout.count() <= 0) throw SegmentError("ShmOptions::timeout must be positive");
  if (options.peer_check_interval.count() <= 0) throw SegmentError("ShmOptions::peer_check_interval must be positive");
  const auto deadline = Clock::now() + options.timeout;
  shm::SegmentParams params{name, static_cast<uint32_t>(size), options.slot_bytes, options.ring_entries,
                            options.slots_per_rank, options.window_bytes};
  segment_ = shm::Segment::attach(params, static_cast<uint32_t>(rank), deadline);

  const auto n = static_cast<size_t>(size);
  send_queues_.resize(n);
  const auto& g = segment_->geometry();
  const auto me = static_cast<uint32_t>(rank);
  tx_.resize(n);
  rx_.resize(n);
  regions_.resize(n);
  for (uint32_t p = 0; p < static_cast<uint32_t>(size); ++p) {
    regions_[p] = shm::RegionView(segment_->region_memory(p), options.slots_per_rank, g.slot_table_bytes, g.slot_stride);
    if (p == me) continue;
    tx_[p] = shm::RingProducer(shm::RingView(segment_->ring_memory(me, p), options.ring_entries));
    rx_[p] = shm::RingConsumer(shm::RingView(segment_->ring_memory(p, me), options.ring_entries));
  }
  slots_ = shm::SlotAllocator(regions_[me]);
  current_.resize(n);
  spare_.resize(n);
  peer_error_.resize(n);
  held_bytes_.assign(n, 0);
  consumed_since_wake_.assign(n, 0);
  wake_batch_ = std::max<uint32_t>(1, std::min(options.slots_per_rank, options.ring_entries) / 4);
  shm::StepPeers& peers = *this;  // (a private base: converted here, where it is accessible)
  steps_ = std::make_unique<shm::CollectiveSteps>(*segment_, spin_budget_, peers);
  rendezvous(deadline);
  next_peer_check_.store(ticks(Clock::now() + options_.peer_check_interval), std::memory_order_relaxed);
  log().debug("rank {} of {} ready on segment '{}'", rank, size, name);
}

// Every rank of this incarnation arrived (they may start in any order; a peer that completed its
// own rendezvous and left counts). A peer that died in it, or gave up on it, ends the wait at once.
void ShmEngine::rendezvous(Clock::time_point deadline) {
  auto next_check = Clock::now();
  auto give_up = [&](auto error) {
    segment_->leave(/*abandoned=*/true);
    throw error;
  };
  const std::string where = "segment '" + name_ + "', rank " + std::to_string(rank_) + ": ";
  // Before anything else on every turn, and once more after the last rank arrived (a peer claims
  // its slot at any moment): a peer of another namespace that already gave up must still be
  // reported as what it is, not as a peer that gave up.
  auto check_namespaces = [&] {
    if (const auto foreign = segment_->foreign_rank()) {
      // Its pid names another process here, or none: liveness (and so every recovery guarantee)
      // could not be kept, and both ranks would soon take each other for dead.
      give_up(SegmentError(where + "rank " + std::to_string(foreign->rank) + " (pid " +
                           std::to_string(foreign->process.pid) + " in its PID namespace) runs in another PID namespace (inode " +
                           std::to_string(foreign->process.pid_ns) + ", this rank's " +
                           std::to_string(shm::self_process().pid_ns) +
                           "), another container for instance: tdshm checks its peers through /proc, so every rank "
                           "of a group must run in one PID namespace (docker run --pid=host or "
                           "--pid=container:NAME; Kubernetes: shareProcessNamespace: true)"));
    }
  };
  auto check_alive = [&] {
    check_namespaces();
    for (uint32_t r = 0; r < static_cast<uint32_t>(size_); ++r) {
      // rank_alive() is false for a rank that has left too: the state is read again after it,
      // so a peer that completed its own rendezvous and left cleanly in between (its state is
      // "left" before its process ends) is not taken for a dead one.
      auto live = [&] { return segment_->rank_slot(r).state.load(std::memory_order_acquire) == shm::kRankLive; };
      if (live() && !segment_->rank_alive(r) && live()) {
        give_up(PeerLostError(where + segment_->describe_rank(r) + " died before the group formed"));
      }
    }
    if (auto dead = segment_->dead_joiner()) {
      give_up(PeerLostError(where + "rank " + std::to_string(dead->rank) + " (pid " + std::to_string(dead->pid) +
                            ") died while joining the group"));
    }
  };
  for (;;) {
    check_namespaces();
    if (const int r = segment_->first_abandoned(); r >= 0) {
      give_up(PeerLostError(where + segment_->describe_rank(static_cast<uint32_t>(r)) +
                            " gave up this group's rendezvous (it timed out or failed): construct the group again"));
    }
    if (segment_->all_arrived()) {
      check_alive();  // once more: a member may have died before this rank looked
      return;
    }
    const auto now = Clock::now();
    if (now >= next_check) {
      check_alive();
      next_check = now + options_.peer_check_interval;
    }
    if (now > deadline) {
      int live = 0;
      for (uint32_t r = 0; r < static_cast<uint32_t>(size_); ++r) live += segment_->rank_alive(r) ? 1 : 0;
      give_up(TimeoutError(where + "only " + std::to_string(live) + " of " + std::to_string(size_) +
                           " ranks attached within the timeout of " + std::to_string(options_.timeout.count()) + " ms"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

ShmEngine::~ShmEngine() {
  shutdown();
  // The helper thread may hold the last reference (background_loop): it ends right after this.
  if (background_.joinable()) {
    if (background_.get_id() == std::this_thread::get_id()) {
      background_.detach();
    } else {
      background_.join();
    }
  }
}

void ShmEngine::shutdown() noexcept {
  {
    std::lock_guard lk(mu_);
    if (shut_down_) return;
    shut_down_ = make_error<Error>("the process group was destroyed while this transfer was pending");
    fail_pending(shut_down_);
  }
  {
    std::lock_guard lk(watch_mu_);
    stopping_ = true;
  }
  watch_cv_.notify_all();
  // On the helper thread itself (a callback destroyed the group) it cannot be joined: it returns
  // to its loop, sees stopping_ and ends; the destructor detaches or joins it.
  if (background_.joinable() && background_.get_id() != std::this_thread::get_id()) background_.join();
  segment_->leave();
}

// ---------------------------------------------------------------------------------------------
// Posting

std::shared_ptr<ShmOp> ShmEngine::post_send(const at::Tensor& tensor, int dst, int64_t tag, bool control,
                                            MessageCheck check) {
  OpList ops = post_sends({&tensor, 1}, dst, {&tag, 1}, {&check, 1}, control);
  return ops.empty() ? nullptr : std::move(ops[0]);
}

OpList ShmEngine::post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                             std::span<const MessageCheck> checks, bool control) {
  if (dst < 0 || dst >= size_ || dst == rank_) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "shm send: destination rank " + std::to_string(dst) + " is invalid for rank " +
                         std::to_string(rank_) + " of " + std::to_string(size_));
  }
  TORCH_INTERNAL_ASSERT(tags.size() == tensors.size() && checks.size() == tensors.size());
  const size_t peer = static_cast<size_t>(dst);
  // Sized only once an op is needed: a batch that completes at once returns no ops.
  OpList ops;
  std::lock_guard lk(mu_);
  bool published = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& tensor = tensors[i];
    const std::string reference = memmap_reference(tensor, options_.slot_bytes);
    // The common small send: nothing queued before it, one entry, room in the ring (and a slot
    // when it does not fit inline). It is published before any allocation (the peer may be
    // spinning on it) and needs no op at all.
    if (!shut_down_ && !poisoned_ && !peer_error_[peer] && send_queues_[peer].empty() && tensor.is_contiguous()) {
      const uint64_t bytes =
          reference.empty() ? static_cast<uint64_t>(tensor.numel()) * tensor.element_size() : reference.size();
      if (bytes <= options_.slot_bytes && tx_[peer].has_room()) {
        const uint32_t flags = shm::kEntryFirst | shm::kEntryLast | (control ? uint32_t{shm::kEntryControl} : 0u) |
                               (reference.empty() ? 0u : uint32_t{shm::kEntryReference}) | check_flag(checks[i]);
        const auto* data = reference.empty() ? static_cast<const uint8_t*>(tensor.data_ptr())
                                             : reinterpret_cast<const uint8_t*>(reference.data());
        if (write_entry(dst, flags, tags[i], tensor, data, 0, bytes, checks[i])) {
          published = true;
          if (!check_poisoned()) continue;  // else: the op below fails with the poison error
        }
      }
    }
    // A send snapshots a strided tensor at post time.
    auto op = make_op(ShmOp::Kind::kSend, dst, tags[i], control, tensor,
                      tensor.is_contiguous() ? tensor : tensor.contiguous());
    op->reference = reference;
    op->check = checks[i];
    ops.resize(tensors.size());
    ops[i] = op;
    if (shut_down_ || poisoned_ || peer_error_[peer]) {
      finish(op, shut_down_ ? shut_down_ : poisoned_ ? poisoned_ : peer_error_[peer]);
      continue;
    }
    send_queues_[peer].push_back(op);
    published |= progress_sends(dst, /*wake=*/false);
  }
  if (published) notify(dst);  // one wake-up for the whole batch
  return ops;
}

std::shared_ptr<ShmOp> ShmEngine::post_recv(const at::Tensor& tensor, int src, int64_t tag, bool control,
                                            MessageCheck check) {
  return std::move(post_recvs({&tensor, 1}, src, {&tag, 1}, {&check, 1}, control)[0]);
}

OpList ShmEngine::post_recvs(std::span<const at::Tensor> tensors, int src, std::span<const int64_t> tags,
                             std::span<const MessageCheck> checks, bool control) {
  if (src < -1 || src >= size_ || src == rank_) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "shm recv: source rank " + std::to_string(src) + " is invalid for rank " + std::to_string(rank_) +
                         " of " + std::to_string(size_));
  }
  TORCH_INTERNAL_ASSERT(tags.size() == tensors.size() && checks.size() == tensors.size());
  // Every tensor is checked before anything is posted.
  for (const at::Tensor& tensor : tensors) {
    // Bytes land in place: a tensor whose elements share memory (an expanded view) cannot take
    // them, nor can a read-only mapping.
    if (tensor.numel() > 1 && at::has_internal_overlap(tensor) == at::MemOverlap::Yes) {
      throw TypeError("shm recv: the tensor's elements overlap in memory (an expanded or stride-0 view, strides " +
                      shape_str(tensor.strides()) + "), so it cannot receive bytes in place; receive into a tensor "
                      "of its own (for instance t.contiguous() or t.clone())");
    }
    if (auto info = MemoryMappedTensor::info(tensor); info && !info->writable) {
      throw TypeError("shm recv: the tensor is a read-only memory-mapped file ('" + info->filename +
                      "'), so it cannot receive bytes; open it writable or receive into another tensor");
    }
  }
  OpList ops;
  if (tensors.size() == 1) {
    ops.push_back(std::make_shared<ShmOp>());  // (an initializer list would copy the shared_ptr)
  } else {
    ops = make_ops(tensors.size());
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    // A strided destination receives into a contiguous staging tensor, copied over at the end.
    const at::Tensor& tensor = tensors[i];
    init_op(ops[i].get(), ShmOp::Kind::kRecv, src, tags[i], control, tensor,
            tensor.is_contiguous() ? tensor : at::empty(tensor.sizes(), tensor.options()));
    ops[i]->check = checks[i];
  }
  std::lock_guard lk(mu_);
  bool posted = false;
  for (const auto& op : ops) posted |= post_recv_locked(op, src);
  if (posted) progress_locked(/*drain_all=*/false);  // a message already in a ring lands in place
  return ops;
}

// Matches `op` with a message drained earlier, or posts it. True if it was posted (the rings may
// hold its message).
bool ShmEngine::post_recv_locked(const std::shared_ptr<ShmOp>& op, int src) {
  const int64_t tag = op->tag;
  const bool control = op->control;
  if (shut_down_ || poisoned_) {
    finish(op, shut_down_ ? shut_down_ : poisoned_);
    return false;
  }
  // Messages drained earlier (unexpected) are older than what is still in the rings: match them
  // first; otherwise post, then drain the rings, so a message already there lands in place.
  if (const std::shared_ptr<Incoming> keep = matcher_.take_early(src, tag, control)) {
    if (!try_match(keep, op)) {
      // The receive failed with a clear error and the message is dropped (as MPI drops a
      // truncated one), so that what follows on this tag stays in step.
      if (!keep->complete) keep->discard = true;
      release_unexpected(*keep);
      return false;
    }
    if (keep->reference) {  // always complete: one entry, checked when it arrived
      shm::ReferenceFields ref;
      const std::string problem = shm::check_reference(keep->heap.get(), keep->heap_bytes, keep->total, ref);
      auto error = problem.empty() ? resolve_reference(*op, ref) : make_error<TransportError>(op->what() + ": " + problem);
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

bool ShmEngine::progress_locked(bool drain_all) {
  if (shut_down_ || check_poisoned()) return false;
  bool moved = false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    moved |= progress_receives(p, drain_all);
    moved |= progress_sends(p);
  }
  return moved;
}

void ShmEngine::poll() {
  std::lock_guard lk(mu_);
  progress_locked();
}

bool ShmEngine::progress_sends(int dst, bool wake) {
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
    if (!op.reference.empty()) {  // the whole message in one entry, whatever the tensor's size
      chunk = op.bytes;
      flags |= shm::kEntryFirst | shm::kEntryLast | shm::kEntryReference | check_flag(op.check);
      written = write_entry(dst, flags, op.tag, op.buffer, reinterpret_cast<const uint8_t*>(op.reference.data()), 0,
                            op.reference.size(), op.check);
    } else {
      chunk = std::min(slot, op.bytes - op.posted);
      if (!op.started) flags |= shm::kEntryFirst | check_flag(op.check);
      if (op.posted + chunk == op.bytes) flags |= shm::kEntryLast;
      written = write_entry(dst, flags, op.tag, op.buffer, op.data + op.posted, op.posted, chunk, op.check);
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
  if (moved && wake) notify(dst);
  return moved;
}

// Fills the next entry of the ring towards `dst` (which has room) and publishes it (seq stored
// last): the chunk inline when it fits, else in an arena slot. False, changing nothing, when the
// chunk needs a slot and none is free.
bool ShmEngine::write_entry(int dst, uint32_t flags, int64_t tag, const at::Tensor& whole, const uint8_t* chunk_data,
                            uint64_t offset, uint64_t chunk, MessageCheck check) {
  const auto to = static_cast<uint32_t>(dst);
  shm::RingProducer& ring = tx_[to];
  uint8_t* payload;
  uint32_t slot = 0;
  if (chunk <= shm::kInlineBytes) {
    flags |= shm::kEntryInline;
    payload = ring.inline_bytes();
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
  e.chunk_offset = offset;
  e.chunk_bytes = static_cast<uint32_t>(chunk);  // slot_bytes <= 2^30
  e.slot = slot;
  if (chunk != 0) std::memcpy(payload, chunk_data, chunk);
  ring.publish();
  return true;
}

bool ShmEngine::progress_receives(int src, bool drain_all) {
  const auto s = static_cast<size_t>(src);
  if (peer_error_[s] && !current_[s]) {
    // A lost peer's ring was drained before it was declared lost, or it sent a malformed entry:
    // nothing more is read from it.
    return false;
  }
  const auto from = static_cast<uint32_t>(src), me = static_cast<uint32_t>(rank_);
  shm::RingConsumer& ring = rx_[s];
  const shm::RegionView& region = regions_[s];
  bool moved = false;
  ReceivePass pass{drain_all};
  for (;;) {
    shm::EntryFields fields;
    if (!ring.peek(fields)) break;  // read once: only this copy is used below
    // The chunk: in the entry, or in the sender's slot if that slot was handed to this rank (else
    // null, and handle_entry refuses the entry as corrupt).
    const bool in_slot = (fields.flags & shm::kEntryInline) == 0;
    const uint8_t* payload = in_slot ? shm::claimed_chunk(region, fields.slot, me) : ring.inline_bytes();
    Taken taken;
    try {
      taken = handle_entry(src, fields, payload, ring.shape(), pass);
      // The sender's region is written only by the sender, and only in free slots: a slot that is
      // no longer handed to this rank after the copy was rewritten while it was read.
      if (taken == Taken::kYes && in_slot && !shm::claimed_chunk(region, fields.slot, me)) {
        throw TransportError("corrupted entry from " + segment_->describe_rank(from) + ": arena slot " +
                             std::to_string(fields.slot) + " was taken back while this rank read it");
      }
    } catch (const Error&) {
      // A truncated segment reads as zeros once the bus guard has replaced its pages, which an
      // entry's checks see as corruption: the truncation is the error every op gets.
      if (check_poisoned()) return true;
      fail_peer(src, std::current_exception());
      return true;
    } catch (const std::bad_alloc&) {
      fail_peer(src, make_error<TransportError>("out of memory receiving a message of " +
                                                std::to_string(fields.total_bytes) + " bytes from " +
                                                segment_->describe_rank(from)));
      return true;
    }
    if (taken == Taken::kHeld) break;  // over the unexpected budget: it waits in the ring
    if (in_slot) shm::release_slot(region, fields.slot);
    ring.consume();
    moved = true;
    ++consumed_since_wake_[s];
  }
  // The sender may sleep waiting for room: wake it once a quarter of its room is back, or when
  // its ring is empty, rather than for every entry (a producer woken per freed slot copies one
  // chunk and sleeps again: with more ranks than cores, a data loader's workers thrashed so).
  if (moved && (consumed_since_wake_[s] >= wake_batch_ || ring.empty())) {
    consumed_since_wake_[s] = 0;
    notify(src);
  }
  return moved;
}

void ShmEngine::finish(const std::shared_ptr<ShmOp>& op, std::exception_ptr error) {
  if (op->done.load(std::memory_order_relaxed)) return;
  // Bytes that went through a mapping the file no longer backs may be zeros: never a success.
  if (!error && segment_->poisoned()) {
    error = poisoned_ ? poisoned_
                      : make_error<TransportError>(op->what() + ": the segment file of '" + name_ +
                                                   "' was truncated by another process while mapped");
  }
  if (!error && op->kind == ShmOp::Kind::kRecv && !op->buffer.is_same(op->user)) {
    try {
      op->user.copy_(op->buffer);  // a non-contiguous destination gets the staged bytes
    } catch (const std::exception& e) {
      error = make_error<TransportError>(op->what() + ": copying into the strided tensor: " + e.what());
    }
  }
  op->error = std::move(error);
  op->done.store(true, std::memory_order_release);  // pairs with acquire loads of done in waiters
}

// Takes `op` back from the engine (its wait gave up): it fails with `error` and never matches a
// later message. A send whose first entry is already in the ring cannot be taken back (its
// receiver expects the rest) and goes on.
void ShmEngine::cancel(std::span<const std::shared_ptr<ShmOp>> ops, const std::exception_ptr& error) {
  std::lock_guard lk(mu_);
  for (const auto& op : ops) withdraw(op, error);
}

void ShmEngine::withdraw(const std::shared_ptr<ShmOp>& op, const std::exception_ptr& error) {
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

}  // namespace tdshm::detail
