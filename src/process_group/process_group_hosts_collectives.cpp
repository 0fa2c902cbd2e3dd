// The collectives of the "shm" backend across hosts (process_group_hosts.h): each in steps,
// inside every host over shared memory, among the hosts' leaders over gloo, inside every host
// again; issued to the group's queue and run in issue order (queued_work.h).

#include "process_group/process_group_hosts.h"

#include "process_group/collective_queue.h"
#include "process_group/queued_work.h"
#include "process_group/tensor_checks.h"

#include <tdshm/errors.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <string>
#include <utility>

namespace tdshm::detail {

namespace {

// The checks both process groups share (tensor_checks.h), in this group's name.
const at::Tensor& only_tensor(const std::vector<at::Tensor>& tensors, const char* op) {
  return one_collective_tensor(tensors, op, kHostsGroup);
}

bool is_avg(const c10d::ReduceOp& op) { return static_cast<c10d::ReduceOp::RedOpType>(op) == c10d::ReduceOp::AVG; }

/// AVG is reduced as SUM (gloo has no AVG, and an average of averages over hosts of other sizes
/// is not the average), then divided by the world size.
c10d::ReduceOp summed(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) {
  if (!is_avg(op)) return op;
  if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) {
    throw TypeError(std::string("the shm backend across hosts: ") + name + " with AVG needs a floating point tensor");
  }
  return c10d::ReduceOp::SUM;
}

}  // namespace

template <class Body>
c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::issue(c10d::OpType type, std::chrono::milliseconds timeout,
                                                        Body&& body, std::vector<at::Tensor> outputs) {
  check_world();
  const auto limit = timeout == c10d::kUnsetTimeout ? parts_.timeout : timeout;
  auto work = c10::make_intrusive<QueuedWorkOf<std::decay_t<Body>>>(getRank(), type, collectives_, limit,
                                                                     std::move(outputs), std::forward<Body>(body),
                                                                     "the shm backend across hosts");
  collectives_->push(*work);
  return work;
}

void ProcessGroupHosts::local_broadcast(at::Tensor& t, int local_root, Deadline d) {
  if (parts_.local->getSize() == 1) return;
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = local_root;
  finish(parts_.local->broadcast(v, o), d, "the broadcast inside the host", false);
}

// Root's host first (over shm), then the leaders (over gloo), then the other hosts (over shm).
void ProcessGroupHosts::broadcast_steps(at::Tensor& t, int root, Deadline d) {
  const bool root_host = host_index(root) == host_index(getRank());
  if (root_host) local_broadcast(t, local_rank(root), d);
  if (leads()) {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = host_index(root);
    finish(parts_.leaders->broadcast(v, o), d, "the broadcast between hosts", true);
  }
  if (!root_host) local_broadcast(t, 0, d);
}

// Reduced to each host's leader, all-reduced among the leaders, broadcast in each host.
void ProcessGroupHosts::allreduce_steps(at::Tensor& t, const c10d::ReduceOp& op, Deadline d) {
  if (parts_.local->getSize() > 1) {
    std::vector<at::Tensor> v{t};
    c10d::ReduceOptions o;
    o.reduceOp = op;
    o.rootRank = 0;
    finish(parts_.local->reduce(v, o), d, "the reduce inside the host", false);
  }
  if (leads()) {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    finish(parts_.leaders->allreduce(v, o), d, "the all_reduce between hosts", true);
  }
  local_broadcast(t, 0, d);
}

at::Tensor ProcessGroupHosts::slice_of(const at::Tensor& blocks, int r) const {
  const std::vector<int>& host = parts_.locality.hosts.at(static_cast<size_t>(host_index(r)));
  const auto at = std::find(host.begin(), host.end(), r) - host.begin();
  return blocks[host_index(r)][at];
}

// Every rank's `t` as rows of a [hosts, widest host, n] tensor: gathered inside each host to its
// leader, all-gathered (or gathered to dst's host) among the leaders, then broadcast inside the
// hosts that need it (every host, or dst's only). Rows of ranks a host does not have are padding.
at::Tensor ProcessGroupHosts::gather_blocks(const at::Tensor& t, Deadline d, bool everywhere, int dst) {
  const int64_t n = t.numel();
  const int hosts = static_cast<int>(parts_.locality.hosts.size());
  const int widest = widest_host();
  const at::Tensor flat = t.contiguous().reshape({n});
  at::Tensor block = at::empty({widest, n}, t.options());
  const int local_size = parts_.local->getSize();
  if (local_size > 1) {
    std::vector<at::Tensor> in{flat};
    std::vector<std::vector<at::Tensor>> out(1);
    if (leads()) {
      for (int i = 0; i < local_size; ++i) out[0].push_back(block[i]);
    } else {
      out.clear();
    }
    c10d::GatherOptions o;
    o.rootRank = 0;
    finish(parts_.local->gather(out, in, o), d, "the gather inside the host", false);
  } else {
    block[0].copy_(flat);
  }
  at::Tensor all = at::empty({hosts, widest, n}, t.options());
  const bool mine = !everywhere && host_index(dst) == host_index(getRank());
  if (leads()) {
    std::vector<at::Tensor> in{block};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int h = 0; h < hosts; ++h) out[0].push_back(all[h]);
    if (everywhere) {
      finish(parts_.leaders->allgather(out, in), d, "the all_gather between hosts", true);
    } else {
      if (!mine) out.clear();
      c10d::GatherOptions o;
      o.rootRank = host_index(dst);
      finish(parts_.leaders->gather(out, in, o), d, "the gather between hosts", true);
    }
  }
  if (everywhere || mine) local_broadcast(all, 0, d);
  return all;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::broadcast(std::vector<at::Tensor>& tensors,
                                                            const c10d::BroadcastOptions& opts) {
  const at::Tensor t = only_tensor(tensors, "broadcast");
  check_root(opts.rootRank, getSize(), "broadcast", kHostsGroup);
  const int root = static_cast<int>(opts.rootRank);
  return issue(
      c10d::OpType::BROADCAST, opts.timeout,
      [this, t, root](Deadline d) {
        at::Tensor x = t.is_contiguous() ? t : t.contiguous();
        broadcast_steps(x, root, d);
        if (!x.is_same(t)) t.copy_(x);
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::allreduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  const at::Tensor t = only_tensor(tensors, "all_reduce");
  const c10d::ReduceOp op = summed(opts.reduceOp, t, "all_reduce");
  const bool avg = is_avg(opts.reduceOp);
  return issue(
      c10d::OpType::ALLREDUCE, opts.timeout,
      [this, t, op, avg](Deadline d) {
        at::Tensor x = t.is_contiguous() ? t : t.contiguous();
        allreduce_steps(x, op, d);
        if (avg) x.div_(getSize());
        if (!x.is_same(t)) t.copy_(x);
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                      const c10d::AllreduceCoalescedOptions& opts) {
  for (const at::Tensor& t : tensors) check_collective_tensor(t, "all_reduce_coalesced", kHostsGroup);
  const bool avg = is_avg(opts.reduceOp);
  const c10d::ReduceOp op = tensors.empty() ? opts.reduceOp : summed(opts.reduceOp, tensors[0], "all_reduce_coalesced");
  return issue(
      c10d::OpType::ALLREDUCE_COALESCED, opts.timeout,
      [this, tensors, op, avg](Deadline d) {
        for (const at::Tensor& t : tensors) {
          at::Tensor x = t.is_contiguous() ? t : t.contiguous();
          allreduce_steps(x, op, d);
          if (avg) x.div_(getSize());
          if (!x.is_same(t)) t.copy_(x);
        }
      },
      tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const at::Tensor t = only_tensor(tensors, "reduce");
  check_root(opts.rootRank, getSize(), "reduce", kHostsGroup);
  const c10d::ReduceOp op = summed(opts.reduceOp, t, "reduce");
  const bool avg = is_avg(opts.reduceOp);
  const int dst = static_cast<int>(opts.rootRank);
  return issue(
      c10d::OpType::REDUCE, opts.timeout,
      [this, t, op, avg, dst](Deadline d) {
        // A scratch copy: only dst's tensor changes.
        at::Tensor x = t.contiguous().clone();
        if (parts_.local->getSize() > 1) {
          std::vector<at::Tensor> v{x};
          c10d::ReduceOptions o;
          o.reduceOp = op;
          o.rootRank = 0;
          finish(parts_.local->reduce(v, o), d, "the reduce inside the host", false);
        }
        if (leads()) {
          std::vector<at::Tensor> v{x};
          c10d::ReduceOptions o;
          o.reduceOp = op;
          o.rootRank = host_index(dst);
          finish(parts_.leaders->reduce(v, o), d, "the reduce between hosts", true);
        }
        if (host_index(dst) != host_index(getRank())) return;
        if (dst != parts_.locality.leader_of(dst)) local_broadcast(x, 0, d);
        if (getRank() == dst) {
          if (avg) x.div_(getSize());
          t.copy_(x);
        }
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::allgather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                                            std::vector<at::Tensor>& inputTensors,
                                                            const c10d::AllgatherOptions& opts) {
  const at::Tensor t = only_tensor(inputTensors, "all_gather");
  check_list(outputTensors, getSize(), t, "all_gather", "output", kHostsGroup);
  std::vector<at::Tensor> outs = outputTensors[0];
  return issue(
      c10d::OpType::ALLGATHER, opts.timeout,
      [this, t, outs](Deadline d) {
        const at::Tensor all = gather_blocks(t, d, true, 0);
        for (int r = 0; r < getSize(); ++r) outs[static_cast<size_t>(r)].copy_(slice_of(all, r).view(outs[static_cast<size_t>(r)].sizes()));
      },
      outs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::_allgather_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                                  const c10d::AllgatherOptions& opts) {
  check_collective_tensor(inputBuffer, "_allgather_base", kHostsGroup);
  check_collective_tensor(outputBuffer, "_allgather_base", kHostsGroup);
  TORCH_CHECK(outputBuffer.numel() == inputBuffer.numel() * getSize() &&
                  outputBuffer.scalar_type() == inputBuffer.scalar_type() && outputBuffer.is_contiguous(),
              kHostsGroup,
              "_allgather_base: the output must be contiguous, of the input's dtype and world size times "
              "its elements");
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (const at::Tensor& chunk : outputBuffer.reshape({getSize(), -1}).unbind(0)) outputs[0].push_back(chunk);
  std::vector<at::Tensor> inputs{inputBuffer.reshape({-1})};
  return allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::gather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                                         std::vector<at::Tensor>& inputTensors,
                                                         const c10d::GatherOptions& opts) {
  const at::Tensor t = only_tensor(inputTensors, "gather");
  check_root(opts.rootRank, getSize(), "gather", kHostsGroup);
  const int dst = static_cast<int>(opts.rootRank);
  check_root_list(outputTensors, getRank() == dst, getSize(), t, "gather", "output", kHostsGroup);
  const std::vector<at::Tensor> outs = getRank() == dst ? outputTensors[0] : std::vector<at::Tensor>{};
  return issue(
      c10d::OpType::GATHER, opts.timeout,
      [this, t, outs, dst](Deadline d) {
        const at::Tensor all = gather_blocks(t, d, false, dst);
        if (getRank() != dst) return;
        for (int r = 0; r < getSize(); ++r) outs[static_cast<size_t>(r)].copy_(slice_of(all, r).view(outs[static_cast<size_t>(r)].sizes()));
      },
      outs);
}

// Every rank's share, from src: src's host gets all of them (over shm), the leaders their
// host's block (a gloo scatter), each host's ranks their row (a shm scatter).
c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::scatter(std::vector<at::Tensor>& outputTensors,
                                                          std::vector<std::vector<at::Tensor>>& inputTensors,
                                                          const c10d::ScatterOptions& opts) {
  const at::Tensor t = only_tensor(outputTensors, "scatter");
  check_root(opts.rootRank, getSize(), "scatter", kHostsGroup);
  const int src = static_cast<int>(opts.rootRank);
  check_root_list(inputTensors, getRank() == src, getSize(), t, "scatter", "input", kHostsGroup);
  const std::vector<at::Tensor> ins = getRank() == src ? inputTensors[0] : std::vector<at::Tensor>{};
  return issue(
      c10d::OpType::SCATTER, opts.timeout,
      [this, t, ins, src](Deadline d) {
        const int64_t n = t.numel();
        const int hosts = static_cast<int>(parts_.locality.hosts.size());
        const int widest = widest_host();
        at::Tensor all = at::empty({hosts, widest, n}, t.options());
        const bool src_host = host_index(src) == host_index(getRank());
        if (src_host) {
          if (getRank() == src) {
            for (int r = 0; r < getSize(); ++r) slice_of(all, r).copy_(ins[static_cast<size_t>(r)].reshape({n}));
          }
          local_broadcast(all, local_rank(src), d);
        }
        at::Tensor block = at::empty({widest, n}, t.options());
        if (leads()) {
          std::vector<at::Tensor> out{block};
          std::vector<std::vector<at::Tensor>> in;
          if (src_host) {
            in.emplace_back();
            for (int h = 0; h < hosts; ++h) in[0].push_back(all[h]);
          }
          c10d::ScatterOptions o;
          o.rootRank = host_index(src);
          finish(parts_.leaders->scatter(out, in, o), d, "the scatter between hosts", true);
        }
        at::Tensor mine = at::empty({n}, t.options());
        const int local_size = parts_.local->getSize();
        if (local_size > 1) {
          std::vector<at::Tensor> out{mine};
          std::vector<std::vector<at::Tensor>> in;
          if (leads()) {
            in.emplace_back();
            for (int i = 0; i < local_size; ++i) in[0].push_back(block[i]);
          }
          c10d::ScatterOptions o;
          o.rootRank = 0;
          finish(parts_.local->scatter(out, in, o), d, "the scatter inside the host", false);
        } else {
          mine.copy_(block[0]);
        }
        t.copy_(mine.view(t.sizes()));
      },
      {t});
}

// All-reduced as one [world, n] tensor; each rank keeps its row.
c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::reduce_scatter(std::vector<at::Tensor>& outputTensors,
                                                                 std::vector<std::vector<at::Tensor>>& inputTensors,
                                                                 const c10d::ReduceScatterOptions& opts) {
  const at::Tensor t = only_tensor(outputTensors, "reduce_scatter");
  check_list(inputTensors, getSize(), t, "reduce_scatter", "input", kHostsGroup);
  const std::vector<at::Tensor> ins = inputTensors[0];
  const c10d::ReduceOp op = summed(opts.reduceOp, t, "reduce_scatter");
  const bool avg = is_avg(opts.reduceOp);
  return issue(
      c10d::OpType::REDUCE_SCATTER, opts.timeout,
      [this, t, ins, op, avg](Deadline d) {
        const int64_t n = t.numel();
        at::Tensor all = at::empty({getSize(), n}, t.options());
        for (int r = 0; r < getSize(); ++r) all[r].copy_(ins[static_cast<size_t>(r)].reshape({n}));
        allreduce_steps(all, op, d);
        at::Tensor mine = all[getRank()];
        if (avg) mine.div_(getSize());
        t.copy_(mine.view(t.sizes()));
      },
      {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::barrier(const c10d::BarrierOptions& opts) {
  return issue(
      c10d::OpType::BARRIER, opts.timeout,
      [this](Deadline d) {
        if (parts_.local->getSize() > 1) finish(parts_.local->barrier(), d, "the barrier inside the host", false);
        if (leads()) finish(parts_.leaders->barrier(), d, "the barrier between hosts", true);
        if (parts_.local->getSize() > 1) finish(parts_.local->barrier(), d, "the barrier inside the host", false);
      },
      {});
}

}  // namespace tdshm::detail
