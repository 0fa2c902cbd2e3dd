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
// message naming the rank. The store carries two operations per rank per beat (rank 0: one more
// per rank): a watcher must not wake the measured ranks of a busy host much more than that.
//
// Store keys (in the group's store, which c10d's stores serve from any thread):
// "tdshm_watch/beat/<rank>" (a counter), "tdshm_watch/lost" (how many losses were published) and
// "tdshm_watch/failed" (the message of one).

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

  /// Starts watching. `describe(rank)` names a rank in messages ("rank 5 (host 1)").
  WorldWatch(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::function<std::string(int)> describe,
             std::function<void(const std::string&)> on_failure);
  /// Stops the thread (a store that no longer answers cannot hold it up: its waits are bounded).
  ~WorldWatch();
  WorldWatch(const WorldWatch&) = delete;
  WorldWatch& operator=(const WorldWatch&) = delete;

  /// Tells the world about a loss this rank saw (publishes it; on_failure runs here too).
  void report(const std::string& what);
  /// The loss, once one is known.
  std::optional<std::string> failure() const;

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
