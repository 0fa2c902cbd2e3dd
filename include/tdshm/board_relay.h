#pragma once
/// A board across hosts (docs/board.md, "Across hosts"): each host holds its own copy of a
/// board, refreshed from the writer's host by one publish. On the writer's host a BoardRelay
/// sender reads the newest version of the board (as a reader) and sends it to one relay receiver
/// on every other host over a process group that spans the hosts (gloo over TCP, or any c10d
/// backend); each receiver writes it in place into its host's board and commits it, where that
/// host's readers read it as they would the writer's.
///
/// - Newest only, as the board: a version published while the previous one is still on the
///   wire is skipped when a newer exists by the time the sender is free. The writer never waits
///   for the relay, nor a receiver for its readers.
/// - Versions are numbered by each host's board (1, 2, ... as it commits them); BoardRelay::sent
///   and received count them.
/// - The sender stops at its destructor (it tells every receiver, which then stops too); a
///   receiver whose sender's process died stops with the group's error (error() says it), and
///   its host's board stays with the last version it had. A sender whose board's writer died
///   tells its receivers to stop too, and stops (error() says the writer died).

#include <tdshm/board.h>
#include <tdshm/distributed.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tdshm {

namespace detail {
class BoardRelayState;
}

class BoardRelay {
 public:
  /// On the writer's host: opens the board `name` as a reader (a slot of its own) and sends every
  /// newest version to the group ranks `receivers` of `group`, from a thread of its own.
  static BoardRelay sender(const std::string& name, Group group, std::vector<int> receivers, BoardOptions options = {});
  /// On another host: creates this host's board `name` for trees like `like` (its readers open
  /// it), and publishes in it every version group rank `src` sends, from a thread of its own.
  static BoardRelay receiver(const std::string& name, const TensorDict& like, Group group, int src,
                             BoardOptions options = {});

  BoardRelay(BoardRelay&&) noexcept;
  BoardRelay& operator=(BoardRelay&&) noexcept;
  /// A sender tells its receivers to stop, then stops; a receiver stops (its board is removed,
  /// as a writer's is).
  ~BoardRelay();

  /// Versions sent (to every receiver), or received and published.
  uint64_t count() const noexcept;
  /// Whether the relay's thread ended: a receiver told to stop, or either side after an error.
  bool stopped() const noexcept;
  /// What ended the thread, if not an orderly stop ("" otherwise).
  std::string error() const;
  /// Waits until count() >= n, stopped(), or `timeout`; returns count().
  uint64_t wait_count(uint64_t n, std::chrono::milliseconds timeout) const;

 private:
  explicit BoardRelay(std::unique_ptr<detail::BoardRelayState> state);
  std::unique_ptr<detail::BoardRelayState> state_;
};

}  // namespace tdshm
