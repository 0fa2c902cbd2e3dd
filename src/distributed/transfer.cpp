// The tensordict transfer API (TensorDict::isend, irecv, send, recv, init_remote,
// from_remote_init, broadcast), written once against c10d::ProcessGroup.
//
// Wire protocol (both peers run tdshm; messages of one transfer share a tag, so MPI's same-tag
// FIFO rule keeps them in order):
//  * per-leaf: a layout descriptor, then one message per tensor leaf in sorted_leaf_keys() order
//    with the tags of transfer_tags(). The descriptor (key hash, dtype and shape per leaf; see
//    layout_descriptor.h) travels under the first leaf's tag in a fixed 32-int64 header {magic,
//    words, up to 30 words inline}, plus a second message when it does not fit (more than a few
//    leaves). The receiver posts its leaf receives only once it has checked two things: that each
//    of its leaves can take bytes in place (else TypeError or MemmapError naming the key, decided
//    before any receive is posted), and that the descriptor matches its keys, dtypes and shapes
//    (else TransportError naming the first key that differs). A refused transfer drains all of
//    the sender's leaves into scratch buffers before its error is raised, so nothing stays queued
//    to spoil the next transfer; over shm every message also carries its dtype and shape, checked
//    by the transport. irecv does not block for the descriptor: its works advance through the
//    stages (header, long descriptor, leaves) when they are waited or polled (Deferred).
//  * consolidated: a 3-int64 header {magic, schema fingerprint, storage bytes} then the storage,
//    both with tag 0. The receiver checks the header (and that its storage can take bytes in
//    place) before it posts the storage's receive; on a mismatch it drains the storage into a
//    scratch buffer and throws.
//  * init_remote: a 4-int64 header {magic, schema bytes, storage bytes, reference bytes}, the
//    encoded schema (keys, non-tensor values, tensorclass name), the storage, then (over shm, when
//    the tree has named MemoryMappedTensor leaves) their file references; tag 0, or broadcasts.
//    The receiver allocates everything it receives into, so no user-owned tensor is written.

#include <tdshm/distributed.h>

#include "common/format.h"
#include "distributed/layout_descriptor.h"
#include "distributed/transfer_errors.h"
#include "tensordict/impl.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>

namespace tdshm {

namespace {

using detail::current_with_context;
using detail::rethrow_with_context;

constexpr int64_t kConsolidatedMagic = 0x7464736d636f6e31;  // "tdsmcon1"
constexpr int64_t kRemoteInitMagic = 0x7464736d696e6931;    // "tdsminI1"
constexpr int kConsolidatedTag = 0;
constexpr int kRemoteInitTag = 0;
// Bounds on what a peer's header may announce (a corrupt or hostile peer makes a transfer fail,
// never an absurd allocation): schemas are metadata, never this large.
constexpr int64_t kMaxSchemaBytes = int64_t{1} << 30;
constexpr int64_t kMaxStorageBytes = int64_t{1} << 40;

// ---------------------------------------------------------------------------------------------
// Receives that go in stages: what a later receive may be depends on a header from the sender
// (the layout descriptor, the consolidated header). irecv posts the header's receive and
// returns; the stages after it run when the header is in, from a wait or from a poll
// (isCompleted), and each only checks and posts receives, never waits. So irecv never blocks,
// isCompleted never blocks, and ranks that post receives before sends do not deadlock.

/// One stage: the receives it posted and, unless it is the last, what to do once they all
/// completed.
struct Stage {
  std::vector<WorkPtr> pending;
  /// Checks what `pending` brought and returns the next stage (posting its receives, never
  /// waiting); null in the last stage.
  std::function<Stage()> next;
  /// Last stage only: the transfer's error. A refused transfer's last stage drains the
  /// sender's messages (`pending`); the Deferred waits for them before it reports the error.
  std::exception_ptr error;
};

// Every backend work is waited exactly once (a gloo receive's wait() waits for one more message
// each time it is called), so the works of a stage are waited by the Deferred alone, except
// the last stage's receives of a successful transfer, each of which is handed to one user work.

class Deferred {
 public:
  /// `what` names what the first stage receives, for messages ("layout descriptor").
  Deferred(std::string what, Stage first) : what_(std::move(what)), stage_(std::move(first)) {}

  /// Never waits for a message, nor for a thread that waits in wait(): advances through every
  /// stage whose receives have completed. True once the last stage is posted (and, for a
  /// refused transfer, its drains have completed).
  bool poll() {
    std::unique_lock lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) return false;  // a wait() is advancing it
    return advance(/*block=*/false, ::kNoTimeout);
  }
  /// Waits (each backend wait with `timeout`) until poll() would return true.
  void wait(std::chrono::milliseconds timeout) {
    std::lock_guard lk(mu_);
    advance(/*block=*/true, timeout);
  }
  /// The last stage: read it only after poll() returned true or wait() returned (it never
  /// changes after that).
  const Stage& last() const { return stage_; }

 private:
  // Requires mu_.
  bool advance(bool block, std::chrono::milliseconds timeout) {
    while (stage_.next || (stage_.error && !stage_.pending.empty())) {
      if (!block && !std::all_of(stage_.pending.begin(), stage_.pending.end(),
                                 [](const WorkPtr& w) { return w->isCompleted(); })) {
        return false;
      }
      std::exception_ptr failed;
      for (const auto& w : stage_.pending) {
        try {
          w->wait(timeout);  // completed already when polling
        } catch (...) {
          if (!failed) failed = current_with_context("receiving the sender's " + what_ + ": ");
        }
      }
      if (!stage_.next) {
        // A refused transfer's drains: its refusal says what went wrong first, a drain can only
        // fail after it.
        stage_.pending.clear();
        break;
      }
      const std::function<Stage()> next = std::move(stage_.next);
      stage_.next = nullptr;
      if (failed) {
        stage_ = Stage{{}, nullptr, failed};
        break;
      }
      try {
        stage_ = next();
      } catch (...) {
        stage_ = Stage{{}, nullptr, current_with_context("")};  // a tdshm error keeps its type
      }
    }
    return true;
  }

  std::mutex mu_;
  const std::string what_;
  Stage stage_;
};

/// Waits for `d`'s last stage and returns its receives; for a refused transfer (once the
/// drains completed), throws the refusal.
const std::vector<WorkPtr>& wait_last(Deferred& d) {
  d.wait(::kNoTimeout);
  const Stage& last = d.last();
  if (last.error) std::rethrow_exception(last.error);
  return last.pending;
}

// The Work handed to users: backend works (given, or the index-th receive of a Deferred's last
// stage) plus what to do once they all succeeded (copy a staged leaf back), with errors that
// name the key.
//
// Locking: progress_mu_ is held by whoever advances the work (wait() blocks for it,
// isCompleted() only tries it); mu_ guards the state that isSuccess(), exception() and abort()
// read, and is never held across a wait.
class TransferWork final : public c10d::Work {
 public:
  TransferWork(std::string context, std::vector<WorkPtr> inner, c10d::OpType type,
               std::function<void()> on_success = {})
      : c10d::Work(-1, type), context_(std::move(context)), inner_(std::move(inner)), on_success_(std::move(on_success)) {}
  TransferWork(std::string context, std::shared_ptr<Deferred> deferred, size_t index, c10d::OpType type,
               std::function<void()> on_success = {})
      : c10d::Work(-1, type),
        context_(std::move(context)),
        deferred_(std::move(deferred)),
        index_(index),
        on_success_(std::move(on_success)) {}

  /// Only polls: never waits for a message, nor for a thread that waits in wait().
  bool isCompleted() override {
    {
      std::lock_guard lk(mu_);
      if (finished_) return true;
    }
    std::unique_lock progress(progress_mu_, std::try_to_lock);
    if (!progress.owns_lock()) return false;  // a wait() is advancing this work
    if (!resolve(/*block=*/false, ::kNoTimeout)) return false;
    for (const auto& w : inner_) {
      if (!w->isCompleted()) return false;
    }
    complete(::kNoTimeout);  // every work has completed: nothing in there waits
    return true;
  }
  bool isSuccess() const override {
    std::lock_guard lk(mu_);
    return finished_ && !error_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard lk(mu_);
    return error_;
  }
  std::vector<at::Tensor> result() override { return {}; }
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override {
    {
      std::lock_guard progress(progress_mu_);
      bool finished;
      {
        std::lock_guard lk(mu_);
        finished = finished_;
      }
      if (!finished) {
        resolve(/*block=*/true, timeout);
        complete(timeout);
      }
    }
    std::lock_guard lk(mu_);
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  void abort() override {
    std::vector<WorkPtr> inner;
    {
      std::lock_guard lk(mu_);
      inner = inner_;
    }
    for (auto& w : inner) w->abort();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    TORCH_CHECK(inner_.size() == 1 && !deferred_ && !on_success_, "this tdshm transfer work has no future; call wait()");
    return inner_[0]->getFuture();
  }

 private:
  // Requires progress_mu_. A deferred work's backend work is the receive the Deferred's last
  // stage posted for it; for a refused transfer there is none (the Deferred drained the
  // sender's messages), and the refusal is its error (it names the key itself). False while the
  // Deferred is not done (only when !block).
  bool resolve(bool block, std::chrono::milliseconds timeout) {
    if (!deferred_ || resolved_) return true;
    if (block) {
      deferred_->wait(timeout);
    } else if (!deferred_->poll()) {
      return false;
    }
    const Stage& last = deferred_->last();
    std::lock_guard lk(mu_);
    if (last.error) {
      refusal_ = last.error;
    } else {
      inner_ = {last.pending.at(index_)};
    }
    resolved_ = true;
    return true;
  }

  // Requires progress_mu_. Waits for every inner work (all of them, even after a failure:
  // nothing stays posted into a leaf the caller may reuse), then runs on_success, once.
  void complete(std::chrono::milliseconds timeout) {
    std::exception_ptr error = refusal_;
    for (const auto& w : inner_) {
      try {
        w->wait(timeout);
      } catch (...) {
        if (!error) error = current_with_context(context_);
      }
    }
    if (!error && on_success_) {
      try {
        on_success_();
      } catch (...) {
        error = current_with_context(context_);
      }
    }
    std::lock_guard lk(mu_);
    error_ = error;
    finished_ = true;
  }

  const std::string context_;
  std::vector<WorkPtr> inner_;  // written under both locks, read under either
  const std::shared_ptr<Deferred> deferred_;
  const size_t index_ = 0;
  const std::function<void()> on_success_;
  std::mutex progress_mu_;
  bool resolved_ = false;       // progress_mu_
  std::exception_ptr refusal_;  // progress_mu_
  mutable std::mutex mu_;
  bool finished_ = false;
  std::exception_ptr error_;
};

/// Waits for every work (all of them) and rethrows the first error, its message prefixed with
/// `verb` and the key of its leaf (works[i] moves keys[i]; the strings are built only on error).
void wait_keyed(const std::vector<WorkPtr>& works, const std::vector<Key>& keys, const char* verb) {
  std::exception_ptr first;
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      works[i]->wait();
    } catch (...) {
      if (!first) first = current_with_context(std::string(verb) + keys[i].str() + ": ");
    }
  }
  if (first) std::rethrow_exception(first);
}

/// Waits for every work (all of them) and rethrows the first error.
void wait_all(const std::vector<WorkPtr>& works) {
  std::exception_ptr first;
  for (const auto& w : works) {
    try {
      w->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// ---------------------------------------------------------------------------------------------
// Peers

struct Peer {
  Group group;
  int rank = -1;  // in group
};

/// Resolves exactly one of `global` / `in_group` (SEMANTICS.md, Peers), before any message.
Peer resolve_peer(const char* global_name, const char* group_name, std::optional<int> global,
                  std::optional<int> in_group, const Group& given) {
  const std::string g = global_name, gg = group_name;
  if (given.is_non_member()) throw Error("this rank is not a member of `group` (new_group did not include it)");
  if (in_group && !given.defined()) throw Error("`" + gg + "` requires `group` to be passed.");
  if (global && in_group) throw Error("`" + g + "` and `" + gg + "` are mutually exclusive.");
  if (!global && !in_group) throw Error("Exactly one of `" + g + "` and `" + gg + "` must be provided.");
  Peer p;
  p.group = given.defined() ? given : default_group();
  p.rank = in_group ? *in_group : p.group.group_rank(*global);
  if (p.rank < 0 || p.rank >= p.group.size()) {
    throw Error("`" + (in_group ? gg : g) + "` = " + std::to_string(in_group ? *in_group : *global) +
                " is not a rank of the group (size " + std::to_string(p.group.size()) + ")");
  }
  if (p.rank == p.group.rank()) {
    throw Error("`" + (in_group ? gg : g) + "` = " + std::to_string(in_group ? *in_group : *global) +
                " is this process's own rank: a tensordict cannot be sent to itself");
  }
  return p;
}

bool is_shm(const Group& g) { return g.backend_name() == "shm"; }

int c10d_tag(int64_t tag) {
  if (tag < 0 || tag > INT_MAX) {
    throw Error("tag " + std::to_string(tag) + " is outside [0, " + std::to_string(INT_MAX) + "] (init_tag too large?)");
  }
  return static_cast<int>(tag);
}

WorkPtr send_one(const Group& g, at::Tensor t, int peer, int tag) {
  std::vector<at::Tensor> v{std::move(t)};
  return g.backend().send(v, peer, tag);
}
WorkPtr recv_one(const Group& g, at::Tensor t, int peer, int tag) {
  std::vector<at::Tensor> v{std::move(t)};
  return g.backend().recv(v, peer, tag);
}
void recv_now(const Group& g, const at::Tensor& t, int peer, int tag) { recv_one(g, t, peer, tag)->wait(); }
void broadcast_now(const Group& g, const at::Tensor& t, int root) {
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  g.backend().broadcast(v, o)->wait();
}

at::Tensor int64_tensor(std::vector<int64_t> values) {
  auto t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

at::Tensor bytes_tensor(int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kByte)); }

/// A leaf that can be a message: a defined, dense CPU tensor. `what()` names it ("key 'c'"),
/// built only on error. Throws TypeError.
template <class Name>
void check_leaf(const at::Tensor& t, const Name& what) {
  if (!t.device().is_cpu()) {
    throw TypeError(what() + ": only CPU tensors can be transferred, this leaf is on " + t.device().str());
  }
  if (t.layout() != at::kStrided) throw TypeError(what() + ": only dense (strided) tensors can be transferred");
}

/// A tensor a message can land in, in place: a leaf check_leaf accepts whose elements do not
/// overlap (TypeError: an expanded tensor, stride 0, would receive several elements into one
/// place) and that is not a read-only MemoryMappedTensor (MemmapError: its writes are private
/// copy-on-write pages, they would never reach the file). Checked before any receive is posted.
template <class Name>
void check_receive_target(const at::Tensor& t, const Name& what) {
  check_leaf(t, what);
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes) {
    throw TypeError(what() + ": its elements overlap in memory (shape " + detail::shape_str(t.sizes()) + ", strides " +
                    detail::shape_str(t.strides()) + ", an expanded tensor?), so it cannot receive in place; give the "
                    "receiver a tensor of its own (clone() or contiguous()); nothing was received");
  }
  if (const auto info = MemoryMappedTensor::info(t); info && !info->writable) {
    throw MemmapError(what() + ": it maps '" + info->filename +
                      "' read-only (MemmapMode::kReadOnly), so received bytes would never reach the file; map it "
                      "with MemmapMode::kReadWrite or receive into another tensor; nothing was received");
  }
}

// ---------------------------------------------------------------------------------------------
// Per-leaf transfers

struct Leaves {
  std::vector<Key> keys;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> tags;
};

/// The leaves of `td` and their tags; the leaves themselves are checked by the caller (a sender
/// with check_leaf, a receiver with check_receive_target).
Leaves collect(const TensorDict& td, int64_t init_tag, bool pseudo_rand) {
  Leaves l;
  l.keys = td.sorted_leaf_keys();
  for (const auto& k : l.keys) l.tensors.push_back(td.get(k));
  l.tags = transfer_tags(init_tag, l.keys.size(), pseudo_rand);
  for (int64_t t : l.tags) c10d_tag(t);
  return l;
}

/// The tag the descriptor travels with: the first leaf's (or the one it would have).
int descriptor_tag(const Leaves& l, int64_t init_tag, bool pseudo_rand) {
  return c10d_tag(l.tags.empty() ? transfer_tags(init_tag, 1, pseudo_rand)[0] : l.tags[0]);
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
    const std::string problem = detail::layout_problem(theirs, r.leaves->keys, r.leaves->tensors);
    if (problem.empty()) {
      Stage s;
      for (size_t i = 0; i < r.targets.size(); ++i) {
        s.pending.push_back(recv_one(r.group, r.targets[i], r.peer, static_cast<int>(r.leaves->tags[i])));
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

}  // namespace

// ---------------------------------------------------------------------------------------------

void Transfer::wait() const { wait_all(works); }

Transfer TensorDict::isend(const SendOptions& o) const {
  const Peer p = resolve_peer("dst", "group_dst", o.dst, o.group_dst, o.group);
  Transfer out;
  if (o.consolidated) {
    const TensorDict c = consolidate();
    const at::Tensor storage = c.consolidated_storage();
    const auto header = int64_tensor({kConsolidatedMagic, static_cast<int64_t>(c.schema_fingerprint()), storage.numel()});
    std::vector<WorkPtr> inner{send_one(p.group, header, p.rank, kConsolidatedTag),
                               send_one(p.group, storage, p.rank, kConsolidatedTag)};
    if (o.return_early) {
      out.has_works = true;
      out.works.push_back(c10::make_intrusive<TransferWork>("consolidated send: ", std::move(inner), c10d::OpType::SEND));
    } else {
      try {
        wait_all(inner);
      } catch (...) {
        rethrow_with_context("consolidated send: ");
      }
    }
    return out;
  }
  const Leaves l = collect(*this, o.init_tag, o.pseudo_rand);
  for (size_t i = 0; i < l.keys.size(); ++i) {
    check_leaf(l.tensors[i], [&] { return "key " + l.keys[i].str(); });
  }
  std::vector<WorkPtr> descriptor;
  {
    const int tag = descriptor_tag(l, o.init_tag, o.pseudo_rand);
    std::vector<int64_t> desc = detail::describe_leaves(l.keys, l.tensors);
    const bool long_desc = static_cast<int64_t>(desc.size()) > detail::kInlineWords;
    descriptor.push_back(send_one(p.group, detail::descriptor_header(desc), p.rank, tag));
    if (long_desc) descriptor.push_back(send_one(p.group, int64_tensor(std::move(desc)), p.rank, tag));
  }
  std::vector<WorkPtr> sends;
  for (size_t i = 0; i < l.keys.size(); ++i) {
    // Over shm a strided leaf is packed by the transport; other backends want contiguous bytes.
    at::Tensor t = is_shm(p.group) || l.tensors[i].is_contiguous() ? l.tensors[i] : l.tensors[i].contiguous();
    sends.push_back(send_one(p.group, t, p.rank, static_cast<int>(l.tags[i])));
  }
  if (o.return_early) {
    if (l.keys.empty()) wait_all(descriptor);
    out.has_works = true;
    for (size_t i = 0; i < l.keys.size(); ++i) {
      std::vector<WorkPtr> inner = i == 0 ? std::move(descriptor) : std::vector<WorkPtr>{};
      inner.push_back(std::move(sends[i]));
      out.works.push_back(c10::make_intrusive<TransferWork>("send of key " + l.keys[i].str() + ": ", std::move(inner),
                                                            c10d::OpType::SEND));
    }
    return out;
  }
  // Waited here: no user-facing Work per leaf.
  wait_all(descriptor);
  wait_keyed(sends, l.keys, "send of key ");
  out.last_tag = l.tags.empty() ? o.init_tag - 1 : l.tags.back();
  return out;
}

void TensorDict::send(const SendOptions& o) const {
  SendOptions waited = o;
  waited.return_early = false;
  isend(waited);
}

Transfer TensorDict::irecv(const RecvOptions& o) {
  const Peer p = resolve_peer("src", "group_src", o.src, o.group_src, o.group);
  Transfer out;
  std::vector<WorkPtr> works;
  if (o.consolidated) {
    if (!is_consolidated()) {
      throw Error("irecv(consolidated=True) needs a consolidated receiver: call consolidate() first (it must have the "
                  "sender's schema)");
    }
    const at::Tensor storage = consolidated_storage();
    std::exception_ptr refusal;  // a storage that cannot take bytes in place: refused, the sender's drained
    try {
      check_receive_target(storage, [] { return std::string("the consolidated storage"); });
    } catch (...) {
      refusal = std::current_exception();
    }
    const uint64_t mine = schema_fingerprint();
    auto header = int64_tensor({0, 0, 0});
    const Group g = p.group;
    const int peer = p.rank;
    auto after_header = [g, peer, header, storage, mine, refusal]() -> Stage {
      const int64_t magic = header.data_ptr<int64_t>()[0], bytes = header.data_ptr<int64_t>()[2];
      const auto fingerprint = static_cast<uint64_t>(header.data_ptr<int64_t>()[1]);
      if (magic != kConsolidatedMagic || bytes < 0 || bytes > kMaxStorageBytes) {
        throw TransportError("the sender's message is not a consolidated tdshm transfer (is it sending per-leaf?)");
      }
      if (refusal || fingerprint != mine || bytes != storage.numel()) {
        // Drained: the stream stays in step.
        Stage drain{{recv_one(g, bytes_tensor(bytes), peer, kConsolidatedTag)}, nullptr, refusal};
        if (!refusal) {
          drain.error = std::make_exception_ptr(SchemaError(
              "the sender's schema (fingerprint " + std::to_string(fingerprint) + ", " + std::to_string(bytes) +
              " bytes) differs from this tensordict's (fingerprint " + std::to_string(mine) + ", " +
              std::to_string(storage.numel()) + " bytes): tensorclass names, keys, dtypes, shapes or layout differ; "
              "nothing was written"));
        }
        return drain;
      }
      return Stage{{recv_one(g, storage, peer, kConsolidatedTag)}, nullptr, nullptr};
    };
    auto deferred = std::make_shared<Deferred>(
        "consolidated header", Stage{{recv_one(g, header, peer, kConsolidatedTag)}, std::move(after_header), nullptr});
    works.push_back(c10::make_intrusive<TransferWork>("consolidated recv: ", deferred, 0, c10d::OpType::RECV));
  } else {
    auto shared = std::make_shared<const Leaves>(collect(*this, o.init_tag, o.pseudo_rand));
    const Leaves& l = *shared;
    auto r = std::make_shared<PerLeafRecv>();
    r->group = p.group;
    r->peer = p.rank;
    r->leaves = shared;
    r->descriptor_tag = descriptor_tag(l, o.init_tag, o.pseudo_rand);
    r->init_tag = o.init_tag;
    r->pseudo_rand = o.pseudo_rand;
    r->header = at::empty({detail::kHeaderWords}, at::TensorOptions().dtype(at::kLong));
    // Every leaf is checked before any receive is posted; a refused transfer still consumes the
    // sender's messages (drain_leaves), so the next transfer on the pair is in step.
    try {
      for (size_t i = 0; i < l.keys.size(); ++i) {
        check_receive_target(l.tensors[i], [&] { return "key " + l.keys[i].str(); });
      }
    } catch (...) {
      r->refusal = std::current_exception();
    }
    // Over shm a strided leaf is staged by the transport; others receive contiguous bytes,
    // copied into the leaf once they are in.
    const bool stage_strided = !is_shm(p.group) && !r->refusal;
    for (const auto& leaf : l.tensors) {
      r->targets.push_back(stage_strided && !leaf.is_contiguous() ? at::empty(leaf.sizes(), leaf.options()) : leaf);
    }
    const std::vector<at::Tensor>& targets = r->targets;
    std::shared_ptr<const PerLeafRecv> rc = std::move(r);
    auto deferred = std::make_shared<Deferred>(
        "layout descriptor", Stage{{recv_one(rc->group, rc->header, rc->peer, rc->descriptor_tag)},
                                   [rc] { return per_leaf_after_header(rc); }, nullptr});
    if (!o.return_premature) {
      // Waited here: no user-facing Work per leaf.
      wait_keyed(wait_last(*deferred), l.keys, "recv of key ");
      for (size_t i = 0; i < targets.size(); ++i) {
        if (!targets[i].is_same(l.tensors[i])) l.tensors[i].copy_(targets[i]);
      }
      return out;
    }
    for (size_t i = 0; i < l.keys.size(); ++i) {
      std::function<void()> copy_back;
      if (!targets[i].is_same(l.tensors[i])) {
        copy_back = [leaf = l.tensors[i], target = targets[i]]() mutable { leaf.copy_(target); };
      }
      works.push_back(c10::make_intrusive<TransferWork>("recv of key " + l.keys[i].str() + ": ", deferred, i,
                                                        c10d::OpType::RECV, std::move(copy_back)));
    }
    if (l.keys.empty()) wait_last(*deferred);  // the descriptor is consumed (and checked) all the same
  }
  if (o.return_premature) {
    out.has_works = true;
    out.works = std::move(works);
  } else {
    wait_all(works);
  }
  return out;
}

int64_t TensorDict::recv(const RecvOptions& o) {
  RecvOptions waited = o;
  waited.return_premature = false;
  irecv(waited);
  if (o.consolidated) return kConsolidatedTag;
  const auto n = sorted_leaf_keys().size();
  return n == 0 ? o.init_tag - 1 : transfer_tags(o.init_tag, n, o.pseudo_rand).back();
}

// ---------------------------------------------------------------------------------------------
// init_remote / from_remote_init / broadcast

namespace {

struct RemotePayload {
  at::Tensor header;  // {magic, schema bytes, storage bytes, reference bytes}
  at::Tensor schema;  // encoded
  at::Tensor storage;
  at::Tensor references;  // encoded MemoryMappedTensor references; empty if none
};

// References of named MemoryMappedTensor leaves: per leaf, the key's parts, the file and the
// offset, each string as u32 length + bytes, the offset as i64 (native byte order: one host).
void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_string(std::string& out, const std::string& v) {
  put_u32(out, static_cast<uint32_t>(v.size()));
  out += v;
}

std::string encode_references(const TensorDict& td) {
  std::string out;
  for (const auto& key : td.keys(/*include_nested=*/true, /*leaves_only=*/true)) {
    const Value v = td.get_value(key);
    if (!v.is_tensor()) continue;
    const auto info = MemoryMappedTensor::info(v.tensor());
    if (!info || info->filename.empty() || !v.tensor().is_contiguous()) continue;
    put_u32(out, static_cast<uint32_t>(key.size()));
    for (const auto& part : key.parts()) put_string(out, part);
    put_string(out, info->filename);
    out.append(reinterpret_cast<const char*>(&info->offset), sizeof info->offset);
  }
  return out;
}

/// Replaces the leaves named in `bytes` (from a peer: every length is checked) with mappings of
/// the sender's files. The leaves keep their dtype and shape.
void apply_references(const TensorDict& td, const at::Tensor& bytes) {
  const auto* p = bytes.data_ptr<uint8_t>();
  const auto* end = p + bytes.numel();
  auto bad = []() { return TransportError("from_remote_init: malformed memory-map references from the sender"); };
  auto u32 = [&]() {
    if (end - p < 4) throw bad();
    uint32_t v;
    std::memcpy(&v, p, 4);
    p += 4;
    return v;
  };
  auto str = [&]() {
    const uint32_t n = u32();
    if (static_cast<uint64_t>(end - p) < n) throw bad();
    std::string v(reinterpret_cast<const char*>(p), n);
    p += n;
    return v;
  };
  while (p < end) {
    const uint32_t parts = u32();
    if (parts == 0 || parts > kSchemaMaxDepth + 1) throw bad();
    std::vector<std::string> key_parts;
    for (uint32_t i = 0; i < parts; ++i) key_parts.push_back(str());
    const std::string file = str();
    int64_t offset;
    if (end - p < 8) throw bad();
    std::memcpy(&offset, p, 8);
    p += 8;
    const Key key(std::move(key_parts));
    const at::Tensor leaf = td.get(key);
    const auto mapped = MemoryMappedTensor::from_filename(file, leaf.scalar_type(), leaf.sizes(), offset);
    // The consolidated tensordict is locked: the leaf is swapped in its node directly.
    TensorDict parent = key.size() == 1 ? td : td.get_tensordict(Key(std::vector<std::string>(key.parts().begin(), key.parts().end() - 1)));
    Value* slot = parent.impl()->find(key.back());
    if (slot == nullptr) throw bad();  // td.get(key) found it: cannot happen
    *slot = Value(mapped);
  }
}

RemotePayload prepare_remote(const TensorDict& td, bool by_reference) {
  const TensorDict c = td.consolidate();
  const std::vector<uint8_t> encoded = encode_schema(c.schema());
  RemotePayload r;
  r.schema = bytes_tensor(static_cast<int64_t>(encoded.size()));
  if (!encoded.empty()) std::memcpy(r.schema.data_ptr(), encoded.data(), encoded.size());
  r.storage = c.consolidated_storage();
  if (by_reference) {
    const std::string refs = encode_references(td);
    if (!refs.empty()) {
      r.references = bytes_tensor(static_cast<int64_t>(refs.size()));
      std::memcpy(r.references.data_ptr(), refs.data(), refs.size());
    }
  }
  r.header = int64_tensor({kRemoteInitMagic, r.schema.numel(), r.storage.numel(),
                           r.references.defined() ? r.references.numel() : 0});
  return r;
}

/// Checks a received header and allocates the schema buffer and storage it announces.
RemotePayload allocate_remote(const at::Tensor& header) {
  const int64_t magic = header.data_ptr<int64_t>()[0], schema_bytes = header.data_ptr<int64_t>()[1],
                storage_bytes = header.data_ptr<int64_t>()[2], reference_bytes = header.data_ptr<int64_t>()[3];
  if (magic != kRemoteInitMagic) {
    throw TransportError("from_remote_init: the first message is not a tdshm init_remote header (does the sender call "
                         "init_remote with the same group and mode?)");
  }
  if (schema_bytes <= 0 || schema_bytes > kMaxSchemaBytes || storage_bytes < 0 || storage_bytes > kMaxStorageBytes ||
      reference_bytes < 0 || reference_bytes > kMaxSchemaBytes) {
    throw TransportError("from_remote_init: the sender announces " + std::to_string(schema_bytes) + " schema bytes and " +
                         std::to_string(storage_bytes) + " storage bytes, which is not a valid transfer");
  }
  RemotePayload r;
  r.header = header;
  r.schema = bytes_tensor(schema_bytes);
  r.storage = bytes_tensor(storage_bytes);
  if (reference_bytes > 0) r.references = bytes_tensor(reference_bytes);
  return r;
}

TensorDict rebuild_remote(const RemotePayload& r, const std::optional<c10::Device>& device) {
  Schema schema = decode_schema(std::span<const uint8_t>(r.schema.data_ptr<uint8_t>(), static_cast<size_t>(r.schema.numel())),
                                static_cast<uint64_t>(r.storage.numel()));
  at::Tensor storage = r.storage;
  if (device && *device != storage.device()) storage = storage.to(*device);
  TensorDict td = TensorDict::from_consolidated(storage, std::move(schema));
  if (r.references.defined()) apply_references(td, r.references);
  return td;
}

/// Sends (root) or receives the parts of a payload in order, by broadcast.
void broadcast_parts(const Group& g, RemotePayload& r, int root) {
  broadcast_now(g, r.schema, root);
  broadcast_now(g, r.storage, root);
  if (r.references.defined()) broadcast_now(g, r.references, root);
}

/// The whole exchange as broadcasts from `root` (a group rank); `td` is used on the root only.
TensorDict broadcast_remote(const TensorDict* td, const Group& g, int root, const std::optional<c10::Device>& device) {
  if (g.rank() == root) {
    RemotePayload r = prepare_remote(*td, is_shm(g));
    broadcast_now(g, r.header, root);
    broadcast_parts(g, r, root);
    return td->consolidate();
  }
  auto header = int64_tensor({0, 0, 0, 0});
  broadcast_now(g, header, root);
  RemotePayload r = allocate_remote(header);
  broadcast_parts(g, r, root);
  return rebuild_remote(r, device);
}

Group group_or_default(const Group& g) {
  if (g.is_non_member()) throw Error("this rank is not a member of `group` (new_group did not include it)");
  return g.defined() ? g : default_group();
}

int root_in_group(const Group& g, int src) {
  const int root = g.group_rank(src);
  if (root < 0 || root >= g.size()) throw Error("`src` = " + std::to_string(src) + " is not a rank of the group");
  return root;
}

}  // namespace

void TensorDict::init_remote(const InitRemoteOptions& o) const {
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    broadcast_remote(this, g, g.rank(), o.device);
    return;
  }
  if (!o.dst) throw Error("init_remote: `dst` must be provided (or use_broadcast=True)");
  const Peer p = resolve_peer("dst", "group_dst", o.dst, std::nullopt, o.group);
  RemotePayload r = prepare_remote(*this, is_shm(p.group));
  std::vector<WorkPtr> works{send_one(p.group, r.header, p.rank, kRemoteInitTag),
                             send_one(p.group, r.schema, p.rank, kRemoteInitTag),
                             send_one(p.group, r.storage, p.rank, kRemoteInitTag)};
  if (r.references.defined()) works.push_back(send_one(p.group, r.references, p.rank, kRemoteInitTag));
  wait_all(works);
}

TensorDict TensorDict::from_remote_init(const FromRemoteInitOptions& o) {
  if (!o.src) throw Error("from_remote_init: `src` must be provided");
  if (o.use_broadcast) {
    const Group g = group_or_default(o.group);
    return broadcast_remote(nullptr, g, root_in_group(g, *o.src), o.device);
  }
  const Peer p = resolve_peer("src", "group_src", o.src, std::nullopt, o.group);
  auto header = int64_tensor({0, 0, 0, 0});
  recv_now(p.group, header, p.rank, kRemoteInitTag);
  RemotePayload r = allocate_remote(header);
  recv_now(p.group, r.schema, p.rank, kRemoteInitTag);
  recv_now(p.group, r.storage, p.rank, kRemoteInitTag);
  if (r.references.defined()) recv_now(p.group, r.references, p.rank, kRemoteInitTag);
  return rebuild_remote(r, o.device);
}

TensorDict TensorDict::broadcast(const BroadcastOptions& o) const {
  const Group g = group_or_default(o.group);
  return broadcast_remote(this, g, root_in_group(g, o.src), o.device);
}

}  // namespace tdshm
