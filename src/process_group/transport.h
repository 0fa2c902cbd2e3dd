#pragma once
// The seam between the transfer layer (src/distributed) and the backends that carry its
// messages: what a transfer needs of a group's transport is asked of it here, never found out
// from the backend's name. Implementations (transport.cpp): tdshm's shared-memory
// ProcessGroupShm; any other c10d backend (gloo), which carries plain messages only; and a world
// across hosts, which answers for each peer as the route to it does (hence can(peer)). A Group
// makes its transport once, when it is built (make_transport).

#include <tdshm/process_group.h>

#include "process_group/batch_work.h"
#include "shm/p2p/message_check.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <span>
#include <vector>

namespace tdshm::detail {

using TransportWork = c10::intrusive_ptr<c10d::Work>;

class Transport {
 public:
  /// What the transport can do beyond c10d's send and recv.
  struct Can {
    /// A MessageCheck rides with every message (key hash or schema hash, leaf count), so the
    /// receiver refuses a message meant for another leaf without a word more on the wire.
    bool check_messages = false;
    /// Many messages to one peer are posted under one lock as one batch (send_batch,
    /// recv_batch), with a view of each message (the Batch calls below).
    bool batch = false;
    /// Sends and receives strided tensors itself (packed at post time, staged on receipt): the
    /// transfer layer hands them over as they are.
    bool strided = false;
    /// A receive whose tensor does not fit the message takes the message and drops it, so a
    /// receive of no bytes skips one message and the pair stays in step.
    bool drop_mismatched = false;
    /// Hands out loans (tensors in the sender's shared memory, sent by reference) and receives
    /// views of them (recv_view). Without it a loan is an ordinary tensor.
    bool loans = false;
  };

  virtual ~Transport() = default;
  /// What it can do with `peer` (a group rank): one answer for every peer, except in a group
  /// whose peers are reached by different routes (a world across hosts).
  virtual const Can& can(int /*peer*/) const noexcept { return can_; }

  /// One message; `check` is carried when can(peer).check_messages, else ignored.
  virtual TransportWork send(at::Tensor t, int peer, int tag, MessageCheck check) const = 0;
  virtual TransportWork recv(at::Tensor t, int peer, int tag, MessageCheck check) const = 0;

  // ---- Batches (can(peer).batch; the others throw Error) ----
  /// tensors[i] with tags[i] and checks[i], in order, posted under one lock. send_batch returns
  /// null when every message is already written (nothing to wait for). The batch answers for each
  /// message (batch_work.h).
  virtual c10::intrusive_ptr<BatchWork> send_batch(std::span<const at::Tensor> tensors, int peer,
                                                   const std::vector<int>& tags,
                                                   const std::vector<MessageCheck>& checks) const;
  virtual c10::intrusive_ptr<BatchWork> recv_batch(std::span<const at::Tensor> tensors, int peer,
                                                   const std::vector<int>& tags,
                                                   const std::vector<MessageCheck>& checks) const;

  // ---- Loans (docs/loans.md) ----
  /// A tensor of `sizes` and `dtype` whose sends go by reference to the peers whose can(peer).loans
  /// (an ordinary tensor to the others), else at::empty.
  virtual at::Tensor loan(at::IntArrayRef sizes, at::ScalarType dtype) const;
  /// Receives of whatever tensors come (tags[i] with checks[i]), in the sender's shapes and
  /// dtypes, posted under one lock: views of the sender's loans, or fresh tensors. The batch
  /// answers for each message, and its result() is the tensors in order once it is waited.
  /// can(peer).loans only (the others throw Error).
  virtual c10::intrusive_ptr<BatchWork> recv_views(int peer, const std::vector<int>& tags,
                                                   const std::vector<MessageCheck>& checks) const;

  /// Whether this rank and `peer` pass MemoryMappedTensor leaves of init_remote as files (both
  /// map the same files and run tdshm's from_remote_init), not as bytes. False by default.
  virtual bool memmap_by_reference_with(int /*peer*/) const noexcept { return false; }
  /// Whether `peer` is known to run tdshm's C++ transfers (the shm segment says so); false when
  /// the transport cannot tell (gloo: the group's checked-wire advertisement tells instead).
  virtual bool peer_runs_tdshm(int /*peer*/) const noexcept { return false; }

 protected:
  explicit Transport(Can can) noexcept : can_(can) {}

 private:
  Can can_;
};

/// The transport of `backend` (held by the transport).
std::shared_ptr<const Transport> make_transport(c10::intrusive_ptr<c10d::ProcessGroup> backend);

}  // namespace tdshm::detail
