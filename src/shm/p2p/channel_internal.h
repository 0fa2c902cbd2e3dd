#pragma once
// What the two files of ShmChannel share (channel.cpp: posting, sending, completing, failing;
// channel_receive.cpp: landing and matching incoming messages). Private to them.

#include "common/recycle.h"
#include "memmap/peer_file.h"
#include "shm/p2p/channel.h"

#include <tdshm/memmap.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace tdshm::detail {

/// What a message's first entry says of it (what a receive is matched and checked against).
struct MessageHead {
  int src = -1;
  int64_t tag = 0;
  bool control = false;
  MessageCheck check;  // what the sender's transfer layer said of it (kNone: nothing)
  uint64_t total = 0;
  uint8_t dtype = 0;
  uint8_t ndim = shm::kShapeNotSent;
  int64_t dims[shm::kMaxDims];  // the first `ndim` when ndim >= 2 (not cleared: a message per copy)
  bool reference = false;       // a MemmapReference (a whole message in one entry)
  bool loan = false;            // a LoanReference (a whole message in one entry)
};

/// A message from one source whose entries are arriving, or that arrived before its recv.
struct Incoming : MessageHead {
  uint64_t received = 0;
  std::shared_ptr<ShmOp> op;     // the receive it lands in; null while unexpected
  shm::BufferPool::Buffer heap;  // its bytes while unexpected (from unexpected_pool_; all are written)
  uint64_t heap_bytes = 0;       // counted in ShmChannel::unexpected_bytes_ while heap is held
  bool complete = false;
  bool discard = false;  // it failed the receive it matched: drained and dropped, never copied
  // (MessageHead::reference, ::loan: `heap` holds the reference while it is unexpected)
};

/// Why a message cannot land in a receive (kNone: it fits). What try_match reports, and what a
/// receive that lands at once (receive_now) requires.
enum class Mismatch { kNone, kLeaves, kCheck, kBytes, kDtype, kShape };

/// Whether `msg` fits a receive that expects `expect` into `t`, contiguous and `bytes` long. The
/// checks first: they say why the rest differs (another key, another schema).
inline Mismatch mismatch(const MessageHead& msg, const MessageCheck& expect, const at::Tensor& t, uint64_t bytes) {
  if (expect.kind != MessageCheck::Kind::kNone && msg.check.kind == expect.kind) {
    if (msg.check.leaves != 0 && expect.leaves != 0 && msg.check.leaves != expect.leaves) return Mismatch::kLeaves;
    if (msg.check.value != expect.value) return Mismatch::kCheck;
  }
  if (msg.total != bytes) return Mismatch::kBytes;
  if (msg.dtype != static_cast<uint8_t>(t.scalar_type())) return Mismatch::kDtype;
  if (msg.ndim != shm::kShapeNotSent) {
    // Equal bytes and dtype: equal numel, so 0 or 1 dimensions compare by count alone.
    const auto sizes = t.sizes();
    if (msg.ndim < 2 ? sizes.size() != msg.ndim
                     : !std::equal(sizes.begin(), sizes.end(), msg.dims, msg.dims + msg.ndim)) {
      return Mismatch::kShape;
    }
  }
  return Mismatch::kNone;
}

inline bool ShmChannel::try_match(MessageHead& msg, const std::shared_ptr<ShmOp>& op) {
  op->source = msg.src;
  if (op->view) return bind_view(msg, op);
  const Mismatch why = mismatch(msg, op->check, op->contiguous(), op->bytes);
  if (why == Mismatch::kNone) return true;
  fail_match(msg, op, why);
  return false;
}

// What finish(op, nullptr) does, inline where nothing more is needed: a receive that landed in
// its own contiguous tensor, not failed before, the mapping intact. Anything else goes through
// finish (the staging copy, the lost mapping's error).
inline void ShmChannel::complete(const std::shared_ptr<ShmOp>& op) {
  if (op->staging.defined() || op->error || op->done.load(std::memory_order_relaxed) || segment_.poisoned()) {
    finish(op, nullptr);
    return;
  }
  op->done.store(true, std::memory_order_release);  // pairs with acquire loads of done in waiters
}

// Messages at least this large are copied out of the ring with non-temporal stores.
inline constexpr uint64_t kStreamingMessageBytes = uint64_t{8} << 20;

// A message larger than this is refused as corrupt (1 TiB): it cannot be a real tensor here.
inline constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 40;

template <class E>
std::exception_ptr make_error(const std::string& what) {
  return std::make_exception_ptr(E(what));
}

// The MemmapReference payload for sending `t` by reference, or "" to send its bytes: only a
// contiguous view of a named (not anonymous) mapping whose path fits in a slot goes so.
inline std::string memmap_reference(const at::Tensor& t, uint64_t slot_bytes) {
  if (!MemoryMappedTensor::is_mapped(t)) return {};  // the common case, in a few instructions
  auto info = MemoryMappedTensor::info(t);
  if (!info || info->filename.empty() || !t.is_contiguous()) return {};
  const std::string path = peer_path(info->filename);  // the receiver follows no link
  if (sizeof(shm::MemmapReference) + path.size() > slot_bytes) return {};
  shm::MemmapReference r{};
  r.offset = static_cast<uint64_t>(info->offset);
  r.path_bytes = static_cast<uint32_t>(path.size());
  std::string out(sizeof r, '\0');
  std::memcpy(out.data(), &r, sizeof r);
  return out + path;
}

// The entry flag that says what kind of check `check` carries (0: none).
inline uint32_t check_flag(const MessageCheck& check) noexcept {
  switch (check.kind) {
    case MessageCheck::Kind::kKey: return shm::kEntryKeyCheck;
    case MessageCheck::Kind::kSchema: return shm::kEntrySchemaCheck;
    case MessageCheck::Kind::kNone: break;
  }
  return 0;
}

// The check an entry carries, written into `out` field by field: a MessageCheck temporary was
// stored in parts and read back whole (a stalled store-to-load forward on every entry).
inline void read_entry_check(const shm::EntryFields& e, MessageCheck& out) noexcept {
  const bool key = (e.flags & shm::kEntryKeyCheck) != 0;
  const bool schema = !key && (e.flags & shm::kEntrySchemaCheck) != 0;
  out.kind = key ? MessageCheck::Kind::kKey : schema ? MessageCheck::Kind::kSchema : MessageCheck::Kind::kNone;
  out.value = key || schema ? e.check : 0;
  out.leaves = key ? e.leaves : 0;
}

inline std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
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
