#pragma once
// The by-reference part of one rank's channel: what crosses as a reference to bytes rather than
// the bytes, on both sides.
//  * A loan (a tensor in this rank's loan heap, loan_pool.h) is sent as a ticket of its
//    allocation (kEntryLoan); the send completes when the receiver gives the ticket back. The
//    receiver lands it as a view of the sender's bytes (recv_view: the ticket goes back when the
//    view is dropped) or copies it and gives the ticket back at once.
//  * A contiguous tensor that views a named MemoryMappedTensor is sent as a MemmapReference (file,
//    offset; kEntryReference): the receiver reads the file into its tensor, or nothing at all when
//    its tensor maps the same bytes.
//  * A recv_view takes whatever comes: its tensor is made from the message's dtype and shape.
// The sender reaches it through one hook (lend: a loan's ticket for its entry), the receiver
// through one (decode a reference entry, then land or drop it; bind a view).

#include "shm/p2p/channel_core.h"
#include "shm/p2p/loan_pool.h"
#include "shm/p2p/message.h"

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::detail {

/// A reference entry's payload, read once from the entry (or from the early message that kept
/// it) and checked: what ByReference::land uses.
struct Reference {
  shm::LoanReference loan{};      // a loan's ticket and offset
  const uint8_t* lent = nullptr;  //   and its bytes in the sender's heap
  shm::ReferenceFields file;      // a memmap's file and offset
};

class ByReference {
 public:
  explicit ByReference(ChannelCore& core);
  ByReference(const ByReference&) = delete;
  ByReference& operator=(const ByReference&) = delete;

  // --- the sender's side

  /// Whether `t`'s bytes may be a loan of this rank (then it goes by reference, never by value).
  bool is_lent(const at::Tensor& t) const { return loans_->ever_lent() && loans_->in_heap(t.data_ptr()); }
  /// Where a send's tensor lies in this rank's loan heap (wholly inside one loan): sets op.loan and
  /// op.loan_offset, else leaves op.loan at -1 (it goes by value).
  void bind_loan(SendOp& op) const;
  /// A ticket of `op`'s loan for `dst`, as the reference its entry carries; `op` completes when the
  /// ticket comes back. Nullopt when every ticket is out (a receiver gives one back).
  std::optional<shm::LoanReference> lend(int dst, const std::shared_ptr<SendOp>& op);
  /// The MemmapReference payload for sending `t` by reference, or "" to send its bytes: only a
  /// contiguous view of a named (not anonymous) mapping whose path fits in a slot goes so.
  static std::string memmap_reference(const at::Tensor& t, uint64_t slot_bytes);

  // --- the receiver's side

  /// Reads and checks the reference in `payload` (`bytes` long) of the message `head`: "" when it
  /// is good (then `out` holds it), else what is wrong.
  std::string decode(const MessageHead& head, const uint8_t* payload, uint64_t bytes, Reference& out) const;
  /// Lands the reference message `head` (decoded into `ref`) in its matched receive `op`, and
  /// completes or fails op.
  void land(const MessageHead& head, const Reference& ref, RecvOp& op);
  /// The message `head` (decoded into `ref`) is dropped (its receive failed on a mismatch): a
  /// loan's ticket goes back.
  void drop(const MessageHead& head, const Reference& ref);
  /// A recv_view's tensor for `msg` (its shape and dtype, checked) after the message's own checks;
  /// false with op failed when they differ or make no tensor. A loan's view is made when it lands.
  [[gnu::noinline]] bool bind_view(const MessageHead& msg, RecvOp& op);

  // --- both: progress and failure

  /// Sends of loans whose ticket came back complete; true if any did.
  bool progress();
  /// Whether a send of a loan waits for its ticket.
  bool busy() const noexcept { return !lent_.empty(); }
  /// `peer` is lost: its loans' sends fail (their tickets stay counted until reclaim).
  void fail_peer(int peer, const std::exception_ptr& error);
  /// Every send of a loan fails with `error`.
  void fail_all(const std::exception_ptr& error);
  /// Takes back the tickets `peer` holds (its process is dead); returns how many.
  uint32_t reclaim(int peer);
  /// Who holds this rank's loans, for a TimeoutError ("" when no send waits for a ticket).
  std::string holders() const;
  /// This rank's loan heap: shared with the loans it hands out.
  const std::shared_ptr<shm::LoanPool>& loans() const noexcept { return loans_; }

 private:
  struct ViewShape {
    c10::SmallVector<int64_t, 8> sizes;
    c10::ScalarType dtype = c10::ScalarType::Byte;
  };
  static std::string view_shape(const MessageHead& msg, ViewShape& out);
  void give_back(int src, uint32_t ticket);
  void land_loan(const MessageHead& msg, const Reference& ref, RecvOp& op);
  std::exception_ptr resolve_file(const RecvOp& op, const shm::ReferenceFields& ref) const;

  struct Lent {
    std::shared_ptr<SendOp> op;  // completes when the ticket comes back
    uint32_t ticket;
  };
  ChannelCore& core_;
  std::shared_ptr<shm::LoanPool> loans_;           // this rank's loan heap
  std::vector<shm::LoanRegionView> loan_regions_;  // per rank: its loan region
  std::vector<Lent> lent_;                         // sends of loans whose receiver may still read the bytes
};

}  // namespace tdshm::detail
