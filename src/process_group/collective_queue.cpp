// CollectiveQueue: a group's collectives in issue order, run by their waiter or by a helper
// thread (collective_queue.h).

#include "process_group/collective_queue.h"

#include "common/log.h"

#include <tdshm/errors.h>

#include <algorithm>

namespace tdshm::detail {

CollectiveQueue::CollectiveQueue(std::string name, std::mutex& run_mutex)
    : name_(std::move(name)), run_mutex_(run_mutex) {}

CollectiveQueue::~CollectiveQueue() {
  close(std::make_exception_ptr(Error("the process group was destroyed before this collective ran")));
}

void CollectiveQueue::push(QueuedCollective& c) {
  bool wake = false;
  {
    std::lock_guard lk(mu_);
    if (closed_) std::rethrow_exception(closed_);
    ++submits_;  // no clock read here: the helper thread stamps what it finds (seen_)
    c.retain();
    queued_.push_back(&c);
    unstarted_.fetch_add(1, std::memory_order_relaxed);
    if (!helper_.thread.joinable()) start_helper();
    wake = helper_.idle;
  }
  // Only an idle helper is woken: one checking every kGrace finds the collective itself, so a
  // stream of blocking collectives costs no system call here.
  if (wake) helper_.cv.notify_one();
}

// Starts the head (lk held, nothing running) and returns with lk released.
void CollectiveQueue::run_one(std::unique_lock<std::mutex>& lk) {
  QueuedCollective* c = queued_.front();  // with the queue's reference, released below
  queued_.pop_front();
  unstarted_.fetch_sub(1, std::memory_order_relaxed);
  running_.store(true, std::memory_order_relaxed);  // read under mu_, or seq_cst after a waiter counted itself
  c->state_.store(QueuedCollective::kRunning, std::memory_order_relaxed);
  lk.unlock();
  std::exception_ptr error;
  try {
    std::lock_guard run(run_mutex_);
    c->run(Clock::now() + c->limit_);
  } catch (...) {
    error = std::current_exception();
  }
  c->drop_body();  // what it holds (tensors) is released by whoever ran it
  settle(*c, std::move(error), true);
  c->release();
}

// Makes `c` done (and, when it ran, the queue free to run the next); wakes whoever waits for
// that and calls c's callbacks. Without mu_: the blocking path takes no lock here.
void CollectiveQueue::settle(QueuedCollective& c, std::exception_ptr error, bool ran) {
  c.error_ = std::move(error);
  c.state_.store(QueuedCollective::kDone, std::memory_order_release);
  if (ran) running_.store(false, std::memory_order_relaxed);
  // One fence orders both stores before the loads below (the waiters' side: count, fence, check).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const bool helper = ran && helper_.waits_running.load(std::memory_order_relaxed);
  if (helper || waiters_.load(std::memory_order_relaxed) > 0) {
    // A waiter counted itself, then checks under mu_ and sleeps: taking mu_ here orders this
    // wake-up after its check.
    { std::lock_guard lk(mu_); }
    done_cv_.notify_all();
    if (helper) helper_.cv.notify_one();
  }
  if (c.has_callbacks_.load(std::memory_order_relaxed)) call_back(c);  // after the fence
}

void CollectiveQueue::call_back(QueuedCollective& c) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard lk(mu_);
    callbacks.swap(c.on_done_);
  }
  for (auto& fn : callbacks) {
    try {
      fn();
    } catch (const std::exception& e) {
      log().error("group '{}': a collective's completion callback threw: {}", name_, e.what());
    } catch (...) {
      log().error("group '{}': a collective's completion callback threw", name_);
    }
  }
}

bool CollectiveQueue::wait(const QueuedCollective& c, std::optional<Clock::time_point> until) {
  if (c.done()) return true;
  std::unique_lock lk(mu_);
  for (;;) {
    if (c.done()) return true;
    // c or one issued before it: run it here, unless its deadline could fall after `until` (a
    // run cannot stop early: the helper thread runs it then, and this thread only waits).
    if (!running_.load(std::memory_order_relaxed) && !queued_.empty()) {
      if (!until || Clock::now() + queued_.front()->limit_ <= *until) {
        run_one(lk);
        if (c.done()) return true;
        lk.lock();
        continue;
      }
      urged_ = true;
      if (!helper_.busy) helper_.cv.notify_one();
    }
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // before the checks below (settle's Dekker pair)
    // Without `until`: until c is done or the queue is free to run the next one here.
    auto ready = [&] { return c.done() || (!until && !running_.load(std::memory_order_seq_cst)); };
    if (until) {
      done_cv_.wait_until(lk, *until, ready);
    } else {
      done_cv_.wait(lk, ready);
    }
    waiters_.fetch_sub(1, std::memory_order_relaxed);
    if (until && !c.done() && Clock::now() >= *until) return false;
  }
}

bool CollectiveQueue::cancel(QueuedCollective& c, std::exception_ptr error) {
  {
    std::lock_guard lk(mu_);
    auto it = std::find(queued_.begin(), queued_.end(), &c);
    if (it == queued_.end()) return false;
    queued_.erase(it);
    unstarted_.fetch_sub(1, std::memory_order_relaxed);
  }
  c.drop_body();
  settle(c, std::move(error), false);
  c.release();
  return true;
}

void CollectiveQueue::on_done(QueuedCollective& c, std::function<void()> fn) {
  {
    std::lock_guard lk(mu_);
    c.on_done_.push_back(std::move(fn));
    if (!c.done()) {
      c.has_callbacks_.store(true, std::memory_order_seq_cst);
      if (!c.done()) return;  // settle() sees has_callbacks_ and calls it
    }
  }
  // Done already (a future asked for after wait()), or meanwhile: call_back takes the callbacks
  // under mu_, so each runs once, whichever thread gets there first.
  call_back(c);
}

void CollectiveQueue::urge() noexcept {
  if (unstarted_.load(std::memory_order_relaxed) == 0) return;
  bool wake = false;
  {
    std::lock_guard lk(mu_);
    // While a collective runs the next cannot start; whoever runs it (a waiter, which then runs
    // the next one too, or the helper thread) starts it, and a thread that then blocks urges anew.
    if (queued_.empty() || closed_ || running_.load(std::memory_order_relaxed)) return;
    urged_ = true;
    wake = !helper_.busy;
  }
  if (wake) helper_.cv.notify_one();
}

void CollectiveQueue::close(std::exception_ptr error) noexcept {
  std::unique_lock lk(mu_);
  if (!closed_) {
    closed_ = std::move(error);
    std::deque<QueuedCollective*> failed;
    failed.swap(queued_);
    unstarted_.fetch_sub(failed.size(), std::memory_order_relaxed);
    lk.unlock();
    helper_.cv.notify_all();
    for (QueuedCollective* c : failed) {
      c->drop_body();
      settle(*c, closed_, false);
      c->release();
    }
    lk.lock();
  }
  // The collective that runs ends by itself (its group is shut down first, so promptly).
  waiters_.fetch_add(1, std::memory_order_seq_cst);
  done_cv_.wait(lk, [&] { return !running_.load(std::memory_order_seq_cst); });
  waiters_.fetch_sub(1, std::memory_order_relaxed);
  if (!helper_.thread.joinable()) return;
  if (helper_.thread.get_id() == std::this_thread::get_id()) {
    helper_.thread.detach();  // the last reference was dropped on the helper thread: it ends on its own
    return;
  }
  std::thread helper = std::move(helper_.thread);
  lk.unlock();
  helper.join();
}

void CollectiveQueue::start_helper() {
  helper_.thread = std::thread([self = weak_from_this()] {
    for (;;) {
      std::shared_ptr<CollectiveQueue> q = self.lock();
      if (!q || !q->helper_round()) return;
    }
  });
}

// One round of the helper thread: start what is due, else sleep until something may be. False
// once the queue is closed.
bool CollectiveQueue::helper_round() {
  std::unique_lock lk(mu_);
  if (closed_) return false;
  const auto now = Clock::now();
  if (submits_ != helper_.submits_seen) {  // collectives were issued since the last round
    helper_.submits_seen = submits_;
    helper_.last_activity = now;
  }
  for (QueuedCollective* c : queued_) {
    if (c->seen_ == Clock::time_point{}) c->seen_ = now;  // due kGrace after the helper first sees it
  }
  if (queued_.empty()) {
    urged_ = false;
    if (now - helper_.last_activity < kIdleAfter) {
      helper_.cv.wait_until(lk, now + kGrace);
    } else {
      helper_.idle = true;
      helper_.cv.wait(lk);
      helper_.idle = false;
    }
    return true;
  }
  const auto due_at = queued_.front()->seen_ + kGrace;
  if (!urged_ && now < due_at) {
    helper_.cv.wait_until(lk, due_at);
  } else if (!running_.load(std::memory_order_relaxed)) {
    helper_.busy = true;
    run_one(lk);
    lk.lock();
    helper_.busy = false;
  } else {  // due, but another thread's collective runs: start it once that one ends
    helper_.waits_running.store(true, std::memory_order_seq_cst);
    helper_.cv.wait(lk, [&] { return closed_ || !running_.load(std::memory_order_seq_cst); });
    helper_.waits_running.store(false, std::memory_order_relaxed);
  }
  return true;
}

}  // namespace tdshm::detail
