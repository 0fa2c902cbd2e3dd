// Helpers of the shared-memory transport tests: see shm_test_support.h.

#include "shm_test_support.h"

#include <cxxabi.h>
#include <dirent.h>
#include <errno.h>  // program_invocation_short_name (GNU)
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

namespace tdshm::test {

// ---------------------------------------------------------------------------------------------
// What the current test owns, for the emergency exit of the watchdog

namespace {

struct Registry {
  std::mutex mutex;
  std::set<pid_t> children;
  std::vector<std::string> names;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: used until _exit
  return *r;
}

void register_child(pid_t pid) {
  std::lock_guard lock(registry().mutex);
  registry().children.insert(pid);
}

void unregister_child(pid_t pid) {
  std::lock_guard lock(registry().mutex);
  registry().children.erase(pid);
}

/// The process is about to end because a deadline passed: leave nothing behind.
[[noreturn]] void emergency_exit(const std::string& why) {
  std::fprintf(stderr, "\n*** %s: %s; killing children, removing segments, exiting\n", program_invocation_short_name,
               why.c_str());
  std::fflush(stderr);
  // No lock: the thread that holds it may be the one that is stuck.
  for (pid_t pid : registry().children) ::kill(pid, SIGKILL);
  for (pid_t pid : registry().children) ::waitpid(pid, nullptr, 0);
  for (const std::string& name : registry().names) remove_shm_entries_of(name);
  std::_Exit(124);
}

// Children exit codes.
constexpr int kExitCheck = 10;
constexpr int kExitTdshm = 11;
constexpr int kExitC10 = 12;
constexpr int kExitStd = 13;
constexpr int kExitUnknown = 14;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Options and names

ShmOptions small_options(std::chrono::microseconds spin) {
  ShmOptions o;
  o.timeout = 5s;
  o.spin = spin;
  o.slot_bytes = 4096;
  o.ring_entries = 4;
  o.peer_check_interval = 50ms;
  return o;
}

ShmOptions default_slot_options() {
  ShmOptions o;
  o.timeout = 60s;
  o.peer_check_interval = 100ms;
  return o;
}

std::string segment_path(const std::string& name) { return "/dev/shm/tdshm." + name; }

std::vector<std::string> shm_entries_of(const std::string& name) {
  std::vector<std::string> out;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return out;
  while (const dirent* e = ::readdir(dir)) {
    const std::string entry = e->d_name;
    // tdshm's, and named after `name` (unique_name()s never contain one another).
    if (entry.rfind("tdshm", 0) == 0 && entry.find(name) != std::string::npos) out.push_back(entry);
  }
  ::closedir(dir);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> remove_shm_entries_of(const std::string& name) {
  std::vector<std::string> removed = shm_entries_of(name);
  for (const std::string& entry : removed) ::unlink(("/dev/shm/" + entry).c_str());
  return removed;
}

int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// ---------------------------------------------------------------------------------------------
// Checks

void fail_check(const char* file, int line, const std::string& what) {
  const char* base = std::strrchr(file, '/');
  throw CheckFailure(std::string(base != nullptr ? base + 1 : file) + ":" + std::to_string(line) + ": " + what);
}

std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(mangled);
}

Caught caught_current() {
  Caught c;
  c.threw = true;
  c.error = std::current_exception();
  try {
    throw;
  } catch (const std::exception& e) {
    c.type = demangle(typeid(e).name());
    c.what = e.what();
  } catch (...) {
    const std::type_info* t = abi::__cxa_current_exception_type();
    c.type = t != nullptr ? demangle(t->name()) : "unknown";
    c.what = "(not a std::exception)";
  }
  return c;
}

std::string Caught::describe() const {
  if (!threw) return "no exception";
  std::string what_line = what;
  // c10::Error messages carry a backtrace: its first line is enough here.
  if (const size_t nl = what_line.find('\n'); nl != std::string::npos) what_line = what_line.substr(0, nl) + " [...]";
  return type + ": " + what_line;
}

bool contains_nocase(const std::string& haystack, const std::string& needle) {
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    return s;
  };
  return lower(haystack).find(lower(needle)) != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// Tensors

namespace {

uint64_t mix(uint64_t x) {
  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

at::Tensor pattern(at::ScalarType dtype, int64_t numel, uint64_t seed) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  at::Tensor bytes = at::empty({numel * elem}, at::kByte);
  auto* p = bytes.data_ptr<uint8_t>();
  const uint64_t s = mix(seed);
  for (int64_t i = 0; i < numel * elem; i += 8) {
    const uint64_t v = mix(s ^ static_cast<uint64_t>(i));
    std::memcpy(p + i, &v, static_cast<size_t>(std::min<int64_t>(8, numel * elem - i)));
  }
  if (dtype == at::kBool) {
    for (int64_t i = 0; i < numel; ++i) p[i] &= 1;
    return bytes.view(at::kBool);
  }
  at::Tensor t = bytes.view(dtype);
  if (at::isFloatingType(dtype) || at::isComplexType(dtype)) {
    // NaN compares unequal to itself; replace it (complex: view as real pairs).
    at::Tensor real = at::isComplexType(dtype) ? at::view_as_real(t) : t;
    real.masked_fill_(real.isnan(), 1.5);
  }
  return t;
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

uint64_t checksum(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kStrided: return "strided";
    case Layout::kTransposed: return "transposed";
  }
  return "?";
}

namespace {

/// An empty tensor of `shape` laid out as asked (content unspecified).
at::Tensor empty_with_layout(at::ScalarType dtype, at::IntArrayRef shape, Layout layout) {
  switch (layout) {
    case Layout::kContiguous: return at::empty(shape, dtype);
    case Layout::kStrided: {
      SHM_CHECK(shape.size() == 1, "strided layout is for 1-D tensors");
      return at::empty({shape[0], 2}, dtype).select(1, 0);
    }
    case Layout::kTransposed: {
      SHM_CHECK(shape.size() == 2, "transposed layout is for 2-D tensors");
      return at::empty({shape[1], shape[0]}, dtype).t();
    }
  }
  return {};
}

}  // namespace

at::Tensor with_layout(const at::Tensor& values, Layout layout) {
  at::Tensor out = empty_with_layout(values.scalar_type(), values.sizes(), layout);
  out.copy_(values);
  return out;
}

at::Tensor blank_like(const at::Tensor& like, Layout layout) {
  at::Tensor out = empty_with_layout(like.scalar_type(), like.sizes(), layout);
  if (like.scalar_type() == at::kBool) {
    out.fill_(true);
  } else if (out.numel() > 0) {
    // Through the bytes of the whole underlying buffer, so that every element is 0xA5.
    at::Tensor storage_bytes =
        at::from_blob(out.storage().data(), {static_cast<int64_t>(out.storage().nbytes())}, at::kByte);
    storage_bytes.fill_(0xA5);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// RawSegment

RawSegment::RawSegment(const std::string& name) {
  const std::string path = segment_path(name);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  SHM_CHECK(fd >= 0, "cannot open " << path << ": " << std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(shm::SegmentHeader))) {
    ::close(fd);
    SHM_CHECK(false, path << " is missing or smaller than a header");
  }
  size_ = static_cast<size_t>(st.st_size);
  base_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  SHM_CHECK(base_ != MAP_FAILED, "cannot map " << path << ": " << std::strerror(errno));
}

RawSegment::~RawSegment() {
  if (base_ != MAP_FAILED) ::munmap(base_, size_);
}

shm::RankSlot& RawSegment::rank_slot(int rank) const {
  const uint64_t offset = header().rank_table_offset + static_cast<uint64_t>(rank) * sizeof(shm::RankSlot);
  SHM_CHECK(offset + sizeof(shm::RankSlot) <= size_, "rank slot " << rank << " is outside the segment");
  return *reinterpret_cast<shm::RankSlot*>(data() + offset);
}

bool wait_segment_ready(const std::string& name, const std::vector<int>& live_ranks, Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  const std::string path = segment_path(name);
  while (Clock::now() < deadline) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(shm::SegmentHeader))) {
      RawSegment seg(name);
      if (seg.header().layout_version.load(std::memory_order_acquire) != 0) {
        bool all = true;
        for (int r : live_ranks) {
          all = all && seg.rank_slot(r).state.load(std::memory_order_acquire) == shm::kRankLive;
        }
        if (all) return true;
      }
    }
    std::this_thread::sleep_for(2ms);
  }
  return false;
}

bool stop_outside_segment_lock(pid_t pid, const std::string& name, Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  const std::string path = segment_path(name) + ".lock";
  for (;;) {
    if (::kill(pid, SIGSTOP) != 0) return false;
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    const bool free = fd < 0 || ::flock(fd, LOCK_EX | LOCK_NB) == 0;  // no file: no lock to hold
    if (fd >= 0) ::close(fd);                                         // drops the lock if taken
    if (free) return true;
    ::kill(pid, SIGCONT);
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
}

// ---------------------------------------------------------------------------------------------
// Child

Child::Child(std::function<void()> body) {
  // One intra-op thread, set here in the parent: children inherit it. Setting it in the child
  // created LibTorch's thread pool there, and a new thread in a child forked from this
  // multi-threaded process (the watchdog) can block forever on an allocator lock another thread
  // held at fork time (seen under ASan: ranks that never reached their rendezvous).
  static const bool single_threaded = (at::set_num_threads(1), true);
  (void)single_threaded;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw std::runtime_error("fork failed");
  }
  if (pid == 0) {
    ::close(fds[0]);
    int code = 0;
    std::string message;
    try {
      body();
    } catch (const CheckFailure& e) {
      code = kExitCheck;
      message = e.what();
    } catch (...) {
      const Caught c = caught_current();
      code = c.is<tdshm::Error>()     ? kExitTdshm
             : c.is<c10::Error>()     ? kExitC10
             : c.is<std::exception>() ? kExitStd
                                      : kExitUnknown;
      message = "threw " + c.describe();
    }
    size_t off = 0;
    while (off < message.size()) {
      const ssize_t n = ::write(fds[1], message.data() + off, message.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::_exit(code);
  }
  ::close(fds[1]);
  pid_ = pid;
  pipe_fd_ = fds[0];
  ::fcntl(pipe_fd_, F_SETFL, O_NONBLOCK);
  register_child(pid_);
}

Child Child::adopt(pid_t pid) {
  Child c;
  c.pid_ = pid;
  register_child(pid);
  return c;
}

Child::Child(Child&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      pipe_fd_(std::exchange(other.pipe_fd_, -1)),
      reaped_(other.reaped_),
      timed_out_(other.timed_out_),
      exit_code_(other.exit_code_),
      signal_(other.signal_),
      message_(std::move(other.message_)) {}

Child::~Child() {
  if (pid_ > 0 && !reaped_) {
    ::kill(pid_, SIGKILL);
    while (!poll()) std::this_thread::sleep_for(1ms);
  }
  if (pipe_fd_ >= 0) ::close(pipe_fd_);
}

void Child::drain() {
  if (pipe_fd_ < 0) return;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(pipe_fd_, buf, sizeof(buf));
    if (n <= 0) break;
    message_.append(buf, static_cast<size_t>(n));
  }
}

bool Child::poll() {
  if (reaped_ || pid_ <= 0) return reaped_;
  drain();
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r != pid_) return false;
  reaped_ = true;
  unregister_child(pid_);
  drain();
  if (WIFEXITED(status)) exit_code_ = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) signal_ = WTERMSIG(status);
  return true;
}

bool Child::wait(Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!poll()) {
    if (Clock::now() >= deadline) {
      timed_out_ = true;
      kill();
      while (!poll()) std::this_thread::sleep_for(1ms);
      return false;
    }
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

void Child::kill() {
  if (pid_ > 0 && !reaped_) ::kill(pid_, SIGKILL);
}

std::string Child::describe() const {
  std::ostringstream os;
  os << "pid " << pid_;
  if (!reaped_) {
    os << " still running";
  } else if (timed_out_) {
    os << " overstayed its deadline and was killed";
  } else if (signal_ != 0) {
    os << " was killed by signal " << signal_ << " (" << strsignal(signal_) << ")";
  } else {
    os << " exited with " << exit_code_;
  }
  if (!message_.empty()) os << ": " << message_;
  return os.str();
}

bool wait_all(std::vector<Child>& children, Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    bool all = true;
    for (Child& c : children) all = c.poll() && all;
    if (all) return true;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(1ms);
  }
  for (Child& c : children) {
    if (!c.exited()) c.wait(0s);
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Ranks

const char* peers_name(Peers peers) { return peers == Peers::kThreads ? "thread" : "process"; }

std::vector<std::string> run_ranks(Peers peers, int world, const std::function<void(int)>& body,
                                   Clock::duration timeout) {
  std::vector<std::string> failures;
  if (peers == Peers::kProcesses) {
    std::vector<Child> children;
    children.reserve(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) children.emplace_back([&body, r] { body(r); });
    wait_all(children, timeout);
    for (int r = 0; r < world; ++r) {
      if (!children[static_cast<size_t>(r)].ok()) {
        failures.push_back("rank " + std::to_string(r) + " (process): " + children[static_cast<size_t>(r)].describe());
      }
    }
    return failures;
  }

  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    int done = 0;
    std::vector<std::string> errors;
  };
  auto state = std::make_shared<State>();
  state->errors.resize(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([state, &body, r] {
      std::string error;
      try {
        body(r);
      } catch (...) {
        error = caught_current().describe();
      }
      std::lock_guard lock(state->mutex);
      state->errors[static_cast<size_t>(r)] = std::move(error);
      ++state->done;
      state->cv.notify_all();
    });
  }
  {
    std::unique_lock lock(state->mutex);
    if (!state->cv.wait_for(lock, timeout, [&] { return state->done == world; })) {
      std::ostringstream os;
      os << "ranks as threads overstayed their deadline in "
         << ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name() << "."
         << ::testing::UnitTest::GetInstance()->current_test_info()->name() << " (" << state->done << " of " << world
         << " done)";
      lock.unlock();
      emergency_exit(os.str());
    }
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    if (!state->errors[static_cast<size_t>(r)].empty()) {
      failures.push_back("rank " + std::to_string(r) + " (thread): " + state->errors[static_cast<size_t>(r)]);
    }
  }
  return failures;
}

// ---------------------------------------------------------------------------------------------
// Fixture: watchdog, names, leftovers

namespace {

class Watchdog {
 public:
  explicit Watchdog(std::string test) : test_(std::move(test)) {
    deadline_ = Clock::now() + 120s;
    thread_ = std::thread([this] { run(); });
    // Returns once the thread waits on its condition variable. Tests fork right after SetUp, and
    // under ASan a thread that is still starting (its allocations) can hold an allocator lock at
    // fork(): the child inherits it locked, and its first new thread (a TCPStore's server) then
    // blocks on it forever (seen: DistErrors.MissingPeerTimesOut/gloo_env, 1 run in 3 to 5).
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [this] { return started_; });
  }
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void set_deadline(Clock::time_point deadline) {
    std::lock_guard lock(mutex_);
    deadline_ = deadline;
    cv_.notify_all();
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    started_ = true;
    cv_.notify_all();
    for (;;) {
      if (stop_) return;
      if (Clock::now() >= deadline_) {
        lock.unlock();
        emergency_exit("test " + test_ + " overstayed its deadline");
      }
      cv_.wait_until(lock, deadline_);
    }
  }

  std::string test_;
  std::mutex mutex_;
  std::condition_variable cv_;
  Clock::time_point deadline_;
  bool stop_ = false;
  bool started_ = false;
  std::thread thread_;
};

std::unique_ptr<Watchdog>& watchdog() {
  static std::unique_ptr<Watchdog> w;
  return w;
}

}  // namespace

void ShmTest::SetUp() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  watchdog() = std::make_unique<Watchdog>(std::string(info->test_suite_name()) + "." + info->name());
}

void ShmTest::TearDown() {
  watchdog().reset();
  std::vector<std::string> names;
  {
    std::lock_guard lock(registry().mutex);
    names.swap(registry().names);
  }
  for (const std::string& name : names) {
    const std::vector<std::string> left = remove_shm_entries_of(name);
    if (!left.empty() && !HasFailure()) {
      std::string list;
      for (const std::string& l : left) list += " /dev/shm/" + l;
      ADD_FAILURE() << "left behind in /dev/shm (now removed):" << list;
    }
  }
}

std::string ShmTest::unique_name() {
  static std::atomic<int> counter{0};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const size_t h = std::hash<std::string>{}(std::string(info->test_suite_name()) + "." + info->name());
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%08x", static_cast<unsigned>(h & 0xffffffffu));
  const std::string name =
      "t" + std::to_string(::getpid()) + "x" + std::to_string(counter.fetch_add(1) + 1) + "x" + hash;
  // Nothing of an earlier run with a recycled pid may be in the way.
  remove_shm_entries_of(name);
  std::lock_guard lock(registry().mutex);
  registry().names.push_back(name);
  return name;
}

void ShmTest::set_deadline(Clock::duration timeout) {
  if (watchdog()) watchdog()->set_deadline(Clock::now() + timeout);
}

// ---------------------------------------------------------------------------------------------
// Scenarios

void exchange(ProcessGroupShm& pg) {
  const int peer = 1 - pg.getRank();
  for (int64_t bytes : {int64_t{24}, 3 * static_cast<int64_t>(pg.options().slot_bytes) + 5}) {
    const at::Tensor mine = pattern(at::kByte, bytes, static_cast<uint64_t>(pg.getRank() * 7919 + bytes));
    const at::Tensor expected = pattern(at::kByte, bytes, static_cast<uint64_t>(peer * 7919 + bytes));
    const at::Tensor got = at::zeros({bytes}, at::kByte);
    auto s = post_send(pg, mine, peer, 42);
    auto r = post_recv(pg, got, peer, 42);
    s->wait();
    r->wait();
    SHM_CHECK(same_bytes(got, expected), "rank " << pg.getRank() << " received wrong bytes (" << bytes << ")");
  }
}

}  // namespace tdshm::test
