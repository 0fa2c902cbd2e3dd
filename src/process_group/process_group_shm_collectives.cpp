// ProcessGroupShm's collectives: c10d's arguments checked at the call, then issued to the group's
// queue (process_group/collective_queue.h) as a function that turns them into byte buffers and runs over the
// segment's collective windows (shm/engine/collectives.h). The Work returns at once; the collective runs
// in the thread that waits for it, or on the queue's helper thread; its error is raised by wait().

#include <tdshm/process_group.h>

#include "process_group/collective_queue.h"
#include "process_group/queued_work.h"
#include "process_group/tensor_checks.h"
#include "shm/engine/collectives.h"
#include "shm/engine/engine.h"

#include <ATen/core/ivalue.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>

#include <functional>
#include <mutex>
#include <optional>
#include <type_traits>

namespace tdshm {

using detail::ReduceKind;

namespace {

using detail::check_collective_tensor;
using detail::check_list;
using detail::check_root;
using detail::check_root_list;

const at::Tensor& only_tensor(const std::vector<at::Tensor>& tensors, const char* op) {
  return detail::one_collective_tensor(tensors, op);
}

ReduceKind reduce_kind(const c10d::ReduceOp& op, at::ScalarType dtype, const char* name) {
  ReduceKind k;
  switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
    case c10d::ReduceOp::SUM: k = ReduceKind::kSum; break;
    case c10d::ReduceOp::AVG: k = ReduceKind::kAvg; break;
    case c10d::ReduceOp::PRODUCT: k = ReduceKind::kProduct; break;
    case c10d::ReduceOp::MIN: k = ReduceKind::kMin; break;
    case c10d::ReduceOp::MAX: k = ReduceKind::kMax; break;
    case c10d::ReduceOp::BAND: k = ReduceKind::kBand; break;
    case c10d::ReduceOp::BOR: k = ReduceKind::kBor; break;
    case c10d::ReduceOp::BXOR: k = ReduceKind::kBxor; break;
    default:
      throw TypeError(std::string("ProcessGroupShm::") + name +
                      ": this reduce op is not supported (PREMUL_SUM is NCCL's); use SUM, AVG, PRODUCT, MIN, MAX, "
                      "BAND, BOR or BXOR");
  }
  if (std::string problem = detail::reduce_problem(k, dtype); !problem.empty()) {
    throw TypeError(std::string("ProcessGroupShm::") + name + ": " + problem);
  }
  return k;
}

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
uint64_t nbytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// A contiguous tensor with t's values (t itself when it is contiguous); `back` copies it into t.
struct Dense {
  at::Tensor t;
  at::Tensor staged;
  explicit Dense(const at::Tensor& user, bool copy_in = true) : t(user) {
    if (!user.is_contiguous()) {
      staged = copy_in ? user.contiguous() : at::empty(user.sizes(), user.options());
    }
  }
  const at::Tensor& dense() const { return staged.defined() ? staged : t; }
  void back() const {
    if (staged.defined()) t.copy_(staged);
  }
};

}  // namespace

// Issues `body` as the group's next collective (it runs in issue order, under the steps' mutex,
// against the deadline of `timeout` from when it starts: the group's when unset) and returns its
// Work at once.
template <class Body>
c10::intrusive_ptr<c10d::Work> ProcessGroupShm::run_collective(c10d::OpType type, std::chrono::milliseconds timeout,
                                                               Body&& body, std::vector<at::Tensor> outputs) {
  const auto limit = timeout == c10d::kUnsetTimeout ? engine_->options().timeout : timeout;
  auto work = c10::make_intrusive<detail::QueuedWorkOf<std::decay_t<Body>>>(
      getRank(), type, collectives_, limit, std::move(outputs), std::forward<Body>(body), "ProcessGroupShm");
  collectives_->push(*work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = only_tensor(tensors, "broadcast");
  check_root(opts.rootRank, getSize(), "broadcast");
  TORCH_CHECK(opts.rootTensor == 0, "ProcessGroupShm::broadcast: rootTensor must be 0");
  const int root = static_cast<int>(opts.rootRank);
  return run_collective(
      c10d::OpType::BROADCAST, opts.timeout,
      [this, t, root](detail::Deadline d) {
        const Dense x(t, getRank() == root);
        detail::shm_broadcast(*engine_, bytes_of(x.dense()), nbytes(t), root, d);
        x.back();
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::barrier(const c10d::BarrierOptions& opts) {
  return run_collective(
      c10d::OpType::BARRIER, opts.timeout, [this](detail::Deadline d) { detail::shm_barrier(*engine_, d); }, {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = only_tensor(tensors, "allreduce");
  const ReduceKind op = reduce_kind(opts.reduceOp, t.scalar_type(), "allreduce");
  return run_collective(
      c10d::OpType::ALLREDUCE, opts.timeout,
      [this, t, op](detail::Deadline d) {
        const Dense x(t);
        detail::shm_reduce(*engine_, bytes_of(x.dense()), static_cast<uint64_t>(t.numel()), t.scalar_type(), op, -1, d);
        x.back();
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "ProcessGroupShm::allreduce_coalesced: no tensors");
  for (const auto& t : tensors) {
    check_collective_tensor(t, "allreduce_coalesced");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                "ProcessGroupShm::allreduce_coalesced: all tensors must have one dtype, got ", tensors[0].scalar_type(),
                " and ", t.scalar_type());
  }
  const at::ScalarType dtype = tensors[0].scalar_type();
  const ReduceKind op = reduce_kind(opts.reduceOp, dtype, "allreduce_coalesced");
  return run_collective(
      c10d::OpType::ALLREDUCE_COALESCED, opts.timeout,
      [this, tensors, dtype, op](detail::Deadline d) {
        int64_t total = 0;
        for (const auto& t : tensors) total += t.numel();
        at::Tensor flat = at::empty({total}, tensors[0].options().memory_format(c10::nullopt));
        int64_t at_el = 0;
        for (const auto& t : tensors) {
          flat.narrow(0, at_el, t.numel()).copy_(t.reshape({-1}));
          at_el += t.numel();
        }
        detail::shm_reduce(*engine_, bytes_of(flat), static_cast<uint64_t>(total), dtype, op, -1, d);
        at_el = 0;
        for (const auto& t : tensors) {
          t.copy_(flat.narrow(0, at_el, t.numel()).view(t.sizes()));
          at_el += t.numel();
        }
      },
      tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const at::Tensor& t = only_tensor(tensors, "reduce");
  check_root(opts.rootRank, getSize(), "reduce");
  TORCH_CHECK(opts.rootTensor == 0, "ProcessGroupShm::reduce: rootTensor must be 0");
  const ReduceKind op = reduce_kind(opts.reduceOp, t.scalar_type(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  return run_collective(
      c10d::OpType::REDUCE, opts.timeout,
      [this, t, op, root](detail::Deadline d) {
        const Dense x(t);
        detail::shm_reduce(*engine_, bytes_of(x.dense()), static_cast<uint64_t>(t.numel()), t.scalar_type(), op, root, d);
        if (getRank() == root) x.back();
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = only_tensor(inputs, "allgather");
  check_list(outputs, getSize(), in, "allgather", "output");
  return run_collective(
      c10d::OpType::ALLGATHER, opts.timeout,
      [this, in, outputs = outputs[0]](detail::Deadline d) {
        const Dense x(in);
        std::vector<Dense> outs;
        std::vector<uint8_t*> ptrs;
        for (const auto& o : outputs) {
          outs.emplace_back(o, false);
          ptrs.push_back(bytes_of(outs.back().dense()));
        }
        detail::shm_gather(*engine_, bytes_of(x.dense()), nbytes(in), ptrs, -1, d);
        for (const auto& o : outs) o.back();
      },
      outputs[0]);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  check_collective_tensor(input, "_allgather_base");
  check_collective_tensor(output, "_allgather_base");
  TORCH_CHECK(output.scalar_type() == input.scalar_type() && output.numel() == input.numel() * getSize(),
              "ProcessGroupShm::_allgather_base: the output must have the input's dtype and world size (", getSize(),
              ") times its elements");
  return run_collective(
      c10d::OpType::_ALLGATHER_BASE, opts.timeout,
      [this, input, output](detail::Deadline d) {
        const Dense x(input);
        const Dense out(output, false);
        std::vector<uint8_t*> ptrs;
        for (int r = 0; r < getSize(); ++r) ptrs.push_back(bytes_of(out.dense()) + static_cast<uint64_t>(r) * nbytes(input));
        detail::shm_gather(*engine_, bytes_of(x.dense()), nbytes(input), ptrs, -1, d);
        out.back();
      },
      {output});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const at::Tensor& in = only_tensor(inputs, "gather");
  check_root(opts.rootRank, getSize(), "gather");
  const int root = static_cast<int>(opts.rootRank);
  check_root_list(outputs, getRank() == root, getSize(), in, "gather", "output");
  return run_collective(
      c10d::OpType::GATHER, opts.timeout,
      [this, in, root, outputs](detail::Deadline d) {
        const Dense x(in);
        std::vector<Dense> outs;
        std::vector<uint8_t*> ptrs;
        if (getRank() == root) {
          for (const auto& o : outputs[0]) {
            outs.emplace_back(o, false);
            ptrs.push_back(bytes_of(outs.back().dense()));
          }
        }
        detail::shm_gather(*engine_, bytes_of(x.dense()), nbytes(in), ptrs, root, d);
        for (const auto& o : outs) o.back();
      },
      getRank() == root ? outputs[0] : std::vector<at::Tensor>{});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  const at::Tensor& out = only_tensor(outputs, "scatter");
  check_root(opts.rootRank, getSize(), "scatter");
  const int root = static_cast<int>(opts.rootRank);
  check_root_list(inputs, getRank() == root, getSize(), out, "scatter", "input");
  return run_collective(
      c10d::OpType::SCATTER, opts.timeout,
      [this, out, root, inputs](detail::Deadline d) {
        std::vector<at::Tensor> dense;
        std::vector<const uint8_t*> ptrs;
        if (getRank() == root) {
          for (const auto& i : inputs[0]) {
            dense.push_back(i.contiguous());
            ptrs.push_back(bytes_of(dense.back()));
          }
        }
        const Dense o(out, false);
        detail::shm_scatter(*engine_, ptrs, bytes_of(o.dense()), nbytes(out), root, d);
        o.back();
      },
      {out});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = only_tensor(outputs, "reduce_scatter");
  check_list(inputs, getSize(), out, "reduce_scatter", "input");
  const ReduceKind op = reduce_kind(opts.reduceOp, out.scalar_type(), "reduce_scatter");
  return run_collective(
      c10d::OpType::REDUCE_SCATTER, opts.timeout,
      [this, out, inputs = inputs[0], op](detail::Deadline d) {
        std::vector<at::Tensor> dense;
        std::vector<const uint8_t*> ptrs;
        for (const auto& i : inputs) {
          dense.push_back(i.contiguous());
          ptrs.push_back(bytes_of(dense.back()));
        }
        const Dense o(out, false);
        detail::shm_reduce_scatter(*engine_, ptrs, bytes_of(o.dense()), static_cast<uint64_t>(out.numel()),
                                   out.scalar_type(), op, d);
        o.back();
      },
      {out});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::ReduceScatterOptions& opts) {
  // torch's reduce_scatter_tensor: rank r's share of the input is its r-th block of
  // output.numel() elements, which is reduce_scatter over views of one buffer.
  check_collective_tensor(input, "_reduce_scatter_base");
  check_collective_tensor(output, "_reduce_scatter_base");
  TORCH_CHECK(output.scalar_type() == input.scalar_type() && input.numel() == output.numel() * getSize(),
              "ProcessGroupShm::_reduce_scatter_base: the input must have the output's dtype and world size (",
              getSize(), ") times its elements");
  const ReduceKind op = reduce_kind(opts.reduceOp, output.scalar_type(), "_reduce_scatter_base");
  return run_collective(
      c10d::OpType::_REDUCE_SCATTER_BASE, opts.timeout,
      [this, input, output, op](detail::Deadline d) {
        const Dense x(input);
        const Dense o(output, false);
        std::vector<const uint8_t*> ptrs;
        for (int r = 0; r < getSize(); ++r) ptrs.push_back(bytes_of(x.dense()) + static_cast<uint64_t>(r) * nbytes(output));
        detail::shm_reduce_scatter(*engine_, ptrs, bytes_of(o.dense()), static_cast<uint64_t>(output.numel()),
                                   output.scalar_type(), op, d);
        o.back();
      },
      {output});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& outputSplitSizes,
                                                              std::vector<int64_t>& inputSplitSizes,
                                                              const c10d::AllToAllOptions& opts) {
  check_collective_tensor(input, "alltoall_base");
  check_collective_tensor(output, "alltoall_base");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "ProcessGroupShm::alltoall_base: input and output dtypes differ (",
              input.scalar_type(), ", ", output.scalar_type(), ")");
  const auto w = static_cast<size_t>(getSize());
  // Split sizes count rows of dim 0; empty: equal splits.
  auto bytes_per_peer = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const uint64_t row_bytes = rows == 0 ? 0 : nbytes(t) / static_cast<uint64_t>(rows);
    std::vector<uint64_t> out(w);
    if (splits.empty()) {
      TORCH_CHECK(rows % static_cast<int64_t>(w) == 0, "ProcessGroupShm::alltoall_base: the ", what, "'s ", rows,
                  " rows do not split evenly among ", w, " ranks; pass split sizes");
      for (auto& b : out) b = static_cast<uint64_t>(rows) / w * row_bytes;
    } else {
      TORCH_CHECK(splits.size() == w, "ProcessGroupShm::alltoall_base: ", w, " ", what, " split sizes expected, got ",
                  splits.size());
      int64_t sum = 0;
      for (size_t r = 0; r < w; ++r) {
        TORCH_CHECK(splits[r] >= 0, "ProcessGroupShm::alltoall_base: negative ", what, " split size");
        sum += splits[r];
        out[r] = static_cast<uint64_t>(splits[r]) * row_bytes;
      }
      TORCH_CHECK(sum == rows, "ProcessGroupShm::alltoall_base: the ", what, " split sizes add up to ", sum,
                  " rows, the tensor has ", rows);
    }
    return out;
  };
  const std::vector<uint64_t> send = bytes_per_peer(input, inputSplitSizes, "input");
  const std::vector<uint64_t> recv = bytes_per_peer(output, outputSplitSizes, "output");
  return run_collective(
      c10d::OpType::ALLTOALL_BASE, opts.timeout,
      [this, input, output, send, recv](detail::Deadline d) {
        const Dense x(input);
        const Dense o(output, false);
        detail::shm_alltoall(*engine_, bytes_of(x.dense()), send, bytes_of(o.dense()), recv, d);
        o.back();
      },
      {output});
}

}  // namespace tdshm
