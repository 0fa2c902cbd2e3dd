#pragma once
// The shared-memory transport's engine: one rank's attachment to a group, composed of parts. A
// ProcessGroupShm and its Work objects are thin c10d wrappers around it.
//  * the segment (segment.h): the mapped file of this incarnation, the rank table, liveness;
//  * the point-to-point channel (channel.h): sends, receives, early messages (the protocol);
//  * the collective steps (collective/steps.h), which ask the engine about its peers
//    (shm::StepPeers);
//  * waiting (waiter.h): every wait, point-to-point or collective, is one spin/yield/sleep loop.
// The engine's own jobs: the rendezvous (engine.cpp), the liveness checks and what fails when a
// peer is lost (engine_peers.cpp), point-to-point waits and the helper thread that completes
// futures (engine_wait.cpp). The locks, and what each guards, are listed with the fields at the
// end of the class.
//
// Wake-ups: a rank that sleeps announces it in its RankSlot::sleepers and sleeps on
// RankSlot::wake_seq; whoever makes progress possible for it (the channel, posting an entry to
// it or freeing an entry it writes to) bumps wake_seq and calls FUTEX_WAKE only when
// sleepers > 0, so a spinning peer costs no system call (the wake-up pair of waiter.h: no lost
// wake-up).

#include <tdshm/process_group.h>

#include "shm/collective/steps.h"
#include "shm/p2p/channel.h"
#include "shm/parts/light_mutex.h"
#include "shm/parts/wait_hook.h"
#include "shm/parts/waiter.h"
#include "shm/segment/segment.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

namespace tdshm::detail {

class ShmEngine : public std::enable_shared_from_this<ShmEngine>, private shm::StepPeers {
 public:
  ShmEngine(const std::string& name, int rank, int size, const ShmOptions& options);
  /// Calls shutdown() (and detaches the helper thread when it is the one destroying the engine).
  ~ShmEngine();
  /// Fails every pending op (with `reason`; null: "the process group was destroyed while this
  /// transfer was pending"), stops the helper thread and leaves the segment. Idempotent; later
  /// posts fail at once.
  void shutdown(std::exception_ptr reason = nullptr) noexcept;
  ShmEngine(const ShmEngine&) = delete;
  ShmEngine& operator=(const ShmEngine&) = delete;

  /// Posts a send of `tensor` and moves as much of it as fits now. Returns null when the send
  /// is already complete (the whole message is in the ring): there is nothing left to wait for.
  std::shared_ptr<ShmOp> post_send(const at::Tensor& tensor, int dst, int64_t tag, bool control,
                                   MessageCheck check = {});
  /// Posts a receive into `tensor` (src -1: any source) and takes a message that already arrived.
  /// Null when it completed as it was posted (its message was waiting, whole): the tensor holds it.
  std::shared_ptr<ShmOp> post_recv(const at::Tensor& tensor, int src, int64_t tag, bool control,
                                   MessageCheck check = {});
  /// A batch of the above to one peer (a per-leaf transfer): the same messages, in order, posted
  /// under one lock; a batch of sends wakes `dst` once. post_sends returns no ops at all when
  /// every send completed when posted, else one per tensor (null: that send is complete).
  OpList post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                    std::span<const MessageCheck> checks, bool control = false);
  OpList post_recvs(std::span<const at::Tensor> tensors, int src, std::span<const int64_t> tags,
                    std::span<const MessageCheck> checks, bool control = false);
  /// Posts a receive of whatever tensor comes from `src` with `tag` (ShmChannel::make_recv_view).
  std::shared_ptr<ShmOp> post_recv_view(int src, int64_t tag, MessageCheck check = {});
  /// A batch of the above from one peer (a tree's views): one op per tag, posted under one lock.
  OpList post_recv_views(int src, std::span<const int64_t> tags, std::span<const MessageCheck> checks);
  /// A loan of `sizes` and `dtype` from this rank's heap, waiting (progress, then sleep) until
  /// receivers give enough back; TimeoutError at `deadline`, SegmentError if it can never fit
  /// (ShapeError: a negative or huge shape).
  at::Tensor loan(c10::IntArrayRef sizes, c10::ScalarType dtype, std::chrono::steady_clock::time_point deadline);
  /// loan() without waiting or throwing for want of room: an undefined tensor when the heap has
  /// no room now (after one progress pass) or never will (larger than the heap). ShapeError for a
  /// bad shape; the channel's error once it is unusable.
  at::Tensor try_loan(c10::IntArrayRef sizes, c10::ScalarType dtype);
  /// Whether `t` lies wholly inside one live loan of this rank.
  bool is_loan(const at::Tensor& t) const;
  /// Whether this rank and `peer` both offer MemoryMappedTensor leaves by reference in
  /// init_remote (ShmOptions::memmap_by_reference, RankSlot::features).
  bool memmap_by_reference_with(int peer) const noexcept;
  /// Whether rank `peer` (this one included) runs tdshm's C++ transfers (ShmOptions::tdshm_transfers).
  bool runs_tdshm_transfers(int peer) const noexcept;
  /// Segment::rank_died for `peer` (false outside the group).
  bool rank_died(int peer) const;
  /// Whether rank `peer`'s slot has `feature` (a kRankFeature* bit) set.
  bool rank_offers(int peer, uint32_t feature) const noexcept;
  /// Moves everything pending until every op in `ops` (null ones count as done) is done (or failed), spinning then
  /// sleeping; throws TimeoutError at `deadline`, after withdrawing the ops that are not done
  /// (they fail with that error). Does not rethrow the ops' errors. With `stop_on_error` it also
  /// returns as soon as one op failed (the others may still be pending). With `keep_at_deadline`
  /// it returns at `deadline` instead, the ops left pending.
  void wait(std::span<const std::shared_ptr<ShmOp>> ops, std::chrono::steady_clock::time_point deadline,
            bool stop_on_error = false, bool keep_at_deadline = false);
  /// One non-blocking progress pass.
  void poll();
  /// Withdraws every op of `ops` that is not done (a send that started is left to finish); they
  /// fail with `error`.
  void cancel(std::span<const std::shared_ptr<ShmOp>> ops, const std::exception_ptr& error);
  /// Calls `on_done` (from a helper thread, or at once) when every op in `ops` is done; the
  /// helper thread moves progress meanwhile. Nothing escapes the helper thread: an exception from
  /// `on_done` or from progress is logged. The engine must be owned by a shared_ptr.
  void watch(std::vector<std::shared_ptr<ShmOp>> ops, std::function<void()> on_done);

  /// Adds `hook` to what every wait of this engine runs before it may block (wait_hook.h); the
  /// engine holds it until it is destroyed. At most kMaxWaitHooks, added while the group is
  /// built (waits that run meanwhile may miss the new hook, never read a torn one).
  void add_wait_hook(std::shared_ptr<shm::WaitHook> hook);
  /// Segment::unlink_name of this group's segment (once every rank has attached).
  void unlink_segment_name() noexcept;
  static constexpr int kMaxWaitHooks = 2;  // the group's collectives, and a world across hosts'

  /// The collective steps (collective/steps.h; the protocol is in engine/collectives.h), over this
  /// engine's segment, liveness and spin budget.
  shm::CollectiveSteps& steps() noexcept { return *steps_; }
  const shm::CollectiveSteps& steps() const noexcept { return *steps_; }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const ShmOptions& options() const noexcept { return options_; }
  const std::string& name() const noexcept { return name_; }

 private:
  struct OpWait;  // a point-to-point wait's hooks on the shared wait loop (engine_wait.cpp)
  struct Watch {
    std::vector<std::shared_ptr<ShmOp>> ops;
    std::function<void()> on_done;
  };

  // ---- Rendezvous and liveness (engine.cpp, engine_peers.cpp) ----
  void rendezvous(std::chrono::steady_clock::time_point deadline);
  void check_peers();                                                 // requires mu_
  void maybe_check_peers(std::chrono::steady_clock::time_point now);  // takes mu_ when a check is due

  // ---- Waiting (engine_wait.cpp, on waiter.h) ----
  void sleep_until_event(std::chrono::steady_clock::time_point until, bool drain_all = true);  // takes mu_
  std::chrono::steady_clock::time_point sleep_limit(std::chrono::steady_clock::time_point now,
                                                    std::chrono::steady_clock::time_point deadline) const override;
  [[noreturn]] void time_out(std::span<const std::shared_ptr<ShmOp>> ops);  // takes mu_
  bool waited_ranks_asleep(std::span<const std::shared_ptr<ShmOp>> ops) const;
  bool background_step();
  static void background_loop(std::weak_ptr<ShmEngine> weak);

  // ---- What the collective steps ask (shm::StepPeers; engine_peers.cpp) ----
  std::exception_ptr unusable() override;         // takes mu_
  std::exception_ptr lost(int awaited) override;  // takes mu_
  void check_due(std::chrono::steady_clock::time_point now) override { maybe_check_peers(now); }
  void before_wait() noexcept override {
    const int n = wait_hook_count_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) wait_hooks_[static_cast<size_t>(i)]->before_wait();
  }

  // Locks: the one place that lists every mutex of a ProcessGroupShm and how they nest. A
  // thread takes them only in this order (outer first), and sleeps in a wait holding none of
  // its group's but the steps' mutex (a collective's steps wait under it):
  //  1. a Work's future mutex (process_group_shm.cpp, queued_work.h), only to make its future;
  //     it then takes helper_.mu (watch) or the collective queue's mutex (on_done).
  //  2. the steps' mutex (steps().mutex()): a whole collective, by the thread that runs it (the
  //     queue's run mutex). Across hosts, ProcessGroupHosts' run mutex comes before it.
  //  3. the collective queue's mutex (process_group/collective_queue.h): never held while the
  //     queue's collective runs, taken inside one by its waits (before_wait urges the queue);
  //     never held with mu_.
  //  4. mu_: the channel, and the group's failure state; the StepPeers calls take it inside a
  //     collective. Taken on every message, so a LightMutex (one futex word, inline).
  //  5. the loan pool's mutex (loan_pool.h): under mu_ (the channel's loans) or alone (a loan
  //     made or dropped on any thread); innermost.
  // helper_.mu (the helper thread's list) is held with none of 2 to 5. Fields are grouped below
  // by what guards them.

  // Set in the constructor, then only read (any thread, no lock).
  std::string name_;
  int rank_;
  int size_;
  ShmOptions options_;
  std::unique_ptr<shm::Segment> segment_;
  std::shared_ptr<shm::LoanPool> loans_;  // the channel's (its own lock: loans come and go on any thread)

  // Under mu_: the point-to-point channel, which is also the group's failure state (closed,
  // poisoned, lost peers). Engaged once the segment is attached.
  LightMutex mu_;  // held on every message: one word, inline (light_mutex.h)
  std::optional<ShmChannel> channel_;
  std::vector<int> view_holders_;  // lost peers whose process runs: the loans they hold stay lent

  // Atomics, any thread, no lock (relaxed: hints, re-checked under mu_ where it matters).
  shm::SpinBudget spin_budget_;  // how long a waiter spins before it sleeps (waiter.h)
  std::atomic<std::chrono::steady_clock::rep> next_peer_check_{0};  // next liveness check, in ticks

  // The wait hooks (add_wait_hook): a slot is written once, before the count that publishes it.
  std::array<std::shared_ptr<shm::WaitHook>, kMaxWaitHooks> wait_hooks_;
  std::atomic<int> wait_hook_count_{0};

  // The collective steps; their state is under their own mutex (collective/steps.h).
  std::unique_ptr<shm::CollectiveSteps> steps_;

  // The helper thread that completes futures (watch()); its fields under its own mutex.
  struct Helper {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<Watch> watches;
    bool stopping = false;
    std::thread thread;
  };
  Helper helper_;
};

}  // namespace tdshm::detail
