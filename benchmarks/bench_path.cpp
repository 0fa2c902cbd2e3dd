// The cost of tdshm's per-message software path, without the wire's waiting: two ranks of one
// ProcessGroupShm world live in this process and one thread drives both. Rank 0 sends a message
// to rank 1, which receives it, then rank 1 sends it back. Every instruction counted is the path
// itself: c10d's calls and Work objects, the engine's lock, the channel's posting, matching,
// entry checks and copies, the wake-up words. No spinning, no cache line moving between CPUs:
// the figure is the same in a fast and a slow minute. Two orders, two paths:
//  * default: each receive is posted once its message is already in the ring (it lands as it is
//    posted: a loader's main rank, a stream of messages that runs ahead of its receives);
//  * --posted-first: each receive is posted before its message is sent, and its wait finds the
//    message (a ping-pong's receiver: the matcher, the op and a progress pass under the lock).
// With --seed-tree the message is the seed tree (3 leaves, 72 B) moved per-leaf with
// TensorDict::send and TensorDict::recv (default order): the transfer layer's path as well.
// With --loan each message is a loan of its sender (ProcessGroupShm::loan) received as a view
// (recv_view), whose receiver reads its bytes and drops it; the send completes when the ticket
// comes back (a data loader's batches, an actor's weights by reference).
//
//   build/benchmarks/tdshm_bench_path [--bytes N] [--iters N] [--posted-first | --seed-tree | --loan] [--instructions]
//
// It prints ns per message (one send and its receive; with --seed-tree, per tree). With --instructions it runs itself
// twice under valgrind's callgrind (--iters N and 2N) and prints the instructions per message from the difference,
// counting only the measured loop (the rendezvous and the process's start are left out); hardware counters are not
// needed (this VM has none).

#include <tdshm/distributed.h>
#include <tdshm/process_group.h>

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int64_t bytes = 8;
  int iters = 100000;
  bool instructions = false;
  bool posted_first = false;
  bool seed_tree = false;
  bool loan = false;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr,
               "tdshm_bench_path: %s\nusage: tdshm_bench_path [--bytes N] [--iters N] [--posted-first | --seed-tree | "
               "--loan] [--instructions]\n",
               what.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> long long {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      char* end = nullptr;
      const long long v = std::strtoll(argv[++i], &end, 10);
      if (*end != '\0') usage_error("bad option " + a + " " + argv[i]);
      return v;
    };
    if (a == "--bytes") {
      o.bytes = value();
      if (o.bytes < 1 || o.bytes > (int64_t{1} << 16)) usage_error("--bytes must be in [1, 65536]");
    } else if (a == "--iters") {
      const long long v = value();
      if (v < 1 || v > 100000000) usage_error("--iters must be in [1, 100000000]");
      o.iters = static_cast<int>(v);
    } else if (a == "--instructions") {
      o.instructions = true;
    } else if (a == "--posted-first") {
      o.posted_first = true;
    } else if (a == "--seed-tree") {
      o.seed_tree = true;
    } else if (a == "--loan") {
      o.loan = true;
    } else {
      usage_error("bad option " + a);
    }
  }
  if (int{o.posted_first} + int{o.seed_tree} + int{o.loan} > 1)
    usage_error("--posted-first, --seed-tree and --loan are apart");
  return o;
}

/// The seed tree (tdshm bench --td's "seed"): 3 float leaves, 72 B, batch size [2].
tdshm::TensorDict seed_tree(float fill) {
  return tdshm::TensorDict(
      {{{"a", "b"}, at::full({2}, fill)}, {"c", at::full({2, 3}, fill)}, {"_", at::full({2, 1, 5}, fill)}}, {2});
}

/// Two ranks of one world in this process, and what they send each other.
struct Rig {
  std::array<c10::intrusive_ptr<tdshm::ProcessGroupShm>, 2> pg;
  std::array<tdshm::Group, 2> group;
  std::vector<at::Tensor> out, in, back;
  tdshm::TensorDict tree_out, tree_in, tree_back;
  std::array<std::vector<at::Tensor>, 2> lent;  // --loan: each rank's loan
};

/// --loan: `from` sends its loan to `to`, which receives it as a view, copies its bytes into
/// `into` (its own loan, or the check buffer) and drops the view; then the send completes.
void lend_once(Rig& r, int from, int to, const at::Tensor& into) {
  auto sent = r.pg[static_cast<size_t>(from)]->send(r.lent[static_cast<size_t>(from)], to, 0);
  {
    const at::Tensor view = r.pg[static_cast<size_t>(to)]->recv_view(from, 0);
    std::memcpy(into.data_ptr(), view.data_ptr(), static_cast<size_t>(view.numel()));
  }  // (the view's last reference: its ticket goes back)
  sent->wait();
}

/// The measured loop, alone in a function that is never inlined: --instructions counts only
/// what runs inside it (callgrind's --toggle-collect), not the process's start, whose library
/// initialisation (a timer calibration loop among others) varies by thousands of instructions
/// from run to run.
[[gnu::noinline]] void measured_round_trips(Rig& r, const Options& o) {
  auto& pg = r.pg;
  for (int i = 0; i < o.iters; ++i) {
    if (o.loan) {
      lend_once(r, 0, 1, r.lent[1][0]);
      lend_once(r, 1, 0, r.back[0]);
    } else if (o.seed_tree) {
      r.tree_out.send({.dst = 1, .group = r.group[0]});
      r.tree_in.recv({.src = 0, .group = r.group[1]});
      r.tree_in.send({.dst = 0, .group = r.group[1]});
      r.tree_back.recv({.src = 1, .group = r.group[0]});
    } else if (o.posted_first) {
      auto there = pg[1]->recv(r.in, 0, 0);
      pg[0]->send(r.out, 1, 0);
      there->wait();
      auto back_again = pg[0]->recv(r.back, 1, 0);
      pg[1]->send(r.in, 0, 0);
      back_again->wait();
    } else {
      pg[0]->send(r.out, 1, 0);
      pg[1]->recv(r.in, 0, 0)->wait();
      pg[1]->send(r.in, 0, 0);
      pg[0]->recv(r.back, 1, 0)->wait();
    }
  }
}

/// Runs the ping-pong for `iters` round trips; returns seconds. Checks the last message's bytes.
double run(const Options& o) {
  const std::string name = "bench-path-" + std::to_string(::getpid());
  tdshm::ShmOptions so;
  so.timeout = std::chrono::seconds(60);
  Rig r;
  {  // the constructors meet in a rendezvous: one thread each
    std::thread other([&] { r.pg[1] = c10::make_intrusive<tdshm::ProcessGroupShm>(name, 1, 2, so); });
    r.pg[0] = c10::make_intrusive<tdshm::ProcessGroupShm>(name, 0, 2, so);
    other.join();
  }
  r.group = {tdshm::Group(r.pg[0], {0, 1}), tdshm::Group(r.pg[1], {0, 1})};
  r.out = {at::arange(o.bytes, at::kByte)};
  r.in = {at::zeros({o.bytes}, at::kByte)};
  r.back = {at::zeros({o.bytes}, at::kByte)};
  r.tree_out = seed_tree(1.5f);
  r.tree_in = seed_tree(0.0f);
  r.tree_back = seed_tree(0.0f);
  if (o.loan) {
    for (size_t k = 0; k < 2; ++k) r.lent[k] = {r.pg[k]->loan({o.bytes}, at::kByte)};
    r.lent[0][0].copy_(r.out[0]);
  }
  const auto start = Clock::now();
  measured_round_trips(r, o);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (o.seed_tree ? !(r.tree_back == r.tree_out).all() : !at::equal(r.back[0], r.out[0])) {
    throw std::runtime_error("the message came back with other bytes");
  }
  r.pg[1].reset();
  r.pg[0].reset();
  return seconds;
}

/// Instructions of `self --bytes B --iters N` under callgrind ("Collected : X" on its stderr).
long long callgrind_instructions(const std::string& self, const Options& o, int iters) {
  const std::string cmd =
      "valgrind --tool=callgrind --callgrind-out-file=/dev/null --collect-atstart=no "
      "'--toggle-collect=*measured_round_trips*' '" +
      self + "' --bytes " + std::to_string(o.bytes) + " --iters " + std::to_string(iters) +
      (o.posted_first ? " --posted-first" : "") + (o.seed_tree ? " --seed-tree" : "") + (o.loan ? " --loan" : "") +
      " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot run valgrind");
  std::string output;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p) != nullptr) output += buf;
  const int status = ::pclose(p);
  const size_t at = output.find("Collected : ");
  if (status != 0 || at == std::string::npos) {
    throw std::runtime_error("valgrind --tool=callgrind failed (is valgrind installed?):\n" + output);
  }
  return std::atoll(output.c_str() + at + 12);
}

const char* mode_name(const Options& o) {
  return o.posted_first ? ", posted first" : o.loan ? ", a loan as a view" : "";
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    if (o.instructions) {
      char self[4096];
      const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
      if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
      self[n] = '\0';
      const int iters = std::min(o.iters, 2000);  // callgrind runs ~50x slower
      const long long one = callgrind_instructions(self, o, iters);
      const long long two = callgrind_instructions(self, o, 2 * iters);
      const double per_message = static_cast<double>(two - one) / (2.0 * iters);
      if (o.seed_tree) {
        std::printf(
            "seed tree (3 leaves, per-leaf): %.0f instructions per tree (send + receive, both ranks; callgrind, "
            "%d vs %d round trips)\n",
            per_message, iters, 2 * iters);
      } else {
        std::printf(
            "%lld B%s: %.0f instructions per message (send + receive, both ranks; callgrind, %d vs %d round trips)\n",
            static_cast<long long>(o.bytes), mode_name(o), per_message, iters, 2 * iters);
      }
      return 0;
    }
    const double seconds = run(o);
    if (o.seed_tree) {
      std::printf(
          "seed tree (3 leaves, per-leaf): %.1f ns per tree (send + receive, one thread drives both ranks, %d round "
          "trips)\n",
          seconds * 1e9 / (2.0 * o.iters), o.iters);
    } else {
      std::printf("%lld B%s: %.1f ns per message (send + receive, one thread drives both ranks, %d round trips)\n",
                  static_cast<long long>(o.bytes), mode_name(o), seconds * 1e9 / (2.0 * o.iters), o.iters);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdshm_bench_path: %s\n", e.what());
    return 1;
  }
}
