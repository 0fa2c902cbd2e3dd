// Waiting in ShmEngine: point-to-point waits on shm::spin_then_sleep (waiter.h), and the helper
// thread that completes futures (see engine.h).

#include "shm/engine/engine_internal.h"

#include "common/log.h"

#include <tdshm/errors.h>
#include "shm/parts/waiter.h"

#include <algorithm>
#include <thread>

namespace tdshm::detail {

// A quiet waiter's lock-free polls between two full progress passes (ShmEngine::wait).
constexpr uint32_t kFullPollEvery = 64;

// Sleeps on this rank's wake word until `until` or a wake-up, unless a progress pass (the
// re-check after the announcement) moves something.
void ShmEngine::sleep_until_event(Clock::time_point until, bool drain_all) {
  shm::SleepAnnouncement asleep(segment_->rank_slot(static_cast<uint32_t>(rank_)));
  bool moved;
  {
    std::lock_guard lk(mu_);
    moved = channel_->progress(drain_all);
  }
  if (!moved) asleep.sleep(until);
}

// The latest a sleeper may sleep: its deadline, the next liveness check, and 100 ms at most.
Clock::time_point ShmEngine::sleep_limit(Clock::time_point now, Clock::time_point deadline) const {
  const auto next_check = from_ticks(next_peer_check_.load(std::memory_order_relaxed));
  return std::min({deadline, std::max(next_check, now), now + std::chrono::milliseconds(100)});
}

namespace {
// Thrown by a wait's timed_out hook when its ops are kept at the deadline; caught by the wait.
struct KeptAtDeadline {};
}  // namespace

// The hooks of one point-to-point wait on the shared wait loop (shm::spin_then_sleep): when its
// ops are done, one progress pass, what to check when the clock is read, how to sleep.
struct ShmEngine::OpWait {
  ShmEngine& e;
  std::span<const std::shared_ptr<ShmOp>> ops;
  Clock::time_point deadline;
  bool stop_on_error;
  bool keep_at_deadline;
  // Ops complete mostly in order (a pair's messages match in order): the first one not known
  // to be done is remembered, so a check does not walk a batch of 100 leaves each time. A
  // failure further on (stop_on_error) is looked for at every clock read.
  size_t first_pending = 0;
  bool busy = true;  // as of the last progress pass: see poll()
  uint32_t quiet_polls = 0;
  const bool single_recv = ops.size() == 1 && ops[0] && ops[0]->kind == ShmOp::Kind::kRecv && ops[0]->peer >= 0;

  static bool failed(const std::shared_ptr<ShmOp>& op) {
    return op && op->done.load(std::memory_order_acquire) && op->error;
  }
  bool all_done() {
    while (first_pending < ops.size() && is_done(ops[first_pending])) {
      if (stop_on_error && failed(ops[first_pending])) return true;
      ++first_pending;
    }
    return first_pending == ops.size();
  }
  bool failed_later() const {
    return stop_on_error && std::any_of(ops.begin() + static_cast<std::ptrdiff_t>(first_pending), ops.end(), failed);
  }
  shm::Poll poll() {
    // A waiter that last found nothing but new entries to wait for (no send queued for room,
    // no message in progress) reads the rings' next entries without the lock, and takes it
    // only when one seems published, or every kFullPollEvery polls (a send queued meanwhile
    // by another thread, a peer's failure): the spin of a ping-pong's waiting rank is then
    // a few loads, and it sees the message sooner.
    if (!busy && (++quiet_polls % kFullPollEvery) != 0 && !e.channel_->incoming_hint()) {
      return all_done() ? shm::Poll::kDone : shm::Poll::kIdle;
    }
    quiet_polls = 0;
    bool moved = false, landed = false;
    {
      std::lock_guard lk(e.mu_);
      // A wait for one receive from one peer, with nothing else in flight (a ping-pong): its
      // message, whole in the next entry, lands without a pass over every ring and queue.
      // (Tried for a tree's receives too, one land_posted per leaf: more instructions than
      // the pass, which reads the ring once for all of them.)
      landed = single_recv && !e.channel_->busy() && e.channel_->land_posted(ops[0]);
      if (!landed) {
        moved = e.channel_->progress(/*drain_all=*/false);
        busy = e.channel_->busy();
      }
    }
    if (landed || all_done()) return shm::Poll::kDone;
    return moved ? shm::Poll::kMoved : shm::Poll::kIdle;
  }
  bool at_clock(Clock::time_point now) {
    e.maybe_check_peers(now);
    return all_done() || failed_later();
  }
  void timed_out() {
    if (keep_at_deadline) throw KeptAtDeadline{};
    e.time_out(ops);
  }
  void sleep(Clock::time_point now, Clock::time_point first_sleep) {
    // Before sleeping, messages from sources nobody waits on are drained into process memory
    // (early messages), so that a sender blocked on room that this rank waits for indirectly
    // (two ranks that both send more than the arena holds before they receive) goes on. Not
    // at once, though: a data loader's main rank that sleeps a few microseconds for worker 1
    // would otherwise copy the batches that workers 2-4 have queued (they run ahead by design)
    // out of their slots into fresh buffers, and copy them again when it posts their receives
    // (4 workers, consolidated: that double copy was half of the main rank's memcpy time).
    // After kDrainOthersAfter of sleeping (a deadlock costs that much once), a sleep drains if
    // every rank this wait depends on sleeps too: one that runs is not blocked on this rank and
    // will deliver (more ranks than cores: a descheduled worker). Draining then only made
    // copies: a loader's main rank that waited for one worker past 1 ms took the other
    // workers' queued batches out of their rings every time, fell behind, and in 2 of 6 runs
    // of 80,000 batches held 7,000-10,000 early messages and ran at 44-53k batches/s instead
    // of 78-83k. A rank that waits on room without sleeping (a caller polling isCompleted())
    // is not seen asleep: after kDrainAnywayAfter every sleep drains, so such a cycle costs
    // that much once.
    constexpr auto kDrainOthersAfter = std::chrono::milliseconds(1);
    constexpr auto kDrainAnywayAfter = std::chrono::milliseconds(20);
    const auto slept = now - first_sleep;
    const bool drain_others = slept >= kDrainAnywayAfter || (slept >= kDrainOthersAfter && e.waited_ranks_asleep(ops));
    auto until = e.sleep_limit(now, deadline);
    if (slept < kDrainOthersAfter) until = std::min(until, first_sleep + kDrainOthersAfter);
    if (!drain_others) until = std::min(until, first_sleep + kDrainAnywayAfter);
    e.sleep_until_event(until, drain_others);
  }
};

void ShmEngine::wait(std::span<const std::shared_ptr<ShmOp>> ops, Clock::time_point deadline, bool stop_on_error,
                     bool keep_at_deadline) {
  // A collective the group issued and left to run may be what a peer waits for before it sends
  // what this wait needs (shm/parts/wait_hook.h).
  before_wait();
  OpWait hooks{*this, ops, deadline, stop_on_error, keep_at_deadline};
  if (hooks.all_done()) return;
  // The loop runs on a local type: its instantiation is then internal to this file and inlined
  // here (on OpWait itself, a type with linkage, it was a call of its own: +31 instructions per
  // loan sent and viewed).
  struct Local {
    OpWait& w;
    shm::Poll poll() { return w.poll(); }
    bool at_clock(Clock::time_point now) { return w.at_clock(now); }
    void timed_out() { w.timed_out(); }
    void sleep(Clock::time_point now, Clock::time_point first_sleep) { w.sleep(now, first_sleep); }
  };
  try {
    shm::spin_then_sleep(spin_budget_, shm::Judge::kSinceProgress, deadline, Local{hooks});
  } catch (const KeptAtDeadline&) {
  }
}

// Ends a wait at its deadline: the ops not done are withdrawn and fail with the TimeoutError,
// which names them and any message held in its ring for want of early-message budget.
void ShmEngine::time_out(std::span<const std::shared_ptr<ShmOp>> ops) {
  std::string pending;
  for (const auto& op : ops) {
    if (!is_done(op)) pending += (pending.empty() ? "" : "; ") + op->what();
  }
  std::lock_guard lk(mu_);
  pending += channel_->held_messages();
  auto error = std::make_exception_ptr(
      TimeoutError("segment '" + name_ + "', rank " + std::to_string(rank_) + ": timed out waiting for " + pending));
  for (const auto& op : ops) channel_->withdraw(op, error);
  std::rethrow_exception(error);
}

// Whether every rank that one of `ops` still waits on (its peer; every peer for an any-source
// receive) announces a sleeper in its RankSlot: whether this wait may be part of a cycle of
// ranks blocked on each other. The counts are read without trust: a peer that lies only makes
// this rank drain sooner or later (kDrainAnywayAfter bounds it). A lost peer's ops fail through
// the liveness checks, whatever this says.
bool ShmEngine::waited_ranks_asleep(std::span<const std::shared_ptr<ShmOp>> ops) const {
  auto asleep = [&](int p) {
    return segment_->rank_slot(static_cast<uint32_t>(p)).sleepers.load(std::memory_order_relaxed) != 0;
  };
  for (const auto& op : ops) {
    if (!op || op->done.load(std::memory_order_acquire)) continue;
    if (op->peer >= 0) {
      if (!asleep(op->peer)) return false;
      continue;
    }
    for (int p = 0; p < size_; ++p) {
      if (p != rank_ && !asleep(p)) return false;
    }
  }
  return true;
}

void ShmEngine::watch(std::vector<std::shared_ptr<ShmOp>> ops, std::function<void()> on_done) {
  const bool done = std::all_of(ops.begin(), ops.end(), is_done);
  if (done) {
    on_done();
    return;
  }
  {
    std::lock_guard lk(helper_.mu);
    helper_.watches.push_back({std::move(ops), std::move(on_done)});
    if (!helper_.thread.joinable() && !helper_.stopping)
      helper_.thread = std::thread(background_loop, weak_from_this());
  }
  helper_.cv.notify_all();
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
    std::unique_lock lk(helper_.mu);
    helper_.cv.wait(lk, [&] { return helper_.stopping || !helper_.watches.empty(); });
    if (helper_.stopping) {
      stop = true;
      ready = std::move(helper_.watches);  // fail-fast: their ops were finished with errors or will be
      helper_.watches.clear();
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
      channel_->progress();
    }
    maybe_check_peers(Clock::now());
  } catch (const std::exception& e) {
    log().error("segment '{}': progress on the helper thread failed: {}", name_, e.what());
  }
  {
    std::lock_guard lk(helper_.mu);
    auto it = std::partition(helper_.watches.begin(), helper_.watches.end(),
                             [](const Watch& w) { return !std::all_of(w.ops.begin(), w.ops.end(), is_done); });
    std::move(it, helper_.watches.end(), std::back_inserter(ready));
    helper_.watches.erase(it, helper_.watches.end());
  }
  run(ready);
  if (ready.empty()) {
    try {
      sleep_until_event(Clock::now() + std::chrono::milliseconds(1));
    } catch (...) {  // logged by the next pass's progress, which fails the same way
    }
  }
  return true;
}

}  // namespace tdshm::detail
