// Consolidated transfers (docs/semantics.md, "Consolidated mode"): the storage as one uint8 message.
//
// Wire, by default exactly tensordict's: the consolidated storage, one message, tag 0. Over shm
// the message carries the sender's schema hash inside the transport's entry (MessageCheck), and
// the receiver's transport compares it with its own before writing a byte: another schema is a
// SchemaError, the message is dropped. Over gloo the wire carries only the bytes (a storage of
// another size is gloo's business, as under tensordict), so two tdshm ranks that both advertised
// it (Group::checked_wire_with) use the checked protocol: a 3-int64 header {magic, schema
// fingerprint, storage bytes} first, same tag. The receiver checks the header (and that its
// storage can take bytes in place) before it posts the storage's receive; on a mismatch it
// drains the storage into a scratch buffer and throws.

#include "distributed/protocols.h"
#include "distributed/staged_receives.h"
#include "distributed/transfer_work.h"

namespace tdshm::detail {

namespace {

constexpr int64_t kConsolidatedMagic = 0x7464736d636f6e31;  // "tdsmcon1"

std::exception_ptr schema_mismatch(uint64_t theirs, int64_t their_bytes, uint64_t mine, int64_t my_bytes) {
  return std::make_exception_ptr(SchemaError(
      "the sender's schema (fingerprint " + std::to_string(theirs) + ", " + std::to_string(their_bytes) +
      " bytes) differs from this tensordict's (fingerprint " + std::to_string(mine) + ", " + std::to_string(my_bytes) +
      " bytes): tensorclass names, keys, dtypes, shapes or layout differ; nothing was written"));
}

/// The checked protocol's receive: header, then the storage or its drain.
std::shared_ptr<Deferred> checked_recv(const Group& g, int peer, const at::Tensor& storage, uint64_t mine,
                                       std::exception_ptr refusal) {
  auto header = int64_tensor({0, 0, 0});
  auto after_header = [g, peer, header, storage, mine, refusal]() -> Stage {
    const int64_t magic = header.data_ptr<int64_t>()[0], bytes = header.data_ptr<int64_t>()[2];
    const auto fingerprint = static_cast<uint64_t>(header.data_ptr<int64_t>()[1]);
    if (magic != kConsolidatedMagic || bytes < 0 || static_cast<uint64_t>(bytes) > kMaxStorageBytes) {
      throw TransportError("the sender's message is not a consolidated tdshm transfer (is it sending per-leaf?)");
    }
    if (refusal || fingerprint != mine || bytes != storage.numel()) {
      // Drained: the stream stays in step.
      return Stage{{recv_one(g, bytes_tensor(bytes), peer, kConsolidatedTag)}, nullptr,
                   refusal ? refusal : schema_mismatch(fingerprint, bytes, mine, storage.numel())};
    }
    return Stage{{recv_one(g, storage, peer, kConsolidatedTag)}, nullptr, nullptr};
  };
  return std::make_shared<Deferred>(
      "consolidated header", Stage{{recv_one(g, header, peer, kConsolidatedTag)}, std::move(after_header), nullptr});
}

}  // namespace

Transfer isend_consolidated(const TensorDict& td, const Peer& p, const SendOptions& o, Completion done) {
  Transfer out;
  const TensorDict c = td.consolidate();
  const at::Tensor storage = c.consolidated_storage();
  std::vector<WorkPtr> inner;
  if (p.group.checked_wire_with(p.rank)) {
    inner.push_back(send_one(
        p.group, int64_tensor({kConsolidatedMagic, static_cast<int64_t>(c.schema_fingerprint()), storage.numel()}),
        p.rank, kConsolidatedTag));
  }
  inner.push_back(send_one(p.group, storage, p.rank, kConsolidatedTag, schema_check(c.schema_fingerprint())));
  if (o.return_early && done == Completion::kAsOptions) {
    out.has_works = true;
    out.works.push_back(c10::make_intrusive<TransferWork>("consolidated send: ", std::move(inner), c10d::OpType::SEND));
    return out;
  }
  try {
    wait_all(inner);
  } catch (...) {
    rethrow_with_context("consolidated send: ");
  }
  return out;
}

Transfer irecv_consolidated(const TensorDict& td, const Peer& p, const RecvOptions& o, Completion c) {
  if (!td.is_consolidated()) {
    throw Error("irecv(consolidated=True) needs a consolidated receiver: call consolidate() first (it must have the "
                "sender's schema)");
  }
  const at::Tensor storage = td.consolidated_storage();
  std::exception_ptr refusal;  // a storage that cannot take bytes in place: refused, the sender's drained
  try {
    check_receive_target(storage, [] { return std::string("the consolidated storage"); });
  } catch (...) {
    refusal = std::current_exception();
  }
  const uint64_t mine = td.schema_fingerprint();
  WorkPtr work;
  if (p.group.checked_wire_with(p.rank)) {
    work = c10::make_intrusive<TransferWork>("consolidated recv: ", checked_recv(p.group, p.rank, storage, mine, refusal),
                                             0, c10d::OpType::RECV);
  } else if (refusal) {
    auto drain = std::make_shared<Deferred>(
        "storage", Stage{{recv_one(p.group, bytes_tensor(storage.numel()), p.rank, kConsolidatedTag)}, nullptr, refusal});
    work = c10::make_intrusive<TransferWork>("consolidated recv: ", std::move(drain), 0, c10d::OpType::RECV);
  } else {
    work = c10::make_intrusive<TransferWork>(
        "consolidated recv: ",
        std::vector<WorkPtr>{recv_one(p.group, storage, p.rank, kConsolidatedTag, schema_check(mine))},
        c10d::OpType::RECV);
  }
  Transfer out;
  if (o.return_premature && c == Completion::kAsOptions) {
    out.has_works = true;
    out.works.push_back(std::move(work));
  } else {
    wait_all({work});
  }
  return out;
}

}  // namespace tdshm::detail
