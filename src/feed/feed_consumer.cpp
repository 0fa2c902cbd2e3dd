// A feed's consumer (include/tdshm/feed.h; the frames in feed_wire.h): joins producer k's group
// when its first item is asked for, follows its generations, and hands out each item's tensors as
// views (of loans) or fresh tensors (sent by value).

#include "feed/feed_wire.h"
#include "tensordict/impl.h"

#include <tdshm/errors.h>
#include <tdshm/feed.h>
#include <tdshm/schema.h>

#include <algorithm>
#include <cstring>

namespace tdshm {
namespace detail {

class FeedConsumerState {
 public:
  FeedConsumerState(std::string name, int producers, FeedOptions o)
      : name_(std::move(name)), o_(o), ends_(static_cast<size_t>(std::max(producers, 0))) {
    if (producers < 1) throw Error("FeedConsumer: producers " + std::to_string(producers) + " must be >= 1");
    for (int k = 0; k < producers; ++k) validate_segment_name(feed::group_name(name_, k, 0));
  }
  ~FeedConsumerState() { shutdown(); }

  std::optional<FeedItem> next_from(int k) {
    End& e = end(k);
    if (e.closed) return std::nullopt;
    if (shut_) throw Error("FeedConsumer '" + name_ + "': used after shutdown()");
    if (!e.pg) e.pg = join(k, 0, feed::page_up(o_.first_heap_bytes), feed::kFirstTickets);
    while (true) {
      const at::Tensor frame = wait_one(k, e, e.pg->irecv_view(1, feed::kFrameTag));
      const auto bytes = static_cast<size_t>(frame.numel());
      feed::FrameHead head;
      if (frame.scalar_type() != at::kByte || bytes < sizeof head)
        bad(k, "a frame of " + std::to_string(bytes) + " bytes");
      std::memcpy(&head, frame.data_ptr<uint8_t>(), sizeof head);
      if (head.magic != feed::kFrameMagic) bad(k, "a frame without the feed's magic");
      if (head.kind == feed::FrameKind::kClose) {
        e.closed = true;
        leave(e);
        return std::nullopt;
      }
      if (head.kind == feed::FrameKind::kGrow) {
        if (head.generation != e.gen + 1 || head.heap_bytes > feed::kMaxHeapBytes || head.loan_tickets < 1 ||
            head.loan_tickets > feed::kMaxTickets) {
          bad(k, "a grow frame to generation " + std::to_string(head.generation) + " (heap " +
                     std::to_string(head.heap_bytes) + " bytes, " + std::to_string(head.loan_tickets) +
                     " tickets) after generation " + std::to_string(e.gen));
        }
        leave(e);  // views of its loans keep their mapping
        e.gen = head.generation;
        e.pg = join(k, e.gen, head.heap_bytes, head.loan_tickets);
        continue;
      }
      if (head.kind != feed::FrameKind::kItem || head.tensors > feed::kMaxTensors) {
        bad(k, "a frame of kind " + std::to_string(static_cast<int>(head.kind)) + " with " +
                   std::to_string(head.tensors) + " tensors");
      }
      FeedItem item;
      item.tensors.resize(head.tensors);
      const uint64_t header_at = inline_tensors(k, frame, head, item.tensors);
      item.header.assign(frame.data_ptr<uint8_t>() + header_at, frame.data_ptr<uint8_t>() + bytes);
      if (head.tensors > head.inline_tensors) {
        auto work = e.pg->irecv_views(1, feed::kFrameTag, head.tensors - head.inline_tensors);
        wait_work(k, e, work);
        std::vector<at::Tensor> sent = work->result();
        size_t next = 0;
        for (at::Tensor& t : item.tensors) {
          if (!t.defined()) t = std::move(sent.at(next++));
        }
      }
      return item;
    }
  }

  std::optional<TensorDict> next_td_from(int k) {
    std::optional<FeedItem> item = next_from(k);
    if (!item) return std::nullopt;
    const auto& h = item->header;
    uint32_t magic = 0;
    if (h.size() >= sizeof magic) std::memcpy(&magic, h.data(), sizeof magic);
    if (magic != feed::kTensorDictMagic || item->tensors.size() != 1 || item->tensors[0].scalar_type() != at::kByte ||
        item->tensors[0].dim() != 1 || !item->tensors[0].is_contiguous()) {
      throw TransportError("feed '" + name_ + "', producer " + std::to_string(k) +
                           ": the item was not put as a TensorDict (FeedProducer::put(TensorDict))");
    }
    const at::Tensor& storage = item->tensors[0];
    // A producer's items share a schema: the same header bytes decode once (the checks against
    // the storage's size are made again: total_bytes against this item's).
    End& e = end(k);
    if (!e.schema || h != e.schema_bytes) {
      e.schema = decode_schema(std::span<const uint8_t>(h.data() + sizeof magic, h.size() - sizeof magic));
      e.schema_bytes = h;
      e.fingerprint = schema_fingerprint(*e.schema);
    }
    if (e.schema->total_bytes > static_cast<uint64_t>(storage.numel())) {
      bad(k, "a schema of " + std::to_string(e.schema->total_bytes) + " bytes for a storage of " +
                 std::to_string(storage.numel()));
    }
    return detail::from_checked_consolidated(storage, *e.schema, e.fingerprint);  // decoded and checked above
  }

  std::optional<TensorDict> next() {
    const int n = static_cast<int>(ends_.size());
    for (int tried = 0; tried < n; ++tried) {
      const int k = cursor_;
      cursor_ = (cursor_ + 1) % n;
      if (std::optional<TensorDict> td = next_td_from(k)) return td;
    }
    return std::nullopt;
  }

  bool closed(int k) { return end(k).closed; }
  void watch(int k, pid_t pid) { end(k).pid = pid; }

  // Idempotent: a second call sweeps again (after the caller ended the producers' processes).
  // Also the group of each producer this consumer never joined: a producer that created it and
  // was killed before the consumer came (main raising a worker's error, then its exit ending the
  // workers) left it, and nobody else knows its name.
  void shutdown() noexcept {
    const bool first = !shut_;
    shut_ = true;
    for (End& e : ends_) leave(e);
    feed::sweep(joined_);
    std::vector<std::string> unjoined;
    try {
      for (size_t k = 0; k < ends_.size(); ++k) {
        const std::string n = feed::group_name(name_, static_cast<int>(k), ends_[k].gen);
        if (std::find(joined_.begin(), joined_.end(), n) == joined_.end()) unjoined.push_back(n);
      }
    } catch (...) {
      return;  // no memory for the names: what is left is gc's
    }
    // Once: a producer waiting to meet this consumer in its first group learns it will not.
    if (first) {
      for (const std::string& n : unjoined)
        feed::refuse_group(n, o_, feed::page_up(o_.first_heap_bytes), feed::kFirstTickets);
    }
    feed::sweep(unjoined);
  }

  int producers() const noexcept { return static_cast<int>(ends_.size()); }

 private:
  struct End {
    c10::intrusive_ptr<ProcessGroupShm> pg;
    uint32_t gen = 0;
    bool closed = false;
    pid_t pid = 0;
    std::optional<Schema> schema;  // the last TensorDict item's schema, and its header bytes
    std::vector<uint8_t> schema_bytes;
    uint64_t fingerprint = 0;  // schema_fingerprint(*schema)
  };

  End& end(int k) {
    if (k < 0 || k >= static_cast<int>(ends_.size())) {
      throw Error("FeedConsumer: producer " + std::to_string(k) + " is outside [0, " + std::to_string(ends_.size()) +
                  ")");
    }
    return ends_[static_cast<size_t>(k)];
  }

  c10::intrusive_ptr<ProcessGroupShm> join(int k, uint32_t gen, uint64_t heap, uint32_t tickets) {
    const pid_t pid = end(k).pid;
    joined_.push_back(feed::group_name(name_, k, gen));
    return feed::join_group(feed::group_name(name_, k, gen), 0, o_, heap, tickets, [pid, k] {
      const std::string why = feed::process_gone(pid);
      return why.empty() ? why : "producer " + std::to_string(k) + " (" + why + ")";
    });
  }

  at::Tensor wait_one(int k, End& e, const c10::intrusive_ptr<c10d::Work>& work) {
    wait_work(k, e, work);
    return work->result().at(0);
  }

  // Any failure of a wait leaves this producer's answers out of step (its receive is withdrawn,
  // or the group is lost): the producer counts as closed from then on.
  void wait_work(int k, End& e, const c10::intrusive_ptr<c10d::Work>& work) {
    try {
      feed::wait_in_slices(work, o_);
    } catch (...) {
      e.closed = true;
      leave(e);
      try {
        throw;
      } catch (const TimeoutError&) {
        throw TimeoutError("feed '" + name_ + "': producer " + std::to_string(k) + " sent nothing within " +
                           std::to_string(o_.timeout.count()) + " ms");
      } catch (const PeerLostError& lost) {
        throw PeerLostError("feed '" + name_ + "': producer " + std::to_string(k) + ": " + lost.what());
      }
    }
  }

  // The inline tensors of item frame `frame` (views of its bytes) into their places in `out`
  // (head.tensors of them); returns where the header starts. Each entry is checked before its
  // view is made: a frame that fails a check is a TransportError, and its item is dropped.
  uint64_t inline_tensors(int k, const at::Tensor& frame, const feed::FrameHead& head, std::vector<at::Tensor>& out) {
    const auto bytes = static_cast<uint64_t>(frame.numel());
    const uint8_t* const base = frame.data_ptr<uint8_t>();
    if (head.inline_tensors > head.tensors) {
      bad(k,
          "a frame of " + std::to_string(head.inline_tensors) + " inline tensors of " + std::to_string(head.tensors));
    }
    uint64_t at = sizeof head + uint64_t{head.inline_tensors} * sizeof(feed::InlineTensor);
    if (at > bytes) bad(k, "a frame of " + std::to_string(bytes) + " bytes for its inline tensors' table");
    int64_t last = -1;
    for (uint32_t i = 0; i < head.inline_tensors; ++i) {
      feed::InlineTensor e;
      std::memcpy(&e, base + sizeof head + i * sizeof e, sizeof e);
      const std::string which = "inline tensor " + std::to_string(i);
      if (static_cast<int64_t>(e.index) <= last || e.index >= head.tensors) {
        bad(k, which + " at place " + std::to_string(e.index) + " (after " + std::to_string(last) + ", of " +
                   std::to_string(head.tensors) + ")");
      }
      last = e.index;
      const auto dtype = static_cast<c10::ScalarType>(e.dtype);
      if (e.dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions) || dtype == c10::ScalarType::Undefined ||
          c10::isQIntType(dtype)) {
        bad(k, which + " of dtype " + std::to_string(e.dtype));
      }
      if (e.ndim > feed::kInlineDims) bad(k, which + " of " + std::to_string(e.ndim) + " dimensions");
      // numel x element size == bytes, without overflow, and the bytes within the frame.
      const uint64_t element = c10::elementSize(dtype);
      uint64_t numel = 1;
      for (uint8_t d = 0; d < e.ndim; ++d) {
        if (e.sizes[d] < 0) bad(k, which + " of a negative size");
        const auto size = static_cast<uint64_t>(e.sizes[d]);
        numel = size == 0 || numel <= bytes / size ? numel * size : bytes + 1;
      }
      if (numel > bytes || numel * element != e.bytes || e.bytes > bytes - at || feed::pad8(e.bytes) > bytes - at) {
        bad(k, which + " of " + std::to_string(e.bytes) + " bytes at byte " + std::to_string(at) + " of a frame of " +
                   std::to_string(bytes));
      }
      out[e.index] = detail::view_into(frame, at, dtype, at::IntArrayRef(e.sizes, e.ndim));
      at += feed::pad8(e.bytes);
    }
    return at;
  }

  [[noreturn]] void bad(int k, const std::string& what) {
    End& e = end(k);
    e.closed = true;
    leave(e);
    throw TransportError("feed '" + name_ + "': producer " + std::to_string(k) + " sent " + what);
  }

  static void leave(End& e) noexcept {
    if (e.pg) e.pg->shutdown();
    e.pg.reset();
  }

  std::string name_;
  FeedOptions o_;
  std::vector<End> ends_;
  int cursor_ = 0;
  bool shut_ = false;
  std::vector<std::string> joined_;  // every group this consumer joined or tried to (swept at the end)
};

}  // namespace detail

FeedConsumer::FeedConsumer(const std::string& name, int producers, FeedOptions options)
    : state_(std::make_unique<detail::FeedConsumerState>(name, producers, options)) {}
FeedConsumer::FeedConsumer(FeedConsumer&&) noexcept = default;
FeedConsumer& FeedConsumer::operator=(FeedConsumer&&) noexcept = default;
FeedConsumer::~FeedConsumer() = default;

std::optional<FeedItem> FeedConsumer::next_from(int k) { return state_->next_from(k); }
std::optional<TensorDict> FeedConsumer::next() { return state_->next(); }
std::optional<TensorDict> FeedConsumer::next_td_from(int k) { return state_->next_td_from(k); }
void FeedConsumer::watch(int k, pid_t pid) { state_->watch(k, pid); }
bool FeedConsumer::closed(int k) const { return state_->closed(k); }
void FeedConsumer::shutdown() noexcept { state_->shutdown(); }
int FeedConsumer::producers() const noexcept { return state_->producers(); }

}  // namespace tdshm
