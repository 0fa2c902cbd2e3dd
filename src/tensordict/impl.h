#pragma once
// The private representation behind the TensorDict handle, shared by tensordict.cpp,
// tensordict_leaves.cpp, consolidate.cpp and the transfer layer.

#include <tdshm/tensordict.h>

#include "common/format.h"
#include "common/hash.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace tdshm::detail {

/// Bumped by every change to the keys of any tensordict in this process (an entry added or
/// removed, or replaced by a value of another kind): a cached sorted_leaves() is valid while
/// the epoch it was computed at is current. Global because a nested tensordict can be changed
/// through a handle of its own, which its parents never hear of.
inline std::atomic<uint64_t> keys_epoch{1};
inline void keys_changed() noexcept { keys_epoch.fetch_add(1, std::memory_order_acq_rel); }

/// A 64-bit hash of a key's full path, the same in every process and build: FNV-1a over the
/// number of parts, then each part's byte length and bytes, then a mixing step (common/hash.h).
inline uint64_t key_path_hash(const Key& key) {
  StableHasher h;
  h.u64(key.size());
  for (const std::string& part : key.parts()) h.str(part);
  return h.finish();
}

struct PerLeafWire;  // distributed/per_leaf.cpp

/// A tensordict's tensor leaves in transfer order (sorted_leaf_keys()) and their key hashes,
/// computed once per keys_epoch: repeated transfers of an unchanged tree reuse them.
struct SortedLeaves {
  uint64_t epoch = 0;
  std::vector<Key> keys;
  std::vector<uint64_t> key_hashes;  // key_path_hash of each key
  /// Where each leaf sits: leaf i is entries[p0] of the root, entries[p1] of that tensordict, ...
  /// for p in positions[path_begin[i], path_begin[i + 1]). Positions only move when keys change
  /// (an erase rebuilds the index, and bumps keys_epoch), so leaf_tensor() finds the current
  /// tensor of an unchanged tree without hashing a key.
  std::vector<uint32_t> positions;
  std::vector<uint32_t> path_begin;  // keys.size() + 1 offsets into positions
  /// The sorted index of the j-th leaf in insertion order (depth first), the order in which
  /// map_leaves visits them (with_leaves).
  std::vector<uint32_t> insertion_order;
  /// The per-leaf transfers' tags and checks for these keys (per_leaf.cpp's wire_of), kept with
  /// the keys so that they are computed once per tree too. Those of init_tag 0 without
  /// pseudo_rand (every transfer that sets neither) are made once and never replaced, so a
  /// transfer reads them with one load and no reference count (an atomic shared_ptr's load takes
  /// a lock and a count: three atomic operations); any other, the last used, in `wire`.
  mutable std::atomic<const PerLeafWire*> default_wire{nullptr};
  mutable std::shared_ptr<const PerLeafWire> default_wire_owner;  // set once, under default_wire_mutex
  mutable std::mutex default_wire_mutex;
  mutable std::atomic<std::shared_ptr<const PerLeafWire>> wire;
};

/// The cache slot in TensorDictImpl: atomic, since several threads may transfer one tensordict.
struct SortedLeavesSlot {
  std::atomic<std::shared_ptr<const SortedLeaves>> value;
  SortedLeavesSlot() = default;
  SortedLeavesSlot(const SortedLeavesSlot& o) : value(o.value.load()) {}
  SortedLeavesSlot& operator=(const SortedLeavesSlot& o) {
    value.store(o.value.load());
    return *this;
  }
};

/// A tensor of `dtype`/`shape` viewing bytes [start, ...) of the 1-D uint8 `storage`, sharing its
/// StorageImpl (so it keeps the storage, and a file mapping behind it, alive); no dispatcher call
/// when the offset suits the dtype. Defined in consolidate.cpp.
at::Tensor view_into(const at::Tensor& storage, uint64_t start, c10::ScalarType dtype, at::IntArrayRef shape);

/// TensorDict::from_consolidated without its checks, for a caller that decoded and validated
/// `schema` once for storages of this kind (a feed's producer, a board) and checked that
/// `storage` (1-D contiguous uint8) holds schema.total_bytes: validating and fingerprinting again
/// for every item cost more than building its tree. `fingerprint`: schema_fingerprint(schema).
TensorDict from_checked_consolidated(const at::Tensor& storage, Schema schema, uint64_t fingerprint);

/// The storage and schema of a consolidated tensordict (held by its root only).
struct Consolidation {
  at::Tensor storage;  // 1-D uint8
  Schema schema;
  uint64_t fingerprint = 0;
};

struct TensorDictImpl {
  std::vector<std::pair<std::string, Value>> entries;  // insertion order
  std::unordered_map<std::string, size_t> index;       // key -> position in entries
  std::vector<int64_t> batch_size;
  std::optional<c10::Device> device;
  std::string class_name;
  bool locked = false;
  // The tensordict whose lock_() locked this one (itself when locked directly); a nested
  // tensordict locked through its parent cannot be unlocked on its own.
  std::weak_ptr<const TensorDictImpl> locked_by;
  std::shared_ptr<const Consolidation> consolidation;
  SortedLeavesSlot sorted_leaves;  // cache of detail::sorted_leaves()

  const Value* find(const std::string& key) const {
    auto it = index.find(key);
    return it == index.end() ? nullptr : &entries[it->second].second;
  }
  Value* find(const std::string& key) {
    auto it = index.find(key);
    return it == index.end() ? nullptr : &entries[it->second].second;
  }
  void append(std::string key, Value value) {
    append_fresh(std::move(key), std::move(value));
    keys_changed();
  }
  /// append() to a node under construction, which no tensordict holds yet: no cache can have
  /// seen its keys, so the epoch stays (building a tensordict leaves every cache valid).
  void append_fresh(std::string key, Value value) {
    index.emplace(key, entries.size());
    entries.emplace_back(std::move(key), std::move(value));
  }
};

/// A lazy stack's leaves in transfer order (distributed/per_leaf.cpp builds them), kept with the
/// members' own SortedLeaves they came from: valid while each member's is still current.
struct LazyLeavesCache {
  struct Entry {
    std::vector<std::shared_ptr<const SortedLeaves>> members;
    std::shared_ptr<const SortedLeaves> leaves;
  };
  std::atomic<std::shared_ptr<const Entry>> value;
};

/// `td`'s leaves in transfer order with their key hashes, from the cache while no tensordict's
/// keys changed since it was computed.
std::shared_ptr<const SortedLeaves> sorted_leaves(const TensorDict& td);

/// The tensor of leaf `i` of `leaves` (which sorted_leaves(td) returned, for this `td`), as
/// td.get(leaves.keys[i]) would return it, found by position.
at::Tensor leaf_tensor(const TensorDict& td, const SortedLeaves& leaves, size_t i);

/// `td`'s structure (sub-tensordicts, batch sizes, non-tensor values) with tensor leaf i of
/// `leaves` (sorted_leaves(td)) replaced by tensors[i], each checked as set() checks a value;
/// no key is hashed or looked up.
TensorDict with_leaves(const TensorDict& td, const SortedLeaves& leaves, c10::ArrayRef<at::Tensor> tensors);

/// Entry `i` of `td` along its first batch dimension, as views: every leaf t.select(0, i), every
/// batch size (sub-tensordicts' too) without its first dimension, non-tensor values kept. The
/// caller checks that the first dimension exists and holds i.
TensorDict select_first(const TensorDict& td, int64_t i);


}  // namespace tdshm::detail
