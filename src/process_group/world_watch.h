#pragma once
// Internal: how the ranks of a world across hosts learn that one of them is gone (docs/hosts.md,
// "When a rank dies"). Inside a host the shm transport sees a dead peer at once (its pid); across
// hosts nothing does, except gloo on a connection the dead rank held. So every rank's watcher
// thread beats in the group's store every kBeat, and group rank 0's watcher reads every beat: a
// rank whose beat has not moved for kSilence is gone, and rank 0 publishes it. A rank that learns
// of a loss another way (its own transport saw a peer die, or a collective failed) publishes it
// too, and every watcher looks for a published loss every beat. If rank 0 itself dies, the store
// it serves (tcp://) stops answering, which every watcher sees. Either way each rank learns within
// about kSilence + 2 kBeat, and its `on_failure` runs once, on the watcher's thread, with a
// message naming the rank.
//
// A loss is a symptom (a connection reset, a host-mate that shut its group down) or a verdict
// (this rank is gone: its host-mate saw its process end, or its beat stopped). A survivor that
// sees only a symptom waits a bounded moment for a verdict (ProcessGroupHosts::explain_loss), so
// that every survivor's error names the rank that died, and never a live one. A watcher keeps
// beating after a loss, until it is stopped: a silent rank is then one that did not answer. Every
// rank counts itself told of the loss; group rank 0, whose process serves a tcp:// store, keeps it
// up when it is stopped until the others were told (at most kLinger): a survivor that exits at
// once must not take the verdict with it. The store carries two operations per rank per beat (rank 0: one more
// per rank): a watcher must not wake the measured ranks of a busy host much more than that.
//
// Store keys (in the group's store, which c10d's stores serve from any thread):
// "tdshm_watch/beat/<rank>" (a counter), "tdshm_watch/lost" (how many losses were published),
// "tdshm_watch/failed" (the message of one), "tdshm_watch/verdicts" and "tdshm_watch/verdict"
// (the same for the verdicts), "tdshm_watch/told" (how many ranks learned of the loss).

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace tdshm::detail {

class WorldWatch {
 public:
  static constexpr std::chrono::milliseconds kBeat{500};
  static constexpr std::chrono::milliseconds kSilence{3000};
  static constexpr std::chrono::milliseconds kLinger{3000};

  /// Starts watching. `describe(rank)` names a rank in messages ("rank 5 (host 1)").
  WorldWatch(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::function<std::string(int)> describe,
             std::function<void(const std::string&)> on_failure);
  /// Stops the thread (a store that no longer answers cannot hold it up: its waits are bounded);
  /// after a loss, rank 0 first waits until every other rank but one was told (kLinger at most).
  ~WorldWatch();
  WorldWatch(const WorldWatch&) = delete;
  WorldWatch& operator=(const WorldWatch&) = delete;

  /// Tells the world about a loss this rank saw (publishes it; on_failure runs here too).
  void report(const std::string& what);
  /// The loss, once one is known.
  std::optional<std::string> failure() const;
  /// Publishes a verdict: `what` names the rank that is gone (say "rank 3 (host 1) died ...").
  void publish_verdict(const std::string& what);
  /// A verdict some rank published; nullopt when none was, or the store does not answer.
  std::optional<std::string> verdict();
  /// Every rank's beat counter now (-1 for one never seen); empty when the store does not answer.
  std::vector<int64_t> beats();

 private:
  void loop();
  void fail(const std::string& what, bool publish);

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  std::function<std::string(int)> describe_;
  std::function<void(const std::string&)> on_failure_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::optional<std::string> failure_;
  std::thread thread_;
};

}  // namespace tdshm::detail
