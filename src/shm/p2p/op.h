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

/// One posted send or receive. Fields after `done` are written under the owner's lock before
/// `done` is stored (release); a thread that loads done == true (acquire) may read them.
struct ShmOp {
  enum class Kind { kSend, kRecv };
  // User-provided, so that make_shared's value-initialisation does not zero the whole op before
  // the member initialisers below run (a few hundred bytes per message).
  ShmOp() noexcept {}
  Kind kind = Kind::kSend;
  int peer = -1;  // destination of a send; source of a recv, -1 for any source
  int64_t tag = 0;
  bool control = false;        // a collective's message: matched apart from user tags
  MessageCheck check;          // what the transfer layer knows of the message (first entry's `check`)
  uint16_t sender_leaves = 0;  // recv failed on a leaf count: the message's (else 0)
  at::Tensor user;             // the caller's tensor
  at::Tensor staging;          // a strided `user`'s contiguous copy (send) or landing place (recv); else undefined
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  std::string reference;     // send of a named memmap: the MemmapReference payload sent instead of the bytes
  int64_t loan = -1;         // send of a loan: its allocation in this rank's loan heap (else -1)
  uint64_t loan_offset = 0;  //   and the offset of its bytes there
  bool view = false;         // recv_view: lands in a tensor of the message's shape and dtype (user),
                             //   the sender's bytes themselves when they are a loan
  uint64_t posted = 0;       // send: payload bytes written to the ring
  bool started = false;      // send: first entry written
  std::atomic<bool> done{false};
  std::exception_ptr error;
  int source = -1;           // recv: the rank the message came from
  std::string what() const;  // "recv from rank 1, tag 3" for messages
  /// The contiguous tensor whose bytes are `data`: the staging copy, or the caller's own tensor
  /// (no second reference to it: two reference-count operations fewer per message).
  const at::Tensor& contiguous() const noexcept { return staging.defined() ? staging : user; }
};

/// Ops of one call: a tree's leaves are few, so they stay inline (no allocation per transfer).
using OpList = c10::SmallVector<std::shared_ptr<ShmOp>, 4>;

/// Whether `op` completed (or failed). A null op is a send that completed when it was posted.
inline bool is_done(const std::shared_ptr<ShmOp>& op) noexcept {
  return !op || op->done.load(std::memory_order_acquire);  // pairs with the release store in finish
}

// Fills a fresh op. A strided `user` gets a contiguous staging tensor: a send snapshots it at
// post time, a receive lands there and is copied over at the end.
inline void init_op(ShmOp* op, ShmOp::Kind kind, int peer, int64_t tag, bool control, const at::Tensor& user) {
  op->kind = kind;
  op->peer = peer;
  op->tag = tag;
  op->control = control;
  op->user = user;
  if (!user.is_contiguous()) {
    op->staging = kind == ShmOp::Kind::kSend ? user.contiguous() : at::empty(user.sizes(), user.options());
  }
  const at::Tensor& bytes = op->contiguous();
  op->data = static_cast<uint8_t*>(bytes.data_ptr());
  op->bytes = static_cast<uint64_t>(bytes.numel()) * bytes.element_size();
}

// A fresh op and its control block in one block that the thread recycles (one per message).
inline std::shared_ptr<ShmOp> new_op() { return std::allocate_shared<ShmOp>(RecyclingAllocator<ShmOp>{}); }

inline std::shared_ptr<ShmOp> make_op(ShmOp::Kind kind, int peer, int64_t tag, bool control, const at::Tensor& user) {
  auto op = new_op();
  init_op(op.get(), kind, peer, tag, control, user);
  return op;
}

// `n` fresh ops. A few (a small tree's leaves) each come from the thread's recycled blocks, as a
// single receive's op does: no allocation at all. More share one array, each an aliasing
// shared_ptr into it, so a tree of 100 leaves costs two allocations (the array and its control
// block) rather than 100 (the array, and the tensors its ops hold, live until the last of them
// is released).
inline OpList make_ops(size_t n) {
  constexpr size_t kRecycledUpTo = 8;
  if (n <= kRecycledUpTo) {
    OpList ops(n);
    for (auto& op : ops) op = new_op();
    return ops;
  }
  std::shared_ptr<ShmOp[]> block(new ShmOp[n]);  // (make_shared<T[]> would need a copyable ShmOp)
  OpList ops(n);
  for (size_t i = 0; i < n; ++i) ops[i] = std::shared_ptr<ShmOp>(block, &block[i]);
  return ops;
}

}  // namespace tdshm::detail
