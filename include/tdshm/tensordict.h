#pragma once
/// \file
/// TensorDict: a dictionary of tensors with nested keys, a batch size and an optional device,
/// with the semantics of Python's tensordict (see docs/semantics.md), and its consolidation into one
/// flat uint8 storage.
///
/// Handle semantics, like at::Tensor: copying a TensorDict copies a handle to the same
/// dictionary; `get_tensordict()` returns a handle to the nested dictionary itself, so writes
/// through it are seen by the parent (as in Python). `clone()` makes an independent deep copy.
/// A value may also be a LazyStackedTensorDict (lazy_stack.h), held with its members shared;
/// whole-tree walks (leaves, clone, apply, comparisons, transfers) go through its members.
///
/// Thread safety: a TensorDict may be read from several threads at once; any call that
/// modifies it (set, erase, lock_, update, ...) needs exclusive access, as for a std::map.
///
/// Errors (all derive from tdshm::Error; a call that throws leaves the tensordict as it was):
/// KeyError (empty key or key part, missing key, a leaf used as a subtree or the reverse),
/// ShapeError (leading dimensions differ from the batch size, in-place shape mismatch),
/// TypeError (a non-tensor value where a tensor is needed), LockedError (new key or deletion on
/// a locked tensordict).

#include <tdshm/errors.h>
#include <tdshm/memmap.h>
#include <tdshm/schema.h>

#include <ATen/core/Tensor.h>

#include <compare>
#include <concepts>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tdshm {

namespace detail {
struct TensorDictImpl;
}

/// A key: one string (`"a"`) or a path of strings (`{"a", "b"}`, Python's `("a", "b")`).
/// Construction throws KeyError for an empty key or an empty part. Strings are compared as
/// bytes; no part is ever split on dots.
class Key {
 public:
  Key(const char* key);                             // NOLINT: implicit, like Python's str keys
  Key(std::string key);                             // NOLINT
  Key(std::initializer_list<std::string> parts);    // NOLINT
  explicit Key(std::vector<std::string> parts);

  const std::vector<std::string>& parts() const noexcept { return parts_; }
  size_t size() const noexcept { return parts_.size(); }
  bool is_nested() const noexcept { return parts_.size() > 1; }
  const std::string& front() const noexcept { return parts_.front(); }
  const std::string& back() const noexcept { return parts_.back(); }
  /// This key with `part` appended.
  Key operator/(const std::string& part) const;
  /// "a" for a plain key, ("a", "b") for a nested one: for messages.
  std::string str() const;

  friend bool operator==(const Key&, const Key&) = default;
  friend auto operator<=>(const Key&, const Key&) = default;

 private:
  std::vector<std::string> parts_;
};

class TensorDict;
class Value;
class LazyStackedTensorDict;  // lazy_stack.h
// The transfer API's options and results (include <tdshm/distributed.h> to call it).
struct SendOptions;
struct RecvOptions;
struct Transfer;
struct InitRemoteOptions;
struct FromRemoteInitOptions;
struct BroadcastOptions;
struct GatherAndStackOptions;
struct ReduceOptions;
struct AllReduceOptions;
struct AllGatherOptions;
struct ScatterOptions;

/// Options of TensorDict::consolidate.
struct ConsolidateOptions {
  /// When non-empty, the storage is a MemoryMappedTensor over this file, followed in the file by
  /// the encoded schema, so that TensorDict::from_consolidated_file(filename) can rebuild it.
  std::string filename;
};

/// A dictionary of tensors (see the file comment).
class TensorDict {
 public:
  using Item = std::pair<Key, Value>;

  /// An empty tensordict with batch size [] and no device.
  TensorDict();
  /// An empty tensordict.
  explicit TensorDict(std::vector<int64_t> batch_size, std::optional<c10::Device> device = std::nullopt);
  /// A tensordict holding `items`, set in order with set(): nested keys create the intermediate
  /// tensordicts. Throws like set().
  TensorDict(std::initializer_list<Item> items, std::vector<int64_t> batch_size = {},
             std::optional<c10::Device> device = std::nullopt);
  TensorDict(const std::vector<Item>& items, std::vector<int64_t> batch_size = {},
             std::optional<c10::Device> device = std::nullopt);

  // ---- shape and identity ----
  const std::vector<int64_t>& batch_size() const noexcept;
  int64_t batch_dims() const noexcept { return static_cast<int64_t>(batch_size().size()); }
  std::optional<c10::Device> device() const noexcept;
  /// Number of top-level keys.
  size_t size() const noexcept;
  bool empty() const noexcept { return size() == 0; }
  /// True when both handles refer to the same dictionary.
  bool is_same(const TensorDict& other) const noexcept { return impl_ == other.impl_; }
  /// Registered tensorclass name this dictionary is the body of, or "" for a plain TensorDict.
  const std::string& class_name() const noexcept;

  // ---- access ----
  /// Whether `key` names a value; false also when the path goes through a leaf. Never throws.
  bool contains(const Key& key) const noexcept;
  /// What `key` holds. Throws KeyError if missing.
  Value get_value(const Key& key) const;
  /// The tensor at `key`. Throws KeyError if missing, TypeError if it holds no tensor.
  at::Tensor get(const Key& key) const;
  /// The nested tensordict at `key` (a handle to it). Throws KeyError / TypeError.
  TensorDict get_tensordict(const Key& key) const;
  /// The non-tensor value at `key`. Throws KeyError / TypeError.
  NonTensorData get_non_tensor(const Key& key) const;
  /// The lazy stack at `key` (a handle sharing its members; include lazy_stack.h to use it).
  /// Throws KeyError / TypeError.
  LazyStackedTensorDict get_lazy_stack(const Key& key) const;

  /// Sets `key` to `value`, creating intermediate tensordicts (with this batch size and device)
  /// for a nested key. A tensor's leading dimensions must equal the batch size, a tensordict's
  /// batch size must start with it (ShapeError naming the key and both shapes); tensors are
  /// moved to the device when one is set. On a locked tensordict an existing tensor leaf is
  /// written in place (as set_), anything else is a LockedError.
  TensorDict& set(const Key& key, const Value& value);
  /// Writes `tensor` into the existing leaf at `key` in place (dtype converted as by copy_).
  /// Throws KeyError if missing, TypeError if the key holds no tensor, ShapeError if the shape
  /// differs. Allowed on a locked tensordict.
  TensorDict& set_(const Key& key, const at::Tensor& tensor);
  /// Removes `key` (and its subtree). Throws KeyError if missing, LockedError if locked.
  TensorDict& erase(const Key& key);

  // ---- keys ----
  /// Keys in insertion order. include_nested: also the keys inside nested tensordicts, depth
  /// first, each nested one right after its parent. leaves_only: no tensordict keys.
  std::vector<Key> keys(bool include_nested = false, bool leaves_only = false) const;
  /// Keys and values, in the order of keys(include_nested, leaves_only).
  std::vector<Item> items(bool include_nested = false, bool leaves_only = false) const;
  /// Top-level keys in byte order of their UTF-8 bytes (Python's str order: "_" sorts after
  /// "Z" and before "a").
  std::vector<std::string> sorted_keys() const;
  /// Every tensor leaf key in per-leaf transfer order: keys sorted at each level (as
  /// sorted_keys), depth first into nested tensordicts; non-tensor values are skipped.
  std::vector<Key> sorted_leaf_keys() const;

  // ---- new tensordicts ----
  /// Deep copy: new tensors, unlocked, not consolidated; keeps class_name.
  TensorDict clone() const;
  /// Same keys with contiguous tensors (an expanded leaf is materialised).
  TensorDict contiguous() const;
  /// Expands every leaf to the batch size `new_batch_size`, which must end with the current
  /// batch size (Python's expand: [2] → [1, 2]); tensors are expanded views. Throws ShapeError.
  TensorDict expand(std::vector<int64_t> new_batch_size) const;
  /// A new tensordict with fn applied to every tensor leaf (non-tensor values are copied).
  /// The results must keep the batch size (ShapeError otherwise).
  TensorDict apply(const std::function<at::Tensor(const at::Tensor&)>& fn) const;
  /// Writes fn(leaf) into every tensor leaf in place.
  TensorDict& apply_(const std::function<at::Tensor(const at::Tensor&)>& fn);
  /// The tensordict with every tensor moved to `device` (and device() set to it).
  TensorDict to(c10::Device device) const;

  // ---- bulk updates ----
  /// set() for every leaf of `other` (nested tensordicts merge key by key).
  TensorDict& update(const TensorDict& other);
  /// set_() for every leaf of `other`. Every key of `other` must exist here with a matching
  /// kind and shape; this is checked for all keys before anything is written (KeyError,
  /// TypeError, ShapeError), so a failed update_ leaves the tensordict unchanged.
  TensorDict& update_(const TensorDict& other);

  // ---- comparisons (results are tensordicts of bool tensors; use all()/any()) ----
  // Non-tensor values are left out of the results.
  TensorDict eq(const at::Scalar& v) const;
  TensorDict ne(const at::Scalar& v) const;
  TensorDict lt(const at::Scalar& v) const;
  TensorDict le(const at::Scalar& v) const;
  TensorDict gt(const at::Scalar& v) const;
  TensorDict ge(const at::Scalar& v) const;
  /// Leafwise comparison with a tensordict of the same keys (KeyError otherwise; TypeError when
  /// a key holds a tensor on one side and a tensordict on the other).
  TensorDict eq(const TensorDict& other) const;
  TensorDict ne(const TensorDict& other) const;
  /// True when every element of every tensor leaf is non-zero (true for no leaves).
  bool all() const;
  /// True when some element of some tensor leaf is non-zero.
  bool any() const;
  /// Same keys (and nesting), same leaf kinds, and for tensors the same dtype and shape; and
  /// the same batch sizes. Values and insertion order are not compared (two tensordicts of the
  /// same structure but another insertion order consolidate to different layouts; compare
  /// schema fingerprints for that).
  bool same_structure(const TensorDict& other) const;

  // ---- locking ----
  /// Locks this tensordict and every nested one: new keys and deletions throw LockedError,
  /// in-place writes are allowed.
  TensorDict& lock_();
  /// Unlocks this tensordict and the nested ones it locked, and drops a consolidation (the
  /// leaves stay views of the old storage, but the tensordict is no longer consolidated).
  /// Throws LockedError on a nested tensordict locked through a locked parent.
  TensorDict& unlock_();
  bool is_locked() const noexcept;

  // ---- consolidation ----
  /// One flat uint8 storage holding every tensor leaf: insertion order, depth first, each leaf
  /// contiguous and zero-padded to a multiple of 8 bytes — byte for byte tensordict's
  /// consolidate(), which pads every leaf whatever the dtypes (it calls
  /// _reduce_vals_and_metadata with dtype=None, so need_padding is always true). The result's leaves are views into the
  /// storage and it is locked, so update_ and set_ write into the storage. A tensordict that is
  /// already consolidated is returned as is (no copy) unless a filename is given.
  TensorDict consolidate(const ConsolidateOptions& options = {}) const;
  bool is_consolidated() const noexcept;
  /// The flat storage (1-D uint8). Throws Error if not consolidated.
  at::Tensor consolidated_storage() const;
  /// The schema of the storage. Throws Error if not consolidated.
  const Schema& schema() const;
  /// schema_fingerprint(schema()), computed once. Throws Error if not consolidated.
  uint64_t schema_fingerprint() const;
  /// Rebuilds a consolidated tensordict whose leaves are views of `storage` (1-D, uint8,
  /// contiguous, CPU or any device) laid out as `schema` says. Throws SchemaError if the schema
  /// does not fit the storage.
  static TensorDict from_consolidated(const at::Tensor& storage, Schema schema);
  /// Rebuilds a tensordict written by consolidate({.filename = path}) from that file alone; its
  /// leaves map the file (writes reach it). Throws MemmapError / SchemaError.
  static TensorDict from_consolidated_file(const std::string& path, MemmapMode mode = MemmapMode::kReadWrite);

  // ---- transfers between processes (declared in <tdshm/distributed.h>; see docs/semantics.md) ----
  // Peers are checked before any communication: `group_dst` without `group`, both `dst` and
  // `group_dst`, or neither, are three distinct Errors naming the parameters; a peer outside
  // the group or equal to this rank is an Error too.

  /// Sends every tensor leaf (per-leaf mode: one message per leaf in sorted_leaf_keys() order,
  /// tags from transfer_tags) or, with `consolidated`, the consolidated storage as one message
  /// (consolidating first when needed: a copy). Returns as Python's isend: the last tag, or the
  /// Work handles with return_early, or nothing for a consolidated send.
  Transfer isend(const SendOptions& options) const;
  /// isend, then waits for every message to be sent.
  void send(const SendOptions& options) const;
  /// Receives into the existing leaves in place (per-leaf), or into the consolidated storage.
  /// Before a receive into a leaf is posted, each leaf must be able to take bytes in place
  /// (else TypeError naming the key: not a dense CPU tensor, or elements that overlap, as in an
  /// expanded tensor; MemmapError: a read-only MemoryMappedTensor), and the sender's layout
  /// descriptor must match this tensordict's keys, dtypes and shapes leaf by leaf (else
  /// TransportError naming the first key that differs). A consolidated receive checks its
  /// storage the same way and the sender's schema fingerprint (SchemaError when keys, dtypes,
  /// shapes, layout or tensorclass names differ) before a byte of the storage is written. A
  /// refused transfer still consumes the sender's messages, so the next transfer between the
  /// same peers is in step; its leaves are left as they were. Errors keep their type, with the
  /// key or mode in front of their message. irecv never blocks: the checks run when its works
  /// are waited or polled, and Work::isCompleted only polls. Returns nothing, or the Work
  /// handles with return_premature.
  Transfer irecv(const RecvOptions& options);
  /// irecv, then waits; returns the last tag used (init_tag - 1 for no leaves).
  int64_t recv(const RecvOptions& options);
  /// Receives what recv would, but into a new tensordict (this one is left as it is and only
  /// gives the keys, or with `consolidated` the schema): over shm each leaf (or the consolidated
  /// storage) the sender sent from a loan (tdshm::loan) is a view of the sender's bytes, no copy,
  /// which go back to the sender when the view is dropped; any other message lands in a fresh
  /// tensor. Leaves take the sender's dtypes and shapes (per-leaf; they must fit this batch
  /// size, ShapeError otherwise); keys, key checks, schema checks and errors are recv's. Over
  /// other backends: recv into fresh tensors like these. See docs/loans.md.
  TensorDict recv_view(const RecvOptions& options) const;
  /// Sends metadata (schema, non-tensor values, tensorclass name) and the consolidated storage
  /// to `dst` (or, with use_broadcast, to every rank of the group).
  void init_remote(const InitRemoteOptions& options) const;
  /// Receives what init_remote sent and rebuilds it as a consolidated tensordict on `device`;
  /// class_name() is the sender's tensorclass name, if any. A leaf that was a MemoryMappedTensor
  /// on the sender travels by value inside the storage, as under tensordict, except point to
  /// point over shm between two ranks with ShmOptions::memmap_by_reference (C++ ranks): there
  /// the result's leaf maps the sender's file (MemmapError if this rank cannot) and the result
  /// is locked but not consolidated (docs/semantics.md).
  static TensorDict from_remote_init(const FromRemoteInitOptions& options);
  /// tensordict's gather_and_stack: every rank of `group` calls it; rank `dst` receives
  /// every other rank's tensordict, in rank order without its own, into its own, whose first
  /// batch dimension must be the group's size - 1 (written in place, as update_ of the stack);
  /// returns *this there, nullopt elsewhere. Per leaf, no pickle: between tdshm ranks only. A
  /// group with a Python (tensordict) rank, whose gather_and_stack pickles the whole tensordict,
  /// is refused on every tdshm rank before anything is sent (Error); a dst whose batch does not
  /// fit refuses (ShapeError) and tells the senders, which raise Error.
  std::optional<TensorDict> gather_and_stack(const GatherAndStackOptions& options);
  /// Collective: the root (options.src) broadcasts this tensordict; every rank returns the
  /// consolidated result (on non-root ranks `*this` is not used and may be empty).
  TensorDict broadcast(const BroadcastOptions& options) const;

  // ---- collectives (declared in <tdshm/distributed.h>; tensordict's TensorDictBase.reduce,
  // all_reduce, all_gather, scatter) ----
  // Every rank of the group calls the method with the same options; each runs only the generic
  // c10d collectives of the group's backend, so it works on any backend that implements them
  // (gloo and "shm"; a backend's refusal is a TransportError). Checked before any
  // communication, each an Error naming the parameter: a rank outside `group` (new_group did
  // not include it), `dst` / `src` not a member of the group (global ranks, as
  // torch.distributed takes them); and for reduce / all_reduce every leaf must be able to take
  // bytes in place (TypeError / MemmapError naming the key, as for irecv). Over a c10d backend
  // a rank that fails these checks leaves its peers waiting until the group's timeout, as
  // tensordict does.

  /// Reduces every tensor leaf, one collective per leaf in sorted_leaf_keys() order, into the
  /// leaves of rank `dst` (in place; what the other ranks' leaves hold afterwards is up to the
  /// backend: gloo writes partial results into them). Non-tensor values take no part. Returns
  /// as Python's reduce: nothing, or with async_op and return_premature the Work handles (one
  /// per leaf, not waited); async_op alone waits for all of them. Errors of the backend become
  /// TransportErrors naming the key. (tensordict's _reduce does not pass `group` on to nested
  /// tensordicts, whose leaves then go over the default group; tdshm reduces every leaf over
  /// `group`, which is the same for the default group.)
  Transfer reduce(const ReduceOptions& options);
  /// Reduces every tensor leaf in place on every rank, one all_reduce per leaf, in insertion
  /// order depth first (tensordict's _fast_apply order: every rank must hold its keys in the
  /// same insertion order). Returns nothing, or with async_op the Work handles (not waited).
  Transfer all_reduce(const AllReduceOptions& options);
  /// Every rank's tensordict, in group rank order: each rank consolidates its own (a copy unless
  /// already consolidated), the metadata dicts are all-gathered as torch 1.13's
  /// all_gather_object does, the storages (zero-padded to the largest) with one all_gather.
  /// Each result is a consolidated tensordict viewing its own received storage (this rank's
  /// too), a plain TensorDict (the root's tensorclass name does not travel, as under
  /// tensordict). Ranks may differ in anything: keys, shapes, dtypes, batch sizes, non-tensor
  /// values. Throws SchemaError for metadata a peer should not have sent.
  std::vector<TensorDict> all_gather(const AllGatherOptions& options) const;
  /// The source rank's options.tensordicts[r] arrives on group rank r (the source's own entry
  /// too): metadata through scatter_object_list (torch 1.13's wire), then the storages,
  /// zero-padded to the largest, with one scatter. Returns this rank's tensordict, consolidated,
  /// on options.device (default CPU). On the source `tensordicts` must hold exactly one
  /// tensordict per rank of the group (Error otherwise, before any communication); on the other
  /// ranks it is ignored, as tensordict ignores it, and `*this` is not used on any rank.
  TensorDict scatter(const ScatterOptions& options) const;

  /// Pretty, multi-line description (keys, dtypes, shapes, batch size).
  std::string repr() const;

  // Internal: used by tensorclass and the transfer layer.
  explicit TensorDict(std::shared_ptr<detail::TensorDictImpl> impl) : impl_(std::move(impl)) {}
  const std::shared_ptr<detail::TensorDictImpl>& impl() const noexcept { return impl_; }
  /// Sets the tensorclass name carried by this dictionary (empty: plain TensorDict).
  TensorDict& set_class_name(std::string name);

 private:
  std::shared_ptr<detail::TensorDictImpl> impl_;
};

TensorDict operator==(const TensorDict& td, const at::Scalar& v);
TensorDict operator!=(const TensorDict& td, const at::Scalar& v);
TensorDict operator==(const TensorDict& a, const TensorDict& b);
TensorDict operator!=(const TensorDict& a, const TensorDict& b);

/// What a key holds: a tensor, a nested tensordict, a non-tensor value (string, integer,
/// floating point, bool), or a lazy stack of tensordicts (lazy_stack.h). Converts implicitly
/// from each, so items read like Python's dicts.
class Value {
 public:
  Value(at::Tensor t) : v_(std::move(t)) {}                  // NOLINT
  Value(const MemoryMappedTensor& m) : v_(m.tensor()) {}      // NOLINT
  Value(TensorDict td) : v_(std::move(td)) {}                // NOLINT
  Value(NonTensorData d) : v_(std::move(d)) {}               // NOLINT
  /// Holds the stack (its members are shared, not copied). Defined in lazy_stack.cpp.
  Value(const LazyStackedTensorDict& s);                       // NOLINT
  Value(std::string s) : v_(NonTensorData(std::move(s))) {}  // NOLINT
  Value(const char* s) : v_(NonTensorData(std::string(s))) {}  // NOLINT
  Value(bool b) : v_(NonTensorData(b)) {}                    // NOLINT
  template <std::integral T>
    requires(!std::same_as<T, bool>)
  Value(T i) : v_(NonTensorData(static_cast<int64_t>(i))) {}  // NOLINT
  template <std::floating_point T>
  Value(T f) : v_(NonTensorData(static_cast<double>(f))) {}  // NOLINT

  bool is_tensor() const noexcept { return v_.index() == 0; }
  bool is_tensordict() const noexcept { return v_.index() == 1; }
  bool is_non_tensor() const noexcept { return v_.index() == 2; }
  bool is_lazy_stack() const noexcept { return v_.index() == 3; }
  /// Throws TypeError when the value is of another kind.
  const at::Tensor& tensor() const;
  const TensorDict& tensordict() const;
  const NonTensorData& non_tensor() const;
  const LazyStackedTensorDict& lazy_stack() const;
  /// "tensor", "tensordict", "non-tensor value" or "lazy stack", for messages.
  const char* kind_name() const noexcept;

 private:
  std::variant<at::Tensor, TensorDict, NonTensorData, std::shared_ptr<const LazyStackedTensorDict>> v_;
};

}  // namespace tdshm
