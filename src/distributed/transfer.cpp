// The tensordict transfer API's entry points (TensorDict::isend, irecv, send, recv): resolve the
// peer, then hand over to the protocol (per_leaf.cpp, consolidated.cpp; init_remote,
// from_remote_init and broadcast are in remote_init.cpp). What the protocols share is in
// messages.h (peers, messages, the wire), staged_receives.h and transfer_work.h; each protocol's
// file describes its wire at the top.

#include "distributed/protocols.h"
#include "distributed/transfer_work.h"

namespace tdshm {

using detail::Peer;
using detail::resolve_peer;

void Transfer::wait() const { detail::wait_all(works); }

Transfer TensorDict::isend(const SendOptions& o) const {
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  return o.consolidated ? detail::isend_consolidated(*this, p, o) : detail::isend_per_leaf(*this, p, o);
}

void TensorDict::send(const SendOptions& o) const {
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  if (o.consolidated) {
    detail::isend_consolidated(*this, p, o, detail::Completion::kWaited);
  } else {
    detail::isend_per_leaf(*this, p, o, detail::Completion::kWaited);
  }
}

Transfer TensorDict::irecv(const RecvOptions& o) {
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  return o.consolidated ? detail::irecv_consolidated(*this, p, o) : detail::irecv_per_leaf(*this, p, o);
}

namespace {

// A lazy stack's consolidated transfers are its consolidated shell's (lazy_stack.h).
const TensorDict& consolidated_receiver(const std::shared_ptr<const TensorDict>& shell) {
  if (!shell) {
    throw Error("LazyStackedTensorDict: recv(consolidated=True) needs a consolidated receiver: call consolidate() "
                "first (its members must have the sender's keys, dtypes and shapes)");
  }
  return *shell;
}

}  // namespace

Transfer LazyStackedTensorDict::isend(const SendOptions& o) const {
  if (o.consolidated) return consolidate().consolidated_->isend(o);
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  return detail::isend_per_leaf(*this, p, o);
}

void LazyStackedTensorDict::send(const SendOptions& o) const {
  if (o.consolidated) return consolidate().consolidated_->send(o);
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  detail::isend_per_leaf(*this, p, o, detail::Completion::kWaited);
}

Transfer LazyStackedTensorDict::irecv(const RecvOptions& o) {
  if (o.consolidated) return TensorDict(consolidated_receiver(consolidated_)).irecv(o);
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  return detail::irecv_per_leaf(*this, p, o);
}

int64_t LazyStackedTensorDict::recv(const RecvOptions& o) {
  if (o.consolidated) return TensorDict(consolidated_receiver(consolidated_)).recv(o);
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  int64_t last_tag = 0;
  detail::irecv_per_leaf(*this, p, o, &last_tag, detail::Completion::kWaited);
  return last_tag;
}

int64_t TensorDict::recv(const RecvOptions& o) {
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  if (o.consolidated) {
    detail::irecv_consolidated(*this, p, o, detail::Completion::kWaited);
    return 0;  // tensordict's consolidated transfers use tag 0
  }
  int64_t last_tag = 0;
  detail::irecv_per_leaf(*this, p, o, &last_tag, detail::Completion::kWaited);
  return last_tag;
}

}  // namespace tdshm
