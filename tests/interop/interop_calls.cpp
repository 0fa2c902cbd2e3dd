// The C++ halves of td_peer.py's scenarios (interop_calls.h).

#include "interop/interop_calls.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/process_group.h>
#include <tdshm/tensorclass.h>

#include "dist/dist_support.h"
#include "interop/interop_trees.h"

namespace tdshm::test::interop {

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

namespace {

/// The tags of `n` leaves from init_tag: the last one.
int64_t expected_last_tag(size_t n, int64_t init_tag, bool pseudo) {
  int64_t tag = init_tag - 1;
  for (size_t i = 0; i < n; ++i) tag = pseudo ? pseudo_rand_tag(tag + 1) : tag + 1;
  return tag;
}

}  // namespace

namespace {

/// The two leaves beside a nested stack (PerLeaf::nest), as td_peer.py makes them.
TensorDict nest_lazy(const LazyStackedTensorDict& stack, int64_t salt, bool blank) {
  const at::Tensor a0 = blank ? at::full({3}, -1.0) : at::arange(3, at::kFloat) + static_cast<double>(salt);
  const at::Tensor zz = blank ? at::full({2}, -1, at::kLong) : at::arange(2, at::kLong) * (salt + 1);
  return TensorDict({{"a0", a0}, {"ls", Value(stack)}, {"zz", zz}}, {});
}

}  // namespace

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

namespace {

size_t leaf_count(const TensorDict& td) { return td.sorted_leaf_keys().size(); }

size_t leaf_count(const LazyStackedTensorDict& s) {
  size_t n = 0;
  for (const TensorDict& td : s.tensordicts()) n += leaf_count(td);
  return n;
}

}  // namespace

/// The members of a lazy stack of `trees` at salt + m.
void check_lazy(const LazyStackedTensorDict& s, const std::vector<std::string>& trees, int64_t salt, const std::string& what) {
  SHM_CHECK(s.size() == trees.size(), what << ": " << s.size() << " members, expected " << trees.size());
  for (size_t m = 0; m < s.size(); ++m) {
    check_tree(s.tensordicts()[m], trees[m], salt + static_cast<int64_t>(m), what + ", member " + std::to_string(m));
  }
}

namespace {

/// nest_lazy of a lazy stack of `trees`: the leaves beside the stack, then its members.
void check_nested_lazy(const TensorDict& td, const std::vector<std::string>& trees, int64_t salt, const std::string& what) {
  const TensorDict want = nest_lazy(lazy_stack_of(trees, salt, false), salt, false);
  SHM_CHECK(at::equal(td.get("a0"), want.get("a0")) && at::equal(td.get("zz"), want.get("zz")),
            what << ": the leaves beside the nested lazy stack: " << td.get("a0") << ", " << td.get("zz"));
  check_lazy(td.get_lazy_stack("ls"), trees, salt, what);
}

}  // namespace

namespace {

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

}  // namespace

namespace {

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

}  // namespace

std::function<void(const Group&)> cpp_send(int dst, PerLeaf p) {
  return [dst, p](const Group& g) {
    if (!p.lazy.empty() && p.nest) return send_as(nest_lazy(lazy_stack_of(p.lazy, p.salt, false), p.salt, false), p, to(dst, g));
    if (!p.lazy.empty()) return send_as(lazy_stack_of(p.lazy, p.salt, false), p, to(dst, g));
    send_as(maybe_loaned(build_tree(p.tree, p.salt), g, p.loan), p, to(dst, g));
  };
}

namespace {

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

}  // namespace

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
                                                        bool loaned) {
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
namespace {

c10d::ReduceOp::RedOpType reduce_op(const std::string& op) {
  static const std::map<std::string, c10d::ReduceOp::RedOpType> ops = {
      {"sum", c10d::ReduceOp::SUM}, {"min", c10d::ReduceOp::MIN}, {"max", c10d::ReduceOp::MAX},
      {"product", c10d::ReduceOp::PRODUCT}};
  return ops.at(op);
}

}  // namespace

namespace {

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

}  // namespace

/// all_reduce (Api::kSync, or kAsync: async_op) or reduce to `dst` (kSync, kAsync: async_op,
/// kEarly: async_op and return_premature) of "reducible" in a world of `world`.
std::function<void(const Group&)> cpp_reduction(bool all, const std::string& op, Api api, int64_t salt, int world,
                                                int dst) {
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

std::vector<std::string> py_reduction(bool all, const std::string& op, Api api, int64_t salt, int dst) {
  return {"--scenario", all ? "all_reduce" : "reduce", "--op", op, "--api", api_arg(api), "--tree", "reducible",
          "--salt", std::to_string(salt), "--dst", std::to_string(dst)};
}

namespace {

std::string joined(const std::vector<std::string>& trees) {
  std::string s;
  for (const std::string& t : trees) s += (s.empty() ? "" : ",") + t;
  return s;
}

}  // namespace

namespace {

/// Tree `name` at `salt`, as a tensorclass's tensordict for "record" (whose name must not travel).
TensorDict collective_tree(const std::string& name, int64_t salt) {
  const TensorDict td = build_tree(name, salt);
  return name == "record" ? InteropRecord(td).tensordict() : td;
}

}  // namespace

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
                                           int64_t salt, int src) {
  return {"--scenario", scenario, "--trees", joined(trees), "--salt", std::to_string(salt), "--src", std::to_string(src)};
}

const std::vector<std::string> kPyIdle = {"--scenario", "idle", "--role", "idle"};

void cpp_idle(const Group&) {}

}  // namespace tdshm::test::interop
