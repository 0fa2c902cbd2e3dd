#pragma once
// The versioned board's file (include/tdshm/board.h): its layout and a process's state of it,
// shared by board_file.cpp (creating and opening) and board.cpp (publishing, reading, views).
//
// Layout (/dev/shm/tdshm-board.<name>, every offset from the header, checked by readers):
//   BoardHeader (256 bytes) | ReaderSlot[readers] (64 bytes each) | the encoded schema |
//   buffers, each a page-aligned BufferHead (64 bytes) + the tree's consolidated bytes.

#include <tdshm/board.h>
#include <tdshm/errors.h>
#include <tdshm/schema.h>

#include "shm/parts/futex.h"
#include "shm/parts/process_identity.h"
#include "shm/parts/trust.h"

#include <ATen/ops/from_blob.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tdshm {
namespace detail {

// Named, not anonymous: BoardState (a detail class) holds these.
namespace board_file {

constexpr uint64_t kBoardMagic = 0x314452414f424454ULL;  // "TDBOARD1"
constexpr uint32_t kBoardLayout = 1;
constexpr uint32_t kMaxReaders = 64;
constexpr uint64_t kWriting = ~uint64_t{0};
constexpr uint64_t kPage = 4096;
constexpr uint32_t kSlotFree = 0, kSlotClaiming = 1, kSlotLive = 2;
constexpr uint32_t kPinClaimed = ~uint32_t{0};  // a pin taken by a thread of its reader, no buffer yet

struct BoardHeader {
  uint64_t magic;
  uint32_t layout;
  uint32_t readers;
  uint32_t buffers;
  uint32_t reserved0;
  uint64_t tree_bytes;     // the consolidated tree (schema total_bytes)
  uint64_t buffer_stride;  // BufferHead + tree bytes, page-aligned
  uint64_t schema_offset;
  uint64_t schema_bytes;
  uint64_t buffers_offset;
  uint64_t file_bytes;
  uint32_t writer_pid;
  uint32_t writer_pid_ns;
  uint64_t writer_start_time;
  std::atomic<uint32_t> ready;               // 1 once everything above is written (release)
  std::atomic<uint32_t> closed;              // 1 once the writer's Board is gone: no newer version comes
  alignas(64) std::atomic<uint64_t> latest;  // version << 8 | buffer; 0: none yet
  std::atomic<uint32_t> wake;                // the low 32 bits of the latest version (futex word)
  std::atomic<uint32_t> sleepers;            // readers in wait_newer's futex wait
};
static_assert(sizeof(BoardHeader) <= 256);
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);
constexpr uint64_t kHeaderBytes = 256;

struct ReaderSlot {
  std::atomic<uint32_t> state;
  uint32_t pid;
  uint64_t start_time;
  uint32_t pid_ns;
  std::atomic<uint32_t> pins[Board::kPinsPerReader];  // buffer + 1; 0: none; kPinClaimed
  uint8_t pad[64 - 20 - 4 * Board::kPinsPerReader];
};
static_assert(sizeof(ReaderSlot) == 64);

struct BufferHead {
  std::atomic<uint64_t> stamp;  // the version its bytes hold; kWriting while written; 0: never
  uint8_t pad[56];
};
static_assert(sizeof(BufferHead) == 64);

inline uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

inline std::string board_path(const std::string& name) {
  return std::string(shm::kSegmentDir) + "/tdshm-board." + name;
}

void check_name(const std::string& name);

// The descriptor of the file `path` names, locked (flock, exclusive) while the name still refers
// to it (its stat in `st`), or -1 when the name is gone or was replaced meanwhile; SegmentError
// when another process holds the lock for 5 seconds. Whoever removes a board's name (a writer
// replacing a dead one's board, the last reader of such a board, `tdshm gc`) does it under this
// lock, so none removes a board another has just made.
int open_locked(const std::string& path, struct stat& st);

// Why the board of header `h` and reader slots `slots` is in use, or "" when its writer's process
// is gone and no reader's runs: what a dead writer's last reader and `tdshm gc` check, under the
// lock, before they remove its name.
std::string in_use_by(const BoardHeader& h, const ReaderSlot* slots);

struct Leaf {
  Key key;
  SchemaTensor tensor;
};

// The tree's leaves, sorted by key (sorted at each level, depth first: the order of the dicts
// Python's views and like() return). TypeError for a tree a board cannot hold.
std::vector<Leaf> board_leaves(const SchemaNode& root);

// `schema` with each leaf moved to a multiple of kLeafAlign in the buffer (consolidate packs them
// to 8 bytes: a complex128 view at 8 mod 16 crashed torch's kernels, as torch's own would).
constexpr uint64_t kLeafAlign = 64;  // what torch's CPU allocator gives every tensor
Schema aligned_leaves(const Schema& schema);

// How many times this process forked into a child so far in the child's view: a state made in a
// parent is inherited by the child when the numbers differ (see BoardState::inherited).
uint32_t fork_generation() noexcept;

// now + timeout, or the far future when that does not fit the clock (timedelta.max as "forever").
std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout);

/// The mapping of the board file, unmapped when the last Board or view of it is gone.
struct Mapping {
  uint8_t* base = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (base != nullptr) ::munmap(base, bytes);
  }
};

}  // namespace board_file

using namespace board_file;

class BoardState : public std::enable_shared_from_this<BoardState> {
 public:
  std::string name;
  bool writer = false;
  std::shared_ptr<Mapping> map;
  BoardHeader* header = nullptr;
  ReaderSlot* slots = nullptr;
  uint8_t* buffers = nullptr;
  Schema schema;
  uint64_t fingerprint = 0;  // schema_fingerprint(schema), for the views' trees
  std::vector<Leaf> leaves;
  ReaderSlot* mine = nullptr;         // a reader's slot
  uint64_t next_version = 1;          // the writer's
  std::chrono::microseconds spin{0};  // wait_newer's
  int64_t open_buffer = -1;           // the writer's buffer between begin() and commit()
  dev_t dev = 0;
  ino_t ino = 0;
  uint32_t fork_gen = fork_generation();
  std::mutex writing;  // publish, begin and commit of one writer's threads, one at a time

  // This process is a child forked from the one that made or opened the board: its copy must
  // not act for the parent (free its reader slot or pins, close or remove the parent's board).
  bool inherited() const noexcept { return fork_gen != fork_generation(); }
  void check_process(const char* what) const {
    if (inherited()) {
      throw Error(std::string("tdshm::Board::") + what + ": board '" + name +
                  "' was made or opened by the process this one was forked from; Board::open it here");
    }
  }

  ~BoardState() {
    if (inherited()) return;  // the parent's board: its slot, pins and name stay the parent's
    if (mine != nullptr) mine->state.store(kSlotFree, std::memory_order_release);  // views are gone too
    if (writer) {
      // Removes the name while it still refers to this board (readers' mappings stay valid).
      struct stat st {};
      const std::string path = board_path(name);
      if (::lstat(path.c_str(), &st) == 0 && st.st_dev == dev && st.st_ino == ino) ::unlink(path.c_str());
    } else if (!writer_alive()) {
      remove_if_abandoned();
    }
  }

  // The writer's Board is gone: readers' waits end (the wake word changes, sleepers are woken).
  void close_writer() noexcept {
    if (inherited()) return;
    header->closed.store(1, std::memory_order_seq_cst);
    header->wake.fetch_add(1, std::memory_order_seq_cst);
    shm::futex_wake_all(header->wake);
  }
  bool writer_alive() const {
    return shm::process_alive({header->writer_pid, header->writer_start_time, header->writer_pid_ns});
  }
  // The last reader of a board whose writer died removes its name (board_file.cpp).
  void remove_if_abandoned() const noexcept;

  uint32_t free_buffer(const char* what);
  std::atomic<uint32_t>* free_pin();
  uint64_t pin_latest(std::atomic<uint32_t>& pin, const char* what);
  at::Tensor pin_newest(const std::shared_ptr<BoardState>& self);
  uint64_t publish_buffer(uint32_t chosen);

  BufferHead& head(uint32_t b) const {
    return *reinterpret_cast<BufferHead*>(buffers + uint64_t{b} * header->buffer_stride);
  }
  uint8_t* bytes(uint32_t b) const { return buffers + uint64_t{b} * header->buffer_stride + sizeof(BufferHead); }

  /// Whether a live reader pins buffer `b`; a dead reader's pins are taken back on the way.
  bool pinned(uint32_t b) {
    for (uint32_t r = 0; r < header->readers; ++r) {
      ReaderSlot& s = slots[r];
      for (auto& pin : s.pins) {
        if (pin.load(std::memory_order_seq_cst) != b + 1) continue;
        const shm::ProcessId id{s.pid, s.start_time, s.pid_ns};
        if (s.state.load(std::memory_order_acquire) == kSlotLive && shm::alive_or_self(id)) return true;
        uint32_t expected = b + 1;
        pin.compare_exchange_strong(expected, 0, std::memory_order_acq_rel);  // a dead reader's
      }
    }
    return false;
  }

  /// Checks `td`'s tree against the board's: every leaf there with its dtype and shape, no other.
  void check_tree(const TensorDict& td, const char* what) const {
    for (const Leaf& l : leaves) {
      at::Tensor t;
      try {
        t = td.get(l.key);
      } catch (const std::exception&) {
        throw SchemaError(std::string("tdshm::Board::") + what + ": the tree has no tensor leaf " + l.key.str() +
                          ", which the board's has");
      }
      if (t.device().type() != c10::DeviceType::CPU || t.layout() != c10::kStrided) {
        throw TypeError(std::string("tdshm::Board::") + what + ": leaf " + l.key.str() + " is " +
                        (t.layout() != c10::kStrided ? "a " + c10::str(t.layout()) + " tensor"
                                                     : "a tensor on " + c10::str(t.device())) +
                        "; a board holds dense CPU tensors (.cpu() or .to_dense() it first)");
      }
      if (t.scalar_type() != l.tensor.dtype || t.sizes().vec() != l.tensor.shape) {
        throw SchemaError(std::string("tdshm::Board::") + what + ": leaf " + l.key.str() + " is " +
                          c10::toString(t.scalar_type()) + " " + c10::str(t.sizes()) + ", the board's is " +
                          c10::toString(l.tensor.dtype) + " " + c10::str(at::IntArrayRef(l.tensor.shape)));
      }
    }
    const std::vector<Key> keys = td.keys(/*include_nested=*/true, /*leaves_only=*/true);
    if (keys.size() != leaves.size()) {
      for (const Key& k : keys) {
        bool found = false;
        for (const Leaf& l : leaves) found = found || l.key == k;
        if (!found) {
          throw SchemaError(std::string("tdshm::Board::") + what + ": the tree has leaf " + k.str() +
                            ", which the board's has not");
        }
      }
    }
  }

  at::Tensor leaf_of(uint32_t b, const Leaf& l) const {
    return at::from_blob(bytes(b) + l.tensor.start, l.tensor.shape, at::TensorOptions().dtype(l.tensor.dtype));
  }

  // Copies a leaf between a tree and buffer b (check_tree made their dtypes and shapes equal): a
  // memcpy when the tree's tensor is contiguous and its bytes are its values (4 MiB in 69 us here
  // against ATen's copy kernel's 73), else copy_ (strided, or a conjugate or negative view, whose
  // values are not its bytes).
  void copy_leaf(uint32_t b, const Leaf& l, const at::Tensor& tree, bool to_tree) const {
    uint8_t* const board = bytes(b) + l.tensor.start;
    if (tree.is_contiguous() && !tree.is_conj() && !tree.is_neg()) {
      void* const t = tree.data_ptr();
      if (to_tree) {
        std::memcpy(t, board, tree.nbytes());
      } else {
        std::memcpy(board, t, tree.nbytes());
      }
    } else if (to_tree) {
      tree.copy_(leaf_of(b, l));
    } else {
      leaf_of(b, l).copy_(tree);
    }
  }
};

/// Frees a pin (claimed or holding a buffer) when it goes out of scope, unless `pin` is cleared.
struct PinRelease {
  std::atomic<uint32_t>* pin;
  ~PinRelease() {
    if (pin != nullptr) pin->store(0, std::memory_order_release);
  }
};

namespace board_file {

/// Maps `bytes` of the board file `fd` and wraps them in a state (header and slots placed).
std::shared_ptr<BoardState> map_board(const std::string& name, int fd, uint64_t bytes, bool writer);

}  // namespace board_file
}  // namespace detail
}  // namespace tdshm
