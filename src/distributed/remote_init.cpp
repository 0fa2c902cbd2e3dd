// init_remote / from_remote_init / broadcast (docs/semantics.md, "init_remote, from_remote_init
// and broadcast"; docs/wire.md): the consolidated storage plus
// tensordict's metadata dict, exactly as tensordict sends them.
//
// Wire (tag 0):
//  * init_remote(dst): send_object_list([metadata]) — an int64 tensor holding the pickle's byte
//    length, then the uint8 pickle (protocol 4, src/pickle/) — then the storage.
//    from_remote_init(src) mirrors it with receives.
//  * use_broadcast / broadcast: broadcast_object_list([metadata]) — the same two tensors,
//    broadcast — then broadcast(storage); the metadata also holds "_storage_device".
// The receiver allocates everything it receives into, so no user-owned tensor is written, and
// trusts nothing it reads: the length is bounded before allocating, the pickle is read by a
// decoder that refuses anything but plain data (no globals beyond a tensorclass's name, no
// REDUCE), and the metadata is checked against the storage it describes (from_metadata) before
// the tree is rebuilt. A MemoryMappedTensor leaf travels by value (in the storage), as under
// tensordict: its bytes arrive, its file does not; except point to point between two ranks that
// both pass memmaps by reference (remote_memmaps.h: one message more, and the storage without
// those leaves' bytes).

#include "distributed/protocols.h"
#include "distributed/remote_memmaps.h"
#include "distributed/remote_metadata.h"
#include "distributed/transfer_work.h"
#include "pickle/pickle.h"

#include <cstring>

namespace tdshm {

using namespace detail;

namespace {

constexpr int kRemoteInitTag = 0;

/// The pickled metadata as send_object_list / broadcast_object_list carry it.
struct ObjectList {
  at::Tensor sizes;  // int64 [1]: the pickle's byte length
  at::Tensor bytes;  // uint8: the pickle
};

// A lazy stack travels as its consolidated shell {"0": member 0, ...} (lazy_stack.h) whose
// schema's root is marked a lazy stack (SchemaNode::lazy_stack_dim), so that tensordict's
// metadata names it {"cls": "LazyStackedTensorDict", "cls_metadata": {"stack_dim", ...}}.
// `LazyRoot` is that stack_dim, or nullopt for a tensordict.
using LazyRoot = std::optional<int64_t>;

/// The shell's schema with its root marked a lazy stack along `stack_dim`.
Schema lazy_root_schema(Schema s, int64_t stack_dim) {
  s.root.lazy_stack_dim = stack_dim;
  s.root.batch_size.insert(s.root.batch_size.begin() + stack_dim, static_cast<int64_t>(s.root.entries.size()));
  return s;
}

/// Whether the sender's tree is the kind asked for, told once the whole transfer is in (so that
/// the ranks stay in step either way).
void check_kind(const LazyRoot& got, bool want_lazy, const char* method) {
  if (got.has_value() == want_lazy) return;
  throw SchemaError(want_lazy ? std::string("LazyStackedTensorDict::") + method +
                                    ": the sender's sends a tensordict, not a lazy stack (use TensorDict::" + method + ")"
                              : std::string(method) + ": the sender's sends a LazyStackedTensorDict (use "
                                                      "LazyStackedTensorDict::" + method + ")");
}

ObjectList pickle_metadata(const TensorDict& consolidated, std::optional<std::string> storage_device,
                           const LazyRoot& lazy) {
  ObjectList o;
  const pickle::PyValue metadata = lazy ? to_metadata(lazy_root_schema(consolidated.schema(), *lazy), std::move(storage_device))
                                        : to_metadata(consolidated.schema(), std::move(storage_device));
  o.bytes = pickled_tensor(metadata);
  o.sizes = int64_tensor({o.bytes.numel()});
  return o;
}

/// The pickle buffer for a received length.
at::Tensor pickle_buffer(const at::Tensor& sizes) {
  const int64_t n = sizes.data_ptr<int64_t>()[0];
  if (n <= 0 || n > kMaxPickleBytes) {
    throw TransportError("from_remote_init: the sender announces " + std::to_string(n) +
                         " bytes of pickled metadata, which is not a valid transfer (does the sender call init_remote "
                         "with the same group and mode?)");
  }
  return bytes_tensor(n);
}

/// The metadata dict of a received pickle, and the storage it announces (allocated on CPU).
struct Received {
  pickle::PyValue metadata;
  at::Tensor storage;
};

Received read_metadata(const at::Tensor& bytes) {
  Received r;
  r.metadata = load_metadata(bytes, "from_remote_init");
  r.storage = bytes_tensor(static_cast<int64_t>(metadata_total_bytes(r.metadata)));
  return r;
}

/// The whole exchange as broadcasts from `root` (a group rank); `td` (a lazy stack's shell when
/// `lazy` is set) is used on the root only. The other ranks' result is a lazy stack's shell when
/// the root's is one (`received` says which).
TensorDict broadcast_remote(const TensorDict* td, const LazyRoot& lazy, const Group& g, int root,
                            const std::optional<c10::Device>& device, LazyRoot* received) {
  if (g.rank() == root) {
    const TensorDict c = td->consolidate();
    const at::Tensor storage = c.consolidated_storage();
    ObjectList o = pickle_metadata(c, storage.device().str(), lazy);
    *received = lazy;
    broadcast_now(g, o.sizes, root);
    broadcast_now(g, o.bytes, root);
    broadcast_now(g, storage, root);
    return c;
  }
  auto sizes = int64_tensor({0});
  broadcast_now(g, sizes, root);
  const at::Tensor bytes = pickle_buffer(sizes);
  broadcast_now(g, bytes, root);
  // A refused metadata leaves the group out of step (the storage's size is unknown); the error
  // says so through its type (SchemaError) and message.
  const Received r = read_metadata(bytes);
  broadcast_now(g, r.storage, root);
  return rebuild_consolidated(r.metadata, r.storage, device, received);
}

/// TensorDict::broadcast and init_remote/from_remote_init(use_broadcast) of a tensordict.
TensorDict broadcast_tensordict(const TensorDict* td, const Group& g, int root, const std::optional<c10::Device>& device,
                                const char* method) {
  LazyRoot received;
  TensorDict out = broadcast_remote(td, std::nullopt, g, root, device, &received);
  check_kind(received, false, method);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Shared with collectives.cpp (remote_metadata.h)

namespace detail {

std::optional<int64_t> take_lazy_root(Schema& schema) {
  if (!schema.root.lazy_stack_dim) return std::nullopt;
  const int64_t dim = *schema.root.lazy_stack_dim;  // validated: within the stacked batch
  schema.root.lazy_stack_dim.reset();
  schema.root.batch_size.erase(schema.root.batch_size.begin() + dim);
  return dim;
}

at::Tensor pickled_tensor(const pickle::PyValue& metadata) {
  const std::vector<uint8_t> pickled = pickle::dumps(metadata);
  at::Tensor t = bytes_tensor(static_cast<int64_t>(pickled.size()));
  if (!pickled.empty()) std::memcpy(t.data_ptr(), pickled.data(), pickled.size());
  return t;
}

pickle::PyValue load_metadata(const at::Tensor& bytes, const char* method) {
  pickle::PyValue metadata = pickle::loads(
      std::span<const uint8_t>(bytes.data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel())), metadata_pickle_limits());
  if (metadata.kind() != pickle::PyKind::kDict) {
    throw SchemaError(std::string(method) + ": the sender's metadata is a " + pickle::type_name(metadata) +
                      ", not a dict");
  }
  const uint64_t total = metadata_total_bytes(metadata);
  if (total > kMaxStorageBytes) {
    throw SchemaError(std::string(method) + ": the sender's metadata announces a storage of " + std::to_string(total) +
                      " bytes (more than 1 TiB)");
  }
  return metadata;
}

TensorDict rebuild_consolidated(const pickle::PyValue& metadata, const at::Tensor& storage,
                                const std::optional<c10::Device>& device, std::optional<int64_t>* lazy_root) {
  Schema schema = from_metadata(metadata, static_cast<uint64_t>(storage.numel()));
  if (lazy_root != nullptr) *lazy_root = take_lazy_root(schema);
  at::Tensor s = storage;
  if (device && *device != s.device()) s = s.to(*device);
  return TensorDict::from_consolidated(s, std::move(schema));
}

}  // namespace detail

namespace {

// init_remote point to point of `td` (a lazy stack's shell when `lazy` is set).
void init_remote_p2p(const TensorDict& td, const InitRemoteOptions& o, const LazyRoot& lazy) {
  if (!o.dst) throw Error("init_remote: `dst` must be provided (or use_broadcast=True)");
  const Peer p = resolve_peer("dst", "group_dst", o.dst, std::nullopt, o.group);
  const TensorDict c = td.consolidate();
  ObjectList meta = pickle_metadata(c, std::nullopt, lazy);
  std::vector<WorkPtr> works{send_one(p.group, meta.sizes, p.rank, kRemoteInitTag),
                             send_one(p.group, meta.bytes, p.rank, kRemoteInitTag)};
  const at::Tensor storage = c.consolidated_storage();
  if (!p.group.transport().memmap_by_reference_with(p.rank)) {
    works.push_back(send_one(p.group, storage, p.rank, kRemoteInitTag));
    wait_all(works);
    return;
  }
  const std::vector<MemmapReference> refs = memmap_references(td, c.schema());
  const at::Tensor table = encode_references(refs);
  works.push_back(send_one(p.group, int64_tensor({table.numel()}), p.rank, kRemoteInitTag));
  works.push_back(send_one(p.group, table, p.rank, kRemoteInitTag));
  for (const auto& [from, to] : storage_ranges(static_cast<uint64_t>(storage.numel()), refs)) {
    works.push_back(send_one(p.group, storage.narrow(0, static_cast<int64_t>(from), static_cast<int64_t>(to - from)),
                             p.rank, kRemoteInitTag));
  }
  wait_all(works);
}

// from_remote_init point to point: the sender's tree, a lazy stack's shell when `received` is
// set on return.
TensorDict from_remote_init_p2p(const FromRemoteInitOptions& o, LazyRoot* received) {
  if (!o.src) throw Error("from_remote_init: `src` must be provided");
  const Peer p = resolve_peer("src", "group_src", o.src, std::nullopt, o.group);
  auto sizes = int64_tensor({0});
  recv_now(p.group, sizes, p.rank, kRemoteInitTag);
  const at::Tensor bytes = pickle_buffer(sizes);
  recv_now(p.group, bytes, p.rank, kRemoteInitTag);
  Received r;
  try {
    r = read_metadata(bytes);
  } catch (...) {
    // The sender's storage is still on its way: take it (a transport that drops mismatched
    // messages drops it on a receive of no bytes) so that the pair stays in step, then report the
    // refusal.
    if (p.group.transport().can(p.rank).drop_mismatched) {
      try {
        recv_now(p.group, bytes_tensor(0), p.rank, kRemoteInitTag);
      } catch (...) {
      }
    }
    throw;
  }
  if (!p.group.transport().memmap_by_reference_with(p.rank)) {
    recv_now(p.group, r.storage, p.rank, kRemoteInitTag);
    return rebuild_consolidated(r.metadata, r.storage, o.device, received);
  }
  // The memmap table, then the storage without the referenced leaves (remote_memmaps.h). A
  // refused table leaves the pair out of step; the error says so through its type (SchemaError).
  Schema schema = from_metadata(r.metadata, static_cast<uint64_t>(r.storage.numel()));
  *received = take_lazy_root(schema);
  auto table_size = int64_tensor({0});
  recv_now(p.group, table_size, p.rank, kRemoteInitTag);
  const int64_t n = table_size.data_ptr<int64_t>()[0];
  if (n < 0 || n > kMaxReferenceTableBytes) {
    throw SchemaError("from_remote_init: the sender announces a memmap table of " + std::to_string(n) + " bytes");
  }
  const at::Tensor table = bytes_tensor(n);
  recv_now(p.group, table, p.rank, kRemoteInitTag);
  const std::vector<MemmapReference> refs = decode_references(table, schema);
  for (const auto& [from, to] : storage_ranges(static_cast<uint64_t>(r.storage.numel()), refs)) {
    recv_now(p.group, r.storage.narrow(0, static_cast<int64_t>(from), static_cast<int64_t>(to - from)), p.rank,
             kRemoteInitTag);
  }
  TensorDict td = rebuild_with_references(r.storage, schema, refs, o.memmap_writable);
  if (o.device && *o.device != r.storage.device()) td = td.to(*o.device);
  return td;
}

}  // namespace

void TensorDict::init_remote(const InitRemoteOptions& o) const {
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    broadcast_tensordict(this, g, g.rank(), o.device, "init_remote");
    return;
  }
  init_remote_p2p(*this, o, std::nullopt);
}

TensorDict TensorDict::from_remote_init(const FromRemoteInitOptions& o) {
  if (o.use_broadcast) {
    if (!o.src) throw Error("from_remote_init: `src` must be provided");
    const Group g = group_or_default(o.group);
    return broadcast_tensordict(nullptr, g, root_in_group(g, *o.src), o.device, "from_remote_init");
  }
  LazyRoot received;
  TensorDict td = from_remote_init_p2p(o, &received);
  check_kind(received, false, "from_remote_init");
  return td;
}

TensorDict TensorDict::broadcast(const BroadcastOptions& o) const {
  const Group g = group_or_default(o.group);
  return broadcast_tensordict(this, g, root_in_group(g, o.src), o.device, "broadcast");
}

LazyStackedTensorDict LazyStackedTensorDict::from_shell(const TensorDict& shell, int64_t stack_dim) {
  std::vector<TensorDict> members;
  for (size_t m = 0; m < shell.size(); ++m) {
    const std::string key = std::to_string(m);
    if (!shell.contains(key) || !shell.get_value(key).is_tensordict()) {
      throw SchemaError("LazyStackedTensorDict: the lazy stack's metadata has no member \"" + key +
                        "\" (members are the children \"0\", \"1\", ...)");
    }
    members.push_back(shell.get_tensordict(key));
  }
  return LazyStackedTensorDict(std::move(members), stack_dim);
}

void LazyStackedTensorDict::init_remote(const InitRemoteOptions& o) const {
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    broadcast_in_group(g, g.rank(), o.device);
    return;
  }
  init_remote_p2p(shell(), o, stack_dim_);
}

LazyStackedTensorDict LazyStackedTensorDict::from_remote_init(const FromRemoteInitOptions& o) {
  if (o.use_broadcast) {
    if (!o.src) throw Error("LazyStackedTensorDict::from_remote_init: `src` must be provided");
    const Group g = group_or_default(o.group);
    return LazyStackedTensorDict({}).broadcast_in_group(g, root_in_group(g, *o.src), o.device);
  }
  LazyRoot received;
  const TensorDict shell = from_remote_init_p2p(o, &received);
  check_kind(received, true, "from_remote_init");
  return from_shell(shell, *received);
}

LazyStackedTensorDict LazyStackedTensorDict::broadcast(const BroadcastOptions& o) const {
  const Group g = group_or_default(o.group);
  return broadcast_in_group(g, root_in_group(g, o.src), o.device);
}

LazyStackedTensorDict LazyStackedTensorDict::broadcast_in_group(const Group& g, int root,
                                                                const std::optional<c10::Device>& device) const {
  LazyRoot received;
  if (g.rank() == root) {
    // tensordict returns the consolidated stack on the source; its shell is what travels.
    LazyStackedTensorDict c = consolidate();
    broadcast_remote(c.consolidated_.get(), stack_dim_, g, root, device, &received);
    return c;
  }
  const TensorDict shell = broadcast_remote(nullptr, std::nullopt, g, root, device, &received);
  check_kind(received, true, "broadcast");
  return from_shell(shell, *received);
}

}  // namespace tdshm
