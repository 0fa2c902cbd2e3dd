// Process groups: Group, the process-global default group, new_group and standalone gloo groups
// (see include/tdshm/distributed.h).
//
// The default group is one `World` per process, held behind a mutex. The mutex is never held
// while a group is being built (a rendezvous can last the whole timeout): init_process_group
// marks the world as "initializing", builds the group unlocked, then publishes it; new_group
// takes what it needs under the lock, builds unlocked, then records the subgroup (if the world
// was destroyed meanwhile, the caller still gets its group, it is just not recorded).
//
// Subgroups are numbered by the order of new_group calls (k = 0, 1, ...), which every rank of
// the default group makes in the same order (as torch requires), members or not; so k names the
// same group on every rank without any communication: the gloo rendezvous keys live under
// "tdshm_group_<k>/" in the default group's store, the shm segment is "<name>.g<k>".

#include <tdshm/distributed.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>

namespace tdshm {

namespace {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;
using GlooDevice = std::shared_ptr<::gloo::transport::Device>;

constexpr std::string_view kAcceptedForms =
    "\"shm://NAME\" for the shm backend; \"tcp://HOST:PORT\", \"file://PATH\" or \"env://\" for gloo";

/// Everything init_process_group made: the default group and what new_group needs to make more.
struct World {
  std::string backend;  // "shm" or "gloo"
  Group group;
  std::chrono::milliseconds timeout{};
  // shm: the default group's segment name and options (subgroups use the same geometry).
  std::string shm_name;
  ShmOptions shm_options;
  // gloo: the rendezvous store and the transport device, shared by every subgroup.
  StorePtr store;
  GlooDevice device;
  // Subgroups made by new_group, released with the world.
  int next_group = 0;
  std::vector<Group> subgroups;
};

struct State {
  std::mutex mutex;
  std::shared_ptr<World> world;  // null: not initialized
  bool initializing = false;     // an init_process_group is building a world
};

State& state() {
  static State* s = new State();  // never destroyed: groups may be used until exit
  return *s;
}

std::shared_ptr<World> current_world(const char* what) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.world) {
    throw Error(std::string(what) + ": the default process group is not initialized; call "
                "tdshm::init_process_group first");
  }
  return s.world;
}

// ---------------------------------------------------------------------------------------------
// Parsing

std::optional<int> parse_int(std::string_view text) {
  int value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

/// `value` if it is not -1, else the integer in environment variable `env`.
int rank_or_env(int value, const char* option, const char* env) {
  if (value != -1) return value;
  const char* text = std::getenv(env);
  if (text == nullptr) {
    throw Error(std::string("init_process_group: InitOptions::") + option + " is -1 and " + env +
                " is not set; pass " + option + " or set " + env);
  }
  const std::optional<int> parsed = parse_int(text);
  if (!parsed) {
    throw Error(std::string("init_process_group: ") + env + "=\"" + text + "\" is not an integer");
  }
  return *parsed;
}

uint16_t parse_port(std::string_view text, const std::string& where) {
  const std::optional<int> port = parse_int(text);
  if (!port || *port < 1 || *port > 65535) {
    throw Error("init_process_group: " + where + ": the port \"" + std::string(text) +
                "\" is not a number from 1 to 65535");
  }
  return static_cast<uint16_t>(*port);
}

[[noreturn]] void malformed(const std::string& backend, const std::string& init_method, const std::string& why) {
  throw Error("init_process_group(\"" + backend + "\"): malformed init_method \"" + init_method + "\" (" + why +
              "); accepted forms: " + std::string(kAcceptedForms));
}

/// Where a gloo rendezvous goes: a TCPStore at host:port, or a FileStore at path.
struct GlooRendezvous {
  std::string host;  // empty for file://
  uint16_t port = 0;
  std::string path;  // empty for tcp:// and env://
};

GlooRendezvous parse_gloo_method(const std::string& init_method) {
  const auto starts = [&](std::string_view prefix) { return init_method.rfind(prefix, 0) == 0; };
  GlooRendezvous r;
  if (starts("file://")) {
    r.path = init_method.substr(7);
    if (r.path.empty()) malformed("gloo", init_method, "the path is empty");
    return r;
  }
  if (init_method == "env://") {
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    if (addr == nullptr || *addr == '\0' || port == nullptr) {
      throw Error("init_process_group(\"gloo\", \"env://\"): MASTER_ADDR and MASTER_PORT must be set (the "
                  "address and port of the TCPStore that rank 0 serves)");
    }
    r.host = addr;
    r.port = parse_port(port, "MASTER_PORT");
    return r;
  }
  if (starts("tcp://")) {
    const std::string rest = init_method.substr(6);
    // HOST:PORT, or [IPV6]:PORT.
    size_t colon = std::string::npos;
    if (!rest.empty() && rest.front() == '[') {
      const size_t close = rest.find(']');
      if (close == std::string::npos || close + 1 >= rest.size() || rest[close + 1] != ':') {
        malformed("gloo", init_method, "expected [IPV6]:PORT");
      }
      r.host = rest.substr(1, close - 1);
      colon = close + 1;
    } else {
      colon = rest.rfind(':');
      if (colon == std::string::npos) malformed("gloo", init_method, "no port");
      r.host = rest.substr(0, colon);
      if (r.host.find(':') != std::string::npos) malformed("gloo", init_method, "write an IPv6 host as [ADDRESS]");
    }
    if (r.host.empty()) malformed("gloo", init_method, "the host is empty");
    r.port = parse_port(std::string_view(rest).substr(colon + 1), init_method);
    return r;
  }
  malformed("gloo", init_method, "unknown scheme");
}

std::string parse_shm_method(const std::string& init_method) {
  if (init_method.rfind("shm://", 0) != 0) malformed("shm", init_method, "the shm backend needs shm://NAME");
  std::string name = init_method.substr(6);
  if (name.empty()) malformed("shm", init_method, "the segment name is empty");
  validate_segment_name(name);  // SegmentError, naming the allowed characters
  return name;
}

// ---------------------------------------------------------------------------------------------
// gloo

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

/// The transport device of a gloo group whose rendezvous is at `host` (nullopt: not known).
///
/// A rendezvous on a loopback address means every peer is on this host, so the loopback device
/// always reaches them; gloo's default device would instead bind to whatever this machine's
/// hostname resolves to, which may be an address that is firewalled, slow to resolve, or not
/// configured at all. Otherwise we do what torch does: the interface named by GLOO_SOCKET_IFNAME
/// when set (multi-homed hosts), else gloo's default device (the hostname's address, or loopback
/// when it does not resolve).
GlooDevice make_gloo_device(const std::optional<std::string>& host) {
  if (host && is_loopback_host(*host)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

/// The host of the TCPStore under `store` (through PrefixStores), if it is one.
std::optional<std::string> tcp_store_host(StorePtr store) {
  while (store) {
    if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
      store = prefix->getUnderlyingStore();
    } else if (auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get())) {
      return tcp->getHost();
    } else {
      break;
    }
  }
  return std::nullopt;
}

bool mentions_timeout(const std::string& what) {
  std::string lower = what;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower.find("timed out") != std::string::npos || lower.find("timeout") != std::string::npos;
}

/// Runs a rendezvous step of c10d or gloo: a failure that says it timed out becomes TimeoutError
/// (the contract of init_process_group), naming `what`; any other error goes through unchanged.
template <typename Fn>
auto translate_timeout(const std::string& what, std::chrono::milliseconds timeout, Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (!mentions_timeout(message)) throw;
    if (const size_t nl = message.find('\n'); nl != std::string::npos) message.resize(nl);  // c10 backtrace
    throw TimeoutError(what + ": the peers did not all arrive within " + std::to_string(timeout.count()) +
                       " ms (" + message + ")");
  }
}

ProcessGroupPtr make_gloo(const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout,
                          const GlooDevice& device) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

void check_rank(int rank, int size, const char* what) {
  if (size < 1) throw Error(std::string(what) + ": world_size must be at least 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size) {
    throw Error(std::string(what) + ": rank " + std::to_string(rank) + " is outside [0, " + std::to_string(size) +
                ")");
  }
}

std::vector<int> iota_ranks(int size) {
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
  return ranks;
}

std::shared_ptr<World> make_world(const std::string& backend, const InitOptions& options) {
  auto world = std::make_shared<World>();
  world->backend = backend;
  world->timeout = options.timeout;
  if (backend == "shm") {
    world->shm_name = parse_shm_method(options.init_method);
    const int size = rank_or_env(options.world_size, "world_size", "WORLD_SIZE");
    const int rank = rank_or_env(options.rank, "rank", "RANK");
    check_rank(rank, size, "init_process_group");
    world->shm_options = options.shm;
    world->shm_options.timeout = options.timeout;
    world->group = Group(c10::make_intrusive<ProcessGroupShm>(world->shm_name, rank, size, world->shm_options),
                         iota_ranks(size));
    return world;
  }
  if (backend != "gloo") {
    throw Error("init_process_group: unknown backend \"" + backend + "\"; use \"shm\" (one host) or \"gloo\"");
  }
  const GlooRendezvous r = parse_gloo_method(options.init_method);
  const int size = rank_or_env(options.world_size, "world_size", "WORLD_SIZE");
  const int rank = rank_or_env(options.rank, "rank", "RANK");
  check_rank(rank, size, "init_process_group");
  const std::string what = "init_process_group(\"gloo\", \"" + options.init_method + "\")";
  translate_timeout(what, options.timeout, [&] {
    if (!r.path.empty()) {
      world->store = c10::make_intrusive<c10d::FileStore>(r.path, size);
      world->store->setTimeout(options.timeout);
    } else {
      c10d::TCPStoreOptions store_options;
      store_options.port = r.port;
      store_options.isServer = rank == 0;
      store_options.numWorkers = static_cast<size_t>(size);
      // Not waiting for the workers here: the gloo rendezvous right after waits for every rank
      // anyway, within `timeout`; TCPStore's own wait would cost up to twice the timeout first.
      store_options.waitWorkers = false;
      store_options.timeout = options.timeout;
      world->store = c10::make_intrusive<c10d::TCPStore>(r.host, store_options);
    }
    world->device = make_gloo_device(r.path.empty() ? std::optional<std::string>(r.host) : std::nullopt);
    world->group = Group(make_gloo(world->store, rank, size, options.timeout, world->device), iota_ranks(size));
  });
  return world;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Group

Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> backend) : backend_(std::move(backend)) {
  if (!backend_) throw Error("Group: the backend is null (use Group{} for \"no group\")");
}

Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> backend, std::vector<int> global_ranks)
    : backend_(std::move(backend)), global_ranks_(std::move(global_ranks)) {
  if (!backend_) throw Error("Group: the backend is null (use Group{} for \"no group\")");
  if (global_ranks_.size() != static_cast<size_t>(backend_->getSize())) {
    throw Error("Group: " + std::to_string(global_ranks_.size()) + " global ranks for a backend of size " +
                std::to_string(backend_->getSize()));
  }
  std::vector<int> sorted = global_ranks_;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0) throw Error("Group: negative global rank " + std::to_string(sorted.front()));
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    throw Error("Group: global rank " + std::to_string(*dup) + " is listed twice");
  }
}

c10d::ProcessGroup& Group::backend() const {
  if (!backend_) {
    throw Error("Group::backend(): this Group is not defined (no group, or a rank outside the group new_group made)");
  }
  return *backend_;
}

std::string Group::backend_name() const { return backend().getBackendName(); }

int Group::rank() const { return backend().getRank(); }

int Group::size() const { return backend().getSize(); }

int Group::group_rank(int global) const {
  backend();  // throws if not defined
  if (!registered()) {
    throw Error("Group::group_rank(" + std::to_string(global) +
                "): this group is standalone (not made by init_process_group or new_group), so global ranks "
                "mean nothing to it; address its ranks with group_dst / group_src");
  }
  const auto it = std::find(global_ranks_.begin(), global_ranks_.end(), global);
  if (it == global_ranks_.end()) {
    throw Error("Group::group_rank: global rank " + std::to_string(global) + " is not a member of this group");
  }
  return static_cast<int>(it - global_ranks_.begin());
}

int Group::global_rank(int group_rank) const {
  const int n = size();  // throws if not defined
  if (group_rank < 0 || group_rank >= n) {
    throw Error("Group::global_rank: group rank " + std::to_string(group_rank) + " is outside [0, " +
                std::to_string(n) + ")");
  }
  return registered() ? global_ranks_[static_cast<size_t>(group_rank)] : group_rank;
}

// ---------------------------------------------------------------------------------------------
// The default group

Group init_process_group(const std::string& backend, const InitOptions& options) {
  State& s = state();
  {
    std::lock_guard lock(s.mutex);
    if (s.world) {
      throw Error("init_process_group: the default process group is already initialized (backend \"" +
                  s.world->backend + "\"); call tdshm::destroy_process_group first");
    }
    if (s.initializing) {
      throw Error("init_process_group: another thread is initializing the default process group");
    }
    s.initializing = true;
  }
  std::shared_ptr<World> world;
  try {
    world = make_world(backend, options);
  } catch (...) {
    std::lock_guard lock(s.mutex);
    s.initializing = false;
    throw;
  }
  std::lock_guard lock(s.mutex);
  s.initializing = false;
  s.world = world;
  return world->group;
}

bool is_initialized() noexcept {
  State& s = state();
  std::lock_guard lock(s.mutex);
  return static_cast<bool>(s.world);
}

Group default_group() { return current_world("default_group")->group; }

int get_rank() { return current_world("get_rank")->group.rank(); }

int get_world_size() { return current_world("get_world_size")->group.size(); }

Group new_group(const std::vector<int>& ranks) {
  State& s = state();
  std::shared_ptr<World> world;
  int k = 0;
  {
    std::lock_guard lock(s.mutex);
    if (!s.world) {
      throw Error("new_group: the default process group is not initialized; call tdshm::init_process_group first");
    }
    world = s.world;
    const int world_size = world->group.size();
    if (ranks.empty()) throw Error("new_group: the list of ranks is empty");
    std::vector<int> sorted = ranks;
    std::sort(sorted.begin(), sorted.end());
    for (int r : sorted) {
      if (r < 0 || r >= world_size) {
        throw Error("new_group: rank " + std::to_string(r) + " is outside the default group [0, " +
                    std::to_string(world_size) + ")");
      }
    }
    if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
      throw Error("new_group: rank " + std::to_string(*dup) + " is listed twice");
    }
    // Only a valid call takes a number, so that the numbering stays the same on every rank.
    k = world->next_group++;
  }

  const int me = world->group.rank();
  const auto it = std::find(ranks.begin(), ranks.end(), me);
  if (it == ranks.end()) return Group::not_a_member();  // nothing to join, nothing to wait for
  const int group_rank = static_cast<int>(it - ranks.begin());
  const int size = static_cast<int>(ranks.size());

  ProcessGroupPtr backend;
  if (world->backend == "shm") {
    backend = c10::make_intrusive<ProcessGroupShm>(world->shm_name + ".g" + std::to_string(k), group_rank, size,
                                                   world->shm_options);
  } else {
    const std::string prefix = "tdshm_group_" + std::to_string(k) + "/";
    backend = translate_timeout("new_group (gloo group " + std::to_string(k) + ")", world->timeout, [&] {
      return make_gloo(c10::make_intrusive<c10d::PrefixStore>(prefix, world->store), group_rank, size,
                       world->timeout, world->device);
    });
  }
  Group group(std::move(backend), ranks);
  std::lock_guard lock(s.mutex);
  if (s.world == world) world->subgroups.push_back(group);
  return group;
}

void destroy_process_group() {
  std::shared_ptr<World> world;
  {
    State& s = state();
    std::lock_guard lock(s.mutex);
    world = std::move(s.world);
  }
  // Released outside the lock: a backend's destructor may wait for its threads. Subgroups first.
  if (world) world->subgroups.clear();
}

Group gloo_group_from_store(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                            std::chrono::milliseconds timeout) {
  if (!store) throw Error("gloo_group_from_store: the store is null");
  check_rank(rank, size, "gloo_group_from_store");
  const std::string what = "gloo_group_from_store(rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
  return Group(translate_timeout(what, timeout, [&] {
    return make_gloo(store, rank, size, timeout, make_gloo_device(tcp_store_host(store)));
  }));
}

}  // namespace tdshm
