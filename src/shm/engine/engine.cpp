// The shared-memory transport's engine (see engine.h): construction and rendezvous, shutdown,
// and the posting calls, which take the lock around the channel.

#include "shm/engine/engine_internal.h"

#include "common/format.h"
#include "common/log.h"
#include "shm/parts/waiter.h"

#include <tdshm/errors.h>
#include <tdshm/memmap.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <exception>
#include <thread>
#include <utility>

namespace tdshm::detail {

ShmEngine::ShmEngine(const std::string& name, int rank, int size, const ShmOptions& options)
    : name_(name), rank_(rank), size_(size), options_(options), spin_budget_(options.spin) {
  if (size < 1) throw SegmentError("world size " + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size) {
    throw SegmentError("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(size) + ")");
  }
  if (options.timeout.count() <= 0) throw SegmentError("ShmOptions::timeout must be positive");
  if (options.peer_check_interval.count() <= 0) throw SegmentError("ShmOptions::peer_check_interval must be positive");
  const auto deadline = Clock::now() + options.timeout;
  shm::SegmentParams params{name,
                            static_cast<uint32_t>(size),
                            options.slot_bytes,
                            options.ring_entries,
                            options.slots_per_rank,
                            options.window_bytes,
                            options.loan_tickets,
                            options.loan_bytes,
                            (options.memmap_by_reference ? shm::kRankFeatureMemmapByReference : 0u) |
                                (options.tdshm_transfers ? shm::kRankFeatureTdshmTransfers : 0u)};
  segment_ = shm::Segment::attach(params, static_cast<uint32_t>(rank), deadline);

  channel_.emplace(*segment_, rank, size, options);
  loans_ = channel_->loans();
  shm::StepPeers& peers = *this;  // (a private base: converted here, where it is accessible)
  steps_ = std::make_unique<shm::CollectiveSteps>(*segment_, spin_budget_, peers);
  rendezvous(deadline);
  next_peer_check_.store(ticks(Clock::now() + options_.peer_check_interval), std::memory_order_relaxed);
  log().debug("rank {} of {} ready on segment '{}'", rank, size, name);
}

// Every rank of this incarnation arrived (they may start in any order; a peer that completed its
// own rendezvous and left counts). A peer that died in it, or gave up on it, ends the wait at once
// (one that died after it sent this rank something had completed it: see check_alive).
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
      give_up(SegmentError(
          where + "rank " + std::to_string(foreign->rank) + " (pid " + std::to_string(foreign->process.pid) +
          " in its PID namespace) runs in another PID namespace (inode " + std::to_string(foreign->process.pid_ns) +
          ", this rank's " + std::to_string(shm::self_process().pid_ns) +
          "), another container for instance: tdshm checks its peers through /proc, so every rank "
          "of a group must run in one PID namespace (docker run --pid=host or "
          "--pid=container:NAME; Kubernetes: shareProcessNamespace: true)"));
    }
  };
  // A dead rank that sent this rank anything had completed its own rendezvous (it could not have
  // sent otherwise), so every rank had arrived: a producer that put its items and was killed
  // while this rank slept between two looks. This rank then receives what it sent and finds the
  // death at its next wait; a dead rank that sent nothing fails the rendezvous.
  auto check_alive = [&] {
    check_namespaces();
    for (uint32_t r = 0; r < static_cast<uint32_t>(size_); ++r) {
      // rank_alive() is false for a rank that has left too: the state is read again after it,
      // so a peer that completed its own rendezvous and left cleanly in between (its state is
      // "left" before its process ends) is not taken for a dead one.
      auto live = [&] { return segment_->rank_slot(r).state.load(std::memory_order_acquire) == shm::kRankLive; };
      if (live() && !segment_->rank_alive(r) && live()) {
        const bool sent = r != static_cast<uint32_t>(rank_) &&
                          segment_->ring(r, static_cast<uint32_t>(rank_)).head.load(std::memory_order_acquire) > 0;
        if (sent) continue;
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
      // A peer of another namespace may have claimed its slot and given up (on finding this rank
      // foreign) between the check above and this look: it is that, not just a peer that gave up.
      check_namespaces();
      give_up(RendezvousAbandonedError(
          where + segment_->describe_rank(static_cast<uint32_t>(r)) +
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
      // Every rank may have come since the look above: then the group formed, whatever the clock.
      if (!segment_->abandon_unless_all_arrived()) {
        check_alive();
        return;
      }
      int live = 0;
      for (uint32_t r = 0; r < static_cast<uint32_t>(size_); ++r) live += segment_->rank_alive(r) ? 1 : 0;
      give_up(TimeoutError(where + "only " + std::to_string(live) + " of " + std::to_string(size_) +
                           " ranks attached within the timeout of " + std::to_string(options_.timeout.count()) +
                           " ms"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

ShmEngine::~ShmEngine() {
  shutdown();
  // The helper thread may hold the last reference (background_loop): it ends right after this.
  if (helper_.thread.joinable()) {
    if (helper_.thread.get_id() == std::this_thread::get_id()) {
      helper_.thread.detach();
    } else {
      helper_.thread.join();
    }
  }
}

void ShmEngine::shutdown(std::exception_ptr reason) noexcept {
  if (!reason)
    reason = std::make_exception_ptr(Error("the process group was destroyed while this transfer was pending"));
  {
    std::lock_guard lk(mu_);
    if (!channel_->close(std::move(reason))) return;
  }
  {
    std::lock_guard lk(helper_.mu);
    helper_.stopping = true;
  }
  helper_.cv.notify_all();
  // On the helper thread itself (a callback destroyed the group) it cannot be joined: it returns
  // to its loop, sees helper_.stopping and ends; the destructor detaches or joins it.
  if (helper_.thread.joinable() && helper_.thread.get_id() != std::this_thread::get_id()) helper_.thread.join();
  segment_->leave();
}

// ---------------------------------------------------------------------------------------------
// Posting

// A conjugate or negative view (t.conj(), t._neg_view()) holds its values only with its bit
// applied to its memory, which is what a send copies or lends: such a tensor is sent as a resolved
// copy (torch.distributed resolves it too before a backend sees it). Outside the lock: it copies.
static bool engine_send_needs_resolve(const at::Tensor& t) { return t.is_conj() || t.is_neg(); }

std::shared_ptr<ShmOp> ShmEngine::post_send(const at::Tensor& tensor, int dst, int64_t tag, bool control,
                                            MessageCheck check) {
  if (engine_send_needs_resolve(tensor)) {
    return post_send(tensor.resolve_conj().resolve_neg(), dst, tag, control, check);
  }
  std::lock_guard lk(mu_);
  return channel_->post_send(tensor, dst, tag, check, control);
}

OpList ShmEngine::post_sends(std::span<const at::Tensor> tensors, int dst, std::span<const int64_t> tags,
                             std::span<const MessageCheck> checks, bool control) {
  if (std::any_of(tensors.begin(), tensors.end(), engine_send_needs_resolve)) {
    std::vector<at::Tensor> resolved(tensors.begin(), tensors.end());
    for (at::Tensor& t : resolved) {
      if (engine_send_needs_resolve(t)) t = t.resolve_conj().resolve_neg();
    }
    return post_sends(resolved, dst, tags, checks, control);
  }
  std::lock_guard lk(mu_);
  return channel_->post_sends(tensors, dst, tags, checks, control);
}

std::shared_ptr<ShmOp> ShmEngine::post_recv(const at::Tensor& tensor, int src, int64_t tag, bool control,
                                            MessageCheck check) {
  // A message already waiting lands at once (receive_now); the checks make_recv makes are moot
  // for such a tensor (contiguous: no overlap; not a mapped file: not read-only).
  const bool direct =
      src >= 0 && src < size_ && src != rank_ && tensor.is_contiguous() && !MemoryMappedTensor::is_mapped(tensor);
  std::lock_guard lk(mu_);
  if (direct && channel_->receive_now(tensor, src, tag, check, control)) return nullptr;
  auto op = ShmChannel::make_recv(tensor, src, rank_, size_, tag, check, control);
  channel_->post_recvs({&op, 1}, src);
  return op;
}

OpList ShmEngine::post_recvs(std::span<const at::Tensor> tensors, int src, std::span<const int64_t> tags,
                             std::span<const MessageCheck> checks, bool control) {
  // The tensors are checked and the ops made before the lock is taken.
  OpList ops = ShmChannel::make_recvs(tensors, src, rank_, size_, tags, checks, control);
  std::lock_guard lk(mu_);
  channel_->post_recvs(ops, src);
  return ops;
}

void ShmEngine::unlink_segment_name() noexcept {
  if (segment_) segment_->unlink_name();
}

void ShmEngine::add_wait_hook(std::shared_ptr<shm::WaitHook> hook) {
  if (!hook) throw Error("ShmEngine::add_wait_hook: a null hook");
  std::lock_guard lk(mu_);  // adders take turns; waits read without it
  const int n = wait_hook_count_.load(std::memory_order_relaxed);
  if (n == kMaxWaitHooks)
    throw Error("ShmEngine::add_wait_hook: the engine holds " + std::to_string(n) + " hooks already");
  wait_hooks_[static_cast<size_t>(n)] = std::move(hook);
  wait_hook_count_.store(n + 1, std::memory_order_release);
}

std::shared_ptr<ShmOp> ShmEngine::post_recv_view(int src, int64_t tag, MessageCheck check) {
  return post_recv_views(src, {&tag, 1}, {&check, 1})[0];
}

OpList ShmEngine::post_recv_views(int src, std::span<const int64_t> tags, std::span<const MessageCheck> checks) {
  TORCH_INTERNAL_ASSERT(tags.size() == checks.size());
  OpList ops;
  ops.reserve(tags.size());
  for (size_t i = 0; i < tags.size(); ++i)
    ops.push_back(ShmChannel::make_recv_view(src, rank_, size_, tags[i], checks[i]));
  std::lock_guard lk(mu_);
  channel_->post_recvs(ops, src);
  return ops;
}

// The bytes of a loan of `sizes` and `dtype`; ShapeError for a negative or too large shape.
static uint64_t engine_loan_bytes(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  uint64_t numel = 1;
  for (const int64_t d : sizes) {
    if (d < 0) throw ShapeError("tdshm loan: negative size in shape " + shape_str(sizes));
    if (d != 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(d)) {
      throw ShapeError("tdshm loan: shape " + shape_str(sizes) + " is too large");
    }
    numel *= static_cast<uint64_t>(d);
  }
  return numel * c10::elementSize(dtype);
}

at::Tensor ShmEngine::try_loan(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  if (engine_loan_bytes(sizes, dtype) > loans_->heap_bytes()) return {};
  for (;;) {
    if (at::Tensor t = loans_->allocate(sizes, dtype); t.defined()) return t;
    std::lock_guard lk(mu_);
    if (auto e = channel_->unusable()) std::rethrow_exception(e);
    if (!channel_->progress()) return {};  // no ticket came back: no room now
  }
}

at::Tensor ShmEngine::loan(c10::IntArrayRef sizes, c10::ScalarType dtype, Clock::time_point deadline) {
  const uint64_t bytes = engine_loan_bytes(sizes, dtype);
  if (bytes > loans_->heap_bytes()) {
    throw SegmentError("tdshm loan: " + std::to_string(bytes) + " bytes do not fit rank " + std::to_string(rank_) +
                       "'s loan heap of " + std::to_string(loans_->heap_bytes()) +
                       " bytes (ShmOptions::loan_bytes; the segment's ranks must agree on it)");
  }
  // The shared wait loop (waiter.h) with a budget of 0: a loan waits for a receiver to give its
  // tickets back, which takes a peer's whole step, so it sleeps at once rather than spin.
  struct Hooks {
    ShmEngine& e;
    c10::IntArrayRef sizes;
    c10::ScalarType dtype;
    uint64_t bytes;
    Clock::time_point deadline;
    at::Tensor loan;
    shm::Poll poll() {
      loan = e.loans_->allocate(sizes, dtype);
      if (loan.defined()) return shm::Poll::kDone;
      std::lock_guard lk(e.mu_);
      if (auto error = e.channel_->unusable()) std::rethrow_exception(error);
      // Tickets came back: their loans may be free now.
      return e.channel_->progress() ? shm::Poll::kMoved : shm::Poll::kIdle;
    }
    bool at_clock(Clock::time_point now) {
      e.maybe_check_peers(now);
      return false;
    }
    [[noreturn]] void timed_out() {
      const std::string holders = e.loans_->holders();
      throw TimeoutError("segment '" + e.name_ + "', rank " + std::to_string(e.rank_) + ": no room for a loan of " +
                         std::to_string(bytes) + " bytes in the loan heap of " +
                         std::to_string(e.loans_->heap_bytes()) + " bytes within the timeout: " +
                         (holders.empty() ? std::string("this rank's own loans fill it (drop some)") : holders));
    }
    void sleep(Clock::time_point now, Clock::time_point) {
      e.before_wait();  // a receiver may give its tickets back only after a collective left queued here
      // A receiver that gives a ticket back wakes this rank; a loan dropped by another thread of
      // this process does not, hence the short sleeps.
      e.sleep_until_event(std::min(deadline, now + std::chrono::milliseconds(1)));
    }
  };
  Hooks hooks{*this, sizes, dtype, bytes, deadline, {}};
  shm::SpinBudget never_spins(std::chrono::nanoseconds(0));
  shm::spin_then_sleep(never_spins, shm::Judge::kSinceProgress, deadline, hooks);
  return std::move(hooks.loan);
}

bool ShmEngine::is_loan(const at::Tensor& t) const {
  if (!t.defined() || !t.is_contiguous() || !loans_->in_heap(t.data_ptr())) return false;
  return loans_->find(t.data_ptr(), static_cast<uint64_t>(t.numel()) * t.element_size()).has_value();
}

bool ShmEngine::rank_offers(int peer, uint32_t feature) const noexcept {
  return peer >= 0 && peer < size_ && (segment_->rank_features(static_cast<uint32_t>(peer)) & feature) != 0;
}

bool ShmEngine::runs_tdshm_transfers(int peer) const noexcept {
  return rank_offers(peer, shm::kRankFeatureTdshmTransfers);
}

bool ShmEngine::rank_died(int peer) const {
  return peer >= 0 && peer < size_ && peer != rank_ && segment_->rank_died(static_cast<uint32_t>(peer));
}

bool ShmEngine::memmap_by_reference_with(int peer) const noexcept {
  return options_.memmap_by_reference && rank_offers(peer, shm::kRankFeatureMemmapByReference);
}

void ShmEngine::poll() {
  std::lock_guard lk(mu_);
  channel_->progress();
}

// Takes `ops` back from the channel (their wait gave up, or the Work was aborted).
void ShmEngine::cancel(std::span<const std::shared_ptr<ShmOp>> ops, const std::exception_ptr& error) {
  std::lock_guard lk(mu_);
  for (const auto& op : ops) channel_->withdraw(op, error);
}

}  // namespace tdshm::detail
