#pragma once
// One posted send or receive of the point-to-point channel (channel.h), and how ops are made.

#include "common/recycle.h"
#include "shm/p2p/message_check.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

namespace tdshm::detail {

struct SendOp;
struct RecvOp;

/// One posted send or receive: what both kinds carry (the head the waits and the matcher read);
/// SendOp and RecvOp add the fields of their kind. `error` (and a RecvOp's `source` and
/// `sender_leaves`) are written under the owner's lock before `done` is stored (release); a thread
/// that loads done == true (acquire) may read them. Made only through make_send_op, make_recv_op
/// and make_recv_ops, whose shared_ptr destroys the op as its own kind.
struct ShmOp {
  enum class Kind { kSend, kRecv };
  const Kind kind;
  int peer = -1;  // destination of a send; source of a recv, -1 for any source
  int64_t tag = 0;
  bool control = false;  // a collective's message: matched apart from user tags
  MessageCheck check;    // what the transfer layer knows of the message (first entry's `check`)
  at::Tensor user;       // the caller's tensor
  at::Tensor staging;    // a strided `user`'s contiguous copy (send) or landing place (recv); else undefined
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  std::atomic<bool> done{false};
  std::exception_ptr error;

  std::string what() const;  // "recv from rank 1, tag 3" for messages
  /// The contiguous tensor whose bytes are `data`: the staging copy, or the caller's own tensor
  /// (no second reference to it: two reference-count operations fewer per message).
  const at::Tensor& contiguous() const noexcept { return staging.defined() ? staging : user; }
  /// This op as its kind (kind says which).
  SendOp& as_send() noexcept;
  RecvOp& as_recv() noexcept;
  const RecvOp& as_recv() const noexcept;

 protected:
  // User-provided, so that make_shared's value-initialisation does not zero the whole op before
  // the member initialisers run (a few hundred bytes per message).
  explicit ShmOp(Kind k) noexcept : kind(k) {}
  ~ShmOp() = default;  // destroyed only as its kind (no virtual call)
};

struct SendOp final : ShmOp {
  SendOp() noexcept : ShmOp(Kind::kSend) {}
  std::string reference;     // a named memmap: the MemmapReference payload sent instead of the bytes
  int64_t loan = -1;         // a loan: its allocation in this rank's loan heap (else -1)
  uint64_t loan_offset = 0;  //   and the offset of its bytes there
  uint64_t posted = 0;       // payload bytes written to the ring
  bool started = false;      // first entry written (it can no longer be taken back)
};

struct RecvOp final : ShmOp {
  RecvOp() noexcept : ShmOp(Kind::kRecv) {}
  bool view = false;           // recv_view: lands in a tensor of the message's shape and dtype (user),
                               //   the sender's bytes themselves when they are a loan
  int source = -1;             // the rank the message came from
  uint16_t sender_leaves = 0;  // failed on a leaf count: the message's (else 0)
};

inline SendOp& ShmOp::as_send() noexcept { return static_cast<SendOp&>(*this); }
inline RecvOp& ShmOp::as_recv() noexcept { return static_cast<RecvOp&>(*this); }
inline const RecvOp& ShmOp::as_recv() const noexcept { return static_cast<const RecvOp&>(*this); }

/// Ops of one call: a tree's leaves are few, so they stay inline (no allocation per transfer).
using OpList = c10::SmallVector<std::shared_ptr<ShmOp>, 4>;

/// Whether `op` completed (or failed). A null op is a send that completed when it was posted.
inline bool is_done(const std::shared_ptr<ShmOp>& op) noexcept {
  return !op || op->done.load(std::memory_order_acquire);  // pairs with the release store in finish
}

// Fills a fresh op. A strided `user` gets a contiguous staging tensor: a send snapshots it at
// post time, a receive lands there and is copied over at the end.
inline void init_op(ShmOp& op, int peer, int64_t tag, bool control, const at::Tensor& user) {
  op.peer = peer;
  op.tag = tag;
  op.control = control;
  op.user = user;
  if (!user.is_contiguous()) {
    op.staging = op.kind == ShmOp::Kind::kSend ? user.contiguous() : at::empty(user.sizes(), user.options());
  }
  const at::Tensor& bytes = op.contiguous();
  op.data = static_cast<uint8_t*>(bytes.data_ptr());
  op.bytes = static_cast<uint64_t>(bytes.numel()) * bytes.element_size();
}

// A fresh op and its control block in one block that the thread recycles (one per message).
template <class Op>
std::shared_ptr<Op> new_op() {
  return std::allocate_shared<Op>(RecyclingAllocator<Op>{});
}

inline std::shared_ptr<SendOp> make_send_op(int dst, int64_t tag, bool control, const at::Tensor& user) {
  auto op = new_op<SendOp>();
  init_op(*op, dst, tag, control, user);
  return op;
}

inline std::shared_ptr<RecvOp> make_recv_op(int src, int64_t tag, bool control, const at::Tensor& user) {
  auto op = new_op<RecvOp>();
  init_op(*op, src, tag, control, user);
  return op;
}

// `n` fresh receives. A few (a small tree's leaves) each come from the thread's recycled blocks,
// as a single receive's op does: no allocation at all. More share one array, each an aliasing
// shared_ptr into it, so a tree of 100 leaves costs two allocations (the array and its control
// block) rather than 100 (the array, and the tensors its ops hold, live until the last of them
// is released).
inline OpList make_recv_ops(size_t n) {
  constexpr size_t kRecycledUpTo = 8;
  OpList ops(n);
  if (n <= kRecycledUpTo) {
    for (auto& op : ops) op = new_op<RecvOp>();
    return ops;
  }
  std::shared_ptr<RecvOp[]> block(new RecvOp[n]);  // (make_shared<T[]> would need a copyable op)
  for (size_t i = 0; i < n; ++i) ops[i] = std::shared_ptr<ShmOp>(block, &block[i]);
  return ops;
}

}  // namespace tdshm::detail
