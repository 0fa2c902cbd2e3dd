#pragma once
/// A feed: N producer processes hand items (TensorDicts, or a header and tensors) to one consumer
/// process of this host, in order and zero-copy, without the caller managing loans or tickets
/// (docs/loader.md, "The C++ core"). What a data loader is made of; tdshm.DataLoader is built on it.
///
/// - Each producer speaks to the consumer over its own private two-rank shm group
///   ("<name>-<producer>-g<generation>"); nothing touches the user's default group.
/// - The producer's loan heap is sized from its first item (FeedOptions::items_in_heap of them);
///   an item that later outgrows it opens a bigger group (the next generation), announced in-band.
/// - A tensor already in the producer's heap (FeedProducer::loan, try_loan) goes by reference; one
///   of at most 4 KiB inside the item's frame (a loan, or a message of its own, costs more); any
///   other is copied into the heap once; when the consumer holds the whole heap, by value. The
///   consumer receives views: their bytes go back when the last reference is dropped, so items
///   may be held as long as the user likes (later ones then travel by value), never overwritten.
/// - Failures: a producer that dies is a PeerLostError naming it (within the transport's peer
///   check, ~0.1 s); the consumer's wait ends with a TimeoutError after FeedOptions::timeout; a
///   producer's wait for the consumer ends with a PeerLostError once FeedOptions::watch_pid is gone.
///   A producer's close() ends its items (next() then skips it); the segments go with the last
///   rank that leaves them, or with the processes.

#include <tdshm/tensordict.h>

#include <ATen/core/Tensor.h>

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace tdshm {

namespace detail {
class FeedProducerState;
class FeedConsumerState;
struct HeapAllocationsState;
}  // namespace detail

struct FeedOptions {
  /// The consumer's wait for one item, and either side's wait for the other to join a group;
  /// zero: forever (torch's DataLoader timeout=0). Past it: TimeoutError.
  std::chrono::milliseconds timeout{0};
  /// How many items of the first one's size a producer's heap holds: the items in flight plus
  /// those the consumer keeps. Loan tickets follow (two per leaf of each).
  uint32_t items_in_heap = 6;
  /// A producer whose heap is full waits this long for the consumer to give a loan back before it
  /// sends by value (once such a wait runs out, it sends by value without waiting until a loan
  /// comes back: a consumer that keeps its items never slows its producers down for long).
  std::chrono::milliseconds room_wait{20};
  /// The share of /dev/shm's size one producer's group may take when its heap grows (both ranks'
  /// heaps and the rest of the segment): 1/N for N producers on a small /dev/shm (Docker's 64 MiB).
  /// A heap never grows past what /dev/shm has free; items that no heap holds twice go by value.
  double shm_share = 1.0;
  /// A producer's heap when it has no item yet (its first answer carries no tensors), in bytes.
  size_t first_heap_bytes = size_t{1} << 20;
  /// How long a wait spins before it sleeps (yielding its CPU as it spins; the group's spin
  /// budget shortens it for waits that keep running longer). A producer ahead of its consumer
  /// waits for room at every item once its heap is full: asleep, it cost the consumer a wake-up
  /// at every loan it gave back (the bench's feed, 4 producers: 46-53k items/s with 20 us, 57-58k
  /// with 250 us, the hand-written loans loop's rate).
  std::chrono::microseconds spin{250};
  /// Called every 100 ms or so while a side waits (for an item, room), every 20 ms (+2 ms a MiB
  /// of heap) while a producer waits for the consumer to join, and before it joins; what it throws
  /// ends the wait (for Python: KeyboardInterrupt on Ctrl-C); a receive it ends is withdrawn,
  /// and that producer counts as closed (its items would be out of step).
  std::function<void()> check{};
  /// Producer side: the consumer's process; a producer waiting for it gives up (PeerLostError)
  /// once it is gone. 0: not watched (the timeout alone bounds the wait).
  pid_t watch_pid = 0;
};

/// One item as it travels: the producer's header bytes (opaque to the feed) and its tensors, in
/// order. On the consumer's side the tensors are views of the producer's loans, or fresh tensors.
struct FeedItem {
  std::vector<uint8_t> header;
  std::vector<at::Tensor> tensors;
};

/// A producer's end: producer `index` (0-based) of the feed `name`.
class FeedProducer {
 public:
  /// Nothing is created yet: the group opens with the first put, sized from it.
  FeedProducer(const std::string& name, int index, FeedOptions options = {});
  FeedProducer(FeedProducer&&) noexcept;
  FeedProducer& operator=(FeedProducer&&) noexcept;
  /// Leaves the group without ending the feed (the consumer then sees this producer as lost when
  /// it waits for more): call close() first for an orderly end.
  ~FeedProducer();

  /// A tensor in this producer's heap (fill it, then put it: it goes by reference), or an
  /// undefined tensor when there is no heap yet (before the first put) or no room now.
  at::Tensor try_loan(at::IntArrayRef sizes, at::ScalarType dtype);
  /// A consolidated tensordict like `like` whose storage is one loan (try_loan's rules), or
  /// nullopt; put() sends it as one reference.
  std::optional<TensorDict> try_loan(const TensorDict& like);
  /// Whether `t` lies in a live loan of this producer's current group.
  bool is_loan(const at::Tensor& t) const;

  /// While alive, the tensors that torch allocates on the calling thread, of at least
  /// `min_bytes`, are carved out of this producer's heap when it has room (and its not-yet-freed
  /// ones hold at most half of it): the producer's own code (a dataset making a batch) writes
  /// straight into shared memory, and put() sends such a tensor by reference, no copy. Any other
  /// allocation, and every one before the first put (no heap yet), is torch's ordinary one.
  /// Such a tensor behaves as any other; a put of it lends its bytes (do not write into it until
  /// the consumer dropped it, as with any loan). Scopes nest; end one on the thread that opened
  /// it, before the producer goes. A child forked inside the scope allocates as usual.
  class HeapAllocations {
   public:
    HeapAllocations(FeedProducer& producer, size_t min_bytes = size_t{64} << 10);
    HeapAllocations(const HeapAllocations&) = delete;
    HeapAllocations& operator=(const HeapAllocations&) = delete;
    ~HeapAllocations();
    /// Ends the scope now (the destructor's work; once).
    void end() noexcept;
    /// False when torch kept another CPU allocator (one registered with a higher priority): no
    /// allocation is redirected then.
    bool active() const noexcept { return active_; }

   private:
    std::unique_ptr<detail::HeapAllocationsState> state_;
    bool active_ = false;
  };

  /// Hands the next item to the consumer: `header` by value, each tensor by reference when it is
  /// a loan, inside the item's frame when it holds at most 4 KiB, else copied into a loan (or
  /// sent by value when the heap is held); all of them as one batch of messages. Returns once every
  /// byte sent by value is in the segment; a loan stays lent until the consumer drops its view.
  /// Waits for the consumer to join (FeedOptions::timeout / watch_pid); PeerLostError once the
  /// consumer left or died; TypeError for a tensor that is not a dense CPU tensor.
  void put(std::span<const uint8_t> header, const std::vector<at::Tensor>& tensors);
  /// A tensordict as one item: consolidated, one reference when `td` came from try_loan(like),
  /// else copied once into a loan. The consumer's next() rebuilds it (keys, batch size,
  /// non-tensor values, tensorclass names) over a view.
  void put(const TensorDict& td);
  /// Ends this producer's items: the consumer's next_from returns nullopt for it from then on.
  void close();
  /// Items put so far.
  uint64_t items() const noexcept;
  /// The group generation (0 first; +1 each time the heap grew).
  uint32_t generation() const noexcept;

 private:
  std::unique_ptr<detail::FeedProducerState> state_;
};

/// The consumer's end of the feed `name` with `producers` producers.
class FeedConsumer {
 public:
  /// Nothing is joined yet: producer k's group is joined when its first item is asked for.
  FeedConsumer(const std::string& name, int producers, FeedOptions options = {});
  FeedConsumer(FeedConsumer&&) noexcept;
  FeedConsumer& operator=(FeedConsumer&&) noexcept;
  /// Leaves every group: producers waiting on this consumer fail with PeerLostError; views
  /// already received stay readable.
  ~FeedConsumer();

  /// The next item of producer `k` (nullopt once it closed). PeerLostError when it died or left
  /// without closing; TimeoutError after FeedOptions::timeout (the feed of that producer is then
  /// unusable: its answers would be out of step); TransportError for a malformed frame.
  std::optional<FeedItem> next_from(int k);
  /// The next tensordict, in order: producer 0, 1, ..., N-1, 0, ... skipping producers that
  /// closed; nullopt once all did. Its tensors are views of the producer's loan (held until
  /// dropped). TransportError when an item was not put as a TensorDict.
  std::optional<TensorDict> next();
  /// Producer `k`'s items as a TensorDict (next_from + rebuild).
  std::optional<TensorDict> next_td_from(int k);
  /// Watches producer `k`'s process while the consumer waits for it to join its group: once it is
  /// gone, the wait ends with a PeerLostError naming it (once joined, the transport sees it).
  void watch(int k, pid_t pid);
  /// Whether producer `k` closed.
  bool closed(int k) const;
  /// Leaves every group now (the destructor's work), and removes those whose producer died
  /// without leaving; later calls fail. A producer waiting for this consumer in a group it never
  /// joined is refused (its wait ends at once: its put fails, or it tries again after its
  /// FeedOptions::check). Call it again once the producers' processes ended to remove what the
  /// last of them left.
  void shutdown() noexcept;
  int producers() const noexcept;

 private:
  std::unique_ptr<detail::FeedConsumerState> state_;
};

}  // namespace tdshm
