// init_remote / from_remote_init / broadcast (SEMANTICS.md): the consolidated storage plus
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
// tensordict: its bytes arrive, its file does not.

#include "distributed/remote_metadata.h"
#include "distributed/transfer_common.h"
#include "pickle/pickle.h"

#include <cstring>

namespace tdshm {

using namespace detail;

namespace {

constexpr int kRemoteInitTag = 0;
// Bounds on what a peer may announce (a corrupt or hostile peer makes the transfer fail, never an
// absurd allocation): metadata is never this large; a storage is at most 1 TiB.
constexpr int64_t kMaxPickleBytes = int64_t{1} << 30;
constexpr uint64_t kMaxStorageBytes = uint64_t{1} << 40;

/// The pickled metadata as send_object_list / broadcast_object_list carry it.
struct ObjectList {
  at::Tensor sizes;  // int64 [1]: the pickle's byte length
  at::Tensor bytes;  // uint8: the pickle
};

ObjectList pickle_metadata(const TensorDict& consolidated, std::optional<std::string> storage_device) {
  const std::vector<uint8_t> pickled = pickle::dumps(to_metadata(consolidated.schema(), std::move(storage_device)));
  ObjectList o;
  o.sizes = int64_tensor({static_cast<int64_t>(pickled.size())});
  o.bytes = bytes_tensor(static_cast<int64_t>(pickled.size()));
  std::memcpy(o.bytes.data_ptr(), pickled.data(), pickled.size());
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
  r.metadata = pickle::loads(std::span<const uint8_t>(bytes.data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel())),
                             metadata_pickle_limits());
  if (r.metadata.kind() != pickle::PyKind::kDict) {
    throw SchemaError(std::string("from_remote_init: the sender's metadata is a ") + pickle::type_name(r.metadata) +
                      ", not a dict");
  }
  const uint64_t total = metadata_total_bytes(r.metadata);
  if (total > kMaxStorageBytes) {
    throw SchemaError("from_remote_init: the sender's metadata announces a storage of " + std::to_string(total) +
                      " bytes (more than 1 TiB)");
  }
  r.storage = bytes_tensor(static_cast<int64_t>(total));
  return r;
}

TensorDict rebuild(const Received& r, const std::optional<c10::Device>& device) {
  Schema schema = from_metadata(r.metadata, static_cast<uint64_t>(r.storage.numel()));
  at::Tensor storage = r.storage;
  if (device && *device != storage.device()) storage = storage.to(*device);
  return TensorDict::from_consolidated(storage, std::move(schema));
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
  return rebuild(r, device);
}

}  // namespace

void TensorDict::init_remote(const InitRemoteOptions& o) const {
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    broadcast_remote(this, g, g.rank(), o.device);
    return;
  }
  if (!o.dst) throw Error("init_remote: `dst` must be provided (or use_broadcast=True)");
  const Peer p = resolve_peer("dst", "group_dst", o.dst, std::nullopt, o.group);
  const TensorDict c = consolidate();
  ObjectList meta = pickle_metadata(c, std::nullopt);
  wait_all({send_one(p.group, meta.sizes, p.rank, kRemoteInitTag), send_one(p.group, meta.bytes, p.rank, kRemoteInitTag),
            send_one(p.group, c.consolidated_storage(), p.rank, kRemoteInitTag)});
}

TensorDict TensorDict::from_remote_init(const FromRemoteInitOptions& o) {
  if (!o.src) throw Error("from_remote_init: `src` must be provided");
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    return broadcast_remote(nullptr, g, root_in_group(g, *o.src), o.device);
  }
  const Peer p = resolve_peer("src", "group_src", o.src, std::nullopt, o.group);
  auto sizes = int64_tensor({0});
  recv_now(p.group, sizes, p.rank, kRemoteInitTag);
  const at::Tensor bytes = pickle_buffer(sizes);
  recv_now(p.group, bytes, p.rank, kRemoteInitTag);
  Received r;
  try {
    r = read_metadata(bytes);
  } catch (...) {
    // The sender's storage is still on its way: take it (over shm any size is dropped once it
    // fails a receive of no bytes) so that the pair stays in step, then report the refusal.
    if (is_shm(p.group)) {
      try {
        recv_now(p.group, bytes_tensor(0), p.rank, kRemoteInitTag);
      } catch (...) {
      }
    }
    throw;
  }
  recv_now(p.group, r.storage, p.rank, kRemoteInitTag);
  return rebuild(r, o.device);
}

TensorDict TensorDict::broadcast(const BroadcastOptions& o) const {
  const Group g = group_or_default(o.group);
  return broadcast_remote(this, g, root_in_group(g, o.src), o.device);
}

}  // namespace tdshm
