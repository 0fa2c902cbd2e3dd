// The collectives of tensordict 0.14 (TensorDictBase.reduce / _reduce,
// all_reduce, all_gather, scatter) on TensorDict, with exactly the c10d calls tensordict makes,
// through the generic c10d::ProcessGroup API of the group's backend (so the same code runs on
// gloo and on shm, whose ProcessGroupShm implements these collectives).
//
// Wire:
//  * reduce: one reduce(leaf, root = dst) per tensor leaf, in sorted_leaf_keys() order (keys
//    sorted at every level, depth first). tensordict's _reduce recurses into a nested
//    tensordict without passing `group` on (its nested leaves go over the default group); tdshm
//    passes the group to every leaf, which is the same for the default group.
//  * all_reduce: one allreduce(leaf) per tensor leaf in insertion order, depth first (_fast_apply).
//  * all_gather: all_gather_object(metadata) as torch 1.13 writes it — allgather of each rank's
//    pickle length (int64 [1]), then allgather of the pickles, each padded to the longest — then
//    allgather of the consolidated storages, zero-padded to the largest. The metadata is
//    consolidate(metadata=True)'s dict plus "_total_bytes".
//  * scatter: scatter_object_list(metadata per rank) as torch 1.13 writes it — broadcast of the
//    longest pickle's length (int64 [1]), scatter of the pickles padded to it, scatter of each
//    pickle's length (int64 [1]) — then scatter of the storages zero-padded to the largest. Each
//    metadata dict has "_total_bytes", "_max_bytes" and "_storage_device", in that order.
// torch pads pickles with whatever resize_ leaves in memory; tdshm pads with zeros (receivers
// read only the announced length). tensordict's all_gather and scatter call the inner
// tensordict of a tensorclass, so no "_tensorclass_type" travels and the results are plain
// tensordicts; tdshm drops the root's tensorclass name the same way.
//
// Received metadata is untrusted (load_metadata, from_metadata): every length is bounded before
// anything is allocated. A refused metadata dict leaves the group out of step (the sizes of the
// storage messages are unknown); the error says so through its type (SchemaError) and message.

#include <tdshm/lazy_stack.h>
#include "distributed/messages.h"
#include "distributed/remote_metadata.h"
#include "distributed/transfer_work.h"
#include "tensordict/impl.h"

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <string_view>

namespace tdshm {

using namespace detail;

namespace {

// ---------------------------------------------------------------------------------------------
// Checks

/// The group rank of global rank `global` (`name` of `method`, for the message).
int member_rank(const Group& g, int global, const char* method, const char* name) {
  if (!g.registered()) return g.group_rank(global);  // throws: global ranks mean nothing to it
  const std::vector<int>& ranks = g.global_ranks();
  const auto it = std::find(ranks.begin(), ranks.end(), global);
  if (it == ranks.end()) {
    std::string list;
    for (const int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
    throw Error(std::string(method) + ": `" + name + "` = " + std::to_string(global) +
                " is not a rank of the group (its global ranks: " + list + ")");
  }
  return static_cast<int>(it - ranks.begin());
}

/// An announced length, bounded before anything of that size is allocated.
int64_t checked_length(int64_t n, int64_t max, const char* method, const std::string& what) {
  if (n < 0 || n > max) {
    throw TransportError(std::string(method) + ": " + what + " is " + std::to_string(n) +
                         " bytes, which is not a valid transfer (do all ranks call " + method +
                         " with the same group?)");
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// Per-leaf collectives (reduce, all_reduce)

/// The tensor leaves of `node` in insertion order, depth first (tensordict's _fast_apply order;
/// a lazy stack's members one after the other).
void insertion_leaves(const TensorDictImpl& node, std::vector<at::Tensor>& out) {
  for (const auto& [k, v] : node.entries) {
    if (v.is_tensor()) {
      out.push_back(v.tensor());
    } else if (v.is_tensordict()) {
      insertion_leaves(*v.tensordict().impl(), out);
    } else if (v.is_lazy_stack()) {
      for (const TensorDict& m : v.lazy_stack().tensordicts()) insertion_leaves(*m.impl(), out);
    }
  }
}

/// The key of the i-th tensor leaf in insertion order (for messages only: built on error).
Key insertion_leaf_key(const TensorDict& td, size_t i) {
  const auto leaves = sorted_leaves(td);
  if (i >= leaves->insertion_order.size()) throw std::logic_error("insertion_leaf_key: no leaf " + std::to_string(i));
  return leaves->keys[leaves->insertion_order[i]];
}

/// Posts post({leaf}) for every leaf (a non-contiguous leaf through a contiguous copy, written
/// back once its work succeeded); every leaf is checked first. Returns the works (with
/// return_works) or waits for them all. `verb` prefixes error messages ("reduce of key ").
Transfer per_leaf_collective(const std::vector<at::Tensor>& leaves, const std::function<Key(size_t)>& key_of,
                             const char* verb, c10d::OpType type, bool return_works,
                             const std::function<WorkPtr(std::vector<at::Tensor>&)>& post) {
  for (size_t i = 0; i < leaves.size(); ++i) {
    check_receive_target(leaves[i], [&] { return verb + key_of(i).str(); });
  }
  std::vector<WorkPtr> works;
  works.reserve(leaves.size());
  try {
    for (const at::Tensor& leaf : leaves) {
      std::vector<at::Tensor> one{leaf.is_contiguous() ? leaf : leaf.contiguous()};
      WorkPtr w = post(one);
      if (!one[0].is_same(leaf)) {
        w = c10::make_intrusive<TransferWork>(verb + key_of(works.size()).str() + ": ", std::vector<WorkPtr>{w}, type,
                                              [leaf, staged = one[0]]() mutable { leaf.copy_(staged); });
      }
      works.push_back(std::move(w));
    }
  } catch (...) {
    // The backend refused leaf works.size(): the collectives already posted stay matched with the
    // peers' (which refuse the same leaf), so they are waited for before the refusal is reported.
    for (const WorkPtr& w : works) {
      try {
        w->wait();
      } catch (...) {
      }
    }
    rethrow_with_context(verb + key_of(works.size()).str() + ": ");
  }
  Transfer t;
  if (return_works) {
    t.has_works = true;
    t.works = std::move(works);
  } else {
    wait_keyed(works, key_of, verb);
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Objects and storages (all_gather, scatter)

void allgather_now(const Group& g, std::vector<at::Tensor> outputs, at::Tensor input) {
  std::vector<std::vector<at::Tensor>> out{std::move(outputs)};
  std::vector<at::Tensor> in{std::move(input)};
  g.backend().allgather(out, in)->wait();
}

/// scatter from group rank `root`: `inputs` on the root (one per rank), empty elsewhere.
void scatter_now(const Group& g, const at::Tensor& output, std::vector<at::Tensor> inputs, int root) {
  std::vector<at::Tensor> out{output};
  std::vector<std::vector<at::Tensor>> in;
  if (!inputs.empty()) in.push_back(std::move(inputs));
  c10d::ScatterOptions o;
  o.rootRank = root;
  g.backend().scatter(out, in, o)->wait();
}

/// `t` (1-D uint8) zero-padded to `n` bytes (t itself when it has n bytes).
at::Tensor padded(const at::Tensor& t, int64_t n) {
  if (t.numel() == n) return t;
  at::Tensor p = at::zeros({n}, at::TensorOptions().dtype(at::kByte));
  p.narrow(0, 0, t.numel()).copy_(t);
  return p;
}

/// Removes the str key `key` from a dict value and returns its value, if it was there.
std::optional<pickle::PyValue> take(pickle::PyValue& dict, std::string_view key) {
  auto& entries = dict.as_dict("metadata").entries;
  const auto it = std::find_if(entries.begin(), entries.end(), [key](const pickle::PyDictEntry& e) {
    return e.key.kind() == pickle::PyKind::kStr && e.key.as_str("key") == key;
  });
  if (it == entries.end()) return std::nullopt;
  pickle::PyValue v = std::move(it->value);
  entries.erase(it);
  return v;
}

/// What tensordict's all_gather / scatter pickle for a consolidated tensordict: its metadata
/// dict with "_total_bytes", and no "_tensorclass_type" (they work on the inner tensordict).
pickle::PyValue collective_metadata(const TensorDict& consolidated) {
  pickle::PyValue m = to_metadata(consolidated.schema(), std::nullopt);
  take(m, "_tensorclass_type");
  return m;
}

/// The consolidated storage of `td` (consolidating it: a copy unless it is consolidated), which
/// must be on the CPU.
TensorDict consolidated_on_cpu(const TensorDict& td, const char* method) {
  TensorDict c = td.consolidate();
  check_leaf(c.consolidated_storage(), [method] { return std::string(method) + ": the consolidated storage"; });
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The methods

Transfer TensorDict::reduce(const ReduceOptions& o) {
  const Group g = group_or_default(o.group);
  const int root = member_rank(g, o.dst, "reduce", "dst");
  const std::shared_ptr<const SortedLeaves> sorted = sorted_leaves(*this);
  std::vector<at::Tensor> leaves;
  leaves.reserve(sorted->keys.size());
  for (const Key& k : sorted->keys) leaves.push_back(get(k));
  c10d::ReduceOptions ro;
  ro.reduceOp = o.op;
  ro.rootRank = root;
  // tensordict returns the futures only with async_op and return_premature; async_op alone waits.
  return per_leaf_collective(
      leaves, [&sorted](size_t i) { return sorted->keys[i]; }, "reduce of key ", c10d::OpType::REDUCE,
      o.async_op && o.return_premature, [&](std::vector<at::Tensor>& t) { return g.backend().reduce(t, ro); });
}

Transfer TensorDict::all_reduce(const AllReduceOptions& o) {
  const Group g = group_or_default(o.group);
  std::vector<at::Tensor> leaves;
  insertion_leaves(*impl(), leaves);
  c10d::AllreduceOptions ao;
  ao.reduceOp = o.op;
  return per_leaf_collective(
      leaves, [this](size_t i) { return insertion_leaf_key(*this, i); }, "all_reduce of key ", c10d::OpType::ALLREDUCE,
      o.async_op, [&](std::vector<at::Tensor>& t) { return g.backend().allreduce(t, ao); });
}

std::vector<TensorDict> TensorDict::all_gather(const AllGatherOptions& o) const {
  const Group g = group_or_default(o.group);
  const TensorDict c = consolidated_on_cpu(*this, "all_gather");
  const at::Tensor storage = c.consolidated_storage();
  const auto n = static_cast<size_t>(g.size());
  try {
    // all_gather_object([metadata]): the pickles' lengths, then the pickles padded to the longest.
    const at::Tensor pickle = pickled_tensor(collective_metadata(c));
    const at::Tensor lengths = at::zeros({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kLong));
    std::vector<at::Tensor> length_views;
    for (size_t r = 0; r < n; ++r) length_views.push_back(lengths.narrow(0, static_cast<int64_t>(r), 1));
    allgather_now(g, length_views, int64_tensor({pickle.numel()}));
    int64_t longest = 0;
    for (size_t r = 0; r < n; ++r) {
      longest = std::max(longest, checked_length(lengths.data_ptr<int64_t>()[r], kMaxPickleBytes, "all_gather",
                                                 "the pickled metadata of rank " + std::to_string(r)));
    }
    const at::Tensor pickles = bytes_tensor(longest * static_cast<int64_t>(n));
    std::vector<at::Tensor> pickle_views;
    for (size_t r = 0; r < n; ++r) pickle_views.push_back(pickles.narrow(0, static_cast<int64_t>(r) * longest, longest));
    allgather_now(g, pickle_views, padded(pickle, longest));
    std::vector<pickle::PyValue> metadata;
    int64_t largest = 0;
    for (size_t r = 0; r < n; ++r) {
      metadata.push_back(load_metadata(pickle_views[r].narrow(0, 0, lengths.data_ptr<int64_t>()[r]), "all_gather"));
      largest = std::max(largest, static_cast<int64_t>(metadata_total_bytes(metadata.back())));
    }
    // The storages, zero-padded to the largest.
    const at::Tensor storages = bytes_tensor(largest * static_cast<int64_t>(n));
    std::vector<at::Tensor> storage_views;
    for (size_t r = 0; r < n; ++r) {
      storage_views.push_back(storages.narrow(0, static_cast<int64_t>(r) * largest, largest));
    }
    // gloo divides by the message size (SIGFPE on 0 bytes): when every storage is empty (every
    // rank knows it from the metadata) there is nothing to exchange.
    if (largest > 0) allgather_now(g, storage_views, padded(storage, largest));
    std::vector<TensorDict> out;
    out.reserve(n);
    for (size_t r = 0; r < n; ++r) {
      const auto total = static_cast<int64_t>(metadata_total_bytes(metadata[r]));
      out.push_back(rebuild_consolidated(metadata[r], storage_views[r].narrow(0, 0, total), std::nullopt));
    }
    return out;
  } catch (...) {
    rethrow_with_context("all_gather: ");
  }
}

TensorDict TensorDict::scatter(const ScatterOptions& o) const {
  const Group g = group_or_default(o.group);
  const int root = member_rank(g, o.src, "scatter", "src");
  const int n = g.size();
  const bool is_root = g.rank() == root;
  // The root's messages, one per rank: pickles and their lengths, storages.
  std::vector<at::Tensor> pickles, lengths, storages;
  int64_t longest = 0;
  if (is_root) {
    if (!o.tensordicts) {
      throw Error("scatter: `tensordicts` must be given on the source rank (src = " + std::to_string(o.src) +
                  "): one tensordict per rank of the group (" + std::to_string(n) + ")");
    }
    if (o.tensordicts->size() != static_cast<size_t>(n)) {
      throw Error("scatter: `tensordicts` holds " + std::to_string(o.tensordicts->size()) +
                  " tensordicts but the group has " + std::to_string(n) + " ranks: give exactly one per rank");
    }
    std::vector<TensorDict> consolidated;
    int64_t largest = 0;
    for (const TensorDict& td : *o.tensordicts) {
      consolidated.push_back(consolidated_on_cpu(td, "scatter"));
      largest = std::max(largest, consolidated.back().consolidated_storage().numel());
    }
    for (const TensorDict& c : consolidated) {
      pickle::PyValue m = collective_metadata(c);
      m.set("_max_bytes", pickle::PyValue::integer(largest));
      m.set("_storage_device", pickle::PyValue::str(c.consolidated_storage().device().str()));
      pickles.push_back(pickled_tensor(m));
      lengths.push_back(int64_tensor({pickles.back().numel()}));
      longest = std::max(longest, pickles.back().numel());
      storages.push_back(padded(c.consolidated_storage(), largest));
    }
    for (at::Tensor& p : pickles) p = padded(p, longest);
  }
  try {
    // scatter_object_list: the longest pickle's length, the pickles, their lengths.
    const at::Tensor longest_t = int64_tensor({longest});
    broadcast_now(g, longest_t, root);
    longest = checked_length(longest_t.data_ptr<int64_t>()[0], kMaxPickleBytes, "scatter", "the longest pickled metadata");
    const at::Tensor pickle = bytes_tensor(longest);
    scatter_now(g, pickle, std::move(pickles), root);
    const at::Tensor length = int64_tensor({0});
    scatter_now(g, length, std::move(lengths), root);
    pickle::PyValue metadata = load_metadata(
        pickle.narrow(0, 0, checked_length(length.data_ptr<int64_t>()[0], longest, "scatter", "this rank's pickled metadata")),
        "scatter");
    // Then the storage, padded to "_max_bytes".
    const auto total = static_cast<int64_t>(metadata_total_bytes(metadata));
    const std::optional<pickle::PyValue> max_bytes = take(metadata, "_max_bytes");
    if (!max_bytes) throw SchemaError("scatter: the source's metadata has no \"_max_bytes\"");
    const int64_t largest = max_bytes->as_int("_max_bytes");
    if (largest < total || static_cast<uint64_t>(largest) > kMaxStorageBytes) {
      throw SchemaError("scatter: the source's metadata announces \"_max_bytes\" " + std::to_string(largest) +
                        " for a storage of " + std::to_string(total) + " bytes");
    }
    const at::Tensor storage = bytes_tensor(largest);
    if (largest > 0) scatter_now(g, storage, std::move(storages), root);  // as in all_gather
    return rebuild_consolidated(metadata, storage.narrow(0, 0, total), o.device);
  } catch (...) {
    rethrow_with_context("scatter: ");
  }
}

}  // namespace tdshm
