// Interop with tensordict's own wire: worlds of tdshm (C++) ranks and Python ranks that speak
// tensordict 0.14's protocol (tests/python/td_peer.py, a faithful re-implementation with plain
// torch.distributed calls: tensordict itself is not installable here).
//
// Each test forms one world: C++ ranks are forked children (Child) that call
// tdshm::init_process_group; Python ranks are python3 processes (fork + exec, also Child, so the
// fixture's watchdog kills them) that call torch.distributed.init_process_group with the same
// init_method. Both sides build the same trees with the same deterministic values (pattern():
// a function of key, dtype, shape and a salt, written twice, here and in td_peer.py) and check
// what they receive leaf by leaf; the Python side also checks the metadata dict it unpickles
// against the one tensordict's consolidate(metadata=True) makes (td_peer.check_metadata), with
// an unpickler that refuses every global. Every wait has a deadline (the groups' kTimeout, the
// world's deadline, the fixture's watchdog); a failed rank gets the others killed after a short
// grace; the Python ranks' output is in the failure message.
//
//   InteropLayout  consolidate() byte for byte as tensordict's (no processes but python3)
//   InteropGloo    gloo over file://, both directions: per-leaf (send/recv, isend/irecv,
//                  return_early/return_premature, init_tag, pseudo_rand, group_dst of a
//                  new_group), consolidated, init_remote/from_remote_init (nested keys,
//                  non-tensor values, a tensorclass), broadcast and init_remote(use_broadcast)
//                  in a 3-rank mixed world; and what a gloo receiver cannot check; the
//                  collectives reduce, all_reduce, all_gather and scatter in worlds of 2 and 3
//                  (until ProcessGroupShm has them, over gloo only)
//   InteropShm     the same exchanges with the Python ranks on tdshm's "shm" backend
//                  (import tdshm), and mismatches a C++ receiver must report by key
//
// What can and cannot be checked over gloo with a Python (tensordict) peer: tensordict sends one
// bare message per leaf (or the bare storage), nothing else, and a tdshm rank may not add
// messages a tensordict rank does not expect. So a tdshm receiver over gloo only learns, from
// gloo, the byte size of each message, and only when it arrives:
//  - same byte size, other dtype or shape (int32 [2, 3] into float32 [2, 3], or [3, 2] into
//    [2, 3]): undetectable, the bytes land as they are (GlooSameBytesIsNotDetected pins this);
//  - other byte size: gloo itself fails the receive. In LibTorch 1.13 its TCP pair throws from
//    its I/O thread, which ends the receiving process (std::terminate): tensordict has the same
//    behaviour and there is no way for tdshm to intercept it without messages of its own, so it
//    is not tested here (a test would only pin an abort);
//  - a consolidated storage of another layout but the same byte count: undetectable.
// tdshm's checked protocol (descriptor and fingerprint messages) is only used between two tdshm
// ranks; over shm the checks ride in the ring entries, so a Python sender's mismatch reaches a
// C++ receiver as a TransportError/SchemaError naming the key (InteropShm.Mismatch*).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/lazy_stack.h>
#include <tdshm/process_group.h>
#include <tdshm/tensorclass.h>
#include <tdshm/tensordict.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "dist/dist_support.h"
#include "dist/python_launcher.h"

namespace tdshm::test {

// The tensorclass of the interop tests, under the name tensordict gives the Python class
// td_peer_types.InteropRecord (f"{cls.__module__}.{cls.__qualname__}").
TDSHM_TENSORCLASS(InteropRecord, "td_peer_types.InteropRecord", obs, action, reward);

namespace {

using namespace std::chrono_literals;

/// Deadline of every group of the interop worlds (rendezvous and waits), C++ and Python.
constexpr std::chrono::milliseconds kTimeout{15000};
/// Deadline of one world, start to end.
constexpr auto kWorldDeadline = 50s;

// ---------------------------------------------------------------------------------------------
// Where python3 and the peer are (compile definitions from tests/CMakeLists.txt; the environment
// variable TDSHM_INTEROP_PYTHON overrides the interpreter)

#ifndef TDSHM_INTEROP_PYTHON
#define TDSHM_INTEROP_PYTHON ""
#endif
#ifndef TDSHM_INTEROP_PEER
#define TDSHM_INTEROP_PEER ""
#endif
#ifndef TDSHM_INTEROP_PYTHONPATH
#define TDSHM_INTEROP_PYTHONPATH ""
#endif

std::string python_exe() {
  if (const char* e = std::getenv("TDSHM_INTEROP_PYTHON"); e != nullptr && *e != '\0') return e;
  return TDSHM_INTEROP_PYTHON;
}

// ---------------------------------------------------------------------------------------------
// The trees (td_peer.py's TREES, entry for entry, in insertion order) and their values

struct Entry {
  std::vector<std::string> path;
  std::optional<at::ScalarType> dtype;  // a tensor leaf, else a non-tensor value
  std::vector<int64_t> shape;
  NonTensorData value;
};
struct TreeSpec {
  std::vector<int64_t> batch;
  std::vector<Entry> entries;
};

Entry T(std::vector<std::string> path, at::ScalarType dtype, std::vector<int64_t> shape) {
  return {std::move(path), dtype, std::move(shape), NonTensorData(false)};
}
Entry N(std::vector<std::string> path, NonTensorData value) { return {std::move(path), std::nullopt, {}, std::move(value)}; }

const TreeSpec& tree_spec(const std::string& name) {
  using at::kBFloat16, at::kBool, at::kByte, at::kChar, at::kDouble, at::kFloat, at::kHalf, at::kInt, at::kLong,
      at::kShort;
  static const std::map<std::string, TreeSpec> trees = {
      {"seed", {{2}, {T({"a", "b"}, kFloat, {2}), T({"c"}, kFloat, {2, 3}), T({"_"}, kFloat, {2, 1, 5})}}},
      {"u8only", {{}, {T({"x"}, kByte, {3}), T({"n", "y"}, kByte, {5}), T({"z"}, kByte, {1})}}},
      {"mixed",
       {{2},
        {
            T({"obs"}, kFloat, {2, 3}),
            N({"name"}, std::string("h\xc3\xa9llo w\xc3\xb6rld")),
            T({"a", "b"}, kFloat, {2}),
            T({"_"}, kHalf, {2, 1, 5}),
            N({"count"}, int64_t{(int64_t{1} << 40) + 7}),
            T({"Z"}, kLong, {2}),
            T({"a", "x", "y"}, kShort, {2, 3}),
            N({"a", "label"}, std::string("nested")),
            T({"mask"}, kBool, {2, 3}),
            N({"ratio"}, 0.1),
            T({"u8"}, kByte, {2, 5}),
            T({"d"}, kDouble, {2}),
            N({"flag"}, true),
            T({"i8"}, kChar, {2, 7}),
            T({"bf"}, kBFloat16, {2, 3}),
            T({"a", "i32"}, kInt, {2}),
            N({"neg"}, int64_t{-5}),
        }}},
      {"reducible",
       {{2},
        {T({"obs"}, kFloat, {2, 3}), T({"n", "x"}, kLong, {2, 5}), T({"_"}, kDouble, {2, 1}),
         N({"label"}, std::string("r")), T({"n", "deep", "y"}, kInt, {2, 7}), T({"Z"}, kByte, {2, 3})}}},
      {"record", {{3}, {T({"obs"}, kFloat, {3, 4}), T({"action"}, kLong, {3}), T({"reward"}, kFloat, {3, 1})}}},
      {"probe", {{2}, {T({"alpha"}, kFloat, {2}), T({"nest", "victim_key"}, kFloat, {2, 3}), T({"omega"}, kFloat, {2})}}},
  };
  const auto it = trees.find(name);
  if (it == trees.end()) throw std::invalid_argument("no tree " + name);
  return it->second;
}

std::string dotted(const std::vector<std::string>& path) {
  std::string s;
  for (const std::string& p : path) s += (s.empty() ? "" : ".") + p;
  return s;
}

uint32_t fnv1a32(const std::string& text) {
  uint32_t h = 2166136261u;
  for (const unsigned char c : text) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

/// td_peer.pattern: v_i = (7 i + off) % 100, off = (fnv1a32("a.b") + 13 salt) % 100; bool: v odd;
/// floating: (v - 50) / 8 (exact in every float type); integers: v.
at::Tensor pattern(const std::vector<std::string>& path, at::ScalarType dtype, const std::vector<int64_t>& shape,
                   int64_t salt) {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  const int64_t off = (static_cast<int64_t>(fnv1a32(dotted(path))) + 13 * salt) % 100;
  const at::Tensor v = (at::arange(n, at::kLong) * 7 + off).remainder(100);
  at::Tensor out;
  if (dtype == at::kBool) {
    out = v.remainder(2).eq(1);
  } else if (at::isFloatingType(dtype)) {
    out = ((v - 50).to(at::kDouble) / 8).to(dtype);
  } else {
    out = v.to(dtype);
  }
  return out.reshape(shape);
}

/// Tree `name` with pattern values at `salt`, or (blank) every element 111 (true for bool),
/// which no pattern holds.
TensorDict build_tree(const std::string& name, int64_t salt, bool blank = false) {
  const TreeSpec& spec = tree_spec(name);
  TensorDict td(spec.batch);
  for (const Entry& e : spec.entries) {
    if (e.dtype) {
      td.set(Key(e.path), blank ? at::full(e.shape, 111, at::TensorOptions().dtype(*e.dtype))
                                : pattern(e.path, *e.dtype, e.shape, salt));
    } else {
      td.set(Key(e.path), Value(e.value));
    }
  }
  return td;
}

/// The tensor leaves of tree `name` at `salt`, without its non-tensor values: what update_
/// writes into a consolidated copy (update_ takes tensors only).
TensorDict tensors_of(const std::string& name, int64_t salt) {
  const TreeSpec& spec = tree_spec(name);
  TensorDict td(spec.batch);
  for (const Entry& e : spec.entries) {
    if (e.dtype) td.set(Key(e.path), pattern(e.path, *e.dtype, e.shape, salt));
  }
  return td;
}

std::string describe(const NonTensorData& v) {
  return std::visit(
      [](const auto& x) {
        std::ostringstream os;
        os << x;
        return os.str();
      },
      v);
}

/// Every leaf and non-tensor value of tree `name` at `salt` is in `got`, and no other tensor leaf.
void check_tree(const TensorDict& got, const std::string& name, int64_t salt, const std::string& what) {
  const TreeSpec& spec = tree_spec(name);
  std::ostringstream errors;
  if (got.batch_size() != spec.batch) errors << "; batch size differs";
  size_t tensors = 0;
  for (const Entry& e : spec.entries) {
    const Key key(e.path);
    if (!got.contains(key)) {
      errors << "; " << dotted(e.path) << " missing";
      continue;
    }
    const Value v = got.get_value(key);
    if (e.dtype) {
      ++tensors;
      if (!v.is_tensor()) {
        errors << "; " << dotted(e.path) << " is a " << v.kind_name();
        continue;
      }
      const at::Tensor t = v.tensor();
      const at::Tensor want = pattern(e.path, *e.dtype, e.shape, salt);
      if (t.scalar_type() != *e.dtype || t.sizes() != want.sizes()) {
        errors << "; " << dotted(e.path) << " is " << t.scalar_type() << " " << t.sizes() << ", expected " << *e.dtype
               << " " << want.sizes();
      } else if (!at::equal(t, want)) {
        errors << "; " << dotted(e.path) << " holds other values (first: " << t.flatten()[0].item<double>()
               << ", expected " << want.flatten()[0].item<double>() << ")";
      }
    } else if (!v.is_non_tensor()) {
      errors << "; " << dotted(e.path) << " is a " << v.kind_name() << ", not a non-tensor value";
    } else if (!(v.non_tensor() == e.value)) {
      errors << "; " << dotted(e.path) << " = " << describe(v.non_tensor()) << " (index " << v.non_tensor().index()
             << "), expected " << describe(e.value) << " (index " << e.value.index() << ")";
    }
  }
  const size_t leaves = got.sorted_leaf_keys().size();
  if (leaves != tensors) errors << "; " << leaves << " tensor leaves, expected " << tensors;
  SHM_CHECK(errors.str().empty(), what << ": " << errors.str().substr(2));
}

// ---------------------------------------------------------------------------------------------
// Worlds of C++ and Python ranks

enum class Api { kSync, kAsync, kEarly };
const char* api_arg(Api a) { return a == Api::kSync ? "sync" : a == Api::kAsync ? "async" : "early"; }

/// One world: `size` ranks, each either C++ (a body run after init_process_group and, when
/// group_ranks is set, new_group(group_ranks); given that group, not defined() on a
/// non-member) or Python (td_peer.py scenario arguments).
struct World {
  std::string backend = "gloo";
  int size = 2;
  std::vector<int> group_ranks{};
  std::map<int, std::function<void(const Group&)>> cpp{};
  std::map<int, std::vector<std::string>> py{};
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& s, size_t n = 6000) { return s.size() <= n ? s : "..." + s.substr(s.size() - n); }

/// A Python rank running td_peer.py with `args`, stdout and stderr into `log`, forked from the
/// warm interpreter (dist/python_launcher.h) with the tests' environment for Python ranks.
class PyProcess {
 public:
  PyProcess(const std::vector<std::string>& args, const std::string& log) : log_(log), args_(args) {
    std::string pythonpath = std::string(TDSHM_INTEROP_PYTHONPATH);
    if (const char* outer = std::getenv("PYTHONPATH"); outer != nullptr && *outer != '\0') {
      pythonpath += std::string(":") + outer;
    }
    const std::vector<std::string> env = environment_with({"PYTHONPATH=" + pythonpath, "OMP_NUM_THREADS=1",
                                                           "PYTHONDONTWRITEBYTECODE=1", "GLOO_SOCKET_IFNAME=lo"});
    child_ = std::make_unique<Child>(start_python(python_exe(), {TDSHM_INTEROP_PEER, args, env, log}));
  }

  Child& child() { return *child_; }
  std::string command() const {
    std::string s = python_exe() + " " + TDSHM_INTEROP_PEER;
    for (const std::string& a : args_) s += " " + a;
    return s;
  }
  std::string output() const { return read_file(log_); }

 private:
  std::string log_;
  std::vector<std::string> args_;
  std::unique_ptr<Child> child_;
};

/// Removes the entries of /dev/shm whose names start with `prefix` and that were changed (made)
/// at or after `since`, and returns their names.
std::vector<std::string> remove_shm_entries_since(const std::string& prefix, std::filesystem::file_time_type since) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tdshm." + prefix, 0) != 0) continue;
    const auto changed = std::filesystem::last_write_time(e.path(), ec);
    if (ec || changed < since) continue;
    if (std::filesystem::remove(e.path(), ec)) removed.push_back(name);
  }
  return removed;
}

class InteropTest : public DistTest {
 protected:
  void SetUp() override {
    DistTest::SetUp();
    set_deadline(kWorldDeadline + 20s);
    if (python_exe().empty()) {
      GTEST_SKIP() << "no python3 with torch and numpy was found at configure time (set TDSHM_INTEROP_PYTHON)";
    }
  }

  /// Runs the world; every rank must succeed. A rank that fails gets the others killed after
  /// a grace of 3 s (they would otherwise wait for it until their own deadline).
  void run(const World& w) {
    const auto started = std::filesystem::file_time_type::clock::now();  // before any rank exists
    // One file:// store for both backends: torch.distributed (Python) only rendezvouses through
    // a store, and tdshm's shm backend, registered with torch by the tdshm package, takes its
    // segment's name from it; C++ ranks join the same store.
    const std::string init = "file://" + dir_.path() + "/store" + std::to_string(++files_);
    std::map<int, std::unique_ptr<PyProcess>> py;
    for (const auto& [rank, scenario] : w.py) {
      std::vector<std::string> args = {"--rank", std::to_string(rank), "--world", std::to_string(w.size),
                                       "--init-method", init, "--backend", w.backend, "--timeout",
                                       std::to_string(kTimeout.count() / 1000)};
      if (!w.group_ranks.empty()) {
        std::string g;
        for (const int r : w.group_ranks) g += (g.empty() ? "" : ",") + std::to_string(r);
        args.insert(args.end(), {"--group-ranks", g});
      }
      args.insert(args.end(), scenario.begin(), scenario.end());
      py[rank] = std::make_unique<PyProcess>(args, dir_.path() + "/py" + std::to_string(rank) + ".log");
    }
    std::map<int, std::unique_ptr<Child>> cpp;
    for (const auto& [rank, body] : w.cpp) {
      cpp[rank] = std::make_unique<Child>([&w, &init, rank = rank, &body = body] {
        InitOptions o;
        o.rank = rank;
        o.world_size = w.size;
        o.init_method = init;
        o.timeout = kTimeout;
        ::setenv("GLOO_SOCKET_IFNAME", "lo", 1);
        init_process_group(w.backend, o);
        Group g;
        if (!w.group_ranks.empty()) g = new_group(w.group_ranks);
        body(g);
        default_group().backend().barrier()->wait(kTimeout);
        destroy_process_group();
      });
    }
    std::vector<Child*> all;
    for (auto& [r, p] : py) all.push_back(&p->child());
    for (auto& [r, c] : cpp) all.push_back(c.get());
    const auto deadline = Clock::now() + kWorldDeadline;
    std::optional<Clock::time_point> grace_end;
    for (;;) {
      bool done = true, failed = false;
      for (Child* c : all) {
        if (!c->poll()) {
          done = false;
        } else if (!c->ok()) {
          failed = true;
        }
      }
      if (done) break;
      if (failed && !grace_end) grace_end = Clock::now() + 3s;
      if (Clock::now() >= deadline || (grace_end && Clock::now() >= *grace_end)) {
        for (Child* c : all) c->kill();
        for (Child* c : all) c->wait(5s);
        break;
      }
      std::this_thread::sleep_for(5ms);
    }
    for (auto& [rank, c] : cpp) {
      if (!c->ok()) ADD_FAILURE() << "C++ rank " << rank << ": " << c->describe();
    }
    // A shm group made over a store lives on the segment "pg-<pid of its creator>-<random>":
    // nothing of one may be left in /dev/shm once every rank has left (removed either way). Only
    // entries made since this world started count: a pid is reused, and a segment of another
    // test's process that once had a rank's pid is that test's (it may still be in use).
    for (Child* c : all) {
      const std::vector<std::string> left = remove_shm_entries_since("pg-" + std::to_string(c->pid()) + "-", started);
      if (!left.empty() && !HasFailure()) {
        std::string list;
        for (const std::string& l : left) list += " /dev/shm/" + l;
        ADD_FAILURE() << "left behind in /dev/shm (now removed):" << list;
      }
    }
    for (auto& [rank, p] : py) {
      const std::string out = p->output();
      if (!p->child().ok()) {
        ADD_FAILURE() << "Python rank " << rank << ": " << p->child().describe() << "\n$ " << p->command() << "\n"
                      << tail(out);
      } else if (out.find("\"metadata_notes\": [\"") != std::string::npos) {
        std::cout << "[ note     ] Python rank " << rank << ": " << tail(out, 2000) << std::endl;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The C++ halves of td_peer.py's scenarios

/// Peer options: dst/src, or group_dst/group_src in `g` when it is defined.
SendOptions to(int peer, const Group& g) {
  SendOptions o;
  if (g.defined()) {
    o.group = g;
    o.group_dst = peer;
  } else {
    o.dst = peer;
  }
  return o;
}
RecvOptions from(int peer, const Group& g) {
  RecvOptions o;
  if (g.defined()) {
    o.group = g;
    o.group_src = peer;
  } else {
    o.src = peer;
  }
  return o;
}

/// The tags of `n` leaves from init_tag: the last one.
int64_t expected_last_tag(size_t n, int64_t init_tag, bool pseudo) {
  int64_t tag = init_tag - 1;
  for (size_t i = 0; i < n; ++i) tag = pseudo ? pseudo_rand_tag(tag + 1) : tag + 1;
  return tag;
}

struct PerLeaf {
  std::string tree = "mixed";
  int64_t salt = 0;
  Api api = Api::kSync;
  int64_t init_tag = 0;
  bool pseudo = false;
  bool loan = false;  // the C++ sender's tree is a loan (tdshm::loan): by reference over shm
  /// Not empty: a LazyStackedTensorDict of these trees (member m at salt + m) instead of `tree`.
  std::vector<std::string> lazy{};
  /// With `lazy`: the stack nested under "ls" of a TensorDict({"a0": float [3], "ls", "zz": int64
  /// [2]}, []) (tensordict's TestSendLazyStackNest shape); td_peer.py --lazy-nest builds the same.
  bool nest = false;
};

/// The two leaves beside a nested stack (PerLeaf::nest), as td_peer.py makes them.
TensorDict nest_lazy(const LazyStackedTensorDict& stack, int64_t salt, bool blank) {
  const at::Tensor a0 = blank ? at::full({3}, -1.0) : at::arange(3, at::kFloat) + static_cast<double>(salt);
  const at::Tensor zz = blank ? at::full({2}, -1, at::kLong) : at::arange(2, at::kLong) * (salt + 1);
  return TensorDict({{"a0", a0}, {"ls", Value(stack)}, {"zz", zz}}, {});
}

/// "a,b,c": td_peer.py's --lazy-members.
std::string comma_joined(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : ",") + p;
  return out;
}

LazyStackedTensorDict lazy_stack_of(const std::vector<std::string>& trees, int64_t salt, bool blank) {
  std::vector<TensorDict> members;
  for (size_t m = 0; m < trees.size(); ++m) members.push_back(build_tree(trees[m], salt + static_cast<int64_t>(m), blank));
  return LazyStackedTensorDict(std::move(members));
}

size_t leaf_count(const TensorDict& td) { return td.sorted_leaf_keys().size(); }
size_t leaf_count(const LazyStackedTensorDict& s) {
  size_t n = 0;
  for (const TensorDict& td : s.tensordicts()) n += leaf_count(td);
  return n;
}

/// The members of a lazy stack of `trees` at salt + m.
void check_lazy(const LazyStackedTensorDict& s, const std::vector<std::string>& trees, int64_t salt, const std::string& what) {
  SHM_CHECK(s.size() == trees.size(), what << ": " << s.size() << " members, expected " << trees.size());
  for (size_t m = 0; m < s.size(); ++m) {
    check_tree(s.tensordicts()[m], trees[m], salt + static_cast<int64_t>(m), what + ", member " + std::to_string(m));
  }
}

/// nest_lazy of a lazy stack of `trees`: the leaves beside the stack, then its members.
void check_nested_lazy(const TensorDict& td, const std::vector<std::string>& trees, int64_t salt, const std::string& what) {
  const TensorDict want = nest_lazy(lazy_stack_of(trees, salt, false), salt, false);
  SHM_CHECK(at::equal(td.get("a0"), want.get("a0")) && at::equal(td.get("zz"), want.get("zz")),
            what << ": the leaves beside the nested lazy stack: " << td.get("a0") << ", " << td.get("zz"));
  check_lazy(td.get_lazy_stack("ls"), trees, salt, what);
}

/// `td` itself, or a loan like it holding its values (the transport sends it by reference over
/// shm; a Python peer still receives its bytes).
TensorDict maybe_loaned(const TensorDict& td, const Group& g, bool loaned, bool consolidated = false) {
  if (!loaned) return td;
  TensorDict lent = loan(td, {.group = g, .consolidated = consolidated});
  const auto* shm = dynamic_cast<const ProcessGroupShm*>(&(g.defined() ? g : default_group()).backend());
  for (const auto& key : td.sorted_leaf_keys()) {
    lent.get(key).copy_(td.get(key));  // (its non-tensor values came with loan())
    SHM_CHECK(!shm || shm->is_loan(lent.get(key)), "leaf " << key.str() << " is not a loan of the shm group");
  }
  return lent;
}

/// The sends of cpp_send, on a TensorDict or a lazy stack.
template <class Tree>
void send_as(const Tree& td, const PerLeaf& p, SendOptions o) {
  o.init_tag = p.init_tag;
  o.pseudo_rand = p.pseudo;
  const size_t n = leaf_count(td);
  if (p.api == Api::kSync) {
    td.send(o);
  } else if (p.api == Api::kAsync) {
    const Transfer t = td.isend(o);
    SHM_CHECK(t.last_tag && *t.last_tag == expected_last_tag(n, p.init_tag, p.pseudo),
              "isend returned the last tag " << (t.last_tag ? *t.last_tag : -999));
  } else {
    o.return_early = true;
    const Transfer t = td.isend(o);
    SHM_CHECK(t.has_works && t.works.size() == n, "isend(return_early) returned " << t.works.size() << " works");
    for (const WorkPtr& w : t.works) w->wait(kTimeout);
  }
}

std::function<void(const Group&)> cpp_send(int dst, PerLeaf p) {
  return [dst, p](const Group& g) {
    if (!p.lazy.empty() && p.nest) return send_as(nest_lazy(lazy_stack_of(p.lazy, p.salt, false), p.salt, false), p, to(dst, g));
    if (!p.lazy.empty()) return send_as(lazy_stack_of(p.lazy, p.salt, false), p, to(dst, g));
    send_as(maybe_loaned(build_tree(p.tree, p.salt), g, p.loan), p, to(dst, g));
  };
}

/// The receives of cpp_recv, into a TensorDict or a lazy stack.
template <class Tree>
void recv_as(Tree& td, const PerLeaf& p, RecvOptions o) {
  o.init_tag = p.init_tag;
  o.pseudo_rand = p.pseudo;
  const size_t n = leaf_count(td);
  if (p.api == Api::kSync) {
    const int64_t last = td.recv(o);
    SHM_CHECK(last == expected_last_tag(n, p.init_tag, p.pseudo), "recv returned the last tag " << last);
  } else if (p.api == Api::kAsync) {
    const Transfer t = td.irecv(o);
    SHM_CHECK(!t.has_works && !t.last_tag, "irecv returned something");
  } else {
    o.return_premature = true;
    const Transfer t = td.irecv(o);
    SHM_CHECK(t.has_works && t.works.size() == n, "irecv(return_premature) returned " << t.works.size() << " works");
    for (const WorkPtr& w : t.works) w->wait(kTimeout);
  }
}

std::function<void(const Group&)> cpp_recv(int src, PerLeaf p) {
  return [src, p](const Group& g) {
    if (!p.lazy.empty()) {
      LazyStackedTensorDict s = lazy_stack_of(p.lazy, 0, /*blank=*/true);
      if (p.nest) {
        TensorDict td = nest_lazy(s, 0, /*blank=*/true);
        recv_as(td, p, from(src, g));
        check_nested_lazy(td, p.lazy, p.salt, "nested lazy stack from the Python rank");
      } else {
        recv_as(s, p, from(src, g));
        check_lazy(s, p.lazy, p.salt, "lazy stack from the Python rank");
      }
      return;
    }
    TensorDict td = build_tree(p.tree, 0, /*blank=*/true);
    recv_as(td, p, from(src, g));
    check_tree(td, p.tree, p.salt, "per-leaf from the Python rank");
  };
}

std::vector<std::string> py_perleaf(const std::string& role, int peer, PerLeaf p) {
  std::vector<std::string> a = {"--scenario", "perleaf", "--role", role, "--peer", std::to_string(peer), "--tree",
                                p.tree, "--salt", std::to_string(p.salt), "--api", api_arg(p.api), "--init-tag",
                                std::to_string(p.init_tag)};
  if (p.pseudo) a.push_back("--pseudo-rand");
  if (!p.lazy.empty()) {
    a.insert(a.end(), {"--lazy-members", comma_joined(p.lazy)});
    if (p.nest) a.push_back("--lazy-nest");
  }
  return a;
}

/// Two consolidated rounds (salt, then salt + 1 written in place with update_).
std::function<void(const Group&)> cpp_consolidated_send(int dst, const std::string& tree, int64_t salt,
                                                        bool loaned = false) {
  return [=](const Group& g) {
    TensorDict td_c = maybe_loaned(build_tree(tree, salt).consolidate(), g, loaned, /*consolidated=*/true);
    SendOptions o = to(dst, g);
    o.consolidated = true;
    td_c.send(o);
    td_c.update_(tensors_of(tree, salt + 1));
    const Transfer t = td_c.isend(o);
    SHM_CHECK(!t.has_works && !t.last_tag, "isend(consolidated) returned something");
  };
}

std::function<void(const Group&)> cpp_consolidated_recv(int src, const std::string& tree, int64_t salt) {
  return [=](const Group& g) {
    TensorDict td_c = build_tree(tree, 0, true).consolidate();
    RecvOptions o = from(src, g);
    o.consolidated = true;
    for (int64_t r = 0; r < 2; ++r) {
      td_c.recv(o);
      check_tree(td_c, tree, salt + r, "consolidated round " + std::to_string(r));
    }
  };
}

/// A consolidated lazy stack of kLazyMembers-like `trees` (member m at salt + m), two rounds into
/// one storage (the second's values at salt + 1 + m, written in place); td_peer.py's consolidated
/// scenario with --lazy-members on the other side.
std::function<void(const Group&)> cpp_consolidated_lazy_send(int dst, std::vector<std::string> trees, int64_t salt) {
  return [=](const Group& g) {
    const LazyStackedTensorDict c = lazy_stack_of(trees, salt, false).consolidate();
    SendOptions o = to(dst, g);
    o.consolidated = true;
    c.send(o);
    for (size_t m = 0; m < c.size(); ++m) {
      TensorDict(c.tensordicts()[m]).update_(tensors_of(trees[m], salt + 1 + static_cast<int64_t>(m)));
    }
    c.send(o);
  };
}

std::function<void(const Group&)> cpp_consolidated_lazy_recv(int src, std::vector<std::string> trees, int64_t salt) {
  return [=](const Group& g) {
    LazyStackedTensorDict c = lazy_stack_of(trees, 0, /*blank=*/true).consolidate();
    RecvOptions o = from(src, g);
    o.consolidated = true;
    for (int64_t r = 0; r < 2; ++r) {
      c.recv(o);
      check_lazy(c, trees, salt + r, "consolidated lazy stack, round " + std::to_string(r));
    }
  };
}

std::vector<std::string> py_consolidated_lazy(const std::string& role, int peer, const std::vector<std::string>& trees,
                                              int64_t salt) {
  return {"--scenario", "consolidated", "--role", role, "--peer", std::to_string(peer), "--tree", trees[0],
          "--salt", std::to_string(salt), "--rounds", "2", "--lazy-members", comma_joined(trees)};
}

/// init_remote / from_remote_init of a lazy stack of `trees` (member m at salt + m).
std::function<void(const Group&)> cpp_remote_lazy_send(int dst, std::vector<std::string> trees, int64_t salt) {
  return [=](const Group&) { lazy_stack_of(trees, salt, false).init_remote({.dst = dst}); };
}

std::function<void(const Group&)> cpp_remote_lazy_recv(int src, std::vector<std::string> trees, int64_t salt) {
  return [=](const Group&) {
    const LazyStackedTensorDict got = LazyStackedTensorDict::from_remote_init({.src = src});
    SHM_CHECK(got.stack_dim() == 0, "stack_dim " << got.stack_dim());
    check_lazy(got, trees, salt, "from_remote_init of a lazy stack");
  };
}

/// A TensorDict holding a lazy stack of `trees` (nest_lazy, member m at salt + m), consolidated
/// as tensordict lays it out: one consolidated send, or init_remote.
std::function<void(const Group&)> cpp_nested_lazy_send(int dst, std::vector<std::string> trees, int64_t salt, bool remote) {
  return [=](const Group& g) {
    const TensorDict td = nest_lazy(lazy_stack_of(trees, salt, false), salt, false);
    if (remote) return td.init_remote({.dst = dst});
    SendOptions o = to(dst, g);
    o.consolidated = true;
    td.consolidate().send(o);
  };
}

std::function<void(const Group&)> cpp_nested_lazy_recv(int src, std::vector<std::string> trees, int64_t salt, bool remote) {
  return [=](const Group& g) {
    if (remote) return check_nested_lazy(TensorDict::from_remote_init({.src = src}), trees, salt, "from_remote_init");
    TensorDict c = nest_lazy(lazy_stack_of(trees, 0, true), 0, true).consolidate();
    RecvOptions o = from(src, g);
    o.consolidated = true;
    c.recv(o);
    check_nested_lazy(c, trees, salt, "consolidated recv");
  };
}

std::vector<std::string> py_nested_lazy(const std::string& role, int peer, const std::vector<std::string>& trees,
                                        int64_t salt, bool remote) {
  return {"--scenario", remote ? "remote" : "consolidated", "--role", role, "--peer", std::to_string(peer), "--tree",
          trees[0], "--salt", std::to_string(salt), "--rounds", "1", "--lazy-members", comma_joined(trees), "--lazy-nest"};
}

std::vector<std::string> py_consolidated(const std::string& role, int peer, const std::string& tree, int64_t salt) {
  return {"--scenario", "consolidated", "--role", role, "--peer", std::to_string(peer), "--tree", tree,
          "--salt", std::to_string(salt), "--rounds", "2"};
}

/// init_remote, then a consolidated send of the sender's consolidated copy refreshed in place.
std::function<void(const Group&)> cpp_remote_send(int dst, const std::string& tree, int64_t salt) {
  return [=](const Group&) {
    const TensorDict td = build_tree(tree, salt);
    TensorDict td_c;
    if (tree == "record") {
      const InteropRecord rec(td);
      rec.init_remote({.dst = dst});
      td_c = rec.consolidate().tensordict();  // keeps the type name (a C++ receiver checks it)
    } else {
      td.init_remote({.dst = dst});
      td_c = td.consolidate();
    }
    td_c.update_(tensors_of(tree, salt + 1));
    td_c.send({.dst = dst, .consolidated = true});
  };
}

std::function<void(const Group&)> cpp_remote_recv(int src, const std::string& tree, int64_t salt) {
  return [=](const Group&) {
    TensorDict got;
    if (tree == "record") {
      const InteropRecord rec = InteropRecord::from_remote_init({.src = src});
      SHM_CHECK(rec.type_name() == "td_peer_types.InteropRecord", "rebuilt as " << rec.type_name());
      got = rec.tensordict();
    } else {
      got = TensorDict::from_remote_init({.src = src});
      SHM_CHECK(got.class_name().empty(), "rebuilt with class name " << got.class_name());
    }
    SHM_CHECK(got.is_consolidated(), "from_remote_init did not return a consolidated tensordict");
    check_tree(got, tree, salt, "from_remote_init");
    got.recv({.src = src, .consolidated = true});
    check_tree(got, tree, salt + 1, "consolidated after from_remote_init");
  };
}

std::vector<std::string> py_remote(const std::string& role, int peer, const std::string& tree, int64_t salt) {
  return {"--scenario", "remote", "--role", role, "--peer", std::to_string(peer), "--tree", tree,
          "--salt", std::to_string(salt), "--rounds", "2"};
}

/// The root of a broadcast: TensorDict::broadcast, or init_remote(use_broadcast).
std::function<void(const Group&)> cpp_broadcast_root(int src, const std::string& tree, int64_t salt, bool via_init_remote) {
  return [=](const Group&) {
    const TensorDict td = build_tree(tree, salt);
    if (via_init_remote) {
      if (tree == "record") {
        InteropRecord(td).init_remote({.use_broadcast = true});
      } else {
        td.init_remote({.use_broadcast = true});
      }
    } else {
      const TensorDict out = tree == "record" ? InteropRecord(td).broadcast({.src = src}).tensordict()
                                              : td.broadcast({.src = src});
      check_tree(out, tree, salt, "broadcast at the root");
    }
  };
}

std::function<void(const Group&)> cpp_broadcast_member(int src, const std::string& tree, int64_t salt,
                                                       bool via_init_remote) {
  return [=](const Group&) {
    TensorDict got;
    if (tree == "record") {
      const InteropRecord rec = via_init_remote ? InteropRecord::from_remote_init({.src = src, .use_broadcast = true})
                                                : InteropRecord(build_tree(tree, 0, true)).broadcast({.src = src});
      got = rec.tensordict();
    } else {
      got = via_init_remote ? TensorDict::from_remote_init({.src = src, .use_broadcast = true})
                            : TensorDict().broadcast({.src = src});
    }
    check_tree(got, tree, salt, "broadcast member");
  };
}

std::vector<std::string> py_broadcast(const std::string& role, int src, const std::string& tree, int64_t salt,
                                      bool via_init_remote) {
  return {"--scenario", "broadcast", "--role", role, "--src", std::to_string(src), "--tree", tree,
          "--salt", std::to_string(salt), "--via", via_init_remote ? "init_remote" : "broadcast"};
}

// ---- collectives: rank r holds its tree at salt + r; reductions run on tree "reducible" ----

c10d::ReduceOp::RedOpType reduce_op(const std::string& op) {
  static const std::map<std::string, c10d::ReduceOp::RedOpType> ops = {
      {"sum", c10d::ReduceOp::SUM}, {"min", c10d::ReduceOp::MIN}, {"max", c10d::ReduceOp::MAX},
      {"product", c10d::ReduceOp::PRODUCT}};
  return ops.at(op);
}

/// Every tensor leaf of tree `name` in `got` holds the tree at each of `salts` reduced with `op`
/// in the leaf's dtype (td_peer.check_reduced).
void check_reduced(const TensorDict& got, const std::string& name, int64_t salt, int world, const std::string& op,
                   const std::string& what) {
  for (const Entry& e : tree_spec(name).entries) {
    if (!e.dtype) continue;
    at::Tensor want = pattern(e.path, *e.dtype, e.shape, salt);
    for (int r = 1; r < world; ++r) {
      const at::Tensor v = pattern(e.path, *e.dtype, e.shape, salt + r);
      want = op == "sum" ? want + v : op == "min" ? at::minimum(want, v) : op == "max" ? at::maximum(want, v) : want * v;
    }
    const at::Tensor t = got.get(Key(e.path));
    SHM_CHECK(t.scalar_type() == *e.dtype && at::equal(t, want),
              what << ": " << dotted(e.path) << " = " << t.flatten().slice(0, 0, 6) << ", expected " << want.flatten().slice(0, 0, 6));
  }
}

constexpr size_t kReducibleLeaves = 5;

/// all_reduce (Api::kSync, or kAsync: async_op) or reduce to `dst` (kSync, kAsync: async_op,
/// kEarly: async_op and return_premature) of "reducible" in a world of `world`.
std::function<void(const Group&)> cpp_reduction(bool all, const std::string& op, Api api, int64_t salt, int world,
                                                int dst = 0) {
  return [=](const Group&) {
    const int rank = get_rank();
    TensorDict td = build_tree("reducible", salt + rank);
    const Transfer t = all ? td.all_reduce({.op = reduce_op(op), .async_op = api != Api::kSync})
                           : td.reduce({.dst = dst, .op = reduce_op(op), .async_op = api != Api::kSync,
                                        .return_premature = api == Api::kEarly});
    const bool works = all ? api != Api::kSync : api == Api::kEarly;
    SHM_CHECK(t.has_works == works && t.works.size() == (works ? kReducibleLeaves : 0), t.works.size() << " works");
    t.wait();
    if (all || rank == dst) check_reduced(td, "reducible", salt, world, op, all ? "all_reduce" : "reduce");
  };
}

std::vector<std::string> py_reduction(bool all, const std::string& op, Api api, int64_t salt, int dst = 0) {
  return {"--scenario", all ? "all_reduce" : "reduce", "--op", op, "--api", api_arg(api), "--tree", "reducible",
          "--salt", std::to_string(salt), "--dst", std::to_string(dst)};
}

std::string joined(const std::vector<std::string>& trees) {
  std::string s;
  for (const std::string& t : trees) s += (s.empty() ? "" : ",") + t;
  return s;
}

/// Tree `name` at `salt`, as a tensorclass's tensordict for "record" (whose name must not travel).
TensorDict collective_tree(const std::string& name, int64_t salt) {
  const TensorDict td = build_tree(name, salt);
  return name == "record" ? InteropRecord(td).tensordict() : td;
}

/// all_gather of trees[rank] at salt + rank (through the tensorclass for "record").
std::function<void(const Group&)> cpp_all_gather(std::vector<std::string> trees, int64_t salt) {
  return [=](const Group&) {
    const int rank = get_rank();
    const TensorDict mine = build_tree(trees[rank], salt + rank);
    const std::vector<TensorDict> got =
        trees[rank] == "record" ? InteropRecord(mine).all_gather({}) : mine.all_gather({});
    SHM_CHECK(got.size() == trees.size(), got.size() << " tensordicts");
    for (size_t r = 0; r < trees.size(); ++r) {
      SHM_CHECK(got[r].class_name().empty(), "class_name '" << got[r].class_name() << "'");
      check_tree(got[r], trees[r], salt + static_cast<int64_t>(r), "all_gather from rank " + std::to_string(r));
    }
  };
}

/// scatter from `src` of trees[r] at salt + r to rank r.
std::function<void(const Group&)> cpp_scatter(int src, std::vector<std::string> trees, int64_t salt) {
  return [=](const Group&) {
    const int rank = get_rank();
    std::optional<std::vector<TensorDict>> list;
    if (rank == src) {
      list.emplace();
      for (size_t r = 0; r < trees.size(); ++r) list->push_back(collective_tree(trees[r], salt + static_cast<int64_t>(r)));
    }
    const TensorDict got = TensorDict().scatter({.src = src, .tensordicts = list});
    SHM_CHECK(got.class_name().empty(), "class_name '" << got.class_name() << "'");
    check_tree(got, trees[rank], salt + rank, "scatter");
  };
}

std::vector<std::string> py_gather_scatter(const std::string& scenario, const std::vector<std::string>& trees,
                                           int64_t salt, int src = 0) {
  return {"--scenario", scenario, "--trees", joined(trees), "--salt", std::to_string(salt), "--src", std::to_string(src)};
}

const std::vector<std::string> kPyIdle = {"--scenario", "idle", "--role", "idle"};
void cpp_idle(const Group&) {}

// ---------------------------------------------------------------------------------------------
// InteropLayout: TensorDict::consolidate() is tensordict's consolidate(), byte for byte

struct PyLeaf {
  std::string key, dtype, shape;
  uint64_t start = 0, stop = 0, pad = 0;
};

std::string torch_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return std::string("?") + c10::toString(t);
  }
}

void flatten(const SchemaNode& node, const std::string& prefix, std::vector<PyLeaf>& out) {
  for (const SchemaEntry& e : node.entries) {
    const std::string key = prefix.empty() ? e.key : prefix + "." + e.key;
    if (const auto* t = std::get_if<SchemaTensor>(&e.value)) {
      std::string shape;
      for (const int64_t d : t->shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
      // tensordict's stop is the end of the leaf's bytes *and* its pad; tdshm's is the end of the bytes.
      out.push_back({key, torch_dtype(t->dtype), shape.empty() ? "-" : shape, t->start, t->stop + t->pad, t->pad});
    } else if (const auto* child = std::get_if<std::shared_ptr<SchemaNode>>(&e.value)) {
      flatten(**child, key, out);
    }
  }
}

std::string hex(const at::Tensor& storage) {
  const at::Tensor s = storage.contiguous().cpu();
  static const char* digits = "0123456789abcdef";
  std::string out;
  const auto* p = s.data_ptr<uint8_t>();
  for (int64_t i = 0; i < s.numel(); ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

class InteropLayout : public InteropTest, public ::testing::WithParamInterface<std::string> {};

const std::vector<std::string> kLayoutTrees = {"seed", "u8only", "mixed", "record", "probe"};

/// td_peer.py --dump-consolidated of every tree of kLayoutTrees, run once (python3 takes ~2 s to
/// start): the lines of each tree, or an error.
const std::map<std::string, std::string>& python_layouts() {
  static const std::map<std::string, std::string> layouts = [] {
    std::map<std::string, std::string> out;
    static TempDir dir;
    std::string trees;
    for (const std::string& t : kLayoutTrees) trees += (trees.empty() ? "" : ",") + t;
    PyProcess p({"--dump-consolidated", trees}, dir.path() + "/dump.txt");
    if (!p.child().wait(30s) || !p.child().ok()) {
      out["error"] = p.child().describe() + "\n" + tail(p.output());
      return out;
    }
    std::istringstream in(p.output());
    std::string line, current;
    while (std::getline(in, line)) {
      if (line.rfind("tree ", 0) == 0) {
        current = line.substr(5);
      } else if (!current.empty()) {
        out[current] += line + "\n";
      }
    }
    return out;
  }();
  return layouts;
}

TEST_P(InteropLayout, ConsolidateIsTensordictsByteForByte) {
  const std::string tree = GetParam();
  const auto& layouts = python_layouts();
  ASSERT_EQ(layouts.count("error"), 0u) << "td_peer.py --dump-consolidated failed: " << layouts.at("error");
  ASSERT_EQ(layouts.count(tree), 1u) << "td_peer.py printed no layout for " << tree;
  std::istringstream in(layouts.at(tree));
  std::string line;
  uint64_t total = 0;
  std::string storage_hex;
  std::vector<PyLeaf> want;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string kind;
    ls >> kind;
    if (kind == "total") {
      ls >> total;
    } else if (kind == "storage") {
      ls >> storage_hex;
    } else if (kind == "leaf") {
      PyLeaf l;
      ls >> l.key >> l.dtype >> l.shape >> l.start >> l.stop >> l.pad;
      want.push_back(l);
    }
  }
  ASSERT_FALSE(want.empty()) << layouts.at(tree);

  TensorDict td = build_tree(tree, 0);
  if (tree == "record") td = InteropRecord(td).consolidate().tensordict();
  const TensorDict c = td.consolidate();
  ASSERT_TRUE(c.is_consolidated());
  std::vector<PyLeaf> got;
  flatten(c.schema().root, "", got);
  EXPECT_EQ(c.schema().total_bytes, total);
  EXPECT_EQ(c.consolidated_storage().numel(), static_cast<int64_t>(total));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("leaf " + want[i].key);
    EXPECT_EQ(got[i].key, want[i].key);
    EXPECT_EQ(got[i].dtype, want[i].dtype);
    EXPECT_EQ(got[i].shape, want[i].shape);
    EXPECT_EQ(got[i].start, want[i].start);
    EXPECT_EQ(got[i].stop, want[i].stop) << "(tensordict's stop includes the pad)";
    EXPECT_EQ(got[i].pad, want[i].pad);
  }
  EXPECT_EQ(hex(c.consolidated_storage()), storage_hex);
}

INSTANTIATE_TEST_SUITE_P(Trees, InteropLayout, ::testing::ValuesIn(kLayoutTrees),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// The C++ patterns are td_peer.py's (values printed by td_peer.pattern): the layout tests
// compare them through the storage bytes too; this names a difference directly.
TEST(InteropPattern, SameValuesAsTdPeer) {
  EXPECT_EQ(fnv1a32("c"), 3859557458u);
  EXPECT_EQ(fnv1a32("a.b"), 277607692u);
  EXPECT_TRUE(at::equal(pattern({"c"}, at::kFloat, {2, 3}, 0),
                        at::tensor({1.0f, 1.875f, 2.75f, 3.625f, 4.5f, 5.375f}).reshape({2, 3})));
  EXPECT_TRUE(at::equal(pattern({"a", "x", "y"}, at::kShort, {2, 3}, 5),
                        at::tensor({56, 63, 70, 77, 84, 91}, at::kShort).reshape({2, 3})));
  EXPECT_TRUE(at::equal(pattern({"mask"}, at::kBool, {2, 3}, 1),
                        at::tensor({0, 1, 0, 1, 0, 1}, at::kLong).to(at::kBool).reshape({2, 3})));
}

// ---------------------------------------------------------------------------------------------
// Two-rank exchanges, on either backend

struct Exchanges : InteropTest {
  std::string backend = "gloo";

  void perleaf_cpp_to_py(PerLeaf cpp_side, Api py_api) {
    World w{.backend = backend};
    w.cpp[0] = cpp_send(1, cpp_side);
    PerLeaf py_side = cpp_side;
    py_side.api = py_api;
    w.py[1] = py_perleaf("recv", 0, py_side);
    run(w);
  }
  void perleaf_py_to_cpp(PerLeaf cpp_side, Api py_api) {
    World w{.backend = backend};
    PerLeaf py_side = cpp_side;
    py_side.api = py_api;
    w.py[0] = py_perleaf("send", 1, py_side);
    w.cpp[1] = cpp_recv(0, cpp_side);
    run(w);
  }
  /// group_dst / group_src of new_group([0, 2]) in a world of 3: group rank 1 is global rank 2.
  void group_dst(bool cpp_sends) {
    World w{.backend = backend, .size = 3, .group_ranks = {0, 2}};
    const PerLeaf p{.tree = "mixed", .salt = 4, .api = Api::kAsync};
    if (cpp_sends) {
      w.cpp[2] = cpp_send(/*group_dst=*/0, p);
      w.cpp[1] = cpp_idle;
      w.py[0] = py_perleaf("recv", /*group_src=*/1, p);
    } else {
      w.py[2] = py_perleaf("send", 0, p);
      w.py[1] = kPyIdle;
      w.cpp[0] = cpp_recv(1, p);
    }
    run(w);
  }
  /// Rank 1 sends to rank 0: the C++ sender `cpp` and the Python receiver `py`, or the Python
  /// sender `py` and the C++ receiver `cpp`.
  void one_way(bool cpp_sends, std::function<void(const Group&)> cpp, std::vector<std::string> py) {
    World w{.backend = backend};
    w.cpp[cpp_sends ? 1 : 0] = std::move(cpp);
    w.py[cpp_sends ? 0 : 1] = std::move(py);
    run(w);
  }
  void consolidated(bool cpp_sends, const std::string& tree, bool loaned = false) {
    if (cpp_sends) return one_way(true, cpp_consolidated_send(0, tree, 2, loaned), py_consolidated("recv", 1, tree, 2));
    one_way(false, cpp_consolidated_recv(1, tree, 2), py_consolidated("send", 0, tree, 2));
  }
  void consolidated_lazy(bool cpp_sends, const std::vector<std::string>& trees) {
    if (cpp_sends) return one_way(true, cpp_consolidated_lazy_send(0, trees, 3), py_consolidated_lazy("recv", 1, trees, 3));
    one_way(false, cpp_consolidated_lazy_recv(1, trees, 4), py_consolidated_lazy("send", 0, trees, 4));
  }
  void remote_lazy(bool cpp_sends, const std::vector<std::string>& trees) {
    const std::vector<std::string> py = {"--scenario", "remote", "--role", cpp_sends ? "recv" : "send", "--peer",
                                         cpp_sends ? "1" : "0", "--tree", trees[0], "--salt", "5", "--lazy-members",
                                         comma_joined(trees)};
    one_way(cpp_sends, cpp_sends ? cpp_remote_lazy_send(0, trees, 5) : cpp_remote_lazy_recv(1, trees, 5), py);
  }
  /// A TensorDict holding a lazy stack, consolidated send (or init_remote) one way.
  void nested_lazy(bool cpp_sends, bool remote, const std::vector<std::string>& trees) {
    if (cpp_sends) return one_way(true, cpp_nested_lazy_send(0, trees, 6, remote), py_nested_lazy("recv", 1, trees, 6, remote));
    one_way(false, cpp_nested_lazy_recv(1, trees, 7, remote), py_nested_lazy("send", 0, trees, 7, remote));
  }
  void remote(bool cpp_sends, const std::string& tree) {
    World w{.backend = backend};
    if (cpp_sends) {
      w.cpp[0] = cpp_remote_send(1, tree, 3);
      w.py[1] = py_remote("recv", 0, tree, 3);
    } else {
      w.py[0] = py_remote("send", 1, tree, 3);
      w.cpp[1] = cpp_remote_recv(0, tree, 3);
    }
    run(w);
  }
  /// A Python sender of `bad_tree`, then of "probe" (salt 1); a C++ receiver of "probe" twice.
  void mismatch_per_leaf(const std::string& bad_tree) {
    World w{.backend = backend};
    w.py[0] = {"--scenario", "perleaf", "--role", "send", "--peer", "1", "--tree", bad_tree, "--then-tree", "probe"};
    w.cpp[1] = [](const Group&) {
      TensorDict td = build_tree("probe", 0, true);
      const Caught c = catch_any([&] { td.recv({.src = 0}); });
      SHM_CHECK(c.is<TransportError>() || c.is<SchemaError>(),
                "expected TransportError or SchemaError, got " << c.describe());
      SHM_CHECK(contains_nocase(c.what, "victim_key"), "the error does not name the key: " << c.what);
      TensorDict next = build_tree("probe", 0, true);
      next.recv({.src = 0});
      check_tree(next, "probe", 1, "the transfer after the refused one");
    };
    run(w);
  }
  /// A world of all_gather or scatter (from `src`) where rank r holds trees[r] at salt + r and
  /// is C++ for langs[r] == 'c', Python for 'p', Python reading the objects with torch's own
  /// all_gather_object / scatter_object_list for 'P'.
  void gather_scatter(const std::string& scenario, const std::string& langs, const std::vector<std::string>& trees,
                      int64_t salt, int src = 0) {
    World w{.backend = backend, .size = static_cast<int>(langs.size())};
    for (int r = 0; r < w.size; ++r) {
      if (langs[r] == 'c') {
        w.cpp[r] = scenario == "scatter" ? cpp_scatter(src, trees, salt) : cpp_all_gather(trees, salt);
      } else {
        w.py[r] = py_gather_scatter(scenario, trees, salt, src);
        if (langs[r] == 'P') w.py[r].push_back("--torch-object-list");
      }
    }
    run(w);
  }
  /// gather_and_stack in a world with a Python rank: every C++ rank refuses before any message
  /// (the Python rank's gather_and_stack would pickle; it stays idle here), and stays in step.
  void gather_and_stack_with_python() {
    World w{.backend = backend, .size = 3};
    for (int r : {0, 1}) {
      w.cpp[r] = [r](const Group&) {
        TensorDict t = r == 0 ? build_tree("seed", 0, true) : build_tree("seed", 1);
        const Caught c = catch_any([&] { t.gather_and_stack({.dst = 0}); });
        SHM_CHECK(c.is<Error>() && contains_nocase(c.what, "Python"), "expected the refusal, got " << c.describe());
        if (r == 1) build_tree("seed", 2).send({.dst = 0});
        if (r == 0) {
          TensorDict next = build_tree("seed", 0, true);
          next.recv({.src = 1});
          check_tree(next, "seed", 2, "the transfer after the refusal");
        }
      };
    }
    w.py[2] = kPyIdle;
    run(w);
  }
  /// broadcast (or init_remote(use_broadcast)) of a lazy stack of `trees` from rank 1 in a
  /// 3-rank world, C++ unless py_root; ranks alternate languages.
  void broadcast_lazy(bool py_root, const std::vector<std::string>& trees, bool via_init_remote) {
    World w{.backend = backend, .size = 3};
    const int root = 1;
    for (int r = 0; r < 3; ++r) {
      if ((r == root) == py_root) {
        w.py[r] = py_broadcast(r == root ? "root" : "member", root, trees[0], 5, via_init_remote);
        w.py[r].insert(w.py[r].end(), {"--lazy-members", comma_joined(trees)});
        continue;
      }
      w.cpp[r] = [=](const Group&) {
        if (r == root) {
          const LazyStackedTensorDict s = lazy_stack_of(trees, 5, false);
          if (via_init_remote) return s.init_remote({.use_broadcast = true});
          return check_lazy(s.broadcast({.src = root}), trees, 5, "broadcast at the root");
        }
        check_lazy(via_init_remote ? LazyStackedTensorDict::from_remote_init({.src = root, .use_broadcast = true})
                                   : LazyStackedTensorDict({}).broadcast({.src = root}),
                   trees, 5, "broadcast member");
      };
    }
    run(w);
  }
  /// A 3-rank world: the root at rank `root`, C++ unless py_root; ranks alternate languages.
  void broadcast(bool py_root, const std::string& tree, bool via_init_remote) {
    World w{.backend = backend, .size = 3};
    const int root = 1;
    for (int r = 0; r < 3; ++r) {
      const bool py = (r == root) == py_root;
      if (py) {
        w.py[r] = py_broadcast(r == root ? "root" : "member", root, tree, 5, via_init_remote);
        // One Python member takes the metadata with torch's own broadcast_object_list.
        if (r == 2) w.py[r].push_back("--torch-object-list");
      } else {
        w.cpp[r] = r == root ? cpp_broadcast_root(root, tree, 5, via_init_remote)
                             : cpp_broadcast_member(root, tree, 5, via_init_remote);
      }
    }
    run(w);
  }
};

struct InteropGloo : Exchanges {};
struct InteropCppHalves : Exchanges {};
struct InteropShm : Exchanges {
  InteropShm() { backend = "shm"; }
};

// ---- per-leaf: each direction with two pairings of the send and receive calls ----
TEST_F(InteropGloo, PerLeafCppSendPyIrecvPremature) { perleaf_cpp_to_py({.api = Api::kSync}, Api::kEarly); }
TEST_F(InteropGloo, PerLeafCppIsendPyRecv) { perleaf_cpp_to_py({.tree = "seed", .salt = 1, .api = Api::kAsync}, Api::kSync); }
TEST_F(InteropGloo, PerLeafPyIsendEarlyCppRecv) { perleaf_py_to_cpp({.api = Api::kSync}, Api::kEarly); }
TEST_F(InteropGloo, PerLeafPySendCppIrecvPremature) {
  perleaf_py_to_cpp({.tree = "seed", .salt = 1, .api = Api::kEarly}, Api::kSync);
}
TEST_F(InteropGloo, PerLeafPyIsendCppIrecv) { perleaf_py_to_cpp({.salt = 2, .api = Api::kAsync}, Api::kAsync); }
// A heterogeneous lazy stack (members of other keys and shapes): tensordict's _lazy.py wire.
const std::vector<std::string> kLazyMembers{"seed", "mixed", "reducible"};
TEST_F(InteropGloo, LazyStackCppToPy) {
  perleaf_cpp_to_py({.salt = 3, .api = Api::kEarly, .init_tag = 4, .lazy = kLazyMembers}, Api::kSync);
}
TEST_F(InteropGloo, LazyStackPyToCpp) {
  perleaf_py_to_cpp({.salt = 5, .api = Api::kSync, .pseudo = true, .lazy = kLazyMembers}, Api::kEarly);
}
// The stack nested in a TensorDict, between two leaves (tensordict's TestSendLazyStackNest).
TEST_F(InteropGloo, NestedLazyStackCppToPy) {
  perleaf_cpp_to_py({.salt = 8, .api = Api::kSync, .pseudo = true, .lazy = kLazyMembers, .nest = true}, Api::kEarly);
}
TEST_F(InteropGloo, NestedLazyStackPyToCpp) {
  perleaf_py_to_cpp({.salt = 9, .api = Api::kEarly, .lazy = kLazyMembers, .nest = true}, Api::kSync);
}
TEST_F(InteropGloo, InitTagCppToPy) { perleaf_cpp_to_py({.tree = "seed", .api = Api::kEarly, .init_tag = 17}, Api::kSync); }
TEST_F(InteropGloo, InitTagPyToCpp) { perleaf_py_to_cpp({.tree = "seed", .api = Api::kSync, .init_tag = 17}, Api::kAsync); }
TEST_F(InteropGloo, PseudoRandCppToPy) {
  perleaf_cpp_to_py({.api = Api::kAsync, .init_tag = 1, .pseudo = true}, Api::kSync);
}
TEST_F(InteropGloo, PseudoRandPyToCpp) {
  perleaf_py_to_cpp({.api = Api::kSync, .init_tag = 1, .pseudo = true}, Api::kEarly);
}
TEST_F(InteropGloo, GroupDstCppToPy) { group_dst(true); }
TEST_F(InteropGloo, GroupDstPyToCpp) { group_dst(false); }
TEST_F(InteropGloo, GatherAndStackRefusedWithAPythonRank) { gather_and_stack_with_python(); }
// ---- consolidated ----
TEST_F(InteropGloo, ConsolidatedCppToPy) { consolidated(true, "mixed"); }
TEST_F(InteropGloo, ConsolidatedPyToCpp) { consolidated(false, "mixed"); }
TEST_F(InteropGloo, ConsolidatedOneDtypePyToCpp) { consolidated(false, "u8only"); }
TEST_F(InteropGloo, ConsolidatedLazyStackCppToPy) { consolidated_lazy(true, kLazyMembers); }
TEST_F(InteropGloo, ConsolidatedLazyStackPyToCpp) { consolidated_lazy(false, kLazyMembers); }
TEST_F(InteropGloo, RemoteInitLazyStackCppToPy) { remote_lazy(true, kLazyMembers); }
TEST_F(InteropGloo, RemoteInitLazyStackPyToCpp) { remote_lazy(false, kLazyMembers); }
TEST_F(InteropGloo, ConsolidatedNestedLazyStackCppToPy) { nested_lazy(true, false, kLazyMembers); }
TEST_F(InteropGloo, ConsolidatedNestedLazyStackPyToCpp) { nested_lazy(false, false, kLazyMembers); }
TEST_F(InteropGloo, RemoteInitNestedLazyStackCppToPy) { nested_lazy(true, true, kLazyMembers); }
TEST_F(InteropGloo, RemoteInitNestedLazyStackPyToCpp) { nested_lazy(false, true, kLazyMembers); }
TEST_F(InteropGloo, BroadcastLazyStackFromPy) { broadcast_lazy(true, kLazyMembers, false); }
TEST_F(InteropGloo, UseBroadcastLazyStackFromCpp) { broadcast_lazy(false, kLazyMembers, true); }
// ---- init_remote / from_remote_init ----
TEST_F(InteropGloo, RemoteCppToPy) { remote(true, "mixed"); }
TEST_F(InteropGloo, RemotePyToCpp) { remote(false, "mixed"); }
TEST_F(InteropGloo, RemoteTensorClassCppToPy) { remote(true, "record"); }
TEST_F(InteropGloo, RemoteTensorClassPyToCpp) { remote(false, "record"); }
// ---- broadcast, 3 ranks ----
TEST_F(InteropGloo, BroadcastFromCpp) { broadcast(false, "mixed", false); }
TEST_F(InteropGloo, BroadcastFromPy) { broadcast(true, "mixed", false); }
TEST_F(InteropGloo, UseBroadcastFromCpp) { broadcast(false, "record", true); }
TEST_F(InteropGloo, UseBroadcastFromPy) { broadcast(true, "mixed", true); }

// ---- collectives (tensordict's reduce, all_reduce, all_gather, scatter), C++ and Python ranks
// together; one Python rank of each 3-rank world reads objects with torch's own
// all_gather_object / scatter_object_list ----
TEST_F(InteropGloo, AllReduceSum) {
  World w;
  w.cpp[0] = cpp_reduction(true, "sum", Api::kSync, 3, 2);
  w.py[1] = py_reduction(true, "sum", Api::kAsync, 3);
  run(w);
}
TEST_F(InteropGloo, AllReduceProduct3Ranks) {
  World w{.size = 3};
  w.cpp[0] = cpp_reduction(true, "product", Api::kAsync, 1, 3);
  w.py[1] = py_reduction(true, "product", Api::kSync, 1);
  w.cpp[2] = cpp_reduction(true, "product", Api::kSync, 1, 3);
  run(w);
}
TEST_F(InteropGloo, ReduceMinToPy) {
  World w;
  w.cpp[0] = cpp_reduction(false, "min", Api::kEarly, 2, 2, /*dst=*/1);
  w.py[1] = py_reduction(false, "min", Api::kSync, 2, /*dst=*/1);
  run(w);
}
TEST_F(InteropGloo, ReduceMaxToCpp3Ranks) {
  World w{.size = 3};
  w.cpp[0] = cpp_reduction(false, "max", Api::kAsync, 4, 3, /*dst=*/0);
  w.py[1] = py_reduction(false, "max", Api::kEarly, 4, /*dst=*/0);
  w.py[2] = py_reduction(false, "max", Api::kSync, 4, /*dst=*/0);
  run(w);
}
TEST_F(InteropGloo, AllGather3Ranks) { gather_scatter("all_gather", "pcP", {"mixed", "record", "seed"}, 6); }
TEST_F(InteropGloo, AllGatherCppMajority) { gather_scatter("all_gather", "cpc", {"seed", "mixed", "record"}, 7); }
TEST_F(InteropGloo, ScatterFromCpp) { gather_scatter("scatter", "cpP", {"seed", "mixed", "record"}, 8, /*src=*/0); }
TEST_F(InteropGloo, ScatterFromPy) { gather_scatter("scatter", "cpc", {"record", "seed", "mixed"}, 9, /*src=*/1); }

// Over gloo a tdshm receiver of a Python sender sees nothing but the message bytes (see the
// file comment): int32 [2, 3] where it holds float32 [2, 3] arrives as the int32 bytes, and the
// transfer succeeds. This pins the documented limit; over shm the same is an error (below).
TEST_F(InteropGloo, SameBytesOtherDtypeIsNotDetected) {
  World w;
  w.py[0] = {"--scenario", "perleaf", "--role", "send", "--peer", "1", "--tree", "probe_same_bytes", "--salt", "0"};
  w.cpp[1] = [](const Group&) {
    TensorDict td = build_tree("probe", 0, true);
    td.recv({.src = 0});
    const at::Tensor want = pattern({"nest", "victim_key"}, at::kInt, {2, 3}, 0);
    const at::Tensor got = td.get({"nest", "victim_key"});
    SHM_CHECK(got.scalar_type() == at::kFloat, "the leaf changed dtype");
    SHM_CHECK(at::equal(got.view(at::kInt), want), "the leaf does not hold the sender's int32 bytes");
    SHM_CHECK(at::equal(td.get("alpha"), pattern({"alpha"}, at::kFloat, {2}, 0)), "alpha");
  };
  run(w);
}

// ---- the C++ halves against each other (no Python): checks the scenario code itself, as
// run_peer_selftest.py checks td_peer.py's ----
TEST_F(InteropCppHalves, PerLeaf) {
  World w;
  w.cpp[0] = cpp_send(1, {.api = Api::kEarly, .init_tag = 1, .pseudo = true});
  w.cpp[1] = cpp_recv(0, {.api = Api::kSync, .init_tag = 1, .pseudo = true});
  run(w);
}
TEST_F(InteropCppHalves, Consolidated) {
  World w;
  w.cpp[0] = cpp_consolidated_send(1, "mixed", 2);
  w.cpp[1] = cpp_consolidated_recv(0, "mixed", 2);
  run(w);
}
TEST_F(InteropCppHalves, RemoteTensorClass) {
  World w;
  w.cpp[0] = cpp_remote_send(1, "record", 3);
  w.cpp[1] = cpp_remote_recv(0, "record", 3);
  run(w);
}
TEST_F(InteropCppHalves, RemoteAndBroadcast) {
  World w{.size = 3, .group_ranks = {0, 2}};
  w.cpp[0] = [](const Group& g) {
    cpp_remote_recv(1, "mixed", 3)(Group{});
    cpp_broadcast_member(1, "mixed", 5, false)(g);
    cpp_recv(1, {.tree = "seed", .api = Api::kAsync})(g);  // group_src 1: global rank 2
  };
  w.cpp[1] = [](const Group&) {
    cpp_remote_send(0, "mixed", 3)(Group{});
    cpp_broadcast_root(1, "mixed", 5, false)(Group{});
  };
  w.cpp[2] = [](const Group& g) {
    cpp_broadcast_member(1, "mixed", 5, false)(Group{});
    cpp_send(0, {.tree = "seed", .api = Api::kSync})(g);
  };
  run(w);
}

TEST_F(InteropCppHalves, Collectives) {
  const std::vector<std::string> trees = {"mixed", "record", "seed"};
  World w{.size = 3};
  for (int r = 0; r < 3; ++r) {
    w.cpp[r] = [trees](const Group& g) {
      cpp_reduction(true, "product", Api::kAsync, 1, 3)(g);
      cpp_reduction(false, "max", Api::kEarly, 4, 3, /*dst=*/2)(g);
      cpp_all_gather(trees, 6)(g);
      cpp_scatter(1, trees, 9)(g);
    };
  }
  run(w);
}

// ---- the shm backend from Python (PYTHONPATH holds the tdshm package) ----
TEST_F(InteropShm, PerLeafCppToPy) { perleaf_cpp_to_py({.api = Api::kAsync}, Api::kEarly); }
TEST_F(InteropShm, PerLeafPyToCpp) { perleaf_py_to_cpp({.api = Api::kEarly}, Api::kSync); }
TEST_F(InteropShm, LazyStackCppToPy) {
  perleaf_cpp_to_py({.salt = 6, .api = Api::kAsync, .pseudo = true, .lazy = kLazyMembers}, Api::kEarly);
}
TEST_F(InteropShm, LazyStackPyToCpp) {
  perleaf_py_to_cpp({.salt = 7, .api = Api::kEarly, .init_tag = 9, .lazy = kLazyMembers}, Api::kAsync);
}
TEST_F(InteropShm, NestedLazyStackCppToPy) {
  perleaf_cpp_to_py({.salt = 10, .api = Api::kEarly, .lazy = kLazyMembers, .nest = true}, Api::kAsync);
}
TEST_F(InteropShm, NestedLazyStackPyToCpp) {
  perleaf_py_to_cpp({.salt = 11, .api = Api::kAsync, .pseudo = true, .lazy = kLazyMembers, .nest = true}, Api::kEarly);
}
TEST_F(InteropShm, PseudoRandPyToCpp) { perleaf_py_to_cpp({.api = Api::kSync, .init_tag = 1, .pseudo = true}, Api::kAsync); }
TEST_F(InteropShm, GroupDstCppToPy) { group_dst(true); }
TEST_F(InteropShm, GatherAndStackRefusedWithAPythonRank) { gather_and_stack_with_python(); }
TEST_F(InteropShm, ConsolidatedCppToPy) { consolidated(true, "mixed"); }
TEST_F(InteropShm, ConsolidatedPyToCpp) { consolidated(false, "mixed"); }
TEST_F(InteropShm, ConsolidatedLazyStackCppToPy) { consolidated_lazy(true, kLazyMembers); }
TEST_F(InteropShm, ConsolidatedLazyStackPyToCpp) { consolidated_lazy(false, kLazyMembers); }
TEST_F(InteropShm, RemoteInitLazyStackCppToPy) { remote_lazy(true, kLazyMembers); }
TEST_F(InteropShm, RemoteInitLazyStackPyToCpp) { remote_lazy(false, kLazyMembers); }
TEST_F(InteropShm, ConsolidatedNestedLazyStackCppToPy) { nested_lazy(true, false, kLazyMembers); }
TEST_F(InteropShm, ConsolidatedNestedLazyStackPyToCpp) { nested_lazy(false, false, kLazyMembers); }
TEST_F(InteropShm, RemoteInitNestedLazyStackCppToPy) { nested_lazy(true, true, kLazyMembers); }
TEST_F(InteropShm, RemoteInitNestedLazyStackPyToCpp) { nested_lazy(false, true, kLazyMembers); }
TEST_F(InteropShm, BroadcastLazyStackFromCpp) { broadcast_lazy(false, kLazyMembers, false); }
TEST_F(InteropShm, UseBroadcastLazyStackFromPy) { broadcast_lazy(true, kLazyMembers, true); }
TEST_F(InteropShm, RemoteCppToPy) { remote(true, "mixed"); }
TEST_F(InteropShm, RemoteTensorClassPyToCpp) { remote(false, "record"); }
TEST_F(InteropShm, BroadcastFromPy) { broadcast(true, "mixed", false); }
TEST_F(InteropShm, UseBroadcastFromCpp) { broadcast(false, "record", true); }
// The rest of the mode x direction matrix over shm (the same scenarios as over gloo).
// A loaned tree (tdshm::loan) goes by reference over shm; the Python tensordict rank receives its
// bytes as from any sender (its ProcessGroupShm copies out of the loan), and over gloo a loan is
// an ordinary tensor.
TEST_F(InteropShm, LoanedPerLeafCppToPy) { perleaf_cpp_to_py({.salt = 3, .api = Api::kEarly, .loan = true}, Api::kSync); }
TEST_F(InteropShm, LoanedConsolidatedCppToPy) { consolidated(true, "mixed", /*loaned=*/true); }
TEST_F(InteropGloo, LoanedPerLeafCppToPy) { perleaf_cpp_to_py({.salt = 3, .api = Api::kSync, .loan = true}, Api::kEarly); }

TEST_F(InteropShm, PerLeafPyIsendCppIrecv) { perleaf_py_to_cpp({.salt = 2, .api = Api::kAsync}, Api::kAsync); }
TEST_F(InteropShm, InitTagCppToPy) { perleaf_cpp_to_py({.tree = "seed", .api = Api::kEarly, .init_tag = 17}, Api::kSync); }
TEST_F(InteropShm, InitTagPyToCpp) { perleaf_py_to_cpp({.tree = "seed", .api = Api::kSync, .init_tag = 17}, Api::kAsync); }
TEST_F(InteropShm, PseudoRandCppToPy) { perleaf_cpp_to_py({.api = Api::kAsync, .init_tag = 1, .pseudo = true}, Api::kSync); }
TEST_F(InteropShm, GroupDstPyToCpp) { group_dst(false); }
TEST_F(InteropShm, ConsolidatedOneDtypePyToCpp) { consolidated(false, "u8only"); }
// Collectives over shm: the same worlds as over gloo (ProcessGroupShm's collectives under
// tensordict's reduce, all_reduce, all_gather and scatter on both sides).
TEST_F(InteropShm, AllReduceSum) {
  World w;
  w.cpp[0] = cpp_reduction(true, "sum", Api::kSync, 3, 2);
  w.py[1] = py_reduction(true, "sum", Api::kAsync, 3);
  run(w);
}
TEST_F(InteropShm, AllReduceProduct3Ranks) {
  World w{.size = 3};
  w.cpp[0] = cpp_reduction(true, "product", Api::kAsync, 1, 3);
  w.py[1] = py_reduction(true, "product", Api::kSync, 1);
  w.cpp[2] = cpp_reduction(true, "product", Api::kSync, 1, 3);
  run(w);
}
TEST_F(InteropShm, ReduceMaxToCpp3Ranks) {
  World w{.size = 3};
  w.cpp[0] = cpp_reduction(false, "max", Api::kAsync, 4, 3, /*dst=*/0);
  w.py[1] = py_reduction(false, "max", Api::kEarly, 4, /*dst=*/0);
  w.py[2] = py_reduction(false, "max", Api::kSync, 4, /*dst=*/0);
  run(w);
}
TEST_F(InteropShm, AllGather3Ranks) { gather_scatter("all_gather", "pcP", {"mixed", "record", "seed"}, 6); }
TEST_F(InteropShm, ScatterFromPy) { gather_scatter("scatter", "cpc", {"record", "seed", "mixed"}, 9, /*src=*/1); }
TEST_F(InteropShm, ScatterFromCpp) { gather_scatter("scatter", "cpP", {"seed", "mixed", "record"}, 8, /*src=*/0); }
TEST_F(InteropShm, RemotePyToCpp) { remote(false, "mixed"); }
TEST_F(InteropShm, RemoteTensorClassCppToPy) { remote(true, "record"); }
TEST_F(InteropShm, BroadcastFromCpp) { broadcast(false, "mixed", false); }
TEST_F(InteropShm, UseBroadcastFromPy) { broadcast(true, "mixed", true); }

// A Python (tensordict) sender whose ("nest", "victim_key") differs from the C++ receiver's:
// over shm the receiver gets a TransportError or SchemaError naming the key, never an abort,
// and the next transfer (the right tree) arrives intact.
TEST_F(InteropShm, MismatchShapeNamesTheKey) { mismatch_per_leaf("probe_bad_shape"); }
TEST_F(InteropShm, MismatchDtypeNamesTheKey) { mismatch_per_leaf("probe_bad_dtype"); }
TEST_F(InteropShm, MismatchSameBytesOtherDtypeNamesTheKey) { mismatch_per_leaf("probe_same_bytes"); }

// A consolidated storage of another size: the Python sender sends no schema, so the receiver
// can only tell the byte count (the same count with another layout is not detectable); it
// fails with a tdshm error, never an abort, and the next storage arrives intact.
TEST_F(InteropShm, MismatchConsolidatedSize) {
  World w{.backend = "shm"};
  w.py[0] = {"--scenario", "consolidated", "--role", "send", "--peer", "1", "--tree", "probe_bad_dtype",
             "--rounds", "1", "--then-tree", "probe"};
  w.cpp[1] = [](const Group&) {
    TensorDict td_c = build_tree("probe", 0, true).consolidate();
    const Caught c = catch_any([&] { td_c.recv({.src = 0, .consolidated = true}); });
    SHM_CHECK(c.is<Error>(), "expected a tdshm::Error, got " << c.describe());
    SHM_CHECK(c.is<TransportError>() || c.is<SchemaError>(), "expected TransportError or SchemaError, got " << c.describe());
    td_c.recv({.src = 0, .consolidated = true});
    check_tree(td_c, "probe", 1, "the consolidated transfer after the refused one");
  };
  run(w);
}

}  // namespace
}  // namespace tdshm::test
