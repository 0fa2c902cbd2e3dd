// The point-to-point channel of one rank (channel.h): its parts composed, and what spans both
// sides decided here (progress, a lost peer, close, a lost mapping).

#include "shm/p2p/channel.h"

namespace tdshm::detail {

ShmChannel::ShmChannel(shm::Segment& segment, int rank, int size, const ShmOptions& options)
    : core_(segment, rank, size, options),
      by_reference_(core_),
      sender_(core_, by_reference_),
      receiver_(core_, by_reference_) {}

void ShmChannel::post_recvs(std::span<const std::shared_ptr<ShmOp>> ops, int src) {
  if (!receiver_.post_recvs(ops, src)) return;
  // A message already in a ring lands in place. A receive from one source needs only that
  // source's ring read (the other rings and queued sends move in the waits).
  if (src >= 0 && !check_poisoned()) {
    receive_from(src, /*drain_all=*/false);
  } else {
    progress(/*drain_all=*/false);
  }
}

bool ShmChannel::progress(bool drain_all) {
  if (core_.closed() || check_poisoned()) return false;
  bool moved = false;
  for (int p = 0; p < core_.size(); ++p) {
    if (p == core_.rank()) continue;
    moved |= receive_from(p, drain_all);
    moved |= sender_.progress(p);
  }
  if (by_reference_.busy()) moved |= by_reference_.progress();
  return moved;
}

void ShmChannel::lose_to(int src, std::exception_ptr error) {
  // A truncated segment reads as zeros once the bus guard has replaced its pages, which an
  // entry's checks see as corruption: the truncation is the error every op gets.
  if (!check_poisoned()) fail_peer(src, std::move(error));
}

void ShmChannel::drain(int src) {
  while (receive_from(src, /*drain_all=*/true)) {
  }
}

bool ShmChannel::incoming_hint() const noexcept {
  if (core_.segment().poisoned()) return true;
  for (int p = 0; p < core_.size(); ++p) {
    if (p != core_.rank() && receiver_.ready_hint(p)) return true;
  }
  return false;
}

bool ShmChannel::busy() const noexcept {
  for (int p = 0; p < core_.size(); ++p) {
    if (sender_.busy(p) || receiver_.busy(p)) return true;
  }
  return by_reference_.busy();
}

// Takes `op` back (its wait gave up). A send whose first entry is already in the ring cannot be
// taken back (its receiver expects the rest) and goes on.
void ShmChannel::withdraw(const std::shared_ptr<ShmOp>& op, const std::exception_ptr& error) {
  if (!op || op->done.load(std::memory_order_relaxed)) return;
  if (op->kind == ShmOp::Kind::kRecv) {
    receiver_.withdraw(op);
  } else if (!sender_.withdraw(op)) {
    return;
  }
  core_.finish(*op, error);
}

void ShmChannel::fail_peer(int peer, std::exception_ptr error) {
  const std::exception_ptr& first = core_.lose_peer(peer, error);  // (an earlier error stays)
  sender_.fail_peer(peer, first);
  by_reference_.fail_peer(peer, first);  // (its tickets stay counted until reclaim_loans)
  receiver_.fail_peer(peer, first);
  // The rings with `peer` are not reset: they belong to this incarnation only, and `peer` (if it
  // still runs) may still be writing to them. Nothing more is read from or written to them.
}

// Fails every op pending in the channel with `error` (the group was destroyed, or its segment cut).
void ShmChannel::fail_pending(const std::exception_ptr& error) {
  sender_.fail_all(error);
  receiver_.fail_all(error);
  by_reference_.fail_all(error);
}

bool ShmChannel::fail_poisoned() {
  poison_failed_ = true;
  fail_pending(core_.poisoned());
  core_.lose_all(core_.poisoned());
  return true;
}

bool ShmChannel::close(const std::exception_ptr& error) {
  if (!core_.close(error)) return false;
  fail_pending(core_.closed());
  return true;
}

std::exception_ptr ShmChannel::unusable() {
  if (core_.closed()) return core_.closed();
  return check_poisoned() ? core_.poisoned() : nullptr;
}

}  // namespace tdshm::detail
