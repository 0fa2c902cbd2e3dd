#pragma once
/// A versioned board: one writer publishes a tree (a TensorDict of fixed keys, dtypes and shapes)
/// as version 1, 2, ...; readers in other processes of this host read the newest *complete*
/// version, copied into their own tree or as views, and can wait for a version newer than the one
/// they have (docs/board.md). What an actor needs of a learner's weights.
///
/// - A reader never sees a torn version: the writer writes into a buffer no reader holds, stamps
///   it, then publishes it; a reader pins the newest buffer before it reads.
/// - The writer never waits for a reader: there are 2 buffers per reader slot and 2 more, so a
///   free one always exists (each reader holds at most kPinsPerReader versions at once).
/// - A reader that dies holds nothing: the writer takes back the pins of a dead reader's slot, and
///   a new reader takes over its slot.
/// - The board lives in /dev/shm/tdshm-board.<name> (mode 0600, this user's; readers refuse
///   another user's file or a link), removed when the writer's Board is destroyed; readers' views
///   keep their mapping. A writer that dies ends its readers' waits (PeerLostError), and the last
///   of them to go removes its file; a new writer of the name replaces it meanwhile.

#include <tdshm/tensordict.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace tdshm {

namespace detail {
class BoardState;
}

struct BoardOptions {
  /// Reader slots (a reader takes one while its Board or a view of it lives): at most 64.
  uint32_t readers = 8;
  /// Board::open waits this long for the writer to create the board (a century or more: for
  /// ever).
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  /// wait_newer checks the version this long before it sleeps (a futex wake-up costs tens of
  /// microseconds on a VM); 0: sleep at once.
  std::chrono::microseconds spin{std::chrono::microseconds(250)};
};

class Board {
 public:
  /// Versions a reader may hold as views at once (view() beyond that is an Error).
  static constexpr uint32_t kPinsPerReader = 2;

  /// The writer: creates the board `name` for trees with `like`'s keys, dtypes and shapes (its
  /// values are not published; plain nested TensorDicts of dense CPU tensors). SegmentError when
  /// the name is held by a live writer, or is not a valid name; a board left by a dead writer is
  /// replaced. Threads of the writer's process may share it (publish, begin and commit run one at
  /// a time); a child forked from its process must not use it (Error), and dropping it there
  /// leaves the parent's board as it is. The same holds for readers and their views.
  static Board create(const std::string& name, const TensorDict& like, BoardOptions options = {});
  /// A reader: opens the board `name`, waiting up to options.timeout for its writer (TimeoutError),
  /// and takes a reader slot (SegmentError when every slot is held by a live reader).
  static Board open(const std::string& name, BoardOptions options = {});

  Board(Board&&) noexcept;
  Board& operator=(Board&&) noexcept;
  ~Board();

  /// Writer: copies `td`'s leaves into a free buffer and publishes them as the next version,
  /// without waiting for any reader. SchemaError naming the key when `td`'s tree differs from
  /// `like`'s. Returns the new version.
  uint64_t publish(const TensorDict& td);
  /// Writer, without a copy: the tree of a free buffer (views of the board's bytes, holding
  /// whatever an earlier version left there) for the caller to write in place, then commit().
  /// Readers never see it before the commit. Error while a begin() is open (and publish() is one
  /// then too).
  TensorDict begin();
  /// Publishes the tree of the open begin() as the next version and returns it; its views must
  /// not be written afterwards (a later begin() hands out a buffer no reader holds).
  uint64_t commit();
  /// The newest published version (0: none yet).
  uint64_t version() const;
  /// Reader: copies the newest version into `td`'s leaves (SchemaError naming the key when `td`'s
  /// tree differs from the board's) and returns its version; 0 (td untouched) before the first.
  uint64_t read(TensorDict& td);
  /// Reader: the newest version as a locked tree of views of the board's bytes, held (the writer
  /// writes elsewhere) until the last of its tensors is dropped. Read-only by contract: writing
  /// into a view changes what every reader of that version reads. Error when this reader already
  /// holds kPinsPerReader versions; TimeoutError-free: 0 versions published is an Error.
  TensorDict view();
  /// Reader: view()'s tensors without the tree, as (key, view) in key order (sorted at each
  /// level, depth first): what a binding builds its own tree from, with no TensorDict built (from
  /// Python a view of 5 leaves takes 1.2 us so, 2.5 through view()). The same pin as view()'s:
  /// held until the last of them is dropped.
  std::vector<std::pair<Key, at::Tensor>> view_leaves();
  /// Waits until a version newer than `version` is published and returns it: it checks for
  /// BoardOptions::spin, then sleeps on a futex (no spinning while idle); TimeoutError after
  /// `timeout`; PeerLostError once the writer's Board is destroyed (at once) or its process is
  /// gone (within 100 ms): no newer version can come to this board; open the name again for a new
  /// writer's.
  uint64_t wait_newer(uint64_t version, std::chrono::milliseconds timeout);
  /// The board's tree: keys, dtypes, shapes (a tree of zeros).
  TensorDict like() const;
  const std::string& name() const noexcept;
  bool is_writer() const noexcept;
  /// Closes it now, as its destructor does (the writer's readers are told, a reader's slot is
  /// freed once its views are gone too); every later call but name(), is_writer() and
  /// is_closed() is an Error, as on a Board moved from.
  void close() noexcept;
  bool is_closed() const noexcept;

 private:
  explicit Board(std::shared_ptr<detail::BoardState> state);
  detail::BoardState& state(const char* what) const;
  std::shared_ptr<detail::BoardState> state_;
};

}  // namespace tdshm
