// Process groups (distributed.h) over real processes: init_process_group for "shm" (shm://) and
// "gloo" (file://, tcp://, env://), the default group's accessors, a send/recv through it,
// destroy then init again, new_group with a rank outside the group, standalone gloo groups
// built from a store, and the errors of each.
//
// The default group is process-global, so ranks are forked processes, never threads. Scenarios
// run in the children and check with SHM_CHECK; the parent only prepares the rendezvous points
// (unique segment names, files in a temporary directory, free ports) and collects the outcome.
// Children meet outside tdshm through counters in shared memory (Shared<Flags>), always with a
// deadline.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tdshm/distributed.h>
#include <tdshm/errors.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>  // mkdtemp, setenv, unsetenv
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "dist/dist_support.h"
#include "shm/shm_test_support.h"

namespace tdshm::test {
namespace {

/// Counts this rank as done and waits until all `world` ranks are (see finish()).
void all_done(Flags& flags, int world) {
  flags.done.fetch_add(1, std::memory_order_acq_rel);
  wait_until(flags.done, world, "every rank to finish");
}

// ---------------------------------------------------------------------------------------------
// Transfers

/// Group rank `from` sends a pattern tensor (seeded by `seed`) to group rank `to` through `pg`;
/// `to` checks every byte. Other ranks do nothing.
void transfer(c10d::ProcessGroup& pg, int from, int to, uint64_t seed, int tag) {
  const at::Tensor values = pattern(at::kFloat, 3000, seed);  // 12 KB: several shm slots
  if (pg.getRank() == from) {
    SHM_CHECK(post_send(pg, values, to, tag)->wait(kGroupTimeout), "send to " << to << " did not complete");
  } else if (pg.getRank() == to) {
    const at::Tensor received = at::zeros_like(values);
    SHM_CHECK(post_recv(pg, received, from, tag)->wait(kGroupTimeout), "recv from " << from << " did not complete");
    SHM_CHECK(same_bytes(received, values),
              "group rank " << to << " received other values from " << from << " (tag " << tag << ")");
  }
}

/// Group ranks a and b send to each other, one way then the other.
void ping_pong(c10d::ProcessGroup& pg, int a, int b, uint64_t seed, int tag) {
  transfer(pg, a, b, seed, tag);
  transfer(pg, b, a, seed + 1, tag + 1);
}

// ---------------------------------------------------------------------------------------------
// Fixtures

class GroupsTest : public DistTest {
 protected:
  /// Forks `world` ranks that init_process_group at a fresh rendezvous of `m`, run body(rank,
  /// flags), wait for one another and destroy the default group.
  void run_in_world(Method m, int world, const std::function<void(int, Flags&)>& body) {
    const Rendezvous rv = rendezvous(m);
    Shared<Flags> flags;
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, world, [&](int rank) {
      init_process_group(backend_of(m), init_options(rv, rank, world));
      body(rank, *flags);
      finish(*flags, world);
    }));
  }
};

class DistGroups : public GroupsTest, public ::testing::WithParamInterface<Method> {};
class DistErrors : public GroupsTest, public ::testing::WithParamInterface<Method> {};
class DistStandalone : public GroupsTest, public ::testing::WithParamInterface<Method> {};
class DistErrorsArgs : public GroupsTest {};

const auto kAllMethods = ::testing::Values(Method::kShm, Method::kGlooFile, Method::kGlooTcp, Method::kGlooEnv);

// ---------------------------------------------------------------------------------------------
// init_process_group, the default group, destroy, init again

TEST_P(DistGroups, InitSendRecvDestroyAndInitAgain) {
  const Method m = GetParam();
  const Rendezvous first = rendezvous(m);
  const Rendezvous second = rendezvous(m);
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int rank) {
    SHM_CHECK(!is_initialized());
    Group world = init_process_group(backend_of(m), init_options(first, rank, 2));
    SHM_CHECK(is_initialized());
    SHM_CHECK(get_rank() == rank, "get_rank() " << get_rank());
    SHM_CHECK(get_world_size() == 2, "get_world_size() " << get_world_size());

    const Group g = default_group();
    SHM_CHECK(g.defined() && g.registered());
    SHM_CHECK(g.backend_ptr().get() == world.backend_ptr().get(), "default_group() is not the group init returned");
    SHM_CHECK(g.backend_name() == backend_of(m), "backend_name() " << g.backend_name());
    SHM_CHECK(g.rank() == rank && g.size() == 2);
    SHM_CHECK((g.global_ranks() == std::vector<int>{0, 1}));
    SHM_CHECK(g.group_rank(1) == 1 && g.global_rank(0) == 0);
    ping_pong(default_group().backend(), 0, 1, 10, 3);

    destroy_process_group();
    SHM_CHECK(!is_initialized());
    SHM_CHECK_THROWS(
        Error, [] { default_group(); }, "not initialized");
    SHM_CHECK_THROWS(
        Error, [] { get_rank(); }, "not initialized");
    SHM_CHECK_THROWS(
        Error, [] { get_world_size(); }, "not initialized");
    SHM_CHECK_THROWS(
        Error,
        [] {
          new_group({0, 1});
        },
        "not initialized");
    // A Group the user still holds keeps its backend alive after destroy_process_group.
    ping_pong(world.backend(), 1, 0, 20, 5);
    world = Group{};

    Group again = init_process_group(backend_of(m), init_options(second, rank, 2));
    SHM_CHECK(get_rank() == rank && get_world_size() == 2);
    ping_pong(again.backend(), 0, 1, 30, 7);
    finish(*flags, 2);
  }));
}

// ---------------------------------------------------------------------------------------------
// new_group

// World of 3. Group A = new_group({2, 0}) (rank 1 is outside), then group B = new_group({1, 2})
// (rank 0 is outside). Each non-member's call must return at once: the members only enter
// new_group after the non-member's call has returned (so a blocking non-member would time out).
TEST_P(DistGroups, NewGroupWithARankOutside) {
  const Method m = GetParam();
  run_in_world(m, 3, [&](int rank, Flags& flags) {
    // Group A: members 2 and 0, in that order (group rank 0 is global rank 2).
    if (rank == 1) {
      const Group a = new_group({2, 0});
      SHM_CHECK(!a.defined() && !a.registered(), "a non-member got a defined group");
      SHM_CHECK_THROWS(
          Error, [&] { a.backend(); }, "not defined");
      SHM_CHECK_THROWS(
          Error, [&] { a.rank(); }, "not defined");
      // Unlike "no group", it is refused by transfers (as torch refuses NON_GROUP_MEMBER), before
      // any message.
      SHM_CHECK(a.is_non_member() && !Group{}.is_non_member());
      TensorDict td({{"x", at::ones({1})}}, {1});
      SHM_CHECK_THROWS(
          Error, [&] { td.send({.dst = 0, .group = a}); }, "not a member");
      SHM_CHECK_THROWS(
          Error, [&] { td.recv({.src = 0, .group = a}); }, "not a member");
      flags.returned[0].store(1, std::memory_order_release);
    } else {
      wait_until(flags.returned[0], 1, "the non-member of group A to return from new_group");
      const Group a = new_group({2, 0});
      SHM_CHECK(a.defined() && a.registered());
      SHM_CHECK(a.backend_name() == backend_of(m));
      SHM_CHECK(a.size() == 2, "size " << a.size());
      SHM_CHECK((a.global_ranks() == std::vector<int>{2, 0}));
      SHM_CHECK(a.rank() == (rank == 2 ? 0 : 1), "group rank " << a.rank() << " on global rank " << rank);
      SHM_CHECK(a.group_rank(2) == 0 && a.group_rank(0) == 1);
      SHM_CHECK(a.global_rank(0) == 2 && a.global_rank(1) == 0);
      SHM_CHECK_THROWS(
          Error, [&] { a.group_rank(1); }, "not a member");
      SHM_CHECK_THROWS(
          Error, [&] { a.global_rank(2); }, "outside");
      SHM_CHECK_THROWS(
          Error, [&] { a.global_rank(-1); }, "outside");
      ping_pong(a.backend(), 0, 1, 40, 11);
      // The default group is untouched by the subgroup.
      SHM_CHECK(get_rank() == rank && get_world_size() == 3);
    }

    // Group B: members 1 and 2.
    if (rank == 0) {
      SHM_CHECK(!new_group({1, 2}).defined(), "a non-member got a defined group");
      flags.returned[1].store(1, std::memory_order_release);
    } else {
      wait_until(flags.returned[1], 1, "the non-member of group B to return from new_group");
      const Group b = new_group({1, 2});
      SHM_CHECK(b.defined() && b.size() == 2 && b.rank() == rank - 1);
      SHM_CHECK(b.group_rank(1) == 0 && b.global_rank(1) == 2);
      ping_pong(b.backend(), 1, 0, 50, 13);
    }
  });
}

TEST_P(DistGroups, NewGroupRejectsBadRanks) {
  run_in_world(GetParam(), 2, [](int rank, Flags&) {
    SHM_CHECK_THROWS(
        Error, [] { new_group({}); }, "empty");
    SHM_CHECK_THROWS(
        Error,
        [] {
          new_group({0, 1, 0});
        },
        "rank 0", "twice");
    SHM_CHECK_THROWS(
        Error,
        [] {
          new_group({0, 2});
        },
        "rank 2", "outside");
    SHM_CHECK_THROWS(
        Error,
        [] {
          new_group({-1, 0});
        },
        "rank -1", "outside");
    // Refused calls take no group number: the next valid call still meets on every rank.
    const Group g = new_group({1, 0});
    SHM_CHECK(g.defined() && g.rank() == 1 - rank);
    ping_pong(g.backend(), 0, 1, 60, 17);
  });
}

INSTANTIATE_TEST_SUITE_P(Methods, DistGroups, kAllMethods, param_name);

// ---------------------------------------------------------------------------------------------
// Errors

// Bad arguments are refused before anything starts (no segment, no store, no socket).
// gloo writes to its sockets without MSG_NOSIGNAL: a survivor writing to a dead peer's connection
// would die of SIGPIPE. Making a gloo group ignores SIGPIPE where it has its default disposition
// (as Python does from its start), and leaves a program's own handler alone.
void count_sigpipe(int) {}

TEST_F(DistErrorsArgs, AGlooGroupIgnoresSigpipeUnlessTheProgramHandlesIt) {
  run_default_world(
      Method::kGlooFile, 2,
      [](int rank, Flags&) {
        struct sigaction now {};
        SHM_CHECK(::sigaction(SIGPIPE, nullptr, &now) == 0, "sigaction: " << std::strerror(errno));
        if (rank == 0) {
          SHM_CHECK(now.sa_handler == SIG_IGN, "rank 0: SIGPIPE is not ignored after init_process_group(\"gloo\")");
        } else {
          SHM_CHECK(now.sa_handler == &count_sigpipe, "rank 1: the program's own SIGPIPE handler was replaced");
        }
      },
      [](int rank, InitOptions&) {  // before init_process_group, in each rank's process
        struct sigaction want {};
        want.sa_handler = rank == 0 ? SIG_DFL : &count_sigpipe;
        ::sigemptyset(&want.sa_mask);
        SHM_CHECK(::sigaction(SIGPIPE, &want, nullptr) == 0, "sigaction: " << std::strerror(errno));
      });
}

TEST_F(DistErrorsArgs, BadArguments) {
  const std::string name = unique_name();
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 1, [&](int) {
    ::unsetenv("RANK");
    ::unsetenv("WORLD_SIZE");
    ::unsetenv("MASTER_ADDR");
    ::unsetenv("MASTER_PORT");
    const auto refused = [](const std::string& backend, const InitOptions& o, const std::vector<std::string>& needles) {
      try {
        check_throws<Error>(
            __FILE__, __LINE__, [&] { init_process_group(backend, o); }, needles);
      } catch (const CheckFailure& e) {
        throw CheckFailure(std::string(e.what()) + " [backend \"" + backend + "\", init_method \"" + o.init_method +
                           "\", rank " + std::to_string(o.rank) + ", world_size " + std::to_string(o.world_size) + "]");
      }
      SHM_CHECK(!is_initialized(), "a refused init_process_group left a default group");
    };
    const std::string shm = "shm://" + name;
    refused("nccl", {.rank = 0, .world_size = 1, .init_method = shm}, {"unknown backend", "nccl"});
    // shm accepts torch's store rendezvous too (tcp://, file://, env://): env:// needs its variables.
    refused("shm", {.rank = 0, .world_size = 1, .init_method = "env://"}, {"MASTER_ADDR", "MASTER_PORT"});
    refused("shm", {.rank = 0, .world_size = 1, .init_method = "ftp://x"}, {"malformed", "unknown scheme"});
    refused("shm", {.rank = 0, .world_size = 1, .init_method = "shm://"}, {"empty"});
    SHM_CHECK_THROWS(SegmentError,
                     [] { init_process_group("shm", {.rank = 0, .world_size = 1, .init_method = "shm://a b"}); });
    for (const char* method :
         {"tcp://127.0.0.1", "tcp://:29500", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://127.0.0.1:29x",
          "tcp://::1:29500", "udp://127.0.0.1:29500", "file://", "shm://x"}) {
      refused("gloo", {.rank = 0, .world_size = 1, .init_method = method}, {method});
    }
    refused("gloo", {.rank = 0, .world_size = 1, .init_method = "tcp://127.0.0.1"}, {"tcp://HOST:PORT", "file://PATH"});
    refused("gloo", {.rank = 0, .world_size = 1, .init_method = "udp://h:1"}, {"unknown scheme", "env://"});
    refused("gloo", {.rank = 0, .world_size = 1, .init_method = "env://"}, {"MASTER_ADDR", "MASTER_PORT"});
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", "http", 1);
    refused("gloo", {.rank = 0, .world_size = 1, .init_method = "env://"}, {"MASTER_PORT", "http"});

    // Rank and world size (checked before any rendezvous, for both backends).
    for (const std::string backend : {"shm", "gloo"}) {
      const std::string method = backend == "shm" ? shm : "tcp://127.0.0.1:1";
      refused(backend, {.rank = 2, .world_size = 2, .init_method = method}, {"rank 2", "[0, 2)"});
      refused(backend, {.rank = -3, .world_size = 2, .init_method = method}, {"rank -3"});
      refused(backend, {.rank = 0, .world_size = 0, .init_method = method}, {"world_size", "at least 1"});
      refused(backend, {.rank = -1, .world_size = 2, .init_method = method}, {"RANK", "not set"});
      refused(backend, {.rank = 0, .world_size = -1, .init_method = method}, {"WORLD_SIZE", "not set"});
      ::setenv("RANK", "one", 1);
      refused(backend, {.rank = -1, .world_size = 2, .init_method = method}, {"RANK", "one", "not an integer"});
      ::unsetenv("RANK");
    }
    SHM_CHECK_THROWS(
        Error, [] { gloo_group_from_store({}, 0, 1); }, "null");
  }));
}

// A second init_process_group without destroy is refused and leaves the first group working;
// new_group on a world of one; destroy, then init again.
TEST_P(DistErrors, SecondInitIsRefused) {
  const Method m = GetParam();
  const Rendezvous first = rendezvous(m);
  const Rendezvous second = rendezvous(m);
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 1, [&](int rank) {
    const Group g = init_process_group(backend_of(m), init_options(first, rank, 1));
    SHM_CHECK_THROWS(
        Error, [&] { init_process_group(backend_of(m), init_options(first, rank, 1)); }, "already initialized",
        "destroy_process_group");
    SHM_CHECK_THROWS(
        Error, [&] { init_process_group(backend_of(m), init_options(second, rank, 1)); }, "already initialized");
    SHM_CHECK_THROWS(
        Error, [&] { init_process_group("nccl", {}); }, "already initialized");
    SHM_CHECK(is_initialized() && default_group().backend_ptr().get() == g.backend_ptr().get());
    SHM_CHECK(get_rank() == 0 && get_world_size() == 1);
    const Group sub = new_group({0});
    SHM_CHECK(sub.defined() && sub.size() == 1 && sub.global_rank(0) == 0);
    SHM_CHECK(sub.backend_ptr().get() != g.backend_ptr().get());
    destroy_process_group();
    destroy_process_group();  // twice is harmless
    const Group again = init_process_group(backend_of(m), init_options(second, rank, 1));
    SHM_CHECK(again.backend_ptr().get() != g.backend_ptr().get());
    destroy_process_group();
  }));
}

// Only one rank of 2 arrives (rank 0, which serves the TCPStore, or rank 1, a client of it):
// init_process_group ends with TimeoutError, not after the deadline. A TCPStore client gives up
// early: c10d 1.13 counts its connect timeout in whole seconds and retries a refused connection
// only while a further second fits, so with 1.5 s it stops at the first refusal.
TEST_P(DistErrors, MissingPeerTimesOut) {
  const Method m = GetParam();
  constexpr std::chrono::milliseconds kTimeout{1500};
  for (const int lone : {0, 1}) {
    const Rendezvous rv = rendezvous(m);
    const bool early = lone == 1 && (m == Method::kGlooTcp || m == Method::kGlooEnv);
    SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 1, [&](int) {
      InitOptions o = init_options(rv, lone, 2);
      o.timeout = kTimeout;
      const auto start = Clock::now();
      const Caught c = SHM_CHECK_THROWS(TimeoutError, [&] { init_process_group(backend_of(m), o); });
      const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
      SHM_CHECK((early || elapsed >= kTimeout - std::chrono::milliseconds(100)) &&
                    elapsed < kTimeout + std::chrono::seconds(5),
                "rank " << lone << " gave up after " << elapsed.count() << " ms: " << c.what);
      SHM_CHECK(m == Method::kShm || contains_nocase(c.what, "did not all arrive within 1500 ms"), c.what);
      SHM_CHECK(!is_initialized());
    }));
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, DistErrors, kAllMethods, param_name);

// ---------------------------------------------------------------------------------------------
// Standalone gloo groups

// A gloo group from a store the user made (a FileStore, or a TCPStore behind a PrefixStore): never
// registered, so it knows no global ranks; its own ranks work through the backend.
TEST_P(DistStandalone, GlooGroupFromStore) {
  const Method m = GetParam();
  const Rendezvous rv = rendezvous(m);
  Shared<Flags> flags;
  SHM_EXPECT_RANKS_OK(run_ranks(Peers::kProcesses, 2, [&](int rank) {
    c10::intrusive_ptr<c10d::Store> store;
    if (m == Method::kGlooFile) {
      store = c10::make_intrusive<c10d::FileStore>(rv.file, 2);
    } else {
      c10d::TCPStoreOptions so;
      so.port = rv.port;
      so.isServer = rank == 0;
      so.numWorkers = 2;
      so.timeout = kGroupTimeout;
      store =
          c10::make_intrusive<c10d::PrefixStore>("standalone/", c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so));
    }
    SHM_CHECK_THROWS(
        Error, [&] { gloo_group_from_store(store, 2, 2); }, "rank 2", "[0, 2)");
    const Group g = gloo_group_from_store(store, rank, 2, kGroupTimeout);
    SHM_CHECK(g.defined() && !g.registered() && g.global_ranks().empty());
    SHM_CHECK(!is_initialized(), "a standalone group became the default group");
    SHM_CHECK(g.backend_name() == "gloo" && g.rank() == rank && g.size() == 2);
    SHM_CHECK_THROWS(
        Error, [&] { g.group_rank(0); }, "standalone", "group_dst");
    SHM_CHECK(g.global_rank(1) == 1, "a standalone group's global_rank is the identity");
    SHM_CHECK_THROWS(
        Error, [&] { g.global_rank(2); }, "outside");
    // Group's own checks of its arguments.
    SHM_CHECK_THROWS(
        Error, [] { Group{c10::intrusive_ptr<c10d::ProcessGroup>()}; }, "null");
    SHM_CHECK_THROWS(
        Error, [&] { Group(g.backend_ptr(), {0}); }, "1 global ranks", "size 2");
    SHM_CHECK_THROWS(
        Error,
        [&] {
          Group(g.backend_ptr(), {3, 3});
        },
        "twice");
    SHM_CHECK_THROWS(
        Error,
        [&] {
          Group(g.backend_ptr(), {-1, 0});
        },
        "negative");
    ping_pong(g.backend(), 0, 1, 70, 19);
    all_done(*flags, 2);
  }));
}

INSTANTIATE_TEST_SUITE_P(Stores, DistStandalone, ::testing::Values(Method::kGlooFile, Method::kGlooTcp), param_name);

}  // namespace
}  // namespace tdshm::test
