// The versioned board (include/tdshm/board.h): its file's layout, the writer's publish and the
// readers' pins, copies and waits.
//
// Layout (/dev/shm/tdshm-board.<name>, every offset from the header, checked by readers):
//   BoardHeader (256 bytes) | ReaderSlot[readers] (64 bytes each) | the encoded schema |
//   buffers, each a page-aligned BufferHead (64 bytes) + the tree's consolidated bytes.
// Protocol: `latest` holds (version << 8 | buffer). The writer picks a buffer that is neither the
// latest nor pinned by a live reader, stamps it "writing", writes, stamps it with the version and
// publishes it (seq_cst). A view pins the latest buffer (seq_cst) and checks `latest` again: the
// writer's check of the pins then sees the pin (a Dekker pair), so it never writes a pinned
// buffer. A copy reads as a seqlock reader does (stamp, bytes, fence, stamp), so it needs no pin.

#include "tdshm/board.h"

#include "shm/parts/futex.h"
#include "shm/parts/process_identity.h"
#include "shm/parts/spin.h"
#include "shm/parts/trust.h"
#include "tensordict/impl.h"

#include <tdshm/errors.h>
#include <tdshm/schema.h>

#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
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
  std::atomic<uint32_t> ready;  // 1 once everything above is written (release)
  uint32_t reserved1;
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
  std::atomic<uint32_t> pins[Board::kPinsPerReader];  // buffer + 1; 0: none
  uint8_t pad[64 - 20 - 4 * Board::kPinsPerReader];
};
static_assert(sizeof(ReaderSlot) == 64);

struct BufferHead {
  std::atomic<uint64_t> stamp;  // the version its bytes hold; kWriting while written; 0: never
  uint8_t pad[56];
};
static_assert(sizeof(BufferHead) == 64);

uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

std::string board_path(const std::string& name) { return std::string(shm::kSegmentDir) + "/tdshm-board." + name; }

void check_name(const std::string& name) {
  bool ok = !name.empty() && name.size() <= 200;
  for (const char c : name)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  if (!ok || name.front() == '.') {
    throw SegmentError("tdshm::Board: name '" + name +
                       "' must be 1 to 200 letters, digits, '.', '_' or '-', not starting with '.'");
  }
}

struct Leaf {
  Key key;
  SchemaTensor tensor;
};

// The tree's leaves, sorted by key (sorted at each level, depth first: the order of the dicts
// Python's views and like() return).
void collect_leaves(const SchemaNode& node, const Key* prefix, std::vector<Leaf>& out);
std::vector<Leaf> board_leaves(const SchemaNode& root) {
  std::vector<Leaf> out;
  collect_leaves(root, nullptr, out);
  std::sort(out.begin(), out.end(), [](const Leaf& a, const Leaf& b) { return a.key < b.key; });
  return out;
}

void collect_leaves(const SchemaNode& node, const Key* prefix, std::vector<Leaf>& out) {
  if (!node.class_name.empty() || node.lazy_stack_dim) {
    throw TypeError("tdshm::Board: trees of plain nested TensorDicts only (a tensorclass or a lazy stack is not)");
  }
  for (const SchemaEntry& e : node.entries) {
    Key key = prefix ? *prefix / e.key : Key(e.key);
    if (const auto* t = std::get_if<SchemaTensor>(&e.value)) {
      out.push_back({std::move(key), *t});
    } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value); child && *child) {
      collect_leaves(**child, &key, out);
    } else {
      throw TypeError("tdshm::Board: leaf " + key.str() + " is not a tensor (non-tensor values are not published)");
    }
  }
}

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
  uint32_t last_buffer = 0;           // the writer's last choice (round robin keeps pages warm evenly)
  int64_t open_buffer = -1;           // the writer's buffer between begin() and commit()
  dev_t dev = 0;
  ino_t ino = 0;

  ~BoardState() {
    if (mine != nullptr) mine->state.store(kSlotFree, std::memory_order_release);  // views are gone too
    if (writer) {
      // Removes the name while it still refers to this board (readers' mappings stay valid).
      struct stat st {};
      const std::string path = board_path(name);
      if (::lstat(path.c_str(), &st) == 0 && st.st_dev == dev && st.st_ino == ino) ::unlink(path.c_str());
    }
  }

  uint32_t free_buffer(const char* what);
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
  // memcpy when the tree's tensor is contiguous (4 MiB in 69 us here against ATen's copy kernel's
  // 73), else copy_.
  void copy_leaf(uint32_t b, const Leaf& l, const at::Tensor& tree, bool to_tree) const {
    uint8_t* const board = bytes(b) + l.tensor.start;
    if (tree.is_contiguous()) {
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

namespace board_file {

std::shared_ptr<BoardState> map_board(const std::string& name, int fd, uint64_t bytes, bool writer) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw SegmentError("tdshm::Board '" + name + "': mmap failed: " + std::strerror(errno));
  auto state = std::make_shared<BoardState>();
  state->name = name;
  state->writer = writer;
  state->map = std::make_shared<Mapping>();
  state->map->base = static_cast<uint8_t*>(p);
  state->map->bytes = bytes;
  state->header = reinterpret_cast<BoardHeader*>(p);
  state->slots = reinterpret_cast<ReaderSlot*>(state->map->base + kHeaderBytes);
  return state;
}

}  // namespace board_file
}  // namespace detail

using detail::BoardState;

Board::Board(std::shared_ptr<detail::BoardState> state) : state_(std::move(state)) {}
Board::Board(Board&&) noexcept = default;
Board& Board::operator=(Board&&) noexcept = default;
Board::~Board() = default;

// Creates the board's file `path` (0600, exclusive) and returns its descriptor. A file left by a
// dead writer is replaced; one whose writer lives is refused (SegmentError).
static int create_board_file(const std::string& path, const std::string& name) {
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) break;
    if (errno != EEXIST || attempt > 0) throw shm::open_error(path, "board", errno);
    // Held by a live writer, or left by a dead one (replaced).
    struct stat st {};
    const int old = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (old < 0) throw shm::open_error(path, "board", errno);
    bool live = false;
    try {
      shm::check_owned(old, path, "board", &st);
      detail::BoardHeader h{};
      if (::pread(old, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h) && h.magic == detail::kBoardMagic) {
        live = shm::process_alive({h.writer_pid, h.writer_start_time, h.writer_pid_ns});
      }
    } catch (...) {
      ::close(old);
      throw;
    }
    ::close(old);
    if (live) throw SegmentError("tdshm::Board::create: the board '" + name + "' has a live writer");
    ::unlink(path.c_str());
  }
  return fd;
}

Board Board::create(const std::string& name, const TensorDict& like, BoardOptions options) {
  detail::check_name(name);
  if (options.readers == 0 || options.readers > detail::kMaxReaders) {
    throw SegmentError("tdshm::Board::create: readers must be 1 to 64, got " + std::to_string(options.readers));
  }
  const TensorDict c = like.consolidate();
  Schema schema = c.schema();
  std::vector<detail::Leaf> leaves = detail::board_leaves(schema.root);
  const std::vector<uint8_t> encoded = encode_schema(schema);
  const uint32_t buffers = options.readers * kPinsPerReader + 2;
  const uint64_t schema_offset = detail::kHeaderBytes + uint64_t{options.readers} * sizeof(detail::ReaderSlot);
  const uint64_t buffers_offset = detail::round_up(schema_offset + encoded.size(), detail::kPage);
  const uint64_t stride = detail::round_up(sizeof(detail::BufferHead) + schema.total_bytes, detail::kPage);
  const uint64_t file_bytes = buffers_offset + stride * buffers;

  const std::string path = detail::board_path(name);
  const int fd = create_board_file(path, name);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || ::ftruncate(fd, static_cast<off_t>(file_bytes)) != 0 ||
      ::posix_fallocate(fd, 0, static_cast<off_t>(file_bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    throw SegmentError("tdshm::Board::create: cannot size '" + path + "' to " + std::to_string(file_bytes) +
                       " bytes: " + std::strerror(err) + " (is /dev/shm large enough?)");
  }
  std::shared_ptr<BoardState> s;
  try {
    s = detail::map_board(name, fd, file_bytes, /*writer=*/true);
  } catch (...) {
    ::close(fd);
    ::unlink(path.c_str());
    throw;
  }
  ::close(fd);
  s->dev = st.st_dev;
  s->ino = st.st_ino;
  detail::BoardHeader& h = *s->header;
  h.magic = detail::kBoardMagic;
  h.layout = detail::kBoardLayout;
  h.readers = options.readers;
  h.buffers = buffers;
  h.tree_bytes = schema.total_bytes;
  h.buffer_stride = stride;
  h.schema_offset = schema_offset;
  h.schema_bytes = encoded.size();
  h.buffers_offset = buffers_offset;
  h.file_bytes = file_bytes;
  const shm::ProcessId me = shm::self_process();
  h.writer_pid = me.pid;
  h.writer_pid_ns = me.pid_ns;
  h.writer_start_time = me.start_time;
  std::memcpy(s->map->base + schema_offset, encoded.data(), encoded.size());
  s->buffers = s->map->base + buffers_offset;
  s->schema = std::move(schema);
  s->fingerprint = schema_fingerprint(s->schema);
  s->leaves = std::move(leaves);
  s->spin = options.spin;
  h.ready.store(1, std::memory_order_release);
  return Board(std::move(s));
}

Board Board::open(const std::string& name, BoardOptions options) {
  detail::check_name(name);
  const std::string path = detail::board_path(name);
  const auto until = std::chrono::steady_clock::now() + options.timeout;
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno != ENOENT) throw shm::open_error(path, "board", errno);
    if (fd >= 0) {
      std::shared_ptr<BoardState> s;
      try {
        struct stat st {};
        shm::check_owned(fd, path, "board", &st);
        detail::BoardHeader h{};
        const bool whole = ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h);
        if (whole && h.magic == detail::kBoardMagic && static_cast<uint64_t>(st.st_size) >= h.file_bytes &&
            h.file_bytes != 0) {
          s = detail::map_board(name, fd, h.file_bytes, /*writer=*/false);
        }
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
      if (s && s->header->ready.load(std::memory_order_acquire) == 1) {
        // Read once, check, then use: the header's numbers must describe the file mapped.
        const detail::BoardHeader& h = *s->header;
        const bool sane =
            h.layout == detail::kBoardLayout && h.readers >= 1 && h.readers <= detail::kMaxReaders &&
            h.buffers == h.readers * kPinsPerReader + 2 &&
            h.schema_offset == detail::kHeaderBytes + uint64_t{h.readers} * sizeof(detail::ReaderSlot) &&
            h.buffer_stride == detail::round_up(sizeof(detail::BufferHead) + h.tree_bytes, detail::kPage) &&
            h.buffers_offset == detail::round_up(h.schema_offset + h.schema_bytes, detail::kPage) &&
            h.file_bytes == h.buffers_offset + h.buffer_stride * h.buffers;
        if (!sane) throw SegmentError("tdshm::Board::open: '" + path + "' is not a board of this layout");
        s->schema = decode_schema({s->map->base + h.schema_offset, h.schema_bytes}, h.tree_bytes);
        s->fingerprint = schema_fingerprint(s->schema);
        s->leaves = detail::board_leaves(s->schema.root);
        s->buffers = s->map->base + h.buffers_offset;
        // A free slot, or a dead reader's.
        const shm::ProcessId me = shm::self_process();
        for (uint32_t r = 0; r < h.readers && s->mine == nullptr; ++r) {
          detail::ReaderSlot& slot = s->slots[r];
          uint32_t state = slot.state.load(std::memory_order_acquire);
          if (state == detail::kSlotLive && shm::process_alive({slot.pid, slot.start_time, slot.pid_ns})) continue;
          if (state == detail::kSlotClaiming) continue;
          if (!slot.state.compare_exchange_strong(state, detail::kSlotClaiming, std::memory_order_acq_rel)) continue;
          slot.pid = me.pid;
          slot.start_time = me.start_time;
          slot.pid_ns = me.pid_ns;
          for (auto& pin : slot.pins) pin.store(0, std::memory_order_relaxed);
          slot.state.store(detail::kSlotLive, std::memory_order_release);
          s->mine = &slot;
        }
        if (s->mine == nullptr) {
          throw SegmentError("tdshm::Board::open: every one of the " + std::to_string(h.readers) +
                             " reader slots of '" + name + "' is held by a live reader (BoardOptions::readers)");
        }
        s->spin = options.spin;
        return Board(std::move(s));
      }
    }
    if (std::chrono::steady_clock::now() >= until) {
      throw TimeoutError("tdshm::Board::open: no board '" + name + "' within " +
                         std::to_string(options.timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

namespace detail {

// A buffer the writer may write: neither the latest nor pinned by a live reader (one always
// exists: see BoardState).
uint32_t BoardState::free_buffer(const char* what) {
  if (!writer)
    throw Error(std::string("tdshm::Board::") + what +
                ": this Board is a reader (Board::open); the writer made it with create");
  if (open_buffer >= 0) throw Error(std::string("tdshm::Board::") + what + ": a begin() is open; commit() it first");
  const uint64_t latest = header->latest.load(std::memory_order_relaxed);  // only this writer stores it
  const uint32_t count = header->buffers;
  for (uint32_t step = 1; step <= count; ++step) {
    const uint32_t c = (last_buffer + step) % count;
    if (latest != 0 && c == (latest & 0xff)) continue;
    if (!pinned(c)) {
      head(c).stamp.store(kWriting, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);  // the stamp before any byte (copy readers)
      return c;
    }
  }
  throw Error(std::string("tdshm::Board::") + what + ": every buffer is held (a reader broke the protocol)");
}

// Publishes buffer `chosen`, written since free_buffer, as the next version.
uint64_t BoardState::publish_buffer(uint32_t chosen) {
  const uint64_t version = next_version++;
  head(chosen).stamp.store(version, std::memory_order_release);
  header->latest.store(version << 8 | chosen, std::memory_order_seq_cst);
  last_buffer = chosen;
  header->wake.store(static_cast<uint32_t>(version), std::memory_order_seq_cst);
  if (header->sleepers.load(std::memory_order_seq_cst) != 0) shm::futex_wake_all(header->wake);
  return version;
}

}  // namespace detail

uint64_t Board::publish(const TensorDict& td) {
  BoardState& s = *state_;
  s.check_tree(td, "publish");
  const uint32_t chosen = s.free_buffer("publish");
  for (const detail::Leaf& l : s.leaves) s.copy_leaf(chosen, l, td.get(l.key), /*to_tree=*/false);
  return s.publish_buffer(chosen);
}

TensorDict Board::begin() {
  BoardState& s = *state_;
  const uint32_t chosen = s.free_buffer("begin");
  s.open_buffer = static_cast<int64_t>(chosen);
  auto keep = state_;  // the mapping lives as long as the tree
  at::Tensor storage = at::from_blob(
      s.bytes(chosen), {static_cast<int64_t>(s.header->tree_bytes)}, [keep](void*) {},
      at::TensorOptions().dtype(at::kByte));
  return TensorDict::from_consolidated(storage, s.schema);
}

uint64_t Board::commit() {
  BoardState& s = *state_;
  if (s.open_buffer < 0) throw Error("tdshm::Board::commit: no begin() is open");
  const auto chosen = static_cast<uint32_t>(s.open_buffer);
  s.open_buffer = -1;
  return s.publish_buffer(chosen);
}

uint64_t Board::version() const { return state_->header->latest.load(std::memory_order_acquire) >> 8; }

uint64_t Board::read(TensorDict& td) {
  BoardState& s = *state_;
  s.check_tree(td, "read");
  for (;;) {
    const uint64_t latest = s.header->latest.load(std::memory_order_acquire);
    if (latest == 0) return 0;
    const uint32_t b = static_cast<uint32_t>(latest & 0xff);
    const uint64_t version = latest >> 8;
    if (b >= s.header->buffers) throw TransportError("tdshm::Board::read: the board names buffer " + std::to_string(b));
    detail::BufferHead& head = s.head(b);
    if (head.stamp.load(std::memory_order_acquire) != version) continue;  // rewritten meanwhile: newer exists
    for (const detail::Leaf& l : s.leaves) s.copy_leaf(b, l, td.get(l.key), /*to_tree=*/true);
    std::atomic_thread_fence(std::memory_order_acquire);  // the bytes before the stamp's second read
    if (head.stamp.load(std::memory_order_relaxed) == version) return version;
  }
}

// The newest version's bytes as one uint8 tensor, pinned by one of this reader's pins until the
// tensor (and every view of it) is dropped (Board::view, view_leaves).
at::Tensor BoardState::pin_newest(const std::shared_ptr<BoardState>& self) {
  if (mine == nullptr) throw Error("tdshm::Board::view: the writer has no reader slot; views are for readers");
  std::atomic<uint32_t>* pin = nullptr;
  for (auto& p : mine->pins) {
    if (p.load(std::memory_order_relaxed) == 0) {
      pin = &p;
      break;
    }
  }
  if (pin == nullptr) {
    throw Error("tdshm::Board::view: this reader holds " + std::to_string(Board::kPinsPerReader) +
                " versions as views already; drop one (or copy with read())");
  }
  uint64_t latest = 0;
  for (;;) {
    latest = header->latest.load(std::memory_order_seq_cst);
    if (latest == 0) {
      pin->store(0, std::memory_order_relaxed);
      throw Error("tdshm::Board::view: nothing published yet (wait_newer(0, ...) first)");
    }
    const uint32_t b = static_cast<uint32_t>(latest & 0xff);
    if (b >= header->buffers) throw TransportError("tdshm::Board::view: the board names buffer " + std::to_string(b));
    pin->store(b + 1, std::memory_order_seq_cst);
    if (header->latest.load(std::memory_order_seq_cst) == latest) break;  // the writer sees the pin now
  }
  const uint32_t b = static_cast<uint32_t>(latest & 0xff);
  if (head(b).stamp.load(std::memory_order_acquire) != latest >> 8) {
    pin->store(0, std::memory_order_release);
    throw TransportError("tdshm::Board::view: buffer " + std::to_string(b) + " does not hold the version published");
  }
  // One storage over the buffer's bytes: the pin goes when the last view of it is dropped.
  return at::from_blob(
      bytes(b), {static_cast<int64_t>(header->tree_bytes)},
      [keep = self, pin](void*) { pin->store(0, std::memory_order_release); }, at::TensorOptions().dtype(at::kByte));
}

// (The schema was validated against tree_bytes, the pinned storage's size, when the board was
// made or opened.)
TensorDict Board::view() {
  return detail::from_checked_consolidated(state_->pin_newest(state_), state_->schema, state_->fingerprint);
}

std::vector<std::pair<Key, at::Tensor>> Board::view_leaves() {
  const at::Tensor storage = state_->pin_newest(state_);
  std::vector<std::pair<Key, at::Tensor>> out;
  out.reserve(state_->leaves.size());
  for (const detail::Leaf& l : state_->leaves) {
    out.emplace_back(l.key, detail::view_into(storage, l.tensor.start, l.tensor.dtype, l.tensor.shape));
  }
  return out;
}

uint64_t Board::wait_newer(uint64_t version, std::chrono::milliseconds timeout) {
  BoardState& s = *state_;
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + timeout;
  // A version due soon is seen at once; one that is not costs spin of a CPU, then nothing.
  const auto spin_until = start + std::min<std::chrono::steady_clock::duration>(s.spin, timeout);
  for (uint32_t i = 0;; ++i) {
    if (const uint64_t v = this->version(); v > version) return v;
    detail::cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= spin_until) break;
  }
  for (;;) {
    const uint64_t now_version = this->version();
    if (now_version > version) return now_version;
    const auto left = until - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero()) {
      throw TimeoutError("tdshm::Board::wait_newer: no version newer than " + std::to_string(version) + " within " +
                         std::to_string(timeout.count()) + " ms");
    }
    s.header->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t word = s.header->wake.load(std::memory_order_seq_cst);
    if (this->version() <= version) {
      shm::futex_wait(s.header->wake, word, std::min<std::chrono::nanoseconds>(left, std::chrono::milliseconds(100)));
    }
    s.header->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

TensorDict Board::like() const {
  const BoardState& s = *state_;
  TensorDict zeros =
      TensorDict::from_consolidated(at::zeros({static_cast<int64_t>(s.header->tree_bytes)}, at::kByte), s.schema)
          .clone();
  zeros.unlock_();
  return zeros;
}

const std::string& Board::name() const noexcept { return state_->name; }
bool Board::is_writer() const noexcept { return state_->writer; }

}  // namespace tdshm
