// The TensorDict workloads of `tdshm bench --td`: their trees, the ping-pong of
// TensorDict::send / recv over any two-rank c10d group (td-shm, td-gloo), and the file of the
// memmap workloads.

#include "pingpong_td.h"

#include <tdshm/distributed.h>
#include <tdshm/lazy_stack.h>
#include <tdshm/memmap.h>
#include <tdshm/tensordict.h>

#include <ATen/ops/zeros.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <system_error>

namespace tdshm::bench::detail {

namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

Workload td_workload(std::string name, Workload::Tree tree, int leaves, size_t leaf_bytes, bool consolidated) {
  Workload w;
  w.name = std::move(name);
  w.tree = tree;
  w.leaves = leaves;
  w.leaf_bytes = leaf_bytes;
  w.consolidated = consolidated;
  // The seed tree: 2 + 2*3 + 2*1*5 floats (four of them in the lazy stack).
  w.bytes = tree == Workload::Tree::seed        ? (2 + 6 + 10) * sizeof(float)
            : tree == Workload::Tree::lazy_seed ? 4 * (2 + 6 + 10) * sizeof(float)
                                                : static_cast<size_t>(leaves) * leaf_bytes;
  return w;
}

int64_t floats(size_t bytes) { return static_cast<int64_t>(bytes / sizeof(float)); }

// The workload's tensordict with zeroed leaves; for memmap, one leaf mapping w.file (whatever
// the file holds).
TensorDict make_tree(const Workload& w) {
  switch (w.tree) {
    case Workload::Tree::seed:
    case Workload::Tree::lazy_seed:  // (a member; make_object stacks four)
      return TensorDict({{{"a", "b"}, at::zeros({2})}, {"c", at::zeros({2, 3})}, {"_", at::zeros({2, 1, 5})}}, {2});
    case Workload::Tree::uniform: {
      TensorDict td;
      for (int i = 0; i < w.leaves; ++i) {
        char key[16];
        std::snprintf(key, sizeof key, "l%03d", i);  // zero-padded: sorted order is insertion order
        td.set(key, at::zeros({floats(w.leaf_bytes)}));
      }
      return td;
    }
    case Workload::Tree::memmap:
      return TensorDict({{"m", MemoryMappedTensor::from_filename(w.file, at::kFloat, {floats(w.leaf_bytes)})}});
    case Workload::Tree::message:
      break;
  }
  throw std::invalid_argument("the TensorDict transports measure TD workloads only (tdshm bench --td)");
}

// Leaf i of the transfer order holds the pattern of seed i + 1 (a memmap file: seed 1).
size_t leaf_seed(size_t index) { return index + 1; }

/// What a workload transfers: a TensorDict, or (lazy_seed) a lazy stack of four of them.
struct Object {
  TensorDict td;
  std::optional<LazyStackedTensorDict> stack;

  void send(const SendOptions& o) const {
    if (stack) {
      stack->send(o);
    } else {
      td.send(o);
    }
  }
  void recv(const RecvOptions& o) {
    if (stack) {
      stack->recv(o);
    } else {
      td.recv(o);
    }
  }
  /// The leaves in transfer order.
  std::vector<at::Tensor> leaves() const {
    std::vector<at::Tensor> out;
    for (const TensorDict& t : stack ? stack->tensordicts() : std::vector<TensorDict>{td}) {
      for (const Key& k : t.sorted_leaf_keys()) out.push_back(t.get(k));
    }
    return out;
  }
};

Object make_object(const Workload& w) {
  Object o;
  if (w.tree != Workload::Tree::lazy_seed) {
    o.td = make_tree(w);
    return o;
  }
  std::vector<TensorDict> members;
  for (int m = 0; m < 4; ++m) members.push_back(make_tree(w));
  o.stack.emplace(std::move(members));
  return o;
}

void fill_leaves(const Object& o) {
  const std::vector<at::Tensor> leaves = o.leaves();
  for (size_t i = 0; i < leaves.size(); ++i) {
    fill_pattern(static_cast<uint8_t*>(leaves[i].data_ptr()), leaves[i].nbytes(), leaf_seed(i));
  }
}

class TdPingPong final : public PingPong {
 public:
  TdPingPong(c10::intrusive_ptr<c10d::ProcessGroup> backend, int rank) : group_(std::move(backend)), rank_(rank) {}

  void prepare(const Workload& w) override {
    send_ = SendOptions{.group = group_, .group_dst = 1 - rank_, .consolidated = w.consolidated};
    recv_ = RecvOptions{.group = group_, .group_src = 1 - rank_, .consolidated = w.consolidated};
    td_ = make_object(w);
    back_ = Object();
    if (rank_ == 0) {
      // A memmap file holds the pattern already; every other echo lands in zeros.
      if (w.tree != Workload::Tree::memmap) fill_leaves(td_);
      back_ = make_object(w);
    }
    if (w.consolidated) {
      // Kept: consolidate() on a consolidated tensordict returns it as is, so no send copies.
      td_.td = td_.td.consolidate();
      if (rank_ == 0) back_.td = back_.td.consolidate();
    }
  }

  void ping() override {
    td_.send(send_);
    back_.recv(recv_);
  }

  void pong() override {
    td_.recv(recv_);
    td_.send(send_);
  }

  bool verify() const override {
    const std::vector<at::Tensor> leaves = back_.leaves();
    for (size_t i = 0; i < leaves.size(); ++i) {
      const at::Tensor& t = leaves[i];
      if (!t.is_contiguous() || !has_pattern(static_cast<const uint8_t*>(t.data_ptr()), t.nbytes(), leaf_seed(i))) {
        return false;
      }
    }
    return !leaves.empty();
  }

 private:
  Group group_;
  int rank_;
  SendOptions send_;
  RecvOptions recv_;
  Object td_;    // rank 0: what it sends; rank 1: what it receives and sends back
  Object back_;  // rank 0: where the echo lands
};

// ---- the memmap workloads' file and its removal on a signal ----

char g_file_path[4096];
std::atomic<bool> g_file_set{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the signal handler may only touch lock-free atomics");
constexpr int kCleanupSignals[] = {SIGINT, SIGTERM, SIGHUP};
struct sigaction g_previous[std::size(kCleanupSignals)];
bool g_installed[std::size(kCleanupSignals)];  // false: the signal was ignored, and stays so

extern "C" void unlink_file_on_signal(int sig) {
  // Acquire: pairs with the release store in WorkloadFile's constructor (the path is complete).
  if (g_file_set.load(std::memory_order_acquire)) ::unlink(g_file_path);
  // The previous action back (the run's segment removal, pingpong_processes.cpp, which then ends
  // us), and the signal again: blocked while this runs, it is delivered to that action once this
  // returns.
  for (size_t i = 0; i < std::size(kCleanupSignals); ++i) {
    if (kCleanupSignals[i] == sig) ::sigaction(sig, &g_previous[i], nullptr);
  }
  ::raise(sig);
}

std::string mib(uint64_t bytes) { return std::to_string((bytes + kMiB - 1) / kMiB) + " MiB"; }

uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return UINT64_MAX;  // unknown: do not skip on a guess
}

}  // namespace

const std::vector<Workload>& td_workloads() {
  using Tree = Workload::Tree;
  static const std::vector<Workload> workloads{
      td_workload("seed", Tree::seed, 3, 0, false),
      td_workload("seed-consolidated", Tree::seed, 3, 0, true),
      td_workload("lazy-4xseed", Tree::lazy_seed, 12, 0, false),
      td_workload("100x1KiB", Tree::uniform, 100, kKiB, false),
      td_workload("10x1MiB", Tree::uniform, 10, kMiB, false),
      td_workload("64MiB-consolidated", Tree::uniform, 1, 64 * kMiB, true),
      td_workload("memmap-4KiB", Tree::memmap, 1, 4 * kKiB, false),
      td_workload("memmap-1GiB", Tree::memmap, 1, kGiB, false),
  };
  return workloads;
}

std::unique_ptr<PingPong> make_td_pingpong(c10::intrusive_ptr<c10d::ProcessGroup> group, int rank) {
  return std::make_unique<TdPingPong>(std::move(group), rank);
}

std::string no_room_for(const std::string& dir, uint64_t file_bytes, uint64_t memory_bytes) {
  constexpr uint64_t kSpareFile = 64 * kMiB, kSpareMemory = 512 * kMiB;
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return "cannot statvfs " + dir + ": " + std::strerror(errno);
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (free_bytes < file_bytes + kSpareFile) {
    return dir + " has " + mib(free_bytes) + " free; the file needs " + mib(file_bytes) + " and " + mib(kSpareFile) +
           " to spare";
  }
  const uint64_t available = mem_available();
  if (available < memory_bytes + kSpareMemory) {
    return "MemAvailable is " + mib(available) + "; the file and the buffers of the floors at this size need about " +
           mib(memory_bytes) + " and " + mib(kSpareMemory) + " to spare";
  }
  return {};
}

WorkloadFile::WorkloadFile(const std::string& path, size_t bytes) {
  if (path.empty() || path.front() != '/' || path.size() >= sizeof g_file_path) {
    throw std::invalid_argument("workload file path must be absolute and short: '" + path + "'");
  }
  if (g_file_set.load(std::memory_order_relaxed)) throw std::logic_error("only one WorkloadFile at a time");
  // Claim the name: a file of the same name is someone else's.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "creating the workload file " + path);
  ::close(fd);
  path_ = path;
  std::memcpy(g_file_path, path.c_str(), path.size() + 1);
  // Release: the path above is complete for a handler that sees true.
  g_file_set.store(true, std::memory_order_release);
  struct sigaction action {};
  action.sa_handler = unlink_file_on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;
  for (size_t i = 0; i < std::size(kCleanupSignals); ++i) {
    ::sigaction(kCleanupSignals[i], nullptr, &g_previous[i]);
    g_installed[i] = g_previous[i].sa_handler != SIG_IGN;
    if (g_installed[i]) ::sigaction(kCleanupSignals[i], &action, nullptr);
  }
  try {
    // Sized with posix_fallocate by MemoryMappedTensor: a full /dev/shm is a MemmapError now.
    const MemoryMappedTensor file = MemoryMappedTensor::empty({static_cast<int64_t>(bytes)}, at::kByte, path);
    fill_pattern(static_cast<uint8_t*>(file->data_ptr()), bytes, leaf_seed(0));
  } catch (...) {
    remove();
    throw;
  }
}

WorkloadFile::~WorkloadFile() { remove(); }

WorkloadFile::WorkloadFile(WorkloadFile&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }

WorkloadFile& WorkloadFile::operator=(WorkloadFile&& other) noexcept {
  if (this != &other) {
    remove();
    path_ = std::move(other.path_);
    other.path_.clear();
  }
  return *this;
}

void WorkloadFile::remove() noexcept {
  if (path_.empty()) return;
  for (size_t i = 0; i < std::size(kCleanupSignals); ++i) {
    if (g_installed[i]) ::sigaction(kCleanupSignals[i], &g_previous[i], nullptr);
  }
  g_file_set.store(false, std::memory_order_relaxed);
  ::unlink(path_.c_str());
  path_.clear();
}

}  // namespace tdshm::bench::detail
