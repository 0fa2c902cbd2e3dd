// Hostile peers: a rank of the group that is buggy. It joins the group like any rank (it constructs
// its ProcessGroupShm, so the rendezvous completes), then maps the segment itself and writes raw
// entries into its ring towards rank 0, or truncates the segment file under everyone's mappings.
//
// The promise under test (process_group.h, engine.h): every value read from shared memory is read
// once and validated; every declared size is bounded by what the receive can take before anything
// is allocated; a corrupt entry fails that pair's transfers with a TransportError and leaves the
// other pairs working; a truncated segment fails the group's transfers with a TransportError that
// says "truncated" instead of killing anyone with SIGBUS; ShmOptions::max_unexpected_bytes keeps
// early messages in their ring (back-pressure) without dropping any.
//
// Every rank runs in a forked child (Child), the victim too: a crash is a failed test, not a
// crashed test binary. The victim receives into a tensor that is a view inside a larger buffer
// filled with guard bytes, and checks after each case that the guards are untouched and that the
// outcome is either a clear error or the right bytes. Every wait has a deadline.
//
// The raw entries are laid out with the structs and segment_geometry of shm/layout/segment_layout.h,
// offsets computed from the header, never hard-coded. The ring protocol: the producer fills the
// entry at position p (entry p % ring_entries), stores seq = seq_word(p) (release), then head = p + 1;
// a fresh group's rings start at position 0, and the hostile rank sends nothing through its
// engine, so its raw entries start at 0.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shm/layout/segment_layout.h"
#include "shm/parts/futex.h"
#include "shm_test_support.h"

namespace tdshm::test {
namespace {

using shm::EntryHeader;

constexpr uint8_t kByteDtype = static_cast<uint8_t>(at::kByte);
constexpr uint64_t kTiB = uint64_t{1} << 40;

// ---------------------------------------------------------------------------------------------
// The victim's receive buffer: a view inside a larger buffer of guard bytes

class GuardedRecv {
 public:
  static constexpr int64_t kBefore = 1024;
  static constexpr uint8_t kFill = 0xAB;

  /// `bytes` bytes at [1024, 1024 + bytes) of a buffer of at least 4096 bytes filled with 0xAB.
  explicit GuardedRecv(int64_t bytes)
      : bytes_(bytes),
        total_(std::max<int64_t>(4096, kBefore + bytes + kBefore)),
        buffer_(at::full({total_}, kFill, at::kByte)),
        view_(buffer_.narrow(0, kBefore, bytes)) {}

  const at::Tensor& view() const { return view_; }

  /// "" when every guard byte is still 0xAB, else where the first damaged one is.
  std::string damage() const {
    const auto* p = buffer_.data_ptr<uint8_t>();
    for (int64_t i = 0; i < total_; ++i) {
      if (i == kBefore) i = kBefore + bytes_;  // skip the tensor itself
      if (i >= total_) break;
      if (p[i] != kFill) {
        return "guard byte " + std::to_string(i < kBefore ? i - kBefore : i - kBefore - bytes_) +
               (i < kBefore ? " (before the tensor)" : " (past the tensor's end)") + " is " + std::to_string(p[i]) +
               ", not " + std::to_string(kFill);
      }
    }
    return {};
  }

 private:
  int64_t bytes_;
  int64_t total_;
  at::Tensor buffer_;
  at::Tensor view_;
};

#define CHECK_GUARDS(g, context)                                                                      \
  do {                                                                                                \
    const std::string hostile_damage_ = (g).damage();                                                 \
    SHM_CHECK(hostile_damage_.empty(), context << ": wrote outside its tensor: " << hostile_damage_); \
  } while (false)

// ---------------------------------------------------------------------------------------------
// Raw entries in the ring src -> dst, written by the hostile rank

/// The fields of an entry after seq.
struct Fields {
  int64_t tag = 0;
  uint64_t total = 0;
  uint64_t offset = 0;
  uint32_t chunk = 0;
  uint32_t flags = 0;
  uint8_t dtype = kByteDtype;
  uint8_t ndim = 1;
};

template <typename T>
void store_relaxed(T& field, T value) {
  // The flipping tests rewrite fields from two threads of the hostile process: atomic stores keep
  // that free of data races within the process (the victim reads them from another process).
  std::atomic_ref<T>(field).store(value, std::memory_order_relaxed);
}

class RingWriter {
 public:
  /// Maps the segment `name` and finds the ring src -> dst from its header and segment_geometry.
  RingWriter(const std::string& name, int src, int dst) : seg_(name), src_(src), dst_(dst) {
    const shm::SegmentHeader& h = seg_.header();
    SHM_CHECK(h.layout_version.load(std::memory_order_acquire) == shm::kLayoutVersion,
              "the segment's layout version is " << h.layout_version.load());
    world_ = h.world_size;
    entries_ = h.ring_entries;
    slot_ = h.slot_bytes;
    slots_ = h.slots_per_rank;
    geo_ = shm::segment_geometry(world_, slot_, entries_, slots_, h.window_bytes, h.loan_tickets, h.loan_bytes);
    SHM_CHECK(h.rank_table_offset == geo_.rank_table_offset && h.rings_offset == geo_.rings_offset &&
                  h.ring_bytes == geo_.ring_bytes && h.entry_bytes == geo_.entry_bytes &&
                  h.arena_offset == geo_.arena_offset && h.region_bytes == geo_.region_bytes &&
                  h.window_offset == geo_.window_offset &&
                  h.segment_bytes == geo_.segment_bytes && geo_.segment_bytes == seg_.size(),
              "the header's geometry disagrees with segment_geometry");
    SHM_CHECK(src >= 0 && dst >= 0 && static_cast<uint32_t>(src) < world_ && static_cast<uint32_t>(dst) < world_);
    ring_ = seg_.data() + geo_.rings_offset +
            (uint64_t{static_cast<uint32_t>(src)} * world_ + static_cast<uint32_t>(dst)) * geo_.ring_bytes;
    key_ = shm::ring_key(h.incarnation, static_cast<uint32_t>(src), static_cast<uint32_t>(dst));
  }

  /// What the entry of `pos` holds in seq once published (segment_layout.h: seq_word).
  uint64_t seq_word(uint64_t pos) const { return shm::seq_word(key_, pos); }

  uint64_t slot_bytes() const { return slot_; }
  uint32_t ring_entries() const { return entries_; }

  shm::RingControl& control() const { return *reinterpret_cast<shm::RingControl*>(ring_); }
  std::byte* entry_base(uint64_t pos) const {
    return ring_ + sizeof(shm::RingControl) + (pos % entries_) * geo_.entry_bytes;
  }
  EntryHeader& header(uint64_t pos) const { return *reinterpret_cast<EntryHeader*>(entry_base(pos)); }
  shm::EntryTail& entry_tail(uint64_t pos) const {
    return *reinterpret_cast<shm::EntryTail*>(entry_base(pos) + shm::kEntryTailOffset);
  }
  /// The arena slot the entry at `pos` uses when its chunk does not fit inline: one per position
  /// (slots_per_rank >= ring_entries in these tests, so the consumer freed it with the entry).
  uint32_t slot_of(uint64_t pos) const { return static_cast<uint32_t>(pos % slots_); }
  std::atomic<uint32_t>& slot_state(uint32_t slot) const {
    return reinterpret_cast<shm::ArenaSlot*>(region())[slot].state;
  }
  /// The payload bytes of the entry at `pos` when it is not inline: its arena slot.
  uint8_t* payload(uint64_t pos) const {
    return reinterpret_cast<uint8_t*>(region() + geo_.slot_table_bytes + uint64_t{slot_of(pos)} * geo_.slot_stride);
  }
  uint8_t* inline_bytes(uint64_t pos) const { return reinterpret_cast<uint8_t*>(entry_base(pos) + sizeof(EntryHeader)); }
  shm::EntryShape& shape(uint64_t pos) const {
    return *reinterpret_cast<shm::EntryShape*>(entry_base(pos) + shm::kEntryShapeOffset);
  }
  uint64_t tail() const { return control().tail.load(std::memory_order_acquire); }

  /// The sender's loan region: ticket `t` (handed to a rank r as r + 1) and its heap.
  std::atomic<uint32_t>& loan_ticket(uint32_t t) const {
    SHM_CHECK(t < seg_.header().loan_tickets, "no loan ticket " << t);
    return reinterpret_cast<shm::LoanTicket*>(loan_region())[t].state;
  }
  uint8_t* loan_heap() const { return reinterpret_cast<uint8_t*>(loan_region() + geo_.loan_table_bytes); }
  uint64_t loan_heap_bytes() const { return geo_.loan_bytes; }

  /// Waits until the consumer has freed the entry of position `pos`; false if `give_up` said so
  /// first. Throws CheckFailure at `deadline`.
  bool wait_room(uint64_t pos, Clock::time_point deadline, const std::function<bool()>& give_up = {}) const {
    while (pos - tail() >= entries_) {
      if (give_up && give_up()) return false;
      SHM_CHECK(Clock::now() < deadline, "the consumer never freed ring position " << pos);
      std::this_thread::yield();
    }
    return true;
  }

  /// Fills the fields of the entry at `pos` and up to a slot of payload (not published), as an
  /// honest sender would place it: a chunk of up to kInlineBytes inline (kEntryInline added to the
  /// flags), a larger one in the arena slot slot_of(pos), handed to the receiver.
  void write(uint64_t pos, const Fields& f, const void* data = nullptr, size_t bytes = 0) const {
    EntryHeader& e = header(pos);
    const bool in_line = f.chunk <= shm::kInlineBytes;
    store_relaxed(e.tag, f.tag);
    store_relaxed(e.total_bytes, f.total);
    // The tail whatever the flags say (a receiver reads it only where they say the entry has it).
    store_relaxed(entry_tail(pos).chunk_offset, f.offset);
    store_relaxed(e.chunk_bytes, f.chunk);
    store_relaxed(e.flags, f.flags | (in_line ? uint32_t{shm::kEntryInline} : 0u));
    store_relaxed(e.dtype, f.dtype);
    store_relaxed(e.ndim, f.ndim);
    store_relaxed(entry_tail(pos).slot, in_line ? 0u : slot_of(pos));
    if (!in_line) slot_state(slot_of(pos)).store(static_cast<uint32_t>(dst_) + 1, std::memory_order_relaxed);
    if (data != nullptr && bytes != 0) {
      std::memcpy(in_line ? inline_bytes(pos) : payload(pos), data,
                  std::min<size_t>(bytes, in_line ? shm::kInlineBytes : slot_));
    }
  }

  /// Publishes the entry at `pos`: seq (release), head, then wakes the consumer.
  void publish(uint64_t pos) const {
    header(pos).seq.store(seq_word(pos), std::memory_order_release);
    control().head.store(pos + 1, std::memory_order_release);
    wake();
  }

  /// Writes and publishes a whole entry.
  void put(uint64_t pos, const Fields& f, const void* data = nullptr, size_t bytes = 0) const {
    write(pos, f, data, bytes);
    publish(pos);
  }

  /// Writes and publishes a span at `pos` (segment_layout.h): the entry with kEntrySpan added to
  /// the flags, then up to `bytes` of `data` in the entries after it (on at entry 0 past the
  /// ring's end; at most what the rest of the ring holds), head past them.
  /// `kind`: kEntryBatch for a batch, whose `leaves` is its number of records (f.flags 0 for
  /// an honest one).
  void put_span(uint64_t pos, const Fields& f, const void* data, size_t bytes, uint32_t kind = shm::kEntrySpan,
                uint16_t leaves = 0) const {
    EntryHeader& e = header(pos);
    store_relaxed(e.tag, f.tag);
    store_relaxed(e.total_bytes, f.total);
    store_relaxed(e.chunk_bytes, f.chunk);
    store_relaxed(e.flags, f.flags | kind);
    store_relaxed(e.dtype, f.dtype);
    store_relaxed(e.ndim, f.ndim);
    store_relaxed(e.leaves, leaves);
    const size_t room = (entries_ - 1) * shm::kEntryBytes;
    const auto* from = static_cast<const uint8_t*>(data);
    for (size_t off = 0; off < std::min(bytes, room); off += shm::kEntryBytes) {
      std::memcpy(entry_base(pos + 1 + off / shm::kEntryBytes), from + off,
                  std::min<size_t>(shm::kEntryBytes, bytes - off));
    }
    header(pos).seq.store(seq_word(pos), std::memory_order_release);
    control().head.store(pos + 1 + std::min<uint64_t>(shm::span_entries(f.chunk), entries_ - 1),
                         std::memory_order_release);
    wake();
  }

  void wake() const {
    shm::RankSlot& slot = seg_.rank_slot(dst_);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    slot.wake_seq.fetch_add(1, std::memory_order_seq_cst);
    shm::futex_wake_all(slot.wake_seq);
  }

 private:
  std::byte* region() const { return seg_.data() + geo_.arena_offset + uint64_t{static_cast<uint32_t>(src_)} * geo_.region_bytes; }
  std::byte* loan_region() const {
    return seg_.data() + geo_.loan_offset + uint64_t{static_cast<uint32_t>(src_)} * geo_.loan_region_bytes;
  }

  RawSegment seg_;
  int src_;
  int dst_;
  uint32_t world_ = 0;
  uint32_t entries_ = 0;
  uint64_t slot_ = 0;
  uint32_t slots_ = 0;
  shm::SegmentGeometry geo_{};
  std::byte* ring_ = nullptr;
  uint64_t key_ = 0;  // the ring's seq key
};

/// The payload of a kEntryReference entry naming `path` at `offset`.
std::string reference_payload(const std::string& path, uint64_t offset) {
  shm::MemmapReference r{};
  r.offset = offset;
  r.path_bytes = static_cast<uint32_t>(path.size());
  std::string out(sizeof r, '\0');
  std::memcpy(out.data(), &r, sizeof r);
  return out + path;
}

// ---------------------------------------------------------------------------------------------
// Coordination between the children

/// Counters in memory shared by the parent and its children (made before fork()).
struct Sync {
  std::atomic<int> posted{0};       // the victim posted its receive (round number + 1)
  std::atomic<int> published{0};    // the hostile rank published its entries
  std::atomic<int> victim_done{0};  // the victim checked the outcome (round number + 1)
  std::atomic<int> ready{0};        // ranks that finished their constructor
  std::atomic<int> go{0};           // the parent's signal
  std::atomic<int> stage{0};        // a scenario's own steps
  std::atomic<int> stop{0};         // the parent gives up: children end their loops
  std::atomic<int> completed{0};    // statistics of the racy tests
  std::atomic<int> failed{0};
  std::atomic<int> corrupted{0};  // failures that were "corrupted entry" (the others: size mismatches)
  std::atomic<int64_t> count{0};
};

/// Stores a value past every round into `flag` when its scope ends, however it ends (a failed
/// check included), so that the partners of a failing rank stop waiting for it at once.
class SignalOnExit {
 public:
  explicit SignalOnExit(std::atomic<int>& flag) : flag_(flag) {}
  ~SignalOnExit() { flag_.store(std::numeric_limits<int>::max()); }
  SignalOnExit(const SignalOnExit&) = delete;
  SignalOnExit& operator=(const SignalOnExit&) = delete;

 private:
  std::atomic<int>& flag_;
};

/// Waits until `v` >= `at_least`; CheckFailure after `timeout`.
void await(const std::atomic<int>& v, int at_least, const char* what, Clock::duration timeout = 20s) {
  const auto deadline = Clock::now() + timeout;
  while (v.load(std::memory_order_acquire) < at_least) {
    SHM_CHECK(Clock::now() < deadline, "timed out waiting for " << what);
    std::this_thread::sleep_for(100us);
  }
}

/// What wait() of `w` threw, if anything.
Caught outcome(const c10::intrusive_ptr<c10d::Work>& w) {
  return catch_any([&] { w->wait(); });
}

/// Checks that `c` is an E whose message contains every needle (case-insensitive).
template <typename E>
void expect_error(const Caught& c, const std::string& context, const std::vector<std::string>& needles) {
  SHM_CHECK(c.is<E>(), context << ": expected " << demangle(typeid(E).name()) << ", got " << c.describe());
  for (const std::string& n : needles) {
    SHM_CHECK(contains_nocase(c.what, n), context << ": the error does not mention \"" << n << "\": " << c.what);
  }
}

void note(const std::string& line) {
  std::fprintf(stderr, "[hostile] %s\n", line.c_str());
  std::fflush(stderr);
}

/// The largest resident set of this process so far, in KiB.
long max_rss_kib() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

struct Role {
  std::string name;
  std::function<void()> body;
};

/// Runs every role in a forked child and checks that each one exited normally with 0 (no
/// signal: a SIGBUS or SIGSEGV is a crash of that rank) within `timeout`.
void run_roles(const std::vector<Role>& roles, Clock::duration timeout = 60s) {
  std::vector<Child> children;
  children.reserve(roles.size());
  for (const Role& r : roles) children.emplace_back(r.body);
  wait_all(children, timeout);
  for (size_t i = 0; i < roles.size(); ++i) {
    EXPECT_EQ(children[i].signal(), 0) << roles[i].name << " was killed by a signal: " << children[i].describe();
    EXPECT_TRUE(children[i].ok()) << roles[i].name << ": " << children[i].describe();
  }
}

off_t file_size(const std::string& path) {
  struct stat st {};
  SHM_CHECK(::stat(path.c_str(), &st) == 0, "stat " << path << ": " << std::strerror(errno));
  return st.st_size;
}

void truncate_file(const std::string& path, off_t size) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  SHM_CHECK(fd >= 0, "open " << path << ": " << std::strerror(errno));
  const int rc = ::ftruncate(fd, size);
  const int err = errno;
  ::close(fd);
  SHM_CHECK(rc == 0, "ftruncate " << path << " to " << size << ": " << std::strerror(err));
}

/// How far a segment is cut.
enum class Cut {
  kZero,      // to 0 bytes
  kHalfPage,  // to the page boundary at or below half of it
  kHalf,      // to exactly half of it (the page that holds the new end stays mapped, zeroed past it)
};

const char* cut_name(Cut cut) {
  switch (cut) {
    case Cut::kZero:
      return "to 0 bytes";
    case Cut::kHalfPage:
      return "to half (page-aligned)";
    case Cut::kHalf:
      return "to exactly half";
  }
  return "?";
}

off_t cut_size(Cut cut, off_t full) {
  const off_t page = ::sysconf(_SC_PAGESIZE);
  switch (cut) {
    case Cut::kZero:
      return 0;
    case Cut::kHalfPage:
      return full / 2 / page * page;
    case Cut::kHalf:
      return full / 2;
  }
  return 0;
}

/// A private temporary directory (under $TMPDIR or /tmp), removed with what the test put in it.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/tdshm-hostile-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    SHM_CHECK(::mkdtemp(buf.data()) != nullptr, "mkdtemp: " << std::strerror(errno));
    path_ = buf.data();
    // The victim resolves paths: make them canonical (no symlinks in TMPDIR to trip O_NOFOLLOW).
    if (char* real = ::realpath(path_.c_str(), nullptr)) {
      path_ = real;
      std::free(real);
    }
  }
  ~TempDir() {
    for (const std::string& f : files_) ::unlink(f.c_str());
    ::rmdir(path_.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  /// Remembers `name` (inside the directory) for removal; returns its path.
  std::string file(const std::string& name) {
    files_.push_back(path_ + "/" + name);
    return files_.back();
  }

 private:
  std::string path_;
  std::vector<std::string> files_;
};

class ShmHostile : public ShmTest {};

// ---------------------------------------------------------------------------------------------
// 1. Garbage in an entry's header, published with a correct seq

/// What the victim's pending receive must end with.
enum class Verdict {
  kCorrupt,   // TransportError "corrupted entry ...": the pair fails for good
  kMismatch,  // TransportError (the message does not fit the receive): only that receive fails
  kReceived,  // the payload, intact (the garbage is in a field that does not matter here)
};

struct Garbage {
  std::string what;
  std::string needle;                                         // what the error must also say
  int64_t recv_bytes;                                         // the victim's receive
  std::function<void(const RingWriter&, int64_t tag)> write;  // writes and publishes from position 0
  Verdict verdict = Verdict::kCorrupt;
};

constexpr uint8_t kGarbagePayload = 0x5C;

/// A record of a batch (segment_layout.h's BatchRecord) of `bytes` 1-byte elements.
shm::BatchRecord record(int64_t tag, uint32_t bytes, uint32_t flags = 0, uint8_t ndim = 1) {
  shm::BatchRecord r{};
  r.tag = tag;
  r.bytes = bytes;
  r.flags = flags;
  r.dtype = kByteDtype;
  r.ndim = ndim;
  return r;
}

/// The bytes of a batch of `records`: each record, its sizes (`dims`, for every record of 2 to 8
/// dimensions), kGarbagePayload bytes, zeros up to a multiple of 8.
std::vector<uint8_t> batch_of(const std::vector<shm::BatchRecord>& records, const int64_t* dims = nullptr) {
  std::vector<uint8_t> out;
  for (const shm::BatchRecord& r : records) {
    const size_t at = out.size();
    out.resize(at + shm::batch_record_bytes(r.ndim, r.bytes), 0);
    std::memcpy(out.data() + at, &r, sizeof r);
    size_t payload = at + sizeof r;
    if (r.ndim >= 2 && r.ndim <= shm::kMaxDims) {
      std::memcpy(out.data() + payload, dims, r.ndim * sizeof(int64_t));
      payload += r.ndim * sizeof(int64_t);
    }
    std::memset(out.data() + payload, kGarbagePayload, r.bytes);
  }
  return out;
}

std::vector<Garbage> garbage_cases(uint64_t slot) {
  constexpr uint32_t kFirst = shm::kEntryFirst, kLast = shm::kEntryLast;
  // Payload bytes for any slot of these tests (static: the lambdas outlive this function).
  static const std::vector<uint8_t> kPayload(size_t{1} << 20, kGarbagePayload);
  SHM_CHECK(slot <= kPayload.size());
  const uint8_t* data = kPayload.data();
  // Sizes of 8 dimensions that make no shape of any size.
  static const int64_t garbage_dims[shm::kMaxDims] = {
      -1, std::numeric_limits<int64_t>::max(), 0, 7, std::numeric_limits<int64_t>::min(), 3, int64_t{1} << 40, -5};
  std::vector<Garbage> out;
  out.push_back({"unknown flag bits", "unknown flags", 64, [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast | 0x10000}, data, 64);
                 }});
  // Spans (layout 9): the message's bytes in the ring entries after its header.
  out.push_back({"a span larger than the ring", "bytes in a ring of", 4096, [=](const RingWriter& r, int64_t tag) {
                   const auto chunk = static_cast<uint32_t>(r.ring_entries() * shm::kEntryBytes);
                   r.put_span(0, {.tag = tag, .total = chunk, .chunk = chunk, .flags = kFirst | kLast}, data, chunk);
                 }});
  out.push_back({"a span of 2^32 - 1 bytes", "span of 4294967295 bytes", 4096, [=](const RingWriter& r, int64_t tag) {
                   r.put_span(0, {.tag = tag, .total = 0xFFFFFFFFu, .chunk = 0xFFFFFFFFu, .flags = kFirst | kLast},
                              data, 4096);
                 }});
  out.push_back({"a span that is half a message", "a span that is not a whole message", 1000,
                 [=](const RingWriter& r, int64_t tag) {
                   r.put_span(0, {.tag = tag, .total = 1000, .chunk = 500, .flags = kFirst}, data, 500);
                 }});
  out.push_back({"a span that is also inline", "a span that is inline", 50, [=](const RingWriter& r, int64_t tag) {
                   r.put_span(0, {.tag = tag, .total = 50, .chunk = 50, .flags = kFirst | kLast | shm::kEntryInline},
                              data, 50);
                 }});
  out.push_back({"a span of garbage bytes", "", 500,
                 [=](const RingWriter& r, int64_t tag) {
                   r.put_span(0, {.tag = tag, .total = 500, .chunk = 500, .flags = kFirst | kLast}, data, 500);
                 },
                 Verdict::kReceived});
  // Batches (layout 10): whole messages as records in the span of one entry.
  auto put_batch = [](const RingWriter& r, const std::vector<uint8_t>& records, uint16_t leaves,
                      std::optional<uint32_t> chunk = std::nullopt, uint32_t flags = 0) {
    const uint32_t bytes = chunk.value_or(static_cast<uint32_t>(records.size()));
    r.put_span(0, {.total = bytes, .chunk = bytes, .flags = flags, .ndim = 0}, records.data(),
               std::min<size_t>(records.size(), bytes), shm::kEntryBatch, leaves);
  };
  out.push_back({"a batch of one record", "", 64,
                 [=](const RingWriter& r, int64_t tag) { put_batch(r, batch_of({record(tag, 64)}), 1); },
                 Verdict::kReceived});
  out.push_back({"a batch record that runs past the batch", "past the batch's 80", 64,
                 [=](const RingWriter& r, int64_t tag) { put_batch(r, batch_of({record(tag, 64)}), 1, 80); }});
  out.push_back({"a batch that says more records than it holds", "a batch of 1 records that says 3", 64,
                 [=](const RingWriter& r, int64_t tag) { put_batch(r, batch_of({record(tag + 1000, 8)}), 3); }});
  out.push_back({"a batch that holds more records than it says", "more records than its 1", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   put_batch(r, batch_of({record(tag + 1000, 8), record(tag, 64)}), 1);
                 }});
  out.push_back(
      {"a batch record flagged as a loan", "a record with flags 128", 64,
       [=](const RingWriter& r, int64_t tag) { put_batch(r, batch_of({record(tag, 64, shm::kEntryLoan)}), 1); }});
  out.push_back({"a batch larger than the ring", "bytes in a ring of", 64, [=](const RingWriter& r, int64_t tag) {
                   const auto chunk = static_cast<uint32_t>(r.ring_entries() * shm::kEntryBytes);
                   put_batch(r, batch_of({record(tag, 64)}), 1, chunk);
                 }});
  out.push_back({"a batch of 2^32 - 1 bytes", "batch of 4294967295 bytes", 64,
                 [=](const RingWriter& r, int64_t tag) { put_batch(r, batch_of({record(tag, 64)}), 1, 0xFFFFFFFFu); }});
  out.push_back({"a batch of no records", "a batch of no records", 64,
                 [=](const RingWriter& r, int64_t tag) { put_batch(r, batch_of({record(tag, 64)}), 0); }});
  out.push_back({"a batch flagged as a whole message too", "unknown flags", 64, [=](const RingWriter& r, int64_t tag) {
                   put_batch(r, batch_of({record(tag, 64)}), 1, std::nullopt, kFirst | kLast);
                 }});
  out.push_back(
      {"a batch record of 8 garbage dims", "shape", 64,
       [=](const RingWriter& r, int64_t tag) { put_batch(r, batch_of({record(tag, 64, 0, 8)}, garbage_dims), 1); },
       Verdict::kMismatch});
  for (uint64_t seed : {1, 2, 3}) {
    out.push_back(
        {"a batch of random bytes, seed " + std::to_string(seed), "batch", 64, [=](const RingWriter& r, int64_t) {
           std::mt19937_64 rng(seed * 104729);
           std::vector<uint8_t> noise(200);
           for (auto& b : noise) b = static_cast<uint8_t>(rng());
           put_batch(r, noise, 2);
         }});
  }
  out.push_back({"a continuation without a first entry", "continuation without a first entry", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kLast}, data, 64);
                 }});
  // (A first entry has no offset on the wire: its chunk starts the message. A continuation's
  // offset must be the bytes received so far.)
  out.push_back({"a wrong chunk offset", "chunk at offset 72, expected 64", 128, [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 128, .chunk = 64, .flags = kFirst}, data, 64);
                   r.put(1, {.tag = tag, .total = 128, .offset = 72, .chunk = 64, .flags = kLast}, data, 64);
                 }});
  out.push_back({"chunk_bytes larger than the slot", "in a slot of", 64, [=](const RingWriter& r, int64_t tag) {
                   const auto chunk = static_cast<uint32_t>(r.slot_bytes() + 512);
                   r.put(0, {.tag = tag, .total = chunk, .chunk = chunk, .flags = kFirst | kLast}, data,
                         r.slot_bytes());
                 }});
  out.push_back({"chunk_bytes 0xFFFFFFFF", "in a slot of", 64, [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = uint64_t{1} << 33, .chunk = 0xFFFFFFFFu, .flags = kFirst}, data,
                         r.slot_bytes());
                 }});
  out.push_back({"a chunk past the message's end", "past the message", 64, [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 64, .chunk = 200, .flags = kFirst | kLast}, data, 200);
                 }});
  out.push_back({"ndim 200", "ndim 200", 64, [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast, .ndim = 200}, data, 64);
                 }});
  out.push_back({"a last flag that disagrees with the size", "last-entry flag disagrees", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 128, .chunk = 64, .flags = kFirst | kLast}, data, 64);
                 }});
  out.push_back(
      {"a new first entry in the middle of a message", "before the previous one ended", static_cast<int64_t>(2 * slot),
       [=](const RingWriter& r, int64_t tag) {
         r.put(
             0,
             {.tag = tag, .total = 2 * r.slot_bytes(), .chunk = static_cast<uint32_t>(r.slot_bytes()), .flags = kFirst},
             data, r.slot_bytes());
         r.put(1, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast}, data, 64);
       }});
  out.push_back({"the control flag changed in the middle of a message", "control flag changed",
                 static_cast<int64_t>(2 * slot), [=](const RingWriter& r, int64_t tag) {
                   const auto chunk = static_cast<uint32_t>(r.slot_bytes());
                   r.put(0, {.tag = tag, .total = 2 * r.slot_bytes(), .chunk = chunk, .flags = kFirst}, data, chunk);
                   r.put(1,
                         {.tag = tag,
                          .total = 2 * r.slot_bytes(),
                          .offset = chunk,
                          .chunk = chunk,
                          .flags = kLast | shm::kEntryControl},
                         data, chunk);
                 }});
  out.push_back({"an arena slot that was not handed to the receiver", "is not handed to this rank", 256,
                 [=](const RingWriter& r, int64_t tag) {
                   r.write(0, {.tag = tag, .total = 256, .chunk = 256, .flags = kFirst | kLast}, data, 256);
                   r.slot_state(r.slot_of(0)).store(shm::kSlotFree, std::memory_order_relaxed);
                   r.publish(0);
                 }});
  out.push_back({"an arena slot handed to another rank", "is not handed to this rank", 256,
                 [=](const RingWriter& r, int64_t tag) {
                   r.write(0, {.tag = tag, .total = 256, .chunk = 256, .flags = kFirst | kLast}, data, 256);
                   r.slot_state(r.slot_of(0)).store(3 + 1, std::memory_order_relaxed);  // rank 3 (none here)
                   r.publish(0);
                 }});
  out.push_back({"arena slot index 2^31", "arena slot 2147483648", 256, [=](const RingWriter& r, int64_t tag) {
                   r.write(0, {.tag = tag, .total = 256, .chunk = 256, .flags = kFirst | kLast}, data, 256);
                   store_relaxed(r.entry_tail(0).slot, 0x80000000u);
                   r.publish(0);
                 }});
  out.push_back({"an inline chunk of 73 bytes", "inline chunk of 73 bytes", 73, [=](const RingWriter& r, int64_t tag) {
                   r.write(0, {.tag = tag, .total = 73, .chunk = 73, .flags = kFirst | kLast}, data, 73);
                   store_relaxed(r.header(0).flags, uint32_t{kFirst | kLast | shm::kEntryInline});
                   r.publish(0);
                 }});
  out.push_back(
      {"a memmap reference of 3 bytes", "memmap reference of 3 bytes", 64, [=](const RingWriter& r, int64_t tag) {
         r.put(0, {.tag = tag, .total = 64, .chunk = 3, .flags = kFirst | kLast | shm::kEntryReference}, data, 3);
       }});
  // Garbage in the shape, dtype and dims of a message whose size matches the receive.
  out.push_back({"8 garbage dims", "shape", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   std::copy(garbage_dims, garbage_dims + shm::kMaxDims, r.shape(0).dims);
                   r.put(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast, .ndim = 8}, data, 64);
                 },
                 Verdict::kMismatch});
  out.push_back({"garbage dims behind ndim kShapeNotSent", "", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   std::copy(garbage_dims, garbage_dims + shm::kMaxDims, r.shape(0).dims);
                   r.put(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast, .ndim = shm::kShapeNotSent},
                         data, 64);
                 },
                 Verdict::kReceived});
  // The tail's fields where the entry has none (layout 7): never read, so garbage there is harmless.
  out.push_back({"garbage in a first entry's tail offset", "", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 64, .offset = uint64_t{1} << 40, .chunk = 64, .flags = kFirst | kLast},
                         data, 64);
                 },
                 Verdict::kReceived});
  out.push_back({"garbage in an inline entry's tail slot", "", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   r.write(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast}, data, 64);
                   store_relaxed(r.entry_tail(0).slot, 0xFFFFFFFFu);
                   r.publish(0);
                 },
                 Verdict::kReceived});
  out.push_back({"dtype 200 (no such dtype)", "dtype", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast, .dtype = 200}, data, 64);
                 },
                 Verdict::kMismatch});
  out.push_back({"a 0-dim shape for 64 bytes", "shape", 64,
                 [=](const RingWriter& r, int64_t tag) {
                   r.put(0, {.tag = tag, .total = 64, .chunk = 64, .flags = kFirst | kLast, .ndim = 0}, data, 64);
                 },
                 Verdict::kMismatch});
  for (uint64_t seed : {1, 2, 3}) {
    // Random bytes in every field after seq (tag included: the victim's receive may not even
    // match it), random payload.
    out.push_back({"random header bytes, seed " + std::to_string(seed), "", 64, [=](const RingWriter& r, int64_t) {
                     std::mt19937_64 rng(seed * 7919);
                     uint8_t noise[sizeof(EntryHeader)];
                     for (auto& b : noise) b = static_cast<uint8_t>(rng());
                     // The header after seq, byte by byte.
                     auto* h = reinterpret_cast<uint8_t*>(&r.header(0));
                     for (size_t i = sizeof(uint64_t); i < sizeof(EntryHeader); ++i) {
                       store_relaxed(h[i], noise[i]);
                     }
                     for (uint64_t i = 0; i < r.slot_bytes(); ++i) r.payload(0)[i] = static_cast<uint8_t>(rng());
                     r.publish(0);
                   }});
  }
  return out;
}

// Every case runs in a group of 3: rank 1 writes the garbage, rank 2 is honest and must still
// exchange with the victim both ways afterwards.
TEST_F(ShmHostile, GarbageEntriesFailThePairAndSpareTheOthers) {
  set_deadline(300s);
  const ShmOptions opts = small_options();
  const auto cases = garbage_cases(opts.slot_bytes);
  for (const Garbage& g : cases) {
    SCOPED_TRACE(g.what);
    const std::string name = unique_name();
    constexpr int64_t kTag = 3;
    Shared<Sync> s;
    const at::Tensor from_honest = pattern(at::kByte, 256, 77);
    const at::Tensor to_honest = pattern(at::kByte, 5000, 78);  // chunked: 2 entries
    run_roles({{"victim (rank 0)",
                [&] {
                  const SignalOnExit done(s->victim_done);
                  ProcessGroupShm pg(name, 0, 3, opts);
                  GuardedRecv buf(g.recv_bytes);
                  auto w = post_recv(pg, buf.view(), 1, kTag);
                  s->posted.store(1);
                  const Caught c = outcome(w);
                  note(g.what + ": victim's recv: " + c.describe());
                  if (g.verdict == Verdict::kReceived) {
                    SHM_CHECK(!c.threw, g.what << ": " << c.describe());
                    SHM_CHECK(at::all(buf.view() == kGarbagePayload).item<bool>(), g.what << ": wrong bytes");
                  } else {
                    std::vector<std::string> needles;
                    if (g.verdict == Verdict::kCorrupt) needles = {"corrupted entry", "rank 1"};
                    if (!g.needle.empty()) needles.push_back(g.needle);
                    expect_error<TransportError>(c, g.what, needles);
                  }
                  CHECK_GUARDS(buf, g.what);
                  if (g.verdict == Verdict::kCorrupt) {
                    // The pair stays failed: a later receive from rank 1 fails at once, with the same error.
                    GuardedRecv again(64);
                    expect_error<TransportError>(outcome(post_recv(pg, again.view(), 1, kTag + 1)),
                                                 g.what + ", later recv", {"corrupted entry"});
                    CHECK_GUARDS(again, g.what + ", later recv");
                  }
                  // The honest rank 2 is unaffected, both ways.
                  const at::Tensor got = at::zeros({256}, at::kByte);
                  post_recv(pg, got, 2, 7)->wait();
                  SHM_CHECK(same_bytes(got, from_honest), g.what << ": wrong bytes from the honest rank 2");
                  post_send(pg, to_honest, 2, 8)->wait();
                  s->victim_done.store(1);
                }},
               {"hostile (rank 1)",
                [&] {
                  ProcessGroupShm pg(name, 1, 3, opts);
                  RingWriter ring(name, 1, 0);
                  await(s->posted, 1, "the victim's recv");
                  g.write(ring, kTag);
                  s->published.store(1);
                  await(s->victim_done, 1, "the victim");
                }},
               {"honest (rank 2)",
                [&] {
                  ProcessGroupShm pg(name, 2, 3, opts);
                  post_send(pg, from_honest, 0, 7)->wait();
                  const at::Tensor got = at::zeros({5000}, at::kByte);
                  post_recv(pg, got, 0, 8)->wait();
                  SHM_CHECK(same_bytes(got, to_honest), "wrong bytes from the victim");
                  await(s->victim_done, 1, "the victim");
                }}},
              30s);
    if (HasFailure()) break;
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Sizes rewritten after publishing, while the victim consumes
//
// Rank 1 publishes a valid 17-entry message that matches the victim's recv, while a second thread
// of rank 1 keeps rewriting chunk_bytes, total_bytes or chunk_offset of entries it has published
// and the victim has not consumed yet (each time putting the right value back). A fresh group per
// round, since a corrupt entry fails the pair for good. Every rewritten value is wrong for any
// entry it can land in, so a receive that completes read only the producer's values and must hold
// the right bytes; one that fails must fail with a TransportError; the guards hold either way.

TEST_F(ShmHostile, SizesRewrittenAfterPublishingNeverEscapeTheTensor) {
  set_deadline(600s);
  const std::string base = unique_name();
  ShmOptions opts = small_options(200us);
  opts.timeout = 5s;
  constexpr int kRounds = 200;
  const uint64_t slot = opts.slot_bytes;
  const uint64_t total = 16 * slot + 100;  // 17 entries through a ring of 4
  const uint64_t chunks = (total + slot - 1) / slot;
  auto round_name = [&](int i) { return base + "-r" + std::to_string(i); };
  Shared<Sync> s;
  run_roles(
      {{"victim (rank 0)",
        [&] {
          const SignalOnExit done(s->victim_done);
          for (int i = 0; i < kRounds; ++i) {
            const std::string context = "round " + std::to_string(i);
            ProcessGroupShm pg(round_name(i), 0, 2, opts);
            GuardedRecv buf(static_cast<int64_t>(total));
            auto w = post_recv(pg, buf.view(), 1, i);
            s->posted.store(i + 1);
            const Caught c = outcome(w);
            if (!c.threw) {
              // Only the values the producer wrote pass validation, so a completed receive has them all.
              SHM_CHECK(
                  same_bytes(buf.view(), pattern(at::kByte, static_cast<int64_t>(total), static_cast<uint64_t>(i))),
                  context << ": the receive completed with wrong bytes");
              s->completed.fetch_add(1);
            } else {
              expect_error<TransportError>(c, context, {});
              s->failed.fetch_add(1);
              if (contains_nocase(c.what, "corrupted entry")) s->corrupted.fetch_add(1);
            }
            CHECK_GUARDS(buf, context);
            s->victim_done.store(i + 1);
          }
        }},
       {"hostile (rank 1)",
        [&] {
          const std::vector<uint32_t> bad_chunks{0,
                                                 1,
                                                 static_cast<uint32_t>(slot - 1),
                                                 static_cast<uint32_t>(slot + 1),
                                                 static_cast<uint32_t>(2 * slot),
                                                 0xFFFFFFFFu};
          const std::vector<uint64_t> bad_totals{
              0,    total - 1, total + 1,         2 * total,
              kTiB, kTiB + 1,  uint64_t{1} << 63, std::numeric_limits<uint64_t>::max()};
          for (int i = 0; i < kRounds; ++i) {
            if (s->victim_done.load() == std::numeric_limits<int>::max()) break;  // the victim failed and left
            ProcessGroupShm pg(round_name(i), 1, 2, opts);
            const RingWriter ring(round_name(i), 1, 0);
            const at::Tensor data = pattern(at::kByte, static_cast<int64_t>(total), static_cast<uint64_t>(i));
            const auto* bytes = data.data_ptr<uint8_t>();
            auto original = [&](uint64_t pos) {
              Fields f;
              f.tag = i;
              f.total = total;
              f.offset = pos * slot;
              f.chunk = static_cast<uint32_t>(std::min(slot, total - pos * slot));
              f.flags =
                  (pos == 0 ? uint32_t{shm::kEntryFirst} : 0u) | (pos + 1 == chunks ? uint32_t{shm::kEntryLast} : 0u);
              return f;
            };
            await(s->posted, i + 1, "the victim's recv");
            std::atomic<uint64_t> head{0};
            std::atomic<bool> stop{false};
            // Keeps a rewritten value in place for a moment.
            auto linger = [] {
              std::atomic<int> spins{0};
              while (spins.fetch_add(1, std::memory_order_relaxed) < 200) {
              }
            };
            // Rewrites a size of an entry published but not yet consumed, then puts the value back.
            std::thread flipper([&] {
              std::mt19937_64 rng(static_cast<uint64_t>(i) * 104729 + 1);
              while (!stop.load(std::memory_order_relaxed)) {
                const uint64_t h = head.load(std::memory_order_acquire), t = ring.tail();
                if (h <= t) continue;
                const uint64_t pos = t + rng() % (h - t);
                EntryHeader& e = ring.header(pos);
                const Fields f = original(pos);
                switch (rng() % 3) {
                  case 0:
                    store_relaxed(e.chunk_bytes, bad_chunks[rng() % bad_chunks.size()]);
                    linger();
                    store_relaxed(e.chunk_bytes, f.chunk);
                    break;
                  case 1:
                    store_relaxed(e.total_bytes, bad_totals[rng() % bad_totals.size()]);
                    linger();
                    store_relaxed(e.total_bytes, f.total);
                    break;
                  default: {
                    const uint64_t bad_offsets[] = {f.offset + 1, f.offset == 0 ? 4096 : f.offset - 1, f.offset + slot,
                                                    kTiB, std::numeric_limits<uint64_t>::max() - 5};
                    store_relaxed(ring.entry_tail(pos).chunk_offset, bad_offsets[rng() % 5]);
                    linger();
                    store_relaxed(ring.entry_tail(pos).chunk_offset, f.offset);
                    break;
                  }
                }
              }
            });
            struct Join {
              std::atomic<bool>& stop;
              std::thread& t;
              ~Join() {
                stop.store(true);
                t.join();
              }
            } join{stop, flipper};
            const auto deadline = Clock::now() + 20s;
            auto victim_finished = [&] { return s->victim_done.load() >= i + 1; };
            for (uint64_t pos = 0; pos < chunks; ++pos) {
              if (!ring.wait_room(pos, deadline, victim_finished)) break;  // it failed the message
              const Fields f = original(pos);
              ring.write(pos, f, bytes + f.offset, f.chunk);
              head.store(pos + 1, std::memory_order_release);  // the flipper may rewrite it from now on
              ring.publish(pos);
            }
            await(s->victim_done, i + 1, "the victim");
          }
        }}},
      500s);
  std::fprintf(stderr,
               "[hostile] sizes rewritten while consumed: %d receives completed (right bytes), %d failed "
               "with a TransportError (%d corrupted entry, %d size mismatch)\n",
               s->completed.load(), s->failed.load(), s->corrupted.load(), s->failed.load() - s->corrupted.load());
}

// ---------------------------------------------------------------------------------------------
// 3. Huge declared sizes

TEST_F(ShmHostile, HugeDeclaredSizesWithoutRecvAreNeverAllocated) {
  set_deadline(120s);
  const ShmOptions opts = small_options();
  for (const uint64_t huge : {kTiB, uint64_t{1} << 63, kTiB + 1}) {
    const std::string what = "a first entry announcing " + std::to_string(huge) + " bytes";
    SCOPED_TRACE(what);
    const std::string name = unique_name();
    constexpr int64_t kTag = 5;
    Shared<Sync> s;
    const at::Tensor from_honest = pattern(at::kFloat, 3000, 91);  // chunked
    run_roles({{"victim (rank 0)",
                [&] {
                  const SignalOnExit done(s->victim_done);
                  const long rss_before = max_rss_kib();
                  ProcessGroupShm pg(name, 0, 3, opts);
                  await(s->published, 1, "the hostile entry");
                  // Responsive: an honest message arrives while the huge one sits in the other ring.
                  const at::Tensor got = at::zeros({3000}, at::kFloat);
                  post_recv(pg, got, 2, 7)->wait();
                  SHM_CHECK(same_bytes(got, from_honest), what << ": wrong bytes from the honest rank 2");
                  post_send(pg, got, 2, 8)->wait();
                  // The real (small) receive from rank 1: a clear error, either the size mismatch or the
                  // corrupted entry (sizes past 1 TiB are refused as corrupt).
                  GuardedRecv buf(16);
                  const Caught c = outcome(post_recv(pg, buf.view(), 1, kTag));
                  note(what + ", then a 16-byte recv: " + c.describe());
                  if (huge <= kTiB) {
                    expect_error<TransportError>(c, what, {std::to_string(huge), "16"});
                  } else {
                    expect_error<TransportError>(c, what, {"corrupted entry", std::to_string(huge)});
                  }
                  CHECK_GUARDS(buf, what);
                  const long grown = max_rss_kib() - rss_before;
                  SHM_CHECK(grown < (256 << 10), what << ": the victim's resident set grew by " << grown << " KiB");
                  s->victim_done.store(1);
                }},
               {"hostile (rank 1)",
                [&] {
                  ProcessGroupShm pg(name, 1, 3, opts);
                  const RingWriter ring(name, 1, 0);
                  const std::vector<uint8_t> chunk(ring.slot_bytes(), 0x11);
                  ring.put(0,
                           {.tag = kTag,
                            .total = huge,
                            .chunk = static_cast<uint32_t>(ring.slot_bytes()),
                            .flags = shm::kEntryFirst},
                           chunk.data(), chunk.size());
                  s->published.store(1);
                  await(s->victim_done, 1, "the victim");
                }},
               {"honest (rank 2)",
                [&] {
                  ProcessGroupShm pg(name, 2, 3, opts);
                  await(s->published, 1, "the hostile entry");
                  post_send(pg, from_honest, 0, 7)->wait();
                  const at::Tensor back = at::zeros({3000}, at::kFloat);
                  post_recv(pg, back, 0, 8)->wait();
                  SHM_CHECK(same_bytes(back, from_honest), "wrong bytes back from the victim");
                  await(s->victim_done, 1, "the victim");
                }}},
              30s);
    if (HasFailure()) break;
  }
}

TEST_F(ShmHostile, HugeDeclaredSizeAgainstAPostedRecvFailsNamingTheSizes) {
  set_deadline(120s);
  const ShmOptions opts = small_options();
  for (const uint64_t huge : {kTiB, kTiB + 1, uint64_t{1} << 63}) {
    const std::string what = "a first entry announcing " + std::to_string(huge) + " bytes to a posted 16-byte recv";
    SCOPED_TRACE(what);
    const std::string name = unique_name();
    constexpr int64_t kTag = 5;
    Shared<Sync> s;
    run_roles({{"victim (rank 0)",
                [&] {
                  const SignalOnExit done(s->victim_done);
                  const long rss_before = max_rss_kib();
                  ProcessGroupShm pg(name, 0, 2, opts);
                  GuardedRecv buf(16);
                  auto w = post_recv(pg, buf.view(), 1, kTag);
                  s->posted.store(1);
                  const Caught c = outcome(w);
                  note(what + ": " + c.describe());
                  if (huge <= kTiB) {
                    expect_error<TransportError>(c, what, {std::to_string(huge), "16 bytes"});
                  } else {
                    expect_error<TransportError>(c, what, {"corrupted entry", std::to_string(huge)});
                  }
                  CHECK_GUARDS(buf, what);
                  const long grown = max_rss_kib() - rss_before;
                  SHM_CHECK(grown < (256 << 10), what << ": the victim's resident set grew by " << grown << " KiB");
                  s->victim_done.store(1);
                }},
               {"hostile (rank 1)",
                [&] {
                  ProcessGroupShm pg(name, 1, 2, opts);
                  const RingWriter ring(name, 1, 0);
                  await(s->posted, 1, "the victim's recv");
                  const std::vector<uint8_t> chunk(ring.slot_bytes(), 0x22);
                  ring.put(0,
                           {.tag = kTag,
                            .total = huge,
                            .chunk = static_cast<uint32_t>(ring.slot_bytes()),
                            .flags = shm::kEntryFirst},
                           chunk.data(), chunk.size());
                  await(s->victim_done, 1, "the victim");
                }}},
              30s);
    if (HasFailure()) break;
  }
}

// ---------------------------------------------------------------------------------------------
// 4. The segment file truncated while mapped

/// The victim waits in a recv from rank 1 (nothing sent yet) when rank 1 truncates the segment.
void truncated_while_waiting(const std::string& name, Cut cut) {
  const std::string what = std::string("segment truncated ") + cut_name(cut) + " while the victim waits in a recv";
  SCOPED_TRACE(what);
  const ShmOptions opts = small_options();
  const auto bytes = static_cast<int64_t>(3 * opts.slot_bytes + 5);
  Shared<Sync> s;
  run_roles({{"victim (rank 0)",
              [&] {
                const SignalOnExit done(s->victim_done);
                ProcessGroupShm pg(name, 0, 2, opts);
                GuardedRecv buf(bytes);
                auto w = post_recv(pg, buf.view(), 1, 4);
                s->posted.store(1);
                const Caught c = outcome(w);
                note(what + ": victim's recv: " + c.describe());
                expect_error<TransportError>(c, what, {"truncated"});
                CHECK_GUARDS(buf, what);
                // Every later transfer of the group fails as well.
                expect_error<TransportError>(catch_any([&] { post_send(pg, at::ones({8}, at::kByte), 1, 5)->wait(); }),
                                             what + ", a later send", {"truncated"});
                GuardedRecv again(16);
                expect_error<TransportError>(outcome(post_recv(pg, again.view(), 1, 6)), what + ", a later recv",
                                             {"truncated"});
                CHECK_GUARDS(again, what + ", a later recv");
                s->victim_done.store(1);
              }},
             {"truncating rank (rank 1)",
              [&] {
                ProcessGroupShm pg(name, 1, 2, opts);
                await(s->posted, 1, "the victim's recv");
                std::this_thread::sleep_for(50ms);  // the victim is (most likely) in its wait by now
                const std::string path = segment_path(name);
                truncate_file(path, cut_size(cut, file_size(path)));
                await(s->victim_done, 1, "the victim");
                // Its own transfers afterwards: whatever they do, they must not crash it.
                const Caught c = catch_any([&] { post_send(pg, at::ones({8}, at::kByte), 0, 9)->wait(); });
                note(what + ": the truncating rank's own send afterwards: " + c.describe());
              }}},
            30s);
}

TEST_F(ShmHostile, TruncatedToZeroWhileWaitingFailsTheRecv) { truncated_while_waiting(unique_name(), Cut::kZero); }

TEST_F(ShmHostile, TruncatedToHalfPageWhileWaitingFailsTheRecv) {
  truncated_while_waiting(unique_name(), Cut::kHalfPage);
}

// Truncation to a size that is not a multiple of the page size: the page that holds the new end
// of file stays mapped (zero past the end), so a rank that only touches that page gets no SIGBUS.
//
// With the small_options geometry of 2 ranks, half of the segment ends inside the page that holds
// entry 0 of the ring 1 -> 0: the victim, which polls only that entry's seq (and its rank slot, in
// page 0), never faults. This test found that the engine relied on SIGBUS alone (the recv ended
// with a TimeoutError after ShmOptions::timeout, and the truncating rank's later send "succeeded"
// into the zeroed boundary page); the liveness check now compares the file's size with the
// mapping (Segment::check_file), and this test keeps it so.
TEST_F(ShmHostile, TruncatedToExactlyHalfWhileWaitingFailsTheRecv) {
  truncated_while_waiting(unique_name(), Cut::kHalf);
}

/// Rank 1 writes the first entries of a chunked message by hand, waits until the victim has
/// consumed them (it is then in the middle of the message), and truncates the segment.
void truncated_mid_transfer(const std::string& name, Cut cut) {
  const std::string what = std::string("segment truncated ") + cut_name(cut) + " in the middle of a chunked message";
  SCOPED_TRACE(what);
  const ShmOptions opts = small_options();
  const uint64_t slot = opts.slot_bytes;
  const uint64_t total = 16 * slot + 100;
  constexpr uint64_t kSent = 6;  // entries written before the cut
  const at::Tensor data = pattern(at::kByte, static_cast<int64_t>(total), 31);
  Shared<Sync> s;
  run_roles({{"victim (rank 0)",
              [&] {
                const SignalOnExit done(s->victim_done);
                ProcessGroupShm pg(name, 0, 2, opts);
                GuardedRecv buf(static_cast<int64_t>(total));
                auto w = post_recv(pg, buf.view(), 1, 4);
                s->posted.store(1);
                const Caught c = outcome(w);
                note(what + ": victim's recv: " + c.describe());
                expect_error<TransportError>(c, what, {"truncated"});
                CHECK_GUARDS(buf, what);
                s->victim_done.store(1);
                // Rank 1 leaves first (see TruncatedSegmentLeavesNothingBehindWhenThePoisonedRankLeavesFirst
                // for the other order).
                await(s->stage, 1, "rank 1 to leave");
              }},
             {"truncating rank (rank 1)",
              [&] {
                const SignalOnExit left(s->stage);  // after the group below is destroyed
                ProcessGroupShm pg(name, 1, 2, opts);
                const std::string path = segment_path(name);
                const off_t size = cut_size(cut, file_size(path));
                {
                  const RingWriter ring(name, 1, 0);
                  await(s->posted, 1, "the victim's recv");
                  const auto deadline = Clock::now() + 20s;
                  const auto* bytes = data.data_ptr<uint8_t>();
                  for (uint64_t pos = 0; pos < kSent; ++pos) {
                    ring.wait_room(pos, deadline);
                    ring.put(pos,
                             {.tag = 4,
                              .total = total,
                              .offset = pos * slot,
                              .chunk = static_cast<uint32_t>(slot),
                              .flags = pos == 0 ? uint32_t{shm::kEntryFirst} : 0u},
                             bytes + pos * slot, slot);
                  }
                  while (ring.tail() < kSent) {
                    SHM_CHECK(Clock::now() < deadline, "the victim did not consume the first entries");
                    std::this_thread::sleep_for(100us);
                  }
                }  // unmapped: this process must not touch its raw mapping once the file is cut
                std::this_thread::sleep_for(20ms);
                truncate_file(path, size);
                await(s->victim_done, 1, "the victim");
              }}},
            30s);
}

TEST_F(ShmHostile, TruncatedInTheMiddleOfAChunkedMessageFailsTheRecv) {
  for (Cut cut : {Cut::kZero, Cut::kHalfPage}) {
    truncated_mid_transfer(unique_name(), cut);
    if (HasFailure()) break;
  }
}

// The rank that faulted on the cut (its mapping is poisoned) leaves first and its process lives
// on; then the other rank, which never touched a page past the new end, leaves too. Nothing named
// after the segment may be left in /dev/shm.
//
// This test found that the lock file /dev/shm/tdshm.<name>.lock was left behind: the poisoned
// rank 0 counted nobody alive and removed the segment and the lock file, but its kRankLeft store
// landed in its private zero pages, so the file still said rank 0 was Live; rank 1's leave then
// re-created the lock file (O_CREAT), saw rank 0 Live with a running process and removed nothing.
// A rank whose mapping is lost now reads and writes rank slots through the file
// (Segment::read_slot, store_state), and this test keeps it so.
TEST_F(ShmHostile, TruncatedSegmentLeavesNothingBehindWhenThePoisonedRankLeavesFirst) {
  set_deadline(60s);
  const std::string name = unique_name();
  const ShmOptions opts = small_options();
  Shared<Sync> s;
  run_roles({{"poisoned rank (rank 0)",
              [&] {
                {
                  ProcessGroupShm pg(name, 0, 2, opts);
                  s->ready.fetch_add(1);
                  await(s->go, 1, "the cut");
                  GuardedRecv buf(64);
                  expect_error<TransportError>(outcome(post_recv(pg, buf.view(), 1, 3)), "rank 0's recv",
                                               {"truncated"});
                  CHECK_GUARDS(buf, "rank 0's recv");
                }  // leaves first
                s->victim_done.store(1);
                await(s->stage, 1, "rank 1 to leave");  // and lives on meanwhile
              }},
             {"rank 1 (never faults)",
              [&] {
                const SignalOnExit left(s->stage);  // after the group below is destroyed
                ProcessGroupShm pg(name, 1, 2, opts);
                s->ready.fetch_add(1);
                await(s->ready, 2, "rank 0");
                const std::string path = segment_path(name);
                // The rank table (page 0) survives; the rings 1 -> 0 and 1 -> 1 are gone.
                truncate_file(path, cut_size(Cut::kHalfPage, file_size(path)));
                s->go.store(1);
                await(s->victim_done, 1, "rank 0 to leave");
              }}},
            30s);
  EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{})
      << "left behind in /dev/shm after both ranks left and exited";
}

// The test process itself truncates the segment while rank 1 streams 64 KiB messages to rank 0
// through the engine: both ranks end with a TransportError that says "truncated", and every
// receive that completed before has the right bytes.
TEST_F(ShmHostile, TruncatedUnderStreamingTransfersFailsBothRanks) {
  set_deadline(120s);
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 5s;
  constexpr int64_t kBytes = 64 << 10;
  constexpr int kBeforeCut = 20;  // messages received before the cut
  std::vector<at::Tensor> messages;
  for (int k = 0; k < 4; ++k) messages.push_back(pattern(at::kByte, kBytes, 700 + static_cast<uint64_t>(k)));
  Shared<Sync> s;
  std::vector<Child> children;
  children.reserve(2);
  children.emplace_back([&] {
    ProcessGroupShm pg(name, 0, 2, opts);
    for (int64_t k = 0;; ++k) {
      SHM_CHECK(s->stop.load() == 0, "the test gave up");
      GuardedRecv buf(kBytes);
      const Caught c = outcome(post_recv(pg, buf.view(), 1, 1));
      CHECK_GUARDS(buf, "message " << k);
      if (c.threw) {
        note("streaming, receiver: message " + std::to_string(k) + ": " + c.describe());
        expect_error<TransportError>(c, "the receiver", {"truncated"});
        break;
      }
      SHM_CHECK(same_bytes(buf.view(), messages[static_cast<size_t>(k % 4)]), "message " << k << " has wrong bytes");
      s->count.store(k + 1);
    }
  });
  children.emplace_back([&] {
    ProcessGroupShm pg(name, 1, 2, opts);
    for (int64_t k = 0;; ++k) {
      SHM_CHECK(s->stop.load() == 0, "the test gave up");
      const Caught c = catch_any([&] { post_send(pg, messages[static_cast<size_t>(k % 4)], 0, 1)->wait(); });
      if (c.threw) {
        note("streaming, sender: message " + std::to_string(k) + ": " + c.describe());
        expect_error<TransportError>(c, "the sender", {"truncated"});
        break;
      }
    }
  });
  const auto deadline = Clock::now() + 30s;
  while (s->count.load() < kBeforeCut && Clock::now() < deadline && !children[0].poll() && !children[1].poll()) {
    std::this_thread::sleep_for(1ms);
  }
  if (s->count.load() >= kBeforeCut) {
    truncate_file(segment_path(name), 0);
  } else {
    s->stop.store(1);
    ADD_FAILURE() << "the ranks did not stream " << kBeforeCut << " messages";
  }
  wait_all(children, 30s);
  EXPECT_EQ(children[0].signal(), 0) << "receiver: " << children[0].describe();
  EXPECT_TRUE(children[0].ok()) << "receiver: " << children[0].describe();
  EXPECT_EQ(children[1].signal(), 0) << "sender: " << children[1].describe();
  EXPECT_TRUE(children[1].ok()) << "sender: " << children[1].describe();
}

// A process that attaches after the cut, while the members live, gets a SegmentError (never a
// SIGBUS); the members' next transfers fail with "truncated".
TEST_F(ShmHostile, AttachingToATruncatedSegmentIsRefusedWithoutSigbus) {
  set_deadline(120s);
  const std::string name = unique_name();
  const ShmOptions opts = small_options();
  Shared<Sync> s;
  std::vector<Child> members;
  members.reserve(2);
  for (int r = 0; r < 2; ++r) {
    members.emplace_back([&, r] {
      ProcessGroupShm pg(name, r, 2, opts);
      s->ready.fetch_add(1);
      await(s->go, 1, "the test", 60s);  // idle (no tdshm call) while the file is cut and attached to
      if (r == 1) {
        expect_error<TransportError>(catch_any([&] { post_send(pg, at::ones({64}, at::kByte), 0, 3)->wait(); }),
                                     "member rank 1's send", {"truncated"});
      } else {
        GuardedRecv buf(64);
        expect_error<TransportError>(outcome(post_recv(pg, buf.view(), 1, 3)), "member rank 0's recv", {"truncated"});
        CHECK_GUARDS(buf, "member rank 0's recv");
      }
    });
  }
  const auto deadline = Clock::now() + 20s;
  while (s->ready.load() < 2 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(s->ready.load(), 2) << members[0].describe() << "; " << members[1].describe();
  const std::string path = segment_path(name);
  const off_t full = file_size(path);
  for (Cut cut : {Cut::kHalf, Cut::kHalfPage, Cut::kZero}) {
    SCOPED_TRACE(cut_name(cut));
    truncate_file(path, cut_size(cut, full));
    for (int rank : {0, 1}) {
      Child attacher([&] {
        ShmOptions o = opts;
        o.timeout = 3s;
        const Caught c = SHM_CHECK_THROWS(SegmentError, [&] { ProcessGroupShm pg(name, rank, 2, o); });
        note(std::string("attach as rank ") + std::to_string(rank) + " after a cut " + cut_name(cut) + ": " +
             c.describe());
        if (cut != Cut::kZero) {
          SHM_CHECK(contains_nocase(c.what, "truncated"),
                    "the error does not say the segment was truncated: " << c.what);
        }
      });
      attacher.wait(20s);
      EXPECT_EQ(attacher.signal(), 0) << "the attacher crashed: " << attacher.describe();
      EXPECT_TRUE(attacher.ok()) << "attacher as rank " << rank << ": " << attacher.describe();
    }
  }
  s->go.store(1);
  wait_all(members, 30s);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(members[static_cast<size_t>(r)].signal(), 0)
        << "member " << r << ": " << members[static_cast<size_t>(r)].describe();
    EXPECT_TRUE(members[static_cast<size_t>(r)].ok())
        << "member " << r << ": " << members[static_cast<size_t>(r)].describe();
  }
}

// When no member lives any more, a truncated segment is replaced: a new group forms under the name.
TEST_F(ShmHostile, TruncatedSegmentOfDeadRanksIsReplaced) {
  set_deadline(120s);
  const ShmOptions opts = small_options();
  for (Cut cut : {Cut::kZero, Cut::kHalfPage, Cut::kHalf}) {
    SCOPED_TRACE(cut_name(cut));
    const std::string name = unique_name();
    Shared<Sync> s;
    std::vector<Child> members;
    members.reserve(2);
    for (int r = 0; r < 2; ++r) {
      members.emplace_back([&, r] {
        ProcessGroupShm pg(name, r, 2, opts);
        s->ready.fetch_add(1);
        await(s->go, 1, "the test", 60s);
      });
    }
    const auto deadline = Clock::now() + 20s;
    while (s->ready.load() < 2 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    ASSERT_EQ(s->ready.load(), 2) << members[0].describe() << "; " << members[1].describe();
    const std::string path = segment_path(name);
    truncate_file(path, cut_size(cut, file_size(path)));
    for (Child& m : members) m.kill();
    for (Child& m : members) m.wait(10s);
    const at::Tensor a = pattern(at::kFloat, 5000, 1), b = pattern(at::kFloat, 5000, 2);
    SHM_EXPECT_RANKS_OK(run_ranks(
        Peers::kProcesses, 2,
        [&](int r) {
          ProcessGroupShm pg(name, r, 2, opts);
          const at::Tensor got = at::zeros({5000}, at::kFloat);
          auto sw = post_send(pg, r == 0 ? a : b, 1 - r, 1);
          post_recv(pg, got, 1 - r, 1)->wait();
          sw->wait();
          SHM_CHECK(same_bytes(got, r == 0 ? b : a), "rank " << r << " received wrong bytes in the new group");
        },
        30s));
    EXPECT_EQ(shm_entries_of(name), std::vector<std::string>{}) << "left behind after the new group left";
    if (HasFailure()) break;
  }
}

// ---------------------------------------------------------------------------------------------
// 5. Back-pressure: ShmOptions::max_unexpected_bytes (honest peers)

/// Checks, until rank 0 reaches `level` of posting, that `send` is not complete: rank 0 may hold
/// at most max_unexpected_bytes of early messages, so the rest waits in the ring.
void check_held(const c10::intrusive_ptr<c10d::Work>& send, const std::atomic<int>& posting, int level,
                const std::string& what) {
  const auto deadline = Clock::now() + 20s;
  for (;;) {
    const bool completed = send->isCompleted();
    // Rank 0 announces before it posts: a send complete before the announcement was drained
    // without its recv, past the budget.
    const bool announced = posting.load(std::memory_order_seq_cst) >= level;
    SHM_CHECK(!completed || announced, what << " completed before rank 0 posted its recv: rank 0 took more than "
                                               "max_unexpected_bytes of early messages");
    if (announced) return;
    SHM_CHECK(Clock::now() < deadline, "rank 0 never posted its receives");
    std::this_thread::sleep_for(2ms);
  }
}

TEST_F(ShmHostile, UnexpectedBudgetKeepsEarlyMessagesInTheRingAndDropsNothing) {
  set_deadline(120s);
  const std::string name = unique_name();
  ShmOptions opts = small_options();
  opts.timeout = 10s;
  opts.max_unexpected_bytes = 64 << 10;
  constexpr int kMessages = 5;
  constexpr int64_t kBytes = 48 << 10;  // two of them exceed the budget
  constexpr int64_t kBig = 256 << 10;   // alone larger than the budget
  std::vector<at::Tensor> messages;
  for (int k = 0; k < kMessages; ++k) messages.push_back(pattern(at::kByte, kBytes, 500 + static_cast<uint64_t>(k)));
  const at::Tensor big = pattern(at::kByte, kBig, 600);
  Shared<Sync> s;
  run_roles({{"receiver (rank 0)",
              [&] {
                const SignalOnExit done(s->victim_done);
                ProcessGroupShm pg(name, 0, 3, opts);
                const at::Tensor tick = at::zeros({8}, at::kByte);
                // While it waits for rank 2, rank 0 takes rank 1's early messages as far as the budget goes.
                post_recv(pg, tick, 2, 50)->wait();
                std::this_thread::sleep_for(300ms);
                s->go.store(1);
                std::vector<GuardedRecv> bufs;
                bufs.reserve(kMessages);
                for (int k = 0; k < kMessages; ++k) bufs.emplace_back(kBytes);
                std::vector<c10::intrusive_ptr<c10d::Work>> works(kMessages);
                for (int k = kMessages - 1; k >= 0; --k)
                  works[static_cast<size_t>(k)] = post_recv(pg, bufs[static_cast<size_t>(k)].view(), 1, k + 1);
                for (int k = kMessages - 1; k >= 0; --k) works[static_cast<size_t>(k)]->wait();
                for (int k = 0; k < kMessages; ++k) {
                  SHM_CHECK(same_bytes(bufs[static_cast<size_t>(k)].view(), messages[static_cast<size_t>(k)]),
                            "message with tag " << k + 1 << " has wrong bytes");
                  CHECK_GUARDS(bufs[static_cast<size_t>(k)], "message with tag " << k + 1);
                }
                // One message larger than the whole budget arrives once its recv is posted.
                post_recv(pg, tick, 2, 51)->wait();
                std::this_thread::sleep_for(300ms);
                s->go.store(2);
                GuardedRecv big_buf(kBig);
                post_recv(pg, big_buf.view(), 1, 9)->wait();
                SHM_CHECK(same_bytes(big_buf.view(), big), "the large message has wrong bytes");
                CHECK_GUARDS(big_buf, "the large message");
                s->victim_done.store(1);
              }},
             {"sender (rank 1)",
              [&] {
                ProcessGroupShm pg(name, 1, 3, opts);
                std::vector<c10::intrusive_ptr<c10d::Work>> works;
                for (int k = 0; k < kMessages; ++k)
                  works.push_back(post_send(pg, messages[static_cast<size_t>(k)], 0, k + 1));
                s->stage.store(1);
                works[0]->wait();  // the first one fits the budget: rank 0 takes it before any recv
                check_held(works[kMessages - 1], s->go, 1, "the send with tag " + std::to_string(kMessages));
                for (auto& w : works) w->wait();
                auto wb = post_send(pg, big, 0, 9);
                s->published.store(1);
                check_held(wb, s->go, 2, "the send larger than the budget");
                wb->wait();
                await(s->victim_done, 1, "the receiver");
              }},
             {"ticker (rank 2)",
              [&] {
                ProcessGroupShm pg(name, 2, 3, opts);
                await(s->stage, 1, "rank 1's sends");
                std::this_thread::sleep_for(300ms);
                post_send(pg, at::ones({8}, at::kByte), 0, 50)->wait();
                await(s->published, 1, "rank 1's large send");
                std::this_thread::sleep_for(300ms);
                post_send(pg, at::ones({8}, at::kByte), 0, 51)->wait();
                await(s->victim_done, 1, "the receiver");
              }}},
            60s);
}

// ---------------------------------------------------------------------------------------------
// 6. Memmap references naming files the receiver must not read

struct ReferenceCase {
  std::string what;
  std::string path;
  uint64_t offset = 0;
  std::vector<std::string> needles;  // empty: the receive succeeds (a control)
  bool corrupt = false;              // refused when it arrives: the pair fails
};

TEST_F(ShmHostile, MemmapReferencesToUnreadableFilesFailTheRecv) {
  set_deadline(300s);
  const ShmOptions opts = small_options();
  constexpr int64_t kBytes = 64;
  TempDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const at::Tensor good_bytes = pattern(at::kByte, kBytes, 42);
  auto write_file = [&](const std::string& path, const void* data, size_t n) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
    ASSERT_EQ(::write(fd, data, n), static_cast<ssize_t>(n));
    ::close(fd);
  };
  const std::string good = dir.file("good.bin");
  write_file(good, good_bytes.data_ptr(), kBytes);
  const std::string short_file = dir.file("short.bin");
  write_file(short_file, good_bytes.data_ptr(), 10);
  const std::string link = dir.file("link.bin");
  ASSERT_EQ(::symlink(good.c_str(), link.c_str()), 0) << std::strerror(errno);
  const std::string dir_name = dir.path().substr(dir.path().rfind('/') + 1);
  const std::string linked_dir = dir.file("linked");
  ASSERT_EQ(::symlink(dir.path().c_str(), linked_dir.c_str()), 0) << std::strerror(errno);
  const std::string others = dir.file("others.bin");
  write_file(others, good_bytes.data_ptr(), kBytes);
  const bool root = ::geteuid() == 0;  // only root can give a file to another user
  if (root) {
    ASSERT_EQ(::chown(others.c_str(), 65534, 65534), 0) << std::strerror(errno);
  }

  std::vector<ReferenceCase> cases{
      {"a regular file (control)", good, 0, {}, false},
      {"a FIFO", fifo, 0, {"not a regular file"}, false},
      {"/dev/zero", "/dev/zero", 0, {"not a regular file"}, false},
      {"a regular file shorter than the message", short_file, 0, {"has 10 bytes", "needs 64"}, false},
      {"an offset near the end of a file", good, 32, {"needs 96"}, false},
      {"a missing file", dir.path() + "/missing.bin", 0, {"cannot open"}, false},
      {"a symbolic link", link, 0, {"symbolic link"}, false},
      {"a path through a linked directory", linked_dir + "/good.bin", 0, {"linked' is a symbolic link"}, false},
      {"a relative path", "short.bin", 0, {"corrupted entry", "not absolute"}, true},
      {"a path with /../", dir.path() + "/../" + dir_name + "/good.bin", 0, {"corrupted entry", ".."}, true},
      {"a path with /./", dir.path() + "/./good.bin", 0, {"corrupted entry", "'.'"}, true},
      {"an offset that overflows",
       good,
       std::numeric_limits<uint64_t>::max() - 10,
       {"corrupted entry", "offset"},
       true},
      {"an empty path", "", 0, {"corrupted entry", "path length"}, true},
  };
  if (root) cases.push_back({"another user's file", others, 0, {"owned by uid 65534"}, false});
  for (const ReferenceCase& rc : cases) {
    for (const bool posted_first : {true, false}) {
      const std::string what =
          "a reference to " + rc.what + (posted_first ? ", recv posted first" : ", recv posted after it arrived");
      SCOPED_TRACE(what);
      const std::string name = unique_name();
      constexpr int64_t kTag = 3, kAfterTag = 4;
      const at::Tensor after = pattern(at::kByte, 8, 43);
      Shared<Sync> s;
      run_roles({{"victim (rank 0)",
                  [&] {
                    const SignalOnExit done(s->victim_done);
                    ProcessGroupShm pg(name, 0, 2, opts);
                    GuardedRecv buf(kBytes);
                    Caught c;
                    if (posted_first) {
                      auto w = post_recv(pg, buf.view(), 1, kTag);
                      s->posted.store(1);
                      c = outcome(w);
                    } else {
                      await(s->published, 1, "the hostile entries");
                      // Receiving the later message first takes the reference in as an early message.
                      const at::Tensor got = at::zeros({8}, at::kByte);
                      const Caught first = outcome(post_recv(pg, got, 1, kAfterTag));
                      if (rc.corrupt) {
                        expect_error<TransportError>(first, what + ", the message after it", {"corrupted entry"});
                      } else {
                        SHM_CHECK(!first.threw, what << ", the message after it: " << first.describe());
                        SHM_CHECK(same_bytes(got, after), what << ": the message after it has wrong bytes");
                      }
                      c = outcome(post_recv(pg, buf.view(), 1, kTag));
                    }
                    note(what + ": " + c.describe());
                    if (rc.needles.empty()) {
                      SHM_CHECK(!c.threw, what << ": " << c.describe());
                      SHM_CHECK(same_bytes(buf.view(), good_bytes), what << ": wrong bytes");
                    } else {
                      expect_error<TransportError>(c, what, rc.needles);
                    }
                    CHECK_GUARDS(buf, what);
                    s->victim_done.store(1);
                  }},
                 {"hostile (rank 1)",
                  [&] {
                    ProcessGroupShm pg(name, 1, 2, opts);
                    const RingWriter ring(name, 1, 0);
                    if (posted_first) await(s->posted, 1, "the victim's recv");
                    const std::string payload = reference_payload(rc.path, rc.offset);
                    ring.put(0,
                             {.tag = kTag,
                              .total = kBytes,
                              .chunk = static_cast<uint32_t>(payload.size()),
                              .flags = shm::kEntryFirst | shm::kEntryLast | shm::kEntryReference},
                             payload.data(), payload.size());
                    ring.put(1, {.tag = kAfterTag, .total = 8, .chunk = 8, .flags = shm::kEntryFirst | shm::kEntryLast},
                             after.data_ptr(), 8);
                    s->published.store(1);
                    await(s->victim_done, 1, "the victim");
                  }}},
                30s);
      if (HasFailure()) return;
    }
  }
}

// A loan rewritten while the receiver copies it: the hostile rank lends 64 MiB of its heap (its
// own entry, its own ticket handed to the victim), then, at a moment inside the victim's copy,
// rewrites the heap's last MiB and takes the ticket back. The victim's receive must fail with a
// TransportError (the ticket no longer named it after the copy, or before it began), or hold
// exactly the lent bytes (the rewrite came after the copy): never torn bytes silently. Several
// moments, so that some land inside the copy (about 10 ms here).
TEST_F(ShmHostile, ALoanTakenBackDuringTheCopyFailsTheRecv) {
  set_deadline(300s);
  ShmOptions opts = small_options();
  constexpr int64_t kBytes = int64_t{64} << 20;
  constexpr int64_t kRewritten = int64_t{1} << 20;
  opts.loan_bytes = kBytes;
  for (const auto delay : {200us, 1000us, 2000us, 4000us, 8000us}) {
    const std::string what = "the loan taken back " + std::to_string(delay.count()) + " us after it was published";
    SCOPED_TRACE(what);
    const std::string name = unique_name();
    constexpr int64_t kTag = 5;
    Shared<Sync> s;
    run_roles({{"victim (rank 0)",
                [&] {
                  const SignalOnExit done(s->victim_done);
                  ProcessGroupShm pg(name, 0, 2, opts);
                  const at::Tensor got = at::zeros({kBytes}, at::kByte);
                  auto w = post_recv(pg, got, 1, kTag);
                  s->posted.store(1);
                  const Caught c = outcome(w);
                  note(what + ": " + c.describe());
                  if (c.threw) {
                    expect_error<TransportError>(c, what, {"loan"});
                  } else {
                    SHM_CHECK(at::equal(got, at::full({kBytes}, 0x11, at::kByte)),
                              what << ": the receive succeeded with bytes the sender rewrote (a torn copy)");
                  }
                  s->victim_done.store(1);
                }},
               {"hostile (rank 1)",
                [&] {
                  ProcessGroupShm pg(name, 1, 2, opts);
                  const RingWriter ring(name, 1, 0);
                  SHM_CHECK(ring.loan_heap_bytes() >= static_cast<uint64_t>(kBytes), "the loan heap is too small");
                  std::memset(ring.loan_heap(), 0x11, kBytes);
                  ring.loan_ticket(0).store(1, std::memory_order_relaxed);  // handed to rank 0
                  await(s->posted, 1, "the victim's recv");
                  std::this_thread::sleep_for(1ms);  // the victim sleeps in its wait
                  const shm::LoanReference ref{0, 0, 0};
                  ring.put(0,
                           {.tag = kTag,
                            .total = kBytes,
                            .chunk = sizeof ref,
                            .flags = shm::kEntryFirst | shm::kEntryLast | shm::kEntryLoan},
                           &ref, sizeof ref);
                  const auto at = Clock::now() + delay;
                  while (Clock::now() < at) {
                  }
                  std::memset(ring.loan_heap() + kBytes - kRewritten, 0x22, kRewritten);
                  ring.loan_ticket(0).store(0, std::memory_order_release);  // taken back
                  await(s->victim_done, 1, "the victim");
                }}},
              60s);
    if (HasFailure()) return;
  }
}

// A loan whose offset is not aligned for its dtype: a view of it is refused (TransportError);
// the same bytes at an aligned offset arrive as a view of the right floats.
TEST_F(ShmHostile, AMisalignedLoanIsRefusedAsAView) {
  set_deadline(120s);
  const ShmOptions opts = small_options();
  constexpr int64_t kFloats = 16;
  for (const uint64_t offset : {uint64_t{4}, uint64_t{2}, uint64_t{4097}}) {
    const bool aligned = offset % sizeof(float) == 0;
    const std::string what = "a float loan at heap offset " + std::to_string(offset);
    SCOPED_TRACE(what);
    const std::string name = unique_name();
    constexpr int64_t kTag = 6;
    const at::Tensor values = at::arange(kFloats, at::kFloat);
    Shared<Sync> s;
    run_roles({{"victim (rank 0)",
                [&] {
                  const SignalOnExit done(s->victim_done);
                  ProcessGroupShm pg(name, 0, 2, opts);
                  auto w = pg.irecv_view(1, kTag);
                  const Caught c = outcome(w);
                  note(what + ": " + c.describe());
                  if (aligned) {
                    SHM_CHECK(!c.threw, what << ": " << c.describe());
                    SHM_CHECK(at::equal(w->result().at(0), values), what << ": wrong values");
                  } else {
                    expect_error<TransportError>(c, what, {"not aligned", "Float"});
                  }
                  s->victim_done.store(1);
                }},
               {"hostile (rank 1)",
                [&] {
                  ProcessGroupShm pg(name, 1, 2, opts);
                  const RingWriter ring(name, 1, 0);
                  std::memcpy(ring.loan_heap() + offset, values.data_ptr(), kFloats * sizeof(float));
                  ring.loan_ticket(3).store(1, std::memory_order_relaxed);  // handed to rank 0
                  const shm::LoanReference ref{offset, 3, 0};
                  ring.put(0,
                           {.tag = kTag,
                            .total = kFloats * sizeof(float),
                            .chunk = sizeof ref,
                            .flags = shm::kEntryFirst | shm::kEntryLast | shm::kEntryLoan,
                            .dtype = static_cast<uint8_t>(at::kFloat)},
                           &ref, sizeof ref);
                  await(s->victim_done, 1, "the victim");
                }}},
              60s);
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace tdshm::test
