// Peers and the helpers that post one message (messages.h).

#include "distributed/messages.h"

#include "distributed/layout_descriptor.h"

#include <climits>
#include <cstring>

namespace tdshm::detail {

/// Resolves exactly one of `global` / `in_group` (docs/semantics.md, "Peers"), before any message.
Peer resolve_peer(const char* global_name, const char* group_name, std::optional<int> global,
                  std::optional<int> in_group, const Group& given) {
  // Runs for every transfer: the names become strings only in an error message.
  const auto g = [global_name] { return std::string(global_name); };
  const auto gg = [group_name] { return std::string(group_name); };
  if (given.is_non_member()) throw Error("this rank is not a member of `group` (new_group did not include it)");
  if (in_group && !given.defined()) throw Error("`" + gg() + "` requires `group` to be passed.");
  if (global && in_group) throw Error("`" + g() + "` and `" + gg() + "` are mutually exclusive.");
  if (!global && !in_group) throw Error("Exactly one of `" + g() + "` and `" + gg() + "` must be provided.");
  Group fallback;
  const Group& group = given.defined() ? given : (fallback = default_group());
  const int rank = in_group ? *in_group : group.group_rank(*global);
  if (rank < 0 || rank >= group.size()) {
    throw Error("`" + (in_group ? gg() : g()) + "` = " + std::to_string(in_group ? *in_group : *global) +
                " is not a rank of the group (size " + std::to_string(group.size()) + ")");
  }
  if (rank == group.rank()) {
    throw Error("`" + (in_group ? gg() : g()) + "` = " + std::to_string(in_group ? *in_group : *global) +
                " is this process's own rank: a tensordict cannot be sent to itself");
  }
  return Peer(given.defined() ? &given : nullptr, std::move(fallback), rank);
}

bool peer_runs_tdshm(const Group& g, int peer) {
  return g.checked_wire_with(peer) || g.transport().peer_runs_tdshm(peer);
}

int c10d_tag(int64_t tag) {
  if (tag < 0 || tag > INT_MAX) {
    throw Error("tag " + std::to_string(tag) + " is outside [0, " + std::to_string(INT_MAX) +
                "] (init_tag too large?)");
  }
  return static_cast<int>(tag);
}

// A transport that carries checks takes them with the message (in its own metadata); another has
// no room for them on tensordict's wire.
WorkPtr send_one(const Group& g, at::Tensor t, int peer, int tag, MessageCheck check) {
  return g.transport().send(std::move(t), peer, tag, check);
}
WorkPtr recv_one(const Group& g, at::Tensor t, int peer, int tag, MessageCheck check) {
  return g.transport().recv(std::move(t), peer, tag, check);
}
void recv_now(const Group& g, const at::Tensor& t, int peer, int tag) { recv_one(g, t, peer, tag)->wait(); }
void broadcast_now(const Group& g, const at::Tensor& t, int root) {
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  g.backend().broadcast(v, o)->wait();
}

at::Tensor int64_tensor(std::vector<int64_t> values) {
  auto t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

at::Tensor bytes_tensor(int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kByte)); }

Group group_or_default(const Group& g) {
  if (g.is_non_member()) throw Error("this rank is not a member of `group` (new_group did not include it)");
  return g.defined() ? g : default_group();
}

int root_in_group(const Group& g, int src) {
  const int root = g.group_rank(src);
  if (root < 0 || root >= g.size()) throw Error("`src` = " + std::to_string(src) + " is not a rank of the group");
  return root;
}

MessageCheck key_check_of_hash(uint64_t hash, size_t leaves) noexcept {
  return {MessageCheck::Kind::kKey, fold32(hash), leaves <= 0xFFFF ? static_cast<uint16_t>(leaves) : uint16_t{0}};
}

}  // namespace tdshm::detail
