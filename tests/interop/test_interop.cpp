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
// grace; the Python ranks' output is in the failure message. The harness: interop_world.h (the
// worlds and the fixture), interop_trees.h (the trees and their values), interop_calls.h (the C++
// halves of td_peer.py's scenarios and the Python ranks' arguments).
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

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dist/dist_support.h"
#include "interop/interop_calls.h"
#include "interop/interop_trees.h"
#include "interop/interop_world.h"

namespace tdshm::test {

namespace {

using namespace std::chrono_literals;
using namespace interop;

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
