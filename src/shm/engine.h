#pragma once
// The shared-memory transport's engine: process-local state of a ProcessGroupShm (posted
// operations, messages that arrived early, ring positions) and the progress and wait loops.
// ProcessGroupShm and its Work objects are thin c10d wrappers around it. It composes the
// segment's parts, each in its own header: the SPSC metadata ring (ring.h), the slot arena
// (arena.h), the matching of receives with messages (matcher.h), the early-message buffers
// (buffer_pool.h), the futex words (futex.h). Its own code
// is split by job: engine.cpp (construction, posting, progress), engine_receive.cpp (matching
// and landing incoming messages), engine_peers.cpp (liveness), engine_wait.cpp (point-to-point
// waits, wake-ups, the helper thread); engine_internal.h holds what they share. The collective
// windows' steps are a part of their own (collective_steps.h), which the engine owns and answers
// for liveness (shm::StepPeers). Every wait, point-to-point or collective, is one loop
// (waiter.h). The locks and what each guards are listed with the fields, at the end of the class.
//
// Protocol (one SPSC metadata ring per ordered pair of ranks, one slot region per rank, see
// segment_layout.h):
//  * A message is one or more entries: the first carries tag, total size, dtype and shape; each
//    carries up to slot_bytes of payload, inline in the entry when it fits in 72 bytes, else in
//    an arena slot of the sender handed to the receiver. The producer fills the slot and the
//    entry, then stores the entry's seq (release); the consumer polls that seq (acquire), copies
//    the payload out, frees the slot, then advances the ring's tail (release), which frees the
//    entry for the producer.
//  * A tree's leaves (post_sends / post_recvs) are posted under one lock and the receiver is
//    woken once; a receiver wakes a sleeping sender once a quarter of its room is back.
//  * A contiguous tensor that views a named MemoryMappedTensor is sent as a reference (file,
//    offset; kEntryReference): the receiver copies straight from the file into its tensor, or
//    nothing at all when its tensor maps the same bytes. An anonymous memmap goes by value.
//  * A message that matches a posted recv is copied straight into the receiver's tensor. One that
//    matches nothing yet is copied into process memory ("unexpected", as in MPI) so that the
//    ring keeps moving: two ranks that both send before receiving cannot deadlock. Those copies
//    are bounded by ShmOptions::max_unexpected_bytes: a message that does not fit the budget
//    stays in the ring (its sender waits: back-pressure) until its recv is posted. A spinning
//    waiter makes no such copy for a source it posted nothing for (progress_locked's drain_all):
//    a data loader's main rank takes each worker's batch straight from the slots.
//  * Every entry is read once into a local copy and validated (validate.h) before any of its
//    values is used: a peer that rewrites an entry after publishing it cannot move a copy out of
//    bounds. A malformed entry fails that pair's transfers (TransportError); the rings are never
//    reset (a ring belongs to one incarnation of the group, see segment_layout.h).
//  * A wait that times out withdraws its receives (and sends that have not started), so a late
//    message never lands in a receive its caller gave up on.
//  * Wake-ups: a rank that sleeps announces it in its RankSlot::sleepers and sleeps on
//    RankSlot::wake_seq; whoever makes progress possible for it (posts an entry to it, or frees
//    an entry it writes to) bumps wake_seq and calls FUTEX_WAKE only when sleepers > 0, so a
//    spinning peer costs no system call (the wake-up pair of waiter.h: no lost wake-up).

#include <tdshm/process_group.h>

#include "shm/arena.h"
#include "shm/buffer_pool.h"
#include "shm/collective_steps.h"
#include "shm/matcher.h"
#include "shm/ring.h"
#include "shm/segment.h"
#include "shm/validate.h"
#include "shm/waiter.h"

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace tdshm::detail {

/// One posted send or receive. Fields after `done` are written under the engine's mutex before
/// `done` is stored (release); a thread that loads done == true (acquire) may read them.
struct ShmOp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = -1;  // destination of a send; source of a recv, -1 for any source
  int64_t tag = 0;
  bool control = false;  // a collective's message: matched apart from user tags
  MessageCheck check;    // what the transfer layer knows of the message (first entry's `check`)
  uint16_t sender_leaves = 0;  // recv failed on a leaf count: the message's (else 0)
  at::Tensor user;       // the caller's tensor
  at::Tensor buffer;     // contiguous bytes: `user` itself or a staging copy
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  std::string reference;      // send of a named memmap: the MemmapReference payload sent instead of the bytes
  uint64_t posted = 0;        // send: payload bytes written to the ring
  bool started = false;       // send: first entry written
  std::atomic<bool> done{false};
  std::exception_ptr error;
  int source = -1;  // recv: the rank the message came from
  std::string what() const;   // "recv from rank 1, tag 3" for messages
};

struct Incoming;

/// Ops of one call: a tree's leaves are few, so they stay inline (no allocation per transfer).
using OpList = c10::SmallVector<std::shared_ptr<ShmOp>, 4>;

class ShmEngine : public std::enable_shared_from_this<ShmEngine>, private shm::StepPeers {
 public:
  ShmEngine(const std::string& name, int rank, int size, const ShmOptions& options);
  /// Calls shutdown() (and detaches the helper thread when it is the one destroying the engine).
  ~ShmEngine();
  /// Fails every pending op, stops the helper thread and leaves the segment. Idempotent; later
  /// posts fail at once.
  void shutdown() noexcept;
  ShmEngine(const ShmEngine&) = delete;
  ShmEngine& operator=(const ShmEngine&) = delete;

  /// Posts a send of `tensor` and moves as much of it as fits now. Returns null when the send
  /// is already complete (the whole message is in the ring): there is nothing left to wait for.
  std::shared_ptr<ShmOp> post_send(const at::Tensor& tensor, int dst, int64_t tag, bool control,
                                   MessageCheck check = {});
  /// Posts a receive into `tensor` (src -1: any source) and takes a message that already arrived.
  std::shared_ptr<ShmOp> post_recv(const at::Tensor& tensor, int src, int64_t tag, bool control,
                                   MessageCheck check = {});
  /// A batch of the above to one peer (a per-leaf transfer): the same messages, in order, posted
  /// under one lock; a batch of sends wakes `dst` once. post_sends returns no ops at all when
  /// every send completed when posted, else one per tensor (null: that send is complete).
  OpList post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                    std::span<const MessageCheck> checks, bool control = false);
  OpList post_recvs(std::span<const at::Tensor> tensors, int src, std::span<const int64_t> tags,
                    std::span<const MessageCheck> checks, bool control = false);
  /// Moves everything pending until every op in `ops` (null ones count as done) is done (or failed), spinning then
  /// sleeping; throws TimeoutError at `deadline`, after withdrawing the ops that are not done
  /// (they fail with that error). Does not rethrow the ops' errors. With `stop_on_error` it also
  /// returns as soon as one op failed (the others may still be pending).
  void wait(std::span<const std::shared_ptr<ShmOp>> ops, std::chrono::steady_clock::time_point deadline,
            bool stop_on_error = false);
  /// One non-blocking progress pass.
  void poll();
  /// Withdraws every op of `ops` that is not done (a send that started is left to finish); they
  /// fail with `error`.
  void cancel(std::span<const std::shared_ptr<ShmOp>> ops, const std::exception_ptr& error);
  /// Calls `on_done` (from a helper thread, or at once) when every op in `ops` is done; the
  /// helper thread moves progress meanwhile. Nothing escapes the helper thread: an exception from
  /// `on_done` or from progress is logged. The engine must be owned by a shared_ptr.
  void watch(std::vector<std::shared_ptr<ShmOp>> ops, std::function<void()> on_done);

  /// The collective steps (collective_steps.h; the protocol is in collective.h), over this
  /// engine's segment, liveness and spin budget.
  shm::CollectiveSteps& steps() noexcept { return *steps_; }
  const shm::CollectiveSteps& steps() const noexcept { return *steps_; }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const ShmOptions& options() const noexcept { return options_; }
  const std::string& name() const noexcept { return name_; }

 private:
  struct Watch {
    std::vector<std::shared_ptr<ShmOp>> ops;
    std::function<void()> on_done;
  };
  // What one progress pass over a source's ring carries from entry to entry.
  struct ReceivePass {
    // Without it, a message that no posted receive can take stays in its ring while no receive
    // from its source is posted at all (see start_message): a spinning waiter does not copy other
    // peers' messages into process memory just before their receives are posted. Passes that
    // precede a sleep, polls and the helper thread drain everything, so two ranks that both send
    // first still cannot deadlock.
    bool drain_all = true;
    // A posted receive completed in this pass: a message with no receive posted stays in the ring.
    bool completed_posted = false;
  };

  // ---- Point-to-point (engine.cpp, engine_receive.cpp); all require mu_ ----
  bool progress_locked(bool drain_all = true);  // true if anything moved
  bool progress_sends(int dst, bool wake = true);
  bool post_recv_locked(const std::shared_ptr<ShmOp>& op, int src);
  bool write_entry(int dst, uint32_t flags, int64_t tag, const at::Tensor& whole, const uint8_t* chunk_data,
                   uint64_t offset, uint64_t chunk, MessageCheck check = {});
  bool progress_receives(int src, bool drain_all);
  enum class Taken { kYes, kHeld };  // kHeld: the entry stays in the ring (over the unexpected budget)
  Taken handle_entry(int src, const shm::EntryFields& e, const uint8_t* payload, const shm::EntryShape& shape,
                     ReceivePass& pass);
  bool start_message(int src, const shm::EntryFields& e, const int64_t* dims, const ReceivePass& pass);
  void release_unexpected(Incoming& msg);
  std::exception_ptr resolve_reference(const ShmOp& op, const shm::ReferenceFields& ref) const;
  bool try_match(const std::shared_ptr<Incoming>& msg, const std::shared_ptr<ShmOp>& op);
  void finish(const std::shared_ptr<ShmOp>& op, std::exception_ptr error);
  void withdraw(const std::shared_ptr<ShmOp>& op, const std::exception_ptr& error);

  // ---- Liveness (engine_peers.cpp); all but maybe_check_peers require mu_ ----
  void fail_peer(int peer, std::exception_ptr error);
  void fail_pending(const std::exception_ptr& error);
  void fail_all(const std::exception_ptr& error);
  bool check_poisoned();
  void check_peers();
  void maybe_check_peers(std::chrono::steady_clock::time_point now);  // takes mu_ when a check is due
  void rendezvous(std::chrono::steady_clock::time_point deadline);

  // ---- Waiting (engine_wait.cpp, on waiter.h); none requires a lock ----
  void notify(int r);
  void sleep_until_event(std::chrono::steady_clock::time_point until, bool drain_all = true);  // takes mu_
  std::chrono::steady_clock::time_point sleep_limit(std::chrono::steady_clock::time_point now,
                                                    std::chrono::steady_clock::time_point deadline) const override;
  [[noreturn]] void time_out(std::span<const std::shared_ptr<ShmOp>> ops);  // takes mu_
  bool waited_ranks_asleep(std::span<const std::shared_ptr<ShmOp>> ops) const;
  bool background_step();
  static void background_loop(std::weak_ptr<ShmEngine> weak);

  // ---- What the collective steps ask (shm::StepPeers; engine_peers.cpp, engine_wait.cpp) ----
  std::exception_ptr unusable() override;           // takes mu_
  std::exception_ptr lost(int awaited) override;    // takes mu_
  void check_due(std::chrono::steady_clock::time_point now) override { maybe_check_peers(now); }

  // Locks. Three mutexes, never more than two held, always in this order: the steps' mutex (a
  // whole collective, taken by its caller: steps().mutex()) before mu_ (point-to-point state,
  // taken by the StepPeers calls); watch_mu_ (the helper thread's list) is never held with
  // another. Fields are grouped below by what guards them.

  // Set in the constructor, then only read (any thread, no lock).
  std::string name_;
  int rank_;
  int size_;
  ShmOptions options_;
  std::unique_ptr<shm::Segment> segment_;
  std::vector<shm::RegionView> regions_;  // per rank: its arena region
  uint32_t wake_batch_ = 1;               // wake a source after this many entries (progress_receives)

  // Under mu_: point-to-point state and the group's failure state.
  std::mutex mu_;
  std::vector<std::deque<std::shared_ptr<ShmOp>>> send_queues_;  // per destination, FIFO
  std::vector<shm::RingProducer> tx_;                            // per destination: its ring's producer end
  std::vector<shm::RingConsumer> rx_;                            // per source: its ring's consumer end
  shm::SlotAllocator slots_;                                     // this rank's own region
  std::vector<std::shared_ptr<Incoming>> current_;               // per source: message being received
  std::vector<std::shared_ptr<Incoming>> spare_;                 // per source: a finished one, for reuse
  shm::Matcher<ShmOp, Incoming> matcher_;                        // unmatched receives and early messages
  std::vector<std::exception_ptr> peer_error_;                   // per peer: set once it is lost
  std::vector<uint64_t> held_bytes_;  // per source: size of a first entry left in the ring (budget), else 0
  std::vector<uint32_t> consumed_since_wake_;  // per source: entries taken since it was last woken
  uint64_t unexpected_bytes_ = 0;     // process memory held by unexpected messages
  shm::BufferPool unexpected_pool_;   // their buffers, kept for reuse (buffer_pool.h)
  std::exception_ptr shut_down_;      // set by shutdown(): the error of later posts
  std::exception_ptr poisoned_;       // set once the segment's mapping was lost (bus_guard.h)

  // Atomics, any thread, no lock (relaxed: hints, re-checked under mu_ where it matters).
  shm::SpinBudget spin_budget_;  // how long a waiter spins before it sleeps (waiter.h)
  std::atomic<std::chrono::steady_clock::rep> next_peer_check_{0};  // next liveness check, in ticks

  // The collective steps; their state is under their own mutex (collective_steps.h).
  std::unique_ptr<shm::CollectiveSteps> steps_;

  // Under watch_mu_: the helper thread that completes futures (watch()).
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::vector<Watch> watches_;
  bool stopping_ = false;
  std::thread background_;
};

}  // namespace tdshm::detail
