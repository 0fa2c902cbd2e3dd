#pragma once
// The order and the thread in which one process group's collectives run. A collective is issued
// (submit) and returns at once; it runs later, in issue order, one at a time, on one of two
// threads:
//  * the thread that waits for it (wait): it runs every collective issued before it that no
//    thread has started, then its own. A blocking collective (issue, then wait at once) thus
//    runs in its caller's thread, as if it had never been queued: no hand-off, no system call;
//  * the queue's helper thread, for a collective nobody waits for: it starts what was issued
//    more than kGrace ago, or at once when urged (urge). The queue is its group's wait hook
//    (shm/parts/wait_hook.h): every wait of the group's transport that may block urges it first, so a
//    rank that issued a collective asynchronously and then waits for a message a peer sends only
//    after that collective never deadlocks; kGrace covers a caller busy outside the group (in
//    another group's wait, or outside tdshm).
// The helper thread starts with the first collective, checks the queue every kGrace while
// collectives are issued, and sleeps without a timeout once none was issued for kIdleAfter
// (the next submit wakes it). Torch-free: a collective is a function of its deadline.

#include "shm/parts/wait_hook.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace tdshm::detail {

class CollectiveQueue;

/// One collective issued to a CollectiveQueue. Its owner's object (a c10d Work) derives from it,
/// holds the body and counts the references: the queue holds one while it is queued or running,
/// so issuing a collective allocates nothing beyond that object.
class QueuedCollective {
 public:
  using Clock = std::chrono::steady_clock;

  explicit QueuedCollective(std::chrono::milliseconds limit) noexcept : limit_(limit) {}
  QueuedCollective(const QueuedCollective&) = delete;
  QueuedCollective& operator=(const QueuedCollective&) = delete;
  /// Whether it ran (or was failed without running); error() is then final.
  bool done() const noexcept { return state_.load(std::memory_order_acquire) == kDone; }
  /// What it failed with (null: it succeeded). Only once done().
  const std::exception_ptr& error() const noexcept { return error_; }

 protected:
  virtual ~QueuedCollective() = default;

 private:
  friend class CollectiveQueue;
  enum State : int { kQueued, kRunning, kDone };

  virtual void run(Clock::time_point deadline) = 0;
  virtual void drop_body() noexcept = 0;  // releases what the body holds (tensors)
  virtual void retain() noexcept = 0;     // the queue's reference
  virtual void release() noexcept = 0;

  std::chrono::milliseconds limit_;  // its deadline is this long after it starts
  Clock::time_point seen_{};         // when the helper thread first saw it queued (under the queue's mutex)
  std::atomic<int> state_{kQueued};
  std::exception_ptr error_;
  std::atomic<bool> has_callbacks_{false};
  std::vector<std::function<void()>> on_done_;  // under the queue's mutex
};

class CollectiveQueue final : public shm::WaitHook, public std::enable_shared_from_this<CollectiveQueue> {
 public:
  using Clock = QueuedCollective::Clock;
  /// How long a collective the helper thread finds queued waits for its caller before the helper
  /// starts it (so 10 to 20 ms after it was issued: no clock is read when one is issued); also
  /// how often the helper looks while collectives are issued (1 ms cost blocking collectives of
  /// oversubscribed ranks a third of their speed, docs/transport.md).
  static constexpr std::chrono::microseconds kGrace{10000};
  /// How long after the last submit the helper thread stops checking every kGrace.
  static constexpr std::chrono::milliseconds kIdleAfter{100};

  /// `name` names the group in log lines; `run_mutex` (the collective steps' mutex) is held while
  /// a collective runs. Owned by a shared_ptr (the helper thread holds it while it works), and
  /// close()d by its owner before it lets go.
  CollectiveQueue(std::string name, std::mutex& run_mutex);
  /// close()s with a generic error.
  ~CollectiveQueue();
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  /// Issues `c` (the queue holds a reference until it ran or failed); throws the close() error
  /// once the queue is closed.
  void push(QueuedCollective& c);
  /// Until `c` is done (true): runs in this thread what was issued up to and including `c` that
  /// nobody started, and waits for what another thread runs. A collective whose deadline could
  /// fall after `until` is left to the helper thread (urged); once `until` passed, returns false
  /// (`c` goes on). Does not rethrow c's error.
  bool wait(const QueuedCollective& c, std::optional<Clock::time_point> until = std::nullopt);
  /// Withdraws `c` if no thread started it: it fails with `error` (true). False when it runs or ran.
  bool cancel(QueuedCollective& c, std::exception_ptr error);
  /// Calls `fn` once `c` is done: at once if it is, else from the thread that finishes it.
  void on_done(QueuedCollective& c, std::function<void()> fn);
  /// Asks the helper thread to start what is queued now (a thread is about to wait on a result
  /// that may need it). One relaxed load when nothing is queued.
  void urge() noexcept;
  /// The group's transport is about to wait: urge().
  void before_wait() noexcept override { urge(); }
  /// Fails every collective not started with `error`, waits for the one running, ends the helper
  /// thread; later submits throw `error`. Idempotent.
  void close(std::exception_ptr error) noexcept;

 private:
  void run_one(std::unique_lock<std::mutex>& lk);  // requires mu_, a head, none running; returns unlocked
  void settle(QueuedCollective& c, std::exception_ptr error, bool ran);  // without mu_
  void call_back(QueuedCollective& c);  // without mu_: takes c's callbacks and calls them
  bool helper_round();
  void start_helper();  // requires mu_

  const std::string name_;
  std::mutex& run_mutex_;
  std::mutex mu_;                         // never held while a collective runs
  std::condition_variable done_cv_;       // a collective finished (waiters_ > 0)
  std::deque<QueuedCollective*> queued_;  // each holds a reference (retain)
  std::atomic<size_t> unstarted_{0};      // queued_.size(), for urge() to read without mu_
  // A collective runs. Set under mu_; cleared without it by whoever ran it, who then looks at
  // waiters_ and helper_.waits_running (seq_cst on both sides: a thread that counts itself as a
  // waiter and then sees running_ set is woken), so that a blocking collective takes mu_ once.
  std::atomic<bool> running_{false};
  std::atomic<int> waiters_{0};  // threads on done_cv_
  bool urged_ = false;
  std::exception_ptr closed_;
  uint64_t submits_ = 0;  // collectives issued, ever
  // The helper thread, which runs what nobody waits for; its fields under mu_ but `waits_running`.
  struct Helper {
    std::condition_variable cv;              // something for it
    std::atomic<bool> waits_running{false};  // it waits for running_ to clear
    bool idle = false;                       // it sleeps without a timeout: a submit must wake it
    bool busy = false;                       // it runs a collective: urge() need not wake it
    uint64_t submits_seen = 0;               // submits_ at its last round
    Clock::time_point last_activity{};       // its round that saw submits_ change
    std::thread thread;
  };
  Helper helper_;
};

}  // namespace tdshm::detail
