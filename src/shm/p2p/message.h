#pragma once
// What the receiving parts of the channel (receiver.h, by_reference.h) know of an incoming
// message, whether it fits a receive, and the entry fields the sender and the receiver both
// encode. Private to src/shm/p2p.

#include "shm/layout/segment_layout.h"
#include "shm/layout/validate.h"
#include "shm/p2p/op.h"
#include "shm/parts/buffer_pool.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

namespace tdshm::detail {

class ChannelCore;

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
  std::shared_ptr<RecvOp> op;    // the receive it lands in; null while unexpected
  shm::BufferPool::Buffer heap;  // its bytes while unexpected (from the receiver's pool; all are written)
  uint64_t heap_bytes = 0;       // counted in the receiver's unexpected bytes while heap is held
  bool complete = false;
  bool discard = false;  // it failed the receive it matched: drained and dropped, never copied
  // (MessageHead::reference, ::loan: `heap` holds the reference while it is unexpected)
};

/// Why a message cannot land in a receive (kNone: it fits). What a match reports, and what a
/// receive that lands at once (receive_now) requires.
enum class Mismatch { kNone, kLeaves, kCheck, kBytes, kDtype, kShape };

/// Whether `msg` fits `op`'s checks alone (a recv_view takes any shape): kNone, kLeaves or kCheck.
inline Mismatch check_mismatch(const MessageHead& msg, const MessageCheck& expect) {
  if (expect.kind != MessageCheck::Kind::kNone && msg.check.kind == expect.kind) {
    if (msg.check.leaves != 0 && expect.leaves != 0 && msg.check.leaves != expect.leaves) return Mismatch::kLeaves;
    if (msg.check.value != expect.value) return Mismatch::kCheck;
  }
  return Mismatch::kNone;
}

/// Whether `msg` fits a receive that expects `expect` into `t`, contiguous and `bytes` long. The
/// checks first: they say why the rest differs (another key, another schema).
inline Mismatch mismatch(const MessageHead& msg, const MessageCheck& expect, const at::Tensor& t, uint64_t bytes) {
  if (const Mismatch why = check_mismatch(msg, expect); why != Mismatch::kNone) return why;
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

/// Fails `op` with the error that says why `msg` does not fit it (`why` is not kNone).
void fail_match(ChannelCore& core, MessageHead& msg, RecvOp& op, Mismatch why);

// Messages at least this large are copied out of the ring with non-temporal stores.
inline constexpr uint64_t kStreamingMessageBytes = uint64_t{8} << 20;

// A message larger than this is refused as corrupt (1 TiB): it cannot be a real tensor here.
inline constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 40;

template <class E>
std::exception_ptr make_error(const std::string& what) {
  return std::make_exception_ptr(E(what));
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

}  // namespace tdshm::detail
