// `tdshm demo`: the two seed scenarios of the tensordict API pages, as two real processes.
//
//  1. TensorDictBase.isend: rank 1 sends the seed tensordict {("a","b"): randn(2), "c": randn(2,3),
//     "_": ones(2,1,5)} with isend(dst=0); rank 0 receives into zeros with
//     irecv(src=1, return_premature=True), waits the works, and checks (td != 0).all().
//  2. TensorDictBase.init_remote: rank 0 builds {("a","b"): ones(2), "c": ones(2),
//     ("d","e","f"): MemoryMappedTensor ones(2,2)} expanded to [1, 2] and made contiguous, and
//     calls init_remote(dst=1); rank 1 calls from_remote_init(src=0) and checks the keys
//     {"a","c","d"} and that every value is 1.
//
// The parent forks both ranks before LibTorch starts any thread, waits for them with a deadline
// (killing them past it) and exits non-zero unless both ranks' checks passed.

#include "demo.h"

#include "common/loopback_port.h"

#include <tdshm/distributed.h>
#include <tdshm/memmap.h>
#include <tdshm/tensordict.h>

#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace tdshm::tools {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kDeadline = std::chrono::seconds(60);  // the whole demo; a rank that hangs is killed
constexpr int kTimedRounds = 200;                     // round trips timed after the checked transfer

int failures = 0;

void check(int rank, bool ok, const std::string& what) {
  std::printf("[rank %d]   [%s] %s\n", rank, ok ? " ok " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

std::string values(const TensorDict& td) {
  std::string out;
  for (const auto& k : td.sorted_leaf_keys()) {
    const at::Tensor t = td.get(k).flatten();
    out += "    " + k.str() + " " + std::string(c10::toString(t.scalar_type())) + " [";
    for (int64_t i = 0; i < t.numel(); ++i) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.3f", i ? ", " : "", t[i].item<double>());
      out += buf;
    }
    out += "]\n";
  }
  return out;
}

double median_us(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

TensorDict seed_isend_td(bool zeros) {
  auto make = [&](at::IntArrayRef shape) { return zeros ? at::zeros(shape) : at::randn(shape); };
  return TensorDict({{{"a", "b"}, make({2})}, {"c", make({2, 3})}, {"_", zeros ? at::zeros({2, 1, 5}) : at::ones({2, 1, 5})}},
                    {2});
}

/// Scenario 1, then kTimedRounds round trips (1 → 0 → 1) of the same tree, timed on rank 1.
void isend_scenario(int rank) {
  std::printf("[rank %d] scenario 1: TensorDictBase.isend / irecv\n", rank);
  std::fflush(stdout);
  if (rank == 1) {
    TensorDict td = seed_isend_td(false);
    const Transfer t = td.isend({.dst = 0});
    check(rank, t.last_tag == 2, "isend(dst=0) returned the last tag, 2 (tags 0, 1, 2 for _, a.b, c)");
    std::vector<double> one_way;
    TensorDict back = seed_isend_td(true);
    for (int i = 0; i < kTimedRounds; ++i) {
      const auto t0 = Clock::now();
      td.send({.dst = 0});
      back.recv({.src = 0});
      one_way.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 2);
    }
    check(rank, (back == td).all(), "the tree came back unchanged after " + std::to_string(kTimedRounds) + " round trips");
    std::printf("[rank %d]   one-way time per transfer of the 3-leaf tree: median %.2f us over %d round trips\n", rank,
                median_us(one_way), kTimedRounds);
  } else {
    TensorDict td = seed_isend_td(true);
    const void* before = td.get("c").data_ptr();
    Transfer works = td.irecv({.src = 1, .return_premature = true});
    check(rank, works.has_works && works.works.size() == 3, "irecv(src=1, return_premature=True) returned 3 works");
    works.wait();
    std::printf("[rank %d]   received:\n%s", rank, values(td).c_str());
    check(rank, (td != 0).all(), "(td != 0).all()");
    check(rank, td.get("_").eq(1).all().item<bool>(), "\"_\" holds the sender's ones");
    check(rank, td.get("c").data_ptr() == before, "leaves were received in place");
    for (int i = 0; i < kTimedRounds; ++i) {
      td.recv({.src = 1});
      td.send({.dst = 1});
    }
  }
  std::fflush(stdout);
}

/// Scenario 2.
void init_remote_scenario(int rank) {
  std::printf("[rank %d] scenario 2: TensorDictBase.init_remote / from_remote_init\n", rank);
  std::fflush(stdout);
  if (rank == 0) {
    TensorDict td({{{"a", "b"}, at::ones({2})},
                   {"c", at::ones({2})},
                   {{"d", "e", "f"}, MemoryMappedTensor::from_tensor(at::ones({2, 2})).tensor()}},
                  {2});
    td = td.expand({1, 2}).contiguous();
    const auto t0 = Clock::now();
    td.init_remote({.dst = 1});
    std::printf("[rank %d]   init_remote(dst=1) sent %d leaves in %.1f us\n", rank,
                static_cast<int>(td.sorted_leaf_keys().size()),
                std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  } else {
    const auto t0 = Clock::now();
    TensorDict got = TensorDict::from_remote_init({.src = 0});
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    std::printf("[rank %d]   from_remote_init(src=0) took %.1f us (waiting for the sender included); received:\n%s",
                rank, us, values(got).c_str());
    std::vector<std::string> top;
    for (const auto& k : got.keys()) top.push_back(k.front());
    check(rank, std::set<std::string>(top.begin(), top.end()) == std::set<std::string>{"a", "c", "d"},
          "set(keys) == {\"a\", \"c\", \"d\"}");
    check(rank, (got == 1).all(), "(td == 1).all()");
    check(rank, got.batch_size() == std::vector<int64_t>{1, 2}, "batch size [1, 2]");
    check(rank, got.is_consolidated(), "the result is consolidated");
  }
  std::fflush(stdout);
}

int run_rank(const std::string& backend, int rank, const std::string& init_method) {
  try {
    init_process_group(backend, {.rank = rank, .world_size = 2, .init_method = init_method,
                                 .timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kDeadline)});
    isend_scenario(rank);
    init_remote_scenario(rank);
    default_group().backend().barrier()->wait();  // neither rank tears the group down under the other
    destroy_process_group();
  } catch (const std::exception& e) {
    std::printf("[rank %d] error: %s\n", rank, e.what());
    ++failures;
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}


}  // namespace

void print_demo_usage(FILE* out) {
  std::fprintf(out,
               "usage: tdshm demo [--backend shm|gloo]\n"
               "Runs the two seed scenarios (isend/irecv, init_remote/from_remote_init) as two processes\n"
               "over the shm transport (default) or gloo on 127.0.0.1; exits non-zero if a check fails.\n");
}

int run_demo(int argc, char** argv) {
  std::string backend = "shm";
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--backend" && i + 1 < argc) {
      backend = argv[++i];
    } else if (a == "-h" || a == "--help") {
      print_demo_usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "tdshm demo: unknown argument '%s'\n", a.c_str());
      print_demo_usage(stderr);
      return 2;
    }
  }
  std::string init_method;
  if (backend == "shm") {
    init_method = "shm://tdshm-demo-" + std::to_string(::getpid());
  } else if (backend == "gloo") {
    const int port = detail::free_loopback_port();  // rank 0 serves the gloo store on it
    if (port < 0) {
      std::fprintf(stderr, "tdshm demo: no free TCP port on 127.0.0.1\n");
      return 1;
    }
    init_method = "tcp://127.0.0.1:" + std::to_string(port);
  } else {
    std::fprintf(stderr, "tdshm demo: --backend must be shm or gloo, not '%s'\n", backend.c_str());
    return 2;
  }
  std::printf("tdshm demo: two processes, backend %s (%s)\n", backend.c_str(), init_method.c_str());
  std::fflush(stdout);

  pid_t pids[2];
  for (int rank = 0; rank < 2; ++rank) {
    pids[rank] = ::fork();
    if (pids[rank] < 0) {
      std::perror("tdshm demo: fork");
      if (rank == 1) ::kill(pids[0], SIGKILL);
      return 1;
    }
    if (pids[rank] == 0) ::_exit(run_rank(backend, rank, init_method));
  }
  // Both ranks are reaped; once one has failed the other gets a short grace period, not the
  // whole deadline (it may be waiting for the failed one).
  int bad = 0;
  bool reaped[2] = {false, false};
  auto deadline = Clock::now() + kDeadline + std::chrono::seconds(10);
  while (!reaped[0] || !reaped[1]) {
    for (int rank = 0; rank < 2; ++rank) {
      int status = 0;
      if (reaped[rank] || ::waitpid(pids[rank], &status, WNOHANG) != pids[rank]) continue;
      reaped[rank] = true;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        ++bad;
        deadline = std::min(deadline, Clock::now() + std::chrono::seconds(3));
      }
    }
    if (Clock::now() > deadline) {
      for (int rank = 0; rank < 2; ++rank) {
        if (reaped[rank]) continue;
        std::fprintf(stderr, "tdshm demo: rank %d overran its deadline; killing it\n", rank);
        ::kill(pids[rank], SIGKILL);
        ::waitpid(pids[rank], nullptr, 0);
        reaped[rank] = true;
        ++bad;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::printf("\n%s\n", bad == 0 ? "demo passed" : "demo FAILED");
  return bad == 0 ? 0 : 1;
}

}  // namespace tdshm::tools
