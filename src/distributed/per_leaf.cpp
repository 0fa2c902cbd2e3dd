// Per-leaf transfers (docs/semantics.md, "Per-leaf mode"): one message per tensor leaf.
//
// Wire, by default exactly tensordict's: one message per leaf in sorted_leaf_keys() order with the
// tags of transfer_tags(), and nothing else. Over shm each message also carries its leaf's key hash
// inside the transport's entry (MessageCheck), and the transport checks byte size, dtype and shape
// against the receiving leaf: a mismatch fails that leaf's receive with an error naming its key,
// the message is dropped and the transfer stays in step. Over gloo the wire carries nothing but
// the bytes: a message of another size is gloo's business (it aborts on a larger one, as it does
// under tensordict), so between two tdshm ranks the checked protocol is used instead.
//
// Checked protocol (gloo, Group::checked_wire_with: both ranks are tdshm and advertised it): a
// layout descriptor first (key hash, dtype and shape per leaf; see layout_descriptor.h) under the
// first leaf's tag, in a fixed 32-int64 header {magic, words, up to 30 words inline}, plus a
// second message when it does not fit. The receiver posts its leaf receives only once it has
// checked that the descriptor matches its keys, dtypes and shapes (else TransportError naming the
// first key that differs); irecv does not block for the descriptor: its works advance through
// the stages (header, long descriptor, leaves) when they are waited or polled (Deferred).
//
// Either way every receiving leaf is checked before any receive is posted (check_receive_target:
// TypeError or MemmapError naming the key); a refused transfer still takes all of the sender's
// leaves, into scratch tensors, before its error is raised, so the next transfer is in step.

#include "distributed/layout_descriptor.h"
#include "distributed/protocols.h"
#include "distributed/staged_receives.h"
#include "distributed/transfer_work.h"

#include <c10/util/SmallVector.h>

#include <mutex>
#include <span>

namespace tdshm::detail {

// ---------------------------------------------------------------------------------------------
// Per-leaf transfers

namespace {

std::shared_ptr<const PerLeafWire> make_wire(const SortedLeaves& sorted, int64_t init_tag, bool pseudo_rand) {
  auto fresh = std::make_shared<PerLeafWire>();
  fresh->init_tag = init_tag;
  fresh->pseudo_rand = pseudo_rand;
  fresh->tags = transfer_tags(init_tag, sorted.keys.size(), pseudo_rand);
  fresh->c10d_tags.reserve(fresh->tags.size());
  fresh->checks.reserve(fresh->tags.size());
  for (size_t i = 0; i < fresh->tags.size(); ++i) {
    fresh->c10d_tags.push_back(c10d_tag(fresh->tags[i]));
    fresh->checks.push_back(key_check_of_hash(sorted.key_hashes[i], sorted.keys.size()));
  }
  return fresh;
}

}  // namespace

const PerLeafWire& wire_of(const SortedLeaves& sorted, int64_t init_tag, bool pseudo_rand,
                           std::shared_ptr<const PerLeafWire>& keep) {
  if (init_tag == 0 && !pseudo_rand) {
    if (const PerLeafWire* w = sorted.default_wire.load(std::memory_order_acquire)) return *w;
    std::lock_guard<std::mutex> lock(sorted.default_wire_mutex);
    if (!sorted.default_wire_owner) {
      sorted.default_wire_owner = make_wire(sorted, 0, false);
      sorted.default_wire.store(sorted.default_wire_owner.get(), std::memory_order_release);
    }
    return *sorted.default_wire_owner;
  }
  if (auto cached = sorted.wire.load(std::memory_order_acquire);
      cached && cached->init_tag == init_tag && cached->pseudo_rand == pseudo_rand) {
    keep = std::move(cached);
    return *keep;
  }
  keep = make_wire(sorted, init_tag, pseudo_rand);
  sorted.wire.store(keep, std::memory_order_release);
  return *keep;
}

namespace {

struct Leaves {
  std::shared_ptr<const SortedLeaves> sorted;  // keys and key hashes, cached by the tensordict
  const PerLeafWire* wire = nullptr;           // tags and checks, cached with them (wire_of)
  std::shared_ptr<const PerLeafWire> wire_keep;
  c10::SmallVector<at::Tensor, 8> tensors;  // (inline: a tree's leaves are few, no allocation per transfer)
  const std::vector<Key>& keys() const noexcept { return sorted->keys; }
  const std::vector<int64_t>& tags() const noexcept { return wire->tags; }
  /// The last tag of the transfer (init_tag - 1 without leaves), what send and recv return.
  int64_t last_tag() const noexcept { return wire->tags.empty() ? wire->init_tag - 1 : wire->tags.back(); }
};

/// The leaves of `td` and their tags; the leaves themselves are checked by the caller (a sender
/// with check_leaf, a receiver with check_receive_target).
Leaves collect(const TensorDict& td, int64_t init_tag, bool pseudo_rand) {
  Leaves l;
  l.sorted = sorted_leaves(td);
  l.wire = &wire_of(*l.sorted, init_tag, pseudo_rand, l.wire_keep);
  for (size_t i = 0; i < l.keys().size(); ++i) l.tensors.push_back(leaf_tensor(td, *l.sorted, i));
  return l;
}

/// The leaves of a lazy stack: each member's in its sorted order, member after member, the tags
/// running on (docs/wire.md). Leaf j of member m is named (m, key...) in errors and key
/// checks. Kept in the stack's cache while every member's own sorted leaves are current.
Leaves collect(const LazyStackedTensorDict& stack, int64_t init_tag, bool pseudo_rand) {
  Leaves l;
  std::vector<std::shared_ptr<const SortedLeaves>> members;
  members.reserve(stack.size());
  for (const TensorDict& td : stack.tensordicts()) members.push_back(sorted_leaves(td));
  LazyLeavesCache& cache = lazy_leaves_cache(stack);
  std::shared_ptr<const LazyLeavesCache::Entry> entry = cache.value.load(std::memory_order_acquire);
  if (!entry || entry->members != members) {
    auto sorted = std::make_shared<SortedLeaves>();
    for (size_t m = 0; m < members.size(); ++m) {
      for (const Key& key : members[m]->keys) {
        std::vector<std::string> parts{std::to_string(m)};
        parts.insert(parts.end(), key.parts().begin(), key.parts().end());
        sorted->keys.emplace_back(std::move(parts));
        sorted->key_hashes.push_back(key_path_hash(sorted->keys.back()));
      }
    }
    entry = std::make_shared<const LazyLeavesCache::Entry>(LazyLeavesCache::Entry{members, std::move(sorted)});
    cache.value.store(entry, std::memory_order_release);
  }
  for (size_t m = 0; m < members.size(); ++m) {
    for (size_t i = 0; i < members[m]->keys.size(); ++i) l.tensors.push_back(leaf_tensor(stack.tensordicts()[m], *members[m], i));
  }
  l.sorted = entry->leaves;
  l.wire = &wire_of(*l.sorted, init_tag, pseudo_rand, l.wire_keep);
  return l;
}

/// The tag the descriptor travels with: the first leaf's (or the one it would have).
int descriptor_tag(const Leaves& l, int64_t init_tag, bool pseudo_rand) {
  return c10d_tag(l.tags().empty() ? transfer_tags(init_tag, 1, pseudo_rand)[0] : l.tags()[0]);
}

/// The last stage of a refused per-leaf transfer: receives of every leaf the sender sends (its
/// tags follow from the same init_tag and pseudo_rand) into scratch tensors of its dtypes and
/// shapes (shm checks both), so that later transfers stay in step; then `error`.
Stage drain_leaves(const Group& g, int peer, const std::vector<detail::LeafLayout>& theirs, int64_t init_tag,
                   bool pseudo_rand, std::exception_ptr error) {
  Stage s;
  s.error = std::move(error);
  const std::vector<int64_t> their_tags = transfer_tags(init_tag, theirs.size(), pseudo_rand);
  for (size_t i = 0; i < theirs.size(); ++i) {
    s.pending.push_back(recv_one(g, at::empty(theirs[i].shape, at::TensorOptions().dtype(theirs[i].dtype)), peer,
                                 c10d_tag(their_tags[i])));
  }
  return s;
}

/// tensordict's wire does not say how many leaves a transfer has; a transport that carries checks
/// gives each message the sender's count (MessageCheck::leaves), and a receiver whose count
/// differs fails its leaves with "the sender's tree has N leaves" (message_sender_leaves tells N). This makes such a
/// transfer end in step, once, from the first leaf that fails so: with N > M it takes the sender's extra messages (receives of no
/// bytes: the transport fails them and drops the messages), with N < M it aborts the receives no
/// message will come for (they fail at once instead of at the deadline).
struct LeafCountRepair {
  Group group;
  int peer = -1;
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  c10::intrusive_ptr<BatchWork> batch;  // this receiver's (Transport::recv_batch), one message per leaf
  size_t mine = 0;
  std::once_flag once;

  /// Called once the receive of leaf `failed` failed.
  void run(size_t failed) {
    const size_t theirs = batch->message_sender_leaves(failed);
    if (theirs == 0) return;  // another failure
    std::call_once(once, [&] {
      if (theirs > mine) {
        const std::vector<int64_t> tags = transfer_tags(init_tag, theirs, pseudo_rand);
        std::vector<WorkPtr> drains;
        for (size_t i = mine; i < theirs; ++i) {
          drains.push_back(recv_one(group, bytes_tensor(0), peer, c10d_tag(tags[i])));
        }
        for (const WorkPtr& d : drains) {
          try {
            d->wait();
          } catch (...) {  // expected: a message of another size, dropped
          }
        }
      } else {
        for (size_t i = theirs; i < mine; ++i) {
          try {
            batch->abort_message(i);
          } catch (...) {  // completed meanwhile
          }
        }
      }
    });
  }
};

/// The Work of one leaf whose message is already posted: one backend work (a send without a
/// descriptor, a receive on a transport without batches), or message `index` of a batch (an
/// irecv on a transport that batches; batch_work.h). What TransferWork does for it, built for
/// every leaf of every irecv, so it holds only the work, the leaf's index and what the
/// transfer's leaves share. The error names the key and the leaf-count repair runs, once, only
/// when the message fails; a success costs no string, lock or callback.
class LeafWork final : public c10d::Work {
 public:
  /// Leaf `index` is `work` itself.
  LeafWork(WorkPtr work, std::shared_ptr<const SortedLeaves> leaves, size_t index, const char* verb, c10d::OpType type)
      : c10d::Work(-1, type), inner_(std::move(work)), leaves_(std::move(leaves)), index_(index), verb_(verb) {}
  /// Leaf `index` is message `index` of `batch`.
  LeafWork(c10::intrusive_ptr<BatchWork> batch, std::shared_ptr<const SortedLeaves> leaves, size_t index,
           const char* verb, c10d::OpType type, std::shared_ptr<LeafCountRepair> repair)
      : c10d::Work(-1, type),
        batch_(std::move(batch)),
        leaves_(std::move(leaves)),
        index_(index),
        verb_(verb),
        repair_(std::move(repair)) {}

  /// Only polls (neither a backend work's isCompleted nor BatchWork::message_completed waits).
  bool isCompleted() override {
    if (!(batch_ ? batch_->message_completed(index_) : inner_->isCompleted())) return false;
    if (const std::exception_ptr e = inner_error()) keyed(e);
    return true;
  }
  bool isSuccess() const override { return batch_ ? batch_->message_succeeded(index_) : inner_->isSuccess(); }
  std::exception_ptr exception() const override {
    const std::exception_ptr e = inner_error();
    return e ? keyed(e) : nullptr;
  }
  std::vector<at::Tensor> result() override { return {}; }
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override {
    try {
      if (batch_) {
        batch_->wait_message(index_, timeout);
      } else {
        inner_->wait(timeout);
      }
    } catch (...) {
      std::rethrow_exception(keyed(std::current_exception()));
    }
    return true;
  }
  void abort() override {
    if (batch_) {
      batch_->abort_message(index_);
    } else {
      inner_->abort();
    }
  }
  /// The backend's future (the same one at every call); for a batch, that of message i's own Work.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::call_once(future_once_, [&] {
      future_ = batch_ ? batch_->messages().at(index_)->getFuture() : inner_->getFuture();
    });
    return future_;
  }

 private:
  std::exception_ptr inner_error() const { return batch_ ? batch_->message_error(index_) : inner_->exception(); }
  /// The backend's error `e` with the key in front (the same object at every call), after the
  /// repair ran.
  std::exception_ptr keyed(const std::exception_ptr& e) const {
    std::call_once(failed_, [&] {
      try {
        std::rethrow_exception(e);
      } catch (...) {
        error_ = current_with_context(std::string(verb_) + leaves_->keys[index_].str() + ": ");
      }
      if (repair_) {
        try {
          repair_->run(index_);
        } catch (...) {  // a repair that failed leaves the error as it is
        }
      }
    });
    return error_;
  }

  const WorkPtr inner_;                          // the work, when the leaf is one
  const c10::intrusive_ptr<BatchWork> batch_;    // else the batch that holds it
  const std::shared_ptr<const SortedLeaves> leaves_;
  const size_t index_;
  const char* const verb_;  // a literal: "recv of key "
  const std::shared_ptr<LeafCountRepair> repair_;
  std::once_flag future_once_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // written once, under future_once_
  mutable std::once_flag failed_;
  mutable std::exception_ptr error_;  // written once, under failed_
};

/// What the stages of a per-leaf receive share.
struct PerLeafRecv {
  Group group;
  int peer = -1;
  std::shared_ptr<const Leaves> leaves;
  int descriptor_tag = 0;
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  at::Tensor header;                 // kHeaderWords int64, the descriptor's header
  std::vector<at::Tensor> targets;   // where each leaf's message lands
  std::exception_ptr refusal;        // a leaf that cannot take bytes in place (check_receive_target)
};

/// The stage after the descriptor is in: a refused transfer drains the sender's leaves; one
/// whose descriptor differs from this receiver's leaves drains them too, with a TransportError
/// naming the first key that differs; else the leaf receives are posted.
Stage per_leaf_check(const PerLeafRecv& r, const int64_t* desc, int64_t words) {
  const std::vector<detail::LeafLayout> theirs = detail::parse_descriptor(desc, words);
  std::exception_ptr error = r.refusal;
  if (!error) {
    const std::string problem = detail::layout_problem(theirs, r.leaves->keys(), r.leaves->tensors);
    if (problem.empty()) {
      Stage s;
      for (size_t i = 0; i < r.targets.size(); ++i) {
        s.pending.push_back(recv_one(r.group, r.targets[i], r.peer, r.leaves->wire->c10d_tags[i]));
      }
      return s;
    }
    error = std::make_exception_ptr(TransportError(problem));
  }
  return drain_leaves(r.group, r.peer, theirs, r.init_tag, r.pseudo_rand, std::move(error));
}

/// The stage after the descriptor's header is in: a long descriptor is one more receive.
Stage per_leaf_after_header(const std::shared_ptr<const PerLeafRecv>& r) {
  const int64_t words = detail::descriptor_words(r->header);
  if (words <= detail::kInlineWords) return per_leaf_check(*r, r->header.data_ptr<int64_t>() + 2, words);
  const at::Tensor long_desc = at::empty({words}, at::TensorOptions().dtype(at::kLong));
  return Stage{{recv_one(r->group, long_desc, r->peer, r->descriptor_tag)},
               [r, long_desc] { return per_leaf_check(*r, long_desc.data_ptr<int64_t>(), long_desc.numel()); },
               nullptr};
}


/// The receives of a per-leaf irecv once posted, whichever way they went: staged behind the
/// layout descriptor (the checked protocol) or behind a refusal's drains (`deferred`), one batch
/// of the transport (`batch`, with the repair of a leaf count that differs, made only when a
/// Work per leaf is: a blocking receive that succeeds never needs it), or one work per leaf
/// (`recvs`).
struct PostedLeaves {
  std::shared_ptr<Deferred> deferred;
  c10::intrusive_ptr<BatchWork> batch;
  std::shared_ptr<LeafCountRepair> repair;
  std::vector<WorkPtr> recvs;

  /// Makes the repair of a batch (before leaf_work for its leaves).
  void prepare_repair(const Leaves& l, const Peer& p, const RecvOptions& o) {
    if (!batch || repair) return;
    repair = std::make_shared<LeafCountRepair>();
    repair->group = p.group;
    repair->peer = p.rank;
    repair->init_tag = o.init_tag;
    repair->pseudo_rand = o.pseudo_rand;
    repair->batch = batch;
    repair->mine = l.keys().size();
  }

  /// Waits for every leaf; the first error names its key.
  void wait(const Leaves& l) const {
    if (deferred) {
      wait_keyed(wait_last(*deferred), l.keys(), "recv of key ");
    } else if (batch) {  // each leaf's error, the repair, the first error named by its key
      std::vector<WorkPtr> leaf_works;
      for (size_t i = 0; i < l.keys().size(); ++i) leaf_works.push_back(leaf_work(l, i, {}));
      wait_all(leaf_works);
    } else {
      wait_keyed(recvs, l.keys(), "recv of key ");
    }
  }

  /// The user's Work of leaf i, whose bytes land in `target` (the leaf, or a contiguous stage
  /// copied into the leaf once it is in).
  WorkPtr leaf_work(const Leaves& l, size_t i, const at::Tensor& target) const {
    if (batch) return c10::make_intrusive<LeafWork>(batch, l.sorted, i, "recv of key ", c10d::OpType::RECV, repair);
    if (!deferred && target.is_same(l.tensors[i])) {  // received in place: nothing to do after it
      return c10::make_intrusive<LeafWork>(recvs[i], l.sorted, i, "recv of key ", c10d::OpType::RECV);
    }
    std::function<void()> copy_back;
    if (!target.is_same(l.tensors[i])) copy_back = [leaf = l.tensors[i], target]() mutable { leaf.copy_(target); };
    std::string context = "recv of key " + l.keys()[i].str() + ": ";
    if (deferred) {
      return c10::make_intrusive<TransferWork>(std::move(context), deferred, i, c10d::OpType::RECV, std::move(copy_back));
    }
    return c10::make_intrusive<TransferWork>(std::move(context), std::vector<WorkPtr>{recvs[i]}, c10d::OpType::RECV,
                                             std::move(copy_back));
  }
};

/// Posts the receives of every leaf into `targets`.
PostedLeaves post_leaf_receives(const Leaves& l, const Peer& p, const RecvOptions& o,
                                std::span<const at::Tensor> targets, const std::exception_ptr& refusal) {
  PostedLeaves posted;
  const Transport& transport = p.group.transport();
  if (p.group.checked_wire_with(p.rank)) {
    auto r = std::make_shared<PerLeafRecv>();
    r->group = p.group;
    r->peer = p.rank;
    r->leaves = std::make_shared<const Leaves>(l);
    r->descriptor_tag = descriptor_tag(l, o.init_tag, o.pseudo_rand);
    r->init_tag = o.init_tag;
    r->pseudo_rand = o.pseudo_rand;
    r->header = at::empty({kHeaderWords}, at::TensorOptions().dtype(at::kLong));
    r->targets.assign(targets.begin(), targets.end());
    r->refusal = refusal;
    std::shared_ptr<const PerLeafRecv> rc = std::move(r);
    posted.deferred = std::make_shared<Deferred>(
        "layout descriptor",
        Stage{{recv_one(rc->group, rc->header, rc->peer, rc->descriptor_tag)}, [rc] { return per_leaf_after_header(rc); },
              nullptr});
  } else if (refusal) {
    // tensordict's wire says nothing of the sender's leaves: they are taken into scratch tensors
    // shaped like this receiver's own (a transport that drops mismatched messages drops one of
    // another size all the same).
    Stage drain;
    drain.error = refusal;
    for (size_t i = 0; i < l.keys().size(); ++i) {
      drain.pending.push_back(recv_one(
          p.group, at::empty(l.tensors[i].sizes(), at::TensorOptions().dtype(l.tensors[i].scalar_type())), p.rank,
          l.wire->c10d_tags[i]));
    }
    posted.deferred = std::make_shared<Deferred>("leaves", std::move(drain));
  } else if (transport.can(p.rank).batch) {
    // Every receive posted under one lock; the Work of leaf i is message i of the batch.
    posted.batch = transport.recv_batch(targets, p.rank, l.wire->c10d_tags, l.wire->checks);
  } else {
    for (size_t i = 0; i < l.keys().size(); ++i) {
      posted.recvs.push_back(recv_one(p.group, targets[i], p.rank, l.wire->c10d_tags[i], l.wire->checks[i]));
    }
  }
  return posted;
}

}  // namespace

namespace {

Transfer isend_leaves(const Leaves& l, const Peer& p, const SendOptions& o, Completion c) {
  const bool early = o.return_early && c == Completion::kAsOptions;
  Transfer out;
  for (size_t i = 0; i < l.keys().size(); ++i) {
    check_leaf(l.tensors[i], [&] { return "key " + l.keys()[i].str(); });
  }
  std::vector<WorkPtr> descriptor;
  if (p.group.checked_wire_with(p.rank)) {
    const int tag = descriptor_tag(l, o.init_tag, o.pseudo_rand);
    std::vector<int64_t> desc = describe_leaves(l.keys(), l.tensors);
    const bool long_desc = static_cast<int64_t>(desc.size()) > kInlineWords;
    descriptor.push_back(send_one(p.group, descriptor_header(desc), p.rank, tag));
    if (long_desc) descriptor.push_back(send_one(p.group, int64_tensor(std::move(desc)), p.rank, tag));
  }
  const Transport& transport = p.group.transport();
  const Transport::Can& can = transport.can(p.rank);
  if (can.batch && descriptor.empty() && !early) {
    // The blocking send on a transport that batches: every leaf written, then one wake-up of the
    // receiver and at most one Work (none when every leaf is already written).
    if (c10::intrusive_ptr<BatchWork> batch =
            transport.send_batch(l.tensors, p.rank, l.wire->c10d_tags, l.wire->checks)) {
      try {
        batch->wait();
      } catch (...) {
        wait_keyed(batch->messages(), l.keys(), "send of key ");  // names the leaf
        throw;
      }
    }
    out.last_tag = l.last_tag();
    return out;
  }
  std::vector<WorkPtr> sends;
  for (size_t i = 0; i < l.keys().size(); ++i) {
    // A transport that takes strided tensors packs them itself; others want contiguous bytes.
    at::Tensor t = can.strided || l.tensors[i].is_contiguous() ? l.tensors[i] : l.tensors[i].contiguous();
    sends.push_back(send_one(p.group, t, p.rank, l.wire->c10d_tags[i], l.wire->checks[i]));
  }
  if (early) {
    if (l.keys().empty()) wait_all(descriptor);
    out.has_works = true;
    for (size_t i = 0; i < l.keys().size(); ++i) {
      if (descriptor.empty()) {
        out.works.push_back(
            c10::make_intrusive<LeafWork>(std::move(sends[i]), l.sorted, i, "send of key ", c10d::OpType::SEND));
        continue;
      }
      std::vector<WorkPtr> inner = i == 0 ? std::move(descriptor) : std::vector<WorkPtr>{};
      inner.push_back(std::move(sends[i]));
      out.works.push_back(c10::make_intrusive<TransferWork>("send of key " + l.keys()[i].str() + ": ", std::move(inner),
                                                            c10d::OpType::SEND));
    }
    return out;
  }
  // Waited here: no user-facing Work per leaf.
  wait_all(descriptor);
  wait_keyed(sends, l.keys(), "send of key ");
  out.last_tag = l.last_tag();
  return out;
}

Transfer irecv_leaves(const Leaves& l, const Peer& p, const RecvOptions& o, int64_t* last_tag, Completion c) {
  if (last_tag != nullptr) *last_tag = l.last_tag();
  // Every leaf is checked before any receive is posted; a refused transfer still consumes the
  // sender's messages, so the next transfer on the pair is in step.
  std::exception_ptr refusal;
  try {
    for (size_t i = 0; i < l.keys().size(); ++i) {
      check_receive_target(l.tensors[i], [&] { return "key " + l.keys()[i].str(); });
    }
  } catch (...) {
    refusal = std::current_exception();
  }
  // A transport that takes strided tensors stages them itself; others receive contiguous bytes,
  // copied into the leaf once they are in.
  std::vector<at::Tensor> staged;
  if (!p.group.transport().can(p.rank).strided && !refusal &&
      std::any_of(l.tensors.begin(), l.tensors.end(), [](const at::Tensor& t) { return !t.is_contiguous(); })) {
    for (const auto& leaf : l.tensors) staged.push_back(leaf.is_contiguous() ? leaf : at::empty(leaf.sizes(), leaf.options()));
  }
  const std::span<const at::Tensor> targets = staged.empty() ? std::span<const at::Tensor>(l.tensors) : staged;
  PostedLeaves posted = post_leaf_receives(l, p, o, targets, refusal);

  Transfer out;
  if (!o.return_premature || c == Completion::kWaited) {
    // Waited here: no user-facing Work per leaf. A batch is waited as a whole; only a failure
    // needs a Work per leaf (PostedLeaves::wait).
    bool batch_ok = false;
    if (posted.batch) {
      try {
        posted.batch->wait();
        batch_ok = true;
      } catch (...) {
      }
    }
    if (!batch_ok) {
      posted.prepare_repair(l, p, o);
      posted.wait(l);
    }
    for (size_t i = 0; i < targets.size(); ++i) {
      if (!targets[i].is_same(l.tensors[i])) l.tensors[i].copy_(targets[i]);
    }
    return out;
  }
  out.has_works = true;
  out.works.reserve(l.keys().size());
  posted.prepare_repair(l, p, o);
  for (size_t i = 0; i < l.keys().size(); ++i) out.works.push_back(posted.leaf_work(l, i, targets[i]));
  if (l.keys().empty() && posted.deferred) wait_last(*posted.deferred);  // the descriptor is consumed (and checked) all the same
  return out;
}

}  // namespace

Transfer isend_per_leaf(const TensorDict& td, const Peer& p, const SendOptions& o, Completion c) {
  return isend_leaves(collect(td, o.init_tag, o.pseudo_rand), p, o, c);
}
Transfer irecv_per_leaf(const TensorDict& td, const Peer& p, const RecvOptions& o, int64_t* last_tag, Completion c) {
  return irecv_leaves(collect(td, o.init_tag, o.pseudo_rand), p, o, last_tag, c);
}
Transfer isend_per_leaf(const LazyStackedTensorDict& stack, const Peer& p, const SendOptions& o, Completion c) {
  return isend_leaves(collect(stack, o.init_tag, o.pseudo_rand), p, o, c);
}
Transfer irecv_per_leaf(const LazyStackedTensorDict& stack, const Peer& p, const RecvOptions& o, int64_t* last_tag,
                        Completion c) {
  return irecv_leaves(collect(stack, o.init_tag, o.pseudo_rand), p, o, last_tag, c);
}

}  // namespace tdshm::detail
