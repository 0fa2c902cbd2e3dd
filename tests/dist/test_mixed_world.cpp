// Mixed worlds: tdshm's C++ ranks and torch.distributed's Python ranks in ONE world, over gloo
// (tcp://, file://, env://; C++ or Python as rank 0, so either side serves the TCPStore) and
// over shm (the Python package tdshm registers the backend). Both sides use torch 1.13's store
// layout (group.cpp); a difference in any key would hang the rendezvous, the store-based barrier
// or the sequence number exchange, and end these tests with TimeoutError.
//
// Every rank is a child of the test: a C++ rank is forked and runs its scenario, a Python rank
// runs tests/python/mixed_rank.py, forked from a warm interpreter (dist/python_launcher.h), which
// runs the same scenario step by step (see there). Each group has a 20 s timeout, each
// Work::wait too, what is left after 90 s is killed, and the fixture's watchdog ends the test in
// the worst case. A Python rank's traceback goes to stderr; its exit status to the test.
//
// Also checked here: the checked-wire negotiation (InitOptions::checked_wire): two C++ ranks
// agree to it, a C++ rank and a Python rank never do, nor a C++ rank that turned it off.

#include <tdshm/distributed.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "dist/dist_support.h"
#include "dist/python_launcher.h"
#include "dist/python_paths.h"

namespace tdshm::test {
namespace {

constexpr std::chrono::seconds kWorldDeadline{90};

struct MixedCase {
  Method method;       // where the ranks meet (kGlooFile / kGlooTcp / kGlooEnv)
  std::string layout;  // one letter per global rank: 'C' C++, 'P' Python
  int unchecked = -1;  // a C++ rank that sets InitOptions::checked_wire = false
};

std::string case_name(const ::testing::TestParamInfo<MixedCase>& info) {
  std::string name = std::string(method_name(info.param.method)) + "_" + info.param.layout;
  if (info.param.unchecked >= 0) name += "_unchecked" + std::to_string(info.param.unchecked);
  return name;
}

std::string init_method_of(const Rendezvous& rv) {
  switch (rv.method) {
    case Method::kGlooFile: return "file://" + rv.file;
    case Method::kGlooTcp: return "tcp://127.0.0.1:" + std::to_string(rv.port);
    default: return "env://";
  }
}

/// Python rank `rank` of the world: mixed_rank.py with the scenario's arguments and environment.
PythonRun python_rank(const std::string& scenario, const std::string& backend, const Rendezvous& rv, int rank,
                      const std::string& layout) {
  const int world = static_cast<int>(layout.size());
  std::string rank_arg = std::to_string(rank);
  std::vector<std::string> env = {"GLOO_SOCKET_IFNAME=lo", "OMP_NUM_THREADS=1"};  // the loopback device, as ours
  if (rv.method == Method::kGlooEnv) {
    env.insert(env.end(), {"MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(rv.port),
                           "RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world)});
    rank_arg = "-1";  // torch reads RANK and WORLD_SIZE
  }
  if (*TDSHM_TEST_PYTHON_DIR != '\0') env.push_back(std::string("PYTHONPATH=") + TDSHM_TEST_PYTHON_DIR);
  return {std::string(TDSHM_TEST_SCRIPTS) + "/mixed_rank.py",
          {scenario, backend, init_method_of(rv), rank_arg, layout},
          environment_with(env),
          ""};
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  SHM_CHECK(work->wait(kGroupTimeout), what << " did not complete in time");
}

void expect_equal(const char* what, const at::Tensor& got, const at::Tensor& want) {
  SHM_CHECK(at::equal(got, want), what << ": got " << got << ", expected " << want);
}

/// The checked-wire verdicts of `group` on this rank: true exactly for the peers that are C++
/// ranks with checked_wire on, when this rank has it on too.
void check_negotiation(const Group& group, const MixedCase& c, int global_rank) {
  const bool me = c.unchecked != global_rank;
  bool all = true;
  for (int q = 0; q < group.size(); ++q) {
    const int g = group.global_rank(q);
    const bool peer = c.layout[static_cast<size_t>(g)] == 'C' && c.unchecked != g;
    all = all && peer;
    SHM_CHECK(group.checked_wire_with(q) == (me && peer), "global rank " << global_rank << " (layout " << c.layout
                                                                         << "): checked_wire_with(group rank " << q
                                                                         << ") is " << group.checked_wire_with(q));
  }
  SHM_CHECK(group.checked_wire_all() == all, "checked_wire_all is " << group.checked_wire_all());
}

/// The C++ side of mixed_rank.py's gloo_scenario, step by step.
void gloo_scenario(const MixedCase& c, int rank) {
  const int world = static_cast<int>(c.layout.size());
  const Group world_group = default_group();
  SHM_CHECK(world_group.rank() == rank && world_group.size() == world);
  check_negotiation(world_group, c, rank);
  c10d::ProcessGroup& pg = world_group.backend();

  // 1. Point to point in both directions.
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (rank == 0) {
    for (int r = 1; r < world; ++r) wait_work(post_send(pg, at::arange(10, f32) * r, r, r), "send");
    for (int r = 1; r < world; ++r) {
      const at::Tensor t = at::zeros({10}, f32);
      wait_work(post_recv(pg, t, r, 100 + r), "recv");
      expect_equal("reply", t, at::arange(10, f32) * r + r);
    }
  } else {
    const at::Tensor t = at::zeros({10}, f32);
    wait_work(post_recv(pg, t, 0, rank), "recv");
    expect_equal("message of rank 0", t, at::arange(10, f32) * rank);
    wait_work(post_send(pg, t + rank, 0, 100 + rank), "send");
  }
  // 2. all_reduce.
  {
    std::vector<at::Tensor> v{at::full({2, 3}, rank + 1, at::kLong)};
    wait_work(pg.allreduce(v), "all_reduce");
    expect_equal("all_reduce", v[0], at::full({2, 3}, world * (world + 1) / 2, at::kLong));
  }
  // 3. broadcast from the last rank, then a barrier.
  {
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    std::vector<at::Tensor> v{rank == world - 1 ? at::arange(5, f64) + 42 : at::zeros({5}, f64)};
    c10d::BroadcastOptions o;
    o.rootRank = world - 1;
    wait_work(pg.broadcast(v, o), "broadcast");
    expect_equal("broadcast", v[0], at::arange(5, f64) + 42);
    wait_work(pg.barrier(), "barrier");
  }
  // 4. new_group({0, world - 1}): the ranks between are non-members.
  const Group sub = new_group({0, world - 1});
  if (rank == 0 || rank == world - 1) {
    SHM_CHECK(sub.defined() && sub.size() == 2 && sub.rank() == (rank == 0 ? 0 : 1));
    check_negotiation(sub, c, rank);
    std::vector<at::Tensor> v{at::full({1}, rank + 1, at::kInt)};
    wait_work(sub.backend().allreduce(v), "subgroup all_reduce");
    expect_equal("subgroup all_reduce", v[0], at::full({1}, world + 1, at::kInt));
    if (rank == world - 1) {
      wait_work(post_send(sub.backend(), at::tensor({7.0F, 8.0F}), 0, 5), "subgroup send");
    } else {
      const at::Tensor t = at::zeros({2});
      wait_work(post_recv(sub.backend(), t, 1, 5), "subgroup recv");
      expect_equal("subgroup message", t, at::tensor({7.0F, 8.0F}));
    }
  } else {
    SHM_CHECK(!sub.defined() && sub.is_non_member(), "a non-member got a group");
  }
  // 5. A subgroup of everyone.
  std::vector<int> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
  const Group everyone = new_group(all);
  check_negotiation(everyone, c, rank);
  wait_work(everyone.backend().barrier(), "subgroup barrier");
  wait_work(pg.barrier(), "final barrier");
  destroy_process_group();
}

/// The C++ side of mixed_rank.py's shm_scenario.
void shm_scenario(int rank, int world) {
  const Group world_group = default_group();
  SHM_CHECK(world_group.backend_name() == "shm" && world_group.rank() == rank && world_group.size() == world);
  for (int q = 0; q < world; ++q) SHM_CHECK(!world_group.checked_wire_with(q), "checked wire over shm");
  c10d::ProcessGroup& pg = world_group.backend();
  const std::vector<std::pair<at::ScalarType, std::vector<int64_t>>> shapes = {
      {at::kFloat, {3, 4}}, {at::kLong, {5}}, {at::kByte, {2, 2, 2}}, {at::kDouble, {}}};
  for (size_t step = 0; step < shapes.size(); ++step) {
    const auto& [dtype, shape] = shapes[step];
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const at::Tensor ref = (at::arange(n, at::kLong) % 100).to(dtype).reshape(shape);
    const int tag = static_cast<int>(step);
    if (rank == 0) {
      for (int r = 1; r < world; ++r) {
        wait_work(post_send(pg, ref, r, tag), "send");
        const at::Tensor back = at::zeros_like(ref);
        wait_work(post_recv(pg, back, r, tag), "recv");
        expect_equal("sent back doubled", back, ref * 2);
      }
    } else {
      const at::Tensor t = at::zeros_like(ref);
      wait_work(post_recv(pg, t, 0, tag), "recv");
      expect_equal("from rank 0", t, ref);
      wait_work(post_send(pg, t * 2, 0, tag), "send");
    }
  }
  {
    std::vector<at::Tensor> v{rank == 0 ? at::arange(6, at::kFloat) : at::zeros({6})};
    wait_work(pg.broadcast(v), "broadcast");
    expect_equal("broadcast", v[0], at::arange(6, at::kFloat));
  }
  std::vector<int> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
  const Group sub = new_group(all);
  SHM_CHECK(sub.backend_name() == "shm");
  {
    std::vector<at::Tensor> v{rank == world - 1 ? at::tensor({3, 1, 4}, at::kLong) : at::zeros({3}, at::kLong)};
    c10d::BroadcastOptions o;
    o.rootRank = world - 1;
    wait_work(sub.backend().broadcast(v, o), "subgroup broadcast");
    expect_equal("subgroup broadcast", v[0], at::tensor({3, 1, 4}, at::kLong));
  }
  wait_work(sub.backend().barrier(), "subgroup barrier");
  wait_work(pg.barrier(), "final barrier");
  destroy_process_group();
}

class MixedTest : public DistTest {
 protected:
  void SetUp() override {
    DistTest::SetUp();
    if (std::string(TDSHM_TEST_PYTHON).empty() || ::access(TDSHM_TEST_PYTHON, X_OK) != 0) {
      GTEST_SKIP() << "no Python interpreter with torch was found at configure time";
    }
    set_deadline(kWorldDeadline + std::chrono::seconds(30));
  }

  /// Runs one world: C++ ranks run `cpp(rank)` in forked children, Python ranks mixed_rank.py
  /// `scenario` (started first, from the warm interpreter). One deadline for all; when a C++
  /// rank failed, the Python ranks get 3 s more before they are killed (they would wait for it).
  void run_world(const std::string& scenario, const std::string& backend, const Rendezvous& rv,
                 const std::string& layout, const std::function<void(int)>& cpp) {
    const auto deadline = Clock::now() + kWorldDeadline;
    std::vector<std::pair<int, Child>> python;
    for (size_t rank = 0; rank < layout.size(); ++rank) {
      if (layout[rank] != 'P') continue;
      const int r = static_cast<int>(rank);
      python.emplace_back(r, start_python(TDSHM_TEST_PYTHON, python_rank(scenario, backend, rv, r, layout)));
    }
    const std::vector<std::string> failures = run_ranks(
        Peers::kProcesses, static_cast<int>(layout.size()),
        [&](int rank) {
          if (layout[static_cast<size_t>(rank)] != 'P') cpp(rank);
        },
        kWorldDeadline);
    SHM_EXPECT_RANKS_OK(failures);
    const auto python_deadline = failures.empty() ? deadline : std::min(deadline, Clock::now() + 3s);
    for (auto& [rank, child] : python) {
      child.wait(std::max<Clock::duration>(python_deadline - Clock::now(), Clock::duration::zero()));
      if (!child.ok()) ADD_FAILURE() << "Python rank " << rank << ": " << child.describe();
    }
  }
};

class MixedGloo : public MixedTest, public ::testing::WithParamInterface<MixedCase> {};

TEST_P(MixedGloo, OneWorldOfCppAndPythonRanks) {
  const MixedCase c = GetParam();
  const Rendezvous rv = rendezvous(c.method);
  run_world("gloo", "gloo", rv, c.layout, [&](int rank) {
    InitOptions o = init_options(rv, rank, static_cast<int>(c.layout.size()));
    o.checked_wire = c.unchecked != rank;
    init_process_group("gloo", o);
    gloo_scenario(c, rank);
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, MixedGloo,
                         ::testing::Values(MixedCase{Method::kGlooTcp, "CP"}, MixedCase{Method::kGlooTcp, "PC"},
                                           MixedCase{Method::kGlooTcp, "PCC"}, MixedCase{Method::kGlooTcp, "CPCP"},
                                           MixedCase{Method::kGlooFile, "CP"}, MixedCase{Method::kGlooFile, "PCC"},
                                           MixedCase{Method::kGlooFile, "CCP"}, MixedCase{Method::kGlooEnv, "CP"},
                                           MixedCase{Method::kGlooEnv, "PCPC"},
                                           // C++ only: the negotiation, with one rank opting out.
                                           MixedCase{Method::kGlooTcp, "CC"}, MixedCase{Method::kGlooFile, "CCC", 2}),
                         case_name);

/// The segments of groups made through a store ("tdshm.pg-*", see shm_store.cpp) now in /dev/shm.
std::set<std::string> store_segments() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tdshm.pg-", 0) == 0) out.insert(name);
  }
  return out;
}

/// Whether the process named in a store segment's name ("tdshm.pg-<pid>-...") runs.
bool store_creator_alive(const std::string& name) {
  const size_t at = std::string("tdshm.pg-").size();
  const size_t end = name.find('-', at);
  if (end == std::string::npos || end == at ||
      !std::all_of(name.begin() + static_cast<std::ptrdiff_t>(at), name.begin() + static_cast<std::ptrdiff_t>(end),
                   [](char ch) { return ch >= '0' && ch <= '9'; })) {
    return false;
  }
  const pid_t pid = static_cast<pid_t>(std::stol(name.substr(at, end - at)));
  return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM);
}

class MixedShm : public MixedTest, public ::testing::WithParamInterface<MixedCase> {};

TEST_P(MixedShm, OneShmWorldOfCppAndPythonRanks) {
  if (std::string(TDSHM_TEST_PYTHON_DIR).empty()) GTEST_SKIP() << "the Python package tdshm is not built";
  const MixedCase c = GetParam();
  const Rendezvous rv = rendezvous(c.method);
  const int world = static_cast<int>(c.layout.size());
  const std::set<std::string> before = store_segments();
  run_world("shm", "shm", rv, c.layout, [&](int rank) {
    InitOptions o = init_options(rv, rank, world);
    o.shm = ShmOptions{};  // the Python ranks use the defaults: one segment geometry for all
    init_process_group("shm", o);
    shm_scenario(rank, world);
  });
  for (const std::string& name : store_segments()) {
    // Another test running beside this one may have a group of its own: a segment whose creator
    // (the pid in its name, shm_store.cpp) still runs is not this world's (its ranks have exited).
    if (before.count(name) == 1 || store_creator_alive(name)) continue;
    ADD_FAILURE() << "/dev/shm/" << name << " was left behind";
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, MixedShm,
                         ::testing::Values(MixedCase{Method::kGlooFile, "CP"}, MixedCase{Method::kGlooFile, "PC"},
                                           MixedCase{Method::kGlooTcp, "PCC"}, MixedCase{Method::kGlooEnv, "CP"}),
                         case_name);

}  // namespace
}  // namespace tdshm::test
