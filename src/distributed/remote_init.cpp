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

#include "distributed/remote_memmaps.h"
#include "distributed/remote_metadata.h"
#include "distributed/transfer_common.h"
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

// A lazy stack travels as its consolidated shell {"0": member 0, ...} (lazy_stack.h) whose root
// tensordict's metadata names instead: {"cls": "LazyStackedTensorDict", "cls_metadata":
// {"stack_dim", "stack_dim_name", "is_locked"}} (_lazy.py's _reduce_get_metadata), the members
// being the children "0", "1", ...
constexpr std::string_view kLazyStackCls = "LazyStackedTensorDict";

void mark_lazy_root(pickle::PyValue& metadata, int64_t stack_dim) {
  metadata.set("cls", pickle::PyValue::str(std::string(kLazyStackCls)));
  pickle::PyValue cls_metadata = pickle::PyValue::dict();
  cls_metadata.set("stack_dim", pickle::PyValue::integer(stack_dim));
  cls_metadata.set("stack_dim_name", pickle::PyValue::none());
  cls_metadata.set("is_locked", pickle::PyValue::boolean(false));
  metadata.set("cls_metadata", std::move(cls_metadata));
}

bool is_lazy_root(const pickle::PyValue& metadata) {
  const pickle::PyValue* cls = metadata.find("cls");
  return cls != nullptr && cls->kind() == pickle::PyKind::kStr && std::get<std::string>(cls->v) == kLazyStackCls;
}

/// Turns a lazy stack's root back into the shell's (a TensorDict of the members' batch size, from
/// member "0"'s cls_metadata) and returns its stack_dim. Throws SchemaError for a malformed one.
int64_t unmark_lazy_root(pickle::PyValue& metadata) {
  const pickle::PyValue* cls_metadata = metadata.find("cls_metadata");
  if (cls_metadata == nullptr) throw SchemaError("from_remote_init: the lazy stack's metadata lacks \"cls_metadata\"");
  const pickle::PyValue* dim = cls_metadata->find("stack_dim");
  if (dim == nullptr) throw SchemaError("from_remote_init: the lazy stack's metadata lacks \"stack_dim\"");
  const int64_t stack_dim = dim->as_int("stack_dim of the lazy stack");
  pickle::PyValue shell_meta = pickle::PyValue::dict();
  shell_meta.set("device", pickle::PyValue::none());
  pickle::PyValue batch = pickle::PyValue::list({});
  if (const pickle::PyValue* first = metadata.find("0")) {
    if (const pickle::PyValue* m = first->find("cls_metadata")) {
      if (const pickle::PyValue* b = m->find("batch_size")) batch = *b;
    }
  }
  const size_t dims = batch.kind() == pickle::PyKind::kList ? batch.as_list("batch_size of member 0").items.size() : 0;
  shell_meta.set("names", pickle::PyValue::list(std::vector<pickle::PyValue>(dims)));
  shell_meta.set("batch_size", std::move(batch));
  shell_meta.set("is_locked", pickle::PyValue::boolean(false));
  metadata.set("cls", pickle::PyValue::str("TensorDict"));
  metadata.set("cls_metadata", std::move(shell_meta));
  return stack_dim;
}

ObjectList pickle_metadata(const TensorDict& consolidated, std::optional<std::string> storage_device,
                           std::optional<int64_t> lazy_stack_dim = std::nullopt) {
  ObjectList o;
  pickle::PyValue metadata = to_metadata(consolidated.schema(), std::move(storage_device));
  if (lazy_stack_dim) mark_lazy_root(metadata, *lazy_stack_dim);
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

/// The whole exchange as broadcasts from `root` (a group rank); `td` is used on the root only.
TensorDict broadcast_remote(const TensorDict* td, const Group& g, int root, const std::optional<c10::Device>& device) {
  if (g.rank() == root) {
    const TensorDict c = td->consolidate();
    const at::Tensor storage = c.consolidated_storage();
    ObjectList o = pickle_metadata(c, storage.device().str());
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
  return rebuild_consolidated(r.metadata, r.storage, device);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Shared with collectives.cpp (remote_metadata.h)

namespace detail {

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
                                const std::optional<c10::Device>& device) {
  Schema schema = from_metadata(metadata, static_cast<uint64_t>(storage.numel()));
  at::Tensor s = storage;
  if (device && *device != s.device()) s = s.to(*device);
  return TensorDict::from_consolidated(s, std::move(schema));
}

}  // namespace detail

namespace detail {

// init_remote point to point of `td` (a lazy stack's shell when lazy_stack_dim is set).
void init_remote_p2p(const TensorDict& td, const InitRemoteOptions& o, std::optional<int64_t> lazy_stack_dim) {
  if (!o.dst) throw Error("init_remote: `dst` must be provided (or use_broadcast=True)");
  const Peer p = resolve_peer("dst", "group_dst", o.dst, std::nullopt, o.group);
  const TensorDict c = td.consolidate();
  ObjectList meta = pickle_metadata(c, std::nullopt, lazy_stack_dim);
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

// from_remote_init point to point; with lazy_stack_dim, of a lazy stack (its shell is returned,
// its stack_dim stored there), else of a tensordict (a lazy stack's metadata is refused).
TensorDict from_remote_init_p2p(const FromRemoteInitOptions& o, int64_t* lazy_stack_dim) {
  if (!o.src) throw Error("from_remote_init: `src` must be provided");
  const Peer p = resolve_peer("src", "group_src", o.src, std::nullopt, o.group);
  auto sizes = int64_tensor({0});
  recv_now(p.group, sizes, p.rank, kRemoteInitTag);
  const at::Tensor bytes = pickle_buffer(sizes);
  recv_now(p.group, bytes, p.rank, kRemoteInitTag);
  Received r;
  bool lazy = false;  // the sender's is a lazy stack: received whole, then refused if unwanted
  int64_t stack_dim = 0;
  try {
    r = read_metadata(bytes);
    lazy = is_lazy_root(r.metadata);
    if (lazy) stack_dim = unmark_lazy_root(r.metadata);
  } catch (...) {
    // The sender's storage is still on its way: take it (a transport that drops mismatched
    // messages drops it on a receive of no bytes) so that the pair stays in step, then report the
    // refusal.
    if (p.group.transport().can().drop_mismatched) {
      try {
        recv_now(p.group, bytes_tensor(0), p.rank, kRemoteInitTag);
      } catch (...) {
      }
    }
    throw;
  }
  // Whether the sender's kind is the one asked for, told once the whole transfer is in (so that
  // the pair stays in step either way).
  auto checked = [&](TensorDict td) {
    if (lazy != (lazy_stack_dim != nullptr)) {
      throw SchemaError(lazy_stack_dim != nullptr
                            ? "LazyStackedTensorDict::from_remote_init: the sender's init_remote sends a tensordict, not "
                              "a lazy stack (use TensorDict::from_remote_init)"
                            : "from_remote_init: the sender's init_remote sends a LazyStackedTensorDict (use "
                              "LazyStackedTensorDict::from_remote_init)");
    }
    if (lazy_stack_dim != nullptr) *lazy_stack_dim = stack_dim;
    return td;
  };
  if (!p.group.transport().memmap_by_reference_with(p.rank)) {
    recv_now(p.group, r.storage, p.rank, kRemoteInitTag);
    return checked(rebuild_consolidated(r.metadata, r.storage, o.device));
  }
  // The memmap table, then the storage without the referenced leaves (remote_memmaps.h). A
  // refused table leaves the pair out of step; the error says so through its type (SchemaError).
  Schema schema = from_metadata(r.metadata, static_cast<uint64_t>(r.storage.numel()));
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
  TensorDict td = rebuild_with_references(r.storage, schema, refs);
  if (o.device && *o.device != r.storage.device()) td = td.to(*o.device);
  return checked(std::move(td));
}

}  // namespace detail

void TensorDict::init_remote(const InitRemoteOptions& o) const {
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    broadcast_remote(this, g, g.rank(), o.device);
    return;
  }
  init_remote_p2p(*this, o, std::nullopt);
}

TensorDict TensorDict::from_remote_init(const FromRemoteInitOptions& o) {
  if (o.use_broadcast) {
    if (!o.src) throw Error("from_remote_init: `src` must be provided");
    const Group g = group_or_default(o.group);
    return broadcast_remote(nullptr, g, root_in_group(g, *o.src), o.device);
  }
  return from_remote_init_p2p(o, nullptr);
}

void LazyStackedTensorDict::init_remote(const InitRemoteOptions& o) const {
  if (o.use_broadcast) throw Error("LazyStackedTensorDict::init_remote: use_broadcast is not supported for lazy stacks");
  init_remote_p2p(shell(), o, stack_dim_);
}

LazyStackedTensorDict LazyStackedTensorDict::from_remote_init(const FromRemoteInitOptions& o) {
  if (o.use_broadcast) {
    throw Error("LazyStackedTensorDict::from_remote_init: use_broadcast is not supported for lazy stacks");
  }
  int64_t stack_dim = 0;
  const TensorDict shell = from_remote_init_p2p(o, &stack_dim);
  std::vector<TensorDict> members;
  for (size_t m = 0; m < shell.size(); ++m) {
    const std::string key = std::to_string(m);
    if (!shell.contains(key) || !shell.get_value(key).is_tensordict()) {
      throw SchemaError("LazyStackedTensorDict::from_remote_init: the lazy stack's metadata has no member \"" + key +
                        "\" (members are the children \"0\", \"1\", ...)");
    }
    members.push_back(shell.get_tensordict(key));
  }
  return LazyStackedTensorDict(std::move(members), stack_dim);
}

TensorDict TensorDict::broadcast(const BroadcastOptions& o) const {
  const Group g = group_or_default(o.group);
  return broadcast_remote(this, g, root_in_group(g, o.src), o.device);
}

}  // namespace tdshm
