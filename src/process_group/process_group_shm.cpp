// ProcessGroupShm and its Work: c10d wrappers around the shared-memory engine.

#include <tdshm/process_group.h>

#include "common/recycle.h"
#include "process_group/batch_work.h"
#include "process_group/collective_queue.h"
#include "process_group/shm_group_seam.h"
#include "process_group/tensor_checks.h"
#include "shm/engine/engine.h"

#include <ATen/core/ivalue.h>
#include <c10/util/SmallVector.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <span>

namespace tdshm {

using detail::OpList;
using detail::ShmEngine;
using detail::ShmOp;

namespace {

const at::Tensor& single_tensor(const std::vector<at::Tensor>& tensors, const char* op) {
  detail::check_cpu_dense(detail::one_tensor(tensors, op), op);
  return tensors[0];
}

/// A c10d Work over one or more engine ops; completes when all of them are done. A batch's
/// (ShmGroupSeam's send_batch, recv_batch, recv_views) answers for each of its messages too (batch_work.h).
class ShmWork final : public detail::BatchWork {
 public:
  // One per receive: its block is recycled by the thread (common/recycle.h).
  static void* operator new(size_t bytes) {
    TORCH_INTERNAL_ASSERT(bytes == sizeof(ShmWork));
    return detail::RecycledBlocks<sizeof(ShmWork)>::get();
  }
  static void operator delete(void* p) noexcept { detail::RecycledBlocks<sizeof(ShmWork)>::put(p); }

  ShmWork(std::shared_ptr<ShmEngine> engine, OpList&& ops, c10d::OpType type, at::Tensor output = {})
      : detail::BatchWork(engine->rank(), type),
        engine_(std::move(engine)),
        ops_(std::move(ops)),
        output_(std::move(output)) {}
  /// A single message's Work (none pending when `op` is null: it completed as it was posted). The
  /// op is moved straight into ops_: an initializer list would copy the shared_ptr, and a list
  /// built outside would be moved once more.
  ShmWork(std::shared_ptr<ShmEngine> engine, std::shared_ptr<ShmOp>&& op, c10d::OpType type)
      : detail::BatchWork(engine->rank(), type), engine_(std::move(engine)) {
    if (op) ops_.push_back(std::move(op));
  }
  /// A receive from `source` into `tensor` that completed as it was posted (ShmEngine::post_recv).
  ShmWork(std::shared_ptr<ShmEngine> engine, const at::Tensor& tensor, int source)
      : detail::BatchWork(engine->rank(), c10d::OpType::RECV),
        engine_(std::move(engine)),
        output_(tensor),
        source_(source) {}

  /// Makes this Work, which nobody else holds (RecvWorkPool), a fresh receive: a batch over
  /// `ops` (one per message), or one receive over its op, or, when that receive has no op, into
  /// `tensor` from `source`, completed as it was posted.
  void reuse_as_recv(OpList&& ops, const at::Tensor& tensor, int source, bool batch) {
    ops_ = std::move(ops);  // the previous receive's ops and tensors are released here, off the wait's path
    const bool landed = !batch && ops_.empty();
    output_ = landed ? tensor : at::Tensor();
    source_ = landed ? source : -1;
    batch_ = batch;
    batch_size_ = batch ? ops_.size() : 0;
    positions_.clear();
    future_.reset();  // (no lock: nobody else can reach this Work)
  }

  /// A batch of `size` messages whose pending ones are ops_ (op j is message positions[j], or
  /// message j when `positions` is empty; the others completed when they were posted).
  void set_batch(size_t size, c10::SmallVector<uint32_t, 4> positions) {
    batch_ = true;
    batch_size_ = size;
    positions_ = std::move(positions);
  }

  bool isCompleted() override {
    if (!all_done()) engine_->poll();
    return all_done();
  }

  bool isSuccess() const override { return all_done() && !first_error(); }

  std::exception_ptr exception() const override { return all_done() ? first_error() : nullptr; }

  int sourceRank() const override {
    if (source_ >= 0) return source_;  // a receive that completed as it was posted
    TORCH_CHECK(ops_.size() == 1 && ops_[0]->kind == ShmOp::Kind::kRecv && all_done(),
                "sourceRank() is only valid for a completed recv");
    return ops_[0]->as_recv().source;
  }

  std::vector<at::Tensor> result() override {
    if (output_.defined()) return {output_};
    // A recv's result is its tensor, which its op holds already (no second reference to keep).
    if (!batch_ && ops_.size() == 1 && ops_[0]->kind == ShmOp::Kind::kRecv) return {ops_[0]->user};
    // A batch of receives whose ops are all there (recv_batch, recv_views): their tensors.
    if (batch_ && positions_.empty() && ops_.size() == batch_size_ &&
        std::all_of(ops_.begin(), ops_.end(), [](const auto& op) { return op->kind == ShmOp::Kind::kRecv; })) {
      std::vector<at::Tensor> out;
      out.reserve(ops_.size());
      for (const auto& op : ops_) out.push_back(op->user);
      return out;
    }
    return {};
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (all_done()) {
      if (auto e = first_error()) std::rethrow_exception(e);
      return true;
    }
    const auto limit = timeout == kNoTimeout ? engine_->options().timeout : timeout;
    // A batch stops at its first failure: its other messages may never come (messages()).
    engine_->wait(ops_, std::chrono::steady_clock::now() + limit, /*stop_on_error=*/batch_);
    if (auto e = first_error()) std::rethrow_exception(e);
    return true;
  }

  bool wait_keeping(std::chrono::milliseconds timeout) override {
    if (!all_done()) {
      engine_->wait(ops_, std::chrono::steady_clock::now() + timeout, /*stop_on_error=*/batch_,
                    /*keep_at_deadline=*/true);
    }
    if (auto e = first_error()) std::rethrow_exception(e);
    return all_done() || (batch_ && first_error() != nullptr);
  }

  std::vector<c10::intrusive_ptr<c10d::Work>> messages() const override {
    if (!batch_) throw TypeError("messages(): the Work is not a batch's");
    std::vector<c10::intrusive_ptr<c10d::Work>> out(batch_size_);
    for (size_t j = 0; j < ops_.size(); ++j) {
      const auto& op = ops_[j];
      const bool recv = op->kind == ShmOp::Kind::kRecv;
      // (A view's tensor is made when its message lands: its Work reads it from the op then.)
      out[positions_.empty() ? j : positions_[j]] =
          c10::make_intrusive<ShmWork>(engine_, OpList{op}, recv ? c10d::OpType::RECV : c10d::OpType::SEND,
                                       recv && !op->as_recv().view ? op->user : at::Tensor{});
    }
    for (auto& w : out) {
      if (!w) w = c10::make_intrusive<ShmWork>(engine_, OpList{}, opType_);  // completed when posted
    }
    return out;
  }

  void abort() override {
    engine_->cancel(
        ops_, std::make_exception_ptr(TransportError("the operation was aborted (Work::abort) before it completed")));
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard lk(future_mu_);
    if (future_) return future_;
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    auto future = future_;
    std::vector<std::shared_ptr<ShmOp>> ops(ops_.begin(), ops_.end());
    auto outputs = result();
    engine_->watch(ops, [future, ops, outputs] {
      for (const auto& op : ops) {
        if (!op->done.load(std::memory_order_acquire)) {
          future->setError(std::make_exception_ptr(Error("the process group was destroyed")));
          return;
        }
        if (op->error) {
          future->setError(op->error);
          return;
        }
      }
      future->markCompleted(c10::IValue(outputs));
    });
    return future_;
  }

  // ---- One message of a batch (BatchWork) ----
  bool message_completed(size_t i) override {
    const ShmOp* op = op_of(i);
    if (!done(op)) engine_->poll();
    return done(op);
  }
  bool message_succeeded(size_t i) const override {
    const ShmOp* op = op_of(i);
    return done(op) && (op == nullptr || !op->error);
  }
  std::exception_ptr message_error(size_t i) const override {
    const ShmOp* op = op_of(i);
    return done(op) && op != nullptr ? op->error : nullptr;
  }
  void wait_message(size_t i, std::chrono::milliseconds timeout) override {
    if (const std::shared_ptr<ShmOp>* op = message(i); op != nullptr && !done(op->get())) {
      const auto limit = timeout == kNoTimeout ? engine_->options().timeout : timeout;
      engine_->wait(std::span(op, 1), std::chrono::steady_clock::now() + limit, /*stop_on_error=*/false);
    }
    if (auto e = message_error(i)) std::rethrow_exception(e);
  }
  void abort_message(size_t i) override {
    if (const std::shared_ptr<ShmOp>* op = message(i); op != nullptr) {
      engine_->cancel(
          std::span(op, 1),
          std::make_exception_ptr(TransportError("the operation was aborted (Work::abort) before it completed")));
    }
  }
  uint16_t message_sender_leaves(size_t i) const override {
    const ShmOp* op = op_of(i);
    return done(op) && op != nullptr && op->kind == ShmOp::Kind::kRecv ? op->as_recv().sender_leaves : 0;
  }

 private:
  /// Message j of a batch: its op, or null when it completed as it was posted.
  const std::shared_ptr<ShmOp>* message(size_t j) const {
    if (!batch_ || j >= batch_size_) throw TypeError("shm batch: the Work is not a batch of that many messages");
    if (positions_.empty()) return &ops_[j];  // op j is message j
    const auto it = std::find(positions_.begin(), positions_.end(), static_cast<uint32_t>(j));
    return it == positions_.end() ? nullptr : &ops_[static_cast<size_t>(it - positions_.begin())];
  }
  const ShmOp* op_of(size_t j) const {
    const std::shared_ptr<ShmOp>* op = message(j);
    return op != nullptr ? op->get() : nullptr;
  }
  // A message that completed as it was posted has no op.
  static bool done(const ShmOp* op) { return op == nullptr || op->done.load(std::memory_order_acquire); }
  bool all_done() const {
    for (const auto& op : ops_) {
      if (!op->done.load(std::memory_order_acquire)) return false;  // pairs with ChannelCore::finish
    }
    return true;
  }
  std::exception_ptr first_error() const {
    for (const auto& op : ops_) {
      if (op->done.load(std::memory_order_acquire) && op->error) return op->error;
    }
    return nullptr;
  }

  std::shared_ptr<ShmEngine> engine_;
  OpList ops_;
  at::Tensor output_;   // what result() returns: the received or broadcast tensor
  int source_ = -1;     // a receive that completed as it was posted: its source (it has no op)
  bool batch_ = false;  // a batch (shm_group_seam.h): wait() stops at the first failure
  size_t batch_size_ = 0;
  c10::SmallVector<uint32_t, 4> positions_;
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

c10::intrusive_ptr<c10d::Work> make_work(const std::shared_ptr<ShmEngine>& engine, OpList&& ops, c10d::OpType type,
                                         at::Tensor output = {}) {
  return c10::make_intrusive<ShmWork>(engine, std::move(ops), type, std::move(output));
}

c10::intrusive_ptr<c10d::Work> make_work(const std::shared_ptr<ShmEngine>& engine, std::shared_ptr<ShmOp>&& op,
                                         c10d::OpType type) {
  return c10::make_intrusive<ShmWork>(engine, std::move(op), type);
}

}  // namespace

namespace detail {

// The Works of small receives, kept for reuse: a ping-pong's receiver would otherwise build and
// destroy a c10d Work per message (~500 instructions), its destruction right after the wait, on
// the path to the next send. A Work is reused only once the pool's reference is the last one
// (use_count 1: the caller dropped its own, and that release pairs with the acquire load), and
// only for tensors of up to kMaxBytes, because a kept Work keeps its last tensor alive until it
// is reused. recv() may run on several threads at once: one of them at a time looks (claimed_);
// the others make a Work of their own.
class RecvWorkPool {
 public:
  static constexpr size_t kSize = 4;  // receives posted ahead (irecv) each hold one
  static constexpr uint64_t kMaxBytes = uint64_t{64} << 10;

  /// One receive's Work: over `op`, or (op null) into `tensor` from `source`, complete.
  c10::intrusive_ptr<BatchWork> take(const std::shared_ptr<ShmEngine>& engine, std::shared_ptr<ShmOp>&& op,
                                     const at::Tensor& tensor, int source) {
    OpList ops;
    if (op) ops.push_back(std::move(op));
    return take(engine, std::move(ops), tensor, source, /*batch=*/false, tensor.nbytes());
  }
  /// A batch's Work over `ops`, one per message (recv_batch), receiving `bytes` in all.
  c10::intrusive_ptr<BatchWork> take_batch(const std::shared_ptr<ShmEngine>& engine, OpList&& ops, uint64_t bytes) {
    return take(engine, std::move(ops), at::Tensor(), -1, /*batch=*/true, bytes);
  }

 private:
  c10::intrusive_ptr<BatchWork> take(const std::shared_ptr<ShmEngine>& engine, OpList&& ops, const at::Tensor& tensor,
                                     int source, bool batch, uint64_t bytes) {
    if (bytes <= kMaxBytes && !claimed_.exchange(true, std::memory_order_acquire)) {
      struct Unclaim {
        std::atomic<bool>& flag;
        ~Unclaim() { flag.store(false, std::memory_order_release); }
      } unclaim{claimed_};
      for (auto& w : works_) {
        if (w && w.use_count() == 1) {
          static_cast<ShmWork*>(w.get())->reuse_as_recv(std::move(ops), tensor, source,
                                                        batch);  // only ShmWorks are kept
          return w;
        }
      }
      auto fresh = make(engine, std::move(ops), tensor, source, batch);
      works_[next_] = fresh;  // the oldest kept Work goes (or stays with its caller)
      next_ = (next_ + 1) % kSize;
      return fresh;
    }
    return make(engine, std::move(ops), tensor, source, batch);
  }
  static c10::intrusive_ptr<BatchWork> make(const std::shared_ptr<ShmEngine>& engine, OpList&& ops,
                                            const at::Tensor& tensor, int source, bool batch) {
    if (!batch && ops.empty()) return c10::make_intrusive<ShmWork>(engine, tensor, source);
    const size_t n = ops.size();
    auto work = c10::make_intrusive<ShmWork>(engine, std::move(ops), c10d::OpType::RECV);
    if (batch) work->set_batch(n, {});  // op i is message i
    return work;
  }

  std::atomic<bool> claimed_{false};
  std::array<c10::intrusive_ptr<BatchWork>, kSize> works_;
  size_t next_ = 0;
};

}  // namespace detail

ProcessGroupShm::ProcessGroupShm(const std::string& name, int rank, int size, ShmOptions options)
    : c10d::ProcessGroup(rank, size) {
  validate_segment_name(name);
  if (size < 1 || rank < 0 || rank >= size) {
    throw SegmentError("rank " + std::to_string(rank) + " and world size " + std::to_string(size) +
                       " do not make a group: need 0 <= rank < size");
  }
  engine_ = std::make_shared<ShmEngine>(name, rank, size, options);
  sent_ = make_work(engine_, OpList{}, c10d::OpType::SEND);
  recv_works_ = std::make_unique<detail::RecvWorkPool>();
  collectives_ = std::make_shared<detail::CollectiveQueue>(name, engine_->steps().mutex());
  engine_->add_wait_hook(collectives_);
  init();
}

ProcessGroupShm::~ProcessGroupShm() { shutdown(); }

void ProcessGroupShm::shutdown(std::exception_ptr reason) noexcept {
  // The engine first: a collective that runs fails at once; those not started fail in close().
  if (engine_) engine_->shutdown(reason);
  if (collectives_) {
    collectives_->close(
        reason ? reason : std::make_exception_ptr(Error("the process group was destroyed before this collective ran")));
  }
}

const std::string& ProcessGroupShm::segment_name() const noexcept { return engine_->name(); }
const ShmOptions& ProcessGroupShm::options() const noexcept { return engine_->options(); }

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return detail::ShmGroupSeam::send(*this, detail::one_tensor(tensors, "send"), dstRank, tag, {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return detail::ShmGroupSeam::recv(*this, detail::one_tensor(tensors, "recv"), srcRank, tag, {});
}

bool release_view(const at::Tensor& view) noexcept { return shm::release_view(view); }

at::Tensor ProcessGroupShm::loan(at::IntArrayRef sizes, at::ScalarType dtype) {
  return engine_->loan(sizes, dtype, std::chrono::steady_clock::now() + engine_->options().timeout);
}

at::Tensor ProcessGroupShm::try_loan(at::IntArrayRef sizes, at::ScalarType dtype) {
  return engine_->try_loan(sizes, dtype);
}

bool ProcessGroupShm::is_loan(const at::Tensor& t) const { return engine_->is_loan(t); }

bool ProcessGroupShm::runs_tdshm_transfers(int peer) const noexcept { return engine_->runs_tdshm_transfers(peer); }
bool ProcessGroupShm::peer_died(int peer) const { return engine_->rank_died(peer); }

bool ProcessGroupShm::memmap_by_reference_with(int peer) const noexcept {
  return engine_->memmap_by_reference_with(peer);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::irecv_view(int srcRank, int tag) {
  TORCH_CHECK(srcRank >= 0, "ProcessGroupShm::irecv_view: source rank must be >= 0");
  return make_work(engine_, engine_->post_recv_view(srcRank, tag), c10d::OpType::RECV);
}

at::Tensor ProcessGroupShm::recv_view(int srcRank, int tag) {
  auto work = irecv_view(srcRank, tag);
  work->wait();
  return work->result().at(0);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::irecv_views(int srcRank, int tag, size_t n) {
  return detail::ShmGroupSeam::recv_views(*this, srcRank, std::vector<int>(n, tag), std::vector<MessageCheck>(n));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const at::Tensor& t = single_tensor(tensors, "recvAnysource");
  return make_work(engine_, engine_->post_recv(t, -1, tag, /*control=*/false), c10d::OpType::RECVANYSOURCE);
}

}  // namespace tdshm

namespace tdshm::detail {

namespace {

// Checks a batch's arguments as single_tensor does each tensor (without building a vector per
// tensor: this runs for every leaf of every per-leaf transfer); the tags as c10d's int.
void check_batch(std::span<const at::Tensor> tensors, const std::vector<int>& tags,
                 const std::vector<MessageCheck>& checks, const char* op) {
  TORCH_CHECK(tags.size() == tensors.size() && checks.size() == tensors.size(), "ProcessGroupShm::", op, ": ",
              tensors.size(), " tensors, ", tags.size(), " tags and ", checks.size(), " checks");
  for (const auto& t : tensors) check_cpu_dense(t, op);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ShmGroupSeam::send(ProcessGroupShm& pg, const at::Tensor& t, int dst, int tag,
                                                  MessageCheck check) {
  check_cpu_dense(t, "send");
  auto op = pg.engine_->post_send(t, dst, tag, /*control=*/false, check);
  if (!op) return pg.sent_;
  return make_work(pg.engine_, std::move(op), c10d::OpType::SEND);
}

c10::intrusive_ptr<c10d::Work> ShmGroupSeam::recv(ProcessGroupShm& pg, const at::Tensor& t, int src, int tag,
                                                  MessageCheck check) {
  check_cpu_dense(t, "recv");
  TORCH_CHECK(src >= 0, "ProcessGroupShm::recv: source rank must be >= 0 (use recvAnysource)");
  auto op = pg.engine_->post_recv(t, src, tag, /*control=*/false, check);
  return pg.recv_works_->take(pg.engine_, std::move(op), t, src);  // (op null: its message was waiting)
}

c10::intrusive_ptr<BatchWork> ShmGroupSeam::send_batch(ProcessGroupShm& pg, std::span<const at::Tensor> tensors,
                                                       int dst, const std::vector<int>& tags,
                                                       const std::vector<MessageCheck>& checks) {
  check_batch(tensors, tags, checks, "send_batch");
  const c10::SmallVector<int64_t, 8> wide(tags.begin(), tags.end());
  OpList ops = pg.engine_->post_sends(tensors, dst, wide, checks);
  if (ops.empty()) return {};  // every message is in the segment
  OpList pending;
  c10::SmallVector<uint32_t, 4> positions;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i]) continue;
    pending.push_back(std::move(ops[i]));
    positions.push_back(static_cast<uint32_t>(i));
  }
  auto work = c10::make_intrusive<ShmWork>(pg.engine_, std::move(pending), c10d::OpType::SEND);
  work->set_batch(tensors.size(), std::move(positions));
  return work;
}

c10::intrusive_ptr<BatchWork> ShmGroupSeam::recv_batch(ProcessGroupShm& pg, std::span<const at::Tensor> tensors,
                                                       int src, const std::vector<int>& tags,
                                                       const std::vector<MessageCheck>& checks) {
  check_batch(tensors, tags, checks, "recv_batch");
  TORCH_CHECK(src >= 0, "ProcessGroupShm::recv_batch: source rank must be >= 0");
  const c10::SmallVector<int64_t, 8> wide(tags.begin(), tags.end());
  OpList ops = pg.engine_->post_recvs(tensors, src, wide, checks);
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.nbytes();
  return pg.recv_works_->take_batch(pg.engine_, std::move(ops), bytes);
}

c10::intrusive_ptr<BatchWork> ShmGroupSeam::recv_views(ProcessGroupShm& pg, int src, const std::vector<int>& tags,
                                                       const std::vector<MessageCheck>& checks) {
  TORCH_CHECK(src >= 0, "ProcessGroupShm::irecv_views: source rank must be >= 0");
  TORCH_CHECK(tags.size() == checks.size(), "ProcessGroupShm::irecv_views: ", tags.size(), " tags and ", checks.size(),
              " checks");
  const c10::SmallVector<int64_t, 8> wide(tags.begin(), tags.end());
  auto work =
      c10::make_intrusive<ShmWork>(pg.engine_, pg.engine_->post_recv_views(src, wide, checks), c10d::OpType::RECV);
  work->set_batch(tags.size(), {});
  return work;
}

void ShmGroupSeam::unlink_segment_name(ProcessGroupShm& pg) noexcept {
  if (pg.engine_) pg.engine_->unlink_segment_name();
}

void ShmGroupSeam::add_wait_hook(ProcessGroupShm& pg, std::shared_ptr<shm::WaitHook> hook) {
  pg.engine_->add_wait_hook(std::move(hook));
}

}  // namespace tdshm::detail
