// Group: a handle on a c10d backend, the global ranks of its members and its transport (see
// include/tdshm/distributed.h; the default group and new_group are group.cpp).

#include <tdshm/distributed.h>

#include "process_group/transport.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace tdshm {

Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> backend) : backend_(std::move(backend)) {
  if (!backend_) throw Error("Group: the backend is null (use Group{} for \"no group\")");
  auto shared = std::make_shared<Shared>();
  shared->transport = detail::make_transport(backend_);
  shared_ = std::move(shared);
}

Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> backend, std::vector<int> global_ranks)
    : backend_(std::move(backend)) {
  if (!backend_) throw Error("Group: the backend is null (use Group{} for \"no group\")");
  if (global_ranks.size() != static_cast<size_t>(backend_->getSize())) {
    throw Error("Group: " + std::to_string(global_ranks.size()) + " global ranks for a backend of size " +
                std::to_string(backend_->getSize()));
  }
  std::vector<int> sorted = global_ranks;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0) throw Error("Group: negative global rank " + std::to_string(sorted.front()));
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    throw Error("Group: global rank " + std::to_string(*dup) + " is listed twice");
  }
  auto shared = std::make_shared<Shared>();
  shared->global_ranks = std::move(global_ranks);
  shared->transport = detail::make_transport(backend_);
  shared_ = std::move(shared);
}

void Group::set_checked_wire(std::vector<bool> advertised) {
  auto shared = std::make_shared<Shared>(shared_ ? *shared_ : Shared{});  // (copies that exist keep theirs)
  shared->checked = std::move(advertised);
  shared_ = std::move(shared);
}

bool Group::checked_wire_with(int peer) const noexcept {
  if (!shared_ || !shared_->transport) return false;
  const std::vector<bool>& checked = shared_->checked;  // empty: never set
  if (peer < 0 || static_cast<size_t>(peer) >= checked.size() || !checked[static_cast<size_t>(peer)] ||
      !checked[static_cast<size_t>(rank())]) {
    return false;
  }
  // Where the transport carries tdshm's checks itself (shared memory), the wire stays tensordict's.
  return !shared_->transport->can(peer).check_messages;
}

bool Group::checked_wire_all() const noexcept {
  if (!shared_ || shared_->checked.empty()) return false;
  for (int r = 0; r < static_cast<int>(shared_->checked.size()); ++r) {
    if (!checked_wire_with(r)) return false;
  }
  return true;
}

c10d::ProcessGroup& Group::backend() const {
  if (!backend_) {
    throw Error("Group::backend(): this Group is not defined (no group, or a rank outside the group new_group made)");
  }
  return *backend_;
}

const detail::Transport& Group::transport() const {
  if (!shared_ || !shared_->transport) {
    throw Error("Group::transport(): this Group is not defined (no group, or a rank outside the group new_group made)");
  }
  return *shared_->transport;
}

std::string Group::backend_name() const { return backend().getBackendName(); }

int Group::rank() const { return backend().getRank(); }

int Group::size() const { return backend().getSize(); }

int Group::group_rank(int global) const {
  backend();  // throws if not defined
  if (!registered()) {
    throw Error("Group::group_rank(" + std::to_string(global) +
                "): this group is standalone (not made by init_process_group or new_group), so global ranks "
                "mean nothing to it; address its ranks with group_dst / group_src");
  }
  const std::vector<int>& ranks = global_ranks();
  const auto it = std::find(ranks.begin(), ranks.end(), global);
  if (it == ranks.end()) {
    throw Error("Group::group_rank: global rank " + std::to_string(global) + " is not a member of this group");
  }
  return static_cast<int>(it - ranks.begin());
}

int Group::global_rank(int group_rank) const {
  const int n = size();  // throws if not defined
  if (group_rank < 0 || group_rank >= n) {
    throw Error("Group::global_rank: group rank " + std::to_string(group_rank) + " is outside [0, " +
                std::to_string(n) + ")");
  }
  return registered() ? global_ranks()[static_cast<size_t>(group_rank)] : group_rank;
}

}  // namespace tdshm
