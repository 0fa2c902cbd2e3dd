// The by-reference part of one rank's channel (by_reference.h): loans sent as tickets and landed
// as views or copies, memory-mapped files sent as references, recv_view's tensors.

#include "shm/p2p/by_reference.h"

#include "common/copy.h"
#include "memmap/peer_file.h"

#include <tdshm/memmap.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tdshm::detail {

ByReference::ByReference(ChannelCore& core)
    : core_(core), loans_(std::make_shared<shm::LoanPool>(core.segment(), static_cast<uint32_t>(core.rank()))) {
  loan_regions_.resize(static_cast<size_t>(core.size()));
  for (uint32_t p = 0; p < static_cast<uint32_t>(core.size()); ++p) {
    loan_regions_[p] = shm::LoanRegionView::of(core.segment(), p);
  }
}

// ---------------------------------------------------------------------------------------------
// The sender's side

void ByReference::bind_loan(SendOp& op) const {
  if (op.staging.defined() || !loans_->in_heap(op.data)) return;
  if (auto place = loans_->find(op.data, op.bytes)) {
    op.loan = static_cast<int64_t>(place->allocation);
    op.loan_offset = place->offset;
  }
}

std::optional<shm::LoanReference> ByReference::lend(int dst, const std::shared_ptr<SendOp>& op) {
  const auto ticket = loans_->take_ticket(static_cast<uint32_t>(dst), static_cast<uint64_t>(op->loan));
  if (!ticket) return std::nullopt;
  lent_.push_back({op, *ticket});
  return shm::LoanReference{op->loan_offset, *ticket, 0};
}

std::string ByReference::memmap_reference(const at::Tensor& t, uint64_t slot_bytes) {
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

// ---------------------------------------------------------------------------------------------
// The receiver's side

std::string ByReference::decode(const MessageHead& head, const uint8_t* payload, uint64_t bytes, Reference& out) const {
  if (!head.loan) return shm::check_reference(payload, bytes, head.total, out.file);
  // (check_entry found a loan's payload to be exactly one LoanReference)
  std::memcpy(&out.loan, payload, sizeof out.loan);
  out.lent = shm::lent_bytes(loan_regions_[static_cast<size_t>(head.src)], out.loan, head.total,
                             static_cast<uint32_t>(core_.rank()));
  if (out.lent != nullptr) return {};
  return "loan of " + std::to_string(head.total) + " bytes at offset " + std::to_string(out.loan.offset) +
         " under ticket " + std::to_string(out.loan.ticket) + " is not lent to this rank";
}

void ByReference::land(const MessageHead& head, const Reference& ref, RecvOp& op) {
  if (head.loan) {
    land_loan(head, ref, op);
  } else {
    core_.finish(op, resolve_file(op, ref.file));
  }
}

void ByReference::drop(const MessageHead& head, const Reference& ref) {
  if (head.loan && ref.lent != nullptr) give_back(head.src, ref.loan.ticket);
}

void ByReference::give_back(int src, uint32_t ticket) {
  shm::give_back(loan_regions_[static_cast<size_t>(src)], ticket,
                 core_.segment().rank_slot(static_cast<uint32_t>(src)));
}

// A view of the lent bytes (recv_view), or a copy after which the ticket goes back at once.
void ByReference::land_loan(const MessageHead& msg, const Reference& ref, RecvOp& op) {
  const int src = msg.src;
  const auto s = static_cast<size_t>(src);
  const uint32_t ticket = ref.loan.ticket;
  if (op.view) {
    try {
      ViewShape shape;
      view_shape(msg, shape);  // (checked by bind_view when the receive matched)
      // A view's elements must be aligned for its dtype: a forged offset would give a tensor
      // whose every access is misaligned.
      if (const size_t element = c10::elementSize(shape.dtype); reinterpret_cast<uintptr_t>(ref.lent) % element != 0) {
        throw TransportError("the sender's loan of " + std::to_string(msg.total) + " bytes at heap offset " +
                             std::to_string(ref.lent - loan_regions_[s].heap) + " is not aligned for " +
                             c10::toString(shape.dtype) + " (" + std::to_string(element) + " bytes)");
      }
      op.user =
          shm::view_of_loan(core_.segment().mapping(), loan_regions_[s], ticket,
                            core_.segment().rank_slot(static_cast<uint32_t>(src)), ref.lent, shape.sizes, shape.dtype);
    } catch (const std::exception& e) {
      give_back(src, ticket);
      core_.finish(op, make_error<TransportError>(op.what() + ": " + e.what()));
      return;
    }
    op.data = static_cast<uint8_t*>(op.user.data_ptr());
    core_.complete(op);
    return;
  }
  if (msg.total != 0) copy_bytes(op.data, ref.lent, msg.total, msg.total >= kStreamingMessageBytes);
  // The bytes were read only while the ticket named this rank: a sender that took it back (or
  // rewrote it) meanwhile may have rewritten them, and the copy may be torn (as for a slot).
  if (!shm::still_lent(loan_regions_[s], ticket, static_cast<uint32_t>(core_.rank()))) {
    core_.finish(op, make_error<TransportError>(op.what() + ": corrupted transfer from " +
                                                core_.segment().describe_rank(static_cast<uint32_t>(src)) +
                                                ": its loan (ticket " + std::to_string(ticket) +
                                                ") was taken back while this rank copied it"));
    return;  // not this rank's ticket any more: nothing to give back
  }
  give_back(src, ticket);
  core_.complete(op);
}

// The shape and dtype of the tensor `msg` holds, or why it makes none ("" when it does).
std::string ByReference::view_shape(const MessageHead& msg, ViewShape& out) {
  if (msg.dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions)) return "has no valid dtype";
  out.dtype = static_cast<c10::ScalarType>(msg.dtype);
  if (c10::isQIntType(out.dtype) || out.dtype == c10::ScalarType::Undefined) {
    return std::string("has dtype ") + c10::toString(out.dtype) + ", which a view cannot take";
  }
  const uint64_t element = c10::elementSize(out.dtype);
  if (msg.ndim == shm::kShapeNotSent) return "has more than 8 dimensions, whose shape is not sent";
  if (msg.total % element != 0) return "has a size that is not a whole number of elements";
  out.sizes.clear();
  if (msg.ndim == 1) {
    out.sizes.push_back(static_cast<int64_t>(msg.total / element));
  } else if (msg.ndim >= 2) {
    uint64_t numel = 1;
    for (uint8_t d = 0; d < msg.ndim; ++d) {
      if (msg.dims[d] < 0 || (msg.dims[d] != 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(msg.dims[d]))) {
        return "has an invalid shape";
      }
      numel *= static_cast<uint64_t>(msg.dims[d]);
      out.sizes.push_back(msg.dims[d]);
    }
    if (numel * element != msg.total) return "has a shape that does not match its size";
  } else if (msg.total != element) {
    return "has no dimensions but " + std::to_string(msg.total) + " bytes";
  }
  return {};
}

// A recv_view takes any tensor: the message's own checks still apply (another key, another
// schema), then its dtype and shape must make a tensor of its size. A message that is not a loan
// lands in a fresh tensor of that shape.
bool ByReference::bind_view(const MessageHead& msg, RecvOp& op) {
  if (const Mismatch why = check_mismatch(msg, op.check); why != Mismatch::kNone) {
    MessageHead m = msg;
    fail_match(core_, m, op, why);
    return false;
  }
  ViewShape shape;
  if (const std::string why = view_shape(msg, shape); !why.empty()) {
    core_.finish(
        op, make_error<TransportError>(op.what() + ": the message from rank " + std::to_string(msg.src) + " " + why));
    return false;
  }
  op.bytes = msg.total;
  if (!msg.loan) {  // (a loan's view is made where its bytes are: land_loan)
    try {
      // ATen's allocation without the dispatcher (at::empty's): 1.5k instructions against 2.3k
      // for each message received by value.
      op.user = at::Tensor(at::detail::empty_cpu(shape.sizes, shape.dtype));
    } catch (const std::exception& e) {
      core_.finish(op, make_error<TransportError>(op.what() + ": a tensor for the message from rank " +
                                                  std::to_string(msg.src) + " cannot be allocated: " + e.what()));
      return false;
    }
    op.data = static_cast<uint8_t*>(op.user.data_ptr());
  }
  return true;
}

// Lands a file reference (checked by decode) in `op`: nothing to do when op's tensor maps the same
// bytes, else one copy from the file. Returns the error to fail op with. The file is the sender's
// choice: it is opened by the rules of memmap/peer_file.h (no link followed, a regular file of
// this user, read-only), and never read past its end; the bytes go into the receiver's own tensor.
std::exception_ptr ByReference::resolve_file(const RecvOp& op, const shm::ReferenceFields& ref) const {
  if (op.bytes == 0) return nullptr;
  if (auto mine = MemoryMappedTensor::info(op.user);
      mine && mine->writable && op.user.is_contiguous() && static_cast<uint64_t>(mine->offset) == ref.offset &&
      (mine->filename == ref.path || peer_path(mine->filename) == ref.path)) {  // (a private mapping may differ)
    return nullptr;  // the receiver's tensor is the sender's bytes
  }
  auto fail = [&](const std::string& why) {
    return make_error<TransportError>(op.what() + ": the sender's memory-mapped file '" + ref.path + "': " + why);
  };
  std::string problem;
  const int fd = open_peer_file(ref.path, /*writable=*/false, problem);
  if (fd < 0) return fail(problem);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return fail(std::string("cannot stat it: ") + std::strerror(errno));
  }
  if (ref.offset + op.bytes > static_cast<uint64_t>(st.st_size)) {
    ::close(fd);
    return fail("the file has " + std::to_string(st.st_size) + " bytes, the message needs " +
                std::to_string(ref.offset + op.bytes));
  }
  uint64_t done = 0;
  while (done < op.bytes) {
    const ssize_t n = ::pread(fd, op.data + done, op.bytes - done, static_cast<off_t>(ref.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "the file is shorter than the message";
      ::close(fd);
      return fail("reading it: " + why);
    }
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Progress and failure

// Sends of loans complete when their receiver gives the ticket back (after its copy, or when its
// last view is dropped), or when the owner takes it back from a rank that is gone.
bool ByReference::progress() {
  bool moved = false;
  std::erase_if(lent_, [&](const Lent& l) {
    if (!loans_->ticket_free(l.ticket)) return false;
    loans_->ticket_returned(l.ticket);
    core_.finish(*l.op, nullptr);  // (a no-op for one that failed already: its peer was lost)
    moved = true;
    return true;
  });
  return moved;
}

void ByReference::fail_peer(int peer, const std::exception_ptr& error) {
  // Its loans' tickets stay counted until they are free (reclaim takes them back).
  for (auto& l : lent_) {
    if (l.op->peer == peer) core_.finish(*l.op, error);
  }
}

void ByReference::fail_all(const std::exception_ptr& error) {
  for (auto& l : lent_) core_.finish(*l.op, error);
}

uint32_t ByReference::reclaim(int peer) {
  const uint32_t n = loans_->reclaim(static_cast<uint32_t>(peer));
  progress();  // their allocations are free again once their tensors are gone
  return n;
}

std::string ByReference::holders() const { return lent_.empty() ? std::string() : "; " + loans_->holders(); }

}  // namespace tdshm::detail
