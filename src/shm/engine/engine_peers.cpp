// Liveness in ShmEngine: peers that are gone, a segment cut under its mapping, and what fails
// then (the channel fails their transfers; see engine.h).

#include "shm/engine/engine_internal.h"

#include "common/log.h"

#include <tdshm/errors.h>

namespace tdshm::detail {

void ShmEngine::check_peers() {
  ShmChannel& channel = *channel_;
  if (channel.closed()) return;
  segment_->check_file();
  if (channel.check_poisoned()) return;
  // Lost peers that may still hold views of this rank's loans: their tickets come back once
  // their process is dead.
  std::erase_if(view_holders_, [&](int p) {
    if (segment_->rank_process_alive(static_cast<uint32_t>(p))) return false;
    channel.reclaim_loans(p);
    return true;
  });
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || channel.peer_error(p)) continue;
    if (segment_->rank_alive(static_cast<uint32_t>(p))) continue;
    segment_->check_file();
    if (channel.check_poisoned()) return;  // the rank table read zeros because the file was just cut
    channel.drain(p);                      // what it sent before it went is still good: all of it is taken
    if (channel.peer_error(p)) continue;
    // A rank that left while its process runs on (it destroyed or shut down its group, say after
    // its own failure) is not said to have died.
    const bool process_alive = segment_->rank_process_alive(static_cast<uint32_t>(p));
    channel.fail_peer(
        p, std::make_exception_ptr(PeerLostError(
               segment_->describe_rank(static_cast<uint32_t>(p)) + " of segment '" + name_ +
               (process_alive ? "' left the group (its process runs on)" : "' is gone (it exited or died)"))));
    // A gone rank reads nothing more: the slots this rank handed to it are free again.
    const uint32_t reclaimed = channel.reclaim_slots(p);
    if (process_alive) {
      view_holders_.push_back(p);  // it left its group: its views stay readable, and lent
    } else {
      channel.reclaim_loans(p);
    }
    // A rank that left on purpose (a loader's main ending its iterator mid-epoch) is no news: the
    // transfers with it fail with the error above; a death is worth a warning.
    log().log(process_alive ? spdlog::level::info : spdlog::level::warn,
              "segment '{}': {} {}; its pending transfers failed ({} arena slots taken back)", name_,
              segment_->describe_rank(static_cast<uint32_t>(p)), process_alive ? "left" : "is gone", reclaimed);
  }
}

std::exception_ptr ShmEngine::unusable() {
  std::lock_guard lk(mu_);
  return channel_->unusable();
}

// Collectives need every rank. The peer named is `awaited` (the first rank a step still waits
// for) when it is lost: a survivor that published the step and then failed and left its group
// is gone too, but it is not the rank the step lacks.
std::exception_ptr ShmEngine::lost(int awaited) {
  std::lock_guard lk(mu_);
  if (auto error = channel_->unusable()) return error;
  if (awaited >= 0 && channel_->peer_error(awaited)) return channel_->peer_error(awaited);
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && channel_->peer_error(p)) return channel_->peer_error(p);
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
