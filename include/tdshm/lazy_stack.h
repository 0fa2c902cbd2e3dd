#pragma once
/// \file
/// LazyStackedTensorDict: tensordicts stacked along a new dimension without copying, as
/// tensordict's class of that name (docs/wire.md). Members share a batch size; their keys
/// and leaf shapes may differ (a heterogeneous stack). Transfers walk the members in order, each
/// sending its leaves as a TensorDict does, the tag running on from one member to the next:
/// tensordict's wire, so a Python peer's lazy stack of the same members matches
/// (docs/semantics.md, "Lazy stacks").

#include <tdshm/distributed.h>
#include <tdshm/tensordict.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace tdshm {

class LazyStackedTensorDict;
namespace detail {
struct LazyLeavesCache;  // tensordict/impl.h
LazyLeavesCache& lazy_leaves_cache(const LazyStackedTensorDict& stack) noexcept;
}  // namespace detail

class LazyStackedTensorDict {
 public:
  /// Stacks `tensordicts` along a new dimension `stack_dim` of the batch (0 <= stack_dim <= the
  /// members' batch dims; negative counts from the end of the stacked batch). The members are
  /// held, not copied: writes into their leaves are writes into the stack. ShapeError when the
  /// members' batch sizes differ or stack_dim is out of range. An empty stack has batch [0].
  explicit LazyStackedTensorDict(std::vector<TensorDict> tensordicts, int64_t stack_dim = 0);

  const std::vector<TensorDict>& tensordicts() const noexcept { return tensordicts_; }
  int64_t stack_dim() const noexcept { return stack_dim_; }
  /// The members' batch size with the number of members inserted at stack_dim.
  std::vector<int64_t> batch_size() const;
  /// Number of members.
  size_t size() const noexcept { return tensordicts_.size(); }
  /// Member `i` along the stack dimension (negative from the end); ShapeError out of range.
  const TensorDict& operator[](int64_t i) const;

  /// tensordict's keys of a lazy stack: the keys every member has (sorted by their string), and
  /// with include_nested the nested keys every member has; leaves_only: tensor leaves only.
  std::vector<Key> keys(bool include_nested = false, bool leaves_only = false) const;

  /// Member-wise comparison: a lazy stack of each pair's `==` (ShapeError when the member counts
  /// or stack dims differ). all(): every member's every leaf true.
  LazyStackedTensorDict eq(const LazyStackedTensorDict& other) const;
  bool all() const;

  /// The dense TensorDict: each leaf stacked along stack_dim (at::stack). Needs members of the
  /// same keys and leaf shapes (ShapeError / KeyError naming what differs).
  TensorDict to_tensordict() const;

  /// tensordict's consolidate() of a lazy stack: a new stack whose members' leaves view one uint8
  /// storage, member after member, each member's leaves in insertion order depth first (every
  /// leaf padded to 8 bytes), as tensordict lays out a lazy stack (its members are the
  /// sub-tensordicts "0", "1", ... of the metadata). The members are locked. Itself when it is
  /// consolidated already. A member may hold lazy stacks (laid out the same way, nested).
  LazyStackedTensorDict consolidate() const;
  bool is_consolidated() const noexcept { return consolidated_ != nullptr; }
  /// The storage of a consolidated stack (Error otherwise).
  at::Tensor consolidated_storage() const;

  // ---- Transfers (docs/semantics.md, "Lazy stacks") ----
  // With the options of TensorDict's transfers. Per leaf: member after member, each in its
  // sorted-key order, the tags running on. Consolidated: the storage of consolidate() as one
  // message (a sender consolidates first; a receiver must be consolidated already, Error
  // otherwise), checked as a TensorDict's consolidated transfer is.
  Transfer isend(const SendOptions& options) const;
  void send(const SendOptions& options) const;
  /// Receives into the members' leaves (the receiver's stack has the sender's structure).
  Transfer irecv(const RecvOptions& options);
  int64_t recv(const RecvOptions& options);
  /// tensordict's init_remote / from_remote_init of a lazy stack: the metadata names class
  /// LazyStackedTensorDict with its stack_dim, the members are its children "0", "1", ...,
  /// then the consolidated storage (consolidate()'s layout); point to point, or with
  /// use_broadcast as broadcast() from the sender. The received stack's members are
  /// consolidated and locked. A TensorDict's metadata is refused here (and a lazy stack's by
  /// TensorDict::from_remote_init): SchemaError, raised once the whole transfer is in.
  void init_remote(const InitRemoteOptions& options) const;
  static LazyStackedTensorDict from_remote_init(const FromRemoteInitOptions& options);
  /// tensordict's broadcast of a lazy stack from `src` to every rank of the group: on the source
  /// the consolidated stack, elsewhere the received one (this stack is not used there; any
  /// stack, e.g. LazyStackedTensorDict({}), will do). A tensordict broadcast instead is a
  /// SchemaError on the receivers (TensorDict::broadcast refuses a lazy stack the same way).
  LazyStackedTensorDict broadcast(const BroadcastOptions& options) const;

 private:
  friend detail::LazyLeavesCache& detail::lazy_leaves_cache(const LazyStackedTensorDict& stack) noexcept;
  /// The members as the children "0", "1", ... of one tensordict of their batch size: how
  /// tensordict's consolidate and init_remote see a lazy stack (shared members, not copies).
  TensorDict shell() const;
  /// The stack whose members are the children "0", "1", ... of a received `shell`
  /// (SchemaError when one is missing or not a tensordict).
  static LazyStackedTensorDict from_shell(const TensorDict& shell, int64_t stack_dim);
  LazyStackedTensorDict broadcast_in_group(const Group& g, int root, const std::optional<c10::Device>& device) const;
  std::vector<TensorDict> tensordicts_;
  int64_t stack_dim_ = 0;
  /// A consolidated stack: the consolidated TensorDict {"0": member 0, "1": ...} (batch: the
  /// members') whose storage and schema its transfers use; tensordicts_ are its sub-tensordicts.
  std::shared_ptr<const TensorDict> consolidated_;
  /// The transfers' leaf order, tags and checks, kept while no member's keys changed (shared by
  /// copies, which share the members too).
  std::shared_ptr<detail::LazyLeavesCache> leaves_cache_;
};

LazyStackedTensorDict operator==(const LazyStackedTensorDict& a, const LazyStackedTensorDict& b);

}  // namespace tdshm
