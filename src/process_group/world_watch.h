#pragma once
// Internal: how the ranks of a world across hosts learn that one of them is gone (docs/hosts.md,
// "When a rank dies"). Inside a host the shm transport sees a dead peer at once (its pid); across
// hosts nothing does, except gloo on a connection the dead rank held. So every rank's watcher
// thread beats in the group's store every kBeat, and reads the others' beats: a rank whose beat
// has not moved for kSilence is gone. A rank that learns of a loss another way (its own transport
// saw a peer die, or a collective failed) publishes it, and every watcher reads that too. Either
// way each rank learns within about kSilence + kBeat, and its `on_failure` runs once, on the
// watcher's thread, with a message naming the rank.
//
// Store keys (in the group's store, which c10d's stores serve from any thread):
// "tdshm_watch/beat/<rank>" = a counter, "tdshm_watch/failed" = the first failure's message.

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
  static constexpr std::chrono::milliseconds kBeat{250};
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
