#pragma once
/// \file
/// Process groups and the options of the tensordict transfer API (the methods themselves are
/// TensorDict members, see tensordict.h, and tensorclass members, see tensorclass.h).
///
/// The same user code runs over the shared-memory transport on one host ("shm",
/// ProcessGroupShm) and over c10d's ProcessGroupGloo (TCP) across hosts ("gloo"):
///
/// \code
///   auto world = tdshm::init_process_group("shm", {.rank = 1, .world_size = 2, .init_method = "shm://demo"});
///   td.isend({.dst = 0});                                      // returns the last tag
///   auto t = td2.irecv({.src = 1, .return_premature = true});  // t.works: the Work handles
/// \endcode
///
/// Python keyword arguments are option structs with the same names and defaults; a Python
/// `None` is an empty std::optional (or a default-constructed Group: the default group). Every
/// member has a default member initializer, so designated initializers that name only some of
/// them compile cleanly under -Wextra (-Wmissing-field-initializers).

#include <tdshm/errors.h>
#include <tdshm/process_group.h>
#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tdshm {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// A process group as the transfer API sees it: a c10d backend plus, when the group was made by
/// init_process_group or new_group, the global rank of each of its members.
///
/// A default-constructed Group is "no group": transfer calls then use the default group.
/// A Group built from a backend alone is standalone (never registered): it is addressed with
/// group_dst / group_src only; `dst` / `src` on it throw Error (as torch does for a group it
/// does not know).
namespace detail {
class Transport;
}  // namespace detail

class Group {
 public:
  Group() = default;
  /// A standalone group over `backend` (its ranks are the backend's ranks).
  explicit Group(c10::intrusive_ptr<c10d::ProcessGroup> backend);
  /// A registered group: `global_ranks[i]` is the global rank of group rank i.
  Group(c10::intrusive_ptr<c10d::ProcessGroup> backend, std::vector<int> global_ranks);

  /// What new_group returns on a rank outside the group (torch's NON_GROUP_MEMBER): not
  /// defined(), and a transfer given it as `group` throws Error instead of using the default group.
  static Group not_a_member() {
    Group g;
    g.non_member_ = true;
    return g;
  }
  bool is_non_member() const noexcept { return non_member_; }

  /// False for "no group" and for the value new_group returns on a rank outside the group.
  bool defined() const noexcept { return static_cast<bool>(backend_); }
  /// True for a group made by init_process_group or new_group.
  bool registered() const noexcept { return !global_ranks().empty(); }
  /// The c10d backend. Throws Error if !defined().
  c10d::ProcessGroup& backend() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& backend_ptr() const noexcept { return backend_; }
  /// "shm" or "gloo" (the backend's name).
  std::string backend_name() const;
  /// This process's rank in the group, and the group's size. Throw Error if !defined().
  int rank() const;
  int size() const;
  /// Global ranks of the members (empty for a standalone group).
  const std::vector<int>& global_ranks() const noexcept {
    static const std::vector<int> none;
    return shared_ ? shared_->global_ranks : none;
  }
  /// The group rank of global rank `global`. Throws Error for a standalone group or a rank that
  /// is not a member.
  int group_rank(int global) const;
  /// The global rank of group rank `group_rank`. Throws Error if out of range; for a standalone
  /// group returns `group_rank` itself.
  int global_rank(int group_rank) const;

  /// Whether this rank and group rank `peer` both run tdshm's transfer layer and agreed, when the
  /// group was formed, to use its checked gloo protocol (see docs/wire.md): a
  /// per-leaf layout descriptor and a consolidated header that let the receiver name the key
  /// that differs. False for every Python (tensordict) peer and over shm (where the checks ride
  /// inside the transport's own message metadata): then the wire is exactly tensordict's. In a
  /// "shm" world across hosts: with the tdshm ranks of other hosts.
  bool checked_wire_with(int peer) const noexcept;
  /// Whether it holds with every member (collective exchanges: broadcast).
  bool checked_wire_all() const noexcept;
  /// Internal (set by init_process_group / new_group): which group ranks advertised the checked
  /// protocol.
  void set_checked_wire(std::vector<bool> advertised);
  /// Internal: what the backend can do for the transfer layer (made with the group). Throws
  /// Error if !defined().
  const detail::Transport& transport() const;

 private:
  // What copies share, never changed once the group is formed (set_checked_wire replaces it): a
  // Group is copied by options and by transfers that outlive their call, so a copy costs two
  // reference counts and no allocation (a blocking transfer refers to its options' group).
  struct Shared {
    std::vector<int> global_ranks;  // empty: a standalone group
    std::vector<bool> checked;      // per group rank: advertised the checked protocol (empty: not set)
    std::shared_ptr<const detail::Transport> transport;
  };
  c10::intrusive_ptr<c10d::ProcessGroup> backend_;
  std::shared_ptr<const Shared> shared_;
  bool non_member_ = false;
};

/// Options of init_process_group (torch.distributed.init_process_group's parameters).
struct InitOptions {
  /// This process's rank and the number of processes; -1: read RANK / WORLD_SIZE from the
  /// environment (as torch's env:// does; here with any init_method).
  int rank = -1;
  int world_size = -1;
  /// "tcp://HOST:PORT", "file://PATH" or "env://" (MASTER_ADDR, MASTER_PORT) for both backends,
  /// with torch 1.13's store layout, so that Python ranks (torch.distributed, and for "shm" the
  /// tdshm Python package) join the same world; "shm://NAME" for shm without a store (NAME: a
  /// segment name, see validate_segment_name).
  std::string init_method = "env://";
  /// Deadline of the rendezvous and of every later wait of the group.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// Options of the shm backend (its timeout is replaced by `timeout`).
  ShmOptions shm{};
  /// gloo: advertise tdshm's checked protocol in the store when the group is formed, and use it
  /// with every peer that advertised it too (tdshm ranks with this option on). Python ranks never
  /// advertise, so they always get tensordict's exact wire. false: this rank speaks tensordict's
  /// wire to everyone. Over shared memory it is not used (its checks travel inside the
  /// transport's entries); in a "shm" world across hosts it applies to the ranks of other hosts.
  bool checked_wire = true;
};

/// Creates the default (world) group with `backend` "shm" or "gloo" and returns it. Throws
/// Error if a default group exists already, for an unknown backend or a malformed init_method
/// (the message names what was expected), TimeoutError if the peers do not arrive in time.
/// gloo's transport binds to 127.0.0.1 when the rendezvous host is a loopback address (all peers
/// are local), else to the interface GLOO_SOCKET_IFNAME names, else to gloo's default device.
/// Thread safety: all functions of the default group may be called from any thread.
Group init_process_group(const std::string& backend, const InitOptions& options = {});
/// Whether init_process_group succeeded and destroy_process_group was not called since.
bool is_initialized() noexcept;
/// The default group. Throws Error if there is none.
Group default_group();
/// Rank and size in the default group. Throw Error if there is none.
int get_rank();
int get_world_size();
/// A subgroup of the default group with the given global ranks (any order; group rank i is
/// ranks[i]). Like torch, every rank of the default group must call new_group with the same
/// ranks in the same order of calls; on a rank outside `ranks` the result is not defined()
/// (Group{}) and the call returns at once (over a store it only checks in to the store-based
/// barrier, without waiting). Throws Error for an empty list, duplicate or out-of-range ranks
/// (such a call counts for nothing in that order).
/// tcp://, file://, env://: torch 1.13's layout: group k (the k-th valid call) is named
/// str(k + 1) and meets under "default_pg/<name>/" of the store, followed by the store-based
/// barrier "default_pg/store_based_barrier_key:<k + 2>" of every rank, so Python ranks calling
/// torch.distributed.new_group in the same order join it (torch sorts the ranks: with Python
/// ranks, pass them sorted). "shm://NAME": on the segment "<NAME>.g<k>", k from 0.
Group new_group(const std::vector<int>& ranks);
/// Releases the default group and every group made by new_group: a group the caller still holds
/// (a Group copy) stays usable; the pending works of the others fail. With gloo over tcp:// or
/// env://, rank 0 serves the store: it must not destroy before the other ranks are done with
/// their new_group calls.
void destroy_process_group();
/// A standalone gloo group over `store` (a c10d TCPStore or FileStore, possibly wrapped in a
/// PrefixStore), never registered: address its ranks with group_dst / group_src. The device is
/// chosen as for init_process_group (loopback for a TCPStore on a loopback host). It advertises
/// tdshm's checked wire in the store, as init_process_group does (Group::checked_wire_with).
/// Throws Error for a null store or a rank outside [0, size).
Group gloo_group_from_store(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                            std::chrono::milliseconds timeout = std::chrono::minutes(30));

// ---------------------------------------------------------------------------------------------
// Options and results of the transfer methods. Peers: exactly one of dst / group_dst (src /
// group_src); group_dst requires group. See docs/semantics.md for tags and leaf order.

/// Options of tdshm::loan.
struct LoanOptions {
  Group group{};  ///< default: the default group
  /// The rank the loan is meant for (group rank, for the docs' symmetry with send): any rank of
  /// the group may receive it, since a loan lives in its owner's heap, which every rank maps.
  std::optional<int> dst{};
  /// For a tensordict: one storage holding every leaf as consolidate() lays it out (the result
  /// is consolidated and locked), sent with `consolidated` as one reference; else one loan per leaf.
  bool consolidated = false;
};

/// A tensor of `sizes` and `dtype` whose bytes live in this rank's loan heap of the group's
/// segment (shm): sending it (or a contiguous part of it) to any rank of the group posts a
/// reference, not the bytes, and the send completes once the receiver no longer reads them.
/// Its contents are undefined until written (as torch.empty). Waits for room while receivers
/// hold earlier loans (TimeoutError after the group's timeout, naming who holds what); over a
/// backend without loans (gloo) it is an ordinary tensor. See docs/loans.md.
at::Tensor loan(at::IntArrayRef sizes, at::ScalarType dtype, const LoanOptions& options = {});
/// A tensordict like `like` (keys, dtypes, shapes, batch size, tensorclass name, non-tensor
/// values) whose leaves are loans, or with `consolidated` whose consolidated storage is one.
TensorDict loan(const TensorDict& like, const LoanOptions& options = {});
/// release_view (<tdshm/process_group.h>) of every leaf of `td` (and of its consolidated
/// storage): the senders' loans go back now; `td` must not be read afterwards. Returns how many
/// loans went back (a consolidated view is one).
size_t release_views(const TensorDict& td);

/// isend / send (TensorDictBase.isend's keyword arguments).
struct SendOptions {
  std::optional<int> dst{};        ///< global rank of the destination
  Group group{};                   ///< default: the default group
  std::optional<int> group_dst{};  ///< rank of the destination inside `group`
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  bool return_early = false;       ///< isend only: return the Work handles without waiting
  bool consolidated = false;       ///< one message with the consolidated storage
};

/// irecv / recv (TensorDictBase.irecv's keyword arguments).
struct RecvOptions {
  std::optional<int> src{};
  Group group{};
  std::optional<int> group_src{};
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  bool return_premature = false;  ///< irecv only: return the Work handles without waiting
  bool consolidated = false;
};

/// TensorDict::gather_and_stack: every rank of `group` calls it with the same destination,
/// exactly one of dst / group_dst (group_dst requires group; a standalone group has only it).
struct GatherAndStackOptions {
  std::optional<int> dst{};        ///< global rank that receives and stacks
  Group group{};                   ///< default: the default group
  std::optional<int> group_dst{};  ///< the same, as a rank of `group`
};

/// What isend / irecv return. Python returns one of int, List[Work] or None; here:
///  * isend per-leaf, return_early false: `last_tag` set, `works` empty;
///  * return_early / return_premature true: `works` holds the handles (a list of one for a
///    consolidated transfer), `has_works` is true;
///  * otherwise (irecv, or isend consolidated without return_early): neither (Python's None).
struct Transfer {
  std::optional<int64_t> last_tag{};
  bool has_works = false;
  std::vector<WorkPtr> works{};
  /// Waits for every work (rethrowing the first error); nothing to do when there are none.
  void wait() const;
};

/// init_remote (dst, group, device, use_broadcast).
struct InitRemoteOptions {
  std::optional<int> dst{};
  Group group{};
  std::optional<c10::Device> device{};
  bool use_broadcast = false;
};

/// from_remote_init (src, group, device, use_broadcast).
struct FromRemoteInitOptions {
  std::optional<int> src{};
  Group group{};
  std::optional<c10::Device> device{};  ///< where the storage is allocated (default CPU)
  bool use_broadcast = false;
  /// A memory-mapped leaf the sender passes by reference (ShmOptions::memmap_by_reference) is
  /// mapped shared and writable only when this is set and the sender's is writable; by default
  /// the receiver maps it read-only (it sees the sender's writes, its own stay private).
  bool memmap_writable = false;
};

/// broadcast (src, group, device).
struct BroadcastOptions {
  int src = 0;  ///< global rank of the root
  Group group{};
  std::optional<c10::Device> device{};
};

/// reduce (dst, op, async_op, return_premature, group).
struct ReduceOptions {
  int dst = 0;  ///< global rank that receives the result
  c10d::ReduceOp op = c10d::ReduceOp::SUM;  ///< Python's op=None is SUM
  bool async_op = false;
  bool return_premature = false;  ///< with async_op: return the Work handles without waiting
  Group group{};
};

/// all_reduce (op, group, async_op).
struct AllReduceOptions {
  c10d::ReduceOp op = c10d::ReduceOp::SUM;
  Group group{};
  bool async_op = false;  ///< return the Work handles without waiting
};

/// all_gather (group).
struct AllGatherOptions {
  Group group{};
};

/// scatter (src, tensordicts, group, device).
struct ScatterOptions {
  int src = 0;  ///< global rank of the source
  /// On the source: one tensordict per rank of the group, in group rank order. Ignored
  /// elsewhere (Python's None).
  std::optional<std::vector<TensorDict>> tensordicts{};
  Group group{};
  std::optional<c10::Device> device{};  ///< where the result lives (default CPU)
};

/// The pseudo-random tag of `seed` (tensordict's _int_generator): numpy default_rng(seed),
/// .bytes(8) read big-endian, mod 10000. Bit-identical to numpy for every seed >= 0; throws
/// Error for a negative seed.
int64_t pseudo_rand_tag(int64_t seed);
/// The tags of `n` leaves: init_tag, init_tag+1, ... or, with pseudo_rand, t0 =
/// pseudo_rand_tag(init_tag), t(i+1) = pseudo_rand_tag(t(i) + 1).
std::vector<int64_t> transfer_tags(int64_t init_tag, size_t n, bool pseudo_rand);

// ---------------------------------------------------------------------------------------------
// The tensorclass transfer methods (declared in TensorClass): those of the inner tensordict.

template <class Derived>
Transfer TensorClass<Derived>::isend(const SendOptions& options) const {
  return this->td_.isend(options);
}
template <class Derived>
void TensorClass<Derived>::send(const SendOptions& options) const {
  this->td_.send(options);
}
template <class Derived>
Transfer TensorClass<Derived>::irecv(const RecvOptions& options) {
  return this->td_.irecv(options);
}
template <class Derived>
int64_t TensorClass<Derived>::recv(const RecvOptions& options) {
  return this->td_.recv(options);
}
template <class Derived>
void TensorClass<Derived>::init_remote(const InitRemoteOptions& options) const {
  this->td_.init_remote(options);
}
template <class Derived>
Derived TensorClass<Derived>::from_remote_init(const FromRemoteInitOptions& options) {
  return tensorclass_cast<Derived>(TensorDict::from_remote_init(options));
}
template <class Derived>
Derived TensorClass<Derived>::broadcast(const BroadcastOptions& options) const {
  return tensorclass_cast<Derived>(this->td_.broadcast(options));
}

template <class Derived>
Transfer TensorClass<Derived>::reduce(const ReduceOptions& options) {
  return this->td_.reduce(options);
}
template <class Derived>
Transfer TensorClass<Derived>::all_reduce(const AllReduceOptions& options) {
  return this->td_.all_reduce(options);
}
template <class Derived>
std::vector<TensorDict> TensorClass<Derived>::all_gather(const AllGatherOptions& options) const {
  return this->td_.all_gather(options);
}
template <class Derived>
TensorDict TensorClass<Derived>::scatter(const ScatterOptions& options) const {
  return this->td_.scatter(options);
}

}  // namespace tdshm
