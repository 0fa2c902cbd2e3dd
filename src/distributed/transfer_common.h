#pragma once
// What the transfer protocols (per_leaf.cpp, consolidated.cpp, remote_init.cpp) share: staged
// receives (Deferred), the Work handed to users (TransferWork), peers, and the small helpers that
// post one message. Internal to the distributed layer.
//
// Wire (see docs/wire.md): by default exactly tensordict's. Over shm, what tdshm
// checks rides inside the transport's own entries (tdshm::MessageCheck: a key hash per leaf, a
// schema hash per consolidated storage), so no message is added. Over gloo, two tdshm ranks that
// both advertised it when the group was formed (Group::checked_wire_with) use the checked
// protocol: a layout descriptor before per-leaf leaves, a header before a consolidated storage.

#include <tdshm/distributed.h>
#include <tdshm/lazy_stack.h>

#include "common/format.h"
#include "distributed/transfer_errors.h"
#include "process_group/transport.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tdshm::detail {

/// The most bytes a peer may announce for one storage (1 TiB): a corrupt or hostile peer makes
/// a transfer fail, never an absurd allocation.
inline constexpr uint64_t kMaxStorageBytes = uint64_t{1} << 40;

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
inline const std::vector<WorkPtr>& wait_last(Deferred& d) {
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
      : c10d::Work(-1, type),
        context_(std::move(context)),
        inner_(std::move(inner)),
        on_success_(std::move(on_success)) {}
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
void wait_keyed(const std::vector<WorkPtr>& works, const std::vector<Key>& keys, const char* verb);
/// The same with the key of works[i] computed by key_of(i), only on error.
void wait_keyed(const std::vector<WorkPtr>& works, const std::function<Key(size_t)>& key_of, const char* verb);
/// Waits for every work (all of them) and rethrows the first error.
void wait_all(const std::vector<WorkPtr>& works);

// ---------------------------------------------------------------------------------------------
// Peers and messages

/// The peer of a transfer: a rank of `group`, the caller's own group (referred to, not copied: a
/// copy costs four reference-count operations per transfer) or the default group (held here).
/// Lives on the stack of the call that resolved it, which holds the caller's options.
class Peer {
 public:
  Peer(const Group* given, Group fallback, int group_rank) noexcept
      : fallback_(std::move(fallback)), group(given != nullptr ? *given : fallback_), rank(group_rank) {}
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

 private:
  Group fallback_;  // (declared first: `group` may refer to it)

 public:
  const Group& group;
  const int rank;  // in group
};

/// Resolves exactly one of `global` / `in_group` (docs/semantics.md, "Peers"), before any message.
Peer resolve_peer(const char* global_name, const char* group_name, std::optional<int> global,
                  std::optional<int> in_group, const Group& given);
/// The group to use: `g`, or the default group when `g` is "no group". Throws Error for a
/// non-member.
Group group_or_default(const Group& g);
/// The group rank of global rank `src` (Error when it is not a member).
int root_in_group(const Group& g, int src);

/// A transfer tag as c10d takes it. Throws Error outside [0, INT_MAX].
int c10d_tag(int64_t tag);

/// Posts one message; `check` rides with it where the transport can carry it
/// (Transport::Can::check_messages), else it is ignored.
WorkPtr send_one(const Group& g, at::Tensor t, int peer, int tag, MessageCheck check = {});
WorkPtr recv_one(const Group& g, at::Tensor t, int peer, int tag, MessageCheck check = {});
void recv_now(const Group& g, const at::Tensor& t, int peer, int tag);
void broadcast_now(const Group& g, const at::Tensor& t, int root);

at::Tensor int64_tensor(std::vector<int64_t> values);
at::Tensor bytes_tensor(int64_t n);

/// 32 bits of a 64-bit hash (key hash, schema fingerprint) for a MessageCheck.
inline uint32_t fold32(uint64_t h) noexcept { return static_cast<uint32_t>(h ^ (h >> 32)); }
/// The MessageCheck of the leaf whose key has key_hash `hash` (SortedLeaves::key_hashes) in a
/// transfer of `leaves` leaves (shm only; the same in every process and build; a count past
/// 65535 is sent as unknown).
MessageCheck key_check_of_hash(uint64_t hash, size_t leaves) noexcept;
/// The MessageCheck of a consolidated storage with schema fingerprint `fingerprint`.
inline MessageCheck schema_check(uint64_t fingerprint) noexcept {
  return {MessageCheck::Kind::kSchema, fold32(fingerprint)};
}

struct SortedLeaves;  // tensordict/impl.h

/// The per-leaf wire of a tree's leaves for one init_tag and pseudo_rand: the tags (checked as
/// c10d takes them) and the shm key checks, which every transfer of an unchanged tree repeats.
/// SortedLeaves (tensordict/impl.h) holds the last one used.
struct PerLeafWire {
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  std::vector<int64_t> tags;
  std::vector<int> c10d_tags;
  std::vector<MessageCheck> checks;  // the shm key check of each leaf
};
/// `sorted`'s wire for init_tag / pseudo_rand, from its cache (SortedLeaves::default_wire, or
/// the last used). Valid while `sorted` lives and `keep` holds what it was given.
const PerLeafWire& wire_of(const SortedLeaves& sorted, int64_t init_tag, bool pseudo_rand,
                           std::shared_ptr<const PerLeafWire>& keep);

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
  // (A contiguous tensor cannot overlap, and only a mapped one can be read-only: the common
  // leaf costs two inline checks, not a call into ATen and a copy of the mapping's file name.)
  if (!t.is_contiguous() && at::has_internal_overlap(t) == at::MemOverlap::Yes) {
    throw TypeError(what() + ": its elements overlap in memory (shape " + detail::shape_str(t.sizes()) + ", strides " +
                    detail::shape_str(t.strides()) + ", an expanded tensor?), so it cannot receive in place; give the "
                    "receiver a tensor of its own (clone() or contiguous()); nothing was received");
  }
  if (!MemoryMappedTensor::is_mapped(t)) return;
  if (const auto info = MemoryMappedTensor::info(t); info && !info->writable) {
    throw MemmapError(what() + ": it maps '" + info->filename +
                      "' read-only (MemmapMode::kReadOnly), so received bytes would never reach the file; map it "
                      "with MemmapMode::kReadWrite or receive into another tensor; nothing was received");
  }
}

// ---------------------------------------------------------------------------------------------
// The protocols (one file each), called by TensorDict's methods once the peer is resolved.

/// How a protocol's entry point completes: as its options say (isend's return_early, irecv's
/// return_premature), or waited whatever they say (send, recv: no copy of the options per call).
enum class Completion { kAsOptions, kWaited };

Transfer isend_per_leaf(const TensorDict& td, const Peer& p, const SendOptions& o,
                        Completion c = Completion::kAsOptions);
/// `last_tag`, when given, is set to the transfer's last tag (what recv returns).
Transfer irecv_per_leaf(const TensorDict& td, const Peer& p, const RecvOptions& o, int64_t* last_tag = nullptr,
                        Completion c = Completion::kAsOptions);
/// The same for a lazy stack: its members' leaves in order, the tags running on.
Transfer isend_per_leaf(const LazyStackedTensorDict& stack, const Peer& p, const SendOptions& o,
                        Completion c = Completion::kAsOptions);
Transfer irecv_per_leaf(const LazyStackedTensorDict& stack, const Peer& p, const RecvOptions& o,
                        int64_t* last_tag = nullptr, Completion c = Completion::kAsOptions);
Transfer isend_consolidated(const TensorDict& td, const Peer& p, const SendOptions& o,
                            Completion c = Completion::kAsOptions);
Transfer irecv_consolidated(const TensorDict& td, const Peer& p, const RecvOptions& o,
                            Completion c = Completion::kAsOptions);
inline constexpr int kConsolidatedTag = 0;  // tensordict's consolidated transfers use tag 0
TensorDict recv_view(const TensorDict& td, const Peer& p, const RecvOptions& o);  // loans.cpp

}  // namespace tdshm::detail
