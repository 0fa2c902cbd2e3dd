// Creating and opening a versioned board (include/tdshm/board.h): its file, made exclusive and
// replaced when its writer died, checked field by field by the readers that open it.

#include "board/board_state.h"

#include "common/fd.h"

#include "shm/parts/futex.h"
#include "shm/parts/spin.h"

#include <ATen/ops/zeros.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <thread>

namespace tdshm {
namespace detail {
namespace board_file {

void check_name(const std::string& name) {
  bool ok = !name.empty() && name.size() <= 200;
  for (const char c : name)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  if (!ok || name.front() == '.') {
    throw SegmentError("tdshm::Board: name '" + name +
                       "' must be 1 to 200 letters, digits, '.', '_' or '-', not starting with '.'");
  }
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

// The tree's leaves, sorted by key (sorted at each level, depth first: the order of the dicts
// Python's views and like() return).
std::vector<Leaf> board_leaves(const SchemaNode& root) {
  std::vector<Leaf> out;
  collect_leaves(root, nullptr, out);
  std::sort(out.begin(), out.end(), [](const Leaf& a, const Leaf& b) { return a.key < b.key; });
  return out;
}

namespace {

// Copies `node` with its leaves placed from `cursor` on, in insertion order (the schema's rule),
// each at a multiple of kLeafAlign; `cursor` ends past the last one's 8-byte padding.
std::shared_ptr<SchemaNode> align_node(const SchemaNode& node, uint64_t& cursor) {
  auto out = std::make_shared<SchemaNode>(node);  // children replaced below: never the caller's
  for (SchemaEntry& e : out->entries) {
    if (auto* t = std::get_if<SchemaTensor>(&e.value)) {
      const uint64_t nbytes = t->stop - t->start;
      t->start = round_up(cursor, kLeafAlign);
      t->stop = t->start + nbytes;
      t->pad = static_cast<uint32_t>(round_up(t->stop, 8) - t->stop);
      cursor = t->stop + t->pad;
    } else if (auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value); child && *child) {
      *child = align_node(**child, cursor);
    }
  }
  return out;
}

}  // namespace

Schema aligned_leaves(const Schema& schema) {
  uint64_t cursor = 0;
  Schema out;
  out.root = *align_node(schema.root, cursor);
  out.total_bytes = round_up(cursor, 8);
  return out;
}

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
Board& Board::operator=(Board&& other) noexcept {
  if (this != &other) {
    if (state_ && state_->writer) state_->close_writer();
    state_ = std::move(other.state_);
  }
  return *this;
}
// The writer's Board ends its readers' waits; its file goes with the last tree of it (begin()).
Board::~Board() {
  if (state_ && state_->writer) state_->close_writer();
}

int detail::board_file::open_locked(const std::string& path, struct stat& st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return -1;
    throw shm::open_error(path, "board", errno);
  }
  // Held for a few checks, or while a writer sizes a new board (posix_fallocate: ~0.3 s a GiB).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if ((errno != EWOULDBLOCK && errno != EINTR) || std::chrono::steady_clock::now() > give_up) {
      const int err = errno;
      ::close(fd);
      throw SegmentError(
          "tdshm::Board: cannot lock '" + path + "': " +
          (err == EWOULDBLOCK ? std::string("another process holds it (a writer creating it?)") : std::strerror(err)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  struct stat now {};
  if (::fstat(fd, &st) != 0 || ::lstat(path.c_str(), &now) != 0 || now.st_dev != st.st_dev || now.st_ino != st.st_ino) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Creates the board's file `path` (0600, exclusive) and returns its descriptor. A file left by a
// dead writer is replaced; one whose writer lives is refused (SegmentError).
static int create_board_file(const std::string& path, const std::string& name) {
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) return fd;
    if (errno != EEXIST || attempt > 2) throw shm::open_error(path, "board", errno);
    // Held by a live writer, or left by a dead one (replaced).
    struct stat st {};
    const int old = detail::open_locked(path, st);
    if (old < 0) continue;  // removed or replaced meanwhile
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
    if (!live) ::unlink(path.c_str());
    ::close(old);
    if (live) throw SegmentError("tdshm::Board::create: the board '" + name + "' has a live writer");
  }
}

Board Board::create(const std::string& name, const TensorDict& like, BoardOptions options) {
  detail::check_name(name);
  if (options.readers == 0 || options.readers > detail::kMaxReaders) {
    throw SegmentError("tdshm::Board::create: readers must be 1 to 64, got " + std::to_string(options.readers));
  }
  const TensorDict c = like.consolidate();
  Schema schema = detail::aligned_leaves(c.schema());
  std::vector<detail::Leaf> leaves = detail::board_leaves(schema.root);
  const std::vector<uint8_t> encoded = encode_schema(schema);
  const uint32_t buffers = options.readers * kPinsPerReader + 2;
  const uint64_t schema_offset = detail::kHeaderBytes + uint64_t{options.readers} * sizeof(detail::ReaderSlot);
  const uint64_t buffers_offset = detail::round_up(schema_offset + encoded.size(), detail::kPage);
  const uint64_t stride = detail::round_up(sizeof(detail::BufferHead) + schema.total_bytes, detail::kPage);
  const uint64_t file_bytes = buffers_offset + stride * buffers;

  const std::string path = detail::board_path(name);
  // Locked until its header is ready: a writer that would replace a dead writer's board, or a
  // reader's or gc's clean-up, finds a file without a header yet and waits for the lock instead
  // of taking it for a dead writer's.
  const detail::Fd fd(create_board_file(path, name));
  (void)::flock(fd.get(), LOCK_EX);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || ::ftruncate(fd.get(), static_cast<off_t>(file_bytes)) != 0 ||
      ::posix_fallocate(fd.get(), 0, static_cast<off_t>(file_bytes)) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    throw SegmentError("tdshm::Board::create: cannot size '" + path + "' to " + std::to_string(file_bytes) +
                       " bytes: " + std::strerror(err) + " (is /dev/shm large enough?)");
  }
  std::shared_ptr<BoardState> s;
  try {
    s = detail::map_board(name, fd.get(), file_bytes, /*writer=*/true);
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
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
  (void)::flock(fd.get(), LOCK_UN);  // closing would not unlock: the mapping holds the file open
  return Board(std::move(s));
}

// Why the file at `fd` (no whole board header: `whole`, `magic` as read) will never be a board,
// or "" while a writer may still be making it: that writer holds the file's lock, and the file
// changed in the last 5 s (see `tdshm gc`). Waiting out the timeout for such a file told nothing.
static std::string no_board_coming(int fd, const struct stat& st, bool whole, uint64_t magic) {
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) return "";  // its writer is making it
  (void)::flock(fd, LOCK_UN);
  if (whole && magic != 0 && magic != detail::kBoardMagic) return "is not a board (another file under its name)";
  if (::time(nullptr) - st.st_mtime < 5) return "";
  return "holds no board: its writer died while making it, or it was cut short (`tdshm gc` removes it; "
         "Board::create of the name replaces it)";
}

Board Board::open(const std::string& name, BoardOptions options) {
  detail::check_name(name);
  const std::string path = detail::board_path(name);
  const auto until = detail::deadline_after(options.timeout);
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno != ENOENT) throw shm::open_error(path, "board", errno);
    if (fd >= 0) {
      std::shared_ptr<BoardState> s;
      struct stat st {};
      try {
        shm::check_owned(fd, path, "board", &st);
        detail::BoardHeader h{};
        const bool whole = ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h);
        if (whole && h.magic == detail::kBoardMagic && static_cast<uint64_t>(st.st_size) >= h.file_bytes &&
            h.file_bytes != 0) {
          s = detail::map_board(name, fd, h.file_bytes, /*writer=*/false);
          if (s->header->ready.load(std::memory_order_acquire) != 1) {
            if (const std::string why = no_board_coming(fd, st, whole, h.magic); !why.empty()) {
              throw SegmentError("tdshm::Board::open: '" + path + "' " + why);
            }
          }
        } else if (const std::string why = no_board_coming(fd, st, whole, h.magic); !why.empty()) {
          throw SegmentError("tdshm::Board::open: '" + path + "' " + why);
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
        s->dev = st.st_dev;  // a board: the last reader removes it once its writer is dead
        s->ino = st.st_ino;
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

std::string detail::board_file::in_use_by(const BoardHeader& h, const ReaderSlot* slots) {
  if (shm::process_alive({h.writer_pid, h.writer_start_time, h.writer_pid_ns})) {
    return "its writer (pid " + std::to_string(h.writer_pid) + ")" +
           (h.ready.load(std::memory_order_acquire) == 1 ? " runs" : " is creating it");
  }
  for (uint32_t r = 0; r < h.readers; ++r) {
    const uint32_t state = slots[r].state.load(std::memory_order_acquire);
    if (state == kSlotClaiming ||
        (state == kSlotLive && shm::process_alive({slots[r].pid, slots[r].start_time, slots[r].pid_ns}))) {
      return "its writer is gone, but reader pid " + std::to_string(slots[r].pid) + " has it open";
    }
  }
  return "";
}

void detail::BoardState::remove_if_abandoned() const noexcept {
  if (dev == 0 && ino == 0) return;  // not a board this process opened
  try {
    const std::string path = board_path(name);
    struct stat st {};
    const int fd = detail::open_locked(path, st);
    if (fd < 0) return;
    if (st.st_dev == dev && st.st_ino == ino && in_use_by(*header, slots).empty()) ::unlink(path.c_str());
    ::close(fd);
  } catch (...) {
    // A name this reader cannot lock or open stays: the next writer of the name replaces it.
  }
}

}  // namespace tdshm
