#pragma once
// Helpers of the tests that run peers: the shared-memory transport (tdshm_shm_tests) and the
// process groups (tdshm_dist_tests). Built once, as the static library tdshm_test_support.
//
// Peers run in two ways, with the same scenario code:
//  - as threads: `world` std::threads of this process, each constructing its own ProcessGroupShm
//    (the segment is mapped per object, so threads of one process can be ranks). These also run
//    under ThreadSanitizer.
//  - as processes: fork()ed children. The test process has already used ATen, so a child calls
//    at::set_num_threads(1) first and then only uses tdshm and simple ATen ops. A child reports
//    through its exit code (0: fine) and a message written to a pipe; it ends with _exit().
//
// Scenarios therefore never use gtest assertions (a child's gtest state is lost): they check with
// SHM_CHECK, which throws CheckFailure, and the runner turns what a rank threw into a failure of
// the test in the parent.
//
// Every test has a deadline (ShmTest's watchdog ends the process with a message if a test
// overstays, after killing its children and removing its segments), a unique segment name per
// group, and a final check that nothing named after its segments is left in /dev/shm.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/errors.h>
#include <tdshm/process_group.h>

#include <sys/mman.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "shm/layout/segment_layout.h"

namespace tdshm::test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Options and names

/// Options that make modest messages interesting: 4 KiB slots (larger messages are chunked),
/// 4-entry rings (a sender soon waits for its receiver), a deadline of a few seconds and a
/// quick liveness check.
ShmOptions small_options(std::chrono::microseconds spin = 50us);

/// Default slot geometry, a test-sized deadline.
ShmOptions default_slot_options();

/// Where the segment `name` lives: /dev/shm/tdshm.<name>.
std::string segment_path(const std::string& name);

/// Names of the entries of /dev/shm that belong to the segment `name`: tdshm's entries whose
/// names contain `name` (the segment "tdshm.<name>", any lock file or semaphore named after it,
/// and a board made under a name built from it, "tdshm-board.b<name>"); every tdshm entry for "".
std::vector<std::string> shm_entries_of(const std::string& name);

/// Removes the entries shm_entries_of(name); returns their names.
std::vector<std::string> remove_shm_entries_of(const std::string& name);

/// CLOCK_MONOTONIC in nanoseconds: comparable between the processes of this host.
int64_t monotonic_ns();

// ---------------------------------------------------------------------------------------------
// Checks that work in threads and children

class CheckFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail_check(const char* file, int line, const std::string& what);

/// SHM_CHECK(cond, stream-expr...): throws CheckFailure with file:line and the message.
#define SHM_CHECK(cond, ...)                                                  \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::ostringstream shm_check_os_;                                       \
      shm_check_os_ << "check failed: " #cond " " __VA_OPT__(<< __VA_ARGS__); \
      ::tdshm::test::fail_check(__FILE__, __LINE__, shm_check_os_.str());     \
    }                                                                         \
  } while (false)

/// What a call threw: nothing, or its dynamic type and message.
struct Caught {
  bool threw = false;
  std::string type;  // demangled dynamic type of the exception
  std::string what;
  std::exception_ptr error;

  /// True if the exception is an E (or derives from it).
  template <typename E>
  bool is() const {
    if (!error) return false;
    try {
      std::rethrow_exception(error);
    } catch (const E&) {
      return true;
    } catch (...) {
      return false;
    }
  }
  /// "no exception" or "<type>: <message>".
  std::string describe() const;
};

/// Describes the exception being handled (call inside a catch block).
Caught caught_current();

template <typename Fn>
Caught catch_any(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (...) {
    return caught_current();
  }
  return {};
}

/// Runs `fn` and checks that it throws an E whose message contains every one of `needles`
/// (case-insensitive). Returns what was thrown (for further checks).
template <typename E, typename Fn>
Caught check_throws(const char* file, int line, Fn&& fn, const std::vector<std::string>& needles = {});

bool contains_nocase(const std::string& haystack, const std::string& needle);

#define SHM_CHECK_THROWS(E, fn, ...) \
  ::tdshm::test::check_throws<E>(__FILE__, __LINE__, fn __VA_OPT__(, std::vector<std::string>{__VA_ARGS__}))

std::string demangle(const char* mangled);

template <typename E, typename Fn>
Caught check_throws(const char* file, int line, Fn&& fn, const std::vector<std::string>& needles) {
  Caught c = catch_any(std::forward<Fn>(fn));
  if (!c.is<E>()) {
    fail_check(file, line, "expected " + demangle(typeid(E).name()) + ", got " + c.describe());
  }
  for (const std::string& n : needles) {
    if (!contains_nocase(c.what, n)) {
      fail_check(file, line, "the " + c.type + " message does not mention \"" + n + "\": " + c.what);
    }
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Tensors

/// `numel` elements of `dtype`, filled from a hash of (seed, byte index): every byte pattern of
/// integers, no NaN for floating types (so that equality of values and of bytes agree), 0/1 for
/// bool. Deterministic, so two processes make the same tensor.
at::Tensor pattern(at::ScalarType dtype, int64_t numel, uint64_t seed);

/// True if a and b have the same dtype and shape and the same bytes in row-major order.
bool same_bytes(const at::Tensor& a, const at::Tensor& b);

/// FNV-1a of the row-major bytes of `t`.
uint64_t checksum(const at::Tensor& t);

/// How a tensor of a test sits in memory.
enum class Layout {
  kContiguous,
  kStrided,     // every other element of a larger buffer (non-contiguous for numel > 1)
  kTransposed,  // shape (a, b) viewing a (b, a) buffer (non-contiguous when a, b > 1)
};
const char* layout_name(Layout layout);

/// A tensor equal to `values` (1-D, or 2-D for kTransposed) laid out as asked.
at::Tensor with_layout(const at::Tensor& values, Layout layout);

/// An uninitialised-looking (filled with 0xA5 bytes) tensor of the same dtype and shape as
/// `like`, laid out as asked. For bool, filled with true.
at::Tensor blank_like(const at::Tensor& like, Layout layout);

// ---------------------------------------------------------------------------------------------
// The bytes of a segment, mapped without tdshm (to inspect or corrupt it on purpose)

class RawSegment {
 public:
  /// Maps /dev/shm/tdshm.<name> read-write. Throws CheckFailure if it cannot.
  explicit RawSegment(const std::string& name);
  ~RawSegment();
  RawSegment(const RawSegment&) = delete;
  RawSegment& operator=(const RawSegment&) = delete;

  size_t size() const { return size_; }
  std::byte* data() const { return static_cast<std::byte*>(base_); }
  shm::SegmentHeader& header() const { return *static_cast<shm::SegmentHeader*>(base_); }
  /// Rank slot `rank` (uses the header's rank_table_offset; the caller checks it is sane).
  shm::RankSlot& rank_slot(int rank) const;

 private:
  void* base_ = MAP_FAILED;
  size_t size_ = 0;
};

/// Waits until /dev/shm/tdshm.<name> exists, its header is published (layout_version != 0) and
/// the ranks in `live_ranks` show as live. Returns false at the deadline.
bool wait_segment_ready(const std::string& name, const std::vector<int>& live_ranks, Clock::duration timeout);

/// Stops `pid` (SIGSTOP) at a moment it does not hold the lock of segment `name`: a rank holds it
/// until it is attached, after its slot already shows as live, and one stopped before then would
/// keep every other rank out. Tries again (SIGCONT, 1 ms) until then; false at the deadline (the
/// process is left running).
bool stop_outside_segment_lock(pid_t pid, const std::string& name, Clock::duration timeout);

// ---------------------------------------------------------------------------------------------
// Memory shared with forked children

/// A T in an anonymous MAP_SHARED mapping: made before fork(), seen by parent and children.
/// T must be trivially destructible (atomics and plain data).
template <typename T>
class Shared {
  static_assert(std::is_trivially_destructible_v<T>);

 public:
  Shared() {
    mem_ = ::mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem_ == MAP_FAILED) throw std::bad_alloc();
    new (mem_) T();
  }
  ~Shared() { ::munmap(mem_, sizeof(T)); }
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;
  T* operator->() const { return static_cast<T*>(mem_); }
  T& operator*() const { return *static_cast<T*>(mem_); }

 private:
  void* mem_;
};

// ---------------------------------------------------------------------------------------------
// Peers

/// A forked child running `body`. The destructor kills (SIGKILL) and reaps a child still
/// running, so a failing test leaves no process behind.
class Child {
 public:
  /// Forks; the child sets one ATen thread, runs body() and _exit()s with 0, or with a code per
  /// kind of failure after writing the failure to a pipe.
  explicit Child(std::function<void()> body);
  /// Takes charge of `pid`, a process that is already this process's child (one a child
  /// subreaper inherited, as tests/dist/python_launcher.h does): waited for, killed and described
  /// like a forked one, without the failure pipe.
  static Child adopt(pid_t pid);
  ~Child();
  Child(Child&& other) noexcept;
  Child& operator=(Child&&) = delete;
  Child(const Child&) = delete;

  pid_t pid() const { return pid_; }
  /// Waits for the child at most `timeout`, reaping it; kills it with SIGKILL when it overstays
  /// (then timed_out()). Returns true once it has exited.
  bool wait(Clock::duration timeout);
  /// Reaps the child if it has exited; does not block.
  bool poll();
  /// SIGKILLs the child (it is reaped by wait/poll/destructor).
  void kill();
  bool exited() const { return reaped_; }
  bool timed_out() const { return timed_out_; }
  /// True if it exited with status 0.
  bool ok() const { return reaped_ && exit_code_ == 0 && signal_ == 0; }
  int signal() const { return signal_; }
  /// "pid N exited with 0", "... killed by signal 9", plus what it wrote to its pipe.
  std::string describe() const;

 private:
  Child() = default;
  void drain();

  pid_t pid_ = -1;
  int pipe_fd_ = -1;
  bool reaped_ = false;
  bool timed_out_ = false;
  int exit_code_ = -1;
  int signal_ = 0;
  std::string message_;
};

/// Waits for all `children` with one common deadline; those still running then are killed.
/// Returns true if all exited in time.
bool wait_all(std::vector<Child>& children, Clock::duration timeout);

enum class Peers { kThreads, kProcesses };
const char* peers_name(Peers peers);

/// Runs body(rank) for rank 0..world-1 as threads or as processes, and returns one line per rank
/// that failed (empty if all succeeded). A thread that overstays `timeout` ends the whole test
/// process through the watchdog (a thread cannot be killed); a child is killed.
std::vector<std::string> run_ranks(Peers peers, int world, const std::function<void(int)>& body,
                                   Clock::duration timeout = 60s);

/// run_ranks, and a gtest failure per failed rank.
#define SHM_EXPECT_RANKS_OK(failures)                              \
  do {                                                             \
    const auto shm_failures_ = (failures);                         \
    for (const std::string& f : shm_failures_) ADD_FAILURE() << f; \
  } while (false)

// ---------------------------------------------------------------------------------------------
// The fixture

/// Base of every test: a watchdog deadline, unique segment names, and a check at the end that
/// nothing named after them is left in /dev/shm.
class ShmTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  /// A fresh segment name: "t<pid>x<counter>x<hash of the test name>", unique on this host.
  std::string unique_name();
  /// Replaces the watchdog's deadline (counted from now).
  void set_deadline(Clock::duration timeout);
};

/// pg.send / pg.recv of one tensor (c10d takes a vector), on any c10d group.
inline c10::intrusive_ptr<c10d::Work> post_send(c10d::ProcessGroup& pg, const at::Tensor& t, int dst, int tag) {
  std::vector<at::Tensor> v{t};
  return pg.send(v, dst, tag);
}
inline c10::intrusive_ptr<c10d::Work> post_recv(c10d::ProcessGroup& pg, const at::Tensor& t, int src, int tag) {
  std::vector<at::Tensor> v{t};
  return pg.recv(v, src, tag);
}

/// One small and one chunked message each way between ranks 0 and 1 of `pg` (checked with
/// SHM_CHECK): the group works.
void exchange(ProcessGroupShm& pg);

}  // namespace tdshm::test
