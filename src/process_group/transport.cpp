// The transports of transport.h: ProcessGroupShm's (checks, batches, strided tensors, dropped
// mismatches, loans), any other c10d backend's (plain send and recv), and a world across hosts'
// (each peer by its route: one of the two). make_transport is the only place that tells backends
// apart.

#include "process_group/transport.h"

#include "process_group/process_group_hosts.h"
#include "process_group/shm_group_seam.h"

#include <tdshm/errors.h>

#include <ATen/ops/empty.h>

#include <string>
#include <utility>

namespace tdshm::detail {

namespace {

[[noreturn]] void no_batches() { throw Error("this group's backend does not post batches of messages"); }

/// Any c10d backend: c10d's send and recv, nothing more.
class C10dTransport final : public Transport {
 public:
  explicit C10dTransport(c10::intrusive_ptr<c10d::ProcessGroup> backend)
      : Transport(Can{}), backend_(std::move(backend)) {}

  TransportWork send(at::Tensor t, int peer, int tag, MessageCheck) const override {
    std::vector<at::Tensor> v{std::move(t)};
    return backend_->send(v, peer, tag);
  }
  TransportWork recv(at::Tensor t, int peer, int tag, MessageCheck) const override {
    std::vector<at::Tensor> v{std::move(t)};
    return backend_->recv(v, peer, tag);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> backend_;
};

/// tdshm's shared-memory backend.
class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(c10::intrusive_ptr<ProcessGroupShm> backend)
      : Transport(Can{.check_messages = true, .batch = true, .strided = true, .drop_mismatched = true, .loans = true}),
        backend_(std::move(backend)) {}

  TransportWork send(at::Tensor t, int peer, int tag, MessageCheck check) const override {
    return ShmGroupSeam::send(*backend_, t, peer, tag, check);
  }
  TransportWork recv(at::Tensor t, int peer, int tag, MessageCheck check) const override {
    return ShmGroupSeam::recv(*backend_, t, peer, tag, check);
  }
  c10::intrusive_ptr<BatchWork> send_batch(std::span<const at::Tensor> tensors, int peer,
                                           const std::vector<int>& tags,
                                           const std::vector<MessageCheck>& checks) const override {
    return ShmGroupSeam::send_batch(*backend_, tensors, peer, tags, checks);
  }
  c10::intrusive_ptr<BatchWork> recv_batch(std::span<const at::Tensor> tensors, int peer,
                                           const std::vector<int>& tags,
                                           const std::vector<MessageCheck>& checks) const override {
    return ShmGroupSeam::recv_batch(*backend_, tensors, peer, tags, checks);
  }
  at::Tensor loan(at::IntArrayRef sizes, at::ScalarType dtype) const override { return backend_->loan(sizes, dtype); }
  c10::intrusive_ptr<BatchWork> recv_views(int peer, const std::vector<int>& tags,
                                           const std::vector<MessageCheck>& checks) const override {
    return ShmGroupSeam::recv_views(*backend_, peer, tags, checks);
  }
  bool memmap_by_reference_with(int peer) const noexcept override { return backend_->memmap_by_reference_with(peer); }
  bool peer_runs_tdshm(int peer) const noexcept override { return backend_->runs_tdshm_transfers(peer); }

 private:
  c10::intrusive_ptr<ProcessGroupShm> backend_;
};

/// A world across hosts: each peer by its route, tdshm's shared-memory transport to the ranks of
/// this host (their ranks there), the network's to the others.
class RoutedTransport final : public Transport {
 public:
  explicit RoutedTransport(c10::intrusive_ptr<ProcessGroupHosts> backend)
      : Transport(Can{}),
        backend_(std::move(backend)),
        local_(backend_->local()),
        network_(backend_->network()) {}

  const Can& can(int peer) const noexcept override { return local(peer) ? local_.can(0) : network_.can(0); }
  TransportWork send(at::Tensor t, int peer, int tag, MessageCheck check) const override {
    return local(peer) ? local_.send(std::move(t), backend_->local_rank(peer), tag, check)
                       : network_.send(std::move(t), peer, tag, check);
  }
  TransportWork recv(at::Tensor t, int peer, int tag, MessageCheck check) const override {
    return local(peer) ? local_.recv(std::move(t), backend_->local_rank(peer), tag, check)
                       : network_.recv(std::move(t), peer, tag, check);
  }
  c10::intrusive_ptr<BatchWork> send_batch(std::span<const at::Tensor> tensors, int peer, const std::vector<int>& tags,
                                           const std::vector<MessageCheck>& checks) const override {
    if (!local(peer)) no_batches();
    return local_.send_batch(tensors, backend_->local_rank(peer), tags, checks);
  }
  c10::intrusive_ptr<BatchWork> recv_batch(std::span<const at::Tensor> tensors, int peer, const std::vector<int>& tags,
                                           const std::vector<MessageCheck>& checks) const override {
    if (!local(peer)) no_batches();
    return local_.recv_batch(tensors, backend_->local_rank(peer), tags, checks);
  }
  // A loan lives in this host's segment: sent to a rank of another host it is an ordinary tensor.
  at::Tensor loan(at::IntArrayRef sizes, at::ScalarType dtype) const override { return local_.loan(sizes, dtype); }
  c10::intrusive_ptr<BatchWork> recv_views(int peer, const std::vector<int>& tags,
                                           const std::vector<MessageCheck>& checks) const override {
    if (!local(peer)) return Transport::recv_views(peer, tags, checks);
    return local_.recv_views(backend_->local_rank(peer), tags, checks);
  }
  bool memmap_by_reference_with(int peer) const noexcept override {
    return local(peer) && local_.memmap_by_reference_with(backend_->local_rank(peer));
  }
  bool peer_runs_tdshm(int peer) const noexcept override {
    return local(peer) && local_.peer_runs_tdshm(backend_->local_rank(peer));
  }

 private:
  bool local(int peer) const noexcept {
    return peer >= 0 && peer < backend_->getSize() && backend_->is_local(peer);
  }

  c10::intrusive_ptr<ProcessGroupHosts> backend_;
  ShmTransport local_;
  C10dTransport network_;
};

}  // namespace

c10::intrusive_ptr<BatchWork> Transport::send_batch(std::span<const at::Tensor>, int, const std::vector<int>&,
                                                    const std::vector<MessageCheck>&) const {
  no_batches();
}
c10::intrusive_ptr<BatchWork> Transport::recv_batch(std::span<const at::Tensor>, int, const std::vector<int>&,
                                                    const std::vector<MessageCheck>&) const {
  no_batches();
}

at::Tensor Transport::loan(at::IntArrayRef sizes, at::ScalarType dtype) const {
  return at::empty(sizes, at::TensorOptions().dtype(dtype));
}
c10::intrusive_ptr<BatchWork> Transport::recv_views(int, const std::vector<int>&, const std::vector<MessageCheck>&) const {
  throw Error("this group's backend does not receive views");
}

std::shared_ptr<const Transport> make_transport(c10::intrusive_ptr<c10d::ProcessGroup> backend) {
  if (auto* shm = dynamic_cast<ProcessGroupShm*>(backend.get())) {
    return std::make_shared<ShmTransport>(c10::intrusive_ptr<ProcessGroupShm>::reclaim_copy(shm));
  }
  if (auto* hosts = dynamic_cast<ProcessGroupHosts*>(backend.get())) {
    return std::make_shared<RoutedTransport>(c10::intrusive_ptr<ProcessGroupHosts>::reclaim_copy(hosts));
  }
  return std::make_shared<C10dTransport>(std::move(backend));
}

}  // namespace tdshm::detail
