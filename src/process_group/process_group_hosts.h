#pragma once
// Internal: the "shm" backend of a world whose ranks live on several hosts (docs/hosts.md). Each
// rank holds three groups:
//  * local: a ProcessGroupShm of the ranks of its host (process_group/locality.h), one segment;
//  * network: a ProcessGroupGloo of the whole world, over TCP, with the world's ranks;
//  * leaders: on a host's lowest rank only, a ProcessGroupGloo of every host's lowest rank (its
//    rank there is its host's index).
// Point to point goes over local when both ranks share a host, else over network (same ranks,
// same tags: a peer there sees what a gloo world carries). Collectives are hierarchical: inside
// each host over shm, between hosts over gloo among the leaders, then inside each host again;
// they are issued to a queue and run in issue order, in the thread that waits for them or on
// the queue's helper thread (queued_work.h), as ProcessGroupShm's are. Results equal those of a
// one-process reference in the order the docs state (AVG: the SUM, divided by the world size at
// the end).

#include <tdshm/process_group.h>

#include "process_group/locality.h"
#include "process_group/world_watch.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace tdshm::detail {

class CollectiveQueue;

class ProcessGroupHosts final : public c10d::ProcessGroup {
 public:
  struct Parts {
    c10::intrusive_ptr<c10d::Store> store;  // the group's (its watcher beats there)
    Locality locality;
    c10::intrusive_ptr<ProcessGroupShm> local;
    c10::intrusive_ptr<c10d::ProcessGroup> network;
    c10::intrusive_ptr<c10d::ProcessGroup> leaders;  // null unless this rank leads its host
    std::chrono::milliseconds timeout{};
  };

  ProcessGroupHosts(int rank, int size, Parts parts);
  /// After a loss, the network groups are left to the process's end rather than destroyed: their
  /// threads may wait on peers that wait on them (a connection the process's exit closes ends it).
  ~ProcessGroupHosts() override;
  const std::string getBackendName() const override { return "shm"; }

  const Locality& locality() const noexcept { return parts_.locality; }
  /// Whether `peer` (a rank of this world) shares this rank's host.
  bool is_local(int peer) const { return parts_.locality.local(peer, getRank()); }
  /// `peer`'s rank in local() (peer on this host).
  int local_rank(int peer) const;
  const c10::intrusive_ptr<ProcessGroupShm>& local() const noexcept { return parts_.local; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& network() const noexcept { return parts_.network; }
  /// Why the world is lost (a rank gone, or a collective that failed), once it is: then every
  /// work fails with PeerLostError, at once for new ones (docs/hosts.md, "When a rank dies").
  std::optional<std::string> lost() const;

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  /// Refused: a receive from any source would have to listen on two transports at once.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                           std::vector<at::Tensor>& inputTensors,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                        std::vector<at::Tensor>& inputTensors,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputTensors,
                                         std::vector<std::vector<at::Tensor>>& inputTensors,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputTensors,
                                                std::vector<std::vector<at::Tensor>>& inputTensors,
                                                const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

 private:
  using Deadline = std::chrono::steady_clock::time_point;
  template <class Body>
  c10::intrusive_ptr<c10d::Work> issue(c10d::OpType type, std::chrono::milliseconds timeout, Body&& body,
                                       std::vector<at::Tensor> outputs);

  // The world is lost: remember why, and fail what waits on this host's shared memory.
  void on_lost(const std::string& what);
  /// Throws PeerLostError once the world is lost.
  void check_world() const;
  /// Waits for one step of a collective within what is left of `d`. A step over the network
  /// waits in slices, so that a loss the watcher learns of ends it. A failure is reported to the
  /// world (the collectives are out of step), and surfaces typed: PeerLostError, TimeoutError.
  void finish(const c10::intrusive_ptr<c10d::Work>& work, Deadline d, const char* step, bool network);
  /// How long a rank whose step failed with a symptom (a reset connection, a host-mate's
  /// shutdown) waits for the world's verdict: two beats and a margin, so that a rank that did not
  /// answer has missed two.
  static constexpr std::chrono::milliseconds kVerdictWait{1500};
  /// Why the world is lost, as this rank can best tell after `step` failed with `symptom`: a
  /// host-mate that died (seen here, and published as the verdict), else the verdict another
  /// rank publishes within kVerdictWait, else the cause is unknown and the ranks that did not
  /// answer meanwhile are named as such. Never names a live rank as gone.
  struct Explained {
    std::string what;
    bool verdict;  // a rank was named gone
  };
  Explained explain_loss(const char* step, const std::string& symptom);
  /// "rank 5 (host 1) died ..." for a rank of this host whose process ended without leaving.
  std::optional<std::string> dead_host_mate() const;
  std::string describe(int rank) const { return "rank " + std::to_string(rank) + " (host " + std::to_string(host_index(rank)) + ")"; }

  // The steps of the collectives (run by the queue, against `d`).
  void local_broadcast(at::Tensor& t, int local_root, Deadline d);
  void broadcast_steps(at::Tensor& t, int root, Deadline d);
  void allreduce_steps(at::Tensor& t, const c10d::ReduceOp& op, Deadline d);
  /// Every rank's `t` ([n] elements), as a [hosts, widest host, n] tensor on every rank.
  at::Tensor gather_blocks(const at::Tensor& t, Deadline d, bool everywhere, int dst);
  /// Rank r's slice of a [hosts, widest host, ...] block tensor.
  at::Tensor slice_of(const at::Tensor& blocks, int r) const;
  int host_index(int rank) const { return parts_.locality.host_of.at(static_cast<size_t>(rank)); }
  bool leads() const { return parts_.leaders.defined(); }
  int widest_host() const;

  Parts parts_;
  std::mutex run_mutex_;  // held while a collective runs (the queue's contract)
  std::shared_ptr<CollectiveQueue> collectives_;
  mutable std::mutex lost_mu_;
  std::optional<std::string> lost_;
  std::atomic<bool> is_lost_{false};
  std::unique_ptr<WorldWatch> watch_;  // last: it calls on_lost until it is stopped
};

}  // namespace tdshm::detail
