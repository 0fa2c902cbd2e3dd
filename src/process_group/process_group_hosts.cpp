// The "shm" backend across hosts (process_group_hosts.h): the group, its routes per pair, and
// what happens when its world is lost. Its collectives are process_group_hosts_collectives.cpp.

#include "process_group/process_group_hosts.h"

#include "common/format.h"
#include "process_group/collective_queue.h"
#include "process_group/shm_group_seam.h"

#include <tdshm/errors.h>

#include <algorithm>
#include <exception>
#include <string>
#include <thread>
#include <utility>

namespace tdshm::detail {

namespace {

using Clock = std::chrono::steady_clock;

bool mentions_timeout(const std::string& s) {
  return s.find("imed out") != std::string::npos || s.find("imeout") != std::string::npos;
}

}  // namespace

ProcessGroupHosts::ProcessGroupHosts(int rank, int size, Parts parts)
    : c10d::ProcessGroup(rank, size), parts_(std::move(parts)) {
  collectives_ = std::make_shared<CollectiveQueue>("across hosts, rank " + std::to_string(rank), run_mutex_);
  // A wait on this host's transport (a point-to-point transfer to a rank of this host, a step of
  // a hierarchical collective's local part) starts what this group left queued.
  if (parts_.local) ShmGroupSeam::add_wait_hook(*parts_.local, collectives_);
  watch_ = std::make_unique<WorldWatch>(
      parts_.store, rank, size,
      [this](int r) { return describe(r); },
      [this](const std::string& what) { on_lost(what); });
}

ProcessGroupHosts::~ProcessGroupHosts() {
  watch_.reset();
  collectives_->close(std::make_exception_ptr(Error("the process group was destroyed before this collective ran")));
  if (is_lost_.load()) {
    // Left to the process's end (see the header): their threads may wait on peers that wait on them.
    (void)parts_.network.release();
    (void)parts_.leaders.release();
  }
}

std::optional<std::string> ProcessGroupHosts::lost() const {
  std::lock_guard lk(lost_mu_);
  return lost_;
}

void ProcessGroupHosts::on_lost(const std::string& what) {
  {
    std::lock_guard lk(lost_mu_);
    if (lost_) return;
    lost_ = what;
  }
  is_lost_.store(true);
  parts_.local->shutdown(std::make_exception_ptr(PeerLostError("the world across hosts is lost: " + what)));
}

void ProcessGroupHosts::check_world() const {
  if (!is_lost_.load(std::memory_order_relaxed)) return;
  throw PeerLostError("the world across hosts is lost: " + lost().value_or("?"));
}

void ProcessGroupHosts::finish(const c10::intrusive_ptr<c10d::Work>& work, Deadline d, const char* step, bool network) {
  const auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()), std::chrono::milliseconds(1));
  };
  try {
    if (!network) {
      work->wait(left());
      return;
    }
    for (;;) {
      try {
        work->wait(std::min(left(), std::chrono::milliseconds(100)));
        return;
      } catch (...) {
        if (work->isCompleted()) throw;  // its own failure, not the end of a slice
        check_world();
        if (Clock::now() >= d) {
          throw TimeoutError(std::string("the world across hosts: ") + step + " did not complete within its deadline");
        }
      }
    }
  } catch (const std::exception& e) {
    check_world();  // a loss known here explains the failure best
    // The collectives are out of step now: the world is lost, for every rank. A timeout before
    // the collective's own deadline (gloo's, say, after its peer gave up) is a symptom too.
    const bool timed_out = dynamic_cast<const TimeoutError*>(&e) != nullptr || mentions_timeout(e.what());
    if (timed_out && Clock::now() >= d) {
      const std::string what = std::string(step) + " failed on rank " + std::to_string(getRank()) + ": " + first_line(e.what());
      watch_->report(what);
      throw TimeoutError("the world across hosts: " + what);
    }
    const Explained why = explain_loss(step, first_line(e.what()));
    watch_->report(why.what);
    if (timed_out && !why.verdict) throw TimeoutError("the world across hosts: " + why.what);
    throw PeerLostError("the world across hosts is lost: " + why.what);
  }
}

std::optional<std::string> ProcessGroupHosts::dead_host_mate() const {
  const std::vector<int>& mine = parts_.locality.hosts.at(static_cast<size_t>(host_index(getRank())));
  for (size_t i = 0; i < mine.size(); ++i) {
    if (mine[i] == getRank() || !parts_.local->peer_died(static_cast<int>(i))) continue;
    return describe(mine[i]) + " died: its process ended without leaving the group (seen by rank " +
           std::to_string(getRank()) + " on its host)";
  }
  return std::nullopt;
}

// The first signal of a death is often not the dead rank's: a connection that another survivor
// reset when it gave up, a host-mate that shut its group down after its own failure. So a symptom
// is explained by the world's verdict when one comes soon, and said to be a symptom otherwise.
ProcessGroupHosts::Explained ProcessGroupHosts::explain_loss(const char* step, const std::string& symptom) {
  const std::string here = "; on rank " + std::to_string(getRank()) + ", " + step + " failed";
  if (auto mate = dead_host_mate()) {
    watch_->publish_verdict(*mate);
    return {*mate + here, true};
  }
  const std::vector<int64_t> before = watch_->beats();
  const auto until = Clock::now() + kVerdictWait;
  for (;;) {
    if (auto v = watch_->verdict()) return {*v + here, true};
    if (auto mate = dead_host_mate()) {
      watch_->publish_verdict(*mate);
      return {*mate + here, true};
    }
    if (auto known = lost()) return {*known, true};  // the world's word, as the watcher heard it
    if (Clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string silent;
  const std::vector<int64_t> after = watch_->beats();
  if (before.empty() || after.empty()) {
    silent = "the group's store no longer answers";
  } else {
    for (int r = 0; r < getSize(); ++r) {
      const auto i = static_cast<size_t>(r);
      if (r == getRank() || after[i] != before[i]) continue;
      silent += (silent.empty() ? "" : ", ") + describe(r);
    }
    silent = silent.empty() ? "every rank still beats" : silent + " did not answer";
  }
  return {"no rank was found gone within " + std::to_string(kVerdictWait.count()) + " ms (" + silent + ")" + here +
              ": " + symptom,
          false};
}


int ProcessGroupHosts::local_rank(int peer) const {
  const std::vector<int>& mine = parts_.locality.hosts.at(static_cast<size_t>(host_index(getRank())));
  const auto it = std::find(mine.begin(), mine.end(), peer);
  if (it == mine.end()) throw Error("rank " + std::to_string(peer) + " is not on this rank's host");
  return static_cast<int>(it - mine.begin());
}

int ProcessGroupHosts::widest_host() const {
  size_t widest = 0;
  for (const auto& h : parts_.locality.hosts) widest = std::max(widest, h.size());
  return static_cast<int>(widest);
}

// ---- point to point ---------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  if (dstRank < 0 || dstRank >= getSize()) throw Error("send: rank " + std::to_string(dstRank) + " is not in the world");
  check_world();
  if (is_local(dstRank)) return parts_.local->send(tensors, local_rank(dstRank), tag);
  return parts_.network->send(tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  if (srcRank < 0 || srcRank >= getSize()) throw Error("recv: rank " + std::to_string(srcRank) + " is not in the world");
  check_world();
  if (is_local(srcRank)) return parts_.local->recv(tensors, local_rank(srcRank), tag);
  return parts_.network->recv(tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHosts::recvAnysource(std::vector<at::Tensor>&, int) {
  throw Error("the shm backend across hosts does not receive from any source (its peers are reached over shared "
              "memory and over the network): name the source");
}

}  // namespace tdshm::detail
