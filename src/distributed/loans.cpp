// Loans and views in the transfer layer (docs/loans.md). tdshm::loan asks the group's transport
// for tensors whose sends go by reference (Transport::loan; an ordinary tensor where the
// transport has no loans), so every transfer of the tensordict API sends a loaned tree by
// reference without a change: the transport sees the bytes are a loan. TensorDict::recv_view
// receives a tree as views (Transport::recv_view): per-leaf with recv's tags and key checks, or
// the consolidated storage with its schema check, then rebuilt around the received tensors. Over
// a transport without views it is recv into fresh tensors.

#include "distributed/transfer_common.h"
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

namespace {

// Waits for every one of `works` (so that every message is taken, even after a failure), then
// rethrows the first failure with the context `what(i)` of its work.
template <class What>
void wait_each(const std::vector<WorkPtr>& works, What what) {
  std::exception_ptr first;
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      works[i]->wait();
    } catch (...) {
      if (!first) first = current_with_context(what(i));
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace

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
    const std::vector<WorkPtr> works{transport.recv_view(p.rank, kConsolidatedTag, schema_check(td.schema_fingerprint()))};
    wait_each(works, [](size_t) { return std::string("consolidated recv_view: "); });
    const at::Tensor storage = works[0]->result().at(0);
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
  const size_t n = sorted->keys.size();
  std::vector<WorkPtr> works;
  works.reserve(n);
  for (size_t i = 0; i < n; ++i) works.push_back(transport.recv_view(p.rank, wire.c10d_tags[i], wire.checks[i]));
  wait_each(works, [&](size_t i) { return "recv_view of key " + sorted->keys[i].str() + ": "; });
  c10::SmallVector<at::Tensor, 8> views;
  for (const WorkPtr& w : works) views.push_back(w->result().at(0));
  try {
    return with_leaves(td, *sorted, views);  // the structure around the views, no key looked up
  } catch (...) {
    rethrow_with_context("recv_view: ");
  }
}

}  // namespace detail

}  // namespace tdshm
