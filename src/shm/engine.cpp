// The shared-memory transport's engine (see engine.h for the protocol).

#include "shm/engine.h"

#include "common/copy.h"
#include "common/format.h"
#include "common/log.h"
#include "shm/futex.h"

#include <tdshm/memmap.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tdshm::detail {

using shm::EntryHeader;
using Clock = std::chrono::steady_clock;

/// A message from one source whose entries are arriving, or that arrived before its recv.
struct Incoming {
  int src = -1;
  int64_t tag = 0;
  bool control = false;
  MessageCheck check;  // what the sender's transfer layer said of it (kNone: nothing)
  uint64_t total = 0;
  uint8_t dtype = 0;
  uint8_t ndim = shm::kShapeNotSent;
  int64_t dims[shm::kMaxDims] = {};
  uint64_t received = 0;
  std::shared_ptr<ShmOp> op;  // the receive it lands in; null while unexpected
  shm::BufferPool::Buffer heap;  // its bytes while unexpected (from unexpected_pool_; all are written)
  uint64_t heap_bytes = 0;       // counted in ShmEngine::unexpected_bytes_ while heap is held
  bool complete = false;
  bool discard = false;  // it failed the receive it matched: drained and dropped, never copied
  bool reference = false;  // a MemmapReference: `heap` holds it while unexpected
  uint64_t arrival = 0;
};

namespace {

// Messages at least this large are copied out of the ring with non-temporal stores.
constexpr uint64_t kStreamingMessageBytes = uint64_t{8} << 20;

// A message larger than this is refused as corrupt (1 TiB): it cannot be a real tensor here.
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 40;

inline void cpu_relax() noexcept {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

template <class E>
std::exception_ptr make_error(const std::string& what) {
  return std::make_exception_ptr(E(what));
}

// The MemmapReference payload for sending `t` by reference, or "" to send its bytes: only a
// contiguous view of a named (not anonymous) mapping whose path fits in a slot goes so.
std::string memmap_reference(const at::Tensor& t, uint64_t slot_bytes) {
  auto info = MemoryMappedTensor::info(t);
  if (!info || info->filename.empty() || !t.is_contiguous()) return {};
  if (sizeof(shm::MemmapReference) + info->filename.size() > slot_bytes) return {};
  shm::MemmapReference r{};
  r.offset = static_cast<uint64_t>(info->offset);
  r.path_bytes = static_cast<uint32_t>(info->filename.size());
  std::string out(sizeof r, '\0');
  std::memcpy(out.data(), &r, sizeof r);
  return out + info->filename;
}

Clock::rep ticks(Clock::time_point t) { return t.time_since_epoch().count(); }
Clock::time_point from_ticks(Clock::rep r) { return Clock::time_point(Clock::duration(r)); }

// The entry flag that says what kind of check `check` carries (0: none).
uint32_t check_flag(const MessageCheck& check) noexcept {
  switch (check.kind) {
    case MessageCheck::Kind::kKey: return shm::kEntryKeyCheck;
    case MessageCheck::Kind::kSchema: return shm::kEntrySchemaCheck;
    case MessageCheck::Kind::kNone: break;
  }
  return 0;
}

MessageCheck entry_check(const shm::EntryFields& e) noexcept {
  if (e.flags & shm::kEntryKeyCheck) return {MessageCheck::Kind::kKey, e.check, e.leaves};
  if (e.flags & shm::kEntrySchemaCheck) return {MessageCheck::Kind::kSchema, e.check};
  return {};
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// A null op is a send that completed when it was posted.
bool is_done(const std::shared_ptr<ShmOp>& op) noexcept {
  return !op || op->done.load(std::memory_order_acquire);  // pairs with the release store in finish
}

std::shared_ptr<ShmOp> make_op(ShmOp::Kind kind, int peer, int64_t tag, bool control, const at::Tensor& user,
                               at::Tensor buffer) {
  auto op = std::make_shared<ShmOp>();
  op->kind = kind;
  op->peer = peer;
  op->tag = tag;
  op->control = control;
  op->user = user;
  op->buffer = std::move(buffer);
  op->data = static_cast<uint8_t*>(op->buffer.data_ptr());
  op->bytes = static_cast<uint64_t>(op->buffer.numel()) * op->buffer.element_size();
  return op;
}

}  // namespace

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
      spin_budget_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(options.spin).count()) {
  if (size < 1) throw SegmentError("world size " + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size) {
    throw SegmentError("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(size) + ")");
  }
  if (options.timeout.count() <= 0) throw SegmentError("ShmOptions::timeout must be positive");
  if (options.peer_check_interval.count() <= 0) throw SegmentError("ShmOptions::peer_check_interval must be positive");
  const auto deadline = Clock::now() + options.timeout;
  shm::SegmentParams params{name, static_cast<uint32_t>(size), options.slot_bytes, options.ring_entries,
                            options.slots_per_rank};
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
  collective_seq_.assign(4, 0);
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
  auto check_alive = [&] {
    for (uint32_t r = 0; r < static_cast<uint32_t>(size_); ++r) {
      if (segment_->rank_slot(r).state.load(std::memory_order_acquire) == shm::kRankLive && !segment_->rank_alive(r)) {
        give_up(PeerLostError(where + segment_->describe_rank(r) + " died before the group formed"));
      }
    }
    if (auto dead = segment_->dead_joiner()) {
      give_up(PeerLostError(where + "rank " + std::to_string(dead->rank) + " (pid " + std::to_string(dead->pid) +
                            ") died while joining the group"));
    }
  };
  for (;;) {
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
    for (auto& q : send_queues_) {
      for (auto& op : q) finish(op, shut_down_);
      q.clear();
    }
    for (auto& op : posted_) finish(op, shut_down_);
    posted_.clear();
    for (auto& msg : current_) {
      if (msg && msg->op) finish(msg->op, shut_down_);
      msg.reset();
    }
    unexpected_.clear();
    unexpected_bytes_ = 0;
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

int64_t ShmEngine::next_collective_tag(int kind) {
  std::lock_guard lk(mu_);
  return (int64_t{kind} << 56) | collective_seq_.at(static_cast<size_t>(kind))++;
}

// ---------------------------------------------------------------------------------------------
// Posting

std::shared_ptr<ShmOp> ShmEngine::post_send(const at::Tensor& tensor, int dst, int64_t tag, bool control,
                                            MessageCheck check) {
  return post_sends({&tensor, 1}, dst, {&tag, 1}, {&check, 1}, control)[0];
}

std::vector<std::shared_ptr<ShmOp>> ShmEngine::post_sends(std::span<const at::Tensor> tensors, int dst,
                                                          std::span<const int64_t> tags,
                                                          std::span<const MessageCheck> checks, bool control) {
  if (dst < 0 || dst >= size_ || dst == rank_) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "shm send: destination rank " + std::to_string(dst) + " is invalid for rank " +
                         std::to_string(rank_) + " of " + std::to_string(size_));
  }
  TORCH_INTERNAL_ASSERT(tags.size() == tensors.size() && checks.size() == tensors.size());
  const size_t peer = static_cast<size_t>(dst);
  std::vector<std::shared_ptr<ShmOp>> ops(tensors.size());
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
  return post_recvs({&tensor, 1}, src, {&tag, 1}, {&check, 1}, control)[0];
}

std::vector<std::shared_ptr<ShmOp>> ShmEngine::post_recvs(std::span<const at::Tensor> tensors, int src,
                                                          std::span<const int64_t> tags,
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
  std::vector<std::shared_ptr<ShmOp>> ops(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    // A strided destination receives into a contiguous staging tensor, copied over at the end.
    const at::Tensor& tensor = tensors[i];
    ops[i] = make_op(ShmOp::Kind::kRecv, src, tags[i], control, tensor,
                     tensor.is_contiguous() ? tensor : at::empty(tensor.sizes(), tensor.options()));
    ops[i]->check = checks[i];
  }
  std::lock_guard lk(mu_);
  bool posted = false;
  for (const auto& op : ops) posted |= post_recv_locked(op, src);
  if (posted) progress_locked();  // a message already in a ring lands in place
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
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    const auto& msg = *it;
    if ((src >= 0 && msg->src != src) || msg->tag != tag || msg->control != control) continue;
    const std::shared_ptr<Incoming> keep = msg;
    unexpected_.erase(it);
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
  posted_.push_back(op);
  return true;
}

// Checks that `msg` fits `op`; binds the source. On a mismatch fails `op` and returns false.
bool ShmEngine::try_match(const std::shared_ptr<Incoming>& msg, const std::shared_ptr<ShmOp>& op) {
  op->source = msg->src;
  std::string problem;
  const auto dtype = static_cast<c10::ScalarType>(msg->dtype);
  // Checks first: they say why the rest differs (another key, another schema).
  const bool checked = op->check.kind != MessageCheck::Kind::kNone && msg->check.kind == op->check.kind;
  const std::string from = op->peer < 0 ? " (from rank " + std::to_string(msg->src) + ")" : "";
  if (checked && msg->check.leaves != 0 && op->check.leaves != 0 && msg->check.leaves != op->check.leaves) {
    op->sender_leaves = msg->check.leaves;  // published by finish's release of done
    finish(op, make_error<TransportError>(op->what() + from + ": the sender's tree has " +
                                          std::to_string(msg->check.leaves) + " leaves but this receiving tree has " +
                                          std::to_string(op->check.leaves) + "; nothing was written"));
    return false;
  }
  if (checked && msg->check.value != op->check.value) {
    if (op->check.kind == MessageCheck::Kind::kSchema) {
      finish(op, make_error<SchemaError>(op->what() + from + ": the sender's consolidated schema (hash " +
                                         hex32(msg->check.value) + ") differs from this tensordict's (hash " +
                                         hex32(op->check.value) + "): tensorclass names, keys, dtypes, shapes or "
                                         "layout differ; nothing was written"));
    } else {
      finish(op, make_error<TransportError>(op->what() + from + ": the sender's leaf at this position has another key "
                                            "(key hash " + hex32(msg->check.value) + ", this leaf's is " +
                                            hex32(op->check.value) + "): the two trees' keys differ; nothing was "
                                            "written"));
    }
    return false;
  }
  if (msg->total != op->bytes) {
    problem = "the message has " + std::to_string(msg->total) + " bytes but the tensor has " + std::to_string(op->bytes);
  } else if (msg->dtype != static_cast<uint8_t>(op->buffer.scalar_type())) {
    problem = std::string("the message has dtype ") +
              (msg->dtype < static_cast<uint8_t>(c10::ScalarType::NumOptions) ? c10::toString(dtype) : "?") +
              " but the tensor has dtype " + c10::toString(op->buffer.scalar_type());
  } else if (msg->ndim != shm::kShapeNotSent &&
             (msg->ndim < 2 ? op->buffer.dim() != msg->ndim  // equal bytes and dtype: equal numel
                            : !std::equal(op->buffer.sizes().begin(), op->buffer.sizes().end(), msg->dims,
                                          msg->dims + msg->ndim))) {
    if (msg->ndim == 1) msg->dims[0] = static_cast<int64_t>(msg->total / op->buffer.element_size());
    problem = "the message has shape " + shape_str(c10::IntArrayRef(msg->dims, msg->ndim)) + " but the tensor has shape " +
              shape_str(op->buffer.sizes());
  }
  if (problem.empty()) return true;
  finish(op, make_error<TransportError>(op->what() + from + ": " + problem));
  return false;
}

// ---------------------------------------------------------------------------------------------
// Progress

bool ShmEngine::progress_locked() {
  if (shut_down_ || check_poisoned()) return false;
  bool moved = false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    moved |= progress_receives(p);
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

bool ShmEngine::progress_receives(int src) {
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
  for (;;) {
    shm::EntryFields fields;
    if (!ring.peek(fields)) break;  // read once: only this copy is used below
    // The chunk: in the entry, or in the sender's slot if that slot was handed to this rank (else
    // null, and handle_entry refuses the entry as corrupt).
    const bool in_slot = (fields.flags & shm::kEntryInline) == 0;
    const uint8_t* payload = in_slot ? shm::claimed_chunk(region, fields.slot, me) : ring.inline_bytes();
    Taken taken;
    try {
      taken = handle_entry(src, fields, payload, ring.shape());
      // The sender's region is written only by the sender, and only in free slots: a slot that is
      // no longer handed to this rank after the copy was rewritten while it was read.
      if (taken == Taken::kYes && in_slot && !shm::claimed_chunk(region, fields.slot, me)) {
        throw TransportError("corrupted entry from " + segment_->describe_rank(from) + ": arena slot " +
                             std::to_string(fields.slot) + " was taken back while this rank read it");
      }
    } catch (const Error&) {
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
    // A posted receive just completed: return, so that a waiter that now has what it waited
    // for stops here instead of draining later messages into process memory ("unexpected", a
    // second copy) before their receives are posted. A waiter that still waits calls again.
    if (std::exchange(completed_posted_, false)) break;
  }
  // The sender may sleep waiting for room: wake it once a quarter of its room is back, or when
  // its ring is empty, rather than for every entry (a producer woken per freed slot copies one
  // chunk and sleeps again: with more ranks than cores, a data loader's workers thrashed so).
  if (moved && (consumed_since_wake_[s] >= wake_batch_ || ring.depth() == 0)) {
    consumed_since_wake_[s] = 0;
    notify(src);
  }
  return moved;
}

// Validates one entry (a copy of what another process wrote) and moves its payload.
ShmEngine::Taken ShmEngine::handle_entry(int src, const shm::EntryFields& e, const uint8_t* payload,
                                         const shm::EntryShape& shape) {
  auto corrupt = [&](const std::string& what) {
    return TransportError("corrupted entry from " + segment_->describe_rank(static_cast<uint32_t>(src)) + ": " + what);
  };
  auto& cur = current_[static_cast<size_t>(src)];
  shm::RxProgress rx;
  if (cur) rx = {true, cur->control, cur->total, cur->received};
  const shm::ArenaShape arena{options_.slot_bytes, options_.slots_per_rank};
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
  if (e.flags & shm::kEntryFirst) {
    int64_t dims[shm::kMaxDims] = {};
    if (e.ndim != shm::kShapeNotSent && e.ndim >= 2) std::memcpy(dims, shape.dims, e.ndim * sizeof(int64_t));
    if (!start_message(src, e, dims)) return Taken::kHeld;
  }
  Incoming& msg = *cur;
  if (reference) {
    std::exception_ptr error;
    if (msg.op) {
      error = resolve_reference(*msg.op, ref);
    } else if (!msg.discard) {
      std::memcpy(msg.heap.get(), payload, e.chunk_bytes);  // checked again when a recv takes it
    }
    msg.received = msg.total;
    msg.complete = true;
    auto done = std::move(cur);
    if (done->op) {
      finish(done->op, error);
      completed_posted_ = true;
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
      finish(done->op, nullptr);
      completed_posted_ = true;
    }
    if (done->op || done->discard) {
      done->op.reset();
      if (done.use_count() == 1) spare_[static_cast<size_t>(src)] = std::move(done);  // reused by the next message
    }
  }
  return Taken::kYes;
}

// Lands a reference message (validated by check_reference) in `op`: nothing to do when op's
// tensor maps the same bytes, else one copy from the file. Returns the error to fail op with.
// The file is the sender's choice: only a regular file this process can read is read, never
// through a final symlink, and never past its end; the bytes go into the receiver's own tensor.
std::exception_ptr ShmEngine::resolve_reference(const ShmOp& op, const shm::ReferenceFields& ref) const {
  if (op.bytes == 0) return nullptr;
  if (auto mine = MemoryMappedTensor::info(op.user);
      mine && mine->writable && op.user.is_contiguous() && mine->filename == ref.path &&
      static_cast<uint64_t>(mine->offset) == ref.offset) {  // (a private copy-on-write mapping may differ)
    return nullptr;  // the receiver's tensor is the sender's bytes
  }
  auto fail = [&](const std::string& why) {
    return make_error<TransportError>(op.what() + ": the sender's memory-mapped file '" + ref.path + "': " + why);
  };
  // O_NONBLOCK: opening a FIFO named by a buggy peer must not block (it is refused below).
  const int fd = ::open(ref.path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return fail(std::string("cannot open it: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return fail("not a regular file");
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
bool ShmEngine::start_message(int src, const shm::EntryFields& e, const int64_t* dims) {
  const auto s = static_cast<size_t>(src);
  const bool control = (e.flags & shm::kEntryControl) != 0;
  const bool reference = (e.flags & shm::kEntryReference) != 0;
  auto posted = std::find_if(posted_.begin(), posted_.end(), [&](const std::shared_ptr<ShmOp>& op) {
    return (op->peer < 0 || op->peer == src) && op->tag == e.tag && op->control == control;
  });
  // An unexpected reference keeps the reference, not the bytes.
  const uint64_t need = posted != posted_.end() ? 0 : reference ? e.chunk_bytes : e.total_bytes;
  if (posted == posted_.end() && need > options_.max_unexpected_bytes - std::min<uint64_t>(unexpected_bytes_, options_.max_unexpected_bytes)) {
    held_bytes_[s] = std::max<uint64_t>(need, 1);
    return false;
  }
  held_bytes_[s] = 0;
  auto& spare = spare_[s];
  auto msg = spare ? std::move(spare) : std::make_shared<Incoming>();
  *msg = Incoming{};
  msg->src = src;
  msg->tag = e.tag;
  msg->control = control;
  msg->reference = reference;
  msg->check = entry_check(e);
  msg->total = e.total_bytes;
  msg->dtype = e.dtype;
  msg->ndim = e.ndim;
  if (e.ndim != shm::kShapeNotSent && e.ndim >= 2) std::copy(dims, dims + e.ndim, msg->dims);
  msg->arrival = arrivals_++;
  if (posted != posted_.end()) {
    auto op = *posted;
    posted_.erase(posted);
    current_[s] = msg;
    if (try_match(msg, op)) {
      msg->op = op;
    } else {
      msg->discard = true;  // that receive failed on a mismatch; the message is dropped
    }
    return true;
  }
  msg->heap = unexpected_pool_.take(need);
  msg->heap_bytes = need;
  unexpected_bytes_ += need;
  current_[s] = msg;
  unexpected_.push_back(msg);
  return true;
}

void ShmEngine::release_unexpected(Incoming& msg) {
  unexpected_bytes_ -= std::min(unexpected_bytes_, msg.heap_bytes);
  unexpected_pool_.give_back(std::move(msg.heap));
  msg.heap = {};
  msg.heap_bytes = 0;
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
    std::erase(posted_, op);
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
// Peers

void ShmEngine::fail_peer(int peer, std::exception_ptr error) {
  auto& slot = peer_error_[static_cast<size_t>(peer)];
  if (!slot) slot = error;
  auto& queue = send_queues_[static_cast<size_t>(peer)];
  for (auto& op : queue) finish(op, slot);
  queue.clear();
  auto& cur = current_[static_cast<size_t>(peer)];
  if (cur) {
    if (cur->op) finish(cur->op, slot);
    if (std::erase(unexpected_, cur) != 0) release_unexpected(*cur);  // nobody will ever finish it
    cur.reset();
  }
  held_bytes_[static_cast<size_t>(peer)] = 0;
  bool someone_alive = false;
  for (int p = 0; p < size_; ++p) someone_alive |= (p != rank_ && !peer_error_[static_cast<size_t>(p)]);
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer == peer || ((*it)->peer < 0 && !someone_alive)) {
      finish(*it, slot);
      it = posted_.erase(it);
    } else {
      ++it;
    }
  }
  // The rings with `peer` are not reset: they belong to this incarnation only, and `peer` (if it
  // still runs) may still be writing to them. Nothing more is read from or written to them.
}

// Once the segment's mapping is lost (a peer truncated the file), every transfer fails.
bool ShmEngine::check_poisoned() {
  if (poisoned_) return true;
  if (!segment_->poisoned()) return false;
  poisoned_ = make_error<TransportError>("the segment file of '" + name_ +
                                         "' was truncated by another process while in use: this group's shared "
                                         "memory is gone and all of its transfers fail; construct the group again");
  log().error("segment '{}' was truncated under its mapping: the group's transfers fail", name_);
  fail_all(poisoned_);
  return true;
}

void ShmEngine::fail_all(const std::exception_ptr& error) {
  for (auto& q : send_queues_) {
    for (auto& op : q) finish(op, error);
    q.clear();
  }
  for (auto& op : posted_) finish(op, error);
  posted_.clear();
  for (auto& msg : current_) {
    if (msg && msg->op) finish(msg->op, error);
    msg.reset();
  }
  unexpected_.clear();
  unexpected_bytes_ = 0;
  for (auto& p : peer_error_) {
    if (!p) p = error;
  }
}

void ShmEngine::check_peers() {
  if (shut_down_) return;
  segment_->check_file();
  if (check_poisoned()) return;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || peer_error_[static_cast<size_t>(p)]) continue;
    if (segment_->rank_alive(static_cast<uint32_t>(p))) continue;
    segment_->check_file();
    if (check_poisoned()) return;  // the rank table read zeros because the file was just cut
    while (progress_receives(p)) {
    }  // what it sent before it went is still good: all of it is taken
    if (peer_error_[static_cast<size_t>(p)]) continue;
    fail_peer(p, make_error<PeerLostError>(segment_->describe_rank(static_cast<uint32_t>(p)) +
                                           " of segment '" + name_ + "' is gone (it exited or died)"));
    // A gone rank reads nothing more: the slots this rank handed to it are free again.
    const uint32_t reclaimed = slots_.reclaim(static_cast<uint32_t>(p));
    log().warn("segment '{}': {} is gone; its pending transfers failed ({} arena slots taken back)", name_,
               segment_->describe_rank(static_cast<uint32_t>(p)), reclaimed);
  }
}

void ShmEngine::maybe_check_peers(Clock::time_point now) {
  if (ticks(now) < next_peer_check_.load(std::memory_order_relaxed)) return;
  std::lock_guard lk(mu_);
  if (ticks(now) < next_peer_check_.load(std::memory_order_relaxed)) return;  // another thread just did
  check_peers();
  next_peer_check_.store(ticks(now + options_.peer_check_interval), std::memory_order_relaxed);
}

void ShmEngine::notify(int r) {
  shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(r));
  // Orders the publication above before the sleepers check (pairs with sleep_until_event).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (slot.sleepers.load(std::memory_order_relaxed) != 0) {
    slot.wake_seq.fetch_add(1, std::memory_order_seq_cst);
    shm::futex_wake_all(slot.wake_seq);
  }
}

// ---------------------------------------------------------------------------------------------
// Waiting

void ShmEngine::sleep_until_event(Clock::time_point until) {
  shm::RankSlot& slot = segment_->rank_slot(static_cast<uint32_t>(rank_));
  slot.sleepers.fetch_add(1, std::memory_order_seq_cst);  // announce, then re-check (see notify)
  // The re-check below reads ring words with acquire loads, which the C++ model may order before
  // the announcement; this fence pairs with the one in notify (store-load ordering, Dekker).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const uint32_t seen = slot.wake_seq.load(std::memory_order_seq_cst);
  bool moved;
  {
    std::lock_guard lk(mu_);
    moved = progress_locked();
  }
  if (!moved) shm::futex_wait(slot.wake_seq, seen, until - Clock::now());
  slot.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void ShmEngine::wait(std::span<const std::shared_ptr<ShmOp>> ops, Clock::time_point deadline, bool stop_on_error) {
  auto all_done = [&] {
    if (std::all_of(ops.begin(), ops.end(), is_done)) return true;
    return stop_on_error && std::any_of(ops.begin(), ops.end(), [](const std::shared_ptr<ShmOp>& op) {
             return op && op->done.load(std::memory_order_acquire) && op->error;
           });
  };
  if (all_done()) return;
  // Checks are cheap (one pause between them, ~30 ns here); the clock is read every 32 checks
  // and the core is offered to others (sched_yield) every 1024 (~30-50 us), so a peer that
  // shares this core with us (more ranks than cores) still runs.
  // The spin budget starts at the first clock read (after kClockEvery checks, ~1 us): a wait
  // that ends sooner never reads the clock. Blocking-only waits (spin 0) never spin. The budget
  // adapts (note_wait): spinning only pays while waits are short.
  constexpr unsigned kClockEvery = 32, kYieldEvery = 1024;
  const bool spinning = options_.spin.count() > 0;
  Clock::time_point now{}, start{}, spin_end{};
  auto done = [&] {
    if (!all_done()) return false;
    if (spinning) note_wait(start == Clock::time_point{} ? Clock::duration::zero() : Clock::now() - start);
    return true;
  };
  for (unsigned spins = 1;; ++spins) {
    bool moved;
    {
      std::lock_guard lk(mu_);
      moved = progress_locked();
    }
    if (done()) return;
    if (moved) continue;
    if (spinning && spins % kClockEvery != 0 && (spin_end == Clock::time_point{} || now < spin_end)) {
      cpu_relax();
      continue;
    }
    now = Clock::now();
    if (spin_end == Clock::time_point{}) {
      start = now;
      spin_end = now + std::chrono::nanoseconds(spin_budget_ns_.load(std::memory_order_relaxed));
    }
    maybe_check_peers(now);
    if (done()) return;
    if (now >= deadline) {
      std::string pending;
      for (const auto& op : ops) {
        if (!is_done(op)) pending += (pending.empty() ? "" : "; ") + op->what();
      }
      std::lock_guard lk(mu_);
      for (size_t p = 0; p < held_bytes_.size(); ++p) {
        if (held_bytes_[p] != 0) {
          pending += "; a message of " + std::to_string(held_bytes_[p]) + " bytes from rank " + std::to_string(p) +
                     " waits in its ring for its recv (early messages already hold " +
                     std::to_string(unexpected_bytes_) + " bytes of ShmOptions::max_unexpected_bytes = " +
                     std::to_string(options_.max_unexpected_bytes) + ")";
        }
      }
      auto error = make_error<TimeoutError>("segment '" + name_ + "', rank " + std::to_string(rank_) +
                                            ": timed out waiting for " + pending);
      for (const auto& op : ops) withdraw(op, error);
      std::rethrow_exception(error);
    }
    if (now < spin_end) {
      if (spins % kYieldEvery == 0) sched_yield();
      continue;
    }
    const auto next_check = from_ticks(next_peer_check_.load(std::memory_order_relaxed));
    sleep_until_event(std::min({deadline, std::max(next_check, now), now + std::chrono::milliseconds(100)}));
  }
}

// Adapts the spin budget to how long waits take: a wait that ended within ShmOptions::spin would
// have been served by spinning, so the budget doubles (up to ShmOptions::spin); one that took more
// than 4 times as long means spinning burnt a core that a peer may have needed (more ranks than
// cores: a data loader's workers), so it halves, down to 1 us. Waits in between leave it alone
// (a transfer of 100 leaves takes ~2x the spin: spinning still saves its wake-ups). Ping-pong
// keeps the full budget; a receiver that waits milliseconds for its producers sleeps almost at once.
void ShmEngine::note_wait(Clock::duration elapsed) noexcept {
  constexpr int64_t kMinSpinNs = 1000;
  const int64_t max = std::chrono::duration_cast<std::chrono::nanoseconds>(options_.spin).count();
  int64_t b = spin_budget_ns_.load(std::memory_order_relaxed);
  if (elapsed <= options_.spin) {
    b = std::min(max, std::max(b * 2, kMinSpinNs));
  } else if (elapsed > 4 * options_.spin) {
    b = std::max(kMinSpinNs, b / 2);
  }
  spin_budget_ns_.store(std::min(b, max), std::memory_order_relaxed);
}

void ShmEngine::watch(std::vector<std::shared_ptr<ShmOp>> ops, std::function<void()> on_done) {
  const bool done = std::all_of(ops.begin(), ops.end(), is_done);
  if (done) {
    on_done();
    return;
  }
  {
    std::lock_guard lk(watch_mu_);
    watches_.push_back({std::move(ops), std::move(on_done)});
    if (!background_.joinable() && !stopping_) background_ = std::thread(background_loop, weak_from_this());
  }
  watch_cv_.notify_all();
}

// The helper thread holds the engine only while it works on it, so that the engine can be
// destroyed (by a callback, even) while the thread runs.
void ShmEngine::background_loop(std::weak_ptr<ShmEngine> weak) {
  for (;;) {
    auto self = weak.lock();
    if (!self || !self->background_step()) return;
  }
}

// One round of the helper thread; false once it should end. Nothing escapes it.
bool ShmEngine::background_step() {
  std::vector<Watch> ready;
  bool stop = false;
  {
    std::unique_lock lk(watch_mu_);
    watch_cv_.wait(lk, [&] { return stopping_ || !watches_.empty(); });
    if (stopping_) {
      stop = true;
      ready = std::move(watches_);  // fail-fast: their ops were finished with errors or will be
      watches_.clear();
    }
  }
  auto run = [&](std::vector<Watch>& list) {
    for (auto& w : list) {
      try {
        w.on_done();
      } catch (const std::exception& e) {
        log().error("segment '{}': a future's completion callback threw: {}", name_, e.what());
      } catch (...) {
        log().error("segment '{}': a future's completion callback threw", name_);
      }
    }
  };
  if (stop) {  // also when no watch is left: shutdown() joins this thread
    run(ready);
    return false;
  }
  try {
    {
      std::lock_guard lk(mu_);
      progress_locked();
    }
    maybe_check_peers(Clock::now());
  } catch (const std::exception& e) {
    log().error("segment '{}': progress on the helper thread failed: {}", name_, e.what());
  }
  {
    std::lock_guard lk(watch_mu_);
    auto it = std::partition(watches_.begin(), watches_.end(), [](const Watch& w) {
      return !std::all_of(w.ops.begin(), w.ops.end(), is_done);
    });
    std::move(it, watches_.end(), std::back_inserter(ready));
    watches_.erase(it, watches_.end());
  }
  run(ready);
  if (ready.empty()) {
    try {
      sleep_until_event(Clock::now() + std::chrono::milliseconds(1));
    } catch (...) {
    }
  }
  return true;
}

}  // namespace tdshm::detail
