// What the parts of one rank's channel share (channel_core.h): the failure state and how an op
// completes.

#include "shm/p2p/channel_core.h"

#include "common/log.h"
#include "shm/p2p/message.h"
#include "shm/parts/waiter.h"

#include <utility>

namespace tdshm::detail {

std::string ShmOp::what() const {
  std::string s = kind == Kind::kSend
                      ? "send to rank " + std::to_string(peer)
                      : (peer < 0 ? std::string("recv from any rank") : "recv from rank " + std::to_string(peer));
  return s + (control ? ", collective " : ", tag ") + std::to_string(tag) + " (" + std::to_string(bytes) + " bytes)";
}

ChannelCore::ChannelCore(shm::Segment& segment, int rank, int size, const ShmOptions& options)
    : segment_(segment), rank_(rank), size_(size), options_(options) {
  const auto n = static_cast<size_t>(size);
  const auto& g = segment_.geometry();
  regions_.resize(n);
  for (uint32_t p = 0; p < static_cast<uint32_t>(size); ++p) {
    regions_[p] = shm::RegionView(segment_.region_memory(p), options.slots_per_rank, g.slot_table_bytes, g.slot_stride);
  }
  peer_error_.resize(n);
}

bool ChannelCore::someone_alive() const noexcept {
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && !peer_error_[static_cast<size_t>(p)]) return true;
  }
  return false;
}

const std::exception_ptr& ChannelCore::lose_peer(int peer, const std::exception_ptr& error) {
  auto& slot = peer_error_[static_cast<size_t>(peer)];
  if (!slot) slot = error;
  return slot;
}

void ChannelCore::lose_all(const std::exception_ptr& error) {
  for (auto& p : peer_error_) {
    if (!p) p = error;
  }
}

bool ChannelCore::close(const std::exception_ptr& error) {
  if (closed_) return false;
  closed_ = error;
  return true;
}

// Once the segment's mapping is lost (a peer truncated the file), every transfer fails.
bool ChannelCore::record_poison() {
  poisoned_ = make_error<TransportError>("the segment file of '" + name() +
                                         "' was truncated by another process while in use: this group's shared "
                                         "memory is gone and all of its transfers fail; construct the group again");
  log().error("segment '{}' was truncated under its mapping: the group's transfers fail", name());
  return true;
}

void ChannelCore::finish(ShmOp& op, std::exception_ptr error) {
  if (op.done.load(std::memory_order_relaxed)) return;
  // Bytes that went through a mapping the file no longer backs may be zeros: never a success.
  if (!error && segment_.poisoned()) {
    error = poisoned_ ? poisoned_
                      : make_error<TransportError>(op.what() + ": the segment file of '" + name() +
                                                   "' was truncated by another process while mapped");
  }
  if (!error && op.kind == ShmOp::Kind::kRecv && op.staging.defined()) {
    try {
      op.user.copy_(op.staging);  // a non-contiguous destination gets the staged bytes
    } catch (const std::exception& e) {
      error = make_error<TransportError>(op.what() + ": copying into the strided tensor: " + e.what());
    }
  }
  op.error = std::move(error);
  op.done.store(true, std::memory_order_release);  // pairs with acquire loads of done in waiters
}

void ChannelCore::wake_peer(int r) noexcept { shm::wake(segment_.rank_slot(static_cast<uint32_t>(r))); }

TransportError ChannelCore::corrupted(int src, const std::string& what) const {
  return TransportError("corrupted entry from " + segment_.describe_rank(static_cast<uint32_t>(src)) + ": " + what);
}

}  // namespace tdshm::detail
