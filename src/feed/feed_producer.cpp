// A feed's producer (include/tdshm/feed.h; the frames in feed_wire.h): sizes its group from the
// first item, grows it when an item outgrows the heap, and sends each tensor by reference when it
// can, copied into a loan when it can, by value otherwise, so that a put never waits for the
// consumer to drop what it holds.

#include "feed/feed_wire.h"
#include "feed/heap_allocator.h"

#include "process_group/batch_work.h"
#include "process_group/shm_group_seam.h"

#include <tdshm/errors.h>
#include <tdshm/feed.h>
#include <tdshm/schema.h>

#include <ATen/EmptyTensor.h>

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

namespace tdshm {

namespace feed {

std::string process_gone(pid_t pid) {
  if (pid <= 0) return {};
  if (::kill(pid, 0) != 0 && errno == ESRCH) return "process " + std::to_string(pid) + " is gone";
  // A zombie (killed, not yet reaped) no longer runs either.
  char buf[512];
  std::string text;
  if (const int fd = ::open(("/proc/" + std::to_string(pid) + "/stat").c_str(), O_RDONLY | O_CLOEXEC); fd >= 0) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    ::close(fd);
    if (n > 0) text.assign(buf, static_cast<size_t>(n));
  }
  const size_t paren = text.rfind(')');
  if (paren != std::string::npos && paren + 2 < text.size() && (text[paren + 2] == 'Z' || text[paren + 2] == 'X')) {
    return "process " + std::to_string(pid) + " ended";
  }
  return {};
}

void wait_in_slices(const c10::intrusive_ptr<c10d::Work>& work, const FeedOptions& o) {
  using Clock = std::chrono::steady_clock;
  auto* batch = dynamic_cast<detail::BatchWork*>(work.get());
  if (batch == nullptr || !o.check) {
    work->wait(wait_limit(o));
    return;
  }
  const auto deadline = Clock::now() + wait_limit(o);
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      work->wait(std::chrono::milliseconds(1));  // withdraws it with the transport's TimeoutError
      return;
    }
    if (batch->wait_keeping(std::min(left, std::chrono::milliseconds(100)))) return;
    try {
      o.check();
    } catch (...) {
      work->abort();
      throw;
    }
  }
}

// For its scope, this thread's allocations go to torch's allocator, not to a feed's heap.
class OwnAllocations {
 public:
  OwnAllocations() : previous_(feed::set_thread_heap_source(nullptr)) {}
  ~OwnAllocations() { feed::set_thread_heap_source(previous_); }
  OwnAllocations(const OwnAllocations&) = delete;
  OwnAllocations& operator=(const OwnAllocations&) = delete;

 private:
  const feed::HeapSource* previous_;
};

namespace detail_producer {

constexpr uint64_t kLeafSlack = 256;  // heap bytes per tensor beyond its own (the allocator's alignment)

uint64_t tensor_bytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// A tensor this small travels by value, never in a loan (FeedProducer::put).
constexpr uint64_t kSmallBytes = uint64_t{4} << 10;
bool small(const at::Tensor& t) { return tensor_bytes(t) <= kSmallBytes; }

// What /dev/shm holds in all (total) and has free now, in bytes (0, 0 when it cannot be read).
struct ShmSpace {
  uint64_t total = 0;
  uint64_t free = 0;
};
ShmSpace shm_space() {
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) != 0) return {};
  return {static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize, static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize};
}

// A frame of a FrameHead alone (kGrow, kClose).
at::Tensor frame_tensor(const FrameHead& head) {
  at::Tensor t(at::detail::empty_cpu({static_cast<int64_t>(sizeof head)}, at::kByte));
  std::memcpy(t.data_ptr<uint8_t>(), &head, sizeof head);
  return t;
}

// An item's frame (FrameHead::inline_tensors of `head` set): the tensors marked in `inlined`
// (their padded bytes `inline_bytes` in all) inside it, then the header.
at::Tensor item_frame(const FrameHead& head, std::span<const uint8_t> header, const std::vector<at::Tensor>& tensors,
                      const std::vector<bool>& inlined, uint64_t inline_bytes) {
  const uint64_t table = uint64_t{head.inline_tensors} * sizeof(InlineTensor);
  at::Tensor frame(
      at::detail::empty_cpu({static_cast<int64_t>(sizeof head + table + inline_bytes + header.size())}, at::kByte));
  uint8_t* const base = frame.data_ptr<uint8_t>();
  std::memcpy(base, &head, sizeof head);
  uint8_t* entry = base + sizeof head;
  uint8_t* data = entry + table;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!inlined[i]) continue;
    // The values, not the memory: a conjugate or negative view is resolved, a strided one packed.
    const at::Tensor c = tensors[i].resolve_conj().resolve_neg().contiguous();
    InlineTensor e;
    e.index = static_cast<uint32_t>(i);
    e.dtype = static_cast<uint8_t>(c.scalar_type());
    e.ndim = static_cast<uint8_t>(c.dim());
    e.bytes = tensor_bytes(c);
    for (int64_t d = 0; d < c.dim(); ++d) e.sizes[d] = c.size(d);
    std::memcpy(entry, &e, sizeof e);
    entry += sizeof e;
    if (e.bytes != 0) std::memcpy(data, c.data_ptr(), e.bytes);
    std::memset(data + e.bytes, 0, pad8(e.bytes) - e.bytes);
    data += pad8(e.bytes);
  }
  if (!header.empty()) std::memcpy(data, header.data(), header.size());
  return frame;
}

}  // namespace detail_producer
}  // namespace feed

namespace detail {

class FeedProducerState {
 public:
  FeedProducerState(std::string name, int index, FeedOptions o) : name_(std::move(name)), index_(index), o_(o) {
    if (index < 0) throw Error("FeedProducer: index " + std::to_string(index) + " must be >= 0");
    validate_segment_name(feed::group_name(name_, index_, 0));
  }
  ~FeedProducerState() { leave(); }

  // A loan, waiting for room while the consumer gives loans back (see room()), else undefined.
  at::Tensor try_loan(at::IntArrayRef sizes, at::ScalarType dtype, size_t lending = 0) {
    if (!pg_ || closed_) return {};
    while (true) {
      if (ticket_free(lending)) {
        if (at::Tensor t = pg_->try_loan(sizes, dtype); t.defined()) return t;
      }
      if (!room()) return {};
    }
  }

  bool is_loan(const at::Tensor& t) const { return pg_ && pg_->is_loan(t); }

  // A loan for an allocation redirected into the heap (FeedProducer::HeapAllocations): never
  // waits, and leaves half of the heap to the items' own loans. What counts against that half is
  // what the producer's code keeps (a dataset's cache), not the redirected allocations that are
  // items in flight: those are the items' loans (counted too, every allocation past
  // prefetch_factor 3 went to torch's allocator and was copied into a loan at put: 4 workers, whole
  // batches, prefetch_factor 4, 2.4 page faults a batch and 20 % fewer batches a second).
  at::Tensor take_for_allocation(uint64_t bytes) {
    if (!pg_ || closed_) return {};
    prune();
    uint64_t in_flight = 0;
    for (const Lent& l : lent_) in_flight += l.redirected;
    const uint64_t live = feed::heap_allocations_live_bytes();
    if (live - std::min(live, in_flight) + bytes > heap_ / 2) return {};
    return pg_->try_loan({static_cast<int64_t>(bytes)}, at::kByte);
  }

  void put(std::span<const uint8_t> header, const std::vector<at::Tensor>& tensors) {
    // The put's own tensors (the frame, a clone) travel by value: made in the heap by an open
    // HeapAllocations scope they were loans, sent by reference, and the put waited for the
    // consumer to drop them, forever when it kept the item (a frame of 64-128 KiB of small
    // tensors, list(loader)).
    const feed::OwnAllocations own;
    using feed::detail_producer::kLeafSlack;
    using feed::detail_producer::small;
    using feed::detail_producer::tensor_bytes;
    if (closed_) throw Error("FeedProducer '" + name_ + "': put after close()");
    uint64_t need = 0;
    size_t leaves = 0;  // tensors that travel in the heap
    for (const auto& t : tensors) {
      if (!t.defined() || t.device().type() != c10::DeviceType::CPU || t.layout() != c10::kStrided) {
        throw TypeError("FeedProducer::put: tensor " + std::to_string(&t - tensors.data()) +
                        " must be a defined dense CPU tensor");
      }
      if (small(t)) continue;
      need += tensor_bytes(t) + kLeafSlack;
      ++leaves;
    }
    if (tensors.size() > feed::kMaxTensors) throw Error("FeedProducer::put: more than 2^20 tensors");
    fit(need, leaves);
    // Small tensors that are no loans travel inside the frame: a loan costs more than copying a
    // few KiB (a ticket, a reference, a view on the other side), and a message of its own each
    // costs the consumer an allocation and a receive.
    std::vector<bool>& inlined = put_.inlined;
    inlined.assign(tensors.size(), false);
    feed::FrameHead head;
    head.tensors = static_cast<uint32_t>(tensors.size());
    uint64_t inline_bytes = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i];
      if (small(t) && t.dim() <= feed::kInlineDims && !pg_->is_loan(t)) {
        inlined[i] = true;
        ++head.inline_tensors;
        inline_bytes += feed::pad8(tensor_bytes(t));
      }
    }
    // The frame and the other tensors go as one batch of messages (one lock, one wake-up of the
    // consumer). is_lent[i]: message i lends a loan (its Work completes once the consumer
    // dropped its view).
    std::vector<at::Tensor>& msgs = put_.messages;
    msgs.clear();
    msgs.push_back(feed::detail_producer::item_frame(head, header, tensors, inlined, inline_bytes));
    std::vector<bool>& is_lent = put_.is_lent;
    is_lent.assign(1, false);
    prune();
    size_t lending = 0;  // loans this put lends so far (each takes a ticket)
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (inlined[i]) continue;
      const at::Tensor& t = tensors[i];
      const bool loan = pg_->is_loan(t);
      at::Tensor out;
      bool lent = true;  // out is a loan: by reference
      if (small(t) && !loan) {
        out = t.is_contiguous() ? t : t.contiguous();  // by value (more dimensions than a frame holds)
        lent = false;
      } else if (t.is_contiguous() && loan && (ticket_free(lending) || (room() && ticket_free(lending)))) {
        out = t;
      } else if ((out = try_loan(t.sizes(), t.scalar_type(), lending)).defined()) {
        out.copy_(t);
      } else {
        // A loan whose send would wait for a ticket the consumer holds is cloned: by value.
        out = loan || !t.is_contiguous() ? t.clone(at::MemoryFormat::Contiguous) : t;
        lent = false;
      }
      lending += lent ? 1 : 0;
      is_lent.push_back(lent);
      msgs.push_back(std::move(out));
    }
    const std::vector<int> tags(msgs.size(), feed::kFrameTag);
    const std::vector<MessageCheck> checks(msgs.size());
    const c10::intrusive_ptr<BatchWork> batch = ShmGroupSeam::send_batch(*pg_, msgs, 0, tags, checks);
    if (batch) {
      std::vector<c10::intrusive_ptr<c10d::Work>> works = batch->messages();
      for (size_t i = 0; i < works.size(); ++i) {
        if (is_lent[i]) {
          // A tensor the producer made in the heap (HeapAllocations) is in flight until it comes back.
          lent_.push_back({std::move(works[i]), feed::redirected_bytes(msgs[i].data_ptr())});
        } else if (!works[i]->isCompleted()) {
          pending_.push_back(std::move(works[i]));
        }
      }
    }
    msgs.clear();  // the producer keeps none of the item's tensors past its put
    flush();
    ++items_;
  }

  void put(const TensorDict& td) {
    const TensorDict c = td.consolidate();  // no copy when td came from try_loan(like)
    // Items of one tree share a schema: its encoding is made once (a comparison is cheaper).
    if (!td_schema_ || !(c.schema() == *td_schema_)) {
      const std::vector<uint8_t> schema = encode_schema(c.schema());
      td_header_.resize(sizeof feed::kTensorDictMagic + schema.size());
      std::memcpy(td_header_.data(), &feed::kTensorDictMagic, sizeof feed::kTensorDictMagic);
      std::memcpy(td_header_.data() + sizeof feed::kTensorDictMagic, schema.data(), schema.size());
      td_schema_ = c.schema();
    }
    put(td_header_, {c.consolidated_storage()});
  }

  void close() {
    if (closed_) return;
    fit(0, 0);
    feed::FrameHead head;
    head.kind = feed::FrameKind::kClose;
    send_by_value(feed::detail_producer::frame_tensor(head));
    flush();
    closed_ = true;
  }

  uint64_t items() const noexcept { return items_; }
  uint32_t generation() const noexcept { return gen_; }

 private:
  // The group exists and its heap holds an item of `need` bytes a few times over: generation 0
  // (the size both sides know) opens first, then grows to this item's size when it must (a new
  // generation, announced over the old one).
  void fit(uint64_t need, size_t leaves) {
    const uint64_t want = feed::page_up(std::max<uint64_t>(need * o_.items_in_heap, kMinHeap));
    const uint32_t tickets = static_cast<uint32_t>(std::min<uint64_t>(
        feed::kMaxTickets,
        std::max<uint64_t>(feed::kFirstTickets, uint64_t{o_.items_in_heap} * std::max<size_t>(1, leaves) * 2)));
    if (!pg_) open(feed::page_up(o_.first_heap_bytes), feed::kFirstTickets);
    // Grow when fewer than half of items_in_heap such items fit, within this producer's share of
    // /dev/shm (both ranks' heaps count: the segment holds one per rank) and what is free now,
    // and only to a heap that holds two such items: else they go by value.
    if (need * std::max<uint32_t>(2, o_.items_in_heap / 2) <= heap_ && tickets <= tickets_) return;
    const feed::detail_producer::ShmSpace space = feed::detail_producer::shm_space();
    const auto segment = [&](uint64_t heap) {
      return static_cast<uint64_t>(shm_segment_bytes(2, feed::group_options(o_, heap, tickets)));
    };
    uint64_t heap = std::max(want, heap_);
    if (space.total > 0) {
      const auto share = static_cast<uint64_t>(static_cast<double>(space.total) * std::clamp(o_.shm_share, 0.0, 1.0));
      const uint64_t fixed = segment(0);
      const uint64_t room = std::min(share, space.free);
      heap = room > fixed ? std::min(heap, feed::page_down((room - fixed) / 2)) : 0;
    }
    if (heap > feed::kMaxHeapBytes || heap < 2 * need || (heap <= heap_ && tickets <= tickets_)) return;
    feed::FrameHead head;
    head.kind = feed::FrameKind::kGrow;
    head.generation = gen_ + 1;
    head.heap_bytes = heap;
    head.loan_tickets = std::max(tickets, tickets_);
    send_by_value(feed::detail_producer::frame_tensor(head));
    flush();
    // The consumer's views of this generation's loans keep their mapping after both leave it.
    pg_->shutdown();
    pg_.reset();
    lent_.clear();
    ++gen_;
    open(heap, head.loan_tickets);
  }

  void open(uint64_t heap, uint32_t tickets) {
    joined_.push_back(feed::group_name(name_, index_, gen_));
    pg_ = feed::join_group(feed::group_name(name_, index_, gen_), 1, o_, heap, tickets,
                           [this] { return feed::process_gone(o_.watch_pid); });
    heap_ = heap;
    tickets_ = tickets;
  }

  void send_by_value(const at::Tensor& t) {
    std::vector<at::Tensor> one{t};
    pending_.push_back(pg_->send(one, 0, feed::kFrameTag));
  }

  // A message sent by value streams through the group's slots only while this process calls into
  // tdshm: wait until all of it is in (at once, unless the consumer holds every slot). The
  // consumer's death or departure ends the wait with its error.
  void flush() {
    for (auto& w : pending_) feed::wait_in_slices(w, o_);
    pending_.clear();
  }

  // Keeps only the loans' sends whose views the consumer still holds (each holds a ticket).
  void prune() {
    if (std::erase_if(lent_, [](const Lent& l) { return l.work->isCompleted(); }) > 0) {
      held_ = false;
    }
  }

  // A ticket is free for one more loan, beyond `lending` that the put being made lends.
  bool ticket_free(size_t lending = 0) {
    prune();
    return lent_.size() + lending + 1 < tickets_;
  }

  // The heap (or its tickets) is full: waits up to FeedOptions::room_wait for the consumer to give
  // the oldest loan back, so that a producer running ahead of a consumer that reads and drops
  // its items is held back instead of sending by value. Once such a wait ran out (the consumer
  // holds its items: list(loader)), it does not wait again until a loan comes back by itself.
  // True when a loan came back.
  bool room() {
    prune();
    if (lent_.empty() || held_) return false;
    auto* batch = dynamic_cast<BatchWork*>(lent_.front().work.get());
    if (batch == nullptr || !batch->wait_keeping(o_.room_wait)) {
      held_ = true;
      return false;
    }
    prune();
    return true;
  }

  void leave() noexcept {
    pending_.clear();
    lent_.clear();
    if (pg_) pg_->shutdown();
    pg_.reset();
    feed::sweep(joined_);
  }

  static constexpr uint64_t kMinHeap = uint64_t{64} << 10;

  std::string name_;
  int index_;
  FeedOptions o_;
  c10::intrusive_ptr<ProcessGroupShm> pg_;
  uint32_t gen_ = 0;
  uint64_t heap_ = 0;
  uint32_t tickets_ = 0;
  uint64_t items_ = 0;
  bool closed_ = false;
  bool held_ = false;                // a wait for room ran out: the consumer holds what it has
  std::optional<Schema> td_schema_;  // the last tensordict's schema, and its header
  std::vector<uint8_t> td_header_;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_;
  struct Lent {
    c10::intrusive_ptr<c10d::Work> work;
    uint64_t redirected;  // bytes of a HeapAllocations tensor it sends by reference (0: none)
  };
  std::vector<Lent> lent_;
  // put's lists, kept for their capacity.
  struct {
    std::vector<at::Tensor> messages;
    std::vector<bool> is_lent, inlined;
  } put_;
  std::vector<std::string> joined_;  // every group this producer joined or tried to (swept at the end)
};

}  // namespace detail

FeedProducer::FeedProducer(const std::string& name, int index, FeedOptions options)
    : state_(std::make_unique<detail::FeedProducerState>(name, index, options)) {}
FeedProducer::FeedProducer(FeedProducer&&) noexcept = default;
FeedProducer& FeedProducer::operator=(FeedProducer&&) noexcept = default;
FeedProducer::~FeedProducer() = default;

at::Tensor FeedProducer::try_loan(at::IntArrayRef sizes, at::ScalarType dtype) {
  return state_->try_loan(sizes, dtype);
}

std::optional<TensorDict> FeedProducer::try_loan(const TensorDict& like) {
  const TensorDict c = like.consolidate();  // (a copy unless consolidated: only its schema is kept)
  at::Tensor storage = state_->try_loan({c.consolidated_storage().numel()}, at::kByte);
  if (!storage.defined()) return std::nullopt;
  return TensorDict::from_consolidated(storage, c.schema());
}

bool FeedProducer::is_loan(const at::Tensor& t) const { return state_->is_loan(t); }

struct detail::HeapAllocationsState {
  feed::HeapSource source;
  const feed::HeapSource* previous = nullptr;
  bool ended = false;
};

FeedProducer::HeapAllocations::HeapAllocations(FeedProducer& producer, size_t min_bytes)
    : state_(std::make_unique<detail::HeapAllocationsState>()) {
  detail::FeedProducerState* p = producer.state_.get();
  state_->source.min_bytes = std::max<size_t>(min_bytes, 1);
  state_->source.pid = ::getpid();
  state_->source.take = [p](uint64_t bytes) { return p->take_for_allocation(bytes); };
  state_->previous = feed::set_thread_heap_source(&state_->source, &active_);
}

FeedProducer::HeapAllocations::~HeapAllocations() { end(); }

void FeedProducer::HeapAllocations::end() noexcept {
  if (state_->ended) return;
  state_->ended = true;
  feed::set_thread_heap_source(state_->previous);
}
void FeedProducer::put(std::span<const uint8_t> header, const std::vector<at::Tensor>& tensors) {
  state_->put(header, tensors);
}
void FeedProducer::put(const TensorDict& td) { state_->put(td); }
void FeedProducer::close() { state_->close(); }
uint64_t FeedProducer::items() const noexcept { return state_->items(); }
uint32_t FeedProducer::generation() const noexcept { return state_->generation(); }

}  // namespace tdshm
