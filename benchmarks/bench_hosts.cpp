// One "shm" world across two simulated hosts against a pure gloo world of the same ranks, in one
// run (docs/hosts.md, "Figures"): two hosts of three ranks (host A runs 0, 2, 4; host B 1, 3, 5),
// each a mount namespace with its own /dev/shm (sim_hosts.h), the store and gloo on 127.0.0.1.
//
//   tdshm_bench_hosts [--repeat R] [--iters N]
//
// Per world, rank 0 measures: 8 B one-way to rank 2 (same host) and to rank 1 (other host), 1 MiB
// one-way to rank 1 (p50 of round trip / 2, plain c10d send/recv, the two ranks pinned to two CPUs); all_reduce of 1 MiB float32
// over the six ranks (p50 of rank 0's wait); a loader: ranks 1-4 (two workers on each host) send
// batches {image uint8 [32, 3, 64, 64], label int64 [32]} to rank 0 (per leaf, from two loans
// written in place in turn, every byte of each batch written), which keeps a receive posted
// ahead per worker into its own buffers, takes the
// workers in turn and reads each batch's first and last byte: batches/s. The ranks a measurement
// does not involve sleep on a file store meanwhile. The worlds alternate, R times; the table
// gives medians with min-max and the ratio of the medians. Needs root (namespaces): exits 77
// otherwise.

#include "sim_hosts.h"

#include <tdshm/distributed.h>
#include <tdshm/tensordict.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

namespace {

using namespace tdshm;
using Clock = std::chrono::steady_clock;

constexpr int kWorld = 6;

double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

/// Pins this process to `cpu` (-1: every CPU of the machine).
void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  for (long c = 0; c < cpus; ++c) {
    if (cpu < 0 || c == cpu % cpus) CPU_SET(static_cast<int>(c), &set);
  }
  ::sched_setaffinity(0, sizeof set, &set);
}

/// One-way p50 (µs) of `iters` round trips of `bytes` between a and b (this rank is one of them).
double ping_pong(c10d::ProcessGroup& pg, int a, int b, int64_t bytes, int iters) {
  std::vector<at::Tensor> buf{at::zeros({bytes}, at::kByte)};
  std::vector<double> one_way;
  const int me = pg.getRank();
  for (int i = -20; i < iters; ++i) {  // 20 to warm up
    const auto t0 = Clock::now();
    if (me == a) {
      pg.send(buf, b, 0)->wait();
      pg.recv(buf, b, 0)->wait();
      if (i >= 0) one_way.push_back(micros(Clock::now() - t0) / 2);
    } else if (me == b) {
      pg.recv(buf, a, 0)->wait();
      pg.send(buf, a, 0)->wait();
    }
  }
  return one_way.empty() ? 0 : p50(one_way);
}

double all_reduce(c10d::ProcessGroup& pg, int iters) {
  std::vector<at::Tensor> t{at::ones({1 << 18}, at::kFloat)};  // 1 MiB
  std::vector<double> times;
  for (int i = -5; i < iters; ++i) {
    t[0].fill_(1);
    const auto t0 = Clock::now();
    pg.allreduce(t)->wait();
    if (i >= 0) times.push_back(micros(Clock::now() - t0));
  }
  return p50(times);
}

TensorDict batch(int64_t fill) {
  return TensorDict({{"image", at::full({32, 3, 64, 64}, fill % 251, at::kByte)}, {"label", at::full({32}, fill, at::kLong)}},
                    {32});
}

/// Batches per second that rank 0 receives from ranks 1-4, `per_worker` from each. Main keeps one
/// receive posted ahead per worker (two buffers each: irecv into one while it reads the other)
/// and takes the workers in turn.
double loader(int rank, int per_worker) {
  const std::vector<int> workers{1, 2, 3, 4};
  if (rank == 0) {
    std::vector<std::vector<TensorDict>> into(workers.size());
    std::vector<Transfer> pending(workers.size());
    for (size_t w = 0; w < workers.size(); ++w) {
      into[w] = {batch(0), batch(0)};
      pending[w] = into[w][0].irecv({.src = workers[w], .return_premature = true});
    }
    int64_t seen = 0;
    const auto t0 = Clock::now();
    for (int i = 0; i < per_worker; ++i) {
      for (size_t w = 0; w < workers.size(); ++w) {
        pending[w].wait();
        if (i + 1 < per_worker) {
          pending[w] = into[w][static_cast<size_t>((i + 1) % 2)].irecv({.src = workers[w], .return_premature = true});
        }
        const at::Tensor image = into[w][static_cast<size_t>(i % 2)].get("image");
        seen += image.data_ptr<uint8_t>()[0] + image.data_ptr<uint8_t>()[image.numel() - 1];
      }
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (seen < 0) std::abort();
    return per_worker * static_cast<double>(workers.size()) / seconds;
  }
  if (std::find(workers.begin(), workers.end(), rank) != workers.end()) {
    // Two loans, written in place while the other is on its way (docs/loans.md): a loan goes by
    // reference to a rank of this host, as bytes to another host, and is an ordinary tensor in a
    // gloo world. The same code runs in both worlds.
    TensorDict b[2] = {loan(batch(rank), {.dst = 0}), loan(batch(rank), {.dst = 0})};
    Transfer sent[2];
    for (int i = 0; i < per_worker; ++i) {
      const int k = i % 2;
      if (sent[k].has_works) sent[k].wait();  // the receiver is done with this one
      b[k].get("image").fill_((rank + i) % 251);  // every byte written for each batch
      sent[k] = b[k].isend({.dst = 0, .return_early = true});
    }
    for (const Transfer& t : sent) {
      if (t.has_works) t.wait();
    }
  }
  return 0;
}

struct Row {
  std::string name;
  std::string unit;
  bool higher_is_better = false;
};

const std::vector<Row> kRows = {
    {"8 B one-way, same host", "us"},          {"8 B one-way, between hosts", "us"},
    {"1 MiB one-way, between hosts", "us"},    {"all_reduce 1 MiB float32, world 6", "us"},
    {"loader, 2 workers per host -> rank 0", "batches/s", true},
};

/// One world of `backend` on the two hosts; rank 0 writes its figures (one per row) to `out`.
/// The ranks a measurement does not involve wait for it on a file store (asleep, as a rank busy
/// elsewhere would be, rather than spinning in the transport's waits beside the measured ones).
std::vector<std::string> run_world(const std::string& backend, const std::string& out, int iters) {
  const std::string method = "tcp://127.0.0.1:" + std::to_string(free_port());
  const std::string quiet_path = out + ".quiet";
  ::unlink(quiet_path.c_str());
  return sim::run_sim_hosts(
      {{sim::HostView::kOwnShm, {0, 2, 4}}, {sim::HostView::kOwnShm, {1, 3, 5}}},
      [&](int rank) {
        init_process_group(backend, {.rank = rank, .world_size = kWorld, .init_method = method,
                                     .timeout = std::chrono::seconds(60)});
        c10d::ProcessGroup& pg = default_group().backend();
        auto quiet = c10::make_intrusive<c10d::FileStore>(quiet_path, kWorld);
        int step = 0;
        // Runs `measure` on `ranks` while the others sleep until rank 0 is done.
        auto only = [&](const std::vector<int>& ranks, auto&& measure) {
          const std::string key = "done" + std::to_string(step++);
          double x = 0;
          if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) x = measure();
          if (rank == 0) quiet->set(key, {1});
          quiet->wait({key}, std::chrono::seconds(300));
          return x;
        };
        std::vector<double> figures;
        // The ping-pongs run pinned, one rank per CPU (as tdshm bench's): on one CPU every hand-off
        // would be a context switch, whichever transport carries it.
        pin(rank == 0 ? 0 : rank == 1 || rank == 2 ? 1 : -1);
        figures.push_back(only({0, 2}, [&] { return ping_pong(pg, 0, 2, 8, iters); }));
        figures.push_back(only({0, 1}, [&] { return ping_pong(pg, 0, 1, 8, iters); }));
        figures.push_back(only({0, 1}, [&] { return ping_pong(pg, 0, 1, 1 << 20, std::max(20, iters / 20)); }));
        pin(-1);
        figures.push_back(only({0, 1, 2, 3, 4, 5}, [&] { return all_reduce(pg, std::max(20, iters / 20)); }));
        figures.push_back(only({0, 1, 2, 3, 4}, [&] { return loader(rank, std::max(50, iters / 10)); }));
        pg.barrier()->wait();
        destroy_process_group();
        if (rank == 0) {
          std::ofstream f(out);
          for (double x : figures) f << x << "\n";
        }
      },
      std::chrono::seconds(600));
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 3;
  int iters = 1000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--repeat") repeat = std::atoi(argv[i + 1]);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--repeat R] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  if (const auto why = sim::sim_hosts_unavailable()) {
    std::fprintf(stderr, "tdshm_bench_hosts: %s\n", why->c_str());
    return 77;
  }
  const std::string out = "/tmp/tdshm_bench_hosts." + std::to_string(::getpid());
  std::map<std::string, std::vector<std::vector<double>>> figures;  // backend -> run -> row
  for (int r = 0; r < repeat; ++r) {
    for (const std::string backend : {"shm", "gloo"}) {
      const std::vector<std::string> failures = run_world(backend, out, iters);
      for (const std::string& f : failures) std::fprintf(stderr, "%s world: %s\n", backend.c_str(), f.c_str());
      if (!failures.empty()) return 1;
      std::ifstream f(out);
      std::vector<double> row;
      for (double x; f >> x;) row.push_back(x);
      ::unlink(out.c_str());
      if (row.size() != kRows.size()) {
        std::fprintf(stderr, "%s world: rank 0 wrote %zu figures\n", backend.c_str(), row.size());
        return 1;
      }
      figures[backend].push_back(row);
    }
  }
  std::printf("two simulated hosts x 3 ranks, %d runs of each world alternating; medians (min-max)\n", repeat);
  std::printf("%-40s %-26s %-26s %s\n", "figure", "shm across hosts", "pure gloo world", "shm vs gloo");
  for (size_t i = 0; i < kRows.size(); ++i) {
    auto column = [&](const std::string& backend) {
      std::vector<double> v;
      for (const auto& run : figures[backend]) v.push_back(run[i]);
      std::sort(v.begin(), v.end());
      return v;
    };
    const std::vector<double> s = column("shm");
    const std::vector<double> g = column("gloo");
    const double sm = s[s.size() / 2], gm = g[g.size() / 2];
    char a[64], b[64];
    std::snprintf(a, sizeof a, "%.2f (%.2f-%.2f) %s", sm, s.front(), s.back(), kRows[i].unit.c_str());
    std::snprintf(b, sizeof b, "%.2f (%.2f-%.2f)", gm, g.front(), g.back());
    const double ratio = kRows[i].higher_is_better ? sm / gm : gm / sm;
    std::printf("%-40s %-26s %-26s %.2fx %s\n", kRows[i].name.c_str(), a, b, ratio,
                kRows[i].higher_is_better ? "(shm/gloo)" : "(gloo time / shm time)");
  }
  return 0;
}
