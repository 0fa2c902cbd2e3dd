#pragma once
/// \file
/// ProcessGroupShm: a c10d::ProcessGroup whose ranks are processes on one host that share a
/// named shared-memory segment (/dev/shm/tdshm.<name>).
///
/// Supported: send, recv, recvAnysource of one dense CPU tensor (any dtype, contiguous or not;
/// a conjugate or negative view is sent as its values, through a resolved copy) with integer
/// tags; the collectives broadcast, barrier, allreduce, allreduce_coalesced,
/// reduce, allgather, _allgather_base, gather, scatter, reduce_scatter, _reduce_scatter_base
/// and alltoall_base (see "Collectives" below). What else torch 1.13's ProcessGroup declares
/// (alltoall of tensor lists, allgather_coalesced, monitoredBarrier) throws c10::Error saying the
/// "shm" backend does not support it.
///
/// Matching follows MPI: messages from one sender to one receiver with the same tag are received
/// in the order they were sent; messages with different tags may be received in any order.
/// A message that arrives before its recv is posted is kept (in process memory, up to
/// ShmOptions::max_unexpected_bytes per group) until it is received, so two ranks that both send
/// before they receive never deadlock while their early messages fit that budget; past it the
/// sender waits for the recv (back-pressure).
/// A message whose byte size, dtype or shape does not fit the recv it matches fails that recv
/// with a TransportError and is dropped (as MPI drops a truncated message), so the messages
/// that follow it on the same tag are still received in order.
///
/// MemoryMappedTensors travel by reference: a contiguous tensor that views a named
/// MemoryMappedTensor (one with a filename) is sent as (file, offset) in one ring entry, whatever
/// its size, and the send completes at once. The receiver reads the bytes from the file when the
/// message is received (so writes the sender makes to the file until then are seen), straight
/// into its tensor; when its tensor maps the same bytes (same file and offset, a shared mapping)
/// nothing is copied at all. An anonymous memmap, or a strided view of one, is sent by value.
///
/// Progress: there is no background thread on the point-to-point data path (collectives: see
/// "Collectives" below). A transfer moves when a thread of
/// this process is inside a tdshm call: send/recv post what fits at once, and Work::wait,
/// Work::isCompleted and every later call move everything that is pending, in both directions.
/// A small send (up to ShmOptions::slot_bytes) is complete when send() returns. A larger one
/// streams through the ring while some call of this process waits. getFuture() starts a helper
/// thread that keeps progress going while futures are pending, so future-only users never hang.
///
/// Waiting: a waiter spins for ShmOptions::spin (yielding now and then, so a peer on the same
/// core still runs), then sleeps on a futex in the segment; posting to a spinning peer costs no
/// system call. Every wait has a deadline (TimeoutError) and checks the liveness of the peers it
/// waits on every ShmOptions::peer_check_interval (PeerLostError when one died). A wait that
/// times out withdraws its receives (and its sends that have not started): they fail with the
/// TimeoutError and never match a later message.
///
/// Incarnations: each construction under a name joins or starts one incarnation of the group.
/// A rank that was already a member of the current one (it left, or it died and was restarted)
/// starts a new one, and the other ranks join it when they construct their own group again;
/// ranks meet only ranks of the same incarnation and no message crosses incarnations. So
/// destroy-then-construct under one name is always safe, in any order and interleaving.
///
/// Trust: the segment and its lock file must belong to the caller's effective uid and be private
/// to it (mode 0600); anything else, or a symbolic link at either path, is a SegmentError. Ranks
/// of the same user are trusted not to attack, but not to be bug-free: what they write is read
/// once and validated, a malformed entry fails that pair's transfers with a TransportError, and
/// a segment file truncated under a mapping fails the group's transfers instead of raising
/// SIGBUS (tdshm installs a SIGBUS handler that chains to the previous one for other faults).
///
/// A receive into a tensor whose elements overlap (an expanded, stride-0 view) or into a
/// read-only memory-mapped tensor is refused when posted (tdshm::TypeError).
///
/// The Works of small receives (tensors of up to 64 KiB) are kept by the group once their callers
/// drop them and reused for later receives: a kept Work refers to its last tensor until then, or
/// until the group is destroyed.
///
/// Thread safety: all methods may be called from several threads at once.

#include <tdshm/errors.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tdshm {

namespace detail {
class ShmEngine;
class RecvWorkPool;
class CollectiveQueue;
struct ShmGroupSeam;  // what tdshm's own layers ask of a group beyond this API (not public)
}  // namespace detail

/// Options of a ProcessGroupShm. All ranks of a group must use the same slot_bytes,
/// slots_per_rank, ring_entries and window_bytes (they fix the segment layout; a mismatch is a
/// SegmentError at attach).
struct ShmOptions {
  /// Deadline of every wait, including the rendezvous of the constructor.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// How long a waiter spins before it sleeps on a futex. 0: blocking only (never spins).
  /// Spinning yields the core every few checks, so a longer budget costs a co-scheduled peer
  /// little; 250 us lets a rank that waits a few hundred microseconds (an actor waiting for its
  /// weights) avoid a futex wake-up per wait. The budget adapts (see "Waiting" above).
  std::chrono::microseconds spin{std::chrono::microseconds(250)};
  /// Payload bytes of one arena slot; larger messages are cut into chunks of this size (a chunk
  /// of up to 72 bytes travels inline in its ring entry and takes no slot).
  size_t slot_bytes = size_t{64} << 10;
  /// Arena slots of each rank: what one rank may have in flight towards all of its peers
  /// together (memory: world × slots_per_rank × slot_bytes; 4 MiB per rank by default).
  uint32_t slots_per_rank = 64;
  /// Entries of the metadata ring of each ordered pair of ranks: messages (or chunks) one rank
  /// may have in flight towards one peer (memory: world² × ring_entries × 192 bytes).
  uint32_t ring_entries = 64;
  /// Bytes of each rank's collective window (memory: world × window_bytes): collectives move
  /// their data through it in steps of window_bytes / 4 per rank, larger tensors in several steps.
  /// A multiple of 256 in [256, 2^30].
  size_t window_bytes = size_t{1} << 20;
  /// How often a waiter checks that its peers are alive: a dead peer's transfers fail within
  /// about this long.
  std::chrono::milliseconds peer_check_interval{std::chrono::milliseconds(100)};
  /// Most bytes of process memory a rank holds for messages that arrived before their recv was
  /// posted. Past it, a new early message stays in its ring and its sender waits until the recv
  /// is posted (back-pressure): nothing is dropped, and no peer can make a rank allocate more.
  size_t max_unexpected_bytes = size_t{1} << 30;
  /// Bytes of each rank's loan heap (rounded up to 4 KiB; memory: world × loan_bytes): the
  /// tensors tdshm::loan hands out live there and travel by reference (tdshm::loan, distributed.h). 0: no loans.
  size_t loan_bytes = size_t{1} << 20;
  /// Loans one rank may have lent at once (sends of loans not yet handed back), in [1, 2^16].
  uint32_t loan_tickets = 64;
  /// Whether this rank's TensorDict::init_remote / from_remote_init (point to point) exchange
  /// MemoryMappedTensor leaves by reference with a rank that allows it too: the receiver's leaf
  /// maps the sender's file and its bytes do not cross the segment (docs/semantics.md). Off in
  /// the Python "shm" backend, whose from_remote_init is tensordict's.
  bool memmap_by_reference = true;
  /// Whether this rank's tensordict transfers are tdshm's C++ ones (TensorDict's methods), which
  /// its peers read from the segment: protocols only tdshm speaks (gather_and_stack) are refused
  /// up front in a group with a rank that says false. The Python backend says false.
  bool tdshm_transfers = true;
};

/// Gives the bytes of a view (ProcessGroupShm::irecv_view / recv_view, TensorDict::recv_view) back
/// to their sender now rather than when the view's last reference is dropped: the sender may then
/// write into them, so the view (and every tensor sharing its storage) must not be read again.
/// Returns false, doing nothing, for a tensor that does not view a loan (or was released already).
bool release_view(const at::Tensor& view) noexcept;

/// Size in bytes of the segment for `world_size` ranks with `options`.
size_t shm_segment_bytes(int world_size, const ShmOptions& options = {});

/// Checks a segment name: 1 to 200 characters of [A-Za-z0-9._-]. Throws SegmentError.
void validate_segment_name(const std::string& name);

/// Removes the segment `name` if it exists and no live process is attached to it; returns true
/// if something was removed. Throws SegmentError if live ranks still use it, TimeoutError when
/// another process holds its lock file for 5 s.
bool remove_stale_segment(const std::string& name);

class ProcessGroupShm : public c10d::ProcessGroup {
 public:
  /// Attaches rank `rank` of `size` to the segment `name`, creating it if needed (any rank may),
  /// and waits until all `size` ranks have attached (deadline options.timeout).
  /// Throws SegmentError: invalid name or arguments; an existing segment of another world size,
  /// layout version or options; `rank` held by a live process; /dev/shm too small (the message
  /// says how much is needed). A leftover segment whose ranks are all dead is replaced.
  ProcessGroupShm(const std::string& name, int rank, int size, ShmOptions options = {});
  /// Leaves the group; the last rank to leave removes the segment. Pending works fail.
  ~ProcessGroupShm() override;
  /// What the destructor does, while the object lives on: every pending and later work of this
  /// rank fails with `reason` (null: the destructor's error), and the rank leaves the segment
  /// (its peers see it gone). For a rank that knows its world is lost (a world across hosts
  /// whose rank on another host died). Idempotent.
  void shutdown(std::exception_ptr reason = nullptr) noexcept;

  const std::string getBackendName() const override { return "shm"; }
  // Works of this backend support abort(): a pending receive (or a send not yet started) is
  // withdrawn and fails with a TransportError; one that completed is left as it is.

  /// Sends tensors[0] (exactly one dense CPU tensor) to dstRank with `tag`.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  /// Receives into tensors[0]; the message must have its byte size (TransportError otherwise;
  /// dtype and shape are checked too when the sender's are known).
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  /// Receives the first matching message from any rank; Work::sourceRank() tells which.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // ---- Loans and views (docs/loans.md) ----
  /// A contiguous CPU tensor of `sizes` and `dtype` whose bytes live in this rank's loan heap
  /// (ShmOptions::loan_bytes) of the segment: a send of it (or of any contiguous part of it) to
  /// any rank of this group posts a reference, not the bytes; the send's Work completes once the
  /// receiver no longer reads them (it copied them out, or dropped its view). Its bytes are reused
  /// once it is dropped and no receiver holds them. Waits for room while receivers hold earlier
  /// loans (TimeoutError after ShmOptions::timeout, naming who holds what); a loan larger than the
  /// heap is a SegmentError, a negative shape a ShapeError. Any thread.
  at::Tensor loan(at::IntArrayRef sizes, at::ScalarType dtype);
  /// loan() without waiting: an undefined tensor when the heap has no room now (receivers hold
  /// earlier loans) or never will (larger than the heap), for callers that then send by value.
  at::Tensor try_loan(at::IntArrayRef sizes, at::ScalarType dtype);
  /// Whether `t`'s bytes lie wholly inside one live loan of this group (its sends go by reference).
  bool is_loan(const at::Tensor& t) const;
  /// Receives whatever tensor `srcRank` sends with `tag`, in a tensor of the sender's shape and
  /// dtype (Work::result()): when the sender's tensor is a loan, a view of its bytes (no copy;
  /// they go back to the sender when the view's last reference is dropped), else a fresh tensor.
  c10::intrusive_ptr<c10d::Work> irecv_view(int srcRank, int tag);
  /// irecv_view, waited for: the received tensor.
  at::Tensor recv_view(int srcRank, int tag);
  /// The next `n` messages `srcRank` sends with `tag`, each received as irecv_view receives it,
  /// posted at once: one Work whose result() is the n tensors in order once wait() returned;
  /// wait() throws the first error as soon as one receive failed.
  c10::intrusive_ptr<c10d::Work> irecv_views(int srcRank, int tag, size_t n);
  /// Whether this rank and `peer` both set ShmOptions::memmap_by_reference: their
  /// init_remote / from_remote_init then pass MemoryMappedTensor leaves as files, not bytes.
  bool memmap_by_reference_with(int peer) const noexcept;
  /// Whether rank `peer` runs tdshm's C++ tensordict transfers, not a Python process's
  /// tensordict (protocols only tdshm speaks, such as gather_and_stack's, need every rank to).
  bool runs_tdshm_transfers(int peer) const noexcept;
  /// Whether rank `peer` died holding its place in the group: its process ended (a crash, a
  /// kill) without leaving. False for a live rank, one that left (destroyed or shut down its
  /// group, whether or not its process still runs), and this rank. Reads the segment's rank
  /// table; usable after shutdown().
  bool peer_died(int peer) const;

  // ---- Collectives (docs/transport.md, "Collectives over the windows"; protocol in src/shm/engine/collectives.h) ----
  // They run over the segment's collective windows, one at a time in issue order: the call checks
  // its arguments and returns at once; Work::wait() runs the collective (and those issued before
  // it) in the waiting thread, and one nobody waits for runs on the group's helper thread
  // (docs/transport.md, "Which thread runs a collective"). wait() raises what went wrong
  // (PeerLostError when a rank is gone,
  // TimeoutError past opts.timeout or ShmOptions::timeout, TransportError when the ranks called
  // different collectives or with other sizes). Bad arguments throw at the call (c10::Error, or
  // TypeError for a reduce op the dtype does not have). Every rank gets bit-identical results.
  // After a collective failed midway, every later collective of the group fails with its error.
  // Tensors: dense CPU tensors of any dtype, any size (streamed through the window), strided
  // ones are staged. Ops: SUM, AVG (floating point and complex), PRODUCT, MIN, MAX, BAND, BOR,
  // BXOR (integers and bool).

  /// Broadcasts tensors[0] (exactly one tensor) from opts.rootRank to every rank.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  /// Completes on every rank once all ranks have entered it.
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  /// One dtype for all tensors; reduced as one buffer.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  /// Only the root's tensor changes.
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  /// Outputs on the root only (an empty list elsewhere).
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  /// Inputs on the root only (an empty list elsewhere).
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  /// torch's reduce_scatter_tensor: the input holds world size blocks of output.numel()
  /// elements, block r is rank r's share.
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  /// Split sizes count rows of dim 0 (empty: equal); every rank checks every pair's sizes.
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;

  /// The segment's name (without the "tdshm." prefix).
  const std::string& segment_name() const noexcept;
  const ShmOptions& options() const noexcept;

 private:
  friend struct detail::ShmGroupSeam;

  // Issues `body(deadline)` as the group's next collective (process_group_shm_collectives.cpp).
  template <class Body>
  c10::intrusive_ptr<c10d::Work> run_collective(c10d::OpType type, std::chrono::milliseconds timeout, Body&& body,
                                                std::vector<at::Tensor> outputs);

  std::shared_ptr<detail::ShmEngine> engine_;
  // The collectives issued and not yet run, in order (process_group/collective_queue.h).
  std::shared_ptr<detail::CollectiveQueue> collectives_;
  // What every send that completed as it was posted returns (its bytes are in the segment): one
  // completed Work, shared, rather than one allocated and destroyed per message.
  c10::intrusive_ptr<c10d::Work> sent_;
  // Small receives' Works, reused once their callers dropped them (process_group_shm.cpp).
  std::unique_ptr<detail::RecvWorkPool> recv_works_;
};

/// A shm group that meets through a c10d store, as torch.distributed's backends do (what the
/// Python "shm" backend and init_process_group("shm", tcp:// / file:// / env://) use): rank 0
/// makes a fresh random segment name and sets it under "tdshm_shm_segment" in `store` (which
/// must be the group's own, prefixed store: one group per prefix), the other ranks wait for it
/// (at most options.timeout, then TimeoutError), then all construct ProcessGroupShm. Throws
/// Error for a null store or a rank outside [0, size), SegmentError for a malformed name read
/// from the store, and whatever the constructor throws.
c10::intrusive_ptr<ProcessGroupShm> make_shm_group_from_store(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                              int size, ShmOptions options);

/// The "shm" backend over a store, wherever its ranks run (what init_process_group("shm") and the
/// Python backend use): every rank first learns which ranks share memory with it (those that
/// open its files in /dev/shm and share its PID namespace: one host, docs/hosts.md). When all do,
/// this is make_shm_group_from_store. Otherwise each host's ranks form a ProcessGroupShm, the
/// whole world a ProcessGroupGloo on the same store, and the returned group routes each pair
/// over shared memory or the network and runs the collectives hierarchically. Throws as
/// make_shm_group_from_store does, TimeoutError when a rank does not answer in options.timeout.
c10::intrusive_ptr<c10d::ProcessGroup> make_group_from_store(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                             int size, ShmOptions options);

}  // namespace tdshm
