#pragma once
// Internal: tdshm's Schema <-> the metadata dict tensordict pickles for init_remote,
// from_remote_init and broadcast (docs/wire.md, "The metadata"), so that a tdshm rank and a
// tensordict rank understand each other's consolidated tensordicts.
//
// The dict (tensordict 0.14: TensorDictBase._reduce_vals_and_metadata, consolidate(metadata=
// True), init_remote, broadcast; read back by _reductions._rebuild_tensordict_files_consolidated):
//
//   node := {"cls": "TensorDict" | <tensorclass type object>,
//            "non_tensors": {key: (value, batch_size list, device str | None)},
//            "leaves": {key: (dtype str, shape list, start, stop, pad)},
//            "cls_metadata": {"device": str | None, "names": list, "batch_size": list,
//                             "is_locked": bool},
//            <child key>: node, ...}
//   root := node + {"_total_bytes": int, ["_storage_device": str], ["_tensorclass_type": str]}
//
// Mapping decisions:
//   - Offsets. tensordict's `stop` includes the pad (the leaf's slot is [start, stop), the
//     tensor its first numel * itemsize bytes: storage[start:stop].view(dtype)[:numel]);
//     tdshm's SchemaTensor::stop excludes it. So python stop = tdshm stop + pad, and
//     from_metadata checks python stop - start == numel * itemsize + pad, pad in [0, 7].
//     Nothing here assumes a padding rule (which leaves are padded, or to what).
//   - Keys. Keys of "leaves", "non_tensors" and child entries are the key within that node.
//     A child key equal to one of the node's own fields ("cls", "non_tensors", "leaves",
//     "cls_metadata", "size"), or at the root to "_total_bytes", "_storage_device" or
//     "_tensorclass_type", cannot be written (tensordict would read it as the field) and is
//     refused by to_metadata.
//   - Order. tensordict writes leaves and children in insertion order, depth-first, and gives
//     leaves increasing offsets in that order; its reader rebuilds non-tensors, then leaves, then
//     children. from_metadata puts non-tensors first (in dict order) and then merges leaves and
//     children by offset (a child placed by its first leaf; one without leaves right after the
//     child before it), which restores the sender's insertion order of tensors and children.
//     So a Schema whose nodes list non-tensors first survives to_metadata -> from_metadata
//     unchanged.
//   - Tensorclasses. A tdshm node's class_name is the type's registered name; a Python
//     tensorclass's name is f"{cls.__module__}.{cls.__qualname__}" (tensordict's tensorclass,
//     _tc_tensorclass_type_str). The rule is: the two are the same string, compared in full
//     (register a C++ tensorclass that talks to Python under its Python name, e.g.
//     "my.module.MyData"; a script's class is "__main__.MyData"). At the root, tensordict's
//     tensorclass init_remote sends the inner TensorDict ("cls": "TensorDict") and the name in
//     "_tensorclass_type" (resolved on receipt by _resolve_tensorclass_type: import everything
//     before the last '.', take the attribute after it); tdshm does the same. A nested
//     tensorclass has its type object in "cls" (only the names in _reductions.CLS_MAP travel as
//     strings), which pickle writes as a global (module, qualname): to_metadata writes a
//     PyClassRef split at the last '.' (so a nested name must contain one), and from_metadata
//     reads one back as module + "." + qualname. The receiving side must therefore load the
//     pickle with metadata_pickle_limits() (class references read as names, never imported).
//     Other "cls" strings (NonTensorStack, ...) are refused.
//   - Lazy stacks. A node whose "cls" is the string "LazyStackedTensorDict" (at the root or
//     nested) is a SchemaNode with lazy_stack_dim: its "cls_metadata" is LazyStackedTensorDict's
//     {"stack_dim", "stack_dim_name", "is_locked"} (no batch size: it follows from the members),
//     its "leaves" and "non_tensors" are empty, its members are the children "0", "1", ...
//   - Non-tensors. tdshm's str / int64 / double / bool map to Python str / int / float / bool
//     in a (value, batch_size, device) tuple where batch_size and device are the node's (what a
//     NonTensorData set into that node has). Other Python types (None, lists, ...) are refused.
//     The batch size and device of a received non-tensor are checked for form and dropped.
//   - cls_metadata. to_metadata writes names as [None] * batch_dims (what TensorDict.names
//     returns without names; tensordict's reader iterates it, so None would not do) and
//     is_locked False. from_metadata checks names (None or a list of str/None, one per batch
//     dimension) and is_locked (a bool) and drops both: tdshm has no dimension names, and a
//     consolidated tensordict is locked anyway.
//   - Devices are torch device strings ("cpu", "cuda:0"), parsed with c10::Device.
//   - Ragged (nested jagged) leaves, which tensordict writes as 6-tuples under "<NJT...>" keys,
//     are refused.
//
// Thread safety: pure functions.

#include "pickle/pickle.h"

#include "tdshm/schema.h"
#include "tdshm/tensordict.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace tdshm::detail {

/// The torch name of a dtype tdshm stores ("torch.float32"); throws SchemaError for others.
std::string dtype_to_torch_string(c10::ScalarType dtype);
/// The dtype named by a torch dtype string, or nullopt if tdshm does not store that dtype.
std::optional<c10::ScalarType> dtype_from_torch_string(const std::string& name);

/// tensordict's metadata dict for a consolidated tensordict of this schema, as init_remote
/// (no storage device) or broadcast (with str(storage.device)) sends it: the root holds
/// "_total_bytes" = schema.total_bytes, "_storage_device" when given, and
/// "_tensorclass_type" = root.class_name when the root is a tensorclass. Throws SchemaError if
/// the schema fails validate_schema, a child key collides with a field of the dict, a nested
/// tensorclass name has no '.', or a double/str value cannot be pickled.
pickle::PyValue to_metadata(const Schema& schema, std::optional<std::string> storage_device);

/// The Schema described by a metadata dict (as pickle::loads returns it; "_total_bytes",
/// "_storage_device", "_tensorclass_type" and "size" may be present or not), for a storage of
/// `storage_bytes` bytes (Schema::total_bytes). Validates everything: the dict's shape and
/// every value's type, known fields only, dtype strings, shapes and batch sizes (non-negative,
/// at most kSchemaMaxDims), offsets (stop - start == numel * itemsize + pad, pad <= 7, inside
/// the storage, in order, without overlap), "_total_bytes" == storage_bytes when present,
/// devices, keys (non-empty str, unique per node), nesting within kSchemaMaxDepth; and finally
/// validate_schema. Throws SchemaError naming the key path.
Schema from_metadata(const pickle::PyValue& metadata, uint64_t storage_bytes);

/// "_total_bytes" of a metadata dict: what the receiver allocates before it receives the
/// storage. Throws SchemaError if missing, not an int, or negative.
uint64_t metadata_total_bytes(const pickle::PyValue& metadata);

/// "_storage_device" of a metadata dict (broadcast sends it), or nullopt when absent. Throws
/// SchemaError if it is not a str that c10::Device parses.
std::optional<std::string> metadata_storage_device(const pickle::PyValue& metadata);

/// The pickle limits to read metadata with: the defaults plus class references (a nested
/// tensorclass's type travels as a global; it is read as a name and never resolved).
pickle::Limits metadata_pickle_limits();

// ---------------------------------------------------------------------------------------------
// Pickled metadata on the wire, shared by remote_init.cpp (which defines them) and
// collectives.cpp: what a peer may announce is bounded (a corrupt or hostile peer makes the
// transfer fail, never an absurd allocation; a storage's bound, kMaxStorageBytes, is in
// messages.h).

/// Metadata is never this large.
inline constexpr int64_t kMaxPickleBytes = int64_t{1} << 30;

/// pickle::dumps(metadata) as a 1-D uint8 CPU tensor (what torch's _object_to_tensor makes).
at::Tensor pickled_tensor(const pickle::PyValue& metadata);
/// The metadata dict a peer pickled into `bytes` (1-D uint8 CPU), read with
/// metadata_pickle_limits(); its "_total_bytes" is present and at most kMaxStorageBytes. Throws
/// SchemaError (message starting with `method`) otherwise, or what pickle::loads throws.
pickle::PyValue load_metadata(const at::Tensor& bytes, const char* method);
/// The consolidated tensordict `metadata` describes over `storage` (from_metadata, then
/// TensorDict::from_consolidated), moved to `device` when given. Throws SchemaError. A lazy
/// stack at the root is refused, unless `lazy_root` is given: then its shell {"0": member 0,
/// ...} is returned and its stack_dim stored there (nullopt for a tensordict).
TensorDict rebuild_consolidated(const pickle::PyValue& metadata, const at::Tensor& storage,
                                const std::optional<c10::Device>& device,
                                std::optional<int64_t>* lazy_root = nullptr);

/// Turns a schema whose root is a lazy stack into its shell's (a tensordict of the members'
/// batch size holding them as "0", "1", ...) and returns the stack_dim; nullopt, with the schema
/// unchanged, for a tensordict root.
std::optional<int64_t> take_lazy_root(Schema& schema);

}  // namespace tdshm::detail
