// One "shm" world across hosts (src/process_group/process_group_hosts.h), on simulated hosts
// (benchmarks/sim_hosts.h: a private /dev/shm per host, every host named "node"; the network shared,
// so gloo runs over 127.0.0.1): init_process_group("shm", tcp://...) as on two machines, point to
// point routed per pair (the tensordict API in every mode, plain c10d calls), the transport's
// answers per peer (loans and views only inside a host), the collectives against a one-process
// reference, and ranks of two PID namespaces sharing /dev/shm in one world (over gloo between
// them). Root only (namespaces); skipped with a message otherwise.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>
#include <tdshm/tensordict.h>

#include "dist/dist_support.h"
#include "dist/python_paths.h"

#ifndef TDSHM_TOOL_PATH
#define TDSHM_TOOL_PATH ""
#endif
#include "sim_hosts.h"
#include "process_group/process_group_hosts.h"
#include "process_group/transport.h"

#include <unistd.h>

#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace tdshm::test {
namespace {

using sim::HostView;
using sim::SimHost;
using sim::run_sim_hosts;
using sim::sim_hosts_unavailable;

constexpr int kWorld = 6;

/// Two hosts of three ranks, interleaved: host A runs 0, 2, 4 and host B 1, 3, 5.
std::vector<SimHost> two_hosts(HostView view = HostView::kOwnShm) {
  return {{view, {0, 2, 4}}, {view, {1, 3, 5}}};
}

class DistHosts : public DistTest {
 protected:
  void SetUp() override {
    DistTest::SetUp();
    if (const auto why = sim_hosts_unavailable()) GTEST_SKIP() << *why;
    port_ = distinct_free_port();
  }

  /// Every rank of `hosts` joins one "shm" world over tcp://127.0.0.1 (rank 0 serves the
  /// store), runs `body`, meets the others and destroys its groups.
  void run_world(const std::vector<SimHost>& hosts, const std::function<void(int)>& body) {
    int size = 0;
    for (const SimHost& h : hosts) size += static_cast<int>(h.ranks.size());
    const std::string method = "tcp://127.0.0.1:" + std::to_string(port_);
    const std::vector<std::string> failures = run_sim_hosts(hosts, [&](int rank) {
      init_process_group("shm", {.rank = rank, .world_size = size, .init_method = method, .timeout = kGroupTimeout});
      body(rank);
      default_group().backend().barrier()->wait();  // rank 0 serves the store: nobody leaves early
      destroy_process_group();
    });
    for (const std::string& f : failures) ADD_FAILURE() << f;
  }

  uint16_t port_ = 0;
};

/// Rank r's tree at round `salt`: {"x": [2, 3] float, ("n", "y"): [2] int64}, batch [2].
TensorDict tree(int r, int salt, bool blank = false) {
  const double v = blank ? -1 : r * 100 + salt;
  return TensorDict({{"x", at::full({2, 3}, v)}, {{"n", "y"}, at::full({2}, static_cast<int64_t>(v), at::kLong)}}, {2});
}

void check_tree(const TensorDict& td, int r, int salt, const std::string& what) {
  const TensorDict want = tree(r, salt);
  SHM_CHECK((td == want).all(), what << ": got x " << td.get("x") << " from rank " << r);
}

// A ring: every rank sends to the next and receives from the previous, so every rank has a
// local and a remote pair (ranks alternate hosts). Per leaf (blocking and isend/irecv),
// consolidated, and a plain c10d call; the transport answers per peer.
TEST_F(DistHosts, PointToPointRoutedPerPair) {
  run_world(two_hosts(), [](int rank) {
    const Group g = default_group();
    const int next = (rank + 1) % kWorld;
    const int prev = (rank + kWorld - 1) % kWorld;
    SHM_CHECK(g.backend_name() == "shm", g.backend_name());
    // Ranks of one parity share a host: next and prev are on the other host, rank ± 2 on this one.
    const int beside = (rank + 2) % kWorld;
    SHM_CHECK(g.transport().can(beside).loans && !g.transport().can(next).loans, "rank " << rank);
    SHM_CHECK(!g.checked_wire_with(beside) && g.checked_wire_with(next), "checked wire only over the network");
    for (int salt = 0; salt < 2; ++salt) {
      // return_early: tensordict's isend otherwise waits for its sends, which over the network
      // complete only once received (a ring of such isends would wait on each other).
      const Transfer sent = tree(rank, salt).isend({.dst = next, .return_early = true});
      TensorDict in = tree(prev, salt, true);
      in.recv({.src = prev});
      sent.wait();
      check_tree(in, prev, salt, "per leaf from the other host");
      // Inside the host: to rank + 2, from rank - 2.
      const int from = (rank + kWorld - 2) % kWorld;
      const Transfer local = tree(rank, salt + 10).isend({.dst = beside, .return_early = true});
      TensorDict mine = tree(from, salt + 10, true);
      mine.irecv({.src = from}).wait();
      local.wait();
      check_tree(mine, from, salt + 10, "per leaf inside the host");
    }
    // Consolidated, both routes.
    for (const int peer_offset : {1, 2}) {
      const int to = (rank + peer_offset) % kWorld;
      const int from = (rank + kWorld - peer_offset) % kWorld;
      const TensorDict c = tree(rank, 7).consolidate();
      const Transfer t = c.isend({.dst = to, .return_early = true, .consolidated = true});
      TensorDict in = tree(from, 0, true).consolidate();
      in.recv({.src = from, .consolidated = true});
      t.wait();
      check_tree(in, from, 7, "consolidated, offset " + std::to_string(peer_offset));
    }
    // A plain c10d call on the group's backend (what a Python rank makes).
    std::vector<at::Tensor> out{at::full({4}, static_cast<float>(rank))};
    std::vector<at::Tensor> in{at::zeros({4})};
    auto s = g.backend().send(out, next, 99);
    g.backend().recv(in, prev, 99)->wait();
    s->wait();
    SHM_CHECK(at::equal(in[0], at::full({4}, static_cast<float>(prev))), in[0]);
    // Any-source receives cannot listen on both routes: refused.
    SHM_CHECK_THROWS(Error, [&] { (void)g.backend().recvAnysource(in, 5); }, "name the source");
  });
}

// `tdshm world` names the hosts, the routes and the heartbeats of the running world.
TEST_F(DistHosts, TheWorldCommandShowsHostsRoutesAndHeartbeats) {
  if (*TDSHM_TOOL_PATH == '\0') GTEST_SKIP() << "the tdshm tool is not built";
  const std::string url = "tcp://127.0.0.1:" + std::to_string(port_);
  run_world(two_hosts(), [&](int rank) {
    if (rank != 0) return;
    FILE* p = ::popen((std::string(TDSHM_TOOL_PATH) + " world " + url + " 2>&1").c_str(), "r");
    SHM_CHECK(p != nullptr, "popen");
    std::string out;
    char buf[512];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int status = ::pclose(p);
    SHM_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "exit status " << status << ":\n" << out);
    for (const char* want : {"a \"shm\" world of 6 ranks on 2 hosts", "host 0: ranks 0 2 4 (leader 0)",
                             "host 1: ranks 1 3 5 (leader 1)", "the world is running"}) {
      SHM_CHECK(out.find(want) != std::string::npos, "no '" << want << "' in:\n" << out);
    }
    SHM_CHECK(out.find("silent") == std::string::npos && out.find("beating") != std::string::npos, out);
  });
}

// A loan sent to another host arrives as bytes; recv_view from another host is a receive into
// fresh tensors; inside the host a view maps the sender's loan.
TEST_F(DistHosts, LoansAndViewsStayInsideTheHost) {
  run_world(two_hosts(), [](int rank) {
    if (rank == 0 || rank == 2) {
      // 0 -> 1 (other host), 2 -> 4 (this host)
      const int to = rank == 0 ? 1 : 4;
      TensorDict l = loan(tree(rank, 0), {.dst = to});
      l.update_(tree(rank, 3));
      l.send({.dst = to});
    } else if (rank == 1 || rank == 4) {
      const int from = rank == 1 ? 0 : 2;
      const TensorDict v = tree(from, 0, true).recv_view({.src = from});
      check_tree(v, from, 3, "recv_view");
    }
  });
}

/// Every rank's tensor in a collective: rank r holds r + 1 + i at element i.
at::Tensor ranked(int r, int64_t n = 5) { return at::arange(n, at::kFloat) + (r + 1); }

TEST_F(DistHosts, CollectivesEqualAOneProcessReference) {
  run_world(two_hosts(), [](int rank) {
    c10d::ProcessGroup& pg = default_group().backend();
    // The reference, from every rank's input.
    at::Tensor sum = at::zeros({5});
    at::Tensor prod = at::ones({5});
    at::Tensor mx = ranked(0);
    for (int r = 0; r < kWorld; ++r) {
      sum += ranked(r);
      prod *= ranked(r);
      mx = at::maximum(mx, ranked(r));
    }
    {  // all_reduce: SUM, AVG, PRODUCT, MAX
      std::vector<at::Tensor> v{ranked(rank)};
      pg.allreduce(v)->wait();
      SHM_CHECK(at::allclose(v[0], sum), "all_reduce SUM: " << v[0]);
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::AVG;
      v = {ranked(rank)};
      pg.allreduce(v, o)->wait();
      SHM_CHECK(at::allclose(v[0], sum / kWorld), "all_reduce AVG: " << v[0]);
      o.reduceOp = c10d::ReduceOp::PRODUCT;
      v = {ranked(rank)};
      pg.allreduce(v, o)->wait();
      SHM_CHECK(at::allclose(v[0], prod), "all_reduce PRODUCT: " << v[0]);
      o.reduceOp = c10d::ReduceOp::MAX;
      v = {ranked(rank)};
      pg.allreduce(v, o)->wait();
      SHM_CHECK(at::equal(v[0], mx), "all_reduce MAX: " << v[0]);
    }
    for (int root : {0, 3, 4}) {  // broadcast and reduce, roots on both hosts, leaders or not
      std::vector<at::Tensor> v{ranked(rank)};
      c10d::BroadcastOptions b;
      b.rootRank = root;
      pg.broadcast(v, b)->wait();
      SHM_CHECK(at::equal(v[0], ranked(root)), "broadcast from " << root << ": " << v[0]);
      v = {ranked(rank)};
      c10d::ReduceOptions r;
      r.rootRank = root;
      pg.reduce(v, r)->wait();
      SHM_CHECK(at::allclose(v[0], rank == root ? sum : ranked(rank)), "reduce to " << root << ": " << v[0]);
    }
    {  // all_gather, gather to 3, scatter from 2, reduce_scatter
      std::vector<std::vector<at::Tensor>> out(1);
      for (int r = 0; r < kWorld; ++r) out[0].push_back(at::zeros({5}));
      std::vector<at::Tensor> in{ranked(rank)};
      pg.allgather(out, in)->wait();
      for (int r = 0; r < kWorld; ++r) SHM_CHECK(at::equal(out[0][r], ranked(r)), "all_gather slot " << r);
      std::vector<std::vector<at::Tensor>> g(rank == 3 ? 1 : 0);
      if (rank == 3) {
        for (int r = 0; r < kWorld; ++r) g[0].push_back(at::zeros({5}));
      }
      c10d::GatherOptions go;
      go.rootRank = 3;
      pg.gather(g, in, go)->wait();
      if (rank == 3) {
        for (int r = 0; r < kWorld; ++r) SHM_CHECK(at::equal(g[0][r], ranked(r)), "gather slot " << r);
      }
      std::vector<at::Tensor> mine{at::zeros({5})};
      std::vector<std::vector<at::Tensor>> all(rank == 2 ? 1 : 0);
      if (rank == 2) {
        for (int r = 0; r < kWorld; ++r) all[0].push_back(ranked(r) * 10);
      }
      c10d::ScatterOptions so;
      so.rootRank = 2;
      pg.scatter(mine, all, so)->wait();
      SHM_CHECK(at::equal(mine[0], ranked(rank) * 10), "scatter: " << mine[0]);
      std::vector<std::vector<at::Tensor>> parts(1);
      for (int r = 0; r < kWorld; ++r) parts[0].push_back(ranked(rank) * (r + 1));
      std::vector<at::Tensor> share{at::zeros({5})};
      pg.reduce_scatter(share, parts)->wait();
      SHM_CHECK(at::allclose(share[0], sum * (rank + 1)), "reduce_scatter: " << share[0]);
    }
    pg.barrier()->wait();
    // The tensordict collectives over it.
    TensorDict td = tree(rank, 0);
    td.all_reduce({});
    double total = 0;
    for (int r = 0; r < kWorld; ++r) total += r * 100;
    SHM_CHECK(at::allclose(td.get("x"), at::full({2, 3}, total)), "TensorDict::all_reduce: " << td.get("x"));
  });
}

// Subgroups made with new_group find their own hosts: {0, 1, 2} spans both (0 and 2 on A, 1 on
// B), {0, 2, 4} is host A alone (a plain ProcessGroupShm); transfers inside each use their
// group ranks.
TEST_F(DistHosts, NewGroupsFindTheirOwnHosts) {
  run_world(two_hosts(), [](int rank) {
    const Group spans = new_group({0, 1, 2});
    const Group host_a = new_group({0, 2, 4});
    if (spans.defined()) {
      // group ranks: 0 -> 0, 1 -> 1, 2 -> 2; 0 sends to 1 (other host) and 2 (same host).
      const bool on_a = rank != 1;  // group ranks 0 and 2 are on host A, 1 on B
      SHM_CHECK(spans.transport().can(2).loans == on_a && spans.transport().can(1).loans == !on_a, "rank " << rank);
      if (rank == 0) {
        tree(0, 5).send({.group = spans, .group_dst = 1});
        tree(0, 6).send({.group = spans, .group_dst = 2});
      } else {
        TensorDict in = tree(0, 0, true);
        in.recv({.group = spans, .group_src = 0});
        check_tree(in, 0, rank == 1 ? 5 : 6, "in the subgroup across hosts");
      }
      std::vector<at::Tensor> v{ranked(rank)};
      spans.backend().allreduce(v)->wait();
      SHM_CHECK(at::allclose(v[0], ranked(0) + ranked(1) + ranked(2)), "subgroup all_reduce: " << v[0]);
    }
    if (host_a.defined()) {
      SHM_CHECK(host_a.transport().can(1).loans && host_a.transport().can(2).loans, "one host: all shared memory");
      std::vector<at::Tensor> v{ranked(rank)};
      host_a.backend().allreduce(v)->wait();
      SHM_CHECK(at::allclose(v[0], ranked(0) + ranked(2) + ranked(4)), "host A's all_reduce: " << v[0]);
    }
  });
}

// Ranks that share /dev/shm but not their PID namespace cannot judge each other's liveness: one
// world all the same, over gloo between the two namespaces.
TEST_F(DistHosts, TwoPidNamespacesFormOneWorld) {
  run_world({{HostView::kSame, {0, 1}}, {HostView::kOwnPid, {2, 3}}}, [](int rank) {
    const Group g = default_group();
    const int peer = rank ^ 2;  // the other namespace
    const int twin = rank ^ 1;  // the same namespace
    SHM_CHECK(g.transport().can(twin).loans && !g.transport().can(peer).loans, "rank " << rank);
    const Transfer t = tree(rank, 1).isend({.dst = peer, .return_early = true});
    TensorDict in = tree(peer, 1, true);
    in.recv({.src = peer});
    t.wait();
    check_tree(in, peer, 1, "across PID namespaces");
    std::vector<at::Tensor> v{ranked(rank)};
    default_group().backend().allreduce(v)->wait();
    SHM_CHECK(at::allclose(v[0], ranked(0) + ranked(1) + ranked(2) + ranked(3)), v[0]);
  });
}

// A collective's future asked for after wait() completes with its result across hosts too (the
// world's collectives queue as ProcessGroupShm's do), for each kind; polled with a deadline.
TEST_F(DistHosts, AFutureAskedForAfterWaitCompletes) {
  run_world(two_hosts(), [&](int rank) {
    c10d::ProcessGroup& pg = default_group().backend();
    auto late = [&](const c10::intrusive_ptr<c10d::Work>& w, const char* what) {
      w->wait();
      auto f = w->getFuture();
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!f->completed()) {
        SHM_CHECK(std::chrono::steady_clock::now() < give_up, "rank " << rank << ": the future of a waited " << what
                                                                       << " never completed");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      SHM_CHECK(!f->hasError(), "rank " << rank << ": " << what << "'s future failed: " << f->tryRetrieveErrorMessage());
      return f->value().toTensorVector();
    };
    std::vector<at::Tensor> t{at::full({4}, static_cast<float>(rank))};
    auto out = late(pg.allreduce(t), "all_reduce");
    SHM_CHECK(out.size() == 1 && at::equal(out[0], at::full({4}, 15.0f)), "all_reduce's future value");
    std::vector<at::Tensor> b{at::full({4}, static_cast<float>(rank))};
    c10d::BroadcastOptions bo;
    bo.rootRank = 3;
    out = late(pg.broadcast(b, bo), "broadcast");
    SHM_CHECK(out.size() == 1 && at::equal(out[0], at::full({4}, 3.0f)), "broadcast's future value");
    std::vector<at::Tensor> in{at::full({2}, static_cast<float>(rank))};
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < kWorld; ++r) outs[0].push_back(at::zeros({2}));
    late(pg.allgather(outs, in), "all_gather");
    for (int r = 0; r < kWorld; ++r) SHM_CHECK(at::equal(outs[0][r], at::full({2}, static_cast<float>(r))), "all_gather");
    late(pg.barrier(), "barrier");
  });
}

// One set of argument checks for both process groups (src/process_group/tensor_checks.h): each
// bad call below fails at the call with a c10::Error saying the same thing in a world across
// hosts and on a ProcessGroupShm of one host, and sends nothing (the world stays in step).
TEST_F(DistHosts, BadArgumentsFailAtTheCallAsOnOneHost) {
  const std::string base = unique_name();
  run_world(two_hosts(), [&](int rank) {
    c10d::ProcessGroup& world = default_group().backend();
    ProcessGroupShm alone(base + "-" + std::to_string(rank), 0, 1);
    struct Case {
      const char* says;
      std::function<void(c10d::ProcessGroup&)> call;
    };
    const std::vector<Case> cases = {
        {"takes exactly one tensor",
         [](c10d::ProcessGroup& pg) {
           std::vector<at::Tensor> two{at::zeros({2}), at::zeros({2})};
           pg.broadcast(two);
         }},
        {"is outside [0, ",
         [](c10d::ProcessGroup& pg) {
           std::vector<at::Tensor> t{at::zeros({2})};
           c10d::BroadcastOptions o;
           o.rootRank = pg.getSize();
           pg.broadcast(t, o);
         }},
        {"a tensor is undefined",
         [](c10d::ProcessGroup& pg) {
           std::vector<at::Tensor> t{at::Tensor()};
           pg.allreduce(t);
         }},
        {"elements overlap in memory",
         [](c10d::ProcessGroup& pg) {
           std::vector<at::Tensor> t{at::zeros({1}).expand({4})};
           pg.allreduce(t);
         }},
        {"expected one list of",
         [](c10d::ProcessGroup& pg) {
           std::vector<at::Tensor> in{at::zeros({2})};
           std::vector<std::vector<at::Tensor>> outs(1, std::vector<at::Tensor>(pg.getSize() + 1, at::zeros({2})));
           pg.allgather(outs, in);
         }},
        {"every output must match the call's one tensor",
         [](c10d::ProcessGroup& pg) {
           std::vector<at::Tensor> in{at::zeros({2})};
           std::vector<std::vector<at::Tensor>> outs(1);
           for (int r = 0; r < pg.getSize(); ++r) outs[0].push_back(at::zeros({2}, at::kInt));
           pg.allgather(outs, in);
         }},
        {"every input must match the call's one tensor",
         [](c10d::ProcessGroup& pg) {
           std::vector<at::Tensor> out{at::zeros({2})};
           std::vector<std::vector<at::Tensor>> ins(1);
           for (int r = 0; r < pg.getSize(); ++r) ins[0].push_back(at::zeros({3}));
           pg.reduce_scatter(out, ins);
         }},
    };
    for (const Case& c : cases) {
      for (c10d::ProcessGroup* pg : {&world, static_cast<c10d::ProcessGroup*>(&alone)}) {
        const char* which = pg == &world ? "the world across hosts" : "a ProcessGroupShm";
        const Caught e = catch_any([&] { c.call(*pg); });
        SHM_CHECK(e.is<c10::Error>() && !e.is<tdshm::Error>(),
                  "rank " << rank << ", " << which << ", '" << c.says << "': " << e.describe());
        SHM_CHECK(e.what.find(c.says) != std::string::npos,
                  "rank " << rank << ", " << which << ": '" << e.what << "' does not say '" << c.says << "'");
      }
    }
    if (rank != 0) {  // a gather's outputs on a rank that is not its root
      std::vector<at::Tensor> in{at::zeros({2})};
      std::vector<std::vector<at::Tensor>> outs(1, std::vector<at::Tensor>(kWorld, at::zeros({2})));
      const Caught e = catch_any([&] { world.gather(outs, in); });
      SHM_CHECK(e.is<c10::Error>() && e.what.find("only the root passes output tensors") != std::string::npos,
                "rank " << rank << ": gather's outputs off the root: " << e.describe());
    }
    std::vector<at::Tensor> t{at::full({3}, static_cast<float>(rank))};
    world.allreduce(t)->wait();
    SHM_CHECK(at::equal(t[0], at::full({3}, 15.0f)), "rank " << rank << ": the all_reduce after the refused calls");
  });
}

// A rank killed on host B while every rank runs all_reduce in a loop: every survivor, on both
// hosts, gets a PeerLostError within 5 s of the kill (the victim writes the time first) that names
// the killed rank and no other as gone (the first signal on most survivors is a reset connection
// or a host-mate's shutdown, not the death itself), its groups are destroyed without hanging, and
// nothing is left in either /dev/shm (each host checks). First a rank of B, then B's leader (which
// holds the connection between the hosts); in two worlds: three ranks a host, interleaved, and two
// a host (0-1 on A, 2-3 on B).
TEST_F(DistHosts, ARankKilledIsATypedErrorOnEveryHostNamingIt) {
  struct Case {
    std::vector<SimHost> hosts;
    int victim;
  };
  const std::vector<SimHost> pairs = {{HostView::kOwnShm, {0, 1}}, {HostView::kOwnShm, {2, 3}}};
  for (const Case& c : {Case{two_hosts(), 3}, Case{two_hosts(), 1}, Case{pairs, 3}, Case{pairs, 2}}) {
    const int victim = c.victim;
    const int world = static_cast<int>(c.hosts[0].ranks.size() + c.hosts[1].ranks.size());
    const std::string method = "tcp://127.0.0.1:" + std::to_string(distinct_free_port());
    const std::string killed_at = file("killed_at." + std::to_string(world) + "." + std::to_string(victim));
    const std::vector<std::string> failures = run_sim_hosts(c.hosts, [&](int rank) {
      init_process_group("shm", {.rank = rank, .world_size = world, .init_method = method, .timeout = kGroupTimeout});
      c10d::ProcessGroup& pg = default_group().backend();
      for (int i = 0;; ++i) {
        if (rank == victim && i == 30) {
          {
            std::ofstream f(killed_at + ".tmp");
            f << std::chrono::steady_clock::now().time_since_epoch().count();
          }
          std::filesystem::rename(killed_at + ".tmp", killed_at);
          ::raise(SIGKILL);
        }
        std::vector<at::Tensor> v{at::ones({16 * 1024})};
        try {
          pg.allreduce(v)->wait();
        } catch (const PeerLostError& e) {
          const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
          std::ifstream f(killed_at);
          int64_t then = 0;
          SHM_CHECK(f >> then, "rank " << rank << " got an error before the victim died: " << e.what());
          const double seconds = static_cast<double>(now - then) * 1e-9;
          SHM_CHECK(seconds <= 5.0, "rank " << rank << " learned it after " << seconds << " s: " << e.what());
          const std::string what = e.what();
          std::fprintf(stderr, "[world %d, rank %d killed] rank %d after %.3f s: %s\n", world, victim, rank, seconds,
                       what.c_str());
          const std::string named = "rank " + std::to_string(victim) + " (host 1) ";
          SHM_CHECK(what.find(named + "died") != std::string::npos || what.find(named + "is gone") != std::string::npos,
                    "rank " << rank << "'s error does not name rank " << victim << " as gone: " << what);
          for (int r = 0; r < world; ++r) {
            if (r == victim) continue;
            for (const char* host : {"0", "1"}) {
              for (const char* blame : {"died", "is gone", "did not answer"}) {
                const std::string wrong = "rank " + std::to_string(r) + " (host " + host + ") " + blame;
                SHM_CHECK(what.find(wrong) == std::string::npos, "rank " << rank << " blames live rank " << r << ": " << what);
              }
            }
            SHM_CHECK(what.find("rank " + std::to_string(r) + " (pid") == std::string::npos,
                      "rank " << rank << " names live rank " << r << " by its pid: " << what);
          }
          break;
        } catch (const std::exception& e) {
          SHM_CHECK(false, "rank " << rank << " expected a PeerLostError, got " << demangle(typeid(e).name()) << ": "
                                   << e.what());
        }
        SHM_CHECK(at::allclose(v[0], at::full({16 * 1024}, static_cast<float>(world))), "round " << i);
      }
      destroy_process_group();
    });
    for (const std::string& f : failures) {
      if (f != "rank " + std::to_string(victim) + " was killed by signal 9") {
        ADD_FAILURE() << "world " << world << ", victim " << victim << ": " << f;
      }
    }
  }
}

// A rank dies while nobody is talking to it: no transport sees it (its host's other rank holds
// no pending work with it), the heartbeats do. Every survivor's group knows within 5 s, naming
// it, and then refuses new work with a PeerLostError; the dead rank's host-mate cleans its
// segment when it leaves.
TEST_F(DistHosts, ASilentDeathIsSeenByTheHeartbeats) {
  const std::string killed_at = file("silent_killed_at");
  const std::string method = "tcp://127.0.0.1:" + std::to_string(port_);
  const std::string learned = file("learned.");
  const std::vector<std::string> failures =
      run_sim_hosts({{HostView::kOwnShm, {0, 1}}, {HostView::kOwnShm, {2, 3}}}, [&](int rank) {
        init_process_group("shm", {.rank = rank, .world_size = 4, .init_method = method, .timeout = kGroupTimeout});
        auto* hosts = dynamic_cast<detail::ProcessGroupHosts*>(&default_group().backend());
        SHM_CHECK(hosts != nullptr, "not a world across hosts");
        if (rank == 3) {
          {
            std::ofstream f(killed_at + ".tmp");
            f << std::chrono::steady_clock::now().time_since_epoch().count();
          }
          std::filesystem::rename(killed_at + ".tmp", killed_at);
          ::raise(SIGKILL);
        }
        const auto start = std::chrono::steady_clock::now();
        while (!hosts->lost() && std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
        const std::optional<std::string> why = hosts->lost();
        SHM_CHECK(why && why->find("rank 3 (host 1) is gone") != std::string::npos, "lost: " << why.value_or("no"));
        std::ifstream f(killed_at);
        int64_t then = 0;
        SHM_CHECK(f >> then, "no kill time");
        const double seconds = static_cast<double>(now - then) * 1e-9;
        SHM_CHECK(seconds <= 5.0, "rank " << rank << " learned it after " << seconds << " s");
        std::vector<at::Tensor> v{at::ones({4})};
        SHM_CHECK_THROWS(PeerLostError, [&] { (void)default_group().backend().send(v, (rank + 1) % 3, 0); }, "rank 3");
        // Rank 0 serves the store: it leaves once every survivor learned (or the others would
        // learn of the store's end instead).
        std::ofstream(learned + std::to_string(rank)).put('1');
        for (int r = 0; r < 3; ++r) {
          while (!std::filesystem::exists(learned + std::to_string(r)) &&
                 std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        }
        destroy_process_group();
      });
  for (const std::string& f : failures) {
    if (f != "rank 3 was killed by signal 9") ADD_FAILURE() << f;
  }
}

// C++ and Python ranks in one world across two hosts (tests/python/hosts_rank.py): host A runs
// C++ rank 0 and Python rank 2, host B Python rank 1 and C++ rank 3; the C++ ranks make the same
// calls as the Python ones.
TEST_F(DistHosts, PythonAndCppRanksInOneWorld) {
  if (*TDSHM_TEST_PYTHON == '\0') GTEST_SKIP() << "no Python with the tdshm package in this build";
  const std::string port = std::to_string(port_);
  const std::string method = "tcp://127.0.0.1:" + port;
  const std::vector<std::string> failures =
      run_sim_hosts({{HostView::kOwnShm, {0, 2}}, {HostView::kOwnShm, {1, 3}}}, [&](int rank) {
        if (rank == 1 || rank == 2) {
          const std::string python = TDSHM_TEST_PYTHON;
          const std::string script = std::string(TDSHM_TEST_SCRIPTS) + "/hosts_rank.py";
          const std::string r = std::to_string(rank);
          ::setenv("PYTHONPATH", TDSHM_TEST_PYTHON_DIR, 1);
          ::setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
          ::execl(python.c_str(), python.c_str(), script.c_str(), r.c_str(), "4", port.c_str(), nullptr);
          throw std::runtime_error("cannot run " + python);
        }
        init_process_group("shm", {.rank = rank, .world_size = 4, .init_method = method, .timeout = kGroupTimeout});
        c10d::ProcessGroup& pg = default_group().backend();
        const int next = (rank + 1) % 4;
        const int prev = (rank + 3) % 4;
        std::vector<at::Tensor> out{at::full({4}, static_cast<float>(rank))};
        std::vector<at::Tensor> in{at::zeros({4})};
        auto sent = pg.send(out, next, 7);
        pg.recv(in, prev, 7)->wait();
        sent->wait();
        SHM_CHECK(at::equal(in[0], at::full({4}, static_cast<float>(prev))), "ring: " << in[0]);
        std::vector<at::Tensor> t{ranked(rank)};
        pg.allreduce(t)->wait();
        SHM_CHECK(at::allclose(t[0], ranked(0) + ranked(1) + ranked(2) + ranked(3)), "all_reduce: " << t[0]);
        std::vector<at::Tensor> b{at::arange(3, at::kFloat) * (rank + 1)};
        c10d::BroadcastOptions o;
        o.rootRank = 1;
        pg.broadcast(b, o)->wait();
        SHM_CHECK(at::equal(b[0], at::arange(3, at::kFloat) * 2), "broadcast: " << b[0]);
        pg.barrier()->wait();
        destroy_process_group();
      });
  for (const std::string& f : failures) ADD_FAILURE() << f;
}

}  // namespace
}  // namespace tdshm::test
