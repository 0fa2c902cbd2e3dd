// Liveness in ShmEngine: peers that are gone, a segment cut under its mapping, and what fails
// then (see engine.h).

#include "shm/engine_internal.h"

#include "common/log.h"

namespace tdshm::detail {

using shm::EntryHeader;

void ShmEngine::fail_peer(int peer, std::exception_ptr error) {
  auto& slot = peer_error_[static_cast<size_t>(peer)];
  if (!slot) slot = error;
  auto& queue = send_queues_[static_cast<size_t>(peer)];
  for (auto& op : queue) finish(op, slot);
  queue.clear();
  auto& cur = current_[static_cast<size_t>(peer)];
  if (cur) {
    if (cur->op) finish(cur->op, slot);
    if (matcher_.remove_early(cur)) release_unexpected(*cur);  // nobody will ever finish it
    cur.reset();
  }
  held_bytes_[static_cast<size_t>(peer)] = 0;
  bool someone_alive = false;
  for (int p = 0; p < size_; ++p) someone_alive |= (p != rank_ && !peer_error_[static_cast<size_t>(p)]);
  matcher_.drop_posted_if([&](const ShmOp& op) { return op.peer == peer || (op.peer < 0 && !someone_alive); },
                          [&](const std::shared_ptr<ShmOp>& op) { finish(op, slot); });
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

// Fails every op pending in the engine with `error` (the group was destroyed, or its segment cut).
void ShmEngine::fail_pending(const std::exception_ptr& error) {
  for (auto& q : send_queues_) {
    for (auto& op : q) finish(op, error);
    q.clear();
  }
  matcher_.clear([&](const std::shared_ptr<ShmOp>& op) { finish(op, error); });
  for (auto& msg : current_) {
    if (msg && msg->op) finish(msg->op, error);
    msg.reset();
  }
  unexpected_bytes_ = 0;
}

// fail_pending, and every peer is lost with `error`: nothing more moves in this group.
void ShmEngine::fail_all(const std::exception_ptr& error) {
  fail_pending(error);
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
    while (progress_receives(p, /*drain_all=*/true)) {
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

std::exception_ptr ShmEngine::unusable() {
  std::lock_guard lk(mu_);
  if (shut_down_) return shut_down_;
  return check_poisoned() ? poisoned_ : nullptr;
}

// Collectives need every rank. The peer named is `awaited` (the first rank a step still waits
// for) when it is lost: a survivor that published the step and then failed and left its group
// is gone too, but it is not the rank the step lacks.
std::exception_ptr ShmEngine::lost(int awaited) {
  std::lock_guard lk(mu_);
  if (shut_down_) return shut_down_;
  if (check_poisoned()) return poisoned_;
  if (awaited >= 0 && peer_error_[static_cast<size_t>(awaited)]) return peer_error_[static_cast<size_t>(awaited)];
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peer_error_[static_cast<size_t>(p)]) return peer_error_[static_cast<size_t>(p)];
  }
  return nullptr;
}

void ShmEngine::maybe_check_peers(Clock::time_point now) {
  if (ticks(now) < next_peer_check_.load(std::memory_order_relaxed)) return;
  std::lock_guard lk(mu_);
  if (ticks(now) < next_peer_check_.load(std::memory_order_relaxed)) return;  // another thread just did
  check_peers();
  next_peer_check_.store(ticks(now + options_.peer_check_interval), std::memory_order_relaxed);
}

}  // namespace tdshm::detail
