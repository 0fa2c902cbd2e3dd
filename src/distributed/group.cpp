// Process groups: the process-global default group, new_group and standalone gloo groups (see
// include/tdshm/distributed.h; the Group handle itself is group_handle.cpp).
//
// The default group is one `World` per process, held behind a mutex. The mutex is never held
// while a group is being built (a rendezvous can last the whole timeout): init_process_group
// marks the world as "initializing", builds the group unlocked, then publishes it; new_group
// takes what it needs under the lock, builds unlocked, then records the subgroup (if the world
// was destroyed meanwhile, the caller still gets its group, it is just not recorded).
//
// Store layout: exactly torch 1.13's (its distributed_c10d and rendezvous modules),
// so that tdshm ranks and Python ranks (torch.distributed.init_process_group / new_group) form
// one world over tcp://, file:// and env://:
//  - tcp:// and env://: TCPStore(host, port, world_size, is_server = rank 0, timeout,
//    wait_for_workers = true, multi_tenant = true): each rank adds 1 to "init/" and the server
//    waits for world_size of them; file://: FileStore(path, world_size). Then
//    store.set_timeout(timeout).
//  - default_store = PrefixStore("default_pg", store).
//  - Every group has a name: torch's _group_count in decimal, "0" for the default group, then
//    "1", "2", ... in the order of new_group calls, which every rank makes, members or not. The
//    backend gets PrefixStore(<name>, default_store) ("default_pg/<name>/...").
//  - After the backend is made, the store-based barrier in default_store: key
//    "store_based_barrier_key:<count>" (count: _group_count after the group took its name, so 1
//    for the default group, 2 for the first new_group, ...), add(1), then add(0) polled every
//    10 ms until it equals the default group's size; every rank takes part, non-members of a
//    new_group too (a tdshm non-member adds its 1 and returns without waiting: the members'
//    count is the same, and its call still returns at once).
//  - gloo members then call setSequenceNumberForGroup (torch's _set_sequence_number_for_group:
//    group rank 0 writes the sequence number that the others wait for).
//  - tdshm's own key, which Python ranks never write: a rank with InitOptions::checked_wire sets
//    "tdshm_checked_wire/<group rank>" = "1" in the group's store before the barrier; after the
//    barrier each member reads (store.check, no waiting) which group ranks set it, and uses the
//    checked protocol with those it reaches over the network (shared memory carries its checks).
//  - shm over a store (make_group_from_store, also what the Python backend uses): the ranks find
//    which of them share a host (process_group/locality.h); on one host group rank 0 writes a
//    fresh random segment name in the group's store, the others read it; across hosts each
//    host's ranks do so under their own prefix and the world forms a gloo group beside them.
// "shm://NAME" keeps its own scheme without any store: subgroup k (0 for the first valid
// new_group call, then 1, ...) meets on the segment "<NAME>.g<k>".

#include <tdshm/distributed.h>

#include "common/format.h"
#include "process_group/gloo_group.h"
#include "process_group/transport.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <exception>
#include <thread>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>

namespace tdshm {

namespace {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;
using detail::GlooDevice;
using detail::make_gloo;
using detail::make_gloo_device;
using detail::tcp_store_host;

constexpr std::string_view kAcceptedForms =
    "\"tcp://HOST:PORT\", \"file://PATH\" or \"env://\" for both backends, or \"shm://NAME\" for shm";

/// Everything init_process_group made: the default group and what new_group needs to make more.
struct World {
  std::string backend;  // "shm" or "gloo"
  Group group;
  std::chrono::milliseconds timeout{};
  bool checked_wire = false;  // InitOptions::checked_wire, inherited by new_group
  // shm: the options of every group; with "shm://NAME" also the default group's segment name
  // (subgroups use "<NAME>.g<k>").
  std::string shm_name;
  ShmOptions shm_options;
  // tcp://, file://, env:// (both backends): torch's default_store, PrefixStore("default_pg",
  // store), and torch's _group_count (the number of group names handed out: the next group is
  // named after it). gloo: the transport device, shared by every subgroup.
  StorePtr default_store;
  int group_count = 0;
  GlooDevice device;
  // "shm://NAME": subgroups made so far (their number k names the segment).
  int next_group = 0;
  // Subgroups made by new_group, released with the world.
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

/// Where a store rendezvous goes (tcp://, env://, file://): a TCPStore at host:port, or a FileStore at path.
struct GlooRendezvous {
  std::string host;  // empty for file://
  uint16_t port = 0;
  std::string path;  // empty for tcp:// and env://
};

GlooRendezvous parse_store_method(const std::string& backend, const std::string& init_method) {
  const auto starts = [&](std::string_view prefix) { return init_method.rfind(prefix, 0) == 0; };
  GlooRendezvous r;
  if (starts("file://")) {
    r.path = init_method.substr(7);
    if (r.path.empty()) malformed(backend, init_method, "the path is empty");
    return r;
  }
  if (init_method == "env://") {
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    if (addr == nullptr || *addr == '\0' || port == nullptr) {
      throw Error("init_process_group(\"" + backend +
                  "\", \"env://\"): MASTER_ADDR and MASTER_PORT must be set (the address and port of the "
                  "TCPStore that rank 0 serves); accepted forms: " + std::string(kAcceptedForms));
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
        malformed(backend, init_method, "expected [IPV6]:PORT");
      }
      r.host = rest.substr(1, close - 1);
      colon = close + 1;
    } else {
      colon = rest.rfind(':');
      if (colon == std::string::npos) malformed(backend, init_method, "no port");
      r.host = rest.substr(0, colon);
      if (r.host.find(':') != std::string::npos) malformed(backend, init_method, "write an IPv6 host as [ADDRESS]");
    }
    if (r.host.empty()) malformed(backend, init_method, "the host is empty");
    r.port = parse_port(std::string_view(rest).substr(colon + 1), init_method);
    return r;
  }
  malformed(backend, init_method, "unknown scheme");
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
    message = detail::first_line(std::move(message));
    throw TimeoutError(what + ": the peers did not all arrive within " + std::to_string(timeout.count()) +
                       " ms (" + message + ")");
  }
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

// ---------------------------------------------------------------------------------------------
// torch's store layout (see the top of this file)

constexpr const char* kDefaultPrefix = "default_pg";
constexpr const char* kBarrierPrefix = "store_based_barrier_key";
constexpr const char* kCheckedWirePrefix = "tdshm_checked_wire/";

/// The store that torch's rendezvous handler makes for `r`, with its timeout set.
StorePtr make_rendezvous_store(const GlooRendezvous& r, int rank, int size, std::chrono::milliseconds timeout) {
  StorePtr store;
  if (!r.path.empty()) {
    store = c10::make_intrusive<c10d::FileStore>(r.path, size);
  } else {
    c10d::TCPStoreOptions store_options;
    store_options.port = r.port;
    store_options.isServer = rank == 0;
    store_options.numWorkers = static_cast<size_t>(size);
    // As torch: every rank checks in under "init/" and the server waits for all of them (a
    // Python rank 0 waits for our check-in too).
    store_options.waitWorkers = true;
    store_options.timeout = timeout;
    store_options.multiTenant = true;
    store = c10::make_intrusive<c10d::TCPStore>(r.host, store_options);
  }
  store->setTimeout(timeout);
  return store;
}

/// torch's _store_based_barrier: add 1 to "store_based_barrier_key:<count>" in `default_store`,
/// then (when `wait`) poll it with add(0) every 10 ms until `world_size` ranks added theirs.
void store_based_barrier(c10d::Store& default_store, int count, int world_size, std::chrono::milliseconds timeout,
                         bool wait, const std::string& what) {
  // Appended, not `string + ":" + string`: g++ 12 warns (-Warray-bounds, a false positive) on
  // that expression once LibTorch's headers come from the precompiled header.
  std::string key = kBarrierPrefix;
  key.append(":").append(std::to_string(count));
  default_store.add(key, 1);
  if (!wait) return;
  const auto start = std::chrono::steady_clock::now();
  int64_t arrived = default_store.add(key, 0);
  while (arrived < world_size) {
    if (std::chrono::steady_clock::now() - start > timeout) {
      throw TimeoutError(what + ": the peers did not all arrive within " + std::to_string(timeout.count()) +
                         " ms (store-based barrier \"" + key + "\": " + std::to_string(arrived) + " of " +
                         std::to_string(world_size) + " ranks)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    arrived = default_store.add(key, 0);
  }
}

std::string checked_wire_key(int group_rank) { return kCheckedWirePrefix + std::to_string(group_rank); }

/// Which group ranks advertised tdshm's checked wire in `group_store` (no waiting: run after the
/// store-based barrier, which every member passes only after writing its key).
std::vector<bool> read_checked_wire(c10d::Store& group_store, int size) {
  std::vector<bool> advertised(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) advertised[static_cast<size_t>(r)] = group_store.check({checked_wire_key(r)});
  return advertised;
}

/// One group of a store-based world (the default group, or a new_group on a member), as torch's
/// _new_process_group_helper and the store-based barrier after it: `name` is the group's name
/// (torch's _group_count before it was taken), `count` the barrier's number (after).
Group form_store_group(const World& world, const std::string& name, int count, std::vector<int> global_ranks,
                       int group_rank, const std::string& what) {
  const int size = static_cast<int>(global_ranks.size());
  const StorePtr group_store = c10::make_intrusive<c10d::PrefixStore>(name, world.default_store);
  return translate_timeout(what, world.timeout, [&] {
    ProcessGroupPtr backend;
    const bool gloo = world.backend == "gloo";
    if (world.checked_wire) group_store->set(checked_wire_key(group_rank), std::vector<uint8_t>{'1'});
    if (gloo) {
      backend = make_gloo(group_store, group_rank, size, world.timeout, world.device);
    } else {
      backend = make_group_from_store(group_store, group_rank, size, world.shm_options);
    }
    store_based_barrier(*world.default_store, count, world.group.defined() ? world.group.size() : size,
                        world.timeout, true, what);
    Group group(std::move(backend), std::move(global_ranks));
    // Used with the peers that advertised it, where the transport does not carry checks itself
    // (Group::checked_wire_with). A transport that carries them to every peer needs none: an
    // all-false list answers that in one load, on every transfer.
    std::vector<bool> checked = read_checked_wire(*group_store, size);
    bool needed = false;
    for (int r = 0; r < size; ++r) needed |= !group.transport().can(r).check_messages;
    if (!needed) checked.assign(checked.size(), false);
    group.set_checked_wire(std::move(checked));
    // torch's _set_sequence_number_for_group: a Python rank > 0 waits for rank 0's number.
    if (gloo) group.backend().setSequenceNumberForGroup();
    return group;
  });
}

std::shared_ptr<World> make_world(const std::string& backend, const InitOptions& options) {
  if (backend != "gloo" && backend != "shm") {
    throw Error("init_process_group: unknown backend \"" + backend + "\"; use \"shm\" (one host) or \"gloo\"");
  }
  auto world = std::make_shared<World>();
  world->backend = backend;
  world->timeout = options.timeout;
  world->shm_options = options.shm;
  world->shm_options.timeout = options.timeout;
  world->checked_wire = options.checked_wire;
  const bool shm_name = backend == "shm" && options.init_method.rfind("shm://", 0) == 0;
  if (backend == "shm" && (shm_name || options.init_method.find("://") == std::string::npos)) {
    world->shm_name = parse_shm_method(options.init_method);
  }
  const GlooRendezvous r = world->shm_name.empty() ? parse_store_method(backend, options.init_method) : GlooRendezvous{};
  const int size = rank_or_env(options.world_size, "world_size", "WORLD_SIZE");
  const int rank = rank_or_env(options.rank, "rank", "RANK");
  check_rank(rank, size, "init_process_group");
  if (!world->shm_name.empty()) {
    world->group = Group(c10::make_intrusive<ProcessGroupShm>(world->shm_name, rank, size, world->shm_options),
                         iota_ranks(size));
    return world;
  }
  const std::string what = "init_process_group(\"" + backend + "\", \"" + options.init_method + "\")";
  translate_timeout(what, options.timeout, [&] {
    world->default_store =
        c10::make_intrusive<c10d::PrefixStore>(kDefaultPrefix, make_rendezvous_store(r, rank, size, options.timeout));
    if (backend == "gloo") {
      world->device = make_gloo_device(r.path.empty() ? std::optional<std::string>(r.host) : std::nullopt);
    }
  });
  const std::string name = std::to_string(world->group_count++);
  world->group = form_store_group(*world, name, world->group_count, iota_ranks(size), rank, what);
  return world;
}

}  // namespace

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
  int k = 0;          // "shm://NAME": the subgroup's number
  std::string name;   // store-based worlds: torch's group name and barrier number
  int count = 0;
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
    if (world->default_store) {
      name = std::to_string(world->group_count++);
      count = world->group_count;
    } else {
      k = world->next_group++;
    }
  }

  const int me = world->group.rank();
  const auto it = std::find(ranks.begin(), ranks.end(), me);
  const bool member = it != ranks.end();

  Group group;
  if (!world->default_store) {
    // "shm://NAME": no store; a non-member has nothing to join, nothing to wait for.
    if (!member) return Group::not_a_member();
    const int group_rank = static_cast<int>(it - ranks.begin());
    group = Group(c10::make_intrusive<ProcessGroupShm>(world->shm_name + ".g" + std::to_string(k), group_rank,
                                                       static_cast<int>(ranks.size()), world->shm_options),
                  ranks);
  } else {
    const std::string what = "new_group (" + world->backend + " group \"" + name + "\")";
    if (!member) {
      // torch's non-members take part in the store-based barrier; ours only check in.
      translate_timeout(what, world->timeout, [&] {
        store_based_barrier(*world->default_store, count, world->group.size(), world->timeout, false, what);
      });
      return Group::not_a_member();
    }
    group = form_store_group(*world, name, count, ranks, static_cast<int>(it - ranks.begin()), what);
  }
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
  return translate_timeout(what, timeout, [&] {
    // tdshm's checked wire, advertised as init_process_group does: the key goes in before gloo's
    // rendezvous, which every rank passes only after every other rank wrote its address (so after
    // its key too).
    store->set(checked_wire_key(rank), std::vector<uint8_t>{'1'});
    Group group(make_gloo(store, rank, size, timeout, make_gloo_device(tcp_store_host(store))));
    group.set_checked_wire(read_checked_wire(*store, size));
    return group;
  });
}

}  // namespace tdshm
