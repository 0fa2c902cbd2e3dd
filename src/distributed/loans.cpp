// Loans and views in the transfer layer (docs/loans.md). tdshm::loan asks the group's transport
// for tensors whose sends go by reference (Transport::loan; an ordinary tensor where the
// transport has no loans), so every transfer of the tensordict API sends a loaned tree by
// reference without a change: the transport sees the bytes are a loan. TensorDict::recv_view
// receives a tree as views (Transport::recv_view): per-leaf with recv's tags and key checks, or
// the consolidated storage with its schema check, then rebuilt around the received tensors. Over
// a transport without views it is recv into fresh tensors.

#include "distributed/protocols.h"
#include "distributed/transfer_work.h"
#include "tensordict/impl.h"

namespace tdshm {

namespace {

void check_loan_destination(const Group& g, const LoanOptions& o) {
  if (o.dst && (*o.dst < 0 || *o.dst >= g.size())) {
    throw Error("loan: dst " + std::to_string(*o.dst) + " is not a rank of the group (size " +
                std::to_string(g.size()) + ")");
  }
}

}  // namespace

at::Tensor loan(at::IntArrayRef sizes, at::ScalarType dtype, const LoanOptions& o) {
  const Group g = detail::group_or_default(o.group);
  check_loan_destination(g, o);
  return g.transport().loan(sizes, dtype);
}

TensorDict loan(const TensorDict& like, const LoanOptions& o) {
  const Group g = detail::group_or_default(o.group);
  check_loan_destination(g, o);
  const detail::Transport& transport = g.transport();
  if (o.consolidated) {
    const TensorDict c = like.consolidate();  // (a copy unless consolidated: only its schema is kept)
    return TensorDict::from_consolidated(transport.loan({c.consolidated_storage().numel()}, at::kByte), c.schema());
  }
  return like.apply([&](const at::Tensor& t) { return transport.loan(t.sizes(), t.scalar_type()); });
}

size_t release_views(const TensorDict& td) {
  size_t n = td.is_consolidated() && release_view(td.consolidated_storage()) ? 1 : 0;
  for (const auto& key : td.sorted_leaf_keys()) n += release_view(td.get(key)) ? 1 : 0;
  return n;
}

TensorDict TensorDict::recv_view(const RecvOptions& o) const {
  const detail::Peer p = detail::resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  return detail::recv_view(*this, p, o);
}

namespace detail {

TensorDict recv_view(const TensorDict& td, const Peer& p, const RecvOptions& o) {
  const Transport& transport = p.group.transport();
  if (o.consolidated) {
    if (!td.is_consolidated()) {
      throw Error("recv_view(consolidated=True) needs a consolidated tensordict for the schema: call consolidate() "
                  "first");
    }
    const at::Tensor mine = td.consolidated_storage();
    if (!transport.can(p.rank).loans) {
      TensorDict fresh = TensorDict::from_consolidated(at::empty_like(mine), td.schema());
      irecv_consolidated(fresh, p, o, Completion::kWaited);
      return fresh;
    }
    const c10::intrusive_ptr<BatchWork> batch =
        transport.recv_views(p.rank, {kConsolidatedTag}, {schema_check(td.schema_fingerprint())});
    try {
      batch->wait();
    } catch (...) {
      rethrow_with_context("consolidated recv_view: ");
    }
    const at::Tensor storage = batch->result().at(0);
    if (storage.scalar_type() != at::kByte || storage.dim() != 1 || storage.numel() != mine.numel()) {
      throw SchemaError("consolidated recv_view: the sender's storage (" + std::to_string(storage.numel()) + " " +
                        c10::toString(storage.scalar_type()) + " elements) is not this tensordict's (" +
                        std::to_string(mine.numel()) + " bytes)");
    }
    return TensorDict::from_consolidated(storage, td.schema());
  }
  if (!transport.can(p.rank).loans) {
    TensorDict fresh = td.apply([](const at::Tensor& t) { return at::empty(t.sizes(), t.options()); });
    irecv_per_leaf(fresh, p, o, nullptr, Completion::kWaited);
    return fresh;
  }
  const std::shared_ptr<const SortedLeaves> sorted = sorted_leaves(td);
  std::shared_ptr<const PerLeafWire> wire_keep;
  const PerLeafWire& wire = wire_of(*sorted, o.init_tag, o.pseudo_rand, wire_keep);
  // Every leaf's view receive posted under one lock, waited as one; after a failure each message
  // is waited (every message is taken) and the first error names its key.
  const c10::intrusive_ptr<BatchWork> batch = transport.recv_views(p.rank, wire.c10d_tags, wire.checks);
  try {
    batch->wait();
  } catch (...) {
    wait_keyed(batch->messages(), sorted->keys, "recv_view of key ");
    throw;
  }
  const std::vector<at::Tensor> views = batch->result();
  try {
    return with_leaves(td, *sorted, views);  // the structure around the views, no key looked up
  } catch (...) {
    rethrow_with_context("recv_view: ");
  }
}

}  // namespace detail

}  // namespace tdshm
