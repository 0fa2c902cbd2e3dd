#pragma once
// Helpers of the process-group tests (tdshm_dist_tests): where the ranks of a group meet
// (Method, Rendezvous, init_options), meeting points between forked children outside tdshm
// (Flags, wait_until, finish), and the DistTest fixture that hands out unique rendezvous points.
//
// The default group is process-global, so ranks are forked processes (run_ranks with
// Peers::kProcesses), never threads. Scenarios run in the children and check with SHM_CHECK; the
// parent only prepares the rendezvous points and collects the outcome.

#include <tdshm/distributed.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "shm/shm_test_support.h"

namespace tdshm::test {

/// Deadline of every group (rendezvous and waits) and of every Work::wait in the scenarios.
inline constexpr std::chrono::milliseconds kGroupTimeout{20000};

// ---------------------------------------------------------------------------------------------
// Rendezvous points

enum class Method { kShm, kGlooFile, kGlooTcp, kGlooEnv };

const char* method_name(Method m);
/// "shm" for kShm, "gloo" for the others.
std::string backend_of(Method m);

/// A port of 127.0.0.1 that was free a moment ago (bound to port 0, read back, closed). Another
/// process could take it before the test binds it; it comes from the ephemeral range, so that
/// is rare, and the failure would be a clear "address in use".
uint16_t free_port();

/// A fresh directory under /tmp, removed with everything in it.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Where the ranks of one group meet. Made in the parent before the fork, so that every rank
/// sees the same point, and unique to the test.
struct Rendezvous {
  Method method = Method::kShm;
  std::string shm_name;  // kShm
  std::string file;      // kGlooFile
  uint16_t port = 0;     // kGlooTcp, kGlooEnv
};

/// The options of init_process_group for `rank` of `world` at `rv` (timeout kGroupTimeout, small
/// shm rings). For env:// it sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE in this (child)
/// process and leaves rank and world_size at -1, so they are read from the environment.
InitOptions init_options(const Rendezvous& rv, int rank, int world);

/// A store made by the user, as for a standalone group (gloo_group_from_store): a FileStore at
/// rv.file (kGlooFile), or a TCPStore at rv.port served by rank 0 behind a PrefixStore `prefix`
/// (kGlooTcp, kGlooEnv). Throws std::invalid_argument for kShm.
c10::intrusive_ptr<c10d::Store> user_store(const Rendezvous& rv, int rank, int world, const std::string& prefix);

// ---------------------------------------------------------------------------------------------
// Meeting points between the children, outside tdshm (in a Shared<Flags>)

struct Flags {
  std::atomic<int> done;         // ranks that finished their part of the scenario
  std::atomic<int> returned[2];  // set by a non-member once its new_group call returned
  std::atomic<int> step[4];      // free counters for a scenario's own hand-offs
  std::atomic<int> failed;       // ranks that threw (see counting_failures)
};

/// Waits until `value` reaches `at_least`, at most kGroupTimeout (CheckFailure after that). With
/// `failed`, stops at once (CheckFailure) when another rank has failed: it will never arrive.
void wait_until(const std::atomic<int>& value, int at_least, const char* what,
                const std::atomic<int>* failed = nullptr);

/// The end of a scenario: every rank is done with every group before any tears its groups down.
/// (With tcp:// and env:// rank 0 serves the store; peers of gloo groups must not vanish while
/// others still wait on them.) Gives up at once when a rank has failed (flags.failed).
void finish(Flags& flags, int world);

/// `body` for run_ranks, counting a rank that throws in flags.failed before rethrowing, so that
/// the other ranks stop waiting for it in wait_until(..., &flags.failed) and finish.
std::function<void(int)> counting_failures(Flags& flags, std::function<void(int)> body);

// ---------------------------------------------------------------------------------------------
// Fixture

/// ShmTest (watchdog, unique segment names, /dev/shm left clean) plus unique rendezvous points:
/// a segment name, a store file in a temporary directory of the test, or a free port.
class DistTest : public ShmTest {
 protected:
  Rendezvous rendezvous(Method m);
  /// A free port that this test has not handed out yet (the ports of one test must differ: a
  /// store's port may still be in use when the next group starts).
  uint16_t distinct_free_port();
  /// Runs `scenario` in `world` real processes, each in the default group of `m` (init_options,
  /// then `adjust` when given), then finish(); expects every rank to end well.
  void run_default_world(Method m, int world, const std::function<void(int, Flags&)>& scenario,
                         const std::function<void(int, InitOptions&)>& adjust = {});
  /// A file name in the test's temporary directory.
  std::string file(const std::string& name) const { return dir_.path() + "/" + name; }

  TempDir dir_;
  int files_ = 0;
  std::set<uint16_t> ports_;
};

/// The name of a test parameterized by Method: "shm", "gloo_file", ...
std::string param_name(const ::testing::TestParamInfo<Method>& info);

}  // namespace tdshm::test
