// The tensordict transfer API's entry points (TensorDict::isend, irecv, send, recv): resolve the
// peer, then hand over to the protocol (per_leaf.cpp, consolidated.cpp; init_remote,
// from_remote_init and broadcast are in remote_init.cpp). What the protocols share is in
// transfer_common.h; the wire is described there and at the top of each protocol's file.

#include "distributed/transfer_common.h"

namespace tdshm {

using detail::Peer;
using detail::resolve_peer;

void Transfer::wait() const { detail::wait_all(works); }

Transfer TensorDict::isend(const SendOptions& o) const {
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  return o.consolidated ? detail::isend_consolidated(*this, p, o) : detail::isend_per_leaf(*this, p, o);
}

void TensorDict::send(const SendOptions& o) const {
  SendOptions waited = o;
  waited.return_early = false;
  isend(waited);
}

Transfer TensorDict::irecv(const RecvOptions& o) {
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  return o.consolidated ? detail::irecv_consolidated(*this, p, o) : detail::irecv_per_leaf(*this, p, o);
}

namespace {

void refuse_consolidated(bool consolidated, const char* method) {
  if (consolidated) {
    throw Error(std::string("LazyStackedTensorDict::") + method +
                ": consolidated transfers of a lazy stack are not supported; send it per leaf, or send "
                "to_tensordict().consolidate()");
  }
}

}  // namespace

Transfer LazyStackedTensorDict::isend(const SendOptions& o) const {
  refuse_consolidated(o.consolidated, "isend");
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  return detail::isend_per_leaf(*this, p, o);
}

void LazyStackedTensorDict::send(const SendOptions& o) const {
  SendOptions waited = o;
  waited.return_early = false;
  isend(waited);
}

Transfer LazyStackedTensorDict::irecv(const RecvOptions& o) {
  refuse_consolidated(o.consolidated, "irecv");
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  return detail::irecv_per_leaf(*this, p, o);
}

int64_t LazyStackedTensorDict::recv(const RecvOptions& o) {
  refuse_consolidated(o.consolidated, "recv");
  RecvOptions waited = o;
  waited.return_premature = false;
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  int64_t last_tag = 0;
  detail::irecv_per_leaf(*this, p, waited, &last_tag);
  return last_tag;
}

int64_t TensorDict::recv(const RecvOptions& o) {
  RecvOptions waited = o;
  waited.return_premature = false;
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  if (o.consolidated) {
    detail::irecv_consolidated(*this, p, waited);
    return 0;  // tensordict's consolidated transfers use tag 0
  }
  int64_t last_tag = 0;
  detail::irecv_per_leaf(*this, p, waited, &last_tag);
  return last_tag;
}

}  // namespace tdshm
